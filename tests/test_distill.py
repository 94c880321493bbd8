"""On-policy distillation (method: distill): the student samples, the teacher scores each token,
and the student moves toward the teacher; a teacher that reads ids differently is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DIGITS_REWARD, arithmetic_rows, write_jsonl
from rlft.api import train
from rlft.config import LoraConfig, ModelConfig, load_config
from rlft.errors import ConfigError


def _prompts(rows):
    return [{"prompt": r["messages"][0]["content"], "answer": r["answer"]} for r in rows]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    (root / "rewards.py").write_text(DIGITS_REWARD)
    return {"root": root, "train": write_jsonl(root / "train.jsonl", _prompts(arithmetic_rows(64, seed=5))),
            "held_out": _prompts(arithmetic_rows(16, seed=6))}


def _config(data, student, teacher, name, **algorithm):
    return {"method": "distill", "output_dir": str(data["root"] / name), "seed": 0,
            "model": {"path": str(student)}, "teacher": {"path": str(teacher)},
            "data": {"train": str(data["train"])},
            "training": {"learning_rate": 1e-2, "max_steps": 12, "num_threads": 1, "lr_scheduler": "constant",
                         "precision": "fp32"},
            "rollout": {"group_size": 2, "prompts_per_step": 8, "max_new_tokens": 12},
            "algorithm": algorithm,
            "rewards": [{"fn": f"{data['root'] / 'rewards.py'}:digits"}], "logging": {"progress": False}}


def held_out_reverse_kl(student_path, teacher_path, prompts) -> float:
    """Mean per-token log pi_student - log pi_teacher on the student's own samples (T = 1) of
    held-out prompts: a Monte-Carlo estimate of KL(student || teacher) per token."""
    from rlft.models.loading import load_policy
    from rlft.models.template import encode_text, render
    from rlft.rollout import build_engine
    from rlft.rollout.batch import RolloutBatch
    from rlft.rollout.contract import SamplingParams
    from rlft.training.online.update import batch_logprobs

    student = load_policy(ModelConfig(path=str(student_path), dtype="fp32"), LoraConfig())
    teacher = load_policy(ModelConfig(path=str(teacher_path), dtype="fp32"), LoraConfig())
    tok = student.tokenizer
    ids = [encode_text(tok, render(tok, [{"role": "user", "content": p["prompt"]}], True)) for p in prompts]
    engine = build_engine(student, seed=123)
    completions = engine.generate(ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=12))
    batch = RolloutBatch.from_completions(completions, [c.prompt_index for c in completions], tok.pad_token_id,
                                          student.device)
    with torch.no_grad():
        teacher_lp = batch_logprobs(teacher.model, batch, 1.0, None)
    mask = batch.completion_mask
    return float(((batch.sampling_logprobs - teacher_lp) * mask).sum() / mask.sum())


def test_the_student_moves_toward_the_teacher(data, qwen_path, sft_run):
    """Teacher: the tiny model after SFT on arithmetic; student: the same model before it. Twelve
    steps of distillation lower the per-token reverse KL on held-out prompts, with no reward in
    the update (the digits reward is only measured).

    The bar is 0.6x the untrained student's KL: this pair plateaus at 0.42-0.54x (held-out KL
    5.0 -> 2.1-2.7 after 12-30 steps at lr 3e-3 to 1e-2, fp32 and bf16-mixed teachers, AMX and
    AVX2 CPUs; longer runs at the higher rates drift back up). At 0.5x the student of a teacher
    SFT-trained in bf16-mixed on AVX2 (0.52x) failed although it had learnt as much as the others.
    A student that did not move stays at 1.0x."""
    teacher = sft_run.root / "final"
    before = held_out_reverse_kl(qwen_path, teacher, data["held_out"])
    summary = train(_config(data, qwen_path, teacher, "learn"))
    assert summary["status"] == "completed"
    run = data["root"] / "learn"
    after = held_out_reverse_kl(run / "final", teacher, data["held_out"])
    print(f"held-out reverse KL per token: {before:.3f} -> {after:.3f}")
    assert after < 0.6 * before, (before, after)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [r["distill/reverse_kl"] for r in rows]
    assert sum(curve[-3:]) / 3 < 0.6 * sum(curve[:3]) / 3, curve
    assert "kl" not in rows[0]  # no reference model: the teacher is the anchor
    resolved = load_config(run / "config.yaml")
    assert (resolved.algorithm.advantage, resolved.algorithm.kl_coef) == ("reverse_kl", 0.0)


def test_a_teacher_with_another_vocabulary_is_refused_before_training(data, qwen_path):
    from rlft.models.tiny import build_tiny_model

    other = build_tiny_model(data["root"] / "other-tokenizer", seed=3)  # its BPE is learnt on another corpus
    with pytest.raises(ConfigError, match="another vocabulary than the student") as info:
        train(_config(data, qwen_path, other, "vocab"))
    assert "same model family" in str(info.value)
    assert not (data["root"] / "vocab" / "final").exists()


@pytest.mark.parametrize("change, why", [
    (dict(teacher=None), "set teacher.path"),
    (dict(method="grpo"), "teacher: is used by method distill only"),
    (dict(algorithm={"advantage": "group_norm"}), "takes its advantages from the teacher"),
])
def test_distillation_settings_that_cannot_work_are_refused(data, qwen_path, change, why):
    cfg = _config(data, qwen_path, qwen_path, "bad")
    cfg.update(change)
    with pytest.raises(ConfigError, match=why):
        load_config(cfg)
    # group_size 1 is fine for distillation (no group baseline), unlike the group methods
    ok = _config(data, qwen_path, qwen_path, "ok")
    ok["rollout"]["group_size"] = 1
    assert load_config(ok).rollout.group_size == 1
