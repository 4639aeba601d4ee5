"""Benchmark drafters against plain decoding on the same runner, prompt by prompt, interleaved.

For each prompt and turn every method runs back to back (plain decoding first), so machine noise
hits all of them alike. Turn 2 of a multi-turn prompt follows the plain decode's own turn-1
answer for every method, which keeps their inputs identical. Optional Hugging Face ``generate``
baselines (plain, prompt lookup, assisted) run in the same loop; their target passes are
counted with a forward hook.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import Prompt
from draftsmith.errors import UsageError
from draftsmith.eval.decode import Generation, SpeculativeDecoder, eos_token_ids
from draftsmith.eval.drafters.base import Drafter
from draftsmith.eval.sampling import SamplingConfig
from draftsmith.timing import clock

BASELINE = "baseline"
HF_BASELINES = ("hf_plain", "hf_prompt_lookup", "hf_assisted")


@dataclass
class Run:
    """One method on one prompt turn."""

    method: str
    prompt_id: str
    category: str
    turn: int
    new_tokens: int
    steps: int  # target passes after prefill
    seconds: float  # prefill + decode wall-clock
    accepted: list[int] = field(default_factory=list)  # tokens per step (empty for HF baselines)
    # Greedy only: whether the output equals plain decoding's and how many leading tokens agree (a
    # lossless method matches up to floating-point near-ties; a tuned verifier, Medusa-2's, may drift).
    same_output: bool | None = None
    common_prefix: int | None = None


def _hf_generate(model, tokenizer, prompt, max_new_tokens, sampling, eos, seed, **kwargs) -> tuple[list[int], int, float]:
    calls = 0

    def count(*_):
        nonlocal calls
        calls += 1

    handle = model.register_forward_hook(count)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    gen = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        start = clock(device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id, **gen, **kwargs)
        seconds = clock(device) - start
    finally:
        handle.remove()
    return out[0, len(prompt):].tolist(), calls - 1, seconds


def run_bench(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafters: list[Drafter],
    prompts: list[Prompt],
    max_new_tokens: int = 256,
    sampling: SamplingConfig = SamplingConfig(),
    turns: int = 1,
    hf_baselines: tuple[str, ...] = (),
    assistants: dict[str, tuple[PreTrainedModel, int]] | None = None,
    seed: int = 0,
    warmup: bool = True,
) -> list[Run]:
    """Run the baseline, every drafter and the requested HF baselines on every prompt turn.

    ``assistants``: draft LMs for ``hf_assisted`` as ``{name: (model, draft length)}``; HF drafts a
    constant number of tokens per step with each (its adaptive schedule would compare a different
    policy), one row per assistant (``hf_assisted`` alone, ``hf_assisted:NAME`` for several).
    """
    eos = eos_token_ids(target, tokenizer)
    decoders = {BASELINE: SpeculativeDecoder(target, None, tokenizer, sampling, eos)}
    for drafter in drafters:
        if drafter.name in decoders or drafter.name in HF_BASELINES:
            raise UsageError(f"two methods are named {drafter.name!r}; give one a name= option")
        # A drafter trained jointly with a tuned target (Medusa-2: the target plus a LoRA adapter,
        # on only while it decodes) is verified by it; plain decoding stays the baseline.
        verifier = drafter.verifier or target
        decoders[drafter.name] = SpeculativeDecoder(verifier, drafter, tokenizer, sampling, eos)
    hf_kwargs = {name: kwargs for name, kwargs in (("hf_plain", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10}))
                 if name in hf_baselines}
    if "hf_assisted" in hf_baselines:
        if not assistants:
            raise UsageError("--hf-baseline hf_assisted needs an assistant (a draft_lm drafter)")
        for name, (model, length) in assistants.items():
            model.generation_config.num_assistant_tokens = length
            model.generation_config.num_assistant_tokens_schedule = "constant"
            hf_kwargs["hf_assisted" if len(assistants) == 1 else f"hf_assisted:{name}"] = {"assistant_model": model}
    if warmup:  # first calls pay one-off allocation and kernel selection costs
        warm = render_prompt(tokenizer, [{"role": "user", "content": "Hello!"}])
        for decoder in decoders.values():
            decoder.generate(warm, 8, seed=seed)
    runs: list[Run] = []
    total = len(prompts) * turns * (len(decoders) + len(hf_kwargs))
    with tqdm(total=total, desc="bench", unit="gen") as bar:
        for index, prompt in enumerate(prompts):
            history: list[dict] = []
            for turn, text in enumerate(prompt.turns[:turns], start=1):
                history.append({"role": "user", "content": text})
                ids = render_prompt(tokenizer, history)
                reference: Generation | None = None
                for name, decoder in decoders.items():
                    bar.set_postfix_str(f"{prompt.id}/{turn} {name}")
                    gen = decoder.generate(ids, max_new_tokens, seed=seed + index)
                    reference = reference or gen
                    runs.append(Run(name, prompt.id, prompt.category, turn, len(gen.tokens), gen.steps,
                                    gen.seconds, gen.accepted, *_agreement(gen.tokens, reference.tokens, sampling.greedy)))
                    bar.update()
                for name, kwargs in hf_kwargs.items():
                    bar.set_postfix_str(f"{prompt.id}/{turn} {name}")
                    tokens, steps, seconds = _hf_generate(target, tokenizer, ids, max_new_tokens, sampling,
                                                          eos, seed + index, **kwargs)
                    runs.append(Run(name, prompt.id, prompt.category, turn, len(tokens), steps, seconds,
                                    [], *_agreement(tokens, reference.tokens, sampling.greedy)))
                    bar.update()
                answer = [t for t in reference.tokens if t not in eos]
                history.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return runs


def _agreement(tokens: list[int], reference: list[int], greedy: bool) -> tuple[bool | None, int | None]:
    """(same output, common prefix length) against plain decoding's tokens; (None, None) when sampling."""
    if not greedy:  # sampled outputs differ by design
        return None, None
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return list(tokens) == list(reference), prefix


def runs_to_dicts(runs: list[Run]) -> list[dict]:
    return [asdict(r) for r in runs]
