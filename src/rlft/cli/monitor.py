"""`rlft report` and `rlft compare`: read run directories, train nothing.

`register(app)` adds both commands to the main typer app; they import only the monitor modules
(and plotly for the report) when run.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def report(
    runs: List[Path] = typer.Argument(..., help="Run directories (output_dir of training runs); several are overlaid."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="HTML file to write (default: FIRST_RUN/report.html)."),
    steps: Optional[List[int]] = typer.Option(None, "--step", help="Show sample completions of this step (repeatable; "
                                              "default: first, middle and last)."),
) -> None:
    from rlft.monitor.report import write_report
    from rlft.paths import output_file_problem, run_dir_problem, stop_on

    stop_on(*[run_dir_problem(run, "RUNS") for run in runs],
            out and output_file_problem(out, "--out", "the HTML report", "report.html", (".htm",)))
    path = write_report(runs, out or runs[0] / "report.html", sample_steps=steps or None)
    typer.echo(str(path))


def compare(
    runs: List[Path] = typer.Argument(..., help="Run directories; the first is the baseline."),
    csv: Optional[Path] = typer.Option(None, "--csv", help="Also write the ledger as CSV."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the ledger as a Markdown table."),
) -> None:
    from rlft.monitor.console import console
    from rlft.monitor.ledger import compare_runs, print_table, write_csv, write_markdown
    from rlft.paths import output_file_problem, run_dir_problem, stop_on

    stop_on(*[run_dir_problem(run, "RUNS") for run in runs],
            csv and output_file_problem(csv, "--csv", "the ledger", "ledger.csv", (".txt",)),
            markdown and output_file_problem(markdown, "--markdown", "the ledger", "ledger.md", (".markdown", ".txt")))
    rows = compare_runs(runs)
    print_table(rows, console)
    if csv is not None:
        typer.echo(f"wrote {write_csv(rows, csv)}")
    if markdown is not None:
        typer.echo(f"wrote {write_markdown(rows, markdown)}")


def register(app: typer.Typer) -> None:
    app.command("report", help="Write one self-contained HTML report (plots, health events, samples) of one "
                               "or more runs.")(report)
    app.command("compare", help="Compare runs against the first: config changes and final metrics "
                                "(table, --csv, --markdown).")(compare)
