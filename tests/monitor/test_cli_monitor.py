"""`rlft report` and `rlft compare` through typer, registered on a fresh app as cli.py will do."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from rlft.cli_monitor import register


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
    a, b = make_online_run("a"), make_online_run("b", training__learning_rate=3e-5)
    result = CliRunner().invoke(_app(), ["compare", str(a), str(b), "--csv", str(tmp_path / "l.csv"),
                                         "--markdown", str(tmp_path / "l.md")])
    assert result.exit_code == 0, result.output
    assert "baseline" in result.output and (tmp_path / "l.csv").exists()
    assert "training.learning_rate=3e-05" in (tmp_path / "l.md").read_text()


def test_a_bad_run_directory_is_an_rlft_error(tmp_path):
    # cli.main turns RlftError into one 'error:' line; here it surfaces as the exception
    result = CliRunner().invoke(_app(), ["report", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "run directory not found" in str(result.exception)
