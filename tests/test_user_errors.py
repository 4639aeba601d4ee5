"""Bad input from a user ends in one line on stderr naming the file, field or record, exit code 2.

The entry points run in-process with real inputs (files written here, the bundled tokenizer, a
local HTTP server standing in for the hub's answers); one test runs a real subprocess for the
exit code and the one line as a shell sees them (``--debug``'s whole exception is checked in-process).
"""

from __future__ import annotations

import http.server
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_user_error
from training_helpers import save_tiny_target, write_recipe

from draftsmith.config import load_recipe
from draftsmith.data_prep.regenerate import main as regenerate_main
from draftsmith.errors import CheckpointError, UserError, report_user_errors
from draftsmith.eval.demo import main as demo_main
from draftsmith.eval.run import main as eval_main
from draftsmith.export.cli import main as export_main
from draftsmith.hub import check_hub_id
from draftsmith.kinds import registered
from draftsmith.precision import choose_cpu_dtype, resolve_dtype
from draftsmith.recipe import Recipe
from draftsmith.target import load_target, load_tokenizer
from draftsmith.train import eagle3
from draftsmith.train.cli import parse_training_args
from draftsmith.train.dflash import main as dflash_main
from draftsmith.train.distributed import resolve_precision
from draftsmith.train.eagle import EagleRecipe
from draftsmith.train.eagle import main as eagle_main

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# eval/run.py: flags and drafter specs, all refused before the target loads


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-5"),
        ("--limit", "0"),
        ("--per-category", "0"),
        ("--turns", "0"),
    ],
)
def test_counts_below_one_are_refused(capsys, flag, value):
    assert_user_error(
        capsys, rf"argument {flag}: must be >= 1, got {value}", eval_main, ["--drafter", "prompt_lookup", flag, value]
    )


@pytest.mark.parametrize(
    "spec,pattern",
    [
        (
            "foo",
            r"unknown drafter kind 'foo'; choose from dflash, domino, draft_lm, dspark, eagle, eagle3, "
            r"hierarchical, hybrid, medusa, oracle, peagle, prompt_lookup, suffix",
        ),
        ("eagle", r"the eagle drafter needs a checkpoint: eagle:PATH"),
        ("eagle:/nonexistent/run?depth=3", r"/nonexistent/run is not a drafter checkpoint"),
        ("prompt_lookup?num_token=3", r"unknown option\(s\) num_token for prompt_lookup; its options: num_tokens"),
        ("prompt_lookup?min_ngram=4", r"prompt_lookup: need 1 <= min_ngram <= max_ngram"),
        ("prompt_lookup:some/path", r"the prompt_lookup drafter takes no path"),
    ],
)
def test_bad_drafter_specs_are_one_line(capsys, spec, pattern):
    assert_user_error(capsys, pattern, eval_main, ["--drafter", spec])


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("data: {}\n", r"demo\.yaml: no readable drafter\.kind"),
        ("drafter: {kind: eagle4}\n", r"drafter\.kind 'eagle4'"),
    ],
)
def test_the_main_job_names_a_recipe_without_a_trainable_kind(capsys, tmp_path, text, pattern):
    """The main job trains whatever kind its ``--recipe`` names, and refuses one it cannot train."""
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(text)
    assert_user_error(capsys, pattern, demo_main, ["--recipe", str(recipe), "--out-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("minutes", ["-1", "nan"])
def test_the_main_job_refuses_a_negative_benchmark_budget(capsys, minutes):
    """``--eval-minutes`` bounds the benchmark's wall time; 0 lifts the bound, a negative one is a typo."""
    assert_user_error(capsys, r"--eval-minutes must be >= 0", demo_main, ["--eval-minutes", minutes])


def test_checkpoint_of_another_kind_is_named(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"draftsmith_kind": "eagle"}))
    assert_user_error(
        capsys,
        rf"{tmp_path} holds a 'eagle' drafter, not 'medusa': use the drafter kind",
        eval_main,
        ["--drafter", f"medusa:{tmp_path}"],
    )


@pytest.mark.parametrize(
    "spec,pattern",
    [
        (
            "eagle3:CKPT?depth=0",
            r"error: --drafter 'eagle3:.*\?depth=0': depth=0 is not allowed: depth must be an integer >= 1",
        ),
        ("eagle:CKPT?budget=-3", r"budget=-3 is not allowed: budget must be an integer >= 1"),
        ("eagle3:CKPT?top_k=2.5", r"top_k=2.5 is not allowed: top_k must be an integer >= 1"),
        ("prompt_lookup?num_tokens=0", r"num_tokens=0 is not allowed: num_tokens must be an integer >= 1"),
        ("prompt_lookup?branches=0", r"branches=0 is not allowed: branches must be an integer >= 1"),
        ("prompt_lookup?max_ngram=0", r"max_ngram=0 is not allowed: max_ngram must be an integer >= 1"),
        ("oracle?num_tokens=-1", r"num_tokens=-1 is not allowed"),
        ("draft_lm?depth=0", r"depth=0 is not allowed: depth must be an integer >= 1"),
        ("draft_lm?layers=0", r"layers=0 is not allowed: layers must be an integer >= 1"),
        ("draft_lm?depth=two", r"depth=two is not allowed: depth must be an integer >= 1"),
        ("hierarchical?m1_depth=0", r"m1_depth=0 is not allowed: m1_depth must be an integer >= 1"),
        ("hierarchical?m2_layers=0", r"m2_layers=0 is not allowed"),
        ("hierarchical?m1_tau=0", r"m1_tau=0 is not allowed: m1_tau must be a number > 0"),
        ("hierarchical?m2_tau=nan", r"m2_tau=nan is not allowed: m2_tau must be a number > 0"),
        ("medusa:CKPT?budget=0", r"budget=0 is not allowed: budget must be an integer >= 1"),
        (
            "draft_lm?policy=confidence&confidence=1",
            r"confidence=1 is not allowed: confidence must be a number in \(0, 1\)",
        ),
        ("draft_lm?lenience=1.5", r"lenience=1.5 is not allowed: lenience must be a number in \(0, 1\]"),
    ],
)
def test_drafter_options_out_of_range_are_refused_before_loading(capsys, tmp_path, spec, pattern):
    # A real checkpoint folder for the kinds that need one: the range is what is refused, not the path.
    kind = spec.partition(":")[0]
    (tmp_path / "config.json").write_text(json.dumps({"draftsmith_kind": kind}))
    assert_user_error(capsys, pattern, eval_main, ["--drafter", spec.replace("CKPT", str(tmp_path))])


def test_every_numeric_drafter_option_has_a_range_and_help_shows_it(capsys):
    from draftsmith.eval.engine.drafters import POLICY_OPTIONS

    tables = [("all", POLICY_OPTIONS), *((name, kind.options) for name, kind in registered().items())]
    numeric = {
        (kind, name): option
        for kind, table in tables
        for name, option in table.items()
        if isinstance(option.default, (int, float)) or option.range is not None
    }
    assert all(option.range is not None for option in numeric.values()), numeric
    with pytest.raises(SystemExit):
        eval_main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for line in [
        "depth=auto tree depth (draft steps per verification): a count, or auto: planned from the head's "
        "held-out accuracy per depth and this device's measured pass costs (a head recording none: depth 6, "
        "top_k 3, budget 12) (an integer >= 1)",
        "m1_tau=2.0 M1's initial entropy threshold (nats; then the mean M1 entropy of M2's rejections "
        "and M1's declines) (a number > 0)",
        "confidence=0.5 confidence policy: draft only while the target's probability of its own token is >= this "
        "(a number in (0, 1))",
        "lenience=1.0 LOSSY below 1",
        "(a number in (0, 1])",
    ]:
        assert line in shown, line


def test_prompt_files_name_the_bad_line_and_turns_are_checked(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": \n')
    assert_user_error(
        capsys, rf"{prompts}:2: not valid JSON", eval_main, ["--drafter", "prompt_lookup", "--prompts", str(prompts)]
    )
    prompts.write_text('{"prompt": "hello"}\n')
    assert_user_error(
        capsys,
        r"--turns 2: all 1 prompt\(s\) have fewer turns",
        eval_main,
        ["--drafter", "prompt_lookup", "--prompts", str(prompts), "--turns", "2"],
    )
    assert_user_error(capsys, r"--top-p must be in \(0, 1\]", eval_main, ["--drafter", "prompt_lookup", "--top-p", "0"])


def test_debug_shows_the_traceback_and_bugs_keep_theirs(capsys, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_DEBUG", "")  # --debug sets it for nested entry points; undone after the test
    with pytest.raises(UserError, match="unknown drafter kind"):
        eval_main(["--drafter", "foo", "--debug"])
    # The shell test's error, raised whole (a shell then sees Python's traceback and exit code 1).
    with pytest.raises(CheckpointError, match="no config.json"):
        eval_main(["--drafter", "eagle:/nonexistent", "--debug"])
    monkeypatch.setenv("DRAFTSMITH_DEBUG", "1")
    with pytest.raises(UserError):
        eval_main(["--drafter", "foo"])

    @report_user_errors
    def buggy(argv=None):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        buggy([])


def test_a_shell_sees_exit_code_2_and_one_line(tmp_path):
    env = {**os.environ, "DRAFTSMITH_DEBUG": ""}
    done = subprocess.run(
        [sys.executable, "eval/run.py", "--drafter", "eagle:/nonexistent"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "run.py: error: /nonexistent is not a drafter checkpoint: it has no config.json (give a checkpoint-N "
        "or checkpoint-final folder written by training)"
    ]


# ---------------------------------------------------------------------------------------------
# Training scripts: recipes and data


def test_missing_recipe_and_yaml_booleans(capsys, tmp_path):
    assert_user_error(capsys, r"recipe nope\.yaml does not exist", eagle_main, ["nope.yaml"])
    # YAML 1.1 would read no/off/yes as booleans; string fields keep the word, bool fields take it.
    recipe, _ = parse_training_args(
        EagleRecipe,
        [
            "--training.mixed_precision",
            "no",
            "--tracking.run_name",
            "off",
            "--data.regenerate.enabled",
            "yes",
            "--target.dtype",
            "float32",
        ],
    )
    assert recipe.training.mixed_precision == "no" and recipe.tracking.run_name == "off"
    assert recipe.data.regenerate.enabled is True
    path = tmp_path / "r.yaml"
    path.write_text("training:\n  mixed_precision: no\ndistributed:\n  offload_params: on\n")
    loaded = load_recipe(Recipe, path)
    assert loaded.training.mixed_precision == "no" and loaded.distributed.offload_params is True


def _write(path: Path, records: list, cut: int = 0) -> Path:
    text = json.dumps(records, indent=1)
    path.write_text(text[:-cut] if cut else text)
    return path


def test_zero_conversations_stop_with_the_summary_and_reason(capsys, tmp_path):
    conversation = {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    truncated = _write(tmp_path / "cut.json", [conversation], cut=30)  # the only record is cut off
    line = assert_user_error(
        capsys,
        rf"{truncated}: no usable conversation in 0 complete records \(1 dropped as "
        r"truncated_tail\)",
        eagle_main,
        ["--data.path", str(truncated), "--target.dtype", "float32", "--data.cache_dir", str(tmp_path / "cache")],
    )
    assert "ShareGPT-style records" in line
    bad = _write(tmp_path / "bad.json", [{"id": "b", "conversations": [{"from": "robot", "value": "x"}]}])
    assert_user_error(
        capsys,
        r"1 dropped as unknown_role",
        eagle_main,
        ["--data.path", str(bad), "--target.dtype", "float32", "--data.cache_dir", str(tmp_path / "cache")],
    )
    printed = capsys.readouterr()
    assert printed.err == ""


def test_nothing_left_after_tokenising_names_max_length(capsys, tmp_path):
    long_prompt = {
        "id": "c",
        "conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}],
    }
    path = _write(tmp_path / "long.json", [long_prompt])
    assert_user_error(
        capsys,
        r"no training conversation left after tokenising 1 \(1 with no assistant token within "
        r"data\.max_length=64\); raise data\.max_length",
        eagle_main,
        [
            "--data.path",
            str(path),
            "--data.max_length",
            "64",
            "--target.dtype",
            "float32",
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ],
    )


# ---------------------------------------------------------------------------------------------
# The hub: one answer, no retries, the case named


def test_offline_hub_id_not_in_cache_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert_user_error(
        capsys,
        r"target\.name: 'someorg/some-model' is not in the local Hugging Face cache and "
        r"HF_HUB_OFFLINE is set; download it .*hf download someorg/some-model --local-dir DIR.* set "
        r"target\.name to that folder",
        eagle_main,
        ["--target.name", "someorg/some-model", "--target.dtype", "float32"],
    )
    assert_user_error(
        capsys,
        r"--target: 'someorg/some-model' is not in the local Hugging Face cache",
        eval_main,
        ["--drafter", "prompt_lookup", "--target", "someorg/some-model", "--dtype", "float32"],
    )


class _HubStandIn(http.server.BaseHTTPRequestHandler):
    """Answers as the hub does for a gated repo (403, X-Error-Code: GatedRepo) and a missing one."""

    def _answer(self):
        gated = "/gated-org/" in self.path
        self.send_response(403 if gated else 404)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("X-Error-Message", "Access restricted" if gated else "Repository not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _check_in_fresh_process(endpoint: str, cache: Path, *args: str) -> str:
    """``check_hub_id(*args)`` where huggingface_hub reads HF_ENDPOINT (at import), as a user's process does."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(cache))
    code = (
        "import sys\nfrom draftsmith.hub import check_hub_id\ntry:\n    check_hub_id(*sys.argv[1:])\n"
        "except Exception as err:\n    print(type(err).__name__, err)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_gated_and_missing_repos_are_named(hub_endpoint, tmp_path):
    gated = _check_in_fresh_process(hub_endpoint, tmp_path, "gated-org/model", "target.name")
    assert gated.startswith(
        "HubError target.name: 'gated-org/model' is a gated model on the Hugging Face hub: "
        "accept its licence on its hub page and log in (`hf auth login` or HF_TOKEN)"
    ), gated
    missing = _check_in_fresh_process(hub_endpoint, tmp_path, "other-org/data", "data.path", "dataset")
    assert missing.startswith("HubError data.path: no dataset 'other-org/data' on the Hugging Face hub"), missing
    with pytest.raises(UserError, match=r"target\.name: /no/such/folder does not exist"):
        check_hub_id("/no/such/folder", "target.name")


# ---------------------------------------------------------------------------------------------
# dtype auto


def test_auto_dtype_follows_the_measurement(capsys):
    assert choose_cpu_dtype(fp32_seconds=1.0, bf16_seconds=40.0)[0] == torch.float32
    assert "40.0x slower" in choose_cpu_dtype(1.0, 40.0)[1]
    assert choose_cpu_dtype(fp32_seconds=2.0, bf16_seconds=1.0)[0] == torch.bfloat16
    chosen = resolve_dtype("auto", "cpu")
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"dtype auto -> {str(chosen).removeprefix('torch.')} on cpu: a bf16 matmul ran")
    assert chosen in (torch.float32, torch.bfloat16)
    recipe, _ = parse_training_args(EagleRecipe, ["--target.dtype", "float32"])
    assert recipe.training.mixed_precision == "no"  # auto follows the target's dtype
    recipe.target.dtype, recipe.training.mixed_precision = "auto", "auto"
    resolved = resolve_precision(recipe)
    assert (recipe.target.dtype, recipe.training.mixed_precision) == ("auto", "auto")  # a copy, not an edit
    recipe = resolved
    assert recipe.target.dtype == str(chosen).removeprefix("torch.")
    assert recipe.training.mixed_precision == {torch.bfloat16: "bf16", torch.float32: "no"}[chosen]


# ---------------------------------------------------------------------------------------------
# Values a kind cannot honour (its checkpoint's limits), refused before any model loads


@pytest.mark.parametrize(
    "config, spec, most",
    [
        ({"draftsmith_kind": "peagle", "num_depths": 7}, "peagle:CKPT?depth=99", 7),
        ({"draftsmith_kind": "dflash", "block_size": 8}, "dflash:CKPT?depth=8", 7),
    ],
)
def test_a_depth_past_what_the_checkpoint_drafts_is_refused(capsys, tmp_path, config, spec, most):
    """A 7-depth P-EAGLE head asked for depth 99 ran at depth 7 without a word; now the spec is
    refused with the range its checkpoint allows, read from its config.json (no model loads)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    depth = spec.rpartition("=")[2]
    assert_user_error(
        capsys,
        rf"depth={depth} is not allowed: {tmp_path} drafts at most {most} tokens per step, so depth must be an "
        rf"integer in \[1, {most}\]",
        eval_main,
        ["--drafter", spec.replace("CKPT", str(tmp_path))],
    )


def test_regenerate_refuses_a_limit_below_one(capsys, tmp_path):
    """``--limit -1`` regenerated one conversation (a slice to the last but one) without a word."""
    assert_user_error(
        capsys,
        r"argument --limit: must be >= 1, got -1",
        regenerate_main,
        ["--engine", "vllm", "--limit", "-1", "--out", str(tmp_path / "regen.jsonl")],
    )


# ---------------------------------------------------------------------------------------------
# draftsmith-train: dispatch on the recipe's drafter.kind

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
train_dispatch = importlib.import_module("draftsmith.train.__main__").main


def test_draftsmith_train_help_is_the_kinds_own(capsys):
    """``draftsmith-train RECIPE --help`` prints what the recipe's own trainer prints: its schema."""
    with pytest.raises(SystemExit):
        dflash_main(["--help"])
    own = capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_dispatch([str(RECIPES / "smollm2-dflash.yaml"), "--help"])
    assert capsys.readouterr().out == own and "drafter.block_size" in own


def test_draftsmith_train_needs_a_recipe_of_a_trainable_kind(capsys, tmp_path):
    assert_user_error(capsys, r"give a recipe \(draftsmith-train RECIPE.yaml", train_dispatch, [])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("drafter:\n  kind: prompt_lookup\n")
    assert_user_error(
        capsys,
        rf"{recipe}: drafter.kind 'prompt_lookup': choose from dflash, domino, distill, dspark, eagle, eagle3, "
        r"medusa, peagle",
        train_dispatch,
        [str(recipe)],
    )
    recipe.write_text("training:\n  batch_size: 1\n")
    assert_user_error(capsys, rf"{recipe}: drafter.kind is not set", train_dispatch, [str(recipe)])


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: a file cut short (a full disk, an interrupted copy) is one line naming it


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny EAGLE-3 run from stored features, stopped after its first checkpoint: the target
    folder, the recipe, the run folder (``checkpoint-2``: the head and its resumable state) and
    the features store."""
    root = tmp_path_factory.mktemp("damaged")
    target = save_tiny_target(root / "target", load_tokenizer("default"))
    recipe = write_recipe(root, target, {"aux_layers": [0, 1, 2]}, max_steps=4, save_every=2)
    features = ["--drafter.features", "offline", "--drafter.features_dir", str(root / "features")]
    eagle3.main([str(recipe), "--output_dir", str(root / "run"), "--training.stop_after_steps", "2", *features])
    return target, recipe, root / "run", root / "features"


def _cut_in_half(file: Path) -> Path:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file


def _copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def _damaged(file: Path) -> str:
    """The one line that names the cut-short ``file`` (the reader's words, then what to do)."""
    return rf"error: {re.escape(str(file))} is damaged or cut short \(.+\): \w+"


def test_a_cut_short_head_is_one_line_in_eval_and_export(stopped_run, tmp_path, capsys):
    target, _, run, _ = stopped_run
    head = _copy(run / "checkpoint-2", tmp_path / "head")
    weights = _cut_in_half(head / "model.safetensors")
    eval_args = ["--target", str(target), "--drafter", f"eagle3:{head}", "--limit", "1", "--max-new-tokens", "2"]
    line = assert_user_error(capsys, _damaged(weights), eval_main, [*eval_args, "--out", str(tmp_path / "eval")])
    assert "incomplete metadata" in line and "copy it again" in line
    out = tmp_path / "export"
    assert_user_error(capsys, _damaged(weights), export_main, [str(head), "--format", "speculators", "--out", str(out)])
    assert not out.exists()  # nothing half-written
    # A config.json cut short too: the first file read names itself.
    config = _cut_in_half(head / "config.json")
    line = assert_user_error(capsys, _damaged(config), eval_main, [*eval_args, "--out", str(tmp_path / "eval")])
    assert "Expecting" in line or "Unterminated" in line  # json's own words on where it ended


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_resuming_from_a_cut_short_state_is_one_line(stopped_run, tmp_path, capsys, name):
    _, recipe, run, features = stopped_run
    copy = _copy(run, tmp_path / "run")
    damaged = _cut_in_half(copy / "checkpoint-2" / "state" / name)
    argv = [str(recipe), "--output_dir", str(copy), "--resume"]
    argv += ["--drafter.features", "offline", "--drafter.features_dir", str(features)]
    line = assert_user_error(capsys, _damaged(damaged), eagle3.main, argv)
    assert f"move {copy / 'checkpoint-2'} aside" in line


def test_a_cut_short_feature_shard_and_target_cache_are_one_line(stopped_run, tmp_path, capsys):
    target, recipe, _, features = stopped_run
    store = _copy(features, tmp_path / "features")
    shard = sorted(store.rglob("shard-*.safetensors"))[0]
    whole = shard.read_bytes()
    _cut_in_half(shard)
    argv = [str(recipe), "--output_dir", str(tmp_path / "run"), "--training.max_steps", "1"]
    argv += ["--drafter.features", "offline", "--drafter.features_dir", str(store)]
    line = assert_user_error(capsys, _damaged(shard), eagle3.main, argv)
    # What it says to do works: the damaged shard is extracted again and training runs.
    assert f"delete {store / 'manifest.json'} and run again" in line
    (store / "manifest.json").unlink()
    assert eagle3.main(argv).state.step == 1
    assert shard.read_bytes() == whole
    cache = _copy(target, tmp_path / "target")
    weights = _cut_in_half(cache / "model.safetensors")
    with pytest.raises(CheckpointError, match=_damaged(weights).removeprefix("error: ")):
        load_target(str(cache), "float32", "cpu", head_only=True)
