"""GRPO on the tiny model with an `llm_judge` reward served by the stub (tests/judge_stub.py): the
judge's replies reach samples.jsonl and its counts metrics.jsonl; when the endpoint starts
answering without scores the run stops at max_infra_error_rate with the last step checkpointed."""

from __future__ import annotations

import json

import pytest

from judge_stub import LENGTH_RUBRIC, MODEL, JudgeStub
from rlft.api import train
from rlft.errors import TrainingHalted
from rlft.models.tiny import build_tiny_model


@pytest.fixture
def stub():
    server = JudgeStub()
    yield server
    server.close()


def test_judge_replies_are_logged_and_a_failing_judge_stops_with_a_checkpoint(tmp_path, stub):
    model = build_tiny_model(tmp_path / "model", seed=0)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    run = tmp_path / "run"
    cfg = {
        "method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(model)},
        "data": {"train": str(tmp_path / "prompts.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": 4, "num_threads": 1, "lr_scheduler": "constant"},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
        "rewards": [{"fn": "llm_judge", "name": "grader",
                     "args": {"base_url": stub.base_url, "model": MODEL, "rubric": LENGTH_RUBRIC, "backoff_s": 0.01}}],
        "scoring": {"max_infra_error_rate": 0.5},
        "logging": {"progress": False, "sample_every": 1, "num_samples": 2},
    }
    stub.garbage_after = 16  # steps 1 and 2 (8 samples each) are judged; step 3 gets replies without a score
    with pytest.raises(TrainingHalted) as err:
        train(cfg)
    message = str(err.value)
    assert "stopped at step 3: 100% of rewards could not be computed" in message and "judge endpoint" in message
    assert "Last state saved to" in message
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/grader/unparsable"] == 0.0 and r["reward/grader/failed"] == 0.0
        assert r["reward/infra_error_rate"] == 0.0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4  # two per step
    for s in samples:
        length = min(len(s["completion"]), 10)  # the stub's rubric, by hand
        assert s["info"]["grader/reply"] == f"{length} characters or more.\nScore: {length}"
        assert s["info"]["grader/raw"] == length and s["reward"] == pytest.approx(length / 10)
    assert len(stub.requests) == 24  # three steps of 8 samples, no retries (an unreadable reply is not retried)
