"""`rlft compare`: a ledger of runs against the first one (the baseline).

One row per run: the config values that differ from the baseline (dotted keys), the final reward,
KL, completion length and held-out metrics, status and wall time, and a flag on runs that change
more than one setting at once: with two changes, a difference in results cannot be attributed.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rlft.monitor.runlog import RunData, flatten, is_number, load_runs

# Not experimental settings: they differ between any two runs, or do not change what is trained.
IGNORED = ("output_dir", "logging.", "training.num_threads", "checkpoint.")
FINAL_KEYS = ("reward/mean", "kl", "entropy", "completion/length_mean")


def _ignored(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in IGNORED)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def final_metrics(run: RunData) -> dict[str, float]:
    """Final training metrics (last logged values) and held-out metrics (summary.json's eval/*
    when present, else the last logged eval/* values)."""
    out = {k: v for k in FINAL_KEYS if (v := run.last_value(k)) is not None}
    evals = {k: float(v) for k, v in run.summary.items() if k.startswith("eval/") and is_number(v)}
    for key in run.numeric_keys():
        if key.startswith("eval/") and key not in evals:
            evals[key] = run.last_value(key)  # type: ignore[assignment]
    return {**out, **dict(sorted(evals.items()))}


def compare_runs(run_dirs: list[str | Path]) -> list[dict[str, Any]]:
    """One row per run, the first run being the baseline: run, status, steps, wall_time_s,
    changes ({dotted key: value} vs the baseline), n_changes, multi_change, then final metrics."""
    runs = load_runs(list(run_dirs))
    base = {k: v for k, v in flatten(runs[0].config).items() if not _ignored(k)} if runs else {}
    rows = []
    for i, run in enumerate(runs):
        flat = {k: v for k, v in flatten(run.config).items() if not _ignored(k)}
        changes = {k: flat.get(k) for k in sorted(set(base) | set(flat)) if not _same(base.get(k), flat.get(k))}
        rows.append({"run": run.name, "baseline": i == 0, "status": run.status, "steps": run.last_step,
                     "wall_time_s": run.wall_time_s(), "changes": changes, "n_changes": len(changes),
                     "multi_change": len(changes) > 1, **final_metrics(run)})
    return rows


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    return list(cols)


def _cell(key: str, value: Any) -> str:
    if key == "changes":
        return "; ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    cols = _columns(rows)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        for row in rows:
            writer.writerow([_cell(c, row.get(c)) if c == "changes" else row.get(c, "") for c in cols])
    return path


def to_markdown(rows: list[dict[str, Any]]) -> str:
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [_cell(c, row.get(c)).replace("|", "\\|").replace("\n", " ") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(to_markdown(rows))
    return path


# The terminal table has one row per setting or metric and one column per run, so a long metric
# name costs its width once and each run one column; runs that do not fit at RUN_MIN characters go
# to further tables, each beside the baseline again (run columns under ~14 characters fold numbers
# and names into unreadable pieces: 80 columns once gave 12 columns of 3 characters).
LABEL_MAX = 28  # the widest label column (eval/format_compliance is 22); longer names fold
RUN_MIN, RUN_MAX = 14, 48  # a run column's width: never narrower; names past what it gets end in '...'


def _run_tables(n_runs: int, width: int, label_width: int) -> list[list[int]]:
    """The run indices of each table: the baseline (0) first in every one, then as many runs as fit."""
    # a column costs its width, 2 of padding and 1 rule; the table 1 rule more
    room = max(1, (width - label_width - 4) // (RUN_MIN + 3))
    per_table = max(1, room - 1)  # besides the baseline
    others = list(range(1, n_runs))
    return [[0, *others[i:i + per_table]] for i in range(0, len(others), per_table)] or [[0]]


def print_table(rows: list[dict[str, Any]], console: Any = None) -> None:
    """The ledger as rich tables fitted to the terminal: settings and metrics as rows, runs as
    columns (the baseline first); runs changing more than one setting are marked."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    if not rows:
        return
    fields = [c for c in _columns(rows) if c not in ("run", "baseline", "multi_change", "n_changes")]
    label_width = min(max([len(f) for f in fields] + [1]), LABEL_MAX)
    groups = _run_tables(len(rows), console.width, label_width)
    for group in groups:
        # the run columns share what the label column leaves, each at most RUN_MAX wide
        widest = max(RUN_MIN, min(RUN_MAX, (console.width - label_width - 4) // len(group) - 3))
        table = Table(title="runs vs the first (baseline)" + ("" if len(groups) == 1 else (
            f" (run {group[1] + 1} of {len(rows)})" if len(group) == 2
            else f" (runs {group[1] + 1}-{group[-1] + 1} of {len(rows)})")))
        table.add_column("", width=label_width, overflow="fold")
        for i in group:
            name = rows[i]["run"]
            table.add_column(Text(name, no_wrap=True, overflow="ellipsis"), min_width=RUN_MIN, max_width=widest,
                             overflow="fold")
        for field in fields:
            cells = []
            for i in group:
                row = rows[i]
                if field == "changes":  # one change a line
                    changes = escape(_cell("changes", row["changes"])).replace("; ", "\n")
                    cell = "(baseline)" if row["baseline"] else changes
                    if row["multi_change"]:
                        cell += f"\n[bold yellow]{row['n_changes']} changes: not one change per experiment"
                else:
                    cell = escape(_cell(field, row.get(field)))
                cells.append(cell)
            table.add_row(field, *cells)
        console.print(table)
