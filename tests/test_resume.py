"""Never lose a run: SIGKILL at random moments, kills inside a checkpoint save, corrupt checkpoints,
epoch boundaries, LoRA, SIGTERM -- each resumed run must end bitwise identical to one left alone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DIGITS_REWARD
from rlft.api import train
from rlft.models.tiny import build_tiny_model

RLFT = str(Path(sys.executable).parent / "rlft")
VOLATILE = ("time", "tokens_per_s", "step_time")  # wall-clock numbers differ between runs by nature

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD)
    with (root / "sft.jsonl").open("w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"What is {i} + {i % 7}?", "completion": f"The answer is {i + i % 7}."}) + "\n")
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    return root


def sft_config(root: Path, name: str, lora: bool = False) -> dict:
    return {
        "method": "sft", "output_dir": str(root / name), "seed": 3,
        "model": {"path": str(root / "model")}, "lora": {"enabled": lora, "r": 4, "alpha": 8, "dropout": 0.1},
        "data": {"train": str(root / "sft.jsonl")},
        "training": {"learning_rate": 3e-3 if not lora else 1e-2, "batch_size": 4, "epochs": 2, "num_threads": 1},
        "checkpoint": {"every": 1, "keep_last": 2}, "logging": {"progress": False},
    }


def grpo_config(root: Path, name: str, lora: bool = False) -> dict:
    return {
        "method": "grpo", "output_dir": str(root / name), "seed": 3,
        "model": {"path": str(root / "model")}, "lora": {"enabled": lora, "r": 4, "alpha": 8, "dropout": 0.1},
        "data": {"train": str(root / "prompts.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": 6, "num_threads": 1},
        "rollout": {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 8},
        "algorithm": {"epochs": 2, "minibatches": 2},  # exercises the update generator's state too
        "rewards": [{"fn": f"{root / 'reward.py'}:digits"}],
        "checkpoint": {"every": 1, "keep_last": 2}, "logging": {"progress": False, "sample_every": 2},
    }


def write_config(cfg: dict) -> Path:
    path = Path(cfg["output_dir"] + ".yaml")
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in VOLATILE)} for r in rows]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(run / "final" / "model.safetensors"))
    adapter = run / "final" / "adapter" / "adapter_model.safetensors"
    if adapter.exists():
        weights.update({f"adapter.{k}": v for k, v in load_file(str(adapter)).items()})
    return weights


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"parameters differ after resume: {different[:3]}"
    assert metrics(a) == metrics(b)
    samples_a, samples_b = (p / "samples.jsonl" for p in (a, b))
    if samples_a.exists():
        assert samples_a.read_text() == samples_b.read_text()


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RLFT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def kill_at_random(cfg_path: Path, run: Path, rng: random.Random, min_steps: int, max_steps: int) -> int:
    """Start training, SIGKILL it once `metrics.jsonl` reaches a random step (plus a random delay,
    so the kill can land anywhere: in a forward pass, a checkpoint save, a log write)."""
    target = rng.randint(min_steps, max_steps)
    proc = subprocess.Popen([RLFT, "train", str(cfg_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        done = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
        if done >= target:
            time.sleep(rng.uniform(0.0, 0.3))
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"training ended before the kill: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return target


# the LoRA variants take ~30-50 s each on 2 cores: `make test-slow` (make test keeps the full ones)
@pytest.mark.parametrize("kind,lora", [pytest.param("sft", False, marks=pytest.mark.slow), pytest.param("sft", True, marks=pytest.mark.slow),
                                       ("grpo", False), pytest.param("grpo", True, marks=pytest.mark.slow)])
def test_sigkill_at_a_random_moment_then_resume_is_bitwise_identical(root, kind, lora):
    make = sft_config if kind == "sft" else grpo_config
    name = f"{kind}-{'lora' if lora else 'full'}"
    reference = root / f"{name}-ref"
    train(make(root, reference.name, lora))

    killed = root / f"{name}-killed"
    cfg_path = write_config(make(root, killed.name, lora))
    total = len([r for r in metrics(reference) if "loss" in r or "reward/mean" in r])
    kill_at_random(cfg_path, killed, random.Random(f"{name}"), 2, total - 2)
    # `rlft train CONFIG` on a run directory with checkpoints continues it (a kill before the first
    # checkpoint would start it over, which must also end identical)
    resumed = run_cli("train", str(cfg_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr or not list((killed / "checkpoints").glob("step-*"))
    assert_same_run(reference, killed)


def test_lora_resume_loads_the_trained_adapter(root):
    """A resume that silently re-initialised the adapter would still run; check it does not."""
    from peft import get_peft_model_state_dict

    from rlft.config import load_config
    from rlft.models.loading import load_policy
    from rlft.training import checkpoint as ckpt
    from rlft.training.session import seed_everything

    run = root / "sft-lora-ref"
    if not run.exists():
        train(sft_config(root, run.name, lora=True))
    cfg = load_config(sft_config(root, run.name, lora=True))
    seed_everything(cfg.seed)
    policy = load_policy(cfg.model, cfg.lora)
    fresh = {k: v.clone() for k, v in get_peft_model_state_dict(policy.model).items()}
    ckpt.load_model_weights(policy.model, True, ckpt.find_latest(run / "checkpoints"))
    loaded = get_peft_model_state_dict(policy.model)
    assert any(not torch.equal(fresh[k], loaded[k]) for k in fresh if "lora_B" in k)
    saved = load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


@pytest.mark.slow  # ~70 s on 2 cores; the other kill tests stay in make test
def test_kills_inside_checkpoint_saves_epoch_boundary_and_corruption(root):
    """One SFT run (24 rows, batch 4: 6 steps per epoch) crashed four ways, resumed each time:
    1. killed after writing the model of step 3's checkpoint: the torn save never takes its name;
    2. killed right after step 6's checkpoint, the epoch boundary: resume starts epoch 2 at batch 0;
    3. step 6's weights are then corrupted: the loader reports it and falls back to step 5;
    4. killed before renaming step 8's folder; then it runs to the end.
    The result equals a run left alone, bit for bit."""
    reference = root / "sft-full-ref"
    if not reference.exists():
        train(sft_config(root, reference.name))
    run = root / "chain"
    cfg_path = write_config(sft_config(root, run.name))
    ckpts = run / "checkpoints"

    died = run_cli("train", str(cfg_path), env={"RLFT_FAULT": "ckpt-model@3"})
    assert died.returncode == -signal.SIGKILL
    assert not (ckpts / "step-00000003").exists() and list(ckpts.glob(".tmp-*"))
    assert (ckpts / "latest").read_text().strip() == "step-00000002"

    died = run_cli("train", "--resume", str(run), env={"RLFT_FAULT": "ckpt-done@6"})
    assert died.returncode == -signal.SIGKILL
    assert "resumed from" in died.stderr and "step-00000002" in died.stderr
    state = torch.load(ckpts / "step-00000006" / "trainer_state.pt", weights_only=False)
    assert state["parts"]["data"]["epoch"] == 1 and state["parts"]["data"]["batch"] == 0

    weights = ckpts / "step-00000006" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    died = run_cli("train", "--resume", str(run), env={"RLFT_FAULT": "ckpt-rename@8"})
    assert died.returncode == -signal.SIGKILL
    assert "skipping checkpoint" in died.stderr and "SHA-256" in died.stderr
    assert "resumed from" in died.stderr and "step-00000005" in died.stderr

    resumed = run_cli("train", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000007" in resumed.stderr
    assert not list(ckpts.glob(".tmp-*"))  # torn temp folders are cleaned up
    assert json.loads((run / "summary.json").read_text())["step"] == 12
    assert_same_run(reference, run)


def test_a_torn_manifest_in_the_newest_checkpoint_resumes_from_the_one_before(root, capsys, caplog):
    """The quick torn-checkpoint case in make test (the kill-inside-a-save chain is `slow`): a run
    stopped after step 3, its newest checkpoint's manifest.json cut in half as a crash mid-write
    would leave it; continuing skips that checkpoint with the reason, resumes from step 2, and
    ends bitwise identical to a run left alone. Constant lr, so stopping at 3 and continuing to 4
    follows the same schedule as 4 steps straight."""
    cfg = sft_config(root, "torn-ref")
    cfg["training"].update({"lr_scheduler": "constant", "max_steps": 4, "precision": "fp32"})
    train(cfg)
    cfg["output_dir"] = str(root / "torn")
    train(cfg, ["training.max_steps=3"])
    ckpts = root / "torn" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000003"]
    manifest = ckpts / "step-00000003" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        summary = train(cfg)
    assert summary["status"] == "completed" and summary["step"] == 4
    warned = caplog.text + capsys.readouterr().err
    assert "skipping checkpoint" in warned and "step-00000003" in warned and "unreadable manifest" in warned
    assert "resumed from" in warned and "step-00000002" in warned
    assert_same_run(root / "torn-ref", root / "torn")


def test_resume_with_nothing_left_to_train_says_so_and_fails(root, capsys, monkeypatch):
    from rlft.cli.app import main

    run = root / "sft-full-ref"
    if not run.exists():
        train(sft_config(root, run.name))
    for args, message in ((["train", "--resume", str(run)], "nothing to train"),
                          (["train", "--resume", str(root / "no-such-run")], "not a run directory")):
        monkeypatch.setattr(sys, "argv", ["rlft", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_sigterm_finishes_the_step_saves_and_resumes_identically(root):
    reference = root / "grpo-full-ref"
    if not reference.exists():
        train(grpo_config(root, reference.name))
    run = root / "sigterm"
    cfg = grpo_config(root, run.name)
    cfg["checkpoint"] = {"every": 100, "keep_last": 2}  # the only mid-run checkpoint is the signal's
    cfg_path = write_config(cfg)
    proc = subprocess.Popen([RLFT, "train", str(cfg_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]  # interrupted: 128 + the signal
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 1 <= summary["step"] < 6
    assert (run / "checkpoints" / f"step-{summary['step']:08d}" / "COMPLETE").exists()
    assert not (run / "final").exists()
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    resumed = run_cli("train", "--resume", str(run), "checkpoint.every=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, run)


def test_keep_last_and_keep_best(root):
    cfg = sft_config(root, "keep")
    cfg["checkpoint"] = {"every": 1, "keep_last": 2, "keep_best": "loss", "best_mode": "min"}
    train(cfg)
    run = root / "keep"
    losses = {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}
    best_step = min(losses, key=losses.get)
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    expected = sorted({f"step-{s:08d}" for s in (11, 12, best_step)})
    assert kept == expected
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["checkpoint"] == f"step-{best_step:08d}" and best["value"] == pytest.approx(losses[best_step])
