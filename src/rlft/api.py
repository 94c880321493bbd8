"""The Python API: the same entry points as the CLI, for scripts and notebooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlft.config import Config, load_config
from rlft.errors import ResumeError
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
    if cfg.is_online:
        from rlft.training.online import run_online

        return run_online(cfg)
    from rlft.training.offline import run_offline

    return run_offline(cfg)


def resume(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Continue a run from its newest intact checkpoint."""
    root = Path(run_dir)
    if not (root / "config.yaml").is_file():
        raise ResumeError(f"{root} is not a run directory (no config.yaml)")
    if ckpt.find_latest(root / "checkpoints") is None:
        raise ResumeError(f"{root}: no complete checkpoint to resume from.\n"
                          f"Fix: start the run again with `rlft train {root / 'config.yaml'}`")
    return train(root / "config.yaml", [*(overrides or []), f"output_dir={root}"])
