"""Several prompts decoded together: one target pass per step for the whole batch, per-row acceptance.

Each row keeps its own drafter, tree, generator and stop checks, as a
:class:`~draftsmith.eval.engine.decode.SpeculativeDecoder` run would; the target scores every row's
``[last token] + tree`` in one forward of shape ``[batch, n]`` (``n``: the largest row, the
others padded with rows that hang off the prefix, attended to by nobody and never verified),
verification runs per row with :mod:`draftsmith.eval.engine.verify` (device ops only), and all rows'
verdicts come back in one transfer per step.

Cache layout: one :class:`~draftsmith.eval.engine.kv_cache.SlotCache` with a batch dimension and one
write position shared by all rows, so the decoder's in-place writes need no per-row offsets.
Rows of different lengths leave *holes*: right-padding after a short prompt, and after a step
the slots a row did not accept while a longer path in another row did. A per-row validity mask
``[batch, capacity]`` hides them; positions are explicit per row, so a hole costs attention
over one masked key and nothing else. The accepted rows of every row are compacted with one
gather for all layers and rows (per-row orders), computed before the read-back.

Limits: drafters that read the target's features (EAGLE, Medusa) or verify with their own
model (Medusa-2) keep one sequence's state and are refused, and so are draft-length policies and
lenience (issue 17: per-row policy state is not wired in) and sliding-window targets.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import Generation
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.engine.kv_cache import SlotCache
from draftsmith.eval.engine.policies import PolicyConfig
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.engine.stopping import StopChecker
from draftsmith.eval.engine.target_runner import UnsupportedTargetError, attention_layout
from draftsmith.eval.engine.tree import ancestor_mask, upload
from draftsmith.eval.engine.verify import read_verdict, verify
from draftsmith.target import eos_token_ids, final_logits
from draftsmith.timing import clock


class BatchRunner:
    """A causal LM over ``batch`` sequences of different lengths with one shared :class:`SlotCache`
    (see the module doc): prefill, then forwards of ``[batch, n]`` tree rows kept per row."""

    def __init__(self, model: PreTrainedModel):
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.config = model.config
        param = next(self.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        if attention_layout(self.config)[1] is not None:
            raise UnsupportedTargetError(
                f"{self.config.model_type}: batched decoding supports full attention only "
                f"(this model has a sliding window); decode its prompts one at a time"
            )
        self.cache: SlotCache | None = None
        self.valid: torch.Tensor | None = None  # [batch, capacity]: slots a row may attend to
        self.width = 0  # slots written for every row (committed, holes included)

    def _room(self, rows: int) -> None:
        """Grow the validity mask (doubling) to ``rows`` slots; the cache grows on its own."""
        if rows > self.valid.shape[1]:
            grown = self.valid.new_zeros(self.valid.shape[0], max(rows, 2 * self.valid.shape[1]))
            grown[:, : self.width] = self.valid[:, : self.width]
            self.valid = grown

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[batch, n]`` after the written slots, each attending to its row's valid slots and
        to the new rows ``allowed`` ``[batch, n, n]`` says; returns the last hidden states ``[batch, n, H]``."""
        batch, n = ids.shape
        self._room(self.width + n)
        keys = torch.cat([self.valid[:, None, : self.width].expand(batch, n, self.width), allowed], -1)
        mask = torch.zeros(keys.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~keys, torch.finfo(self.dtype).min)
        out = self.decoder(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head in fp32, as the model's forward gives them (:func:`~draftsmith.target.final_logits`)."""
        return final_logits(self.config, self.lm_head(hidden))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], capacity: int) -> torch.Tensor:
        """Start over with ``prompts`` (right-padded into one forward); the last hidden state of each ``[batch, H]``."""
        batch, longest = len(prompts), max(len(p) for p in prompts)
        self.cache = SlotCache(self.config.num_hidden_layers, capacity)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.width = 0
        ids = upload([p + [0] * (longest - len(p)) for p in prompts], self.device)
        lengths = upload([len(p) for p in prompts], self.device)
        slots = torch.arange(longest, device=self.device)
        real = slots[None, :] < lengths[:, None]
        allowed = torch.tril(torch.ones(longest, longest, dtype=torch.bool, device=self.device)) & real[:, None, :]
        hidden = self._forward(ids, slots.expand(batch, longest), allowed)
        self.valid[:, :longest] = real
        self.width = longest
        return hidden.gather(1, (lengths - 1)[:, None, None].expand(batch, 1, hidden.shape[-1]))[:, 0]

    @torch.no_grad()
    def forward_trees(
        self, ids: torch.Tensor, parents: torch.Tensor, positions: torch.Tensor, levels: int
    ) -> torch.Tensor:
        """Rows ``[batch, n]`` (row 0 of each: its last token; ``parents`` row-local, -1 at the
        root and the padding) scored in one pass and left pending until :meth:`keep`."""
        return self._forward(ids, positions, ancestor_mask(parents, levels))

    def keep(self, order: torch.Tensor | None, counts: torch.Tensor | None, most: int) -> None:
        """Keep pending rows ``order[b, :counts[b]]`` of each row ``b`` (device tensors; ``most``:
        the largest count, a host int): one gather for all layers and rows; the rest become holes.
        ``order`` None: every row ran its last token alone, and keeps it where it is."""
        if order is None:
            self.valid[:, self.width] = True
            self.width += 1
            return
        n = order.shape[1]
        self.cache.compact(self.width, order, most)
        self.valid[:, self.width : self.width + n] = torch.arange(n, device=self.device) < counts[:, None]
        self.width += most


def _pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's next token after one row of ``logits``, as a device tensor ``[1]``."""
    if sampling.greedy:
        return logits.argmax(-1).view(1)
    return sample(probabilities(logits, sampling), generator).view(1)


class BatchDecoder:
    """Generate for several prompts at once with the target and one drafter per prompt (or none)."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        eos_ids: set[int] | None = None,
    ):
        self.runner = BatchRunner(target)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.eos_ids = eos_ids if eos_ids is not None else eos_token_ids(target, tokenizer)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        drafters: list[Drafter | None] | None = None,
        stop_strings: tuple[str, ...] = (),
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """Continue every prompt by up to ``max_new_tokens`` tokens; one :class:`Generation` per prompt.

        ``drafters[i]`` drafts for prompt i (None: plain decoding for that row); a drafter keeps
        per-sequence state, so give each prompt its own (a stateless one may repeat). ``seeds[i]``
        seeds row i's generator: row i then samples exactly as ``SpeculativeDecoder.generate(prompts[i],
        seed=seeds[i])``. Times are the batch's (every row gets the whole batch's seconds).
        """
        batch = len(prompts)
        drafters = list(drafters) if drafters is not None else [None] * batch
        if len(drafters) != batch or (seeds is not None and len(seeds) != batch):
            raise UsageError(
                f"{batch} prompts need as many drafters and seeds, got {len(drafters)} and "
                f"{len(seeds) if seeds is not None else 'no'} seeds"
            )
        for drafter in drafters:
            if drafter is not None and (drafter.needs_hidden or drafter.verifier is not None):
                raise UsageError(
                    f"drafter {drafter.name} reads the target's features or verifies with its own "
                    f"model; batched decoding supports feature-free drafters (prompt lookup, draft LMs, ...)"
                )
            if drafter is not None and getattr(drafter, "policy", None) not in (None, PolicyConfig()):
                raise UsageError(
                    f"drafter {drafter.name} has a draft-length policy or lenience; batched decoding "
                    f"drafts at fixed length and verifies losslessly: decode its prompts one at a time"
                )
        device = self.runner.device
        generators = (
            [torch.Generator(device=device).manual_seed(s) for s in seeds] if seeds is not None else [None] * batch
        )
        for drafter, prompt in zip(drafters, prompts):
            if drafter is not None:
                drafter.prepare(prompt, max_new_tokens)
        stops = StopChecker(self.eos_ids, stop_strings, self.tokenizer)
        results = [Generation(tokens=[]) for _ in prompts]
        start = clock(device)
        hidden = self.runner.prefill(prompts, max(map(len, prompts)) + 2 * max_new_tokens + 64)
        logits = self.runner.logits(hidden)
        first = torch.cat([_pick(logits[i], self.sampling, generators[i]) for i in range(batch)]).tolist()
        sequences = [list(prompt) + [token] for prompt, token in zip(prompts, first)]
        lengths = [len(p) for p in prompts]  # tokens of each row in the cache (its root's position)
        active = []
        for i, drafter in enumerate(drafters):
            if drafter is not None:
                drafter.begin(sequences[i], None)
            cut, results[i].stop_reason = stops.check(sequences[i], lengths[i], 0)
            active.append(cut is None and max_new_tokens > 1)
            if cut is not None:
                del sequences[i][lengths[i] + cut :]
        prefill = clock(device) - start
        start = clock(device)
        while any(active):
            trees = []
            for i, drafter in enumerate(drafters):
                remaining = max_new_tokens - (len(sequences[i]) - len(prompts[i]))
                tree = None
                if active[i] and drafter is not None:
                    tree = drafter.propose(DraftContext(sequences[i], self.sampling, generators[i], remaining - 1))
                trees.append(tree if tree is not None and len(tree) else None)
            outcomes, order, counts = self._step(sequences, lengths, trees, generators)
            values = torch.cat(outcomes).tolist()  # the step's one host sync
            most = offset = 0
            for i in range(batch):
                size = len(trees[i]) + 1 if trees[i] is not None else 1
                row, offset = values[offset : offset + size], offset + size
                path, last = read_verdict(row) if trees[i] is not None else ([], row[0])
                most = max(most, len(path) + 1)
                lengths[i] += len(path) + 1
                if not active[i]:
                    continue
                accepted = [trees[i].tokens[node] for node in path] + [last]
                active[i] = self._advance(results[i], sequences[i], len(prompts[i]), accepted, stops, max_new_tokens)
                if drafters[i] is not None:
                    drafters[i].accept(StepResult(accepted, None, sequences[i]))
            self.runner.keep(order, counts, most)
        decode = clock(device) - start
        for result, sequence, prompt in zip(results, sequences, prompts):
            result.tokens = sequence[len(prompt) :]
            result.prefill_seconds, result.decode_seconds = prefill, decode
        return results

    def _step(self, sequences, lengths, trees, generators):
        """One target pass over every row's ``[last token] + tree`` and per-row verification, on the
        device: (the rows' verdicts, or tokens where a row has no tree, to concatenate; kept rows
        first ``[batch, n]`` and kept counts ``[batch]``, None when no row has a tree)."""
        batch, n = len(trees), 1 + max(len(t) if t is not None else 0 for t in trees)
        rows = []
        for sequence, length, tree in zip(sequences, lengths, trees):
            tokens, parents, depths = [sequence[-1]], [-1], [0]
            if tree is not None:
                tokens += tree.tokens
                parents += [p + 1 for p in tree.parents]
                depths += tree.depths
            pad = n - len(tokens)  # rows hanging off the prefix, attended to by nobody, never verified
            rows += [tokens + [0] * pad, parents + [-1] * pad, [length + d for d in depths] + [length] * pad]
        packed = upload(rows, self.runner.device).view(batch, 3, n)
        levels = max((max(t.depths) for t in trees if t is not None), default=0)
        hidden = self.runner.forward_trees(packed[:, 0], packed[:, 1], packed[:, 2], levels)
        logits = self.runner.logits(hidden)
        outcomes, kept = [], []
        best = logits[:, 0].argmax(-1) if self.sampling.greedy else None  # every row's plain pick at once
        if n == 1:  # no trees: nothing to verify or compact
            picks = (
                [_pick(logits[i, 0], self.sampling, generators[i]) for i in range(batch)] if best is None else [best]
            )
            return picks, None, None
        for i, tree in enumerate(trees):
            if tree is None:
                outcomes.append(
                    best[i : i + 1] if best is not None else _pick(logits[i, 0], self.sampling, generators[i])
                )
                kept.append(torch.ones(1, dtype=torch.bool, device=logits.device))
            else:
                outcomes.append(verify(tree, logits[i, : len(tree) + 1], self.sampling, generators[i]))
                kept.append(torch.cat([outcomes[-1].new_ones(1), outcomes[-1][:-1]]).bool())
        kept = torch.nn.utils.rnn.pad_sequence(kept, batch_first=True, padding_value=False)
        kept = torch.nn.functional.pad(kept, (0, n - kept.shape[1]))
        slots = torch.arange(n, device=logits.device)
        order = torch.argsort(torch.where(kept, slots, slots + n), dim=-1)
        return outcomes, order, kept.sum(-1)

    def _advance(
        self,
        result: Generation,
        sequence: list[int],
        base: int,
        accepted: list[int],
        stops: StopChecker,
        max_new_tokens: int,
    ) -> bool:
        """Append a step's accepted tokens to ``sequence`` (cut at a stop or the budget, as
        ``SpeculativeDecoder`` does) and record the step; whether the row goes on."""
        scanned = len(sequence) - base
        sequence += accepted
        result.steps += 1
        cut, reason = stops.check(sequence, base, scanned)
        if cut is not None and cut > max_new_tokens:  # a drafter overshot: the stop is never reached
            cut = None
        end = min(cut or len(sequence) - base, max_new_tokens)
        result.accepted.append(end - scanned)
        del sequence[base + end :]
        if cut is not None:
            result.stop_reason = reason
        return cut is None and end < max_new_tokens
