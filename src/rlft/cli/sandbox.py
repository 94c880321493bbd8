"""`rlft sandbox run`: run one program against a tests file in the code-reward sandbox and show
the verdict. Handy to check a dataset's tests, or why a completion scored what it did."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Run programs in the code-reward sandbox.", no_args_is_help=True, add_completion=False)


@app.callback()
def sandbox() -> None:
    """Run programs in the code-reward sandbox."""  # a callback keeps `run` a subcommand


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(f"{what} file not found: {path}")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"cannot read {what} file {path}: {exc}")
    raise AssertionError("unreachable")


@app.command("run")
def run(
    code: Path = typer.Option(..., "--code", help="Python file to run (with --extract: a model completion)."),
    tests: Path = typer.Option(..., "--tests", help='JSON tests: {"fn_name": ..., "cases": [{"input": [...], '
                               '"output": ...}]} or {"cases": [{"stdin": ..., "stdout": ...}]}.'),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
    timeout: float = typer.Option(10.0, "--timeout", help="Wall-clock seconds for the program over all tests."),
    extract: bool = typer.Option(False, "--extract", help="Run the last fenced code block of the file."),
) -> None:
    """Run CODE against TESTS; exit 0 with a verdict, 1 if the sandbox failed, 2 for bad input."""
    from rlft.paths import text_file_problem
    from rlft.rewards.code import judge_completion, parse_tests, run_program
    from rlft.rewards.code.cases import BadTests

    for problem in (text_file_problem(code, "--code", "a program to run", (".py", ".md"),
                                      "give the program's .py file (with --extract: a completion's text)"),
                    text_file_problem(tests, "--tests", "a JSON tests file", (".json",),
                                      'give one JSON object: {"fn_name": ..., "cases": [...]} or {"cases": [...]}')):
        if problem:
            _fail(problem.replace("\nFix: ", "; fix: "))  # this command's errors are one line
    source, raw_tests = _read(code, "code"), _read(tests, "tests")
    try:
        parse_tests(raw_tests)
    except BadTests as exc:
        _fail(f"{tests}: {exc}")
    if timeout <= 0:
        _fail(f"--timeout must be positive, got {timeout}")
    verdict = judge_completion(source, raw_tests, timeout=timeout) if extract else run_program(source, raw_tests, timeout)
    if as_json:
        typer.echo(json.dumps(verdict.to_dict(), indent=2))
    else:
        _print_table(verdict)
    if verdict.status == "infra_error":
        raise typer.Exit(1)


def _print_table(verdict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    score = "unverifiable" if verdict.score is None else f"{verdict.score:.3f}"
    parts = "" if not verdict.parts else "  (" + ", ".join(f"{k} {v:.2f}" for k, v in verdict.parts.items()) + ")"
    console.print(f"status: {verdict.status}   score: {score}{parts}   passed: {verdict.passed}/{verdict.total}")
    if verdict.message:
        console.print(f"message: {verdict.message}", markup=False)
    if verdict.cases:
        table = Table(box=box.SIMPLE, show_edge=False)
        for column in ("case", "status", "time (s)", "detail"):
            table.add_column(column)
        for case in verdict.cases:
            table.add_row(str(case.index), case.status, f"{case.time_s:.3f}", case.detail)
        console.print(table)
    layers = ", ".join(f"{k}={v}" for k, v in verdict.layers.items())
    console.print(f"isolation: {layers}", markup=False)
