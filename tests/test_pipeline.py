"""`rlft pipeline`: stages chained through their exports, every stage validated before the first
one runs, completed stages skipped on a re-run unless their config changed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from conftest import DIGITS_REWARD, assert_clean_user_error, make_config, run_main, write_jsonl
from rlft.errors import ConfigError
from rlft.pipeline import plan_pipeline, run_pipeline

def _write(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _online(model: str, prompts: Path, rewards: Path, out: Path, **sections) -> dict:
    cfg = {"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": model},
           "data": {"train": str(prompts)},
           "training": {"learning_rate": 1e-3, "max_steps": 2, "num_threads": 1, "lr_scheduler": "constant"},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
           "rewards": [{"fn": f"{rewards}:digits"}], "logging": {"progress": False}}
    cfg.update(sections)
    return cfg


@pytest.fixture
def files(tmp_path, qwen_path, sft_data):
    """Stage configs as separate files in tmp_path/configs, as a user would keep them."""
    configs = tmp_path / "configs"
    configs.mkdir()
    rewards = tmp_path / "rewards.py"
    rewards.write_text(DIGITS_REWARD)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(8)])
    sft = make_config(qwen_path, sft_data["train"], tmp_path / "ignored", data={"eval": str(sft_data["eval"])},
                      training={"learning_rate": 1e-3, "batch_size": 4, "max_steps": 3, "num_threads": 1,
                                "lr_scheduler": "constant"})
    _write(configs / "sft.yaml", sft)
    _write(configs / "grpo.yaml", _online("set-by-the-pipeline", prompts, rewards, tmp_path / "ignored"))
    return tmp_path, configs, prompts, rewards


def test_plan_chains_exports_and_fills_placeholders(files):
    root, configs, prompts, rewards = files
    out = root / "pipe"
    rm = make_config("elsewhere", prompts, root / "x", method="reward_model")
    pipe = _write(configs / "pipe.yaml", {
        "output_dir": str(out),
        "stages": [
            {"name": "sft", "config": "sft.yaml"},  # found beside the pipeline file
            {"name": "rm", "config": rm, "from": "none"},  # keeps its own model.path
            {"name": "ppo", "config": "grpo.yaml", "from": "sft",
             "overrides": ["method=ppo", "critic.path={rm}", "logging.num_samples=2"]},
        ]})
    _, planned = plan_pipeline(pipe)
    by_name = {stage.name: cfg for stage, cfg in planned}
    assert [s.name for s, _ in planned] == ["sft", "rm", "ppo"]
    assert {n: c.output_dir for n, c in by_name.items()} == {n: str(out / n) for n in by_name}
    assert by_name["sft"].model.path == yaml.safe_load((configs / "sft.yaml").read_text())["model"]["path"]
    assert by_name["rm"].model.path == "elsewhere"
    assert by_name["ppo"].model.path == str(out / "sft" / "final")
    assert by_name["ppo"].critic.path == str(out / "rm" / "final")
    assert by_name["ppo"].method == "ppo" and by_name["ppo"].logging.num_samples == 2
    assert not out.exists()  # planning runs nothing


@pytest.mark.parametrize("stages, message", [
    ([{"name": "a", "config": "sft.yaml"}, {"name": "a", "config": "sft.yaml"}], "stages need unique names"),
    ([{"name": "../up", "config": "sft.yaml"}], "stage names become directory names"),
    ([{"name": "a", "config": "nope.yaml"}], "stage a: config file not found: nope.yaml"),
    ([{"name": "a", "config": "sft.yaml"}, {"name": "b", "config": "grpo.yaml", "from": "c"}],
     "stage b: from: 'c' is not an earlier stage (earlier: a)"),
    ([{"name": "a", "config": "sft.yaml", "overrides": ["training.learnin_rate=1"]}],
     "Did you mean 'training.learning_rate'?"),
    ([{"name": "a", "config": "sft.yaml", "extra": 1}], "invalid pipeline"),
])
def test_pipeline_mistakes_are_config_errors(files, stages, message):
    root, configs, _, _ = files
    pipe = _write(configs / "pipe.yaml", {"output_dir": str(root / "pipe"), "stages": stages})
    with pytest.raises(ConfigError) as err:
        plan_pipeline(pipe)
    assert message in str(err.value)
    assert not (root / "pipe").exists()


def test_a_mistake_in_the_last_stage_stops_before_the_first_one_trains(files, monkeypatch, capsys):
    root, configs, _, _ = files
    pipe = _write(configs / "pipe.yaml", {"output_dir": str(root / "pipe"), "stages": [
        {"name": "sft", "config": "sft.yaml"},
        {"name": "grpo", "config": "grpo.yaml", "overrides": ["rollout.group_sise=8"]}]})
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "pipeline", str(pipe)))
    assert "stage grpo (grpo.yaml)" in stderr and "Did you mean 'rollout.group_size'?" in stderr
    assert not (root / "pipe").exists()  # the SFT stage never started


def test_stages_run_in_order_from_each_others_exports_and_rerun_skips_them(files, monkeypatch, capsys):
    root, configs, _, _ = files
    out = root / "pipe"
    stages = [{"name": "sft", "config": "sft.yaml"}, {"name": "grpo", "config": "grpo.yaml"}]
    pipe = _write(configs / "pipe.yaml", {"output_dir": str(out), "stages": stages})

    results = run_pipeline(pipe)
    assert [results[n]["status"] for n in ("sft", "grpo")] == ["completed", "completed"]
    saved = yaml.safe_load((out / "grpo" / "config.yaml").read_text())
    assert saved["model"]["path"] == str(out / "sft" / "final") and saved["output_dir"] == str(out / "grpo")
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    assert json.loads((out / "pipeline_summary.json").read_text())["grpo"]["status"] == "completed"
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2
    logged = {n: (out / n / "metrics.jsonl").read_text() for n in ("sft", "grpo")}

    # a re-run through the CLI trains nothing and shows each stage's headline held-out numbers
    result = run_main(monkeypatch, capsys, "pipeline", str(pipe))
    shown = result.stdout + result.stderr
    assert result.returncode == 0, shown
    assert shown.count("already complete, skipped") == 2
    assert f"loss={results['sft']['eval/loss']:.3f}" in shown
    assert {n: (out / n / "metrics.jsonl").read_text() for n in ("sft", "grpo")} == logged

    # a completed stage whose config changed is not silently reused
    stages[1]["overrides"] = ["training.learning_rate=5e-4"]
    _write(pipe, {"output_dir": str(out), "stages": stages})
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "pipeline", str(pipe)))
    assert "stage grpo" in stderr and "completed with a different config (training.learning_rate)" in stderr
    assert {n: (out / n / "metrics.jsonl").read_text() for n in ("sft", "grpo")} == logged


def test_a_dpo_stage_starts_from_the_sft_export_and_learns_the_preferences(tmp_path, qwen_path, sft_data):
    """sft -> dpo through `rlft pipeline`: the DPO stage loads the SFT stage's export (its saved
    model.path, and its trained weights stay next to that export, far from the base model's), and
    its preference metrics move: at step 1 policy = reference, so every pair ties (margin 0);
    after training the held-out implicit-reward margin and accuracy are positive."""
    from safetensors.torch import load_file

    from rlft.demo.arithmetic import write_preference_data

    pairs = write_preference_data(tmp_path / "pairs", train_rows=64, heldout=32)
    sft = make_config(qwen_path, sft_data["train"], tmp_path / "ignored",
                      training={"learning_rate": 3e-3, "batch_size": 16, "max_steps": 4, "precision": "fp32"})
    dpo = {"method": "dpo", "output_dir": str(tmp_path / "ignored"), "seed": 0, "model": {"path": "from-the-pipeline"},
           "data": {"train": str(pairs["train"]), "eval": str(pairs["heldout"]), "max_length": 128},
           "dpo": {"beta": 0.1},
           "training": {"learning_rate": 5e-4, "batch_size": 16, "max_steps": 4, "num_threads": 1,
                        "lr_scheduler": "constant", "precision": "fp32"},
           "logging": {"progress": False}}
    out = tmp_path / "pipe"
    pipe = _write(tmp_path / "pipe.yaml", {"output_dir": str(out), "stages": [
        {"name": "sft", "config": str(_write(tmp_path / "sft.yaml", sft))},
        {"name": "dpo", "config": str(_write(tmp_path / "dpo.yaml", dpo))}]})
    results = run_pipeline(pipe)
    assert [results[n]["status"] for n in ("sft", "dpo")] == ["completed", "completed"]
    assert yaml.safe_load((out / "dpo" / "config.yaml").read_text())["model"]["path"] == str(out / "sft" / "final")

    base = load_file(str(qwen_path / "model.safetensors"))
    after_sft = load_file(str(out / "sft" / "final" / "model.safetensors"))
    after_dpo = load_file(str(out / "dpo" / "final" / "model.safetensors"))

    def distance(a, b):
        return sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5

    # Adam moves each weight by ~lr per step: 4 SFT steps at 3e-3 vs 4 DPO steps at 5e-4
    assert 0 < distance(after_dpo, after_sft) < distance(after_dpo, base) / 2

    rows = [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rewards/margin" in r]
    assert len(train_rows) == 4
    assert train_rows[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6)  # policy = reference at step 1
    assert train_rows[-1]["rewards/margin"] > 0.0
    # held out: every pair ties at the start (loss ln 2 = 0.6931, margin 0, accuracy 0); after
    # 4 steps the chosen answers are preferred
    ev = results["dpo"]
    assert ev["eval/loss"] < math.log(2) - 0.005 and ev["eval/rewards/margin"] > 0.01
    assert ev["eval/rewards/accuracy"] > 0.5


def test_a_stages_data_sources_are_checked_as_training_reads_them(files):
    """A generated task is no path, a mix's sources are each checked, and a missing one is named
    by its setting (a mix used to crash the check, a reasoning_gym source to fail it)."""
    root, configs, prompts, rewards = files
    mixed = _online("m", prompts, rewards, root / "x", data={"train": [
        {"path": str(prompts), "weight": 1.0}, {"path": "reasoning_gym:basic_arithmetic", "weight": 1.0}]})
    _write(configs / "mixed.yaml", mixed)
    pipe = _write(configs / "pipe.yaml", {"output_dir": str(root / "pipe"),
                                          "stages": [{"name": "a", "config": "mixed.yaml", "from": "none"}]})
    [(_, cfg)] = plan_pipeline(pipe)[1]
    assert [s.path for s in cfg.data.train] == [str(prompts), "reasoning_gym:basic_arithmetic"]
    mixed["data"]["train"][1]["path"] = str(root / "gone.jsonl")
    _write(configs / "mixed.yaml", mixed)
    with pytest.raises(ConfigError, match=r"stage a: data.train\[1\] not found: .*gone.jsonl"):
        plan_pipeline(pipe)
