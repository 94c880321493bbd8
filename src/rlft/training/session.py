"""The training session: the optimizer step and its non-finite guard, the step counter, signals,
progress output, evaluations and the final export; checkpoints through its `RunState`
(training/run_state.py).

Whatever else must survive a restart (the data order, a KL controller, the rollout engine's
sampler, a critic, an async run's queue) is registered by its owner with `register(name, part)`;
a part has `state_dict()` / `load_state_dict()`. A checkpoint stores the model weights plus
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
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from rich.markup import escape

from rlft.config import CheckpointConfig, Config, TrainingConfig, config_warnings
from rlft.data.fingerprint import data_fingerprints
from rlft.errors import ResumeError, RlftError, TrainingHalted
from rlft.eval.suites import run_suites
from rlft.models.compiled import check_compile_available, compiled_forwards
from rlft.models.loading import LoadedModel, export_model, resolve_device
from rlft.models.precision import Precision, resolve_precision
from rlft.monitor.catalogue import preflight
from rlft.monitor.console import ProgressDisplay, console
from rlft.monitor.loggers import LoggerGroup, build_loggers
from rlft.monitor.monitor import Monitor
from rlft.monitor.rundir import RunDir, RunDirError, folder_atomic, fresh_dir
from rlft.rewards.calls import ScoringInterrupted
from rlft.training import checkpoint as ckpt
from rlft.training.distributed import SINGLE, World, full_state_dict, reshard, shard
from rlft.training.optim import build_optimizer, build_scheduler, clip_gradients
from rlft.training.run_state import RunState, Stateful
from rlft.training.threads import set_run_threads

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def open_run(config: Config, world: World = SINGLE) -> Iterator[RunDir]:
    """Set up the process (threads, seeds) and claim the run directory for `config` for as long as
    the block runs (marked and locked: see RunDir). Settings read late in a run are checked first.
    A directory that already holds a checkpointed run with a different config is refused:
    continuing it would mix two experiments. (An attempt that stopped before its first checkpoint
    is simply restarted.)"""
    preflight(config)
    if config.training.compile:  # a missing C++ compiler stops the run here, not in the first forward
        check_compile_available(resolve_device(config.model.device))

    def say(line: str, warning: bool) -> None:
        if world.main:
            console.print(f"[yellow]warning: {escape(line)}" if warning else escape(line), highlight=False)

    # an async run samples on a thread of its own while the trainer computes: both take threads
    async_run = config.is_online and config.rollout.async_steps > 0
    set_run_threads(config.training.num_threads, say, workers=2 if async_run else 1)
    seed_everything(config.seed)
    run = RunDir(config.output_dir, writer=world.main)  # rank 0 alone writes the run directory
    if world.main:
        latest = ckpt.find_latest(run.checkpoints) if run.config_path.exists() else None
        prints = data_fingerprints(config)
        if latest is not None:
            diffs = run.config_changes(config)
            if diffs:
                raise ResumeError(
                    f"{run.root} already holds a run with a different config ({', '.join(diffs[:5])}).\n"
                    f"Fix: continue it with `rlft train --resume {run.root}`, or choose another output_dir")
            changed_data = run.data_changes(config, prints)
            if changed_data:
                raise ResumeError(
                    f"{'; '.join(changed_data)}. Continuing {run.root} from {latest.name} would train on other rows "
                    "than its data order and step count were made for.\nFix: put the original file back, or train "
                    f"on the new data in a new run: output_dir={fresh_dir(run.root)}")
            # said before anything loads: a re-run of a config continues the run in its output_dir
            changed = run.length_changes(config)
            console.print(f"{run.root} already holds this run (newest checkpoint {latest.name}): continuing it"
                          + (f" with {', '.join(changed)}" if changed else "")
                          + f". To train anew instead, set output_dir={fresh_dir(run.root)}", highlight=False)
        run.create(config)
        run.record_data(prints, resumed=latest is not None)
    world.barrier()  # the other ranks read what rank 0 prepared
    try:
        if world.main:
            for warning in config_warnings(config):
                console.print(f"[yellow]warning: {escape(warning)}", highlight=False)
        yield run
    finally:
        run.release()


def run_precision(config: Config, world: World = SINGLE) -> Precision:
    """training.precision resolved for this run's device; the choice and its reason are printed
    (and kept in summary.json when the run ends)."""
    precision = resolve_precision(config.training.precision, config.model.dtype, resolve_device(config.model.device))
    if world.main:
        console.print(f"precision: {precision.name} ({escape(precision.reason)})", highlight=False)
    return precision


def evaluation(evaluate: Callable[[], dict[str, float]],
               world: World = SINGLE) -> tuple[dict[str, float], str | None]:
    """(metrics, None), or ({}, why it failed): an evaluation's failure must not cost the step it
    follows (see TrainingSession.fail_evaluation). A Ctrl-C while its rewards run ends it quietly.
    Every rank of `world` calls it and gets the same answer (`World.agree`): an evaluation that
    failed on one rank alone (a reward there) fails on all, so they stop together instead of the
    others going on into collectives the failed rank never joins."""
    metrics: dict[str, float] = {}
    failed = None
    try:
        metrics = evaluate()
    except ScoringInterrupted:  # no metrics and no failure (one process: ranks never cut rewards short)
        pass
    except RlftError as exc:
        failed = str(exc)
    except Exception as exc:  # a bug or an unexpected input: keep its traceback for the log
        log.error("the evaluation failed", exc_info=True)
        failed = f"{type(exc).__name__}: {exc}"
    failed = world.agree(failed, "in the evaluation")
    return ({}, failed) if failed is not None else (metrics, None)


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
                 monitor: Monitor | None = None, loggers: LoggerGroup | None = None, world: World = SINGLE,
                 precision: Precision | None = None):
        self.run = run
        self.policy = policy
        self.world = world
        self.precision = precision or Precision("fp32", "fp32")
        # fp16 gradients underflow without a loss scale (bf16 has fp32's range and needs none)
        self.scaler = torch.amp.GradScaler(policy.device.type) if self.precision.scales_loss else None
        self.training = training
        self.checkpointing = checkpointing
        self.progress, self.log_every = progress and world.main, log_every
        # everything the optimizer trains, by name (the names key its state in checkpoints)
        self.trainables = torch.nn.ModuleDict({"policy": policy.model})
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
        self.training_started = False  # the run is past its start (resume decided): a failure is recorded in summary.json
        self.clock = RunClock()
        self.state = RunState(run, policy, checkpointing, world, allow_template_change)
        for name, part in (("optimizer", OptimizerState(self.trainables, self.optimizer)), ("nonfinite", self.guard),
                           ("monitor", self.monitor), ("clock", self.clock), ("grad_scaler", self.scaler)):
            if part is not None:
                self.state.register(name, part)
        self._mirror_stale = False
        self._old_handlers: dict[int, Any] = {}
        self._exports: list[Callable[[Path], None]] = []

    def export_also(self, write: Callable[[Path], None]) -> None:
        """`write(folder)` adds to the final export (a PPO critic), inside the folder that becomes
        final/ only once everything is written; called on every rank (it may be collective)."""
        self._exports.append(write)

    def register(self, name: str, part: Stateful) -> None:
        """Checkpoint `part` under `name` and load it back on resume."""
        self.state.register(name, part)

    # -- optimisation -------------------------------------------------------------------------
    def add_module(self, name: str, module: torch.nn.Module) -> None:
        """Train a module's parameters with the policy (e.g. PPO's shared value head); before start()."""
        if self.scheduler is not None:
            raise RuntimeError("add_module must be called before start()")
        self.trainables[name] = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer.add_param_group({"params": params})
        self.params.extend(params)

    def start(self, total_steps: int, keys: list[str], title: str, updates_per_step: int = 1) -> None:
        self.total_steps = total_steps
        self.scheduler = build_scheduler(self.optimizer, self.training, total_steps * updates_per_step)
        self.state.register("scheduler", self.scheduler)
        self.display = ProgressDisplay(total_steps, self.step, keys, self.progress, title)

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The context training forwards run in: mixed precision (autocast to bf16 / fp16) and, with
        training.compile, compiled decoder layers (models/compiled.py)."""
        with self.precision.autocast(self.policy.device), compiled_forwards(self.training.compile):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def optimizer_step(self, loss_value: float) -> tuple[bool, float]:
        """Clip and step, unless the loss or gradient norm is non-finite: then the update is skipped
        (parameters, optimizer and scheduler unchanged) and counted. The loop owns `self.step`."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = float(clip_gradients(self.params, self.training.max_grad_norm))
        loss_value = self.world.sum([loss_value])[0]  # every rank takes the same decision
        if self.scaler is not None and math.isfinite(loss_value) and not math.isfinite(grad_norm):
            # fp16 overflow: the scaler halves its scale and the update is skipped; not a failure
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            return False, grad_norm
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
                    "training.max_grad_norm on, or train in fp32 (training.precision=fp32)")
            return False, grad_norm
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._mirror_stale = True
        return True, grad_norm

    def sync_mirror(self) -> None:
        """Bring the unsharded copy of a distributed run's policy (what rollouts, checkpoints and
        the export read) up to the trained shards (collective; nothing in a single process)."""
        mirror = self.policy.mirror
        if mirror is None or not self._mirror_stale:
            return
        mirror.model.load_state_dict(full_state_dict(self.policy.model, self.world))
        self._mirror_stale = False

    @property
    def nonfinite_total(self) -> int:
        return self.guard.total

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """A reason to end the loop after this step: a signal, a stop alert, an early stop. In a
        distributed run the ranks agree (a signal one rank got stops them all at the same step)."""
        local = bool(self.stop_signal or self.halt or self.early_stop)
        if not self.world.active:
            return local
        if self.world.any(bool(self.stop_signal)) and self.stop_signal is None:
            self.stop_signal = "SIGTERM"  # another rank's signal
        return self.world.any(local)

    def save_checkpoint(self) -> Path:
        """Save this step, keeping the last N and (with checkpoint.keep_best) the best by a logged metric."""
        self.sync_mirror()
        return self.state.save(self.step, self.last_metrics)

    def resume(self) -> bool:
        """Load the newest intact checkpoint into the model and every registered part; False on a
        fresh start. A run whose last attempt failed after its last step (the final export, say)
        resumes there, and finish() does the rest."""
        found = self.state.resume()
        if found is None:
            self.training_started = True
            return False
        path, self.step = found
        last = self.run.read_summary()  # of the last attempt
        unfinished = last.get("status") == "failed" and last.get("step") == self.step
        if self.step >= self.total_steps and not unfinished:
            raise TrainingHalted(
                f"nothing to train: {path} is at step {self.step} and the run has {self.total_steps} steps.\n"
                "Fix: raise training.max_steps / training.epochs to continue this run, or train anew in another "
                f"directory: output_dir={fresh_dir(self.run.root)}")
        self.print(f"resumed from {path} (step {self.step} of {self.total_steps})"
                   + ("; the last attempt failed after it, finishing the run" if self.step >= self.total_steps else ""))
        if self.display is not None:
            self.display.update(self.step, {})
        self.training_started = True
        return True

    def eval_due(self) -> bool:
        """After every `training.eval_every` steps, and after the last step."""
        every = self.training.eval_every
        return self.step == self.total_steps or bool(every) and self.step % every == 0

    def checkpoint_due(self) -> bool:
        return self.state.due(self.step, self.total_steps)

    # -- signals ------------------------------------------------------------------------------
    @contextmanager
    def running(self) -> Iterator[None]:
        """The training loop's span: while it runs, the first SIGINT / SIGTERM asks the loop to
        stop: it ends after the current step, or at once when it is waiting for rewards or an agent
        environment's call (the step is then abandoned), and finish() saves a checkpoint of the last
        completed step. A second one stops at once, without saving. On exit, an error included, the
        previous handlers are back (a notebook keeps its Ctrl-C)."""
        self._install_signal_handlers()
        try:
            yield
        finally:
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

    def _install_signal_handlers(self) -> None:
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
            self.print(f"[yellow]{name}: stopping after this step (at once if rewards or an environment are still "
                       "running) and saving a checkpoint; press Ctrl-C again to stop now without saving")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. a notebook executor): no handlers
                pass

    # -- output -------------------------------------------------------------------------------
    def print(self, *args: Any) -> None:
        if not self.world.main:
            return
        if self.display is not None:
            self.display.print(*args)
        else:
            console.print(*args)

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one step: metrics.jsonl (every `log_every` steps and the last), the logging
        backends, the health monitor (every step), a checkpoint when the step is a new best."""
        record = {"step": self.step, **metrics}
        if self.scaler is not None:  # fp16-mixed: the GradScaler's scale after this step's update
            record["loss_scale"] = float(self.scaler.get_scale())
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

    def evaluate_suites(self, engine: Any, suites: list[Any], seed: int, train_reward: float | None = None,
                        driver: Any = None) -> tuple[dict[str, float], str | None]:
        """The eval suites (eval.suites, prepared by eval/suites.py) due after this step: their
        metrics (eval/<suite>/...) and why they failed, if they did; their completions go to
        samples.jsonl (`suite` names the suite). `driver`: episodes instead of single turns."""
        every = self.training.eval_every
        if not any(p.suite.due(self.step, self.total_steps, every) for p in suites):
            return {}, None
        self.sync_mirror()  # a distributed run samples from its whole copy
        ran: dict[str, list[dict[str, Any]]] = {}

        def run() -> dict[str, float]:
            with self.autocast():  # run_suites runs the suites due at this step
                metrics, records = run_suites(engine, suites, self.step, self.total_steps, seed, train_reward, every,
                                              driver)
            ran.update(records)
            return metrics

        metrics, failed = evaluation(run, self.world)
        if self.world.main:
            for name, records in ran.items():
                self.log_samples([{"step": self.step, "suite": name, **r} for r in records])
        return metrics, failed

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
        if self.state.improves_best(record):
            self.save_checkpoint()

    def fail_evaluation(self, reason: str) -> None:
        """An evaluation failed after a completed step: save it (and, after the last step, the final
        export) so no trained step is lost, then stop with one error saying where they are."""
        path = self.save_checkpoint()
        saved = f"checkpoint {path}"
        if self.step >= self.total_steps:
            self._export(self.policy.unsharded())
            saved += f" and the final model {self.run.final}"
        self.run.update_summary({"status": "eval_failed", "step": self.step, "error": reason})
        self.world.barrier()
        self.training_started = False  # its status is written
        raise TrainingHalted(f"the evaluation after step {self.step} failed: {reason}\nThe trained weights are safe: "
                             f"{saved}. Fix the evaluation, then evaluate with `rlft eval {self.run.root}` or "
                             f"continue with `rlft train --resume {self.run.root}`")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint, export the final model (merged; adapter too under LoRA) unless a health
        alert stopped the run, and write summary.json."""
        try:
            self.close_display()
            summary = {"step": self.step, "wall_time_s": round(self.clock.elapsed, 1),
                       "optimizer_steps": self.guard.applied, "nonfinite_skipped": self.nonfinite_total,
                       "precision": self.precision.name, **summary}
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
        weights = self.policy.unsharded()
        if best is None:
            self._export(weights)
            return f"step {self.step} (last)"
        path = self.run.checkpoints / best["checkpoint"]
        ckpt.load_model_weights(weights.model, weights.is_lora, path)
        self._export(weights)
        return f"{best['checkpoint']} (best {best['metric']} = {best['value']:.4g})"

    def _export(self, weights: LoadedModel) -> None:
        """final/ written whole or not at all (a full disk leaves the previous export, if any)."""
        if not self.world.main:
            for write in self._exports:  # collectives: every rank takes part; rank 0 writes
                write(self.run.final)
            self.world.barrier()
            return
        with folder_atomic(self.run.final, "exporting the final model") as folder:
            export_model(weights, folder)
            for write in self._exports:
                write(folder)
        self.world.barrier()

    def _no_update_warning(self) -> str:
        # the health warnings still in force name what made the rewards equal (a tool that always fails, ...)
        seen = f" The health monitor saw: {', '.join(sorted(self.monitor.active))} (warnings above)." \
            if self.monitor.active else ""
        return (f"no optimizer step was taken in {self.step} steps: the model in final/ is the starting model. "
                "In online RL this means every group's rewards were equal (no advantage): check that the "
                "reward can tell completions apart, or use harder/easier prompts." + seen)

    def close_display(self) -> None:
        if self.display is not None:
            self.display.close()
            self.display = None


def session_for(config: Config, run: RunDir, policy: LoadedModel, world: World = SINGLE,
                precision: Precision | None = None) -> TrainingSession:
    """The session of a run, from its config's sections; the logging backends are built here, so a
    missing package stops the run before training. In a distributed run rank 0 alone logs and
    writes events; every rank watches the same (all-reduced) metrics, so all decide alike."""
    loggers = LoggerGroup([])
    if world.main:
        loggers = build_loggers(config.logging.backends, run.root, run.root.name, config.logging)
        loggers.log_config(config.model_dump(mode="json"))
    monitor = Monitor(config.monitor, run.root if world.main else None)
    return TrainingSession(run, policy, config.training, config.checkpoint, progress=config.logging.progress,
                           log_every=config.logging.log_every, allow_template_change=config.model.allow_template_change,
                           monitor=monitor, loggers=loggers, world=world, precision=precision)


class RunSetup:
    """A run being prepared by `prepared_run`: its directory and precision, for loading the
    policy; then `session()` opens its training session."""

    def __init__(self, config: Config, world: World, run: RunDir, precision: Precision):
        self.config, self.world, self.run, self.precision = config, world, run, precision
        self.opened: TrainingSession | None = None

    def session(self, policy: LoadedModel, frozen: Iterable[Any] = ()) -> TrainingSession:
        """The session that trains `policy`. In a distributed run the policy (keeping a whole
        mirror) is sharded first, then the frozen copies of `frozen` (a reference, a teacher; None
        skipped)."""
        if self.world.active:
            policy.make_mirror()
            shard(policy.model, self.world)
            for part in frozen:
                if part is not None and part.frozen_copy is not None:
                    shard(part.frozen_copy, self.world)
        self.opened = session_for(self.config, self.run, policy, self.world, self.precision)
        return self.opened


@contextmanager
def prepared_run(config: Config, world: World = SINGLE) -> Iterator[RunSetup]:
    """The prologue of both loops: the run claimed (open_run) and its precision resolved; the block
    loads the policy and opens the session with `setup.session(policy, frozen)`. When the block
    ends, an error included, the session's loggers are closed, then the run directory released."""
    with open_run(config, world) as run:
        setup = RunSetup(config, world, run, run_precision(config, world))
        try:
            yield setup
        except RlftError as exc:  # summary.json says so, if it can still be written: a write failed, or the
            # run stopped on an error mid-training (a reward, an environment, a server, the non-finite guard)
            started = setup.opened is not None and setup.opened.training_started
            if world.main and (isinstance(exc, RunDirError) or started):
                _record_failure(run, setup, exc)
            raise
        finally:
            if setup.opened is not None:
                setup.opened.loggers.close()


def _record_failure(run: RunDir, setup: RunSetup, exc: RunDirError) -> None:
    step = setup.opened.step if setup.opened is not None else 0
    try:
        run.update_summary({"status": "failed", "step": step, "error": str(exc)})
    except RunDirError:
        pass  # the disk refuses even that: the error on the console is the record


class OptimizerState:
    """The optimizer's state keyed by parameter names, not positions: a checkpoint loads on another
    number of ranks (and into a run whose sharding differs). Sharded in a distributed run: every
    rank saves and loads its own part (torch.distributed.checkpoint)."""

    sharded = True

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        reshard(self.module)  # the optimizer's parameters are the shards (an eval may have left others)
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        reshard(self.module)
        set_optimizer_state_dict(self.module, self.optimizer, state)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """A whole (one-process) state into a sharded run."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        reshard(self.module)
        set_optimizer_state_dict(self.module, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
