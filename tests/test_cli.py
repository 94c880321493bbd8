"""The `rlft` command: help, tiny-model, and user errors printed as one line without a traceback.

The error handling lives in `main()`, which typer's CliRunner would bypass, so tests call `main()`
with a patched argv, and the real console script runs as a subprocess where a traceback would
show (each subprocess costs a few seconds of imports, so only two)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import assert_clean_user_error, make_config, run_main

RLFT = Path(sys.executable).parent / "rlft"
COMMANDS = {
    "train": "Train from a YAML config",
    "eval": "Evaluate a model folder or run directory",
    "tiny-model": "Write a ~1M-parameter random-weight model",
    "demo": "Run a CPU demo",
    "sandbox": "code-reward sandbox.",
    "config-help": "List every config field with its default and meaning.",
}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed console script in a subprocess."""
    # Wide terminal: rich wraps at 80 columns otherwise.
    env = {**os.environ, "COLUMNS": "250", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(RLFT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_console_script_exists():
    assert RLFT.is_file() and os.access(RLFT, os.X_OK)


def test_help_lists_every_command_with_one_line_of_help():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, help_start in COMMANDS.items():
        rows = [ln for ln in lines if ln.strip("│ ").startswith(name + " ")]
        assert len(rows) == 1, (name, result.stdout)
        assert help_start in rows[0], rows[0]
        # one line: the row ends with the end of the help sentence (no continuation line)
        assert rows[0].rstrip(" │").endswith("."), rows[0]


def test_tiny_model_llama_loads_with_transformers(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny-llama"
    result = run_main(monkeypatch, capsys, "tiny-model", str(out), "--arch", "llama")
    assert result.returncode == 0, result.stdout + result.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n_params < 2e6  # "~1M parameters"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "bos_token" in tok.chat_template
    assert tok.bos_token == "<s>"


def test_tiny_model_bad_arch_is_a_user_error(tmp_path, monkeypatch, capsys):
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "tiny-model", str(tmp_path / "m"), "--arch", "gpt2"))
    assert "error: --arch must be qwen2 or llama, got 'gpt2'" in stderr


def test_config_error_prints_one_line_and_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    raw = make_config("some/model", "train.jsonl", tmp_path / "run")
    raw["training"]["learnin_rate"] = 1e-4
    bad.write_text(yaml.safe_dump(raw))
    stderr = assert_clean_user_error(run("train", str(bad)))
    assert f"error: {bad}: invalid configuration" in stderr
    assert "training.learnin_rate: unknown key. Did you mean 'training.learning_rate'?" in stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_bad_override_through_the_cli(tmp_path, monkeypatch, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(make_config("some/model", "train.jsonl", tmp_path / "run")))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(good), "training.learning_rate"))
    assert "bad override 'training.learning_rate'" in stderr


def test_train_without_a_config_is_a_user_error(monkeypatch, capsys):
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train"))
    assert "give a config file" in stderr


def test_error_from_inside_training_is_also_clean(tmp_path, qwen_path, monkeypatch, capsys):
    # A DataError raised after the model is loaded goes through the same handler.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(make_config(str(qwen_path), str(tmp_path / "missing.jsonl"), str(tmp_path / "run"))))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(cfg)))
    assert f"error: data file not found: {tmp_path / 'missing.jsonl'}" in stderr


def test_config_help_lists_fields(monkeypatch, capsys):
    result = run_main(monkeypatch, capsys, "config-help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "model.path = required" in out and "[algorithm]" in out
    # defaults that depend on the method show each method's real value, not None
    assert "training.learning_rate = by method: sft 1e-05, reward_model 1e-05, dpo 1e-06, grpo 1e-06" in out
    assert "algorithm.kl_coef = by method: grpo 0.04, dr_grpo 0.0, dapo 0.0, rloo 0.05" in out
    assert "kl_coef = None" not in out
    # choice fields list their allowed values
    assert "algorithm.kl_estimator = by method: grpo 'k3'" in out and "(one of: 'k1', 'k2', 'k3')" in out


def test_the_demo_runs_twice_into_the_same_folder(tmp_path):
    # a second `make demo` must start afresh, not stop with "nothing to train" on the first's runs
    from rlft.demo import DemoSettings, run_demo

    small = DemoSettings(heldout=8, sft_rows=32, rl_rows=32, sft_epochs=1, rl_steps=1, prompts_per_step=2,
                         group_size=2, threads=1)
    first = run_demo(tmp_path / "demo", small)
    second = run_demo(tmp_path / "demo", small)
    assert second["sft"] == first["sft"] and second["rl"] == first["rl"]  # the same seed, trained again
