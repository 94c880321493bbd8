"""What both training loops share: the run directory, the policy and its optimizer, the step
counter, the non-finite guard, checkpoints and resume, signals, the final export."""

from __future__ import annotations

import logging
import math
import random
import signal
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rlft.config import Config, LoraConfig, ModelConfig
from rlft.errors import ResumeError, TrainingHalted
from rlft.models.loading import LoadedModel, export_model, load_policy
from rlft.models.template import check_template
from rlft.monitor.console import ProgressDisplay
from rlft.train import checkpoint as ckpt
from rlft.train.optim import build_optimizer, build_scheduler, clip_gradients
from rlft.train.rundir import RunDir

log = logging.getLogger(__name__)

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainingSession:
    def __init__(self, config: Config, policy: LoadedModel | None = None,
                 loader: Callable[[ModelConfig, LoraConfig], LoadedModel] = load_policy):
        self.config = config
        self.run = RunDir(config.output_dir)
        if config.training.num_threads:
            torch.set_num_threads(config.training.num_threads)
        seed_everything(config.seed)
        self._check_run_dir()
        self.policy = policy or loader(config.model, config.lora)  # after seeding: new heads are seeded
        self.params = self.policy.trainable_parameters()
        self.optimizer = build_optimizer(self.params, config.training)
        self.scheduler = None
        self.total_steps = 0
        self.step = 0
        self.nonfinite_total = 0
        self.nonfinite_streak = 0
        self.stop_signal: str | None = None
        self.display: ProgressDisplay | None = None
        self.extra_state: Callable[[], dict[str, Any]] = dict  # set by the loop: its own resumable state
        self.last_metrics: dict[str, Any] = {}  # the latest logged step, for keep_best
        self._old_handlers: dict[int, Any] = {}

    # -- run directory ------------------------------------------------------------------------
    def _check_run_dir(self) -> None:
        # Only a checkpoint makes a run worth protecting: an attempt that stopped before its first
        # one (bad data, template mismatch) is restarted from scratch by `resume()` anyway.
        if self.run.config_path.exists() and ckpt.find_latest(self.run.checkpoints) is not None:
            diffs = self.run.config_changes(self.config)
            if diffs:
                raise ResumeError(
                    f"{self.run.root} already holds a run with a different config ({', '.join(diffs[:5])}).\n"
                    f"Fix: continue it with `rlft train --resume {self.run.root}`, or choose another output_dir")
        self.run.create(self.config)

    # -- optimisation -------------------------------------------------------------------------
    def add_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Train extra parameters with the policy (e.g. PPO's shared value head); before start()."""
        if self.scheduler is not None:
            raise RuntimeError("add_parameters must be called before start()")
        self.optimizer.add_param_group({"params": params})
        self.params.extend(params)

    def start(self, total_steps: int, keys: list[str], title: str, updates_per_step: int = 1) -> None:
        self.total_steps = total_steps
        self.scheduler = build_scheduler(self.optimizer, self.config.training, total_steps * updates_per_step)
        self._install_signal_handlers()
        self.display = ProgressDisplay(total_steps, self.step, keys, self.config.logging.progress, title)

    def optimizer_step(self, loss_value: float) -> tuple[bool, float]:
        """Clip and step, unless the loss or gradient norm is non-finite: then the update is skipped
        (parameters, optimizer and scheduler unchanged) and counted. The loop owns `self.step`."""
        grad_norm = float(clip_gradients(self.params, self.config.training.max_grad_norm))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_total += 1
            self.nonfinite_streak += 1
            self.print(f"[yellow]warning: non-finite loss ({loss_value}) or grad norm ({grad_norm}); "
                       f"step {self.step + 1} skipped ({self.nonfinite_streak} in a row)")
            if self.nonfinite_streak >= self.config.training.max_consecutive_nonfinite:
                path = self.save_checkpoint()
                raise TrainingHalted(
                    f"stopped: {self.nonfinite_streak} consecutive steps had a non-finite loss or gradient norm. "
                    f"Last good state saved to {path}.\nFix: lower training.learning_rate, keep "
                    "training.max_grad_norm on, or use fp32 (model.dtype=fp32)")
            return False, grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak = 0
        return True, grad_norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # -- checkpoints --------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """The session's state plus the loop's own (data position, KL controller, sampler...)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "nonfinite_total": self.nonfinite_total, "nonfinite_streak": self.nonfinite_streak,
                "config": self.config.model_dump(mode="json"), **self.extra_state()}

    def save_checkpoint(self) -> Path:
        """Save, keeping the last N and (with checkpoint.keep_best) the best by a logged metric."""
        cfg = self.config.checkpoint
        best = ckpt.read_best(self.run.checkpoints)
        protect = {best["checkpoint"]} if best else set()
        path = ckpt.save_checkpoint(self.run.checkpoints, self.step, self.policy.model, self.policy.is_lora,
                                    self.policy.tokenizer, self.trainer_state(), cfg.keep_last, protect)
        value = self.last_metrics.get(cfg.keep_best) if cfg.keep_best else None
        if value is not None and math.isfinite(value):
            better = best is None or (value > best["value"] if cfg.best_mode == "max" else value < best["value"])
            if better:
                ckpt.record_best(self.run.checkpoints, path.name, cfg.keep_best, value)
                if best and best["checkpoint"] != path.name:  # the previous best is now an ordinary one
                    ckpt.prune(self.run.checkpoints, cfg.keep_last, {path.name})
        return path

    def resume(self) -> dict[str, Any] | None:
        """Load the newest intact checkpoint; returns its trainer state (None: fresh start)."""
        path = ckpt.find_latest(self.run.checkpoints)
        if path is None:
            self.run.truncate_logs(0)  # logs of an attempt that never reached a checkpoint
            return None
        check_template(path, self.policy.tokenizer, self.config.model.allow_template_change)
        ckpt.load_model_weights(self.policy.model, self.policy.is_lora, path)
        state = ckpt.load_trainer_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.nonfinite_total = state["nonfinite_total"]
        self.nonfinite_streak = state["nonfinite_streak"]
        ckpt.set_rng_state(state["rng"])
        self.run.truncate_logs(self.step)
        if self.step >= self.total_steps:
            raise TrainingHalted(
                f"nothing to train: {path} is at step {self.step} and the run has {self.total_steps} steps.\n"
                "Fix: raise training.max_steps / training.epochs to continue training")
        self.print(f"resumed from {path} (step {self.step} of {self.total_steps})")
        if self.display is not None:
            self.display.update(self.step, {})
        return state

    def eval_due(self) -> bool:
        """After every `training.eval_every` steps, and after the last step."""
        every = self.config.training.eval_every
        return self.step == self.total_steps or bool(every) and self.step % every == 0

    def checkpoint_due(self) -> bool:
        every = self.config.checkpoint.every
        return bool(every) and self.step % every == 0 and self.step < self.total_steps

    # -- signals ------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self.stop_signal is not None:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            self.print(f"[yellow]{self.stop_signal}: finishing this step, then saving a checkpoint")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. a notebook executor): no handlers
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- output -------------------------------------------------------------------------------
    def print(self, *args: Any) -> None:
        if self.display is not None:
            self.display.print(*args)
        else:
            from rlft.monitor.console import console

            console.print(*args)

    def log(self, metrics: dict[str, Any]) -> None:
        record = {"step": self.step, **metrics}
        self.last_metrics = record
        if self.step % self.config.logging.log_every == 0 or self.step == self.total_steps:
            self.run.log_metrics(record)
        if self.display is not None:
            self.display.update(self.step, record)

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """End-of-training evaluation: its own metrics line, also seen by keep_best."""
        self.run.log_metrics({"step": self.step, **metrics})
        self.last_metrics.update(metrics)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint, export the final model (merged; adapter too under LoRA), write summary.json."""
        self.close_display()
        self._restore_signal_handlers()
        if self.stop_signal is not None:
            path = self.save_checkpoint()
            self.print(f"stopped by {self.stop_signal} at step {self.step}; checkpoint {path}\n"
                       f"resume with: rlft train --resume {self.run.root}")
            return self.run.update_summary({"status": "interrupted", "step": self.step, **summary})
        self.save_checkpoint()
        export_model(self.policy, self.run.final)
        return self.run.update_summary({"status": "completed", "step": self.step, "final_model": str(self.run.final),
                                        "nonfinite_skipped": self.nonfinite_total, **summary})

    def close_display(self) -> None:
        if self.display is not None:
            self.display.close()
            self.display = None
