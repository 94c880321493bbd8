"""Files, paths and devices: what a run writes must work from any folder later (absolute paths in
config.yaml and adapter_config.json), and paths or device names that cannot work here stop at
config load with one error naming the field and the fix."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from conftest import assert_clean_user_error, run_main, write_jsonl
from rlft.config import load_config
from rlft.errors import ConfigError


@pytest.fixture(scope="module")
def relative_lora_run(tmp_path_factory, qwen_path):
    """One LoRA SFT step started from `work/` with relative paths only (model, data, reward-free
    SFT, output_dir), checkpointed; `elsewhere/` is another folder to come back from."""
    root = tmp_path_factory.mktemp("relative")
    work, elsewhere = root / "work", root / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(qwen_path, work / "model")
    write_jsonl(work / "sft.jsonl", [{"prompt": f"What is {i} + 1?", "completion": f"It is {i + 1}."}
                                     for i in range(8)])
    config = {"method": "sft", "output_dir": "runs/lora", "model": {"path": "./model", "device": "cpu"},
              "data": {"train": "sft.jsonl", "max_length": 64}, "lora": {"enabled": True, "r": 4},
              "training": {"max_steps": 1, "batch_size": 4, "num_threads": 1, "precision": "fp32"},
              "checkpoint": {"every": 1}, "logging": {"progress": False}, "eval": {"max_examples": 2}}
    before = os.getcwd()
    os.chdir(work)
    try:
        from rlft.api import train

        assert train(config)["status"] == "completed"
    finally:
        os.chdir(before)
    return work / "runs" / "lora", work, elsewhere


def test_a_lora_adapter_loads_with_peft_from_another_folder(relative_lora_run, monkeypatch):
    """adapter_config.json used to record the base as the relative path the run was started with
    ('./model'), so AutoPeftModelForCausalLM failed from any other folder."""
    from peft import AutoPeftModelForCausalLM

    run, work, elsewhere = relative_lora_run
    adapter = run / "final" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(work / "model")
    monkeypatch.chdir(elsewhere)
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    assert model.peft_config["default"].r == 4


def test_config_yaml_holds_absolute_paths_and_resume_works_from_another_folder(relative_lora_run, monkeypatch,
                                                                               capsys):
    """config.yaml used to keep 'model', 'sft.jsonl' and 'runs/lora' as written, so
    `rlft train --resume DIR` worked only from the folder the run started in."""
    run, work, elsewhere = relative_lora_run
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["path"] == str(work / "model") and saved["data"]["train"] == str(work / "sft.jsonl")
    assert saved["output_dir"] == str(run)
    monkeypatch.chdir(elsewhere)
    result = run_main(monkeypatch, capsys, "train", "--resume", str(run), "training.max_steps=2")
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 2
    assert not (elsewhere / "runs").exists()  # nothing written relative to the new folder


def test_home_and_hub_ids_and_modules(tmp_path, monkeypatch):
    """`~` is expanded (it used to reach the data reader as a literal '~' folder); hub ids,
    'hf:NAME' data and 'module:function' rewards stay as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p"}])
    (tmp_path / "r.py").write_text("def f(prompt, completion, **row):\n    return 1.0\n")
    cfg = load_config({"method": "grpo", "output_dir": "~/out", "model": {"path": "Qwen/Qwen2.5-0.5B"},
                       "data": {"train": "~/rows.jsonl", "eval": "hf:org/set"},
                       "rewards": [{"fn": "~/r.py:f"}, {"fn": "my_pkg.rewards:score"}, {"fn": "math"}]})
    assert cfg.output_dir == str(tmp_path / "out") and cfg.data.train == str(tmp_path / "rows.jsonl")
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B" and cfg.data.eval == "hf:org/set"
    assert [r.fn for r in cfg.rewards] == [f"{tmp_path}/r.py:f", "my_pkg.rewards:score", "math"]
    assert cfg.rewards[0].component == "f"


@pytest.mark.parametrize("field, value", [
    ("data.train", "C:\\data\\x.jsonl"),
    ("model.path", "D:/models/qwen"),
    ("output_dir", "runs\\sft"),
])
def test_a_windows_style_path_is_refused_at_load_with_the_fix(tmp_path, monkeypatch, capsys, field, value):
    monkeypatch.chdir(tmp_path)  # before the fix, output_dir "runs\\sft" was created relative to here
    """A path written for Windows never names a file here; it used to surface later as 'not found'
    (data), a hub look-up (model) or a folder literally named 'runs\\sft' (output_dir)."""
    raw = {"method": "sft", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path)},
           "data": {"train": str(tmp_path / "x.jsonl")}}
    section, _, key = field.rpartition(".")
    (raw[section] if section else raw)[key] = value
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    err = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml")))
    assert f"{field}: {value!r} is a Windows-style path" in err.replace("\n", " ") and "Fix:" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, hint", [
    ("gpu", "Did you mean 'cuda'?"), ("CUDA:1", "Did you mean 'cuda:1'?"), ("0", "Did you mean 'cuda:0'?"),
    ("mps", "mps is not supported"), ("cuda:x", "Use one of: auto, cpu, cuda, cuda:N"),
])
def test_an_unknown_device_is_refused_at_load(tmp_path, monkeypatch, capsys, value, hint):
    """model.device=gpu used to pass the config and end in torch's raw `RuntimeError: Expected one of
    cpu, cuda, ... device type at start of device string: gpu` when the model was placed."""
    raw = {"method": "sft", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path), "device": value},
           "data": {"train": str(tmp_path / "x.jsonl")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    err = " ".join(assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml"))).split())
    assert f"model.device: unknown device {value!r}" in err and hint in err
    assert not (tmp_path / "out").exists()
    for good in ("auto", "cpu", "cuda", "cuda:3"):
        assert load_config({**raw, "model": {"path": str(tmp_path), "device": good}}).model.device == good


def test_an_output_dir_name_over_255_bytes_is_refused_at_load(tmp_path, monkeypatch, capsys):
    """A folder name over the file system's 255-byte limit used to end in a raw
    `OSError: [Errno 36] File name too long` traceback from creating the run directory."""
    long_name = "run-" + "é" * 130  # 264 bytes in UTF-8, 134 characters: the limit is in bytes
    raw = {"method": "sft", "output_dir": str(tmp_path / long_name / "inner"), "model": {"path": str(tmp_path)},
           "data": {"train": str(tmp_path / "x.jsonl")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
    err = " ".join(assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml"))).split())
    assert "output_dir: the name 'run-éé" in err and "is 264 bytes long, over the 255 bytes" in err
    assert "Fix: choose a shorter output_dir" in err
    with pytest.raises(ConfigError):  # the same check for the Python API
        load_config(raw)
    assert load_config({**raw, "output_dir": str(tmp_path / ("r" * 255))}).output_dir.endswith("r" * 255)


@pytest.mark.parametrize("override, expected", [
    ("data.train={d}", "directory.); it holds: rows.jsonl. Fix: point the data setting at a data file inside it"),
    ("model.chat_template={d}", "model.chat_template: {d} is a folder; give the template file"),
    ("rewards=[{{fn: '{d}.py:f'}}]", "{d}.py is a folder, not a Python file"),
])
def test_a_folder_where_a_file_is_expected_is_named_as_a_folder(qwen_path, tmp_path, monkeypatch, capsys, override,
                                                                 expected):
    """A folder given where a file belongs was reported as 'file not found' (template, reward file)
    or with no fix (data): the message now says it is a folder and what to give instead."""
    folder = tmp_path / "stuff"
    (tmp_path / "stuff.py").mkdir()
    folder.mkdir()
    write_jsonl(folder / "rows.jsonl", [{"prompt": "p"}])
    raw = {"method": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": str(folder / "rows.jsonl")}, "rewards": [{"fn": "math"}],
           "training": {"max_steps": 1, "num_threads": 1}, "logging": {"progress": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    err = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml"),
                                           override.format(d=folder)))
    assert expected.format(d=folder) in " ".join(err.split())


def test_an_hf_dataset_without_the_hub_fails_in_seconds(no_hub):
    """`hf:NAME` data with no network took ~50 s of datasets' retries before 'Couldn't reach';
    now the same one probe decides, and the error says how to get the data here."""
    import time

    from rlft.data.readers import read_rows
    from rlft.errors import DataError

    start = time.monotonic()
    with pytest.raises(DataError) as info:
        read_rows("hf:rlft-test-org/no-such-set")
    assert time.monotonic() - start < 20  # generous: a loaded 2-core machine; retries took ~50 s
    message = str(info.value)
    assert "hf:rlft-test-org/no-such-set is not in the local datasets cache" in message
    assert f"{no_hub} cannot be reached" in message and "Dataset.save_to_disk" in message


def test_an_empty_path_is_refused_and_resume_expands_home(relative_lora_run, monkeypatch):
    """An empty output_dir would become the working directory itself (abspath('') is the cwd);
    `--resume '~/...'` (quoted, so no shell expansion) was 'not a run directory'."""
    from rlft import api

    with pytest.raises(ConfigError, match="output_dir is empty; give a path"):
        load_config({"method": "sft", "output_dir": " ", "model": {"path": "x/y"}, "data": {"train": "a.jsonl"}})
    run, work, _ = relative_lora_run
    monkeypatch.setenv("HOME", str(work))
    monkeypatch.setattr(api, "train", lambda config, overrides: (config, overrides))  # what resume would run
    config, overrides = api.resume("~/runs/lora", ["training.max_steps=3"])
    assert config == run / "config.yaml" and overrides[-1] == f"output_dir={run}"


def test_an_output_dir_past_the_path_length_limit_is_refused_at_load(tmp_path):
    """Each part under 255 bytes but the whole path near 4096: nothing checked it, so a run got as far
    as its first write of a file deep enough to pass the limit (ENAMETOOLONG)."""
    deep = tmp_path.joinpath(*["d" * 200] * 20)  # ~4,000 bytes
    with pytest.raises(ConfigError, match=r"output_dir: the path is \d+ bytes long; .* 4096-byte path limit"):
        load_config({"method": "sft", "output_dir": str(deep), "model": {"path": "x/y"}, "data": {"train": "a.jsonl"}})
