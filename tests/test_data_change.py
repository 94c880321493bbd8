"""A run records what it trains on (data.json: per local source, its size, line or row count and a
hash) and a resume compares: training data replaced between two attempts is one clear error, not a
silent continuation on other rows."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import DIGITS_REWARD, assert_clean_user_error, run_main
from rlft.api import train
from rlft.data import fingerprint as fp
from rlft.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("datachange")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD)
    return root


def prompts(n: int, word: str) -> str:
    return "".join(json.dumps({"prompt": f"{word} {i}."}) + "\n" for i in range(n))


def test_resuming_after_the_training_file_was_replaced_stops_with_one_clear_error(root, tmp_path, monkeypatch,
                                                                                   capsys):
    """Before: a resume after prompts.jsonl was replaced (2,000 rows -> 50 other rows) went ahead."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(prompts(2000, "Count to"))
    out = tmp_path / "run"
    cfg = {"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(data)}, "training": {"learning_rate": 1e-2, "max_steps": 2, "num_threads": 1},
           "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
           "rewards": [{"fn": f"{root / 'reward.py'}:digits"}], "checkpoint": {"every": 1},
           "logging": {"progress": False}}
    assert train(cfg)["status"] == "completed"
    recorded = json.loads((out / "data.json").read_text())[str(data)]
    assert recorded["lines"] == 2000 and recorded["bytes"] == data.stat().st_size

    original = data.read_bytes()
    data.write_text(prompts(50, "Something else"))
    err = " ".join(assert_clean_user_error(
        run_main(monkeypatch, capsys, "train", "--resume", str(out), "training.max_steps=3")).split())
    assert (f"{data} (data.train) has changed since the run started: 2,000 lines, {len(original):,} bytes then, "
            f"50 lines, {data.stat().st_size:,} bytes now") in err
    assert f"Fix: put the original file back, or train on the new data in a new run: output_dir={out}-2" in err
    assert json.loads((out / "data.json").read_text())[str(data)] == recorded  # still what the run trained on

    data.write_bytes(original)  # restored: a new modification time, the same rows
    os.utime(data, (1, 1))
    assert train(cfg, ["training.max_steps=3"])["step"] == 3


def test_a_fingerprint_sees_new_content_not_a_copy(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(prompts(20, "Count to"))
    b = tmp_path / "b.jsonl"
    shutil.copy(a, b)
    os.utime(b, (1, 1))  # a copy, or a `touch`: another modification time, the same rows
    assert fp.fingerprint(str(a)) == fp.fingerprint(str(b))
    b.write_text(prompts(20, "Count to").replace("Count to 7.", "Count to 8."))  # the same size
    assert fp.fingerprint(str(b))["bytes"] == fp.fingerprint(str(a))["bytes"]
    assert fp.fingerprint(str(b)) != fp.fingerprint(str(a))
    assert fp.fingerprint("hf:openai/gsm8k") is None and fp.fingerprint(str(tmp_path / "gone.jsonl")) is None


def test_a_big_file_is_fingerprinted_by_its_ends_size_and_line_count(tmp_path, monkeypatch):
    """Beyond WHOLE_HASH_MAX only the first and last MiB are hashed (every start computes the
    fingerprint: hashing files of many GB whole would cost minutes); the size and the line count
    still see rows added or removed in the middle."""
    monkeypatch.setattr(fp, "WHOLE_HASH_MAX", 64)
    monkeypatch.setattr(fp, "ENDS", 16)
    big = tmp_path / "big.jsonl"
    rows = [json.dumps({"prompt": f"row {i:03d}"}) + "\n" for i in range(40)]
    big.write_text("".join(rows))
    before = fp.fingerprint(str(big))
    assert before["lines"] == 40
    big.write_text("".join(rows[:20] + rows[21:]))  # a row gone from the middle
    assert fp.fingerprint(str(big))["lines"] == 39 and fp.fingerprint(str(big)) != before
    big.write_text("".join(rows[:-1] + [rows[-1].replace("039", "040")]))  # the last row, same size
    assert fp.fingerprint(str(big)) != before
    big.write_text("".join(rows[:20] + [rows[20].replace("020", "021")] + rows[21:]))  # inside, same size
    assert fp.fingerprint(str(big)) == before  # the one change it is blind to (the module docstring)
