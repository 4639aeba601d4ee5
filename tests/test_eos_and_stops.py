"""Stopping: EOS inside an accepted path, stop strings, the streamer and max_new_tokens.

Speculative decoding must stop exactly where plain decoding stops, even when the stop falls in
the middle of a multi-token step, and must not hand the streamer tokens that are later cut.
"""

from __future__ import annotations

import pytest

from draftsmith.data_prep.chat import render_prompt
from draftsmith.eval.engine.decode import SpeculativeDecoder, autoregressive_greedy
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.oracle import OracleDrafter
from draftsmith.eval.engine.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import TokenTree, chain

PROMPT = [3, 17, 42, 8, 25, 11, 60, 5]
STEP = 9  # the oracle below drafts 8 tokens, so a fully accepted step yields 9


class OvershootDrafter(Drafter):
    """Replays the greedy continuation but ignores ``context.max_tokens`` (a careless drafter)."""

    name = "overshoot"

    def __init__(self, reference: list[int], num_tokens: int = 8):
        self.reference, self.num_tokens = reference, num_tokens

    def propose(self, context: DraftContext) -> TokenTree:
        n = len(context.tokens)
        return chain(self.reference[n : n + self.num_tokens])


class Chunks:
    """A streamer that records what it was given."""

    def __init__(self):
        self.chunks: list[list[int]] = []

    def __call__(self, tokens: list[int]) -> None:
        self.chunks.append(list(tokens))

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=21, scale=20.0)
    continuation = autoregressive_greedy(CausalLMRunner(model), PROMPT, 60)
    return model, continuation


def first_occurrences(tokens: list[int]) -> list[int]:
    return [j for j, t in enumerate(tokens) if t not in tokens[:j]]


def mid_step_eos_index(continuation: list[int]) -> int:
    """A position whose token occurs there first and lies strictly inside a full oracle step
    (new token i is at offset (i - 1) % 9 of its step): not its first token and followed by at
    least two more accepted tokens of that step, which the EOS must cut."""
    for j in first_occurrences(continuation):
        if j >= 10 and 1 <= (j - 1) % STEP <= STEP - 3:
            return j
    raise AssertionError(f"no usable EOS position in {continuation}")


def drafters_for(model, continuation):
    return {
        "oracle": OracleDrafter(CausalLMRunner(model), num_tokens=8),
        "draft_lm_self": DraftLMDrafter(model, depth=8),  # same weights: accepts everything
        "overshoot": OvershootDrafter(list(PROMPT) + continuation),
    }


def test_eos_inside_accepted_path_stops_at_it(tiny):
    model, continuation = tiny
    j = mid_step_eos_index(continuation)
    eos = continuation[j]
    expected = continuation[: j + 1]
    plain = SpeculativeDecoder(model, None, eos_ids={eos}).generate(PROMPT, 60)
    assert plain.tokens == expected and plain.stop_reason == "eos"
    for name, drafter in drafters_for(model, continuation).items():
        streamer = Chunks()
        gen = SpeculativeDecoder(model, drafter, eos_ids={eos}).generate(PROMPT, 60, streamer=streamer)
        assert gen.tokens == expected, name
        assert gen.stop_reason == "eos", name
        assert gen.tokens[-1] == eos and eos not in gen.tokens[:-1]
        # The EOS step was cut: it would have yielded a full 9 tokens.
        assert gen.accepted[:-1] == [STEP] * (len(gen.accepted) - 1), name
        assert 1 <= gen.accepted[-1] <= STEP - 2, name
        assert sum(gen.accepted) == len(expected) - 1
        # The streamer saw exactly the final tokens, in order, one chunk per step.
        assert streamer.tokens == expected, name
        assert [len(c) for c in streamer.chunks] == [1] + gen.accepted, name


def test_eos_as_the_very_first_token(tiny):
    model, continuation = tiny
    for drafter in [None, *drafters_for(model, continuation).values()]:
        streamer = Chunks()
        gen = SpeculativeDecoder(model, drafter, eos_ids={continuation[0]}).generate(PROMPT, 60, streamer=streamer)
        assert gen.tokens == continuation[:1] and gen.stop_reason == "eos"
        assert gen.steps == 0 and gen.accepted == [] and streamer.chunks == [continuation[:1]]


def test_eos_as_the_bonus_token(tiny):
    """EOS as the target's own token after a fully accepted draft ends the step normally."""
    model, continuation = tiny
    j = next(j for j in first_occurrences(continuation) if j >= 10 and (j - 1) % STEP == STEP - 1)
    gen = SpeculativeDecoder(model, drafters_for(model, continuation)["oracle"], eos_ids={continuation[j]}).generate(
        PROMPT, 60
    )
    assert gen.tokens == continuation[: j + 1] and gen.stop_reason == "eos"
    assert gen.accepted == [STEP] * gen.steps


@pytest.mark.parametrize("max_new", [1, 2, 5, 9, 10, 13, 30])
def test_max_new_tokens_is_respected(tiny, max_new):
    model, continuation = tiny
    for name, drafter in drafters_for(model, continuation).items():
        streamer = Chunks()
        gen = SpeculativeDecoder(model, drafter, eos_ids=set()).generate(PROMPT, max_new, streamer=streamer)
        assert gen.tokens == continuation[:max_new], name
        assert gen.stop_reason == "length", name
        assert sum(gen.accepted) == max_new - 1 and streamer.tokens == gen.tokens, name


def test_eos_just_past_the_limit_is_not_reached(tiny):
    """An overshooting step that contains an EOS beyond max_new_tokens: the output is cut at the
    limit and never saw the EOS, so the reason is "length", exactly as in plain decoding."""
    model, continuation = tiny
    j = mid_step_eos_index(continuation)
    eos = continuation[j]
    plain = SpeculativeDecoder(model, None, eos_ids={eos}).generate(PROMPT, j)
    assert plain.tokens == continuation[:j] and plain.stop_reason == "length"
    for name, drafter in drafters_for(model, continuation).items():
        streamer = Chunks()
        gen = SpeculativeDecoder(model, drafter, eos_ids={eos}).generate(PROMPT, j, streamer=streamer)
        assert gen.tokens == continuation[:j], name
        assert gen.stop_reason == "length", name
        assert streamer.tokens == gen.tokens, name


# ---------------------------------------------------------------------------------------------
# Stop strings need a tokenizer: the bundled SmolLM2 and its own greedy text.


@pytest.fixture(scope="module")
def story(smollm2):
    model, tokenizer = smollm2
    message = {"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}
    prompt = render_prompt(tokenizer, [message])
    continuation = autoregressive_greedy(CausalLMRunner(model), prompt, 40)
    assert 2 not in continuation  # no EOS in the first 40 tokens
    return model, tokenizer, prompt, continuation


def stop_string_ending_at(tokenizer, continuation: list[int], k: int) -> str | None:
    """A stop string that first completes with token ``k`` and spans a token boundary."""
    before = tokenizer.decode(continuation[:k])
    text = tokenizer.decode(continuation[: k + 1])
    last = tokenizer.decode(continuation[k : k + 1])
    if not text.startswith(before) or len(last.strip()) < 2:
        return None
    stop = text[-(len(last) + 2) :]  # the last token's text and two characters before it
    return None if stop in before else stop


@pytest.mark.slow
def test_stop_string_mid_step_and_before_eos(story):
    model, tokenizer, prompt, continuation = story
    # k: the stop string completes at token k, inside an oracle step; token k + 1 (same step)
    # is made an EOS, which must not win over the earlier stop string.
    k, stop = next(
        (k, stop)
        for k in range(8, 35)
        if k % STEP != 0
        and continuation[k + 1] not in continuation[: k + 1]
        and (stop := stop_string_ending_at(tokenizer, continuation, k))
    )
    expected = continuation[: k + 1]
    eos = {continuation[k + 1]}
    plain = SpeculativeDecoder(model, None, tokenizer, eos_ids=eos).generate(prompt, 40, stop_strings=(stop,))
    assert plain.tokens == expected and plain.stop_reason == "stop_string"
    assert stop in tokenizer.decode(plain.tokens) and stop not in tokenizer.decode(plain.tokens[:-1])
    drafters = {
        "oracle": OracleDrafter(CausalLMRunner(model), num_tokens=8),
        "overshoot": OvershootDrafter(list(prompt) + continuation),
        "prompt_lookup": PromptLookupDrafter(),
    }
    for name, drafter in drafters.items():
        for eos_ids in (set(), eos):
            streamer = Chunks()
            decoder = SpeculativeDecoder(model, drafter, tokenizer, eos_ids=eos_ids)
            gen = decoder.generate(prompt, 40, stop_strings=("never appears", stop), streamer=streamer)
            assert gen.tokens == expected, (name, eos_ids)
            assert gen.stop_reason == "stop_string", (name, eos_ids)
            assert streamer.tokens == expected and sum(gen.accepted) == len(expected) - 1
        if name == "oracle":
            assert gen.accepted[-1] < STEP  # the stop really fell inside a multi-token step


def test_windowed_stop_check_matches_decoding_everything():
    """The stop-string check decodes a short window per candidate end; it must find the same end
    as decoding the whole text, also for multi-byte characters split across byte-level tokens."""
    from draftsmith.eval.engine.stopping import StopChecker
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer()
    ids = tokenizer.encode("Voilà: naïve café — 漢字 and emoji 🤖🚀 then\n\nDone. STOP here; ünïcödé 🤖 end")
    for stop in ("🤖", "\n\n", "STOP", "é —", "字 and", "🚀 th"):
        expected = next(end for end in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:end]))
        for step in (1, 3):  # tokens added per decoding step
            checker, cut, scanned = StopChecker(set(), (stop,), tokenizer), None, 0
            while cut is None and scanned < len(ids):
                upto = min(len(ids), scanned + step)
                cut, reason = checker.check(ids[:upto], 0, scanned)
                scanned = upto
            assert (cut, reason) == (expected, "stop_string"), (stop, step)
