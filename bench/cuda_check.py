"""The engine and the head trainers on a GPU: the checks of the CPU suite that depend on the device.

    python bench/cuda_check.py [--device cuda] [--out DIR]

On tiny random-weight models built from a config, on ``--device``: (1) greedy speculative decoding
with every drafter kind (EAGLE-1; EAGLE-3 with 1 and 2 layers; P-EAGLE with 2; DFlash with a learned
mask row; DSpark with a vanilla Markov head cut by price and with an rnn one cut by threshold;
Medusa over a static tree; a draft LM cut from the target; prompt lookup; suffix decoding where
arctic-inference is installed; the hybrid of EAGLE-3 and prompt lookup), and plain decoding itself,
each with static shapes replayed from CUDA graphs (``cuda_graphs="on"``; eagerly on a CPU), gives
plain greedy decoding's tokens with shapes as they come (no graphs), with the graphs captured and
the host syncs per step counted
(:func:`~draftsmith.eval.engine.host_syncs.count_host_syncs`: each one waits for the device); (2)
training computes what it computes on the CPU: EAGLE-3's chain-sampled passes equal the full
unroll at their chains, DFlash's block-sparse attention equals dense masked SDPA (values and
gradients), and a packed batch scores what its padded conversations score (EAGLE-3, DFlash); (3) one
training step of each of those losses, and of DSpark's (Markov and confidence heads), in bf16
autocast. Prints one JSON object (and writes it to ``DIR/cuda_check.json``); exits 1 if any check
fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.packing import pack_batch
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.host_syncs import count_host_syncs
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dspark import DSparkHead
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.peagle import PEagleHead
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashRecipe, DFlashTask
from draftsmith.train.dspark import DSparkDrafterConfig, DSparkRecipe, DSparkTask
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.unroll import chain_sample, supervised_next, unroll

VOCAB, MASK = 48, 47
PROMPTS = ([3, 5, 2, 7, 4], [1, 1, 6], list(range(16)) * 2)


def tiny_target(device: str) -> LlamaForCausalLM:
    """A peaked 3-layer Llama (weights x 10: context-dependent greedy text)."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(10.0)
    return model.to(device)


def _perturbed(head):
    with torch.no_grad():
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return head.eval()


def heads(target) -> dict[str, tuple[torch.nn.Module, str]]:
    """Fresh heads of every learned kind for ``target`` and the spec options they draft with."""
    torch.manual_seed(1)
    return {
        "eagle": (_perturbed(EagleHead.for_target(target, "tiny")), "?depth=3&top_k=2&budget=5"),
        "medusa": (_perturbed(MedusaHeads.for_target(target, "tiny", num_heads=3)), "?choices=MEDUSA_TREE"),
        "eagle3": (Eagle3Head.for_target(target, "tiny", [0, 1, 2], init="identity"), "?depth=4&top_k=2&budget=6"),
        "eagle3_2_layers": (
            _perturbed(Eagle3Head.for_target(target, "tiny", [0, 1, 2], init="identity", num_layers=2)),
            "?depth=3&top_k=2&budget=5",
        ),
        "peagle_2_layers": (
            _perturbed(
                PEagleHead.for_target(target, "tiny", [0, 1, 2], mask_token_id=MASK, num_depths=3, num_layers=2)
            ),
            "",
        ),
        "dflash_learned_mask": (
            _perturbed(DFlashHead.for_target(target, "tiny", [0, 1, 2], 2, 4, MASK, learn_mask_embedding=True)),
            "",
        ),
        # The Markov bias makes drafting sequential over the block and the confidence head cuts the
        # chain: priced (the default, timed on the device's clock) and threshold take different paths.
        "dspark": (
            _perturbed(DSparkHead.for_target(target, "tiny", [0, 1, 2], 2, 4, MASK, markov_rank=8)),
            "?depth=3&cut=priced",
        ),
        "dspark_rnn": (
            _perturbed(
                DSparkHead.for_target(target, "tiny", [0, 1, 2], 2, 4, MASK, markov_rank=8, markov_head_type="rnn")
            ),
            "?cut=threshold&threshold=0.2",
        ),
    }


# Medusa's static tree: two candidates at depth 1, a chain of three under the first.
MEDUSA_TREE = "[[0],[1],[0,0],[0,0,0]]"


def suffix_available() -> bool:
    """Whether suffix decoding can run here (arctic-inference, a C++ extension, built and importable)."""
    return importlib.util.find_spec("arctic_inference") is not None


def training_free() -> dict[str, str]:
    """Specs of the kinds that need no checkpoint (suffix decoding where it is available)."""
    specs = {"draft_lm": "draft_lm?layers=1&depth=3", "prompt_lookup": "prompt_lookup?branches=2"}
    if suffix_available():
        specs["suffix"] = "suffix"
    return specs


def check_decoding(target, device: str) -> dict:
    """Greedy speculative decoding equals plain greedy for every kind; acceptance and syncs per step."""
    plain = SpeculativeDecoder(target, None, None, eos_ids=set(), cuda_graphs="off")
    wanted = [plain.generate(prompt, 40).tokens for prompt in PROMPTS]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        specs = training_free()
        for name, (head, options) in heads(target).items():
            head.save_pretrained(Path(tmp) / name)
            specs[name] = f"{name.split('_')[0]}:{Path(tmp) / name}{options.replace('MEDUSA_TREE', MEDUSA_TREE)}"
        specs["hybrid"] = f"hybrid:eagle3:{Path(tmp) / 'eagle3'}+prompt_lookup"
        for name, spec in {"plain": None, **specs}.items():
            drafter = build_drafter(spec, target) if spec else None
            spec = SpeculativeDecoder(target, drafter, None, eos_ids=set(), cuda_graphs="on")
            same, produced, steps, syncs = True, 0, 0, []
            for prompt, want in zip(PROMPTS, wanted):
                with count_host_syncs() as counter:
                    marks: list[int] = []
                    got = spec.generate(prompt, 40, streamer=lambda tokens, m=marks, c=counter: m.append(c.count))
                same &= got.tokens == want
                produced, steps = produced + sum(got.accepted), steps + got.steps
                syncs += [b - a for a, b in zip(marks, marks[1:])]
            runners = spec.runners()
            out[name] = {
                "lossless": same,
                "tokens_per_step": round(produced / steps, 3),
                "host_syncs_per_step_max": max(syncs) if syncs else None,
                "cuda_graphs": sum(r.static.captured for r in runners),
                "cuda_graph_failure": next((r.static.failure for r in runners if r.static.failure), None),
                "device": str(next(drafter.head.parameters()).device) if hasattr(drafter, "head") else device,
            }
    return out


def _batch(lengths=(40, 31)) -> list[dict]:
    """Two tokenised conversations (the first 6 tokens of each unsupervised)."""
    torch.manual_seed(2)
    rows = []
    for n in lengths:
        ids = torch.randint(2, MASK, (n,))
        loss_mask = torch.ones(n, dtype=torch.bool)
        loss_mask[:6] = False
        rows.append({"input_ids": ids, "loss_mask": loss_mask})
    return rows


def _on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def check_training(target, device: str) -> dict:
    """Training-side equalities on the device, and a bf16 autocast step of each loss."""
    out = {}
    torch.manual_seed(1)
    head = _perturbed(Eagle3Head.for_target(target, "tiny", [0, 1, 2], init="random")).train()
    batch = _on(pad_batch(_batch()), device)
    ids, padding, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, attention_mask=padding, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[layer] for layer in (0, 1, 2)], dim=-1)[:, :-1]
    chains = chain_sample(supervised_next(loss_mask, padding), 5, 0.5, 0.25)
    full = unroll(head, ids, features, padding, 5, head.feedback_input)
    sampled = unroll(head, ids, features, padding, 5, head.feedback_input, chains=chains)
    out["eagle3_chain_rows_max_diff"] = max(
        float((sampled[j][c.rows(ids.shape[1] - 1)] - full[j][c.rows(ids.shape[1] - 1)]).abs().max().detach())
        for j, c in enumerate(chains, start=1)
    )

    def task_losses(task_class, recipe, head, packing_batch):
        results = {}
        for layout, rows in (("padded", pad_batch(_batch())), ("packed", packing_batch)):
            torch.manual_seed(0)
            loss, metrics = task_class(recipe, target, head).loss(head, _on(rows, device), training=False)
            results[layout] = (float(loss), metrics)
        return results

    packed = pack_batch([_batch()])  # the two conversations end to end in one row
    recipe = Eagle3Recipe(drafter=Eagle3DrafterConfig(ttt_steps=3, aux_layers=[0, 1, 2], draft_vocab_size=None))
    losses = task_losses(Eagle3Task, recipe, head, packed)
    out["eagle3_packed_vs_padded_loss_diff"] = abs(losses["packed"][0] - losses["padded"][0])
    torch.manual_seed(1)
    dflash = _perturbed(DFlashHead.for_target(target, "tiny", [0, 1, 2], 2, 4, MASK)).train()
    drafter = DFlashDrafterConfig(aux_layers=[0, 1, 2], block_size=4, anchors_per_sequence=64, draft_vocab_size=None)
    task = DFlashTask(DFlashRecipe(drafter=drafter), target, dflash)
    dense_sparse = []
    for sparse in (False, True):
        task.block_sparse = sparse
        dflash.zero_grad()
        torch.manual_seed(0)
        loss, _ = task.loss(dflash, batch, training=True)
        loss.backward()
        dense_sparse.append(
            (float(loss), torch.cat([p.grad.flatten() for p in dflash.parameters() if p.grad is not None]))
        )
    out["dflash_sparse_vs_dense_loss_diff"] = abs(dense_sparse[0][0] - dense_sparse[1][0])
    out["dflash_sparse_vs_dense_grad_max_diff"] = float((dense_sparse[0][1] - dense_sparse[1][1]).abs().max())
    torch.manual_seed(1)
    dspark = _perturbed(DSparkHead.for_target(target, "tiny", [0, 1, 2], 2, 4, MASK, markov_rank=8)).train()
    dspark_drafter = DSparkDrafterConfig(
        aux_layers=[0, 1, 2], block_size=4, anchors_per_sequence=64, draft_vocab_size=None, markov_rank=8
    )
    for name, (trainer, model) in {
        "eagle3": (Eagle3Task(recipe, target, head), head),
        "dflash": (task, dflash),
        "dspark": (DSparkTask(DSparkRecipe(drafter=dspark_drafter), target, dspark), dspark),
    }.items():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss, _ = trainer.loss(model, batch, training=True)
        loss.backward()
        out[f"{name}_bf16_step_loss"] = float(loss)
    return out


def passed(decoding: dict, training: dict) -> bool:
    """The checks' verdict: every check ran, every kind was lossless, every equality held to 1e-3."""
    ok = "error" not in decoding and "error" not in training
    ok = ok and all(row["lossless"] for row in decoding.values())
    return ok and all(value < 1e-3 for key, value in training.items() if "diff" in key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = tiny_target(args.device)
    result: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    for name, check in (("decoding", check_decoding), ("training", check_training)):
        try:
            result[name] = check(target, args.device)
        except Exception:  # report every check, then fail
            result[name] = {"error": traceback.format_exc()}
    ok = result["ok"] = passed(result["decoding"], result["training"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cuda_check.json").write_text(text)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
