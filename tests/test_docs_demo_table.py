"""The demo's acceptance table says what its same-output column measures at the run's dtype: exact
equality in float32, rounding drift in bf16 (where 50% is not a lossy engine), and nothing for
sampled runs."""

from draftsmith.eval.measure import Run
from draftsmith.eval.report import markdown_table, summarise, write_results


def _greedy_runs() -> list[Run]:
    """Two prompts, plain decoding and one drafter that parts from plain on the second prompt
    after 6 of 10 tokens (what bf16 drift produces)."""
    return [
        Run("baseline", "1", "math", 1, new_tokens=8, steps=7, seconds=1.0, same_output=True, common_prefix=8),
        Run("baseline", "2", "code", 1, new_tokens=10, steps=9, seconds=1.0, same_output=True, common_prefix=10),
        Run("eagle", "1", "math", 1, 8, 4, 0.5, [2, 2, 2, 1], same_output=True, common_prefix=8),
        Run("eagle", "2", "code", 1, 10, 5, 0.6, [2, 2, 2, 2, 1], same_output=False, common_prefix=6),
    ]


def _lines(table: str) -> tuple[list[str], list[str]]:
    """(table rows, the text after the table)."""
    rows = [line for line in table.splitlines() if line.startswith("|")]
    rest = [line for line in table.splitlines() if line and not line.startswith("|")]
    return rows, rest


def test_bf16_table_labels_the_column_as_drift_and_shows_the_common_prefix(tmp_path):
    summary = summarise(_greedy_runs(), {"dtype": "bfloat16"})
    rows, rest = _lines(markdown_table(summary))
    head = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert "same as plain (bf16, drift expected)" in head and "same output" not in head
    column = head.index("same as plain (bf16, drift expected)")
    cells = {r.strip("|").split("|")[0].strip(): r.strip("|").split("|")[column].strip() for r in rows[2:]}
    # 1 of 2 outputs identical; 14 of 18 tokens before the first difference
    assert cells == {"baseline": "100% (100% of tokens)", "eagle": "50% (78% of tokens)"}
    (footnote,) = rest
    assert footnote.startswith("same as plain (bf16, drift expected): share of prompts")
    assert "rounding, not a lossy engine" in footnote and "--dtype float32" in footnote
    # table.md, what the demo leaves in results/demo, carries the same label and footnote
    write_results(_greedy_runs(), tmp_path, summary=summary)
    written = (tmp_path / "table.md").read_text()
    assert "| same as plain (bf16, drift expected) |" in written and footnote in written.splitlines()


def test_float32_table_keeps_exact_same_output_and_says_it_is_exact():
    rows, rest = _lines(markdown_table(summarise(_greedy_runs(), {"dtype": "float32"})))
    head = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert "same output" in head and not any("drift" in cell for cell in head)
    column = head.index("same output")
    assert [r.strip("|").split("|")[column].strip() for r in rows[2:]] == ["100%", "50%"]
    (footnote,) = rest
    assert "in float32 the engine is exact" in footnote and "drift" not in footnote


def test_fp16_is_labelled_as_drift_too_and_sampled_runs_get_no_column():
    rows, rest = _lines(markdown_table(summarise(_greedy_runs(), {"dtype": "float16"})))
    assert "same as plain (fp16, drift expected)" in rows[0] and rest[0].startswith("same as plain (fp16")
    sampled = [
        Run("baseline", "1", "math", 1, new_tokens=8, steps=7, seconds=1.0),
        Run("eagle", "1", "math", 1, 8, 4, 0.5, [2, 2, 2, 1]),
    ]
    rows, rest = _lines(markdown_table(summarise(sampled, {"dtype": "bfloat16"})))
    assert "same" not in rows[0] and rest == []


def test_the_demos_longer_training_lines_quote_benchmarks_first_table():
    """The figures the demo prints for longer training are rows of BENCHMARKS.md's first table, so
    that a re-measured table cannot leave the demo quoting old numbers (negative control: a figure
    that is not there is found missing)."""
    import re
    from pathlib import Path

    from draftsmith.eval.demo import LONGER

    benchmarks = (Path(__file__).resolve().parents[1] / "BENCHMARKS.md").read_text()
    first_table = benchmarks.split("## Current best figure per drafter kind and policy")[1].split("\n## ")[0]
    rows = [re.sub(r"\*\*", "", line) for line in first_table.splitlines() if line.startswith("|")]

    def quoted(accept: str, speedup: str) -> bool:
        return any(f"| {accept} | {speedup}x |" in row for row in rows)

    pairs = re.findall(r"(\d+\.\d+), (\d+\.\d+)x", LONGER)
    assert len(pairs) == 4 and all(quoted(*pair) for pair in pairs)
    assert not quoted("2.87", "1.81")
