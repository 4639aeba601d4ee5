"""The shared speculative decoding loop, and plain decoding on the same runner (the baseline).

One step: the drafter proposes a tree below the last token, the target scores ``[last token] +
tree`` in one forward pass, verification keeps the longest correct path plus the target's own
next token, and the cache keeps only the accepted rows. Acceptance length (tau) is tokens
produced during decoding divided by target passes during decoding; prefill counts for neither.

Host overhead: the last token stays on the device, the tree goes there in one copy, and
verification and the cache's compaction order are computed there, so a step reads back one
tensor (the verdict: accepted nodes and last token); sampling with top-p may add one more (see
``sampling.probabilities``). Stops are checked on the step's new tokens only.

The drafter's draft-length policy (:mod:`draftsmith.eval.engine.policies`) decides each step whether it
drafts at all (the confidence gate, whose flag rides on the verdict's read-back) and where its
tree stops growing (the entropy threshold it passes in the context); verification is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.data_prep.traffic import NOT_DRAFTED, TrafficStore, draft_outcomes
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.engine.policies import DraftPolicy, PolicyConfig
from draftsmith.eval.engine.prepack import packed
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.engine.stopping import StopChecker
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import device_tree
from draftsmith.eval.engine.verify import read_verdict, verify
from draftsmith.target import eos_token_ids
from draftsmith.timing import clock


@dataclass
class Generation:
    """One generation and how it went."""

    tokens: list[int]  # new tokens (ending at EOS or a stop string when one was hit)
    steps: int = 0  # target forward passes after prefill
    accepted: list[int] = field(default_factory=list)  # tokens produced per step
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = "length"  # "eos", "stop_string" or "length"
    drafted: list[int] = field(default_factory=list)  # tree nodes verified per step (0: the target decoded alone)
    draft_seconds: float | None = None  # time spent drafting (only when the decoder times drafting)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target pass during decoding (the first token comes from prefill)."""
        return sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


class SpeculativeDecoder:
    """Generate with a target and any drafter (``None`` gives plain autoregressive decoding)."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        eos_ids: set[int] | None = None,
        time_drafting: bool = False,
        capture: TrafficStore | None = None,
        cuda_graphs: str | None = None,
    ):
        """``time_drafting``: also measure the drafter's share of each step for the cost model
        (a device synchronisation around every proposal: for diagnosis, not for speed runs).
        ``capture``: record every finished generation with the target's states at the store's
        layers for the tokens it read (training data from served traffic, :mod:`draftsmith.data_prep.traffic`).
        ``cuda_graphs``: static shapes and CUDA graphs for the target's and the drafter's runners
        (``auto``: on a CUDA device; None: the process's default;
        :class:`~draftsmith.eval.engine.target_runner.CausalLMRunner`)."""
        self.drafter_layers = getattr(drafter, "feature_layers", None)
        layers = self.drafter_layers
        if capture is not None and capture.layers:
            if layers and list(layers) != capture.layers:
                raise ValueError(f"the drafter reads layers {layers}, the capture store keeps {capture.layers}")
            layers = capture.layers
        self.runner = CausalLMRunner(target, capture_layers=layers, cuda_graphs=cuda_graphs)
        self.capture = capture
        self.drafter = drafter
        for runner in self.runners()[1:]:
            runner.set_cuda_graphs(cuda_graphs)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.eos_ids = eos_ids if eos_ids is not None else eos_token_ids(target, tokenizer)
        config = getattr(drafter, "policy", None) or PolicyConfig()
        if config.lossy and sampling.greedy:
            raise ValueError("lenience relaxes sampling verification: it needs temperature > 0")
        self.policy = DraftPolicy(config)
        self.time_drafting = time_drafting

    @torch.inference_mode()
    def capture_buckets(self) -> None:
        """Capture every runner's CUDA graphs now (after a first generation), in the state the
        verifier decodes in (a graph keeps whatever Python-side state its capture saw, e.g. a LoRA
        adapter switched on), so no capture falls inside a timed generation."""
        with self.drafter.verifying() if self.drafter is not None else nullcontext():
            for runner in self.runners():
                runner.capture_buckets()

    def runners(self) -> list[CausalLMRunner]:
        """The target's runner, then the drafter's own (:meth:`Drafter.runners`)."""
        return [self.runner, *(self.drafter.runners() if self.drafter is not None else [])]

    def _pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The target's next token after ``logits`` (one row), as a device tensor ``[1]``."""
        if self.sampling.greedy:
            return logits.argmax(-1).view(1)
        return sample(probabilities(logits, self.sampling), generator).view(1)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a feature-reading drafter gets for the rows of the last forward."""
        return self.runner.captured if self.drafter_layers else hidden

    def _captured(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The capture store's states of the last forward's ``rows`` (all when None)."""
        aux = self.runner.captured if self.capture.layers else None
        if rows is None:
            return hidden, aux
        return hidden[rows], aux[rows] if aux is not None else None

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        streamer: Callable[[list[int]], None] | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` tokens.

        Stops after an EOS token (kept) even inside an accepted path, or once the decoded text
        contains one of ``stop_strings``. ``streamer`` receives each step's new tokens. Runs in
        inference mode (no autograd bookkeeping per op: a tiny model's step ~12% cheaper on a CPU
        than under ``no_grad``); the states a capture store gets are written to its files.
        """
        with self.drafter.verifying() if self.drafter is not None else nullcontext(), packed():
            return self._generate(prompt, max_new_tokens, stop_strings, streamer, seed)

    def _step(self, root: torch.Tensor, tree, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One target pass over ``[root] + tree`` and its verification, all on the device:
        (hidden states, what to read back, kept rows first or None). What to read back is the
        verdict (the token alone without a tree), followed by the confidence flag when the policy
        gates on it."""
        gate = self.policy.config.confidence
        if tree is None or not len(tree):
            with record_function("target_forward"):
                hidden = self.runner.forward(root)
                logits = self.runner.logits(hidden[-1:])
                outcome = self._pick(logits[0], generator)
            if gate is not None:
                outcome = torch.cat([outcome, self._confident(logits[0], outcome, gate)])
            return hidden, outcome, None
        dev = device_tree(tree, self.runner.device)
        with record_function("target_forward"):
            hidden = self.runner.forward(torch.cat([root, dev.tokens]), dev.parents, dev.depths, levels=dev.levels)
            logits = self.runner.logits(hidden)
        with record_function("verify"):
            outcome = verify(tree, logits, self.sampling, generator, self.policy.config.lenience)
            # Kept rows first (the root, then the path in order), computed before the read-back.
            rows = torch.arange(len(tree) + 1, device=outcome.device)
            kept = torch.cat([outcome.new_ones(1), outcome[:-1]]).bool()
            order = torch.argsort(torch.where(kept, rows, rows + len(rows)))
            if gate is not None:
                end = torch.where(kept, rows, 0).max()  # the last accepted row produced the last token
                outcome = torch.cat([outcome, self._confident(logits[end], outcome[-1:], gate)])
        return hidden, outcome, order

    def _confident(self, logits: torch.Tensor, token: torch.Tensor, threshold: float) -> torch.Tensor:
        """``[1]`` device flag: the target's probability of ``token`` (its own next token) is at
        least ``threshold``, under its softmax at the sampling temperature (1 when greedy; top-k/p
        left out: their cut could cost a host sync, and the gate only needs a confidence)."""
        temperature = 1.0 if self.sampling.greedy else self.sampling.temperature
        return ((logits / temperature).softmax(-1)[token] >= threshold).long()

    def _generate(self, prompt, max_new_tokens, stop_strings, streamer, seed) -> Generation:
        # Drafts never reach past the last new token (their depth is capped by the remaining
        # budget), and that token is never fed back: prompt + max_new_tokens - 1 positions.
        self.runner.check_context(
            len(prompt) + max_new_tokens - 1, f"a prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens}"
        )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        drafter = self.drafter
        if drafter is not None:
            drafter.prepare(prompt, max_new_tokens)
        stops = StopChecker(self.eos_ids, stop_strings, self.tokenizer)
        result = Generation(tokens=[])
        device = self.runner.device
        start = clock(device)
        self.runner.reset(capacity=len(prompt) + max_new_tokens + 64)
        hidden = self.runner.forward(prompt)
        root = self._pick(self.runner.logits(hidden[-1]), generator)
        # The whole sequence, grown in place: drafters see it without a copy per step.
        tokens = list(prompt) + root.tolist()
        base = len(prompt)
        if drafter is not None:
            drafter.begin(tokens, self._features(hidden) if drafter.needs_hidden else None)
        states = [self._captured(hidden, None)] if self.capture is not None else None
        # The served drafter's outcome at each reply token (data_prep/traffic.py), for the capture store.
        outcomes = [NOT_DRAFTED] if self.capture is not None else None
        result.prefill_seconds = clock(device) - start
        start = clock(device)
        if streamer:
            streamer(tokens[base:])
        cut, reason = stops.check(tokens, base, 0)
        policy = self.policy
        policy.begin()
        if self.time_drafting:
            result.draft_seconds = 0.0
        while cut is None and len(tokens) - base < max_new_tokens:
            remaining = max_new_tokens - (len(tokens) - base)
            tree = None
            if drafter is not None and policy.drafting:
                if self.time_drafting:
                    drafting = clock(device)
                with record_function("draft"):
                    tree = drafter.propose(
                        DraftContext(tokens, self.sampling, generator, remaining - 1, policy.max_entropy)
                    )
                if self.time_drafting:
                    result.draft_seconds += clock(device) - drafting
            hidden, outcome, order = self._step(root, tree, generator)
            with record_function("read_back"):
                values = outcome.tolist()  # the step's one host sync
            confident = None
            if policy.config.confidence is not None:
                confident, values = bool(values[-1]), values[:-1]
            root = outcome[len(values) - 1 : len(values)]
            kept = self._features(hidden) if drafter is not None and drafter.needs_hidden else None
            path: list[int] = []
            if order is None:
                accepted_tokens = values
            else:
                path, last = read_verdict(values)
                with record_function("commit"):
                    self.runner.keep(order, len(path) + 1)
                accepted_tokens = [tree.tokens[node] for node in path] + [last]
                kept = kept[order[: len(path) + 1]] if kept is not None else None
            if states is not None:
                states.append(self._captured(hidden, order[: len(path) + 1] if order is not None else None))
                outcomes += draft_outcomes(tree.parents if order is not None else None, path)
            policy.observe(tree, path, confident)
            scanned = len(tokens) - base
            tokens += accepted_tokens
            result.steps += 1
            result.drafted.append(len(tree) if tree is not None else 0)
            if drafter is not None:
                with record_function("draft_accept"):
                    drafter.accept(StepResult(accepted_tokens, kept, tokens))
            cut, reason = stops.check(tokens, base, scanned)
            if cut is not None and cut > max_new_tokens:  # a drafter overshot: the stop is never reached
                cut = None
            end = min(cut or len(tokens) - base, max_new_tokens)
            result.accepted.append(end - scanned)
            if streamer:
                streamer(tokens[base + scanned : base + end])
            del tokens[base + end :]
            if outcomes is not None:
                del outcomes[end:]
        result.decode_seconds = clock(device) - start
        result.tokens = tokens[base : base + (cut or max_new_tokens)]
        result.stop_reason = reason if cut is not None else "length"
        if states is not None:  # outside the timed decode: one copy to the host per request
            full = list(prompt) + result.tokens
            rows = min(len(full), sum(h.shape[0] for h, _ in states))  # rows past a stop are cut
            hidden = torch.cat([h for h, _ in states])[:rows]
            aux = torch.cat([a for _, a in states])[:rows] if self.capture.layers else None
            self.capture.add(full, len(prompt), hidden, aux, outcomes[: len(result.tokens)])
        return result


def autoregressive_greedy(runner: CausalLMRunner, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy continuation on ``runner`` (no EOS handling): the oracle's reference."""
    runner.reset()
    hidden = runner.forward(prompt)
    out = [int(runner.logits(hidden[-1]).argmax())]
    while len(out) < max_new_tokens:
        out.append(int(runner.logits(runner.forward([out[-1]])[-1]).argmax()))
    return out
