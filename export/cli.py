"""``draftsmith-export CHECKPOINT --format FORMAT --out DIR``: a trained drafter in a serving format.

Formats: ``speculators`` (EAGLE-3; vLLM loads it), ``sglang`` (EAGLE-1 and EAGLE-3 draft folders
for ``--speculative-draft-model-path``), ``vllm-medusa`` and ``medusa`` (Medusa heads for vLLM's
and the official loaders), ``hf`` (distilled draft LMs). Prints the command that serves the export.
``--check vllm`` then serves the export in vLLM and compares it with draftsmith's engine (the gate,
:mod:`draftsmith.export.serve_check`): exit code 1 when they disagree, 3 when the prompts run cannot
tell (the export is kept either way).
"""

from __future__ import annotations

from draftsmith.errors import ArgumentParser, at_least, report_user_errors
from draftsmith.export import FORMATS, export_checkpoint
from draftsmith.export.common import read_source
from draftsmith.export.serve_check import ENGINES, add_check_arguments, report, serve_check, served_as


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="draftsmith-export", description=__doc__)
    parser.add_argument("checkpoint", help="a drafter checkpoint folder (checkpoint-N or checkpoint-final)")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", required=True, help="a new folder for the export")
    parser.add_argument(
        "--target",
        default=None,
        help="the target's local folder (default: the target the checkpoint records, if it is "
        "'default', a folder, a .gguf file or a hub id in the local cache)",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="an eval/run.py results.json: this checkpoint's acceptance lengths go into the card",
    )
    parser.add_argument(
        "--draft-tokens",
        type=at_least(1),
        default=None,
        help="tokens drafted per step in the printed serve command (default: the engine's depth)",
    )
    parser.add_argument(
        "--target-hub-id",
        default=None,
        help="the target's hub id, written where engines name the verifier (default: the recorded "
        "target's, when it is a hub id or a hub-cache folder)",
    )
    parser.add_argument(
        "--check",
        choices=ENGINES,
        default=None,
        help="then serve the export in this engine and compare with draftsmith's (exit 1 on mismatch)",
    )
    add_check_arguments(parser, prefix="check-")
    args = parser.parse_args(argv)
    if args.check:  # an export the engine cannot serve is refused before anything is written
        source = read_source(args.checkpoint)
        served_as({"format": args.format, "kind": source.kind, "config": source.config}, source.path, args.draft_tokens)
    serve = export_checkpoint(
        args.checkpoint, args.format, args.out, args.target, args.results, args.draft_tokens, args.target_hub_id
    )
    print(
        f"exported {args.checkpoint} as {args.format} to {args.out} (model card: {args.out}/README.md); serve it with:"
    )
    for line in serve:
        print(f"  {line}")
    if args.check:
        report(serve_check(args.out, args.check, args.check_prompts, args.check_limit, args.check_max_new_tokens))


if __name__ == "__main__":
    main()
