"""The Python API: the same entry points as the CLI, for scripts and notebooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from rlft.config import Config, load_config
from rlft.errors import ConfigError, ResumeError
from rlft.models.loading import resolve_device
from rlft.monitor.console import console
from rlft.monitor.rundir import RunDir
from rlft.plan.fit import fit_memory
from rlft.training import checkpoint as ckpt
from rlft.training.distributed import init_world, local_device
from rlft.training.host_memory import keep_freed_pages
from rlft.training.offline.loop import run_offline
from rlft.training.online.loop import run_online


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

    device = resolve_device(cfg.model.device)
    # under torchrun: this process's rank (its own GPU, or gloo on CPU); else a single process
    world = init_world(device.type, cfg.training.dist_timeout_s)
    if world.active and cfg.model.quantization != "none":
        # FSDP2 cannot shard bitsandbytes' packed parameters
        raise ConfigError("model.quantization=4bit trains on one GPU; run without --nproc / torchrun")
    # the memory plan before any weight loads: the cheapest memory savers that fit, or a clean stop
    fit = fit_memory(cfg, world, device)
    cfg = fit.config
    if fit.roomy:  # memory to spare: the C heap keeps what it frees (CPU; see training.host_memory)
        keep_freed_pages(device)
    if world.main and fit.message:
        console.print(f"[bold yellow]{escape(fit.message)}")
    if world.active:
        model = cfg.model.model_copy(update={"device": local_device(cfg.model.device, world)})
        cfg = cfg.model_copy(update={"model": model})
    if cfg.is_online:
        summary = run_online(cfg, world, trim_heap=not fit.roomy)
    else:
        summary = run_offline(cfg, world=world)
    if fit.record and world.main:
        summary = RunDir(cfg.output_dir).update_summary({"memory_fit": fit.record})
    return summary


def resume(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Continue a run from its newest intact checkpoint."""
    return train(*resume_config(run_dir, overrides))


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Path, list[str]]:
    """The config file and overrides that continue the run in `run_dir`."""
    root = Path(run_dir).expanduser()
    if not (root / "config.yaml").is_file():
        raise ResumeError(f"{root} is not a run directory (no config.yaml)")
    if ckpt.find_latest(root / "checkpoints") is None:
        raise ResumeError(f"{root}: no complete checkpoint to resume from.\n"
                          f"Fix: start the run again with `rlft train {root / 'config.yaml'}`")
    return root / "config.yaml", [*(overrides or []), f"output_dir={root}"]
