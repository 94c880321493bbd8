"""The Python API: the same entry points as the CLI, for scripts and notebooks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.markup import escape

from rlft.config import Config, load_config
from rlft.errors import ResumeError
from rlft.launch import CHECKED_ENV
from rlft.training import checkpoint as ckpt


def _as_config(config: Config | dict[str, Any] | str | Path, overrides: list[str] | None) -> Config:
    if isinstance(config, Config):
        if overrides:
            return load_config(config.model_dump(mode="json"), overrides)
        return config
    return load_config(config, overrides)


def train(config: Config | dict[str, Any] | str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train as the config says; continues from the newest checkpoint if `output_dir` has one.
    Returns the run's summary (also written to `output_dir/summary.json`)."""
    cfg = _as_config(config, overrides)
    from rlft.models.loading import resolve_device
    from rlft.training.distributed import init_world, local_device

    # under torchrun: this process's rank (its own GPU, or gloo on CPU); else a single process
    world = init_world(resolve_device(cfg.model.device).type, cfg.training.dist_timeout_s)
    if world.active and cfg.model.quantization != "none":
        from rlft.errors import ConfigError

        # FSDP2 cannot shard bitsandbytes' packed parameters
        raise ConfigError("model.quantization=4bit trains on one GPU; run without --nproc / torchrun")
    if world.main and not os.environ.get(CHECKED_ENV):  # (rlft train --nproc checked it in the launcher)
        from rlft.cli_plan import memory_preflight
        from rlft.monitor.console import console

        # the memory plan before any weight loads: a warning, not a refusal
        warning = memory_preflight(cfg, world.size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if warning:
            console.print(f"[bold yellow]warning: {escape(warning)}")
    if world.active:
        model = cfg.model.model_copy(update={"device": local_device(cfg.model.device, world)})
        cfg = cfg.model_copy(update={"model": model})
    if cfg.is_online:
        from rlft.training.online import run_online

        return run_online(cfg, world)
    from rlft.training.offline import run_offline

    return run_offline(cfg, world=world)


def resume(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Continue a run from its newest intact checkpoint."""
    return train(*resume_config(run_dir, overrides))


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Path, list[str]]:
    """The config file and overrides that continue the run in `run_dir`."""
    root = Path(run_dir)
    if not (root / "config.yaml").is_file():
        raise ResumeError(f"{root} is not a run directory (no config.yaml)")
    if ckpt.find_latest(root / "checkpoints") is None:
        raise ResumeError(f"{root}: no complete checkpoint to resume from.\n"
                          f"Fix: start the run again with `rlft train {root / 'config.yaml'}`")
    return root / "config.yaml", [*(overrides or []), f"output_dir={root}"]
