"""The drafter-kind registry: complete on import (its kinds are entry points, loaded on the first
lookup), and a new kind is its own files plus one line: a toy kind (tests/toy_kind.py) registered by
one entry-point line is listed, parsed, built, decoded with, hybridised and trained by the shared
code, none of which names it. And the one import rule, "shared code imports no kind" (core/kind_contract.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import grimp
import pytest
from cli_helpers import user_error

from draftsmith.errors import CheckpointError
from draftsmith.heads.exported import EXPORT_KEY, native_state
from draftsmith.kind_contract import KindsContract, broken
from draftsmith.kinds import ENTRY_POINTS, DrafterKind, Features, Training, registered
from draftsmith.recipe import Recipe

HERE = Path(__file__).resolve().parent

# Run in a fresh interpreter that sees the toy distribution: every check goes through shared code.
TOY_CHECKS = textwrap.dedent(
    """
    import contextlib, io, json, pathlib
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from draftsmith import kinds
    from draftsmith.errors import UsageError
    from draftsmith.eval.engine.decode import SpeculativeDecoder
    from draftsmith.eval.engine.drafters import build_drafter, parse_spec
    from draftsmith.eval.run import parse_args
    from draftsmith.train.__main__ import main as train_main

    found = {"toy": kinds.get("toy").summary, "builtin": kinds.get("eagle3").name}
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        parse_args(["--help"])
    lines = [" ".join(line.split()) for line in help_text.getvalue().splitlines()]
    found["help"] = lines[lines.index("toy") : lines.index("toy") + 3]
    try:
        parse_spec("toy?depth=2")
    except UsageError as err:
        found["refused"] = str(err)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    target = LlamaForCausalLM(config).eval()
    plain = SpeculativeDecoder(target, None, eos_ids=set()).generate([1, 2, 3], 12).tokens
    drafter = build_drafter("toy?num_tokens=4", target)
    toy = SpeculativeDecoder(target, drafter, eos_ids=set()).generate([1, 2, 3], 12)
    found["decoded"] = {"same": toy.tokens == plain, "drafter": type(drafter).__name__, "tokens": drafter.num_tokens}
    found["hybrid"] = type(build_drafter("hybrid:toy+prompt_lookup", target)).__name__
    train_help = io.StringIO()
    with contextlib.redirect_stdout(train_help):
        train_main(["--help"])
    found["trainable"] = train_help.getvalue().strip().splitlines()[-1]
    found["trained"] = train_main([RECIPE])
    from draftsmith.export import export_checkpoint
    checkpoint = pathlib.Path(RECIPE).parent / "toy-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"draftsmith_kind": "toy", "target": {}}))
    try:
        export_checkpoint(checkpoint, "speculators", checkpoint / "out")
    except UsageError as err:
        found["export"] = str(err)
    print(json.dumps(found))
    """
)


def installed(tmp_path: Path, line: str) -> dict:
    """An environment in which a distribution's metadata declares the kind entry point ``line``."""
    dist = tmp_path / "toy_kind-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-kind\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINTS}]\n{line}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE), os.environ.get("PYTHONPATH", "")])}


def test_the_registry_is_complete_on_import():
    """A fresh interpreter's first lookup finds every kind its entry points declare: nothing to call first."""
    code = (
        "from importlib.metadata import entry_points; from draftsmith import kinds; "
        "print(kinds.get('eagle3').title); print(' '.join(kinds.registered())); "
        f"print(' '.join(sorted(point.name for point in entry_points(group={ENTRY_POINTS!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "EAGLE-3 head"
    assert out[1] == out[2]
    assert {"prompt_lookup", "eagle", "eagle3", "dflash", "dspark", "medusa"} <= set(out[1].split())


def test_a_new_kind_is_its_own_file_and_one_entry_point_line(tmp_path):
    """What a package adding a kind ships: its module and, in its metadata, one line naming the
    declaration. Shared code (the spec parser, eval/run.py --help, build_drafter, the engine, the
    hybrid, draftsmith-train, draftsmith-export) takes the kind from the registry unchanged."""
    env = installed(tmp_path, "toy = toy_kind:KIND")  # the one line
    recipe = tmp_path / "toy.yaml"
    recipe.write_text("drafter:\n  kind: toy\n")
    script = f"RECIPE = {str(recipe)!r}\n{TOY_CHECKS}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["toy"] == "a toy: the last token again, num_tokens times" and found["builtin"] == "eagle3"
    assert found["help"] == [
        "toy",
        "a toy: the last token again, num_tokens times",
        "num_tokens=3 tokens drafted per step",
    ]
    assert "unknown option(s) depth for toy" in found["refused"]
    assert found["decoded"] == {"same": True, "drafter": "RepeatDrafter", "tokens": 4}
    assert found["hybrid"] == "HybridDrafter"
    assert "toy" in found["trainable"].split(": ")[-1].rstrip(".").split(", ")
    assert found["trained"] == f"toy trained on {recipe}"
    assert found["export"].startswith("--format speculators cannot hold toy drafters: speculators 0.9.0 has models for")
    assert found["export"].endswith("; export toy drafters with no format (nothing to export)")


@pytest.mark.parametrize(
    "line, why",
    [
        (
            "toy = no_such_module:KIND",
            "does not load: ModuleNotFoundError: No module named 'no_such_module'; fix or uninstall it",
        ),
        (
            "toy = toy_kind:RepeatDrafter",
            "must name the DrafterKind called 'toy', not <class 'toy_kind.RepeatDrafter'>",
        ),
        ("toy = toy_kind:KIND", None),  # negative control: the same package, its line right
    ],
)
def test_a_broken_kind_entry_point_is_one_line_naming_it_and_its_package(tmp_path, line, why):
    """Another package's entry point that does not load, or names no kind of its name, stops the
    first lookup (eval/run.py --help) with one line naming the line and its package, exit 2: no
    traceback, and not skipped (its kind would be missing unsaid)."""
    code = "import sys; sys.argv[0] = 'draftsmith-eval'; from draftsmith.eval.run import cli; cli()"
    done = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, env=installed(tmp_path, line)
    )
    if why is None:
        assert (done.returncode, done.stderr) == (0, "") and "\n  toy\n" in done.stdout
        return
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"draftsmith-eval: error: entry point {line} (group {ENTRY_POINTS}, installed by toy-kind 0) {why}\n"
    )


def test_the_kinds_rule_refuses_shared_code_importing_a_kind_and_kinds_importing_those_they_do_not_build_on():
    """The rule on a made-up graph: a kind's own modules import their own and those of the kinds
    they build on (followed through); shared code, the hybrid and a kind reaching sideways import
    none; a declaration module without a kind is refused too."""
    modules = [
        "draftsmith.export.speculators",
        "draftsmith.heads.eagle",
        "draftsmith.heads.eagle3",
        "draftsmith.heads.peagle",
        "draftsmith.eval.engine.drafters.eagle",
        "draftsmith.eval.engine.drafters.hybrid",
        "draftsmith.train.distill",
        "draftsmith.heads.draft_lm",
        "draftsmith.plugins.orphan",
        "draftsmith.heads.eagle3.layers",  # a kind's module split into a package stays the kind's
    ]
    allowed = [
        ("draftsmith.heads.peagle", "draftsmith.heads.eagle3"),  # builds on eagle3
        ("draftsmith.heads.peagle", "draftsmith.heads.eagle"),  # and through it on eagle
        ("draftsmith.train.distill", "draftsmith.heads.draft_lm"),  # the draft LM's own (declared) trainer
        ("draftsmith.heads.eagle3", "draftsmith.export.speculators"),  # a kind imports shared code
        ("draftsmith.heads.peagle", "draftsmith.heads.eagle3.layers"),  # and what it builds on, packages too
    ]
    refused = [
        ("draftsmith.export.speculators", "draftsmith.heads.eagle3"),  # shared code
        ("draftsmith.eval.engine.drafters.hybrid", "draftsmith.eval.engine.drafters.eagle"),  # builds on none
        ("draftsmith.heads.eagle", "draftsmith.heads.eagle3"),  # eagle does not build on eagle3
        ("draftsmith.export.speculators", "draftsmith.heads.eagle3.layers"),  # shared code, into the package
    ]
    found = broken(modules, allowed + refused, registered())
    assert [(importer, imported) for importer, imported, _ in found] == sorted(refused) + [
        ("draftsmith.plugins.orphan", "")
    ]
    assert "shared code imports no kind" in found[2][2] and "builds_on=('eagle3',)" in found[3][2]


def test_the_kinds_contract_breaks_on_the_real_graph_when_shared_code_imports_a_kind():
    """import-linter's check of the installed package: one import of a kind's head added to a shared
    module is the one new problem."""
    graph = grimp.build_graph("draftsmith")
    contract = KindsContract("kinds", {"root_packages": ["draftsmith"]}, {})
    before = contract.check(graph, verbose=False).metadata["problems"]
    graph.add_import(importer="draftsmith.export.common", imported="draftsmith.heads.medusa")
    after = contract.check(graph, verbose=False)
    assert not after.kept
    assert [p.split(":")[0] for p in after.metadata["problems"] if p not in before] == [
        "draftsmith.export.common -> draftsmith.heads.medusa"
    ]


def disagreements(kind: DrafterKind) -> list[str]:
    """Where a trainable kind's declared :class:`Features` and its recipe's drafter fields disagree:
    training reads the declaration, so a recipe field it implies must exist, and one it does not
    imply would be ignored."""
    drafter = typing.get_type_hints(kind.training.recipe)["drafter"]
    fields = {field.name for field in dataclasses.fields(drafter)}
    implied = {"aux_layers": kind.features.hidden == "aux", "features": kind.features.rows}
    implied["features_dir"] = implied["features"]
    return [f"{kind.name}: drafter.{name}" for name, wanted in implied.items() if wanted != (name in fields)]


def test_every_trainable_kind_declares_the_features_its_recipe_takes():
    """The declaration (what train/prepare.py reads) and the recipe agree for every kind; a kind
    declaring fused layers over a recipe without drafter.aux_layers is caught (negative control)."""
    trainable = [kind for kind in registered().values() if kind.training is not None]
    assert {kind.name for kind in trainable} >= {"eagle", "eagle3", "peagle", "dflash", "dspark", "medusa", "draft_lm"}
    assert [problem for kind in trainable for problem in disagreements(kind)] == []
    medusa = registered()["medusa"]
    wrong = dataclasses.replace(medusa, features=Features("aux", rows=True))
    assert disagreements(wrong) == ["medusa: drafter.aux_layers"]
    none = DrafterKind("none", "", print, training=Training("none", Recipe, print, print), features=Features())
    assert disagreements(none) == []


def test_an_export_reads_back_through_the_reader_its_kind_declares(tmp_path):
    """The engine loads an export with the reader its kind declares for its format: one a kind
    declares none for, and one whose fields are not its recorded format's, are one-line errors."""
    assert set(registered()["eagle3"].readers) == {"speculators", "sglang"}
    assert set(registered()["medusa"].readers) == {"vllm-medusa", "medusa"}
    record = {"format": "hf", "kind": "draft_lm", "source": "runs/x/checkpoint-final"}
    (tmp_path / "config.json").write_text(json.dumps({EXPORT_KEY: record}))
    with pytest.raises(CheckpointError, match="a 'hf' export of a draft_lm drafter, which the engine does not load"):
        native_state(tmp_path)
    record = {"format": "speculators", "kind": "eagle3", "source": "runs/x/checkpoint-final"}
    (tmp_path / "config.json").write_text(json.dumps({EXPORT_KEY: record, "architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(CheckpointError, match="says it is a speculators export but has no speculators_model_type"):
        native_state(tmp_path)


def test_calibrate_tree_hands_a_checkpoint_to_its_kind_and_refuses_kinds_without_a_calibration(tmp_path, capsys):
    """eval/calibrate_tree.py names no kind: a kind that declares a calibration (Medusa) gets the
    command line; another kind's checkpoint is a one-line refusal naming the kinds that calibrate."""
    from draftsmith.eval.calibrate_tree import main

    assert [name for name, kind in registered().items() if kind.calibrate is not None] == ["medusa"]
    (tmp_path / "config.json").write_text(json.dumps({"draftsmith_kind": "eagle3"}))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--dtype", "float32"])
    assert exit_.value.code == 2
    assert "eagle3 drafters have no tree to calibrate here (kinds that do: medusa)" in capsys.readouterr().err
    main(["--help"])
    assert "--max-budget" in capsys.readouterr().out  # Medusa's options, from its own parser
    # Medusa's own options refuse bad values in one line before any model loads (they were tracebacks)
    (tmp_path / "config.json").write_text(json.dumps({"draftsmith_kind": "medusa"}))
    for flag, value, why in (
        ("--max-budget", "0", "must be >= 1, got 0"),
        ("--sizes", "1,x", "expected comma-separated token counts >= 1, got '1,x'"),
        ("--sizes", "0,4", "expected comma-separated token counts >= 1, got '0,4'"),
    ):
        line = user_error(capsys, main, [str(tmp_path), flag, value])
        assert line.endswith(f"error: argument {flag}: {why} (see --help)"), line
    from draftsmith.eval.medusa_calibration import pass_sizes

    assert pass_sizes("1,2, 4") == [1, 2, 4]  # negative control (a whole calibration: tests/test_medusa.py)
