"""Each logging backend writes what it is given, read back with that tool's own reader: TensorBoard
event files (EventAccumulator), the W&B offline run (`wandb leet inspect --json`, W&B's reader of
its .wandb transaction log), the MLflow store (MlflowClient)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlft.errors import RlftError
from rlft.monitor.loggers import build_loggers, hyperparameters, missing_packages, mlflow_key, scalar_metrics
from rlft.config.monitor import LoggerSettings

CONFIG = {"method": "grpo", "seed": 3, "model": {"path": "/m", "revision": None},
          "training": {"learning_rate": 1e-3, "max_steps": 2},
          "rewards": [{"fn": "math", "weight": 1.0}]}
# Step records as the loop logs them: a NaN, a bool and a string are not scalars for any backend.
RECORDS = [{"step": 1, "reward/mean": 0.25, "kl": 0.01, "loss": float("nan"), "flag": True, "note": "x"},
           {"step": 2, "reward/mean": 0.5, "kl": 0.02, "loss": 1.5, "eval/pass@k": 0.75}]
SCALARS = {1: {"reward/mean": 0.25, "kl": 0.01}, 2: {"reward/mean": 0.5, "kl": 0.02, "loss": 1.5, "eval/pass@k": 0.75}}
SAMPLES = [{"step": 2, "where": "train.jsonl:3", "prompt": "What is 2+2?", "completion": "The answer is 4. | ok",
            "reward": 1.0, "finish_reason": "stop", "components": {"math": 1.0}}]


def _log_run(names, run_dir, **settings):
    group = build_loggers(names, run_dir, "run-a", LoggerSettings(**settings))
    group.log_config(CONFIG)
    for record in RECORDS:
        if record["step"] == 2:
            group.log_samples(2, SAMPLES)
        group.log_metrics(record["step"], record)
    loggers = list(group.loggers)
    group.close()
    assert group.loggers == []  # closed once; closing again (every exit path does) is a no-op
    group.close()
    return SimpleNamespace(loggers=loggers)


def test_scalars_and_hyperparameters_are_the_same_for_every_backend():
    assert [scalar_metrics(r) for r in RECORDS] == [SCALARS[1], SCALARS[2]]
    hp = hyperparameters(CONFIG)
    assert hp["model.revision"] == "null" and hp["training.learning_rate"] == 1e-3
    assert json.loads(hp["rewards"]) == [{"fn": "math", "weight": 1.0}]
    assert mlflow_key("eval/pass@k") == "eval/pass_k"


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _log_run(["jsonl", "tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    assert got.keys() == SCALARS.keys()
    for step, values in SCALARS.items():
        assert got[step] == pytest.approx(values)  # float32 in the event file
    text = acc.Tensors("samples/text_summary")[0]
    assert text.step == 2 and "The answer is 4. | ok" in text.tensor_proto.string_val[0].decode()
    hparams = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        hparams.update({k: v for k, v in data.session_start_info.hparams.items()})
    assert hparams["training.learning_rate"].number_value == pytest.approx(1e-3)
    assert hparams["model.path"].string_value == "/m"


def test_wandb_offline_run_reads_back_with_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "")  # no credentials: offline must not need any
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    _log_run(["wandb"], tmp_path, wandb_project="rlft-test")
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_dirs[0])], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    records = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2]
    for step, values in SCALARS.items():
        assert {k: history[step][k] for k in values} == pytest.approx(values)
        assert not {"loss", "flag", "note"} & (set(history[step]) - set(values))
    assert history[2]["samples._type"] == "table-file" and history[2]["samples.nrows"] == 1
    table = json.loads((run_dirs[0] / "files" / history[2]["samples.path"]).read_text())
    assert table["columns"][:4] == ["step", "where", "prompt", "completion"]
    assert table["data"][0][3] == "The answer is 4. | ok"
    config = {}
    for r in records:
        if r["type"] in ("run", "config"):
            update = (r.get("run") or {}).get("config", {}).get("update") or r.get("config", {}).get("update") or {}
            config.update(update)
    assert config["training.learning_rate"] == 1e-3 and config["model.revision"] == "null"
    run_record = next(r["run"] for r in records if r["type"] == "run")
    assert run_record["display_name"] == "run-a" and run_record["project"] == "rlft-test"


def test_mlflow_local_store_reads_back(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    group = _log_run(["mlflow"], tmp_path)
    logger = group.loggers[0]
    assert logger.tracking_uri == f"sqlite:///{(tmp_path / 'mlflow' / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params["training.learning_rate"] == "0.001" and run.data.params["model.revision"] == "null"
    for key in ("reward/mean", "kl", "loss", "eval/pass@k"):
        history = {m.step: m.value for m in client.get_metric_history(logger.run_id, mlflow_key(key))}
        assert history == {s: v[key] for s, v in SCALARS.items() if key in v}
    assert set(run.data.metrics) == {"reward/mean", "kl", "loss", "eval/pass_k"}
    local = client.download_artifacts(logger.run_id, "samples/step-00000002.json", str(tmp_path / "dl"))
    table = json.loads(Path(local).read_text())
    assert table["data"][0][2:4] == ["What is 2+2?", "The answer is 4. | ok"]
    assert (tmp_path / "mlflow" / "artifacts").is_dir()  # artifacts live in the run directory too


def test_missing_packages_are_one_error_naming_the_extras(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "alembic") else real(name, *a))
    with pytest.raises(RlftError) as err:
        build_loggers(["jsonl", "wandb", "mlflow", "tensorboard"], tmp_path, "r", LoggerSettings())
    message = str(err.value)
    assert "pip install 'rlft[wandb]'" in message and "pip install 'rlft[mlflow]'" in message
    assert "tensorboard" not in message.replace("logging.backends", "")
    assert list(tmp_path.iterdir()) == []  # nothing was built before the check
    # with a tracking server, MLflow does not need the SQL packages of the local store
    assert missing_packages(["mlflow"], SimpleNamespace(mlflow_tracking_uri="http://127.0.0.1:1")) == []
    assert missing_packages(["mlflow"], LoggerSettings()) == ["'mlflow' needs alembic: pip install 'rlft[mlflow]'"]


def test_unknown_backend(tmp_path):
    with pytest.raises(RlftError, match="unknown backend.*'tensorbord'"):
        build_loggers(["tensorbord"], tmp_path, "r", LoggerSettings())


def test_importing_the_monitor_loads_no_optional_package():
    code = ("import sys, rlft.config.monitor, rlft.monitor.monitor, rlft.monitor.loggers, rlft.monitor.report, "
            "rlft.monitor.ledger, rlft.cli.monitor; "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'plotly', 'selenium') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
