"""What a checkpoint holds, and the way back from one: the run's named state parts, saved with the
weights (the last N kept, and the best by a logged metric), and the newest intact checkpoint
loaded back into the policy and every part.

A part is anything with `state_dict()` / `load_state_dict()` that must survive a restart: the
optimizer and scheduler, the non-finite guard, the monitor, the clock (registered by the
session), the data order, a KL controller, the rollout engine's streams, a critic, an async run's
queue of scored batches (registered by their owners with `TrainingSession.register`). A part with
`sharded = True` (the optimizer under FSDP) is written by every rank and resharded on load.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from rlft.config import CheckpointConfig
from rlft.errors import ResumeError
from rlft.models.loading import LoadedModel
from rlft.models.template import check_template
from rlft.monitor.rundir import RunDir
from rlft.training import checkpoint as ckpt
from rlft.training.distributed import World


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunState:
    """The registered parts of a run and its checkpoints directory (see the module docstring)."""

    def __init__(self, run: RunDir, policy: LoadedModel, checkpointing: CheckpointConfig, world: World,
                 allow_template_change: bool = False):
        self.run, self.policy, self.config, self.world = run, policy, checkpointing, world
        self.allow_template_change = allow_template_change
        self.parts: dict[str, Stateful] = {}
        self._saved_step: int | None = None

    def register(self, name: str, part: Stateful) -> None:
        """Checkpoint `part` under `name` and load it back on resume."""
        if name in self.parts:
            raise ValueError(f"state part {name!r} is registered twice")
        self.parts[name] = part

    def due(self, step: int, total_steps: int) -> bool:
        every = self.config.every
        return bool(every) and step % every == 0 and step < total_steps

    def save(self, step: int, last_metrics: dict[str, Any]) -> Path:
        """Save step `step` (once: a second call at the same step returns the same checkpoint),
        keeping the last N and, with checkpoint.keep_best, the best by `last_metrics`' value. The
        policy's unsharded weights must be up to date (the session syncs them first)."""
        if self._saved_step == step:  # already saved at this step (e.g. as a new best)
            return ckpt.checkpoint_path(self.run.checkpoints, step)
        cfg = self.config
        best = ckpt.read_best(self.run.checkpoints)
        protect = {best["checkpoint"]} if best else set()
        sharded = self.world.active  # optimizer states stay sharded: every rank writes its part
        parts = {name: part.state_dict() for name, part in self.parts.items()
                 if not (sharded and getattr(part, "sharded", False))}
        shards = {name: part.state_dict() for name, part in self.parts.items()
                  if sharded and getattr(part, "sharded", False)}
        weights = self.policy.unsharded()
        path = ckpt.save_checkpoint(self.run.checkpoints, step, weights.model, weights.is_lora,
                                    self.policy.tokenizer, {"parts": parts, "world_size": self.world.size},
                                    cfg.keep_last, protect, world=self.world, sharded=shards or None)
        value = last_metrics.get(cfg.keep_best) if cfg.keep_best else None
        if value is not None and math.isfinite(value) and self.world.main:
            if self._better(value, best):
                ckpt.record_best(self.run.checkpoints, path.name, cfg.keep_best, value)
                if best and best["checkpoint"] != path.name:  # the previous best is now an ordinary one
                    ckpt.prune(self.run.checkpoints, cfg.keep_last, {path.name})
        self._saved_step = step
        return path

    def improves_best(self, record: dict[str, Any]) -> bool:
        """Whether the logged `record` beats the recorded best (checkpoint.keep_best)."""
        cfg = self.config
        value = record.get(cfg.keep_best) if cfg.keep_best else None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return self._better(value, ckpt.read_best(self.run.checkpoints))

    def _better(self, value: float, best: dict[str, Any] | None) -> bool:
        return best is None or (value > best["value"] if self.config.best_mode == "max" else value < best["value"])

    def resume(self) -> tuple[Path, int] | None:
        """Load the newest intact checkpoint into the policy and every registered part, and the
        random states; (its path, its step), or None on a fresh start. The run's logs are cut back
        to that step (to nothing on a fresh start: an attempt that never reached a checkpoint)."""
        ckpt.remove_stale_temporaries(self.run.checkpoints)  # space a failed save may still hold
        path = ckpt.find_latest(self.run.checkpoints)
        if path is None:
            self.run.truncate_logs(0)
            return None
        check_template(path, self.policy.tokenizer, self.allow_template_change)
        self._load_weights(path)
        state = ckpt.load_trainer_state(path)
        template = {name: part.state_dict() for name, part in self.parts.items() if getattr(part, "sharded", False)}
        shards = ckpt.load_sharded(path, template) or {}  # written by several ranks: resharded onto this run
        missing = sorted(set(self.parts) - set(state["parts"]) - set(shards))
        if missing:
            raise ResumeError(f"{path} has no saved state for {', '.join(missing)} (written by another rlft "
                              "version or method).\nFix: start the run again in a new output_dir")
        for name, part in self.parts.items():
            if name in shards:
                part.load_state_dict(shards[name])
            elif getattr(part, "sharded", False) and self.world.active:
                part.load_full_state_dict(state["parts"][name])  # one process wrote it whole
            else:
                part.load_state_dict(state["parts"][name])
        ckpt.set_rng_state(state["rng"])
        self.run.truncate_logs(state["step"])
        self._saved_step = state["step"]  # a save before the next step would write this checkpoint again
        return path, state["step"]

    def _load_weights(self, path: Path) -> None:
        """The checkpoint's (whole) weights into the policy; in a distributed run into the
        unsharded copy, then into every rank's shards."""
        target = self.policy.unsharded()
        ckpt.load_model_weights(target.model, target.is_lora, path)
        if self.policy.mirror is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.policy.model, target.model.state_dict(),
                                 options=StateDictOptions(full_state_dict=True))
