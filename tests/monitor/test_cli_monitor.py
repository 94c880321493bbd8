"""`rlft report` and `rlft compare` through typer, registered on a fresh app as cli/app.py will do."""

from __future__ import annotations

import csv
import json

import typer
from typer.testing import CliRunner

from monitor.conftest import online_metrics
from rlft.cli.monitor import register


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_report_defaults_to_the_first_run_and_prints_the_path(make_online_run, tmp_path):
    a, b = make_online_run("a"), make_online_run("b", seed=1)
    result = CliRunner().invoke(_app(), ["report", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(a / "report.html")
    page = (a / "report.html").read_text()
    assert "Config fields that differ" in page and ">seed<" in page
    out = tmp_path / "elsewhere" / "x.html"
    result = CliRunner().invoke(_app(), ["report", str(a), "--out", str(out), "--step", "20"])
    assert result.exit_code == 0 and out.exists() and "<h3>step 10</h3>" not in out.read_text()


def test_compare_prints_and_writes(make_online_run, tmp_path):
    """The CSV `rlft compare` writes holds one row per run with that run's final metrics, read back
    from the runs' own metrics.jsonl (before: only that the file existed)."""
    a = make_online_run("a")
    b = make_online_run("b", training__learning_rate=3e-5, metrics=online_metrics(reward_slope=0.03),
                        summary={"status": "interrupted", "step": 30, "eval/accuracy": 0.7})
    result = CliRunner().invoke(_app(), ["compare", str(a), str(b), "--csv", str(tmp_path / "l.csv"),
                                         "--markdown", str(tmp_path / "l.md")])
    assert result.exit_code == 0, result.output
    assert "baseline" in result.output
    assert "training.learning_rate=3e-05" in (tmp_path / "l.md").read_text()
    with (tmp_path / "l.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == ["a", "b"]
    assert [r["baseline"] for r in table] == ["True", "False"]
    assert [r["status"] for r in table] == ["completed", "interrupted"]
    assert table[0]["changes"] == "" and table[1]["changes"] == "training.learning_rate=3e-05"
    for row, run in zip(table, (a, b)):
        last = logged_rows(run)[-1]
        assert int(row["steps"]) == last["step"] == 30
        for key in ("reward/mean", "kl", "entropy", "completion/length_mean"):
            assert float(row[key]) == last[key], key
    # held-out: the last logged eval for a, summary.json's own value for b
    assert float(table[0]["eval/accuracy"]) == [r for r in logged_rows(a) if "eval/accuracy" in r][-1]["eval/accuracy"]
    assert float(table[1]["eval/accuracy"]) == 0.7
    assert float(table[1]["reward/mean"]) != float(table[0]["reward/mean"])  # the runs' own numbers


def logged_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_bad_run_directory_is_an_rlft_error(tmp_path):
    # cli.main turns RlftError into one 'error:' line; here it surfaces as the exception
    result = CliRunner().invoke(_app(), ["report", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "run directory not found" in str(result.exception)
