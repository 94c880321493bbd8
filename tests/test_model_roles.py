"""Every model path a run names is checked for the head its role needs, before training, and every
error names the field the user wrote (issue "Hard to misuse, round 4", items 2 and 6).

Before: a causal LM given as a reward model (or ensemble member) got a randomly initialised score
head and the run trained on noise without a word; a reward model given as the policy or teacher
loaded (the tiny model ties its embeddings, so no weight was reported missing); a missing teacher
was reported as `model.path`, and a missing ensemble member as Hugging Face's "Repo id must be in
the form ...". Each case runs `rlft train` in this process and must stop with one `error:` line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import DIGITS_REWARD, assert_clean_user_error, run_main, write_jsonl

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _with_tokenizer(folder: Path, source: Path) -> Path:
    for name in TOKENIZER:
        shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen_path) -> dict[str, Path]:
    """The tiny causal LM; a reward model made from it (Qwen2ForSequenceClassification, score head
    saved); the same classifier with its score weights dropped; a folder whose checkpoint holds only
    a score head (no backbone); one whose model_type this transformers does not know; prompts and a
    rule reward."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("roles")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(qwen_path), num_labels=1)
    rm.save_pretrained(root / "rm")
    _with_tokenizer(root / "rm", qwen_path)
    weights = load_file(root / "rm" / "model.safetensors")
    shutil.copytree(root / "rm", root / "rm-no-score")
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")},
              root / "rm-no-score" / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(root / "rm", root / "head-only")
    save_file({k: v for k, v in weights.items() if k.startswith("score.")},
              root / "head-only" / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(root / "rm", root / "unknown-type")  # e.g. saved by a newer transformers
    config = json.loads((root / "unknown-type" / "config.json").read_text())
    (root / "unknown-type" / "config.json").write_text(json.dumps({**config, "model_type": "qwen99"}))
    (root / "reward.py").write_text(DIGITS_REWARD)
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(4)])
    return {"root": root, "lm": qwen_path, "rm": root / "rm", "rm_no_score": root / "rm-no-score",
            "head_only": root / "head-only", "unknown_type": root / "unknown-type"}


def _config(f: dict[str, Path], name: str, method: str = "grpo", **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "method": method, "output_dir": str(f["root"] / "runs" / name), "seed": 0,
        "model": {"path": str(f["lm"]), "device": "cpu"},
        "data": {"train": str(f["root"] / "prompts.jsonl")},
        "training": {"learning_rate": 1e-3, "max_steps": 1, "num_threads": 1, "precision": "fp32"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": [{"fn": f"{f['root'] / 'reward.py'}:digits"}],
        "logging": {"progress": False},
    }
    cfg.update(sections)
    return cfg


def _refused(f: dict[str, Path], cfg: dict[str, Any], monkeypatch, capsys) -> str:
    """`rlft train` on `cfg`: one clean `error:` line, nothing trained; the message, wrapping undone."""
    path = f["root"] / f"{Path(cfg['output_dir']).name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    err = " ".join(assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(path))).split())
    assert not (Path(cfg["output_dir"]) / "final").exists()
    assert "Repo id must be" not in err
    return err


# -- the policy and the teacher: causal LMs -----------------------------------------------------

def test_a_reward_model_as_the_policy_is_refused(folders, monkeypatch, capsys):
    err = _refused(folders, _config(folders, "policy-rm", model={"path": str(folders["rm"]), "device": "cpu"}),
                   monkeypatch, capsys)
    assert f"model.path {str(folders['rm'])!r} holds Qwen2ForSequenceClassification" in err
    assert "Fix: point model.path at a causal language model" in err


@pytest.mark.parametrize("teacher, expected", [
    ("rm", "teacher.path {!r} holds Qwen2ForSequenceClassification"),
    ("missing", "teacher.path {!r}: no such folder"),
])
def test_a_teacher_that_is_not_a_causal_lm_or_not_there_names_teacher_path(folders, monkeypatch, capsys, teacher,
                                                                           expected):
    path = str(folders["rm"] if teacher == "rm" else folders["root"] / "teachr")
    err = _refused(folders, _config(folders, f"teacher-{teacher}", "distill", teacher={"path": path}),
                   monkeypatch, capsys)
    assert expected.format(path) in err
    assert "model.path" not in err.split("Fix:")[0]


# -- reward models and ensemble members: a trained score head ------------------------------------

def test_a_causal_lm_as_the_reward_model_is_refused_with_the_fix(folders, monkeypatch, capsys):
    cfg = _config(folders, "rm-lm", rewards=[{"fn": "reward_model", "args": {"path": str(folders["lm"])}}])
    err = _refused(folders, cfg, monkeypatch, capsys)
    assert f"rewards[0].args.path {str(folders['lm'])!r} holds Qwen2ForCausalLM, not a reward model" in err
    assert "randomly initialised score head" in err
    assert "method: reward_model" in err and "point rewards[0].args.path at a reward model" in err


def test_a_classifier_whose_score_weights_are_missing_is_refused(folders, monkeypatch, capsys):
    rewards = [{"fn": f"{folders['root'] / 'reward.py'}:digits"},
               {"fn": "reward_model", "args": {"path": str(folders["rm_no_score"])}}]
    err = _refused(folders, _config(folders, "rm-no-score", rewards=rewards), monkeypatch, capsys)
    assert f"rewards[1].args.path {str(folders['rm_no_score'])!r} has no weights for score.weight" in err
    assert "method: reward_model" in err


@pytest.mark.parametrize("member, expected", [
    ("lm", "rewards[0].args.paths[1] {!r} holds Qwen2ForCausalLM, not a reward model"),
    ("missing", "rewards[0].args.paths[1] {!r}: no such folder"),
])
def test_an_ensemble_member_that_is_not_a_reward_model_or_not_there_is_named(folders, monkeypatch, capsys, member,
                                                                             expected):
    second = str(folders["lm"] if member == "lm" else folders["root"] / "rm2")
    cfg = _config(folders, f"ensemble-{member}",
                  rewards=[{"fn": "reward_model_ensemble", "args": {"paths": [str(folders["rm"]), second]}}])
    err = _refused(folders, cfg, monkeypatch, capsys)
    assert expected.format(second) in err


def test_a_reward_model_in_an_eval_suite_is_named_by_its_place_in_the_suite(folders, monkeypatch, capsys):
    suite = {"name": "held", "data": str(folders["root"] / "prompts.jsonl"),
             "rewards": [{"fn": "reward_model", "args": {"path": str(folders["lm"])}}]}
    err = _refused(folders, _config(folders, "suite-rm-lm", eval={"suites": [suite]}), monkeypatch, capsys)
    assert f"eval.suites[0].rewards[0].args.path {str(folders['lm'])!r} holds Qwen2ForCausalLM" in err


def test_a_causal_lm_as_the_comparison_judge_model_names_the_flag(folders, monkeypatch, capsys):
    lm = str(folders["lm"])
    result = run_main(monkeypatch, capsys, "eval", lm, "--data", str(folders["root"] / "prompts.jsonl"),
                      "--compare", lm, "--judge-model", lm)
    err = " ".join(assert_clean_user_error(result).split())
    assert f"--judge-model {lm!r} holds Qwen2ForCausalLM, not a reward model" in err


# -- the PPO critic: a backbone from its checkpoint -------------------------------------------

@pytest.mark.parametrize("critic, expected", [
    ("missing", "critic.path {!r}: no such folder"),
    ("head_only", "critic.path {!r} has no weights for model."),
    ("unknown_type", "critic.path {!r}: cannot load it as the critic"),
])
def test_a_critic_path_that_is_not_there_or_has_no_backbone_names_critic_path(folders, monkeypatch, capsys, critic,
                                                                              expected):
    path = str(folders["root"] / "critc" if critic == "missing" else folders[critic])
    err = _refused(folders, _config(folders, f"critic-{critic}", "ppo", critic={"path": path}), monkeypatch, capsys)
    assert expected.format(path) in err
