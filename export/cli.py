"""``draftsmith-export CHECKPOINT --format FORMAT --out DIR``: a trained drafter in a serving format.

Formats: ``speculators`` (EAGLE-3; vLLM loads it), ``sglang`` (EAGLE-1 and EAGLE-3 draft folders
for ``--speculative-draft-model-path``), ``vllm-medusa`` and ``medusa`` (Medusa heads for vLLM's
and the official loaders), ``hf`` (distilled draft LMs). Prints the command that serves the export.
"""

from __future__ import annotations

from draftsmith.errors import ArgumentParser, at_least, report_user_errors
from draftsmith.export import FORMATS, export_checkpoint


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="draftsmith-export", description=__doc__)
    parser.add_argument("checkpoint", help="a drafter checkpoint folder (checkpoint-N or checkpoint-final)")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", required=True, help="a new folder for the export")
    parser.add_argument("--target", default=None,
                        help="the target's local folder (default: the target the checkpoint records, if it is "
                             "'default', a folder, a .gguf file or a hub id in the local cache)")
    parser.add_argument("--results", default=None,
                        help="an eval/run.py results.json: this checkpoint's acceptance lengths go into the card")
    parser.add_argument("--draft-tokens", type=at_least(1), default=None,
                        help="tokens drafted per step in the printed serve command (default: the engine's depth)")
    args = parser.parse_args(argv)
    serve = export_checkpoint(args.checkpoint, args.format, args.out, args.target, args.results, args.draft_tokens)
    print(f"exported {args.checkpoint} as {args.format} to {args.out} (model card: {args.out}/README.md); serve it with:")
    for line in serve:
        print(f"  {line}")


if __name__ == "__main__":
    main()
