"""docs/own_data.md's commands, run as a new user would, at tiny size: so the guide cannot rot.

The blocks of the guide marked ``<!-- tested: tests/test_docs_own_data.py -->`` are read from the
file, their placeholders (the user's target, data and folders) replaced by the bundled SmolLM2
target and files this test writes, and run with only size flags appended (a few steps, no held-out
split, two prompts, 16 new tokens) and the flags a CPU needs where the recipe asks for GPUs. They
run in this process, as their console scripts and ``python SCRIPT`` would run them (one import of
torch and transformers instead of three: on a shared 2-core CPU that alone is a minute or more).
"""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "own_data.md"
MARKER = "<!-- tested: tests/test_docs_own_data.py -->"

# Per program: what shrinks the guide's command to a test (sizes), and what a 2-core CPU needs
# where the recipe is written for GPUs (fp32 instead of bf16, no DeepSpeed, no W&B, regeneration by
# transformers' generate: a vLLM engine's start-up would outlast twelve 16-token replies).
TINY = {
    "train/eagle3.py": [
        "--training.max_steps", "3", "--training.num_epochs", "1", "--training.warmup_steps", "0",
        "--training.eval_every", "0", "--training.save_every", "0", "--training.num_workers", "0",
        # no held-out split: a head without held-out accuracy gets the default tree, not one planned
        # by timing target passes (minutes on a loaded CPU, in eval and again in export)
        "--data.max_length", "160", "--data.held_out_fraction", "0",
        "--data.regenerate.max_new_tokens", "16", "--data.regenerate.engine", "hf",
        "--drafter.draft_vocab_size", "1024", "--drafter.ttt_steps", "2",
        "--target.dtype", "float32", "--training.mixed_precision", "no",
        "--distributed.backend", "ddp", "--tracking.report_to", "none",
    ],
    "draftsmith-eval": ["--limit", "2", "--max-new-tokens", "16", "--dtype", "float32"],
    "draftsmith-export": [],
}  # fmt: skip

CONVERSATIONS = [
    ("Name three primary colours.", "Red, yellow and blue."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nthe garden drinks it slowly,\nclouds move on at dusk."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("Give me a synonym for 'happy'.", "Joyful."),
    ("What does CPU stand for?", "Central processing unit."),
    ("Suggest a name for a grey cat.", "Ash, Smokey or Pebble."),
    ("Is 17 a prime number?", "Yes, 17 is prime: its only divisors are 1 and 17."),
    ("Explain what a list is in Python.", "A list is an ordered, mutable sequence, written [1, 2, 3]."),
    ("What is the boiling point of water at sea level?", "100 degrees Celsius, or 212 degrees Fahrenheit."),
    ("Recommend a book for a long flight.", "Try 'The Martian' by Andy Weir: fast, funny and gripping."),
]


def _write_inputs(folder: Path) -> dict[str, Path]:
    """The user's files: conversations in both layouts the guide names (ShareGPT's and OpenAI's) in
    one JSONL, and a prompt file in both of its layouts."""
    lines = []
    for i, (question, answer) in enumerate(CONVERSATIONS):
        if i % 2:
            record = {
                "id": f"c{i}",
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
            }
        else:
            record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        lines.append(json.dumps(record))
    chats = folder / "my_chats.jsonl"
    chats.write_text("\n".join(lines) + "\n")
    prompts = folder / "my_prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "p1", "category": "facts", "prompt": "What is the capital of Italy?"})
        + "\n"
        + json.dumps({"id": "p2", "category": "writing", "turns": ["Write a haiku about snow."]})
        + "\n"
    )
    return {"chats": chats, "prompts": prompts}


def _tested_commands(text: str) -> list[str]:
    """The commands of the fenced ``bash`` blocks right after the marker, continuation lines
    joined, comments and blank lines dropped."""
    blocks = re.findall(re.escape(MARKER) + r"\s*```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def _program(argv: list[str]) -> str:
    """The script a ``python SCRIPT ...`` line runs, else the console script's name."""
    return argv[1] if argv[0] == "python" else argv[0]


def _run(argv: list[str], tiny: list[str], monkeypatch) -> None:
    """Run one command line of the guide with ``tiny`` appended, as its shell would: ``python
    SCRIPT`` as ``__main__``, a console script through its installed entry point, whose return value
    its wrapper passes to ``sys.exit`` (anything but None or 0 is a failed command)."""
    monkeypatch.chdir(REPO)
    if argv[0] == "python":
        monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:], *tiny])
        run = lambda: runpy.run_path(str(REPO / argv[1]), run_name="__main__") and None  # noqa: E731
    else:
        (entry,) = entry_points(group="console_scripts", name=argv[0])
        monkeypatch.setattr(sys, "argv", [argv[0], *argv[1:], *tiny])
        run = entry.load()
    try:
        code = run()
    except SystemExit as exit_:  # bad input: one line on stderr and exit code 2
        code = exit_.code
    assert code in (None, 0), f"{' '.join(argv)} ended with {code!r}"


def test_guide_marks_train_eval_and_export_blocks():
    """What the slow test below runs: every tested block is found and is one of the three steps."""
    commands = _tested_commands(GUIDE.read_text())
    assert [_program(shlex.split(c)) for c in commands] == ["train/eagle3.py", "draftsmith-eval", "draftsmith-export"]


@pytest.mark.slow
def test_own_data_guide_commands_train_evaluate_and_export(tmp_path, capsys, monkeypatch):
    inputs = _write_inputs(tmp_path)
    places = {
        "meta-llama/Llama-3.1-8B-Instruct": "default",  # the user's target -> the bundled SmolLM2
        "my_chats.jsonl": str(inputs["chats"]),
        "my_prompts.jsonl": str(inputs["prompts"]),
        "runs/mine": str(tmp_path / "runs" / "mine"),
        "results/mine": str(tmp_path / "results" / "mine"),
        "exports/mine": str(tmp_path / "exports" / "mine"),
    }
    commands = _tested_commands(GUIDE.read_text())
    text = "\n".join(commands)
    missing = [place for place in places if place not in text]
    assert not missing, f"docs/own_data.md no longer names {missing}: update this test's placeholders"
    for command in commands:
        for place, value in places.items():
            command = command.replace(place, value)
        argv = shlex.split(command)
        program = _program(argv)
        capsys.readouterr()
        _run(argv, TINY[program], monkeypatch)
        if program == "draftsmith-eval":
            printed = capsys.readouterr().out

    # the head: trained on the user's JSONL (both layouts kept), for the bundled target
    head = tmp_path / "runs" / "mine" / "checkpoint-final"
    config = json.loads((head / "config.json").read_text())
    assert (head / "model.safetensors").stat().st_size > 1_000_000
    assert config["draftsmith_kind"] == "eagle3"

    # the evaluation: a numeric acceptance length for the head (named after its run folder) and
    # prompt lookup against plain decoding, over both prompts, and the table it printed
    result = json.loads((tmp_path / "results" / "mine" / "results.json").read_text())
    methods = result["methods"]
    assert set(methods) == {"baseline", "eagle3:mine", "prompt_lookup"}
    for name in ("eagle3:mine", "prompt_lookup"):
        tau = methods[name]["acceptance_length"]
        assert isinstance(tau, float) and 1.0 <= tau <= 17.0, (name, tau)
        assert methods[name]["num_prompts"] == 2 and methods[name]["speedup"] > 0
        assert methods[name]["same_output"] == 1.0  # float32: lossless, token for token
    assert methods["baseline"]["acceptance_length"] == pytest.approx(1.0)
    assert methods["eagle3:mine"]["mean_tree_nodes"] > 1  # it drafted trees, not nothing
    assert "| eagle3:mine | 1." in printed and (tmp_path / "results" / "mine" / "table.md").exists()

    # the export: what vLLM loads (speculators' EAGLE-3 layout) and its model card
    export = tmp_path / "exports" / "mine"
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in export.iterdir()}
    exported = json.loads((export / "config.json").read_text())
    assert exported["speculators_model_type"] == "eagle3"
    assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
