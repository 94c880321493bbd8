"""`rlft plan CONFIG`: the memory a training config needs, from config.json alone, before any
weight is loaded; a verdict for a device and the changes that would make it fit."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer



def plan(
    config_path: Path = typer.Argument(..., help="Training config YAML."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides: section.key=value ... (as rlft train)."),
    device: Optional[str] = typer.Option(None, "--device", help="e.g. 'H100 80GB' (or 'h100'), 'A100 40GB', "
                                         "'L4 24GB'; the servers' devices too."),
    memory_gb: Optional[float] = typer.Option(None, "--memory-gb", help="Device memory in GiB (instead of --device)."),
    world_size: int = typer.Option(1, "--world-size", min=1, help="Ranks sharing the model (FSDP); with "
                                   "rollout.servers, the trainer's devices (the servers take "
                                   "len(rollout.servers) x rollout.server.tensor_parallel_size more)."),
    devices: Optional[int] = typer.Option(None, "--devices", min=1, help="Devices there are in all (e.g. 8): "
                                          "whether the trainer and the servers fit on them."),
    worst_case: bool = typer.Option(False, "--worst-case", help="Plan every row at data.max_prompt_length / "
                                    "data.max_length instead of the longest row in the data."),
) -> None:
    """Estimate the memory of a training run before loading any weights."""
    from rlft.config import load_config
    from rlft.paths import config_file_problem, stop_on
    from rlft.plan.inputs import plan_report

    stop_on(config_file_problem(config_path, "CONFIG"))
    typer.echo(plan_report(load_config(config_path, list(overrides or [])), device, memory_gb, world_size, worst_case,
                           devices))


def register(app: typer.Typer) -> None:
    app.command("plan", help="Estimate a config's GPU memory from config.json alone: fits or not, and fixes.")(plan)
