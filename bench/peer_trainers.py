"""Peer trainers as a benchmark (issue 44, item 3): speculators 0.9's own trainer against draftsmith's,
same data, same precomputed features, same wall-clock budget, same settings where both have them, for
EAGLE-3, P-EAGLE, DFlash and DSpark; judged by vLLM's acceptance counts on the same prompts, or where vLLM's
CPU build does not serve the kind (DSpark), by draftsmith's engine drafting what vLLM would.

    python bench/peer_trainers.py --minutes 10 --out runs/peer --data.held_out_fraction 0.05

(the measurement: every kind, 10 minutes per trainer, 16 MT-bench first turns x 128 tokens; about 50 held-out
conversations). Smaller: ``--kinds eagle3``, ``--per-category 1``, ``--max-new-tokens 64``; any ``--data.*``
recipe override goes to both trainers (``--target.name DIR`` another target), e.g. the smoke run ``--minutes
1 --limit 2 --max-new-tokens 16 --data.limit 24 --data.regenerate.enabled false --data.held_out_fraction 0.2
--data.max_length 256``. The first run also regenerates the replies (the recipes' cached self-distillation,
shared with them) and extracts the features; neither counts in a trainer's budget. Each trainer's budget is
checked after each optimiser step (a step in flight finishes), so ``loop seconds`` in the table may pass
``--minutes`` by up to one step.

What it runs, in order (each stage is skipped where its output is already there, so a rerun resumes):

1. **Data**: the recipes' data section (``recipes/smollm2-eagle3.yaml``'s: 1,000 ShareGPT
   conversations, the target's own greedy replies, 768 tokens; ``--data.*`` overrides it), tokenised by
   draftsmith (``train``/``held_out`` splits). Both trainers read these rows.
2. **Features, once**: vLLM's ``extract_hidden_states`` (``bench/peer_vllm.py: extract``) writes each
   conversation's aux layers ([2, 15, 27]) and last layer as speculators' offline files
   (``OUT/features/hidden_states/hs_{i}.safetensors`` beside its arrow dataset of ``input_ids``,
   ``loss_mask``, ``seq_len``: train rows then held-out rows). draftsmith's feature store
   (``OUT/features/draftsmith``) is written from the same files (the last layer through the final norm,
   as draftsmith's own vLLM extraction does). Neither trainer's budget pays for features.
3. **Vocabulary**: the draft vocabulary draftsmith computes (8,192 most frequent reply tokens plus the
   special tokens) is given to speculators as ``d2t``/``t2d``; DFlash's mask token is draftsmith's choice,
   given to both.
4. **Train**, one trainer at a time on the whole machine: ``train/<kind>.py`` (``drafter.features:
   offline``, ``training.max_minutes``), then ``bench/peer_speculators.py`` (speculators' own trainer,
   run on the CPU by configuration and run-time patches only; its docstring lists them).
5. **Export**: ours with ``draftsmith-export --format speculators``; speculators' own checkpoint folder
   as it saved it.
6. **Held-out accuracy per depth**: both folders loaded by speculators' own model class, run over the
   held-out rows' features in eval mode (one evaluator, speculators' metrics: EAGLE-3's unconditional
   accuracy at each training-time-test step; P-EAGLE's accuracy per parallel depth; DFlash's and DSpark's
   accuracy per block position and greedy expected accepted length; the same sampled chains or anchors for
   both heads).
7. **Served**: each folder served in vLLM (``bench/peer_vllm.py: score``, fp32, greedy, one prompt at a time,
   chain of ``--eagle3-depth`` for EAGLE-3 and P-EAGLE, which drafts it in one pass, the block for DFlash),
   MT-bench first turns (``--per-category`` per category, or ``--prompts FILE``): acceptance length per
   prompt from vLLM's counters, per-position acceptance, and the difference (ours - speculators) with a 95%
   paired bootstrap interval over prompts (:func:`draftsmith.adapt.judge.paired_gain`). A kind vLLM does
   not serve here (DSpark: GPUs only) runs in draftsmith's engine instead (``eval/run.py``, fp32, the whole
   block top-1, no confidence cut, as vLLM drafts it), speculators' folder given our drafter record
   (:func:`graft_record`, which first checks that every shape field of the two configs agrees).

Settings matched (speculators' flag = draftsmith's field): ``--lr`` = ``training.learning_rate`` (1e-3),
``--optimizer adamw --weight-decay 0`` = AdamW without weight decay, ``--scheduler-warmup-steps`` = 10 warm-up
steps then linear decay to 0 at the deadline (a clock-driven schedule in both), gradient clipping 1.0 (fixed
in speculators; ``training.max_grad_norm 1.0`` here), tokens per step (``--total-seq-len`` = ``batch_size`` x
the mean training row), ``--draft-vocab-size`` and the vocabulary itself, ``--target-layer-ids`` =
``drafter.aux_layers``, ``--hidden-states-dtype`` = the target's dtype (autocast bf16 where the machine
runs bf16), ``--seed``; on a CPU also ``--draft-attn-impl sdpa`` and ``--loss-implementation eager``
(flex attention and the fused loss are GPU kernels). EAGLE-3: ``--ttt-steps 7 --ttt-step-loss-decay 0.8``, one layer,
``--no-norm-before-residual`` (= ``norm_before_residual: false``), frozen embedding. P-EAGLE: EAGLE-3's
layers and norm flag, ``--num-depths`` = ``ttt_steps`` (speculators' depth 0 is our first pass),
``--down-sample-ratio``/``--down-sample-ratio-min`` (chain sampling), ``--max-anchors`` = tokens per step
(every supervised position seeds a chain, as ours), ``--mask-token-id`` (draftsmith's choice), the embedding
table trained (``--embed-requires-grad``; the mask token's row lives there in both); ours weighs the depths
``0.8 ** j`` as speculators does (``drafter.depth_weighting: decay``, whatever the recipe says). DFlash: ``--num-layers
2``, ``--block-size 8``, ``--max-anchors`` = 64 anchors x 4 rows per step, ``--loss-fn kl_div`` with
``--per-position-loss-weight fixed-exp-decay --dflash-decay-gamma 4`` (= soft targets, ``weighting:
decay``, ``decay_gamma: 4``), full bidirectional attention in the block (``--full-attention-indices 0 1
--sliding-window-non-causal``, which also makes vLLM serve the block bidirectionally), ``--mask-token-id``.
DSpark: DFlash's flags with the recipe's block (7, ``--sample-from-anchor``) and heads (``--markov-rank 256
--markov-head-type vanilla --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1``).
Not matched (one trainer has no such setting): AdamW betas (ours 0.9/0.95, speculators' torch defaults),
speculators packs rows (multipack) where ours pads length-grouped batches, EAGLE-3's chain sampling
(``down_sample_ratio`` 0.7) and identity initialisation are ours only, speculators' EAGLE-3 norms
(``norm_before_fc``, ``norm_output``) are its own, ours masks out-of-vocabulary targets, speculators
freezes the drafter's LM head (ours: ``drafter.train_lm_head``). ``--ours "OVERRIDES"`` gives
draftsmith's trainer alone recipe overrides for these (e.g. ``--ours "--training.adam_betas [0.9,0.999]
--training.packing true"``); a folder trained with others is not reused (use another ``--out``, hard-linking
its ``features`` and the speculators side to skip their stages).

Results: ``OUT/peer_trainers.json`` and ``OUT/peer_trainers.md`` (printed too). ``sequences``: conversations
stepped on (ours: steps x ``batch_size`` padded rows; speculators: the conversations its packed rows held); the
JSON keeps each trainer's own token count too (they count different things: loss terms here, tokens there).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
KINDS = ("eagle3", "peagle", "dflash", "dspark")
EAGLE3_FAMILY = ("eagle3", "peagle")  # a chain drafted from the target's features (vLLM: ``eagle3``)
RECIPES = {kind: ROOT / "recipes" / f"smollm2-{kind}.yaml" for kind in KINDS}
FEATURES = "features"  # under --out: speculators' data folder (arrow rows, hidden_states/, vocab files)
SHARED_OVERRIDES = ("--data.", "--target.name")  # recipe overrides both trainers take
CONFIDENCE = 0.975  # each side of the paired bootstrap interval (95% two-sided)


# ---------------------------------------------------------------- recipes, data, features


def recipe_for(kind: str, overrides: list[str]):
    """draftsmith's recipe for ``kind`` (its CPU recipe plus ``overrides``), ``auto`` resolved."""
    from draftsmith.kinds import get
    from draftsmith.train.cli import parse_training_args

    recipe, _ = parse_training_args(get(kind).training.recipe, [str(RECIPES[kind]), *overrides])
    return recipe


def prepare_data(recipe):
    """``(head-only target, tokenizer, data, layers, target folder)`` as draftsmith's trainer builds them."""
    from transformers import AutoConfig

    from draftsmith.data_prep.dataset import build_dataset
    from draftsmith.data_prep.regenerate import prepare_data_config
    from draftsmith.heads.aux_layers import resolve_aux_layers
    from draftsmith.target import load_target, resolve_target

    name, dtype, template = recipe.target.name, recipe.target.dtype, recipe.target.chat_template
    num_layers = AutoConfig.from_pretrained(resolve_target(name, "target.name")).num_hidden_layers
    layers = resolve_aux_layers(recipe.drafter.aux_layers, num_layers)  # as the trainers resolve them
    target, tokenizer = load_target(name, dtype, chat_template=template, field="target.name", head_only=True)
    full = functools.cache(lambda: load_target(name, dtype, chat_template=template, field="target.name")[0])
    prepared = prepare_data_config(recipe.data, target, name, tokenizer, full_target=full)
    data, _ = build_dataset(prepared, tokenizer)
    return target, tokenizer, data, layers, resolve_target(name, "target.name")


def rows_of(data) -> list[dict]:
    """Train rows then held-out rows (the file index of each in speculators' layout)."""
    return [*data["train"], *data["held_out"]]


def extract_features(out: Path, recipe, target, data, layers: list[int], target_dir: str) -> None:
    """vLLM's hidden states of every row, as speculators' ``hs_{i}`` files (resumable)."""
    from draftsmith.data_prep.vllm_features import speculative_config, transfer_config
    from draftsmith.vllm_engine import engine_args, run_job

    folder = out / FEATURES
    rows = rows_of(data)
    hs_dir = folder / "hidden_states"
    if hs_dir.is_dir() and all((hs_dir / f"hs_{i}.safetensors").is_file() for i in range(len(rows))):
        return
    staging = folder / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    num_layers = target.config.num_hidden_layers
    job = {
        "task": "peer_vllm:extract",
        "conversations": [list(map(int, row["input_ids"])) for row in rows],
        "hs_dir": str(hs_dir),
        "layer_ids": sorted({*layers, num_layers}),
        "engine": engine_args(
            target_dir,
            recipe.target.dtype,
            max_model_len=max(len(row["input_ids"]) for row in rows) + 1,
            speculative_config=speculative_config(layers, num_layers),
            kv_transfer_config=transfer_config(staging),
            enable_chunked_prefill=False,
        ),
    }
    result = run_job(job, "peer_trainers: extracting features with vLLM", echo=True)
    if result["layer_ids"] != job["layer_ids"]:
        raise SystemExit(f"vLLM captured layers {result['layer_ids']}, expected {job['layer_ids']}")
    shutil.rmtree(staging, ignore_errors=True)


def write_speculators_rows(out: Path, data) -> float:
    """speculators' arrow dataset (``input_ids``, ``loss_mask``, ``seq_len``; train then held-out rows)
    beside the features; returns its ``--train-data-ratio`` (exactly the train rows)."""
    import datasets

    folder = out / FEATURES
    rows = rows_of(data)
    n_train = len(data["train"])
    if not (folder / "dataset_info.json").is_file():
        table = datasets.Dataset.from_dict(
            {
                "input_ids": [list(map(int, r["input_ids"])) for r in rows],
                "loss_mask": [list(map(int, r["loss_mask"])) for r in rows],
                "seq_len": [len(r["input_ids"]) for r in rows],
            }
        )
        table.set_format(type="torch")
        staging = folder / "arrow.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        table.save_to_disk(str(staging))
        for item in staging.iterdir():
            os.replace(item, folder / item.name)
        staging.rmdir()
    return (n_train + 0.5) / len(rows)


def write_our_store(out: Path, recipe, target, tokenizer, data, layers: list[int]) -> Path:
    """draftsmith's feature store from the same ``hs_{i}`` files (what ``drafter.features: offline``
    reads): the aux layers in the head's order, the last layer through the target's final norm."""
    from safetensors.torch import load_file

    from draftsmith.data_prep.features import is_complete, store_identity, write_store
    from draftsmith.data_prep.vllm_features import split_states

    root = out / FEATURES / "draftsmith"
    if is_complete(root, data):
        return root
    index = {tuple(map(int, row["input_ids"])): i for i, row in enumerate(rows_of(data))}
    hs_dir = out / FEATURES / "hidden_states"
    num_layers = target.config.num_hidden_layers
    norm = target.get_decoder().norm
    dtype = next(target.parameters()).dtype

    @torch.no_grad()
    def compute(chunk):
        states = []
        for ids in chunk:
            saved = load_file(str(hs_dir / f"hs_{index[tuple(map(int, ids))]}.safetensors"))
            hidden, aux = split_states(saved["hidden_states"].to(dtype), layers, num_layers, norm)
            states.append((hidden, aux))
        return states

    identity = store_identity(recipe.target.name, target, tokenizer, layers, recipe.data.features.storage_dtype, data)
    write_store(data, root, compute, identity)
    return root


def vocabulary(out: Path, recipe, tokenizer, data, target) -> tuple[Path, Path, int]:
    """draftsmith's draft vocabulary as speculators' ``d2t``/``t2d`` files; returns them and its size."""
    from draftsmith.heads.vocab import d2t_for, draft_vocab_for

    vocab_size = target.config.vocab_size
    draft = draft_vocab_for(recipe.drafter.draft_vocab_size, data["train"], tokenizer, vocab_size)
    d2t = d2t_for(draft, vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(d2t.numel())] = True
    d2t_path, t2d_path = out / FEATURES / f"d2t-{d2t.numel()}.npy", out / FEATURES / f"t2d-{d2t.numel()}.npy"
    np.save(d2t_path, d2t.numpy())
    np.save(t2d_path, t2d.numpy())
    return d2t_path, t2d_path, d2t.numel()


# ---------------------------------------------------------------- the two trainers


def claim_run(folder: Path, settings: dict) -> None:
    """Record what the trained stages under ``folder`` were run with; refuse to reuse them for others
    (a rerun resumes only the same run)."""
    record = folder / "peer_run.json"
    if record.is_file() and json.loads(record.read_text()) != settings:
        raise SystemExit(f"{folder} holds a run with {record.read_text().strip()}; use another --out for {settings}")
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings))


def _run(command: list[str], log: Path, env: dict | None = None) -> None:
    print(f"$ {' '.join(command)}  > {log}", flush=True)
    with log.open("w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"{command[1]} failed (exit {done.returncode}); the end of {log}:\n" + "\n".join(tail))


def train_ours(kind: str, out: Path, overrides: list[str], minutes: float, store: Path, mask: int | None):
    """draftsmith's trainer (``train/<kind>.py``) on the offline store, its recipe ``overrides`` (the
    shared ones and ``--ours``'); returns its final checkpoint."""
    recipe = recipe_for(kind, overrides)
    folder = out / kind / "draftsmith"
    final = folder / "checkpoint-final"
    if not (final / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        command = [
            sys.executable,
            str(ROOT / "train" / f"{kind}.py"),
            str(RECIPES[kind]),
            *overrides,
            *["--training.mixed_precision", recipe.training.mixed_precision],
            *["--drafter.features", "offline", "--drafter.features_dir", str(store)],
            *[
                "--training.max_minutes",
                str(minutes),
                "--training.num_epochs",
                "100",
                "--training.max_grad_norm",
                "1.0",
            ],
            *["--training.eval_every", "0", "--training.save_every", "0", "--tracking.report_to", "none"],
            *["--training.output_dir", str(folder)],
            *(["--drafter.mask_token_id", str(mask)] if mask is not None else []),
        ]
        folder.parent.mkdir(parents=True, exist_ok=True)
        _run(command, out / kind / "train_draftsmith.log")
    state = json.loads((final / "state" / "trainer_state.json").read_text())
    # Sequences: padded batches of training.batch_size (an epoch's last batch may hold fewer). Tokens: the
    # trainer's own count of loss terms (EAGLE-3: positions; DFlash: block slots), not speculators' count.
    steps = state["step"]
    return final, {
        "steps": steps,
        "seconds": round(state["seconds"], 1),
        "sequences": steps * recipe.training.batch_size,
        "loss_terms": state["tokens"],
    }


def speculators_args(
    kind: str, recipe, target_dir: str, data_path: Path, save: Path, vocab, ratio: float, data
) -> list:
    """speculators' ``train`` arguments matching ``recipe`` where it has the setting (the docstring's list)."""
    drafter, training = recipe.drafter, recipe.training
    lengths = [len(r["input_ids"]) for r in data["train"]]
    tokens_per_step = max(max(lengths), round(training.batch_size * statistics.mean(lengths)))
    d2t, t2d, size = vocab
    dtype = "bfloat16" if recipe.target.dtype == "bfloat16" else "float32"
    layers = [str(x) for x in sorted(drafter.aux_layers or [])]
    args = [
        *["--speculator-type", kind, "--verifier-name-or-path", target_dir, "--data-path", str(data_path)],
        *["--save-path", str(save), "--log-dir", str(save / "logs"), "--on-missing", "raise"],
        *["--d2t-path", str(d2t), "--t2d-path", str(t2d), "--draft-vocab-size", str(size)],
        *["--target-layer-ids", *layers, "--hidden-states-dtype", dtype, "--draft-attn-impl", "sdpa"],
        *["--loss-implementation", "eager"],  # "fused" is a Triton kernel: GPUs only
        *["--total-seq-len", str(tokens_per_step), "--train-data-ratio", repr(ratio), "--num-workers", "0"],
        *["--lr", repr(training.learning_rate), "--optimizer", "adamw", "--weight-decay", repr(training.weight_decay)],
        *["--scheduler-type", "linear", "--scheduler-warmup-steps", str(training.warmup_steps)],
        *["--epochs", "100", "--log-freq", str(training.log_every), "--seed", str(training.seed)],
    ]
    if kind in EAGLE3_FAMILY:
        args += ["--num-layers", str(drafter.num_layers)]
        args += ["--norm-before-residual" if drafter.norm_before_residual else "--no-norm-before-residual"]
    if kind == "eagle3":
        args += ["--ttt-steps", str(drafter.ttt_steps), "--ttt-step-loss-decay", repr(drafter.ttt_step_loss_decay)]
    elif kind == "peagle":
        # speculators' depth 0 is our pass 0 (the next token), so its num_depths is our ttt_steps; every
        # supervised position seeds a chain (its --max-anchors caps the seeds: none here, as ours), the
        # embedding table trains (P-EAGLE's mask row lives there, in both).
        args += ["--num-depths", str(drafter.ttt_steps), "--max-anchors", str(tokens_per_step)]
        args += ["--down-sample-ratio", repr(drafter.down_sample_ratio)]
        args += ["--down-sample-ratio-min", repr(drafter.down_sample_ratio_min)]
        args += ["--mask-token-id", str(drafter.mask_token_id), "--embed-requires-grad"]
    else:
        args += ["--num-layers", str(drafter.num_layers), "--block-size", str(drafter.block_size)]
        args += ["--max-anchors", str(drafter.anchors_per_sequence * training.batch_size)]
        args += ["--loss-fn", "kl_div", "--dflash-decay-gamma", repr(drafter.decay_gamma)]
        args += ["--per-position-loss-weight", "dpace" if drafter.weighting == "dpace" else "fixed-exp-decay"]
        args += ["--full-attention-indices", *map(str, range(drafter.num_layers)), "--sliding-window-non-causal"]
        args += ["--mask-token-id", str(drafter.mask_token_id)]
        if drafter.weighting == "dpace":
            args[args.index("kl_div")] = "ce"  # D-PACE needs speculators' hard-label CE
            args += ["--dpace-alpha", repr(drafter.dpace_alpha)]
        if kind == "dspark":
            flag = {True: "--", False: "--no-"}
            args += [f"{flag[drafter.sample_from_anchor]}sample-from-anchor"]
            args += ["--markov-rank", str(drafter.markov_rank), "--markov-head-type", drafter.markov_head_type]
            args += [f"{flag[drafter.confidence_head]}enable-confidence-head"]
            args += [f"{flag[drafter.confidence_head_with_markov]}confidence-head-with-markov"]
            args += ["--confidence-head-alpha", repr(drafter.confidence_alpha)]
    return args


def train_speculators(kind: str, out: Path, minutes: float, args: list[str], warmup: int) -> tuple[Path, dict]:
    """speculators' own trainer (``bench/peer_speculators.py``); returns its saved folder and summary."""
    save = out / kind / "speculators"
    summary_file = out / kind / "speculators_summary.json"
    if not summary_file.is_file():
        shutil.rmtree(save, ignore_errors=True)
        command = [sys.executable, str(BENCH / "peer_speculators.py"), "--minutes", str(minutes)]
        command += ["--warmup-steps", str(warmup), "--summary", str(summary_file), "--", *args]
        _run(command, out / kind / "train_speculators.log")
    summary = json.loads(summary_file.read_text())
    summary.pop("argv", None)  # the results keep them once, as speculators_args
    return Path(summary["saved"]), summary


def export_ours(checkpoint: Path, out: Path, target_dir: str, depth: int) -> Path:
    from draftsmith.export import export_checkpoint

    folder = out / "draftsmith-speculators"
    if not (folder / "config.json").is_file():
        export_checkpoint(checkpoint, "speculators", folder, target=target_dir, draft_tokens=depth)
    return folder


# ---------------------------------------------------------------- judging


def load_speculators_head(kind: str, folder: Path, target_dir: str):
    """A speculators-format folder loaded by speculators' own class (sdpa attention, fp32, eval), its
    verifier read from the target's local folder."""
    from speculators.model import SpeculatorModel

    model_class = SpeculatorModel.registry[kind]
    config = model_class.config_class.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = target_dir
    return model_class.from_pretrained(folder, config=config).float().eval()


@torch.no_grad()
def held_out_accuracy(kind: str, folder: Path, target_dir: str, data_path: Path, ratio: float, call: dict) -> dict:
    """Held-out metrics of the head in ``folder`` by speculators' forward (one conversation per batch):
    accuracy per depth (EAGLE-3: training-time-test step k+1; DFlash: block position k) and, for
    DFlash, its expected accepted length."""
    from hs_connectors import FileTransfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import RECOVERY_METADATA_KEY

    model = load_speculators_head(kind, folder, target_dir)
    hidden = model.config.transformer_layer_config.hidden_size
    rows = ArrowDataset(
        max_len=1 << 20,
        datapath=str(data_path),
        transfer=FileTransfer(data_path / "hidden_states"),
        on_missing="raise",
        train_ratio=ratio,
        split="val",
        hidden_states_dtype=torch.float32,
    )
    torch.manual_seed(0)  # DFlash draws its anchors: the same ones for every head
    sums: dict[str, float] = {}
    for i in range(len(rows)):
        row = rows[i]
        collate = CollateFn(
            int(row["lengths"][0]) - (kind in EAGLE3_FAMILY),  # shift_batch drops one position
            hidden,
            len(model.target_layer_ids),
            torch.float32,
            shift_batch if kind in EAGLE3_FAMILY else None,
        )
        batch = {k: v for k, v in collate([row]).items() if k != RECOVERY_METADATA_KEY}
        _, _, metrics = model(**batch, **call)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    result = {"conversations": len(rows)}
    if kind == "eagle3":
        steps = sorted(int(k.split("_")[2]) for k in sums if k.startswith("full_acc_") and k.endswith("_sum"))
        result["accuracy"] = [sums[f"full_acc_{s}_sum"] / max(sums[f"full_acc_{s}_total"], 1) for s in steps]
    else:
        positions = sorted(int(k.split("_")[1]) for k in sums if k.startswith("position_") and k.endswith("_acc_sum"))
        result["accuracy"] = [
            sums[f"position_{p}_acc_sum"] / max(sums[f"position_{p}_acc_total"], 1) for p in positions
        ]
        # The DFlash family's greedy expected accepted length (DSpark's accept_len is the sampling one,
        # 1 - TV; the judges here are greedy); P-EAGLE reports accuracy per depth only
        if "eal_sum" in sums:
            result["expected_accepted_length"] = sums["eal_sum"] / max(sums["eal_total"], 1)
    return result


def eval_call_kwargs(kind: str, args: list[str]) -> dict:
    """speculators' own validation-call arguments for the run ``args`` (``get_trainer_kwargs``)."""
    from speculators.model import SpeculatorModel
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(args)
    _, val = SpeculatorModel.registry[kind].get_trainer_kwargs(**cfg.flatten())
    return val


def vllm_counts(folder: Path, served, target_dir: str, prompts: list[list[int]], job: dict) -> dict:
    """Per-prompt drafts and accepted drafts of the head in the speculators folder ``folder``, served by
    vLLM as ``served`` (:func:`vllm_serving`) says."""
    from draftsmith.export.serve_check import speculative_config
    from draftsmith.vllm_engine import engine_args, run_job

    cache = folder.parent / f"vllm_{folder.name}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    spec = speculative_config(served, folder)
    result = run_job(
        {
            **job,
            "task": "peer_vllm:score",
            "prompts": prompts,
            "engine": engine_args(target_dir, speculative_config=spec),
        },
        f"peer_trainers: vLLM serving {folder}",
    )
    cache.write_text(json.dumps(result))
    return result


def vllm_serving(kind: str, folder: Path, depth: int):
    """How vLLM serves the ``kind`` export in ``folder`` on this machine, as the kind's plug-in says
    (P-EAGLE: ``eagle3`` drafting its chain in one pass); None where it does not (its CPU build: DSpark),
    and draftsmith's engine judges both heads."""
    from draftsmith.errors import UsageError
    from draftsmith.export import speculators
    from draftsmith.kinds import get

    try:
        return get(kind).serve(speculators.NAME, folder, depth)
    except UsageError:
        return None


# Config fields that say nothing of a head's shape: versions, dtypes, the verifier's path, the class name
# (speculators' own save_pretrained writes its model class, DSparkDraftModel, where its config's default and
# our export say DSparkSpeculator, and adds auto_map and tie_word_embeddings), and the Hugging Face
# boilerplate our layer config carries and speculators' omits.
LOOSE_FIELDS = {
    "architectures", "auto_map", "dtype", "speculators_config", "speculators_version", "tie_word_embeddings",
    "torch_dtype", "transformers_version",
}  # fmt: skip
LOOSE_LAYER_FIELDS = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label", "is_encoder_decoder",
    "label2id", "output_attentions", "output_hidden_states", "problem_type", "return_dict", "torch_dtype",
    "transformers_version",
}  # fmt: skip


def graft_record(theirs: Path, ours_export: Path, folder: Path) -> Path:
    """speculators' own folder ``theirs`` as one draftsmith's engine loads: its files hard-linked into
    ``folder`` (made afresh) and its config.json given the drafter record of ours (``ours_export``, a
    speculators export of the same kind trained with the same settings; our head's own held-out accuracy
    left out). Every other field, and every field of the layer config, must be in both and agree (block,
    layers, heads, vocabulary, mask token...), else the record would misdescribe their head."""
    from draftsmith.heads.exported import EXPORT_KEY

    ours = json.loads((ours_export / "config.json").read_text())
    config = json.loads((theirs / "config.json").read_text())

    def differences(a: dict, b: dict, loose: set) -> dict:
        return {k: (a.get(k), b.get(k)) for k in (a.keys() | b.keys()) - loose if a.get(k) != b.get(k)}

    layers = ours.pop("transformer_layer_config"), config["transformer_layer_config"]
    differ = differences(ours, config, LOOSE_FIELDS | {EXPORT_KEY, "transformer_layer_config"})
    differ |= differences(*layers, LOOSE_LAYER_FIELDS)
    if differ:
        raise SystemExit(f"{theirs} and {ours_export} differ in {differ}: the heads were not trained alike")
    record = dict(ours[EXPORT_KEY], source=str(theirs))
    record["config"] = {k: v for k, v in record["config"].items() if k != "depth_accuracy"}
    staging = folder.with_name(folder.name + ".tmp")
    for stale in (staging, folder):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(theirs, staging, copy_function=os.link)
    (staging / "config.json").unlink()  # a hard link to theirs: replaced, not written through
    (staging / "config.json").write_text(json.dumps({**config, EXPORT_KEY: record}, indent=1))
    os.replace(staging, folder)
    return folder


def engine_counts(kind: str, heads: dict[str, Path], depth: int, target_dir: str, args, out: Path) -> dict:
    """Per-prompt counts of each of ``heads`` (name -> folder) drafting the chain vLLM would (``depth``
    tokens, top-1 each, no adaptive cut) in draftsmith's engine, for kinds vLLM's CPU build does not
    serve: one ``eval/run.py`` run, fp32, greedy, first turns only, the prompts vLLM would get."""
    from urllib.parse import urlencode

    from draftsmith.kinds import get

    results = out / "engine" / "results.json"
    if not results.is_file():
        command = [sys.executable, str(ROOT / "eval" / "run.py"), "--target", target_dir, "--dtype", "float32"]
        command += ["--prompts", args.prompts] if args.prompts else ["--bench", "mt_bench"]
        command += ["--per-category", str(args.per_category)] if args.per_category else []  # as prompt_ids
        command += ["--limit", str(args.limit)] if args.limit else []
        command += ["--turns", "1", "--max-new-tokens", str(args.max_new_tokens), "--out", str(out / "engine")]
        for name, folder in heads.items():
            options = urlencode({**get(kind).chain(depth), "name": name})
            command += ["--drafter", f"{kind}:{folder}?{options}"]
        _run(command, out / "engine.log")
    runs = json.loads(results.read_text())["runs"]
    counted = {}
    for name in heads:
        rows = []
        for run in sorted((r for r in runs if r["method"] == name), key=lambda r: r["prompt_id"]):
            drafts = [a - 1 for a in run["accepted"]]  # a step's tokens: its accepted drafts and the target's own
            per_position = [sum(d > k for d in drafts) for k in range(depth)]
            rows.append(
                {
                    "drafts": run["steps"],
                    "accepted": sum(drafts),
                    "per_position": per_position,
                    "same": run["same_output"],
                }
            )
        counted[name] = {"rows": rows}
    return counted


def same_outputs(ours: list[dict], theirs: list[dict]) -> int:
    """Prompts on which both heads' outputs agree: vLLM's tokens, or in draftsmith's engine both equal to
    plain decoding's."""
    return sum(a["tokens"] == b["tokens"] if "tokens" in a else a["same"] and b["same"] for a, b in zip(ours, theirs))


def acceptance(result: dict, depth: int) -> dict:
    rows = result["rows"]
    drafts = sum(r["drafts"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    per_position = [sum((r["per_position"] + [0] * depth)[k] for r in rows) for k in range(depth)]
    return {
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "per_position": [round(p / drafts, 4) if drafts else 0.0 for p in per_position],
        "drafts": drafts,
        "accepted": accepted,
        "per_prompt": [(r["accepted"] + r["drafts"], r["drafts"]) for r in rows],
    }


def paired_interval(ours: list, theirs: list) -> dict:
    """tau(ours) - tau(speculators) with a two-sided 95% paired bootstrap interval over prompts (both
    bounds from the project's one-sided helper on the same resamples)."""
    from draftsmith.adapt.judge import paired_gain

    tau_theirs, tau_ours, gain, low = paired_gain(theirs, ours, CONFIDENCE)
    high = 0.0 - paired_gain(ours, theirs, CONFIDENCE)[3]
    return {"difference": round(gain, 4), "low": round(low, 4), "high": round(high, 4), "prompts": len(ours)}


# ---------------------------------------------------------------- report


def table(results: dict) -> str:
    lines = [
        f"Peer trainers, {results['minutes']} min each, {results['train_conversations']} training conversations, "
        f"{results['held_out_conversations']} held out; served fp32 greedy (by vLLM where its CPU build serves "
        f"the kind, else by draftsmith's engine), {results['prompts']} prompts x {results['max_new_tokens']} new "
        "tokens.",
        "",
        "| kind | trainer | steps | loop seconds | sequences | held-out accuracy per depth | served tau "
        "| served acceptance per position | judge |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, entry in results["kinds"].items():
        for who in ("draftsmith", "speculators"):
            run = entry[who]
            acc = " / ".join(f"{a:.3f}" for a in run["held_out"]["accuracy"])
            pos = " / ".join(f"{p:.2f}" for p in run["served"]["per_position"])
            lines.append(
                f"| {kind} | {who} | {run['train']['steps']} | {run['train']['seconds']} | "
                f"{run['train']['sequences']} | {acc} | "
                f"{run['served']['acceptance_length']:.3f} | {pos} | {entry['judge']} |"
            )
    lines.append("")
    for kind, entry in results["kinds"].items():
        d = entry["paired"]
        extra = ""
        if "expected_accepted_length" in entry["draftsmith"]["held_out"]:
            ours_eal = entry["draftsmith"]["held_out"]["expected_accepted_length"]
            theirs_eal = entry["speculators"]["held_out"]["expected_accepted_length"]
            extra = f"; held-out expected accepted length {ours_eal:.3f} (draftsmith) vs {theirs_eal:.3f} (speculators)"
        lines.append(
            f"- {kind}: tau draftsmith - speculators = {d['difference']:+.3f}, 95% paired bootstrap interval "
            f"[{d['low']:+.3f}, {d['high']:+.3f}] over {d['prompts']} prompts; same output for both heads on "
            f"{entry['same_output']} of {d['prompts']} prompts{extra}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget of each trainer (wall clock)")
    parser.add_argument("--out", default="runs/peer", help="output folder (stages found there are reused)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--prompts", default=None, help="JSONL prompt set (default: MT-bench first turns)")
    parser.add_argument("--per-category", type=int, default=2, help="MT-bench prompts per category")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eagle3-depth", type=int, default=3, help="EAGLE-3 chain length served in vLLM")
    parser.add_argument(
        "--ours",
        default="",
        help="recipe overrides for draftsmith's trainer alone, one quoted string (a setting speculators' "
        'trainer has no flag for), e.g. "--drafter.train_lm_head false --training.packing true"',
    )
    args, overrides = parser.parse_known_args(argv)
    ours_only = shlex.split(args.ours)
    bad = [w for w in overrides if w.startswith("--") and not w.startswith(SHARED_OVERRIDES)]
    if bad:
        parser.error(f"unknown options {bad}: only --data.* and --target.name recipe overrides go to both trainers")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH), *filter(None, [os.environ.get("PYTHONPATH")])])
    from draftsmith.export.serve_check import prompt_ids
    from draftsmith.kinds import get
    from draftsmith.vllm_engine import PRELOAD_ENV

    os.environ.setdefault(PRELOAD_ENV, "1")  # up to seven vLLM jobs: vLLM imported once
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    first = recipe_for(args.kinds[0], overrides)
    overrides = [*overrides, "--target.dtype", first.target.dtype]  # one dtype for every process
    target, tokenizer, data, layers, target_dir = prepare_data(first)
    if not len(data["held_out"]):
        raise SystemExit("no held-out conversation: raise --data.held_out_fraction or --data.limit")
    claim_run(out / FEATURES, {"overrides": overrides})
    extract_features(out, first, target, data, layers, target_dir)
    ratio = write_speculators_rows(out, data)
    store = write_our_store(out, first, target, tokenizer, data, layers)
    vocab = vocabulary(out, first, tokenizer, data, target)
    ids = prompt_ids(target_dir, args.prompts, args.limit, args.per_category)
    from draftsmith.target import eos_token_ids

    job = {"max_new_tokens": args.max_new_tokens, "stop_token_ids": sorted(eos_token_ids(target, tokenizer))}
    results = {
        "minutes": args.minutes,
        "ours_overrides": ours_only,
        "train_conversations": len(data["train"]),
        "held_out_conversations": len(data["held_out"]),
        "prompts": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "kinds": {},
    }
    earlier = out / "peer_trainers.json"
    if earlier.is_file():  # kinds run into this folder before (claim_run: with the same settings) stay in the report
        kept = json.loads(earlier.read_text())
        if all("served" in entry for entry in kept.get("kinds", {}).values()):
            results["kinds"] = kept["kinds"]
            results.setdefault("vllm", kept.get("vllm"))
    for kind in args.kinds:
        recipe = recipe_for(kind, overrides)
        recipe.drafter.aux_layers = layers
        mask = None
        if kind != "eagle3":
            from draftsmith.heads.vocab import mask_token_for

            mask = mask_token_for(recipe.drafter.mask_token_id, tokenizer, data["train"], len(tokenizer))
            recipe.drafter.mask_token_id = mask
        # the whole block of a block drafter, as its plug-in counts it (DSpark's anchor slot drafts too)
        depth = args.eagle3_depth if kind in EAGLE3_FAMILY else get(kind).max_depth(asdict(recipe.drafter))
        claim_run(
            out / kind, {"minutes": args.minutes, "overrides": overrides} | ({"ours": args.ours} if ours_only else {})
        )
        # speculators weighs EAGLE-3's depths 0.8 ** j and runs every pass: so does ours unless --ours says otherwise
        matched = ["--drafter.depth_weighting", "decay"] if kind in EAGLE3_FAMILY else []
        ours_ckpt, ours_train = train_ours(kind, out, [*overrides, *matched, *ours_only], args.minutes, store, mask)
        spec_args = speculators_args(
            kind, recipe, target_dir, out / FEATURES, out / kind / "speculators", vocab, ratio, data
        )
        theirs_folder, theirs_train = train_speculators(
            kind, out, args.minutes, spec_args, recipe.training.warmup_steps
        )
        ours_folder = export_ours(ours_ckpt, out / kind, target_dir, depth)
        call = eval_call_kwargs(kind, spec_args)
        folders = {"draftsmith": ours_folder, "speculators": theirs_folder}
        how = vllm_serving(kind, ours_folder, depth)
        served = how is not None
        if served:
            scored = {who: vllm_counts(folder, how, target_dir, ids, job) for who, folder in folders.items()}
            results["vllm"] = scored["draftsmith"]["version"]
        else:
            graft = graft_record(theirs_folder, ours_folder, out / kind / "speculators-engine")
            heads = {"draftsmith": ours_folder, "speculators": graft}
            scored = engine_counts(kind, heads, depth, target_dir, args, out / kind)
        judge = f"vLLM {results['vllm']}" if served else "draftsmith engine"
        entry = {"depth": depth, "judge": judge, "speculators_args": spec_args}
        for who, folder in folders.items():
            held = held_out_accuracy(kind, folder, target_dir, out / FEATURES, ratio, call)
            train = ours_train if who == "draftsmith" else theirs_train
            served_counts = acceptance(scored[who], depth)
            entry[who] = {"train": train, "held_out": held, "served": served_counts, "folder": str(folder)}
        entry["paired"] = paired_interval(
            entry["draftsmith"]["served"]["per_prompt"], entry["speculators"]["served"]["per_prompt"]
        )
        entry["same_output"] = same_outputs(scored["draftsmith"]["rows"], scored["speculators"]["rows"])
        results["kinds"][kind] = entry
        (out / "peer_trainers.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "peer_trainers.md").write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
