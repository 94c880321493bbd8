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


def print_table(rows: list[dict[str, Any]], console: Any = None) -> None:
    """The ledger as a rich table; runs changing more than one setting are marked."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title="runs vs the first (baseline)")
    cols = [c for c in _columns(rows) if c not in ("baseline", "multi_change", "n_changes")]
    for col in cols:
        table.add_column(col, overflow="fold")
    for row in rows:
        cells = [escape(_cell(c, row.get(c))) for c in cols]
        if row["baseline"]:
            cells[cols.index("changes")] = "(baseline)"
        elif row["multi_change"]:
            cells[cols.index("changes")] += f"\n[bold yellow]{row['n_changes']} changes: not one change per experiment"
        table.add_row(*cells)
    console.print(table)
