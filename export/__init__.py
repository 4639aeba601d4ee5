"""Export trained drafters to the formats serving engines load: ``speculators`` (vLLM), SGLang's
EAGLE folders, vLLM's and the official Medusa layouts, and plain Hugging Face draft LMs.

One module per format; each has ``NAME`` and ``why_not(kind)``, and its converters
``(source, target, out, tree)`` (write the folder, return the command lines that serve it). Which
kinds a format holds, and with which converter (a format shared by several kinds takes their
differences as arguments, bound in the declaration), is the kinds' declarations'
(``DrafterKind.formats``; ``DrafterKind.refused`` says why a format cannot hold a kind where the
kind knows better than the format). A format's reader (``read``: the engine loading an export
back, :mod:`draftsmith.heads.exported`) sits beside its writer, the kind's part bound in its
declaration (``DrafterKind.readers``). No module here names a kind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.atomic import staged
from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.export import hf, medusa, sglang, speculators, vllm_medusa
from draftsmith.export.card import write_card
from draftsmith.export.common import find_target, read_source, record_export, refuse
from draftsmith.kinds import DrafterKind, get
from draftsmith.target import load_target

FORMATS = {module.NAME: module for module in (speculators, sglang, vllm_medusa, medusa, hf)}


def _tree(source, kind: DrafterKind, target, draft_tokens: int | None) -> dict:
    """The draft tree the export serves with: for kinds whose trees are planned (EAGLE heads) the
    tree planned for the head on this machine (:mod:`draftsmith.eval.engine.tree_plan`, with
    ``planned``: what it was planned for), else the engine's defaults for the kind, else the most
    its checkpoint drafts (``DrafterKind.max_depth``). ``draft_tokens`` overrides the depth; more
    than the checkpoint drafts is refused."""
    tree = {key: option.default for key, option in kind.options.items()}
    most = kind.max_depth(source.config) if kind.max_depth else None
    if draft_tokens and most and draft_tokens > most:
        raise UsageError(
            f"--draft-tokens {draft_tokens}: this {kind.name} drafter drafts at most {most} tokens per step"
        )
    if kind.plan_fallback is not None:
        model, _ = load_target(str(target.folder), "auto")
        given = f"?depth={draft_tokens}" if draft_tokens else ""
        drafter = build_drafter(f"{source.kind}:{source.path}{given}", model)
        tree = {"depth": drafter.depth, "top_k": drafter.top_k, "budget": drafter.budget, "planned": drafter.tree_label}
    tree["depth"] = draft_tokens or tree.get("depth") or most
    return tree


def export_checkpoint(
    checkpoint: str | Path,
    fmt: str,
    out: str | Path,
    target: str | None = None,
    results: str | Path | None = None,
    draft_tokens: int | None = None,
    target_hub_id: str | None = None,
) -> list[str]:
    """Export the drafter checkpoint folder ``checkpoint`` to ``fmt`` in folder ``out``.

    ``target``: the target's local folder when the recorded name does not resolve offline;
    ``results``: an ``eval/run.py`` results.json whose acceptance lengths go into the model card;
    ``draft_tokens``: tokens drafted per step in the serve command (default: the depth planned for an
    EAGLE head on this machine, else the engine's default depth);
    ``target_hub_id``: the hub id engines are told the target is (default: derived, see :class:`Target`).
    Returns the command lines that serve the export. Bad input raises a :class:`UserError`.
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: choose from {', '.join(FORMATS)}")
    source = read_source(checkpoint)
    kind = get(source.kind, f"{checkpoint}: draftsmith_kind")
    if fmt not in kind.formats:
        elsewhere = " or ".join(f"--format {name}" for name in kind.formats) or "no format (nothing to export)"
        why = kind.refused.get(fmt) or FORMATS[fmt].why_not(source.kind)
        raise refuse(fmt, source.kind, f"{why}; export {source.kind} drafters with {elsewhere}")
    out = Path(out).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty folder; choose a new folder")
    found = find_target(source, target, target_hub_id)
    tree = _tree(source, kind, found, draft_tokens)
    # Written beside ``out`` and renamed into place: a refused or interrupted export leaves nothing
    # (the rerun removes what a killed one left).
    with staged(out, folder=True) as tmp:
        serve = kind.formats[fmt](source, found, tmp, tree)
        record_export(tmp, source, fmt, found, tree)
        for name in kind.copied:
            item = source.path / name
            if item.exists():
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / name)
        serve = [line.replace(str(tmp), str(out)) for line in serve]
        write_card(tmp, out, source, found, fmt, serve, Path(results) if results else None, tree.get("planned"))
    return serve


__all__ = ["FORMATS", "export_checkpoint"]
