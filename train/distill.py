"""Distil a draft LM from the target (DistillSpec): ``accelerate launch train/distill.py recipes/smollm2-distill.yaml``.

Each training sequence is a ShareGPT prompt (its first user turn) followed by a response drawn,
per sequence, from the recipe's mixture: the dataset's own reply (``fixed``), one sampled from
the target (``target``) or one sampled from the student as it is now (``student``, on-policy:
regenerated every step, so it follows the student as it trains). Both models score the whole
sequence; the loss is the recipe's token objective (``drafter.objective``, train/objectives.py)
between the target's distribution p and the student's q at a temperature, averaged over response
tokens. Logged: the objective, the
acceptance rate ``sum min(p, q)`` and the greedy top-1 agreement (held-out: on target-sampled
responses, i.e. where speculative decoding goes; in training also per response source, e.g.
``train/student/acceptance_rate``) and the student's perplexity on the responses.

The student is any causal LM with the target's tokenizer (``drafter.student``) or a few of the
target's own layers (``drafter.num_layers`` / ``layers``), fully fine-tuned or with LoRA.
Checkpoints are plain Hugging Face causal LMs (adapters merged) with the tokenizer: ready for
transformers, vLLM and ``generate(assistant_model=...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch

from draftsmith.config import COUNT, FRACTION, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, Range
from draftsmith.heads.draft_lm import save_draft_lm, student_for
from draftsmith.heads.vocab import token_counts
from draftsmith.recipe import DrafterConfig, LoraConfig, Recipe
from draftsmith.target import eos_token_ids, target_record
from draftsmith.train.cli import entry_point
from draftsmith.train.objectives import acceptance_rate, objective_rows, parse_objective
from draftsmith.train.prepare import target_and_data


@dataclass
class MixtureConfig:
    """Weights of the response sources (normalised): the data's replies, target samples, student samples."""

    fixed: Annotated[float, NON_NEGATIVE] = 0.0  # the data's replies (the target's own with data.regenerate)
    target: Annotated[float, NON_NEGATIVE] = 0.0  # replies sampled from the target
    student: Annotated[float, NON_NEGATIVE] = 1.0  # replies sampled on-policy from the student

    def validate(self) -> None:
        weights = [self.fixed, self.target, self.student]
        if sum(weights) <= 0:
            raise ValueError(f"drafter.mixture weights must have a positive sum, got {weights}")


@dataclass
class DistillLora(LoraConfig):
    """The student's LoRA adapters (``drafter.finetune: lora``), merged into it on export."""

    r: Annotated[int, COUNT] = 16  # LoRA rank
    alpha: Annotated[int, COUNT] = 32  # LoRA alpha (adapter updates are scaled by alpha / r)
    dropout: Annotated[float, FRACTION] = 0.0  # LoRA dropout


@dataclass
class DistillDrafterConfig(DrafterConfig):
    """The student, its token objective and where its training responses come from."""

    kind: str = "distill"
    # The LoRA settings were flat fields before they became the shared drafter.lora section.
    RENAMED = {f"lora_{name}": f"lora.{name}" for name in ("r", "alpha", "dropout", "target_modules")} | {
        "divergence": "objective"  # DistillSpec's name; its fkl and tvd are objective aliases
    }
    student: str | None = None  # hub id or folder of a causal LM with the target's tokenizer; None: derive
    num_layers: Annotated[int, COUNT] = 4  # derived student: this many of the target's layers, evenly spaced
    layers: Annotated[list[int], NON_NEGATIVE_INT] | None = None  # or exactly these layer indices
    finetune: Literal["full", "lora"] = "full"  # train every student weight, or LoRA adapters (merged on export)
    lora: DistillLora = field(default_factory=DistillLora)  # with finetune: lora
    objective: str | dict[str, float] = "kl_div"  # kl_div, rkl, jsd, ce, tv, nla, lk_hybrid or a mix {ce: 0.1, tv: 0.9}
    jsd_beta: Annotated[float, Range(0, 1, open_low=True, open_high=True)] = 0.5  # generalised JSD mixing weight
    temperature: Annotated[float, POSITIVE] = 1.0  # both distributions are taken at this temperature
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    # generating target and student responses (0: greedy)
    sample_temperature: Annotated[float, NON_NEGATIVE] = 1.0
    max_new_tokens: Annotated[int, COUNT] = 128  # response length (fixed replies are cut to it too)
    max_prompt_tokens: Annotated[int, COUNT] = 512  # longer prompts are left out (counted)

    def validate(self) -> None:
        parse_objective(self.objective)


@dataclass
class DistillRecipe(Recipe):
    drafter: DistillDrafterConfig = field(default_factory=DistillDrafterConfig)


def prompt_response_pairs(rows, max_prompt_tokens: int) -> tuple[list[dict], int]:
    """``{id, prompt, response}`` from tokenised conversations: the tokens before the first assistant
    span and that span. Returns the pairs and how many were left out for a too-long prompt."""
    pairs, too_long = [], 0
    for row in rows:
        mask = list(row["loss_mask"])
        start = mask.index(1)
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        if start > max_prompt_tokens:
            too_long += 1
            continue
        ids = list(row["input_ids"])
        pairs.append({"id": row["id"], "prompt": ids[:start], "response": ids[start:end]})
    return pairs, too_long


SOURCES = ("fixed", "target", "student")  # the mixture's order


def _sharded(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 shards ``model``'s parameters over several processes: its forward
    passes then gather them (hooks DeepSpeed put on the module itself, so the unwrapped student
    samples with its current weights), collectives every process must join."""
    multi = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    return multi and any(
        hasattr(p, "ds_id") for p in model.parameters()
    )  # ds_id: DeepSpeed's partitioned-parameter mark


def _collate(rows: list[dict]) -> dict:
    return {
        "ids": [r["id"] for r in rows],
        "prompts": [r["prompt"] for r in rows],
        "responses": [r["response"] for r in rows],
    }


class DistillTask:
    """Divergence between the target and the student on prompt + response sequences."""

    def __init__(self, recipe: DistillRecipe, target, student, tokenizer, counts: torch.Tensor | None = None):
        self.cfg, self.recipe = recipe.drafter, recipe
        self.counts = counts  # response-token frequencies, saved for reduced draft vocabularies
        self.target, self.tokenizer = target, tokenizer
        self.eos = eos_token_ids(target, tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos)
        if self.cfg.finetune == "lora":
            from peft import get_peft_model

            student = get_peft_model(student, self.cfg.lora.peft_config())
        self.model = student
        weights = torch.tensor([self.cfg.mixture.fixed, self.cfg.mixture.target, self.cfg.mixture.student])
        self.mixture = weights / weights.sum()
        self._held_out: dict[str, list[int]] = {}  # target responses to held-out prompts, sampled once

    collate = staticmethod(_collate)

    @torch.no_grad()
    def generate(self, model, prompts: list[list[int]], temperature: float | None = None) -> list[list[int]]:
        """Responses of ``model`` to ``prompts`` (batched, left-padded), each ending at its first EOS."""
        temperature = self.cfg.sample_temperature if temperature is None else temperature
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, device=device)
            mask[i, width - len(prompt) :] = 1
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        was_training = model.training
        model.eval()
        # Sharded parameters: processes must keep stepping together until all have finished.
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.cfg.max_new_tokens,
            pad_token_id=self.pad,
            eos_token_id=sorted(self.eos),
            synced_gpus=_sharded(model),
            **sampling,
        )
        model.train(was_training)
        responses = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            responses.append(row[:end])
        return responses

    def responses(self, batch: dict, training: bool) -> tuple[list[list[int]], list[str]]:
        """Each row's response and its source (drawn from the mixture; held-out rows: the target's)."""
        prompts = batch["prompts"]
        if not training:
            missing = [i for i, key in enumerate(batch["ids"]) if key not in self._held_out]
            if missing:
                # The same held-out responses every evaluation, without touching the training
                # streams (manual_seed reseeds the accelerator's generator too: fork it as well).
                device = next(self.target.parameters()).device
                accel = [] if device.type == "cpu" else [device.index or 0]
                with torch.random.fork_rng(devices=accel, device_type=device.type):
                    torch.manual_seed(self.recipe.training.seed)
                    for i, response in zip(missing, self.generate(self.target, [prompts[i] for i in missing])):
                        self._held_out[batch["ids"][i]] = response
            return [self._held_out[key] for key in batch["ids"]], ["target"] * len(prompts)
        sources = torch.multinomial(self.mixture, len(prompts), replacement=True).tolist()
        out = [list(r[: self.cfg.max_new_tokens]) for r in batch["responses"]]
        for source, model in ((1, self.target), (2, self.model)):
            rows = [i for i, s in enumerate(sources) if s == source]
            if rows:
                for i, response in zip(rows, self.generate(model, [prompts[i] for i in rows])):
                    out[i] = response
            elif _sharded(model):  # every process must join the gathers of a sharded model's forwards
                self.generate(model, prompts[:1])
        return out, [SOURCES[s] for s in sources]

    def loss(self, model, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        prompts = batch["prompts"]
        responses, sources = self.responses(batch, training)
        # Prompts left-padded to one width and responses right-padded after it: every response
        # starts at the same column, so only the response columns need logits.
        width = max(len(p) for p in prompts)
        length = max(max(len(r) for r in responses), 1)
        device = next(self.target.parameters()).device
        ids = torch.full((len(prompts), width + length), self.pad, dtype=torch.long, device=device)
        attention = torch.zeros_like(ids)
        scored = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            ids[i, width - len(prompt) : width] = torch.tensor(prompt, device=device)
            ids[i, width : width + len(response)] = torch.tensor(response, dtype=torch.long, device=device)
            attention[i, width - len(prompt) : width + len(response)] = 1
            scored[i, : len(response)] = True
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        keep = length + 1  # logits at columns width-1 .. end: the ones that predict response tokens
        with torch.no_grad():
            p_logits = (
                self.target(
                    input_ids=ids,
                    attention_mask=attention,
                    position_ids=positions,
                    logits_to_keep=keep,
                    use_cache=False,
                )
                .logits[:, :-1][scored]
                .float()
            )
        q_logits = (
            model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=keep, use_cache=False)
            .logits[:, :-1][scored]
            .float()
        )
        tokens = int(scored.sum())
        if tokens == 0:
            return q_logits.sum() * 0.0, {"tokens": 0.0}
        t = self.cfg.temperature
        target_probs = (p_logits / t).softmax(-1)
        per_token = objective_rows(parse_objective(self.cfg.objective), q_logits / t, target_probs, self.cfg.jsd_beta)
        loss = per_token.mean()
        with torch.no_grad():
            gold = ids[:, width:][scored]
            nll = torch.nn.functional.cross_entropy(q_logits, gold, reduction="sum")
            accept = acceptance_rate(p_logits / t, q_logits / t)
            # Greedy drafting is accepted where the two argmaxes agree.
            agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
        metrics = {
            "tokens": float(tokens),
            "loss": float(loss.detach()) * tokens,
            "objective": float(per_token.detach().sum()),
            "acceptance_rate": float(accept.sum()),
            "top1_agreement": float(agree.sum()),
            "nll": float(nll),
        }
        if training:  # the sources differ a lot (the student agrees with the target on its own samples first)
            row = scored.nonzero()[:, 0]  # each scored token's sequence, in the order of [scored]
            for name in sorted(set(sources)):
                rows = torch.tensor([s == name for s in sources], device=device)[row]
                metrics[f"{name}/tokens"] = float(rows.sum())
                metrics[f"{name}/acceptance_rate"] = float(accept[rows].sum())
                metrics[f"{name}/top1_agreement"] = float(agree[rows].sum())
        return loss, metrics

    def finalise_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """Adds perplexity (``exp`` of the mean response NLL) to logged means."""
        for key in [k for k in logs if k.endswith("/nll")]:
            logs[key[: -len("nll")] + "perplexity"] = math.exp(min(logs[key], 50.0))
        return logs

    def save_pretrained(self, model, path: Path) -> None:
        save_draft_lm(
            model,
            path,
            self.tokenizer,
            target_record(self.target, self.recipe.target.name),
            dtype=next(self.target.parameters()).dtype,
            counts=self.counts,
        )


def build(recipe: DistillRecipe):
    """Target, prompt/response pairs, student and task for ``recipe``."""
    cfg = recipe.drafter
    target, tokenizer, data, _ = target_and_data(recipe)
    splits = {}
    for split in ("train", "held_out"):
        splits[split], too_long = prompt_response_pairs(data[split], cfg.max_prompt_tokens)
        if too_long:
            print(
                f"distill: {too_long} {split} prompts longer than drafter.max_prompt_tokens="
                f"{cfg.max_prompt_tokens} left out"
            )
    torch.manual_seed(recipe.training.seed)
    dtype = torch.float32 if cfg.finetune == "full" else next(target.parameters()).dtype
    student = student_for(target, cfg.student, cfg.num_layers, cfg.layers, dtype)
    counts = token_counts(data["train"], target.get_output_embeddings().weight.shape[0])
    return DistillTask(recipe, target, student, tokenizer, counts), splits["train"], splits["held_out"]


main = entry_point(DistillRecipe, build, __doc__)


if __name__ == "__main__":
    main()
