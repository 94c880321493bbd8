"""Metrics backends besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

Every backend satisfies the small `Logger` protocol and receives the same scalars (finite
numbers; the JSONL file keeps the rest). Each imports its package only when built, so rlft never
needs them; `build_loggers` checks all requested packages before building any, at the start of a
run, so a missing extra stops the run before training rather than at the first log call.

'jsonl' is the run directory's metrics.jsonl, which the training session always writes (resume
and `rlft report` read it): naming it is allowed and builds nothing here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from rlft.errors import RlftError
from rlft.monitor.rundir import writing
from rlft.monitor.runlog import flatten, is_number

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
# packages each backend needs (import names) and the extra that installs them
_NEEDS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
SAMPLE_COLUMNS = ("step", "where", "prompt", "completion", "reward", "finish_reason")


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...
    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """What every backend receives: the finite numbers of a metrics record, without 'step'."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and is_number(v)}


def hyperparameters(config: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """The config flattened to dotted keys with scalar values (lists as JSON, None as 'null'),
    the form TensorBoard's HParams, MLflow params and the W&B config all accept."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in flatten(config).items():
        out[key] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value)
    return out


def sample_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r.get(c) for c in SAMPLE_COLUMNS] for r in records]


class LoggerGroup:
    """All configured backends behind the one `Logger` interface. A backend's failed write (a full
    disk under its folder) is one RunDirError naming that folder, like the run directory's own."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = loggers

    def log_config(self, config: dict[str, Any]) -> None:
        self._each(lambda lg: lg.log_config(config), "logging the config")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = scalar_metrics(metrics)
        self._each(lambda lg: lg.log_metrics(step, scalars), "logging metrics")

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        self._each(lambda lg: lg.log_samples(step, records), "logging samples")

    def close(self) -> None:
        """Flush and close every backend; safe to call again (every exit path of a run calls it)."""
        loggers, self.loggers = self.loggers, []
        for lg in loggers:
            with writing(f"closing {_backend(lg)}", _where(lg)):
                lg.close()

    def _each(self, call: Callable[[Logger], None], what: str) -> None:
        for lg in self.loggers:
            with writing(f"{what} to {_backend(lg)}", _where(lg)):
                call(lg)


def _backend(lg: Logger) -> str:
    return type(lg).__name__.removesuffix("Logger")


def _where(lg: Logger) -> Path:
    """The folder a backend writes (`log_dir`, set by each backend here)."""
    return Path(getattr(lg, "log_dir", "."))


def build_loggers(names: list[str], run_dir: str | Path, run_name: str, settings: Any) -> LoggerGroup:
    """Build the backends named in `names` (logging.backends). `settings` carries the backend
    options (`rlft.config.monitor.LoggerSettings` fields: wandb_project, mlflow_tracking_uri...).
    Raises one RlftError naming every missing package and its pip extra."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise RlftError(f"logging.backends: unknown backend(s) {', '.join(map(repr, unknown))}; choose from "
                        f"{', '.join(BACKENDS)}")
    wanted = list(dict.fromkeys(n for n in names if n != "jsonl"))
    missing = missing_packages(wanted, settings)
    if missing:
        raise RlftError("logging.backends: " + "; ".join(missing))
    root = Path(run_dir)
    builders = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}
    built: list[Logger] = []
    try:
        for name in wanted:
            built.append(builders[name](root, run_name, settings))
    except Exception:
        for lg in built:
            lg.close()
        raise
    return LoggerGroup(built)


def missing_packages(names: list[str], settings: Any) -> list[str]:
    """One line per backend whose packages are not installed, with its pip extra."""
    missing = []
    for name in names:
        needs = _NEEDS.get(name, ())
        if name == "mlflow" and getattr(settings, "mlflow_tracking_uri", None):
            needs = ("mlflow",)  # the SQL packages are for the default local store only
        absent = [p for p in needs if importlib.util.find_spec(p) is None]
        if absent:
            missing.append(f"'{name}' needs {', '.join(absent)}: pip install 'rlft[{name}]'")
    return missing


# ---------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardLogger:
    """Event files under RUN/tensorboard/ (view: `tensorboard --logdir RUN/tensorboard`)."""

    def __init__(self, run_dir: Path, run_name: str, settings: Any = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # The HParams summaries go into this run's own event file (add_hparams would open a
        # sub-run), so TensorBoard lists the hyperparameters next to this run's scalars.
        for summary in hparams(hyperparameters(config), {}):
            self.writer.file_writer.add_summary(summary)
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        if records:
            self.writer.add_text("samples", _markdown_samples(records), step)

    def close(self) -> None:
        self.writer.close()


def _markdown_samples(records: list[dict[str, Any]]) -> str:
    # TensorBoard renders markdown; completions go in fenced blocks so their own markup stays text
    parts = []
    for r in records:
        fence = "````" if "```" in f"{r.get('prompt')}{r.get('completion')}" else "```"
        parts.append(f"**reward {r.get('reward')}** ({r.get('finish_reason')}, {r.get('where')})\n\n"
                     f"{fence}\n{r.get('prompt')}\n{fence}\n\n{fence}\n{r.get('completion')}\n{fence}")
    return "\n\n---\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Weights & Biases


class WandbLogger:
    """A W&B run whose files live under RUN/wandb/. Offline mode (the default) needs no network or
    login; `wandb sync RUN/wandb/offline-run-*` uploads it later."""

    def __init__(self, run_dir: Path, run_name: str, settings: Any):
        import wandb

        mode = getattr(settings, "wandb_mode", "offline")
        self.log_dir = run_dir / "wandb"
        try:
            self.run = wandb.init(project=getattr(settings, "wandb_project", "rlft"),
                                  entity=getattr(settings, "wandb_entity", None), name=run_name, dir=str(run_dir),
                                  mode=mode, reinit="create_new",
                                  # console capture would interleave with rlft's progress bar
                                  settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        except (wandb.errors.UsageError, wandb.errors.CommError, wandb.errors.AuthenticationError) as exc:
            raise RlftError(f"logging.backends: W&B could not start a run in {mode} mode: {exc}\nFix: run "
                            "`wandb login`, or set logging.wandb_mode=offline") from None

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(hyperparameters(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalar_metrics(metrics), step=step)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        import wandb

        if records:
            self.run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(records))}, step=step)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------------------
# MLflow

_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")  # MLflow names allow letters, digits, _ - . space : /


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def mlflow_key(name: str) -> str:
    """A metric or param name MLflow accepts (other characters become '_')."""
    return _MLFLOW_BAD.sub("_", name)


class MlflowLogger:
    """An MLflow run. Without a tracking URI the store is local: RUN/mlflow/mlflow.db (SQLite, the
    backend MLflow recommends; its plain-file store is in maintenance mode) and RUN/mlflow/artifacts/
    (view: `mlflow ui --backend-store-uri sqlite:///RUN/mlflow/mlflow.db`)."""

    def __init__(self, run_dir: Path, run_name: str, settings: Any):
        from mlflow.tracking import MlflowClient

        uri = getattr(settings, "mlflow_tracking_uri", None)
        artifacts = None
        self.log_dir = run_dir / "mlflow"
        if not uri:
            store = (run_dir / "mlflow").resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
        self.tracking_uri = uri
        name = getattr(settings, "mlflow_experiment", "rlft")
        with _quiet("mlflow.store.db.utils", "alembic"):  # creating the store logs each schema migration
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name, artifact_location=artifacts))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(mlflow_key(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in hyperparameters(config).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in scalar_metrics(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        if records:
            table = {"columns": list(SAMPLE_COLUMNS), "data": sample_rows(records)}
            self.client.log_dict(self.run_id, table, f"samples/step-{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
