"""The recipe schema: one dataclass per section, shared by every drafter kind.

A drafter's entry script subclasses :class:`Recipe` with its own ``drafter`` section type.
Defaults live here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from draftsmith.config import COUNT, FRACTION, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, Range

# Ranges of the drafter sections' fields (the general ones are draftsmith.config's).
DECAY = Range(0, 1, open_low=True)  # a factor that weighs each later step (a draft depth, a head) less, or alike
DRAFT_VOCAB = Range(2, integer=True)  # a draft vocabulary's size: at least two tokens to choose from


@dataclass
class TargetConfig:
    """The frozen model the drafter is trained for and verified by."""

    name: str = "default"  # "default" (bundled SmolLM2-135M-Instruct), hub id, local folder or .gguf
    # auto: bf16 on GPUs and on CPUs where a measured bf16 matmul is faster, else fp32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    chat_template: str | None = None  # a .jinja file or template text, for targets that ship none


@dataclass
class RegenerateConfig:
    """Self-distillation: the target rewrites the assistant turns before tokenising (resumable)."""

    enabled: bool = False  # rewrite the data's assistant replies with the target before training
    max_new_tokens: Annotated[int, COUNT] = 512  # longest rewritten reply, in tokens
    # assistant turns rewritten per conversation (None: all; later ones are dropped)
    max_turns: Annotated[int, COUNT] | None = 1
    temperature: Annotated[float, NON_NEGATIVE] = 0.0  # 0: greedy
    top_p: Annotated[float, Range(0, 1, open_low=True)] = 1.0  # nucleus sampling when temperature > 0 (1.0: off)
    batch_size: Annotated[int, COUNT] = 16  # conversations per generate call
    # longer first prompts are left out (counted); None: data.max_length
    max_prompt_tokens: Annotated[int, COUNT] | None = None
    seed: Annotated[int, NON_NEGATIVE_INT] | None = 0  # sampling seed (null: unseeded)
    output: str | None = None  # JSONL file; default: under the draftsmith cache, keyed by its inputs
    # vllm: the serving engine (child process); hf: transformers generate; auto: vllm where importable
    engine: Literal["auto", "vllm", "hf"] = "auto"
    # a reply cut off at max_new_tokens: keep it open (no end-of-turn token; the conversation ends there) or drop it
    on_length: Literal["keep", "drop"] = "keep"
    tensor_parallel_size: Annotated[int, COUNT] = 1  # vLLM: GPUs per model replica
    data_parallel_size: Annotated[int, COUNT] = 1  # vLLM: model replicas
    # rewrite the first N conversations only and keep the others' own replies (a mix; null: rewrite all)
    conversations: Annotated[int, NON_NEGATIVE_INT] | None = None


@dataclass
class FeaturesConfig:
    """Stored or served target features (``drafter.features: offline`` or ``served``)."""

    # who writes an offline store: vllm (the serving engine's extract_hidden_states in a child process; with
    # data.regenerate, regeneration and extraction in one job), hf (the target in the trainer); auto: vllm if importable
    engine: Literal["auto", "vllm", "hf"] = "auto"
    # auto: the target's dtype; bfloat16 (half of float32); float8: e4m3 with a scale per token and layer (half of bf16)
    storage_dtype: Literal["auto", "bfloat16", "float8"] = "auto"
    # an offline store larger than this many GiB is refused before anything is written (its size is stated
    # first, from the data's token count); null: no bound
    max_gb: Annotated[float, POSITIVE] | None = None
    tensor_parallel_size: Annotated[int, COUNT] = 1  # vLLM: GPUs per model replica
    data_parallel_size: Annotated[int, COUNT] = 1  # vLLM: model replicas
    # served: base URL of a running `vllm serve` extracting hidden states (`draftsmith-features --serve` starts one)
    server: str | None = None
    # served: conversations requested ahead of the training step (the bound on what is held)
    window: Annotated[int, COUNT] = 16


@dataclass
class DataConfig:
    """Training conversations and how they are tokenised."""

    path: str = "sharegpt"  # "sharegpt" (bundled file), local .json/.jsonl, or a datasets hub id
    split: str = "train"  # split name when `path` is a hub id
    # tokens per rendered conversation; longer ones are truncated
    max_length: Annotated[int, Range(8, integer=True)] = 2048
    held_out_fraction: Annotated[float, FRACTION] = 0.02  # deterministic by conversation id
    # a fixed held-out set instead (conversations in any format `path` takes; training conversations with one of
    # its prompts leave training), e.g. to compare runs on different training data; it is used as it is
    # (data.regenerate rewrites `path` only)
    held_out_path: str | None = None
    limit: Annotated[int, COUNT] | None = None  # use only the first N valid conversations
    cache_dir: str | None = None  # tokenised-set cache; defaults to the draftsmith cache
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)


# Every attention and MLP projection of Llama-style decoder layers.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA adapters (``peft``) on a model: rank, alpha, dropout and the modules that get them.

    One spelling for every drafter kind that trains adapters (a distilled student, Medusa-2's
    target); a kind extends it with its own settings or other defaults."""

    r: Annotated[int, COUNT] = 8  # LoRA rank
    alpha: Annotated[int, COUNT] = 16  # LoRA alpha (adapter updates are scaled by alpha / r)
    dropout: Annotated[float, FRACTION] = 0.05  # LoRA dropout
    target_modules: list[str] = field(default_factory=lambda: list(LORA_MODULES))  # modules that get adapters

    def validate(self) -> None:
        if not self.target_modules:
            raise ValueError("target_modules is empty: name the modules that get adapters")

    def peft_config(self):
        """This configuration as ``peft``'s ``LoraConfig`` (no bias adapters)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
        )


@dataclass
class DrafterConfig:
    """Drafter-specific settings; each drafter kind extends this section."""

    kind: str = "none"  # the drafter kind this recipe trains (set by the entry script)

    # Keys a section accepted under another name before, old -> new path inside the section
    # (e.g. "lora_r": "lora.r"): recipes written then still load, read as the new key.
    RENAMED = {}  # not annotated: a class attribute, not a recipe field


@dataclass
class TrainingConfig:
    """Optimisation, schedule, checkpointing."""

    output_dir: str = "runs/default"  # checkpoints, recipe copy and W&B files (--output_dir for short)
    seed: Annotated[int, NON_NEGATIVE_INT] = 0  # data order, initialisation and sampling
    learning_rate: Annotated[float, POSITIVE] = 3e-5  # peak AdamW learning rate
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.0  # AdamW weight decay
    # AdamW (beta1, beta2)
    adam_betas: Annotated[list[float], FRACTION] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: Annotated[float, POSITIVE] = 0.5  # gradient clipping norm
    warmup_steps: Annotated[int, NON_NEGATIVE_INT] = 0  # linear warm-up, in optimiser steps
    max_steps: Annotated[int, COUNT] | None = None  # optimiser steps; None means num_epochs over the data
    num_epochs: Annotated[int, COUNT] = 1  # passes over the training set when max_steps is null
    batch_size: Annotated[int, COUNT] = 1  # per device, in sequences
    gradient_accumulation_steps: Annotated[int, COUNT] = 1  # micro-batches per optimiser step
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"  # after warm-up
    # Accelerate autocast; auto: bf16 when target.dtype resolves to bf16
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    num_workers: Annotated[int, NON_NEGATIVE_INT] = 0  # DataLoader workers
    group_by_length: bool = True  # batch sequences of similar length (less padding); the batches' order stays random
    # pack whole conversations into batch_size rows of data.max_length tokens, attention stopping at each one's
    # boundary (no padding but each row's tail; group_by_length is then moot); the batches' order stays random
    packing: bool = False
    # wall-clock budget of the training loop: the schedule runs to its end by then (null: none)
    max_minutes: Annotated[float, POSITIVE] | None = None
    # end this invocation early (time-sliced jobs); resume later
    stop_after_steps: Annotated[int, COUNT] | None = None
    log_every: Annotated[int, COUNT] = 10  # optimiser steps between logged training metrics
    eval_every: Annotated[int, NON_NEGATIVE_INT] = 0  # 0: only at the end
    save_every: Annotated[int, NON_NEGATIVE_INT] = 0  # 0: only at the end
    # numbered checkpoints kept (older ones are deleted; 0: keep all)
    keep_checkpoints: Annotated[int, NON_NEGATIVE_INT] = 2

    def validate(self) -> None:
        if len(self.adam_betas) != 2:
            raise ValueError(f"training.adam_betas must be two numbers (beta1, beta2), got {self.adam_betas}")


@dataclass
class DistributedConfig:
    """How Accelerate spreads the run; the training script builds the DeepSpeed plugin from it."""

    backend: Literal["ddp", "deepspeed"] = "ddp"  # DDP (or one process) through Accelerate, or DeepSpeed ZeRO
    zero_stage: Literal[0, 1, 2, 3] = 2  # DeepSpeed ZeRO stage
    offload_optimizer: bool = False  # DeepSpeed: optimiser states on the CPU
    offload_params: bool = False  # DeepSpeed ZeRO-3: parameters on the CPU


@dataclass
class TrackingConfig:
    """Experiment tracking through Accelerate's trackers."""

    report_to: Literal["wandb", "none"] = "wandb"  # tracker (none: console only)
    project: str = "draftsmith"  # W&B project
    run_name: str | None = None  # W&B run name (null: W&B picks one)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"  # auto: offline without a key


@dataclass
class EvalConfig:
    """Acceptance measurement with the shared decoding engine."""

    bench: str = "mt_bench"  # "mt_bench" or a .jsonl prompt file
    limit: Annotated[int, COUNT] | None = None  # first N prompts (null: all)
    max_new_tokens: Annotated[int, COUNT] = 256  # tokens generated per prompt
    temperature: Annotated[float, NON_NEGATIVE] = 0.0  # 0: greedy


@dataclass
class Recipe:
    """A full recipe. Sections: target, data, drafter, training, distributed, tracking, eval."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# Short command-line names for the fields users override most.
OVERRIDE_ALIASES = {"output_dir": "training.output_dir"}
