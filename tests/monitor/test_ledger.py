"""The run ledger: changes against the first run, final metrics, the one-change flag, writers."""

from __future__ import annotations

import csv

from rich.console import Console

from monitor.conftest import online_metrics
from rlft.monitor.ledger import compare_runs, print_table, to_markdown, write_csv, write_markdown


def test_rows_hold_changes_vs_the_baseline_final_metrics_and_the_multi_change_flag(make_online_run):
    base = make_online_run("base")
    one = make_online_run("lr", training__learning_rate=3e-5, logging__progress=True)  # logging is not a setting
    two = make_online_run("lr+temp", training__learning_rate=3e-5, rollout__temperature=0.7,
                          metrics=online_metrics(reward_slope=0.03),
                          summary={"status": "interrupted", "step": 30, "eval/accuracy": 0.7, "wall_time_s": 75.0})
    rows = compare_runs([base, one, two])
    assert [r["run"] for r in rows] == ["base", "lr", "lr+temp"]
    assert rows[0]["changes"] == {} and rows[0]["baseline"] and not rows[0]["multi_change"]
    assert rows[1]["changes"] == {"training.learning_rate": 3e-5} and not rows[1]["multi_change"]
    assert rows[2]["changes"] == {"rollout.temperature": 0.7, "training.learning_rate": 3e-5}
    assert rows[2]["multi_change"] and rows[2]["n_changes"] == 2
    # final values: last logged reward 0.2 + 0.02 * 30 = 0.8 (0.2 + 0.03 * 30 = 1.1 for the third run)
    assert rows[0]["reward/mean"] == 0.2 + 0.02 * 30 and rows[2]["reward/mean"] == 0.2 + 0.03 * 30
    assert rows[0]["kl"] == 0.001 * 30 and rows[0]["completion/length_mean"] == 40.0
    # held-out: the last logged eval (0.3 + 0.01 * 30) unless summary.json has its own
    assert rows[0]["eval/accuracy"] == 0.3 + 0.01 * 30 and rows[2]["eval/accuracy"] == 0.7
    assert rows[0]["status"] == "completed" and rows[2]["status"] == "interrupted"
    assert rows[0]["wall_time_s"] == 60.0 and rows[2]["wall_time_s"] == 75.0  # 30 x 2 s; summary's own
    assert rows[0]["steps"] == 30


def test_a_key_present_in_only_one_run_is_a_change(make_online_run):
    base = make_online_run("base")
    other = make_online_run("other", algorithm__dual_clip=3.0)
    assert compare_runs([base, other])[1]["changes"] == {"algorithm.dual_clip": 3.0}


def test_csv_markdown_and_table(make_online_run, tmp_path):
    rows = compare_runs([make_online_run("base"),
                         make_online_run("b", training__learning_rate=3e-5, rollout__temperature=0.7)])
    with write_csv(rows, tmp_path / "l.csv").open() as f:
        table = list(csv.DictReader(f))
    assert table[1]["run"] == "b" and table[1]["multi_change"] == "True"
    assert table[1]["changes"] == "rollout.temperature=0.7; training.learning_rate=3e-05"
    assert float(table[0]["reward/mean"]) == rows[0]["reward/mean"]  # full precision in CSV
    md = write_markdown(rows, tmp_path / "l.md").read_text()
    assert md == to_markdown(rows)
    lines = md.splitlines()
    assert lines[0].startswith("| run | baseline | status |") and len(lines) == 4
    assert all(ln.count("|") == lines[0].count("|") for ln in lines)
    console = Console(record=True, width=250)
    print_table(rows, console)
    text = console.export_text()
    assert "(baseline)" in text and "2 changes: not one change per experiment" in text


def test_three_or_more_runs_stay_readable_in_80_columns(make_online_run):
    """Before: one row per run and a column per metric, so `rlft compare A B C` in an 80-column
    terminal folded every name, status and number into columns of 3 characters. Now runs are
    columns of at least 14 characters beside whole metric names; runs that do not fit go to
    another table, beside the baseline again."""
    names = ["grpo-baseline-qwen2.5-0.5b-instruct", "grpo-lr3e-5", "grpo-temperature-0.7-and-lr"]
    runs = [make_online_run(names[0]), make_online_run(names[1], training__learning_rate=3e-5),
            make_online_run(names[2], training__learning_rate=3e-5, rollout__temperature=0.7,
                            summary={"status": "interrupted", "step": 30, "eval/accuracy": 0.7})]
    rows = compare_runs(runs)
    console = Console(record=True, width=80)
    print_table(rows, console)
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert sum("runs vs the first (baseline)" in line for line in lines) == 1  # three runs: one table
    top = next(line for line in lines if line.startswith("┏"))
    columns = [len(part) for part in top.strip("┏┓").split("┳")][1:]  # after the label column
    assert len(columns) == 3 and min(columns) >= 14 + 2  # + padding
    header = next(line for line in lines if line.startswith("┃"))
    assert "grpo-lr3e-5 " in header and "grpo-baseline-…" in header  # a long name: its first 14 characters, cut
    assert all(name[:14] in header for name in names)
    text = "\n".join(lines)
    for key in ("status", "changes", "reward/mean", "completion/length_mean", "eval/format_compliance"):
        assert any(line.startswith(f"│ {key} ") for line in lines), key  # every metric name whole
    assert "interrupted" in text and "completed" in text and "(baseline)" in text
    row = next(line for line in lines if line.startswith("│ eval/accuracy "))
    assert [cell.strip() for cell in row.strip("│").split("│")][1:] == [f"{rows[0]['eval/accuracy']:.4g}",
                                                                        f"{rows[1]['eval/accuracy']:.4g}", "0.7"]

    more = compare_runs(runs + [make_online_run(f"seed-{s}", seed=s) for s in (1, 2)])
    console = Console(record=True, width=80)
    print_table(more, console)
    text = console.export_text()
    assert "(runs 2-3 of 5)" in text and "(runs 4-5 of 5)" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    headers = [line for line in text.splitlines() if line.startswith("┃")]
    assert len(headers) == 2 and all("grpo-baseline-" in h.split("┃")[2] for h in headers)  # beside the baseline
    assert "seed-1" in headers[1] and "seed-2" in headers[1]
