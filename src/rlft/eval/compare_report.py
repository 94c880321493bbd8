"""What `rlft eval TARGET --compare BASELINE` prints and saves: a table, and a JSON file with the
settings, the counts and every pair's record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlft.errors import RlftError
from rlft.eval.compare import Comparison, build_judge, compare_models, model_folders
from rlft.eval.run import data_stem, write_new
from rlft.monitor.console import console


def comparison_path(data: str, run_dir: Path | None, out: Path | None) -> Path | None:
    """--out when given, else RUN/evals/compare-<data stem>.json for a run (a later comparison on
    the same data: compare-<data stem>-2.json, -3, ...; see `write_new`), else nowhere."""
    if out is not None:
        return out
    return None if run_dir is None else run_dir / "evals" / f"compare-{data_stem(data)}.json"


def save_comparison(comparison: Comparison, data: str, path: Path, settings: dict[str, Any],
                    keep_existing: bool = False) -> Path:
    """`keep_existing`: a default path under RUN/evals/ never replaces an earlier comparison."""
    text = json.dumps({
        "target": comparison.target, "baseline": comparison.baseline, "data": data, "judge": comparison.judge,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": settings, "metrics": comparison.metrics,
        "records": comparison.records}, indent=2, default=str)
    if keep_existing:
        return write_new(path.parent, path.stem, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def comparison_table(comparison: Comparison, data: str) -> Any:
    from rich.table import Table

    r = comparison.result
    table = Table(title=f"{comparison.target} vs {comparison.baseline} on {data}", show_header=False)
    table.add_row("judge", comparison.judge)
    table.add_row("pairs judged", str(r.wins + r.ties + r.losses))
    if comparison.unscored:
        table.add_row("unscored (left out)", str(comparison.unscored))
    table.add_row("wins / ties / losses", f"{r.wins} / {r.ties} / {r.losses}")
    table.add_row("win rate (ties count half)", f"{r.rate:.3f}")
    table.add_row("95% interval (Wilson)", f"[{r.low:.3f}, {r.high:.3f}]")
    return table


def compare_command(target: Path, baseline: Path | None, data: str, cfg: Any, rewards: list[Any], *,
                    explicit_rewards: bool, judge: str | None, judge_model: Path | None, run_dir: Path | None,
                    out: Path | None, scoring: Any = None, **options: Any) -> Comparison:
    """`rlft eval TARGET --compare BASELINE [--judge F | --judge-model M]`: refuse contradictory
    flags, compare, save (see `comparison_path`) and print the table."""

    if baseline is None:
        raise RlftError("--judge and --judge-model judge a comparison; add --compare BASELINE")
    if judge and judge_model:
        raise RlftError("give one judge: --judge module:function or --judge-model FOLDER, not both")
    if explicit_rewards and (judge or judge_model):
        raise RlftError("give one way to judge: --reward (the higher total reward wins), --judge or --judge-model")
    model_folders(target, baseline)  # a wrong path is named before a judge or reward model loads
    chosen = build_judge(rewards, judge, str(judge_model) if judge_model else None, scoring)
    comparison = compare_models(target, baseline, data, cfg, chosen, **options)
    path = comparison_path(data, run_dir, out)
    if path is not None:
        settings = {"eval": cfg.model_dump(mode="json"), "seed": options.get("seed", 0),
                    "split": options.get("split", "train"),
                    "rewards": [] if judge or judge_model else [r.model_dump(mode="json") for r in rewards]}
        if options.get("agent") is not None:  # the answers were episodes with these tools and limits
            settings["agent"] = options["agent"].model_dump(mode="json")
        console.print(f"comparison saved to {save_comparison(comparison, data, path, settings, keep_existing=out is None)}")
    console.print(comparison_table(comparison, data))
    return comparison
