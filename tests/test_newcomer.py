"""What a newcomer hits first: the README's Python example, progress in a log file, the exit
status of Ctrl-C, where a bad override came from, config-help's reward arguments, checked CLI
flags, and a data row too large to parse."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import arithmetic_rows, assert_clean_user_error, make_config, run_main, write_jsonl
from rlft.config import load_config
from rlft.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]


def _tiny_sft(root: Path, model: Path, rows: int = 4, **sections) -> dict:
    """`rows` rows, by default in one batch: one step per epoch."""
    data = write_jsonl(root / "train.jsonl", arithmetic_rows(rows, seed=0))
    base = {"data": {"max_length": 64}, "training": {"batch_size": rows}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return make_config(model, data, root / "runs" / "sft", **base)


# -- the README's Python example, exactly as written --------------------------------------------

def test_the_readme_python_example_runs_as_written(tmp_path, qwen_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    example = next(b for b in blocks if "rlft.train(" in b)
    assert 'rlft.train("examples/sft.yaml", ["training.epochs=2", "output_dir=runs/sft-2ep"])' in example
    (tmp_path / "examples").mkdir()
    cfg = {**_tiny_sft(tmp_path, qwen_path), "output_dir": "runs/sft"}  # relative, as in the README
    (tmp_path / "examples" / "sft.yaml").write_text(yaml.safe_dump(cfg))
    script = example + "\nimport json\nprint(json.dumps({'status': summary['status'], 'step': summary['step']}))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"status": "completed", "step": 2}  # 2 epochs x 1
    assert (tmp_path / "runs" / "sft-2ep" / "final" / "config.json").is_file()


# -- progress when the output is a file ------------------------------------------------------

def test_progress_lines_appear_when_the_output_is_not_a_terminal(tmp_path, qwen_path, capsys):
    from rlft.api import train

    train(_tiny_sft(tmp_path, qwen_path, rows=4, training={"batch_size": 2}, logging={"progress": True}))
    err = capsys.readouterr().err  # captured: not a terminal
    lines = [ln for ln in err.splitlines() if ln.startswith("sft step ")]
    # the first and the last step (2 rows per step, 4 rows: 2 steps), each on one line with an ETA
    assert [ln.split()[2] for ln in lines] == ["1/2", "2/2"], err
    assert all(re.search(r"loss=\S+ .*\| \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d$", ln) for ln in lines), lines
    assert "━" not in err and "\x1b[" not in err  # no live bar drawn into a log


def test_progress_lines_are_spaced_by_the_interval():
    from rlft.monitor import console as console_module

    now = [0.0]
    printed = []
    display = console_module.ProgressDisplay(10, 0, ["loss"], True, "sft", interval_s=30, clock=lambda: now[0])
    display._lines = True  # as when the output is a file
    original = console_module.console.print
    console_module.console.print = lambda text, **kw: printed.append(text)
    try:
        for step in range(1, 11):
            now[0] = step * 10.0  # 10 s per step
            display.update(step, {"loss": 1.0 / step})
    finally:
        console_module.console.print = original
    # step 1 (first), then every >= 30 s (steps 4, 7, 10); step 10 is also the last
    assert [p.split()[2] for p in printed] == ["1/10", "4/10", "7/10", "10/10"]
    # at step 4: 40 s for 4 steps, 6 left -> ETA 60 s
    assert printed[1] == "sft step 4/10 (40%) loss=0.25 | 0:00:40 elapsed, ETA 0:01:00"


# -- Ctrl-C ends with 130 and the resume hint ------------------------------------------------

def test_an_interrupted_run_exits_130_with_the_resume_hint(tmp_path, qwen_path, monkeypatch, capsys):
    from rlft.training.session import TrainingSession

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_tiny_sft(tmp_path, qwen_path, rows=8, training={"batch_size": 2})))
    log = TrainingSession.log

    def log_then_ctrl_c(self, metrics):  # Ctrl-C right after the first step
        log(self, metrics)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs on the next bytecode of the main thread

    monkeypatch.setattr(TrainingSession, "log", log_then_ctrl_c)
    result = run_main(monkeypatch, capsys, "train", str(cfg))
    output = result.stdout + result.stderr
    assert result.returncode == 130, output
    assert f"resume with: rlft train --resume {tmp_path / 'runs' / 'sft'}" in output and "Traceback" not in output
    assert json.loads((tmp_path / "runs" / "sft" / "summary.json").read_text())["status"] == "interrupted"


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path, qwen_path, monkeypatch, capsys):
    from rlft.training.session import TrainingSession

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_tiny_sft(tmp_path, qwen_path, rows=8, training={"batch_size": 2})))
    log = TrainingSession.log

    def log_then_two_ctrl_c(self, metrics):
        log(self, metrics)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)

    monkeypatch.setattr(TrainingSession, "log", log_then_two_ctrl_c)
    result = run_main(monkeypatch, capsys, "train", str(cfg))
    output = result.stdout + result.stderr
    assert result.returncode == 130 and "Traceback" not in output, output
    assert "second SIGINT: stopping now without saving" in output and "interrupted (SIGINT)" in output
    assert not (tmp_path / "runs" / "sft" / "summary.json").exists()


def test_the_exit_status_follows_the_signal_named_in_the_summary():
    from rlft.cli.app import _signal_number

    assert 128 + _signal_number("SIGTERM") == 143 and 128 + _signal_number(None) == 130


# -- overrides name themselves ---------------------------------------------------------------

def test_an_override_typo_is_reported_as_the_command_line_override(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(make_config("m", "t.jsonl", tmp_path / "run")))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["training.learnin_rate=1", "training.epochs=two"])
    message = str(info.value)
    assert "invalid configuration" not in message and str(path) not in message  # the file is fine
    assert ("command-line override 'training.learnin_rate=1': training.learnin_rate: unknown key. "
            "Did you mean 'training.learning_rate'?") in message
    assert "command-line override 'training.epochs=two': training.epochs: expected an integer" in message
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(path), "training.learnin_rate=1"))
    assert "error: command-line override 'training.learnin_rate=1'" in stderr


def test_file_errors_still_name_the_file_and_cross_field_errors_name_the_override(tmp_path):
    raw = make_config("m", "t.jsonl", tmp_path / "run", method="grpo", rewards=[{"fn": "math"}])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["rollout.group_size=1"])  # a check across fields, which names the key
    assert str(info.value).startswith("command-line override 'rollout.group_size=1': rollout.group_size is 1")
    raw["training"]["learnin_rate"] = 1.0
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["rollout.group_size=4"])
    assert str(info.value).startswith(f"{path}: invalid configuration\n  - training.learnin_rate: unknown key")


# -- config-help documents the built-in rewards ------------------------------------------------

def test_config_help_lists_built_in_rewards_with_their_args(monkeypatch, capsys):
    out = run_main(monkeypatch, capsys, "config-help").stdout
    assert "[built-in rewards]" in out
    assert "  regex: 1.0 when the completion matches `pattern` (mode: search | fullmatch), else 0.0." in out
    assert "args: pattern=(required), mode='search', flags=''" in out
    assert "timeout=10.0" in out and "args: field='answer', strip=True, case_sensitive=True" in out
    assert "scoring.on_reward_error = 'stop'  (one of: 'stop', 'unverifiable')" in out


# -- CLI flags are checked like config fields ---------------------------------------------------

@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "--temperature -1.0: input should be greater than or equal to 0 (eval.temperature)"),
    ("--samples", "0", "--samples 0: input should be greater than or equal to 1 (eval.num_samples)"),
    ("--max-new-tokens", "0", "--max-new-tokens 0: input should be greater than or equal to 1 (eval.max_new_tokens)"),
])
def test_eval_flags_get_the_config_fields_checks(tmp_path, monkeypatch, capsys, flag, value, message):
    result = run_main(monkeypatch, capsys, "eval", str(tmp_path), "--data", "x.jsonl", "--reward", "math",
                      flag, value)
    assert f"error: {message}" in assert_clean_user_error(result)


# -- rows too large to parse -------------------------------------------------------------------

def _count_parsed_sizes(monkeypatch) -> list[int]:
    """The length of every string json.loads parses from now on (the data reader's calls among them)."""
    from rlft.data import readers

    sizes: list[int] = []
    loads = readers.json.loads

    def counted(text, *args, **kwargs):
        sizes.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(readers.json, "loads", counted)
    return sizes


def test_an_oversized_line_is_rejected_before_parsing(tmp_path, monkeypatch):
    from rlft.data.readers import read_rows

    big = json.dumps({"prompt": "x" * (9 << 20), "answer": "1"})  # 9 MiB > the 8 MiB default
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n" + big + "\n")
    parsed = _count_parsed_sizes(monkeypatch)
    rows = read_rows(str(path))
    assert max(parsed) < 1000  # counted, not timed: the 9 MiB line never reached the JSON parser
    assert rows[0].data is not None
    assert rows[1].data is None and rows[1].where == f"{path}:2"
    assert rows[1].error == "row larger than data.max_row_bytes (8,388,608 bytes; raise it if rows this large are intended)"
    small = read_rows(str(path), max_row_bytes=10)  # the limit counts bytes of the line
    assert [r.data is None for r in small] == [True, True]


def test_an_oversized_row_in_a_json_list_is_rejected_too(tmp_path):
    from rlft.data.readers import read_rows

    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "hi"}, {"prompt": "y" * 5000}]))
    rows = read_rows(str(path), max_row_bytes=1000)
    assert rows[0].data == {"prompt": "hi"} and rows[1].data is None and "data.max_row_bytes" in rows[1].error


def test_an_oversized_row_stops_training_with_the_row_report(tmp_path, qwen_path, monkeypatch):
    from rlft.api import train

    # SFT at the default limit (8 MiB)
    cfg = _tiny_sft(tmp_path, qwen_path)
    rows = Path(cfg["data"]["train"]).read_text().splitlines()
    rows[2] = json.dumps({"messages": [{"role": "user", "content": "z" * (9 << 20)},
                                       {"role": "assistant", "content": "ok"}]})
    Path(cfg["data"]["train"]).write_text("\n".join(rows) + "\n")
    parsed = _count_parsed_sizes(monkeypatch)
    with pytest.raises(DataError) as info:
        train(cfg)
    # counted, not timed: the 9 MiB row was never parsed (so never tokenized, ~20 s and GBs)
    assert parsed and max(parsed) < (1 << 20)
    assert f"{cfg['data']['train']}:3" in str(info.value)
    assert "1 x row larger than data.max_row_bytes (8,388,608 bytes" in str(info.value)
    # online prompts with the setting lowered
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi", "answer": "1"},
                                                       {"prompt": "q" * 200_000, "answer": "2"}])
    online = make_config(qwen_path, prompts, tmp_path / "runs" / "grpo", method="grpo", rewards=[{"fn": "math"}],
                         data={"max_row_bytes": 100_000})
    with pytest.raises(DataError) as info:
        train(online)
    assert f"{prompts}:2" in str(info.value) and "data.max_row_bytes (100,000 bytes" in str(info.value)
