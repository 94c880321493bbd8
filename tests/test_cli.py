"""The `rlft` command: help, tiny-model, and user errors printed as one line without a traceback.

The error handling lives in `main()`, which typer's CliRunner would bypass, so tests call `main()`
with a patched argv, and the real console script runs as a subprocess where a traceback would
show (each subprocess costs a few seconds of imports, so only two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_the_demo_runs_twice_into_the_same_folder(tmp_path, monkeypatch, capsys):
    """A second `make demo` must start afresh, not stop with "nothing to train" on the first's runs;
    and what it hands the reader holds together: results.json's accuracies are shares of the
    held-out problems (k / n in [0, 1]; the whole set's is the suites' size-weighted mean), the
    printed table shows those numbers, and report.html has its sections and a plot of every series
    both runs logged. (Before: only that the two runs' results were equal.)"""
    from rlft.demo import DemoSettings, run_demo
    from rlft.monitor.console import console
    from report_checks import assert_report_shows_runs

    monkeypatch.setattr(console, "_width", 250)  # one table row per line
    small = DemoSettings(heldout=8, sft_rows=32, rl_rows=32, sft_epochs=1, rl_steps=1, prompts_per_step=2,
                         group_size=2, threads=1)
    first = run_demo(tmp_path / "demo", small)
    capsys.readouterr()
    second = run_demo(tmp_path / "demo", small)
    printed = capsys.readouterr().err
    assert second["sft"] == first["sft"] and second["rl"] == first["rl"]  # the same seed, trained again

    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert results == second
    assert_results_match_table(results, printed, small.heldout)

    page = (tmp_path / "demo" / "report.html").read_text()
    for section in ("Config fields that differ", "Health events", "Reward", "Held-out", "Training",
                    "Sample completions"):
        assert f"<h2>{section}</h2>" in page, section
    runs = tmp_path / "demo" / "runs"
    plotted = assert_report_shows_runs(tmp_path / "demo" / "report.html", [runs / "sft", runs / "grpo"])
    assert {"loss", "reward/correct", "eval/target/accuracy"} <= set(plotted)


def assert_results_match_table(results, printed, heldout):
    """results.json's accuracies are shares k / n of the held-out problems, the whole set's is its
    suites' size-weighted mean, and the printed table shows exactly those numbers."""
    for name, label in (("base", "base (random init)"), ("sft", "SFT (sloppy data)"), ("rl", "SFT + GRPO")):
        m = results[name]
        sizes = {suite: m[f"eval/{suite}/num_prompts"] for suite in ("target", "retention")}
        assert sum(sizes.values()) == heldout
        for suite, n in sizes.items():
            accuracy = m[f"eval/{suite}/accuracy"]
            assert isinstance(accuracy, (int, float)) and 0.0 <= accuracy <= 1.0
            assert abs(accuracy * n - round(accuracy * n)) < 1e-9  # k correct of n
        whole = sum(m[f"eval/{suite}/accuracy"] * n for suite, n in sizes.items()) / heldout
        assert results[f"{name}_accuracy"] == m["heldout/accuracy"] == pytest.approx(whole, abs=1e-12)
        row = next(line for line in printed.splitlines() if label in line)
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        assert cells == [label, f"{m['heldout/accuracy']:.3f}", f"{m['eval/target/accuracy']:.3f}",
                         f"{m['eval/retention/accuracy']:.3f}", f"{m['heldout/format_compliance']:.3f}",
                         f"{m['heldout/length_mean']:.1f}"], row
    assert f"RL - SFT = {results['rl_accuracy'] - results['sft_accuracy']:+.3f}" in printed


def test_the_demo_table_prints_the_results(monkeypatch, capsys):
    """The demo's own short run in the test above scores 0 everywhere on equal-sized suites, which
    cannot tell a swapped column or a wrong weighting; here the suites differ in size and score."""
    from rlft.demo import tiny
    from rlft.monitor.console import console

    monkeypatch.setattr(console, "_width", 250)
    results = {"heldout_size": 10, "seconds": 1.0, "reward_curve": [{"step": 1, "correct": 0.5}]}
    for name, (target, retention) in {"base": (0, 1), "sft": (1, 5), "rl": (4, 6)}.items():
        # 4 carry problems, 6 without: accuracy k/4 and k/6; format and length differ by suite too
        metrics = {"eval/target/num_prompts": 4.0, "eval/retention/num_prompts": 6.0,
                   "eval/target/accuracy": target / 4, "eval/retention/accuracy": retention / 6,
                   "eval/target/format_compliance": 0.25, "eval/retention/format_compliance": 1.0,
                   "eval/target/length_mean": 30.0, "eval/retention/length_mean": 20.0}
        results[name] = tiny._heldout(metrics)
        results[f"{name}_accuracy"] = results[name]["heldout/accuracy"]
    assert results["rl"]["heldout/accuracy"] == pytest.approx(10 / 10)
    assert results["sft"]["heldout/accuracy"] == pytest.approx(6 / 10)
    assert results["sft"]["heldout/format_compliance"] == pytest.approx((4 * 0.25 + 6 * 1.0) / 10)
    assert results["sft"]["heldout/length_mean"] == pytest.approx((4 * 30 + 6 * 20) / 10)
    tiny._print_table(results, Path("out"))
    assert_results_match_table(results, capsys.readouterr().err, 10)
