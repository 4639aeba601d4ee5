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
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import Generation, SpeculativeDecoder
from draftsmith.eval.engine.drafters.base import Drafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.target import eos_token_ids
from draftsmith.timing import clock

BASELINE = "baseline"
HF_BASELINES = ("hf_plain", "hf_prompt_lookup", "hf_assisted", "hf_assisted_dynamic")
# What the assistant's generation config says for each assisted baseline. Constant: exactly the
# drafter's depth every step (a confidence threshold of 0 switches off HF's early stop). Dynamic:
# transformers' own defaults (up to 20 tokens, stopping when the assistant's confidence drops below
# a threshold that it re-fits after every step from the assistant's probabilities and the target's
# matches; the re-fit needs scikit-learn).
ASSISTED = {
    "hf_assisted": lambda length: {
        "num_assistant_tokens": length,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    },
    "hf_assisted_dynamic": lambda length: {
        "num_assistant_tokens": None,
        "num_assistant_tokens_schedule": None,
        "assistant_confidence_threshold": None,
    },
}


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
    drafted: list[int] = field(default_factory=list)  # tree nodes verified per step (0: no draft)
    draft_seconds: float | None = None  # drafting time, when timed for the cost model


def _hf_generate(
    model, tokenizer, prompt, max_new_tokens, sampling, eos, seed, **kwargs
) -> tuple[list[int], int, float]:
    calls = 0

    def count(*_):
        nonlocal calls
        calls += 1

    handle = model.register_forward_hook(count)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    gen = (
        dict(do_sample=False)
        if sampling.greedy
        else dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    )
    if seed is not None:
        torch.manual_seed(seed)
    try:
        start = clock(device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=tokenizer.pad_token_id,
            **gen,
            **kwargs,
        )
        seconds = clock(device) - start
    finally:
        handle.remove()
    # Plain generate prefills in a call of its own; assisted generation and prompt lookup draft
    # from the prompt first, so their first target call is prefill and verification at once.
    speculative = "assistant_model" in kwargs or "prompt_lookup_num_tokens" in kwargs
    return out[0, len(prompt) :].tolist(), calls if speculative else calls - 1, seconds


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
    time_drafting: bool = False,
    capture: TrafficStore | None = None,
    max_seconds: float | None = None,
    cuda_graphs: str | None = None,
) -> list[Run]:
    """Run the baseline, every drafter and the requested HF baselines on every prompt turn.

    ``assistants``: draft LMs for ``hf_assisted`` (a constant draft length, the drafter's depth)
    and ``hf_assisted_dynamic`` (HF's dynamic draft length) as ``{name: (model, draft length)}``,
    one row per assistant (``hf_assisted`` alone, ``hf_assisted:NAME`` for several).
    ``time_drafting``: record each generation's drafting time (for the cost model). ``capture``: the
    generations of the first drafter that reads the store's layers (the served head; verified by the
    target itself) go into this traffic store with the target's states and what it drafted at each
    token (accepted or rejected: ``adapt.rejected_weight``); without one, plain decoding's (no draft record);
    the caller closes the store.
    ``max_seconds``: start no prompt that, at the mean time of the prompts so far, would end past
    this much wall-clock time (each prompt runs every method, so the prompts run are compared
    alike); the prompts that ran are those in the returned runs.
    ``cuda_graphs``: every decoder's (:class:`~draftsmith.eval.engine.decode.SpeculativeDecoder`;
    None: the process's default).
    """
    eos = eos_token_ids(target, tokenizer)
    served = BASELINE
    if capture is not None and capture.layers:
        served = next(
            (d.name for d in drafters if d.verifier is None and list(d.feature_layers or []) == capture.layers),
            BASELINE,
        )
    decoders = {
        BASELINE: SpeculativeDecoder(
            target,
            None,
            tokenizer,
            sampling,
            eos,
            capture=capture if served == BASELINE else None,
            cuda_graphs=cuda_graphs,
        )
    }
    for drafter in drafters:
        if drafter.name in decoders or drafter.name in HF_BASELINES:
            raise UsageError(f"two methods are named {drafter.name!r}; give one a name= option")
        # A drafter trained jointly with a tuned target (Medusa-2: the target plus a LoRA adapter,
        # on only while it decodes) is verified by it; plain decoding stays the baseline.
        verifier = drafter.verifier or target
        decoders[drafter.name] = SpeculativeDecoder(
            verifier,
            drafter,
            tokenizer,
            sampling,
            eos,
            time_drafting,
            capture if drafter.name == served else None,
            cuda_graphs,
        )
    hf_kwargs = {
        name: kwargs
        for name, kwargs in (("hf_plain", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10}))
        if name in hf_baselines
    }
    assistant_config = {}  # method -> (assistant model, its generation config for that method)
    for baseline in (b for b in ASSISTED if b in hf_baselines):
        if not assistants:
            raise UsageError(f"--hf-baseline {baseline} needs an assistant (a draft_lm drafter)")
        for name, (model, length) in assistants.items():
            method = baseline if len(assistants) == 1 else f"{baseline}:{name}"
            hf_kwargs[method] = {"assistant_model": model}
            assistant_config[method] = (model, ASSISTED[baseline](length))
    if warmup:  # first calls pay one-off allocation and kernel selection costs
        warm = render_prompt(tokenizer, [{"role": "user", "content": "Hello!"}])
        for decoder in decoders.values():
            held, decoder.capture = decoder.capture, None  # a warm-up is not traffic
            decoder.generate(warm, 8, seed=seed)
            decoder.capture_buckets()  # with CUDA graphs: every tree size captured before timing
            decoder.capture = held
    runs: list[Run] = []
    total = len(prompts) * turns * (len(decoders) + len(hf_kwargs))
    device = next(target.parameters()).device
    started = clock(device)
    with tqdm(total=total, desc="bench", unit="gen") as bar:
        for index, prompt in enumerate(prompts):
            spent = clock(device) - started
            # A prompt starts only where one more of the mean length so far still fits the budget.
            if max_seconds is not None and index and spent * (index + 1) / index > max_seconds:
                tqdm.write(f"time budget of {max_seconds:.0f} s spent: {index} of {len(prompts)} prompts run")
                break
            history: list[dict] = []
            for turn, text in enumerate(prompt.turns[:turns], start=1):
                history.append({"role": "user", "content": text})
                ids = render_prompt(tokenizer, history)
                reference: Generation | None = None
                for name, decoder in decoders.items():
                    bar.set_postfix_str(f"{prompt.id}/{turn} {name}")
                    gen = decoder.generate(ids, max_new_tokens, seed=seed + index)
                    reference = reference or gen
                    runs.append(
                        Run(
                            name,
                            prompt.id,
                            prompt.category,
                            turn,
                            len(gen.tokens),
                            gen.steps,
                            gen.seconds,
                            gen.accepted,
                            *agreement(gen.tokens, reference.tokens, sampling.greedy),
                            gen.drafted,
                            gen.draft_seconds,
                        )
                    )
                    bar.update()
                for name, kwargs in hf_kwargs.items():
                    bar.set_postfix_str(f"{prompt.id}/{turn} {name}")
                    if name in assistant_config:  # one assistant model may serve several baselines
                        model, settings = assistant_config[name]
                        for key, value in settings.items():
                            setattr(model.generation_config, key, value)
                    tokens, steps, seconds = _hf_generate(
                        target, tokenizer, ids, max_new_tokens, sampling, eos, seed + index, **kwargs
                    )
                    runs.append(
                        Run(
                            name,
                            prompt.id,
                            prompt.category,
                            turn,
                            len(tokens),
                            steps,
                            seconds,
                            [],
                            *agreement(tokens, reference.tokens, sampling.greedy),
                        )
                    )
                    bar.update()
                answer = [t for t in reference.tokens if t not in eos]
                history.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return runs


def agreement(tokens: list[int], reference: list[int], greedy: bool) -> tuple[bool | None, int | None]:
    """(same output, common prefix length) of ``tokens`` against plain decoding's ``reference``;
    (None, None) when sampling, where outputs differ by design."""
    if not greedy:  # sampled outputs differ by design
        return None, None
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return list(tokens) == list(reference), prefix


def runs_to_dicts(runs: list[Run]) -> list[dict]:
    return [asdict(r) for r in runs]
