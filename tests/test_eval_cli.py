import json

import pytest
from cli_helpers import user_error

from draftsmith.data_prep.sharegpt import DataError
from draftsmith.eval.measure import Run, agreement
from draftsmith.eval.report import captions, depth_table, summarise
from draftsmith.eval.run import main
from draftsmith.timing import STAGES, stage, stage_table


def test_summary_pools_runs_and_computes_speedup_against_baseline():
    runs = [
        Run("baseline", "1", "math", 1, new_tokens=11, steps=10, seconds=2.0),
        Run("baseline", "2", "code", 1, new_tokens=21, steps=20, seconds=4.0),
        Run("fast", "1", "math", 1, new_tokens=11, steps=4, seconds=1.0, accepted=[3, 3, 2, 2]),
        Run("fast", "2", "code", 1, new_tokens=21, steps=5, seconds=1.0, accepted=[4, 4, 4, 4, 4]),
    ]
    s = summarise(runs)["methods"]
    assert s["baseline"]["acceptance_length"] == pytest.approx(30 / 30)
    assert s["fast"]["acceptance_length"] == pytest.approx(30 / 9)
    assert s["fast"]["tokens_per_second"] == pytest.approx(32 / 2.0)
    assert s["fast"]["speedup"] == pytest.approx((32 / 2.0) / (32 / 6.0))
    assert s["fast"]["per_category"]["math"]["speedup"] == pytest.approx(2.0)
    assert s["fast"]["per_category"]["code"]["acceptance_length"] == pytest.approx(4.0)
    # 9 steps accepted 1, 1, 1 (x9), then >=2 drafts in 7 steps, >=3 in 5 steps
    assert s["fast"]["per_position_acceptance"] == pytest.approx([1.0, 7 / 9, 5 / 9])
    assert s["fast"]["accepted_per_step_histogram"] == {"2": 2, "3": 2, "4": 5}


def test_methods_slower_than_plain_decoding_get_a_caption_with_the_reason():
    runs = [
        Run("baseline", "1", "math", 1, new_tokens=11, steps=10, seconds=2.0),
        Run("slow", "1", "math", 1, new_tokens=11, steps=8, seconds=4.0, accepted=[2, 1, 1, 1, 2, 1, 1, 1]),
        Run("fast", "1", "math", 1, new_tokens=11, steps=4, seconds=1.0, accepted=[3, 3, 2, 2]),
    ]
    summary = summarise(runs)
    (line,) = captions(summary)
    # tau 10/8 = 1.25 at 0.5x: one of its steps cost 2.5 plain steps, so it needs tau above 2.5.
    assert line == (
        "slow is slower than plain decoding here (0.50x): it produced 1.25 tokens per target pass, but one "
        "of its steps (drafting plus verifying the draft) took as long as 2.50 plain decoding steps on this "
        "device, so it needs an acceptance length above 2.50 to pay off."
    )


def test_stage_table_totals_the_stages():
    stages = [("train", 90.0), ("eval", 30.0)]
    assert stage_table(stages).splitlines()[-1] == "| total | 120.0 s (2.0 min) |"
    with stage("a named stage"):
        pass
    assert STAGES[-1][0] == "a named stage" and STAGES[-1][1] >= 0.0


def test_greedy_runs_report_agreement_with_plain_decoding():
    assert agreement([5, 6, 7, 8], [5, 6, 9, 8], greedy=True) == (False, 2)
    assert agreement([5, 6], [5, 6, 7], greedy=True) == (False, 2)  # a prefix is not the same output
    assert agreement([5, 6, 7], [5, 6, 7], greedy=True) == (True, 3)
    assert agreement([5, 6, 7], [1, 2, 3], greedy=False) == (None, None)
    runs = [
        Run("baseline", "1", "math", 1, new_tokens=4, steps=3, seconds=1.0, same_output=True, common_prefix=4),
        Run("tuned", "1", "math", 1, new_tokens=4, steps=2, seconds=1.0, same_output=False, common_prefix=2),
        Run("tuned", "2", "math", 1, new_tokens=6, steps=2, seconds=1.0, same_output=True, common_prefix=6),
        Run("sampled", "1", "math", 1, new_tokens=4, steps=2, seconds=1.0),
    ]
    s = summarise(runs)["methods"]
    assert s["tuned"]["same_output"] == 0.5 and s["tuned"]["matched_fraction"] == pytest.approx(8 / 10)
    assert "same_output" not in s["sampled"]
    runs.append(Run("tuned", "3", "math", 1, new_tokens=4, steps=2, seconds=1.0, accepted=[1, 3]))
    table = depth_table(summarise(runs), depths=3).splitlines()
    assert table[0] == "| method | P(>=1) | P(>=2) | P(>=3) |"
    assert table[2] == "| tuned | 0.50 | 0.50 | 0.00 |" and len(table) == 4  # no baseline row


@pytest.mark.slow
def test_cli_writes_table_json_csv_and_plots(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "rep", "prompt": "Repeat exactly: one two three four five six seven."})
        + "\n"
        + json.dumps({"id": "b", "category": "chat", "turns": ["Say hello.", "Now say it again."]})
        + "\n"
    )
    out = tmp_path / "out"
    main(
        [
            "--drafter",
            "prompt_lookup",
            "--drafter",
            "oracle?num_tokens=4",
            "--drafter",
            "draft_lm?layers=2&depth=2",
            "--prompts",
            str(prompts),
            "--turns",
            "2",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
            "--dtype",
            "float32",
        ]
    )  # exact only in fp32: bf16 tree passes drift from one-token decoding
    printed = capsys.readouterr().out
    assert (
        "| method | accept len | tok/s | speedup | nodes / step | drafted steps | same output | chat (tau / x) "
        "| rep (tau / x) |"
    ) in printed
    result = json.loads((out / "results.json").read_text())
    methods = result["methods"]
    assert set(methods) == {"baseline", "prompt_lookup", "oracle", "draft_lm"}
    for name, stats in methods.items():
        for key in (
            "acceptance_length",
            "speedup",
            "tokens_per_second",
            "baseline_tokens_per_second",
            "num_prompts",
            "new_tokens",
        ):
            assert key in stats, (name, key)
        assert stats["num_prompts"] == 3  # prompt a has one turn, prompt b two
        assert stats["new_tokens"] == methods["baseline"]["new_tokens"]  # greedy: same output everywhere
        assert stats["same_output"] == 1.0 and stats["matched_fraction"] == 1.0, name
    assert methods["oracle"]["acceptance_length"] > 2.5
    assert methods["baseline"]["acceptance_length"] == pytest.approx(1.0)
    assert methods["baseline"]["mean_tree_nodes"] == 0 and methods["baseline"]["drafted_steps"] == 0
    # Drafts are capped by the tokens left to generate, so the last steps draft fewer.
    assert 2 < methods["oracle"]["mean_tree_nodes"] <= 4 and 1.5 < methods["draft_lm"]["mean_tree_nodes"] <= 2
    assert (out / "results.csv").read_text().startswith("method,category,acceptance_length")
    for png in ("acceptance_by_category.png", "accepted_per_step.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_prompts_per_category_keep_file_order(tmp_path):
    from draftsmith.data_prep.prompts import load_prompts

    mt_bench = load_prompts("mt_bench")
    assert len(mt_bench) == 80 and len({p.category for p in mt_bench}) == 8
    two = load_prompts("mt_bench", per_category=2)
    assert len(two) == 16 and all(sum(p.category == c for p in two) == 2 for c in {p.category for p in two})
    assert [p.id for p in two if p.category == "writing"] == [p.id for p in mt_bench if p.category == "writing"][:2]
    assert [p.id for p in load_prompts("mt_bench", limit=3, per_category=2)] == [p.id for p in two[:3]]
    coding = load_prompts("mt_bench", category="coding")
    assert [p.id for p in coding] == [p.id for p in mt_bench if p.category == "coding"] and len(coding) == 10
    with pytest.raises(DataError, match=r"no prompt of category 'code'; its categories: coding, extraction"):
        load_prompts("mt_bench", category="code")


def test_hf_assistant_must_name_a_draft_lm_drafter(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "--drafter",
                "draft_lm?layers=2&name=before",
                "--drafter",
                "prompt_lookup",
                "--hf-baseline",
                "hf_assisted",
                "--hf-assistant",
                "after",
            ]
        )
    assert exit_.value.code == 2
    assert "--hf-assistant after: no draft_lm drafter of that name" in capsys.readouterr().err


@pytest.mark.slow
def test_hf_assisted_runs_only_the_chosen_assistant(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Count from one to ten."}) + "\n")
    out = tmp_path / "out"
    main(
        [
            "--drafter",
            "draft_lm?layers=2&depth=2&name=small",
            "--drafter",
            "draft_lm?layers=30&depth=2&name=whole",
            "--hf-baseline",
            "hf_assisted",
            "--hf-assistant",
            "whole",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
        ]
    )
    methods = json.loads((out / "results.json").read_text())["methods"]
    assert set(methods) == {"baseline", "small", "whole", "hf_assisted"}
    # The assistant is the 30-layer copy of the target: both engines accept every drafted token
    # (2 per pass plus the bonus: 11 tokens after prefill in 4 passes), which a 2-layer draft would not.
    assert methods["whole"]["acceptance_length"] == pytest.approx(11 / 4)
    assert methods["hf_assisted"]["acceptance_length"] == pytest.approx(11 / 4)
    assert methods["small"]["acceptance_length"] < 2


def test_a_request_past_the_targets_context_exits_2_with_one_line(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer("default")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=80,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": "Summarise: " + "the cat sat on the mat. " * 20}) + "\n")
    line = user_error(
        capsys,
        main,
        [
            "--target",
            str(tmp_path / "target"),
            "--drafter",
            "prompt_lookup",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert "max_position_embeddings=80" in line and "max_new_tokens=8" in line


def test_a_recipe_gives_the_target_and_its_eval_section_and_flags_win(tmp_path, capsys):
    """``--recipe``: the recipe's target and eval section are the defaults (no section is parsed and
    left unread); a flag given wins; a bad eval key is one line naming it, exit 2."""
    import yaml

    from draftsmith.eval.run import parse_args

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    recipe = tmp_path / "r.yaml"
    sections = {
        "target": {"name": "some/folder", "dtype": "float32"},
        "drafter": {"kind": "eagle3", "ttt_steps": 3},
        "eval": {"bench": str(prompts), "limit": 3, "max_new_tokens": 40, "temperature": 0.7},
    }
    recipe.write_text(yaml.safe_dump(sections))
    args = parse_args(["--recipe", str(recipe), "--drafter", "prompt_lookup"])
    assert (args.target, args.dtype, args.prompts, args.limit, args.max_new_tokens, args.temperature) == (
        "some/folder",
        "float32",
        str(prompts),
        3,
        40,
        0.7,
    )
    args = parse_args(["--recipe", str(recipe), "--drafter", "suffix", "--max-new-tokens", "9", "--target", "default"])
    assert (args.target, args.max_new_tokens, args.limit) == ("default", 9, 3)
    assert parse_args(["--drafter", "suffix"]).max_new_tokens == 256  # no recipe: the command's own defaults
    sections["eval"] = {"max_tokens": 5}
    recipe.write_text(yaml.safe_dump(sections))
    line = user_error(capsys, main, ["--recipe", str(recipe), "--drafter", "suffix"])
    assert "r.yaml" in line and "eval.max_tokens" in line and "eval.max_new_tokens" in line, line
