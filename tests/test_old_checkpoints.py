"""Checkpoints written before the package layout of 2026-12 (c964299: the online loop in
training/online.py and training/collect.py) resume under the new one. Only an async run's
checkpoint names rlft classes (its queued rollouts); tests/data/pre_move/ holds a real one."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from conftest import DIGITS_REWARD
from rlft.api import train
from rlft.data.prompts import PromptExample
from rlft.models.tiny import build_tiny_model
from rlft.rewards.scores import Scores
from rlft.rollout.contract import Completion
from rlft.training.checkpoint import load_trainer_state
from rlft.training.online.collect import Rollout
from test_resume import assert_same_run

PRE_MOVE = Path(__file__).parent / "data" / "pre_move" / "async_k1_trainer_state.pt"
OLD, NEW = b"rlft.training.collect\n", b"rlft.training.online.collect\n"  # pickle's GLOBAL opcode: module, newline


def test_a_checkpoint_written_before_the_move_loads_its_queued_rollouts_as_todays_classes(tmp_path):
    assert OLD in _pickle_bytes(PRE_MOVE)  # what the file names: the class where it lived then
    (tmp_path / "trainer_state.pt").write_bytes(PRE_MOVE.read_bytes())
    state = load_trainer_state(tmp_path)
    queue = state["parts"]["rollouts"]
    assert (queue["first"], queue["next"]) == (2, 4)  # k = 1: batches 3 and 4 wait, sampled from versions 1 and 2
    batches = queue["rollouts"]
    assert [type(b) for b in batches] == [Rollout, Rollout]
    assert [b.completions[0].policy_version for b in batches] == [1, 2]
    for b in batches:
        assert len(b.completions) == len(b.examples) == len(b.group_ids) == 12  # 3 prompts x 4 samples
        assert all(isinstance(c, Completion) for c in b.completions)
        assert all(isinstance(e, PromptExample) for e in b.examples)
        assert isinstance(b.scores, Scores) and len(b.rewards) == 12


def test_an_async_run_checkpointed_under_the_old_module_names_resumes_bitwise(tmp_path):
    """A run stopped after step 2 whose checkpoint is rewritten to name the queued rollouts' class
    where c964299 pickled it, continued to step 4: the same as a run left alone."""
    build_tiny_model(tmp_path / "model", seed=0)
    (tmp_path / "reward.py").write_text(DIGITS_REWARD)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")

    def cfg(name: str) -> dict:
        return {"method": "grpo", "output_dir": str(tmp_path / name), "seed": 3,
                "model": {"path": str(tmp_path / "model")}, "data": {"train": str(tmp_path / "prompts.jsonl")},
                "training": {"learning_rate": 1e-2, "max_steps": 4, "num_threads": 1, "precision": "fp32",
                             "lr_scheduler": "constant"},
                "rollout": {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 8, "async_steps": 1,
                            "sampler": "thread"},
                "algorithm": {"epochs": 2, "minibatches": 2, "rollout_correction": "tis"},
                "rewards": [{"fn": f"{tmp_path / 'reward.py'}:digits"}],
                "checkpoint": {"every": 1, "keep_last": 1}, "logging": {"progress": False, "sample_every": 2}}

    assert train(cfg("whole"))["status"] == "completed"
    assert train(cfg("stopped"), ["training.max_steps=2"])["status"] == "completed"
    step = tmp_path / "stopped" / "checkpoints" / "step-00000002"
    _rename_in_pickle(step, NEW, OLD)
    assert OLD in _pickle_bytes(step / "trainer_state.pt")
    assert train(cfg("stopped"))["status"] == "completed"
    assert_same_run(tmp_path / "whole", tmp_path / "stopped")


def _pickle_bytes(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def _rename_in_pickle(step: Path, new: bytes, old: bytes) -> None:
    """Rewrite trainer_state.pt's pickle to name `old` where it names `new`, and its digest in the
    checkpoint's manifest (a checkpoint whose files do not match is skipped as corrupt)."""
    path = step / "trainer_state.pt"
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info.filename)) for info in z.infolist()]
    assert any(new in data for info, data in entries if info.filename.endswith("data.pkl"))
    with zipfile.ZipFile(path, "w") as z:
        for info, data in entries:
            z.writestr(info, data.replace(new, old) if info.filename.endswith("data.pkl") else data)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["trainer_state.pt"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))
