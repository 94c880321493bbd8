"""The training session: the optimizer step and its non-finite guard, the step counter, signals,
progress output, and checkpoints of named state parts.

Whatever else must survive a restart (the data order, a KL controller, the rollout engine's
sampler, a critic) is registered by its owner with `register(name, part)`; a part has
`state_dict()` / `load_state_dict()`. A checkpoint stores the model weights plus
`{"step", "rng", "parts": {name: part.state_dict()}}`, and `resume()` loads them back in place.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
from rich.markup import escape

from rlft.config import CheckpointConfig, Config, TrainingConfig, config_warnings
from rlft.errors import ResumeError, RlftError, TrainingHalted
from rlft.models.loading import LoadedModel, export_model
from rlft.models.template import check_template
from rlft.monitor.catalogue import preflight
from rlft.monitor.console import ProgressDisplay, console
from rlft.monitor.loggers import LoggerGroup, build_loggers
from rlft.monitor.monitor import Monitor
from rlft.monitor.rundir import RunDir
from rlft.rewards.calls import ScoringInterrupted
from rlft.training import checkpoint as ckpt
from rlft.training.optim import build_optimizer, build_scheduler, clip_gradients

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def open_run(config: Config) -> Iterator[RunDir]:
    """Set up the process (threads, seeds) and claim the run directory for `config` for as long as
    the block runs (marked and locked: see RunDir). Settings read late in a run are checked first.
    A directory that already holds a checkpointed run with a different config is refused:
    continuing it would mix two experiments. (An attempt that stopped before its first checkpoint
    is simply restarted.)"""
    preflight(config)
    if config.training.num_threads:
        torch.set_num_threads(config.training.num_threads)
    seed_everything(config.seed)
    run = RunDir(config.output_dir)
    if run.config_path.exists() and ckpt.find_latest(run.checkpoints) is not None:
        diffs = run.config_changes(config)
        if diffs:
            raise ResumeError(
                f"{run.root} already holds a run with a different config ({', '.join(diffs[:5])}).\n"
                f"Fix: continue it with `rlft train --resume {run.root}`, or choose another output_dir")
    run.create(config)
    try:
        for warning in config_warnings(config):
            console.print(f"[yellow]warning: {escape(warning)}", highlight=False)
        yield run
    finally:
        run.release()


def evaluation(evaluate: Callable[[], dict[str, float]]) -> tuple[dict[str, float], str | None]:
    """(metrics, None), or ({}, why it failed): an evaluation's failure must not cost the step it
    follows (see TrainingSession.fail_evaluation). A Ctrl-C while its rewards run ends it quietly."""
    try:
        return evaluate(), None
    except ScoringInterrupted:
        return {}, None
    except RlftError as exc:
        return {}, str(exc)
    except Exception as exc:  # a bug or an unexpected input: keep its traceback for the log
        log.error("the evaluation failed", exc_info=True)
        return {}, f"{type(exc).__name__}: {exc}"


class NonFiniteGuard:
    """Counts updates: applied ones, and those skipped for a non-finite loss or gradient norm (in
    total and in a row)."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.streak = 0
        self.applied = 0

    def record(self, finite: bool) -> None:
        if finite:
            self.streak = 0
            self.applied += 1
        else:
            self.total += 1
            self.streak += 1

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.max_in_a_row

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "streak": self.streak, "applied": self.applied}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self.streak, self.applied = state["total"], state["streak"], state["applied"]


class RunClock:
    """Wall time of a run, summed over the attempts a resumed run took."""

    def __init__(self) -> None:
        self.before = 0.0  # seconds of earlier attempts
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.started

    def state_dict(self) -> dict[str, float]:
        return {"elapsed": self.elapsed}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.before, self.started = state["elapsed"], time.perf_counter()


class TrainingSession:
    def __init__(self, run: RunDir, policy: LoadedModel, training: TrainingConfig, checkpointing: CheckpointConfig,
                 *, progress: bool = True, log_every: int = 1, allow_template_change: bool = False,
                 monitor: Monitor | None = None, loggers: LoggerGroup | None = None):
        self.run = run
        self.policy = policy
        self.training = training
        self.checkpointing = checkpointing
        self.progress, self.log_every = progress, log_every
        self.allow_template_change = allow_template_change
        self.params = policy.trainable_parameters()
        self.optimizer = build_optimizer(self.params, training)
        self.scheduler = None
        self.guard = NonFiniteGuard(training.max_consecutive_nonfinite)
        self.total_steps = 0
        self.step = 0
        self.stop_signal: str | None = None
        self.display: ProgressDisplay | None = None
        self.last_metrics: dict[str, Any] = {}  # the latest logged step, for keep_best
        self.monitor = monitor or Monitor(run_dir=run.root)
        self.loggers = loggers or LoggerGroup([])
        self.halt: str | None = None  # a health alert whose action is 'stop'
        self.early_stop: str | None = None
        self.clock = RunClock()
        self._saved_step: int | None = None
        self._parts: dict[str, Stateful] = {"optimizer": self.optimizer, "nonfinite": self.guard,
                                            "monitor": self.monitor, "clock": self.clock}
        self._old_handlers: dict[int, Any] = {}

    def register(self, name: str, part: Stateful) -> None:
        """Checkpoint `part` under `name` and load it back on resume."""
        if name in self._parts:
            raise ValueError(f"state part {name!r} is registered twice")
        self._parts[name] = part

    # -- optimisation -------------------------------------------------------------------------
    def add_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Train extra parameters with the policy (e.g. PPO's shared value head); before start()."""
        if self.scheduler is not None:
            raise RuntimeError("add_parameters must be called before start()")
        self.optimizer.add_param_group({"params": params})
        self.params.extend(params)

    def start(self, total_steps: int, keys: list[str], title: str, updates_per_step: int = 1) -> None:
        self.total_steps = total_steps
        self.scheduler = build_scheduler(self.optimizer, self.training, total_steps * updates_per_step)
        self._parts["scheduler"] = self.scheduler
        self._install_signal_handlers()
        self.display = ProgressDisplay(total_steps, self.step, keys, self.progress, title)

    def optimizer_step(self, loss_value: float) -> tuple[bool, float]:
        """Clip and step, unless the loss or gradient norm is non-finite: then the update is skipped
        (parameters, optimizer and scheduler unchanged) and counted. The loop owns `self.step`."""
        grad_norm = float(clip_gradients(self.params, self.training.max_grad_norm))
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        self.guard.record(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.print(f"[yellow]warning: non-finite loss ({loss_value}) or grad norm ({grad_norm}); "
                       f"step {self.step + 1} skipped ({self.guard.streak} in a row)")
            if self.guard.exhausted:
                path = self.save_checkpoint()
                raise TrainingHalted(
                    f"stopped: {self.guard.streak} consecutive steps had a non-finite loss or gradient norm. "
                    f"Last good state saved to {path}.\nFix: lower training.learning_rate, keep "
                    "training.max_grad_norm on, or use fp32 (model.dtype=fp32)")
            return False, grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True, grad_norm

    @property
    def nonfinite_total(self) -> int:
        return self.guard.total

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """A reason to end the loop after this step: a signal, a stop alert, an early stop."""
        return bool(self.stop_signal or self.halt or self.early_stop)

    def save_checkpoint(self) -> Path:
        """Save, keeping the last N and (with checkpoint.keep_best) the best by a logged metric."""
        if self._saved_step == self.step:  # already saved at this step (e.g. as a new best)
            return ckpt.checkpoint_path(self.run.checkpoints, self.step)
        cfg = self.checkpointing
        best = ckpt.read_best(self.run.checkpoints)
        protect = {best["checkpoint"]} if best else set()
        parts = {name: part.state_dict() for name, part in self._parts.items()}
        path = ckpt.save_checkpoint(self.run.checkpoints, self.step, self.policy.model, self.policy.is_lora,
                                    self.policy.tokenizer, {"parts": parts}, cfg.keep_last, protect)
        value = self.last_metrics.get(cfg.keep_best) if cfg.keep_best else None
        if value is not None and math.isfinite(value):
            better = best is None or (value > best["value"] if cfg.best_mode == "max" else value < best["value"])
            if better:
                ckpt.record_best(self.run.checkpoints, path.name, cfg.keep_best, value)
                if best and best["checkpoint"] != path.name:  # the previous best is now an ordinary one
                    ckpt.prune(self.run.checkpoints, cfg.keep_last, {path.name})
        self._saved_step = self.step
        return path

    def _improves_best(self, record: dict[str, Any]) -> bool:
        cfg = self.checkpointing
        value = record.get(cfg.keep_best) if cfg.keep_best else None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        best = ckpt.read_best(self.run.checkpoints)
        return best is None or (value > best["value"] if cfg.best_mode == "max" else value < best["value"])

    def resume(self) -> bool:
        """Load the newest intact checkpoint into the model and every registered part; False on a
        fresh start."""
        ckpt.remove_stale_temporaries(self.run.checkpoints)  # space a failed save may still hold
        path = ckpt.find_latest(self.run.checkpoints)
        if path is None:
            self.run.truncate_logs(0)  # logs of an attempt that never reached a checkpoint
            return False
        check_template(path, self.policy.tokenizer, self.allow_template_change)
        ckpt.load_model_weights(self.policy.model, self.policy.is_lora, path)
        state = ckpt.load_trainer_state(path)
        missing = sorted(set(self._parts) - set(state["parts"]))
        if missing:
            raise ResumeError(f"{path} has no saved state for {', '.join(missing)} (written by another rlft "
                              "version or method).\nFix: start the run again in a new output_dir")
        for name, part in self._parts.items():
            part.load_state_dict(state["parts"][name])
        self.step = state["step"]
        ckpt.set_rng_state(state["rng"])
        self.run.truncate_logs(self.step)
        if self.step >= self.total_steps:
            raise TrainingHalted(
                f"nothing to train: {path} is at step {self.step} and the run has {self.total_steps} steps.\n"
                "Fix: raise training.max_steps / training.epochs to continue training")
        self.print(f"resumed from {path} (step {self.step} of {self.total_steps})")
        if self.display is not None:
            self.display.update(self.step, {})
        return True

    def eval_due(self) -> bool:
        """After every `training.eval_every` steps, and after the last step."""
        every = self.training.eval_every
        return self.step == self.total_steps or bool(every) and self.step % every == 0

    def checkpoint_due(self) -> bool:
        every = self.checkpointing.every
        return bool(every) and self.step % every == 0 and self.step < self.total_steps

    # -- signals ------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        """The first SIGINT / SIGTERM asks the loop to stop: it ends after the current step, or at
        once when it is waiting for rewards (the step is then abandoned), and saves a checkpoint of
        the last completed step. A second one stops at once, without saving."""
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop_signal is not None:
                self.print(f"[yellow]second {name}: stopping now without saving; resume later from the last "
                           f"checkpoint with: rlft train --resume {self.run.root}")
                previous = self._old_handlers.get(signum)
                if callable(previous):  # the caller's own way to stop (the CLI's: no traceback)
                    previous(signum, frame)
                raise KeyboardInterrupt
            self.stop_signal = name
            self.print(f"[yellow]{name}: stopping after this step (at once if rewards are still running) and "
                       "saving a checkpoint; press Ctrl-C again to stop now without saving")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. a notebook executor): no handlers
                pass

    def _restore_signal_handlers(self) -> None:
        """Idempotent: the loop calls it when it ends (an error included), finish() again."""
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- output -------------------------------------------------------------------------------
    def print(self, *args: Any) -> None:
        if self.display is not None:
            self.display.print(*args)
        else:
            console.print(*args)

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one step: metrics.jsonl (every `log_every` steps and the last), the logging
        backends, the health monitor (every step), a checkpoint when the step is a new best."""
        record = {"step": self.step, **metrics}
        self.last_metrics = record
        if self.step % self.log_every == 0 or self.step == self.total_steps:
            self.run.log_metrics(record)
            self.loggers.log_metrics(self.step, record)
        self._watch(record)
        if self.display is not None:
            self.display.update(self.step, record)

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """An evaluation outside a logged step: its own metrics line, also seen by keep_best."""
        record = {"step": self.step, **metrics}
        self.run.log_metrics(record)
        self.loggers.log_metrics(self.step, record)
        self.last_metrics.update(metrics)
        self._watch(record)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        self.run.log_samples(records)
        self.loggers.log_samples(self.step, records)

    def _watch(self, record: dict[str, Any]) -> None:
        for alert in self.monitor.observe(record):
            colour = "red" if alert.action == "stop" else "yellow"
            self.print(f"[{colour}]{alert.action}: {alert.detector} at step {alert.step}: {escape(alert.message)}")
            if alert.action == "stop":
                self.halt = self.halt or f"{alert.detector}: {alert.message}"
        self.early_stop = self.early_stop or self.monitor.should_stop_early(record)
        if self._improves_best(record):
            self.save_checkpoint()

    def fail_evaluation(self, reason: str) -> None:
        """An evaluation failed after a completed step: save it (and, after the last step, the final
        export) so no trained step is lost, then stop with one error saying where they are."""
        path = self.save_checkpoint()
        saved = f"checkpoint {path}"
        if self.step >= self.total_steps:
            export_model(self.policy, self.run.final)
            saved += f" and the final model {self.run.final}"
        self.run.update_summary({"status": "eval_failed", "step": self.step, "error": reason})
        raise TrainingHalted(f"the evaluation after step {self.step} failed: {reason}\nThe trained weights are safe: "
                             f"{saved}. Fix the evaluation, then evaluate with `rlft eval {self.run.root}` or "
                             f"continue with `rlft train --resume {self.run.root}`")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint, export the final model (merged; adapter too under LoRA) unless a health
        alert stopped the run, and write summary.json."""
        try:
            self.close_display()
            self._restore_signal_handlers()
            summary = {"step": self.step, "wall_time_s": round(self.clock.elapsed, 1),
                       "optimizer_steps": self.guard.applied, "nonfinite_skipped": self.nonfinite_total, **summary}
            path = self.save_checkpoint()
            if self.stop_signal is not None:
                self.print(f"stopped by {self.stop_signal} at step {self.step}; checkpoint {path}\n"
                           f"resume with: rlft train --resume {self.run.root}")
                return self.run.update_summary({"status": "interrupted", "signal": self.stop_signal, **summary})
            if self.halt is not None:
                self.print(f"[red]stopped by the health monitor at step {self.step}: {escape(self.halt)}\n"
                           f"checkpoint {path} (no final/ export). To only warn: monitor.on_alert.<detector>=warn")
                return self.run.update_summary({"status": "stopped", "stop_reason": self.halt, **summary})
            if self.early_stop is not None:
                self.print(f"early stop at step {self.step}: {escape(self.early_stop)}")
                summary["early_stop"] = self.early_stop
            if self.guard.applied == 0:
                summary["warning"] = self._no_update_warning()
                self.print(f"[bold yellow]warning: {escape(summary['warning'])}")
            summary["final_from"] = self._export_final()
            return self.run.update_summary({"status": "completed", "final_model": str(self.run.final), **summary})
        finally:
            self.loggers.close()

    def _export_final(self) -> str:
        """final/ from the last weights, or (checkpoint.final: best) from the best checkpoint."""
        best = ckpt.read_best(self.run.checkpoints) if self.checkpointing.final == "best" else None
        if best is None:
            export_model(self.policy, self.run.final)
            return f"step {self.step} (last)"
        path = self.run.checkpoints / best["checkpoint"]
        ckpt.load_model_weights(self.policy.model, self.policy.is_lora, path)
        export_model(self.policy, self.run.final)
        return f"{best['checkpoint']} (best {best['metric']} = {best['value']:.4g})"

    def _no_update_warning(self) -> str:
        return (f"no optimizer step was taken in {self.step} steps: the model in final/ is the starting model. "
                "In online RL this means every group's rewards were equal (no advantage): check that the "
                "reward can tell completions apart, or use harder/easier prompts")

    def close_display(self) -> None:
        if self.display is not None:
            self.display.close()
            self.display = None


def session_for(config: Config, run: RunDir, policy: LoadedModel) -> TrainingSession:
    """The session of a run, from its config's sections; the logging backends are built here, so a
    missing package stops the run before training."""
    loggers = build_loggers(config.logging.backends, run.root, run.root.name, config.logging)
    loggers.log_config(config.model_dump(mode="json"))
    return TrainingSession(run, policy, config.training, config.checkpoint, progress=config.logging.progress,
                           log_every=config.logging.log_every, allow_template_change=config.model.allow_template_change,
                           monitor=Monitor(config.monitor, run.root), loggers=loggers)
