"""Calibrate a drafter's tree to the device: ``python eval/calibrate_tree.py CHECKPOINT [options]``.

The checkpoint's kind calibrates it (``DrafterKind.calibrate``, with its own options): Medusa's
measures each head's held-out accuracy, the optimal static tree of every size and this device's pass
costs, and writes the fastest tree to ``CHECKPOINT/tree.yaml``, which its drafter then uses by
default (:func:`draftsmith.eval.medusa_calibration.calibrate_tree`).

    python eval/calibrate_tree.py runs/smollm2-medusa/checkpoint-final --dtype bfloat16
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from draftsmith.checkpoint_files import read_json
from draftsmith.errors import CheckpointError, UsageError, report_user_errors
from draftsmith.kinds import get, registered


def checkpoint_of(argv: list[str]) -> str | None:
    """The command line's checkpoint: its first word that is neither an option nor an option's value."""
    words = iter(argv)
    for word in words:
        if word.startswith("--") and "=" not in word:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


@report_user_errors
def main(argv: list[str] | None = None) -> dict | None:
    """Calibrate as the command line says, by the checkpoint's kind; returns what it wrote."""
    argv = list(sys.argv[1:] if argv is None else argv)
    calibrating = {name: kind for name, kind in registered().items() if kind.calibrate is not None}
    checkpoint = checkpoint_of([word for word in argv if word not in ("-h", "--help")])
    if checkpoint is None:
        if {"-h", "--help"} & set(argv):  # what the kinds that calibrate take
            print(
                f"python eval/calibrate_tree.py CHECKPOINT [options]: the checkpoint's kind calibrates its tree "
                f"to this device (kinds that do: {', '.join(calibrating)})\n"
            )
            for kind in calibrating.values():
                with contextlib.suppress(SystemExit):
                    kind.calibrate(["--help"])
            return None
        raise UsageError(f"give a checkpoint of a kind whose tree calibrates ({', '.join(calibrating)})")
    file = Path(checkpoint) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{checkpoint} is not a drafter checkpoint: it has no config.json")
    name = read_json(file).get("draftsmith_kind")
    kind = get(name, f"{file}: draftsmith_kind")
    if kind.calibrate is None:
        raise UsageError(
            f"{checkpoint}: {name} drafters have no tree to calibrate here (kinds that do: {', '.join(calibrating)})"
        )
    return kind.calibrate(argv)


if __name__ == "__main__":
    main()
