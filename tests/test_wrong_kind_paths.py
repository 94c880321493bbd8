"""Every path argument of every command given a path that exists but is the wrong kind (issue "Hard
to misuse, round 4", item 11): a folder, a JSONL data file, a binary file or a Python file where
something else is taken. Before: a config given a data file listed every config field as missing, a
binary one ended in a raw UnicodeDecodeError, a folder was "config file not found", an output path
naming a folder was a raw IsADirectoryError after the work was done, and `--out code.py` (report,
compare, eval) replaced the Python file without a word. Now: one error line that names the
argument, what the path is and what it takes, and nothing is read, loaded or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import assert_clean_user_error, run_main

KINDS = ("folder", "jsonl", "binary", "py")
# (command, the argument the error names, the kinds it refuses); "{p}" is the wrong path, "{ok:NAME}"
# a right one (see `_right`)
CASES = [
    ("train {p}", "CONFIG", KINDS),
    ("train --resume {p}", "--resume", ("jsonl", "binary", "py")),
    ("pipeline {p}", "FILE", KINDS),
    ("plan {p}", "CONFIG", KINDS),
    ("data screen {p} --out {ok:new.jsonl}", "CONFIG", KINDS),
    ("data screen {ok:config.yaml} --out {p}", "--out", ("folder", "binary", "py")),
    ("data pairs {p} --out {ok:new.jsonl}", "CONFIG", KINDS),
    ("data pairs {ok:config.yaml} --out {p}", "--out", ("folder", "binary", "py")),
    ("data agreement {p}", "DATA", ("binary", "py")),
    ("eval {p} --data {ok:data.jsonl}", "TARGET", ("jsonl", "binary", "py")),
    ("eval {ok:model} --config {p} --data {ok:data.jsonl}", "--config", KINDS),
    ("eval {ok:model} --data {p}", "--data", ("binary", "py")),
    ("eval {ok:model} --data {ok:data.jsonl} --compare {p}", "--compare", ("jsonl", "binary", "py")),
    ("eval {ok:model} --data {ok:data.jsonl} --compare {ok:model} --judge-model {p}", "--judge-model",
     ("jsonl", "binary", "py")),
    ("eval {ok:model} --data {ok:data.jsonl} --out {p}", "--out", ("folder", "binary", "py")),
    ("tiny-model {p}", "OUT_DIR", ("jsonl", "binary", "py")),
    ("import-model {p} {ok:new-model}", "SRC", KINDS),
    ("import-model {ok:model.gguf} {p}", "DST", ("jsonl", "binary", "py")),
    ("demo --out {p}", "--out", ("jsonl", "binary", "py")),
    ("report {p}", "RUNS", ("jsonl", "binary", "py")),
    ("report {ok:run} --out {p}", "--out", KINDS),
    ("compare {ok:run} {p}", "RUNS", ("jsonl", "binary", "py")),
    ("compare {ok:run} --csv {p}", "--csv", KINDS),
    ("compare {ok:run} --markdown {p}", "--markdown", KINDS),
    ("sandbox run --code {p} --tests {ok:tests.json}", "--code", ("folder", "jsonl", "binary")),
    ("sandbox run --code {ok:program.py} --tests {p}", "--tests", KINDS),
]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    wrong = tmp_path / "wrong"
    (wrong / "folder").mkdir(parents=True)
    (wrong / "rows.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    (wrong / "weights.dat").write_bytes(bytes(range(256)) * 4)
    (wrong / "rewards.py").write_text("def fn(prompt, completion, **row):\n    return 1.0\n")
    return {"folder": wrong / "folder", "jsonl": wrong / "rows.jsonl", "binary": wrong / "weights.dat",
            "py": wrong / "rewards.py"}


def _right(tmp_path: Path, qwen_path: Path, name: str) -> str:
    """A path of the right kind for the arguments a case does not test."""
    ok = tmp_path / "ok"
    ok.mkdir(exist_ok=True)
    if name == "model":
        return str(qwen_path)
    path = ok / name
    if name == "run":
        path.mkdir(exist_ok=True)
        (path / "config.yaml").write_text("method: sft\n")
    elif name == "model.gguf":
        path.write_bytes(b"GGUF" + bytes(64))
    elif name == "config.yaml":
        path.write_text(f"method: grpo\noutput_dir: {ok / 'r'}\nmodel: {{path: {qwen_path}}}\n")
    elif name == "data.jsonl":
        path.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    elif name == "tests.json":
        path.write_text('{"cases": [{"stdin": "", "stdout": "1\\n"}]}')
    elif name == "program.py":
        path.write_text("print(1)\n")
    return str(path)  # new.jsonl, new-model: not there yet


@pytest.mark.parametrize("command, arg, kind",
                         [(c, a, k) for c, a, kinds in CASES for k in kinds],
                         ids=[f"{c.split(' {')[0]}:{a}:{k}" for c, a, kinds in CASES for k in kinds])
def test_a_path_of_the_wrong_kind_is_one_error_naming_the_argument(command, arg, kind, paths, tmp_path, qwen_path,
                                                                   monkeypatch, capsys):
    wrong = paths[kind]
    before = {p: (p.read_bytes() if p.is_file() else sorted(os.listdir(p))) for p in paths.values()}
    args = []
    for word in command.split():
        if word == "{p}":
            args.append(str(wrong))
        elif word.startswith("{ok:"):
            args.append(_right(tmp_path, qwen_path, word[4:-1]))
        else:
            args.append(word)
    result = run_main(monkeypatch, capsys, *args)
    assert_clean_user_error(result)
    said = result.stdout + result.stderr
    line = next(ln for ln in said.splitlines() if ln.startswith("error:"))
    assert line.startswith(f"error: {arg} {wrong} is "), said  # the argument, the path, what it is
    assert "\nFix: " in said or "; fix: " in said, said  # (sandbox run: one line)
    what = {"folder": "a folder", "jsonl": "a JSONL data file", "binary": "a binary file", "py": "a Python file"}[kind]
    assert line.startswith(f"error: {arg} {wrong} is {what}"), said
    # nothing was replaced or written into
    assert before == {p: (p.read_bytes() if p.is_file() else sorted(os.listdir(p))) for p in paths.values()}


def test_load_config_names_a_folder_and_a_binary_file(paths):
    """The Python API too: before, a folder was 'config file not found' and a binary file a raw
    UnicodeDecodeError."""
    from rlft.config import load_config
    from rlft.errors import ConfigError

    with pytest.raises(ConfigError, match="is a folder, not a config YAML file"):
        load_config(paths["folder"])
    with pytest.raises(ConfigError, match="is a binary file, not a config YAML file"):
        load_config(paths["binary"])
    with pytest.raises(ConfigError, match=r"is a JSONL data file, not a config YAML file.\nFix: data files are"):
        load_config(paths["jsonl"])


def test_a_run_folder_given_as_a_config_points_at_its_config_yaml(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("method: sft\n")
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "plan", str(run)))
    assert f"this folder holds one: {run / 'config.yaml'}" in " ".join(stderr.split())
