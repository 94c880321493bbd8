"""The run directory is shared ground: rlft never adopts a folder of other files, never lets two
runs write one folder, turns failing writes (full disk, unwritable place, a file in the way) into one
error, keeps the last good checkpoint through a failed save; and what a run needs late (eval
settings, metric names, data of later pipeline stages) is checked before the first step."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DIGITS_REWARD, assert_clean_user_error, run_main
from rlft.api import train
from rlft.errors import ConfigError, RlftError
from rlft.models.tiny import build_tiny_model
from rlft.monitor.rundir import RunDir, RunDirError


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD + "\n\ndef constant(prompt, completion, **row):\n    return 0.5\n")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}.", "answer": str(i)}) + "\n"
                                                for i in range(8)))
    (root / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i} + 1?", "completion": f"The answer is {i + 1}.", "answer": str(i + 1)}) + "\n"
        for i in range(16)))
    return root


def grpo(root, out, **sections):
    cfg = {"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "prompts.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 2, "num_threads": 1},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
           "rewards": [{"fn": f"{root / 'reward.py'}:digits", "name": "digits"}],
           "logging": {"progress": False}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def sft(root, out, **sections):
    cfg = {"method": "sft", "output_dir": str(out), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "sft.jsonl")},
           "training": {"learning_rate": 1e-3, "batch_size": 8, "max_steps": 2, "num_threads": 1},
           "logging": {"progress": False}, "eval": {"max_examples": 4, "max_new_tokens": 8}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


# -- whose folder is it ------------------------------------------------------------------------

def test_a_folder_of_other_files_is_refused_unless_adopted(root, tmp_path):
    out = tmp_path / "someone-else"
    out.mkdir()
    (out / "config.yaml").write_text("theirs: true\n")
    (out / "metrics.jsonl").write_text('{"their": 1}\n')
    with pytest.raises(RunDirError, match="already holds files that are not an rlft run") as info:
        train(sft(root, out))
    assert "config.yaml, metrics.jsonl" in str(info.value) and "adopt_output_dir=true" in str(info.value)
    assert (out / "config.yaml").read_text() == "theirs: true\n"  # nothing touched
    assert train(sft(root, out, adopt_output_dir=True))["status"] == "completed"
    assert (out / ".rlft-run").is_file()


def test_an_rlft_run_directory_is_continued_and_marked(root, tmp_path):
    out = tmp_path / "mine"
    train(sft(root, out))
    assert (out / ".rlft-run").is_file()
    summary = train(sft(root, out, training={"max_steps": 3, "epochs": 2}))  # continues: it is an rlft run
    assert summary["status"] == "completed" and summary["step"] == 3


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_owner(root, tmp_path):
    out = tmp_path / "busy"
    holder = RunDir(out)
    holder.claim()  # another run holds the lock
    try:
        with pytest.raises(RunDirError, match=r"is in use by process \d+ on .* \(since"):
            train(sft(root, out))
    finally:
        holder.release()
    assert train(sft(root, out))["status"] == "completed"  # free again once the holder ends


def test_a_file_in_the_way_and_an_unwritable_place_are_one_clear_error(root, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a folder"):
        train(sft(root, tmp_path / "afile"))
    with pytest.raises(RunDirError, match="a file stands where a folder is needed"):
        train(sft(root, tmp_path / "afile" / "run"))
    with pytest.raises(RunDirError, match="cannot write /sys/rlft-run while creating the run directory"):
        train(sft(root, "/sys/rlft-run"))  # sysfs: not even root may create a folder there


def test_the_cli_reports_a_refused_folder_in_one_line(root, tmp_path, monkeypatch, capsys):
    import yaml

    out = tmp_path / "others"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(sft(root, out)))
    assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml")))


def test_a_full_disk_during_a_save_keeps_the_last_good_checkpoint_and_resume_works(root, tmp_path, monkeypatch):
    import rlft.training.checkpoint as ckpt

    out = tmp_path / "full"
    cfg = sft(root, out, training={"max_steps": 4, "epochs": 2}, checkpoint={"every": 1})
    real_save = ckpt.torch.save

    def save(obj, f, *args, **kwargs):
        if obj["step"] == 3:  # the disk fills up while writing step 3's trainer state
            f.write(b"x" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(RunDirError) as info:
        train(cfg)
    message = str(info.value)
    assert "no space left on the device of" in message and "step-00000003" in message
    assert "the last good checkpoint is" in message and "step-00000002" in message
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the partial save gave its space back
    assert ckpt.find_latest(out / "checkpoints").name == "step-00000002"
    monkeypatch.setattr(ckpt.torch, "save", real_save)  # space is back
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["step"] == 4
    reference = train(sft(root, tmp_path / "never-full", training={"max_steps": 4, "epochs": 2}, checkpoint={"every": 1}))
    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(str(tmp_path / "never-full" / "final" /
                                                                             "model.safetensors"))
    assert reference["status"] == "completed" and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_seen_by_torchs_zip_writer_is_the_same_clear_error(root, tmp_path, monkeypatch):
    """torch.save on a full disk does not raise OSError: its zip writer fails its own position check
    (`RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos N vs M`). That error
    used to escape as a traceback and leave `.tmp-step-N/` (the space) behind. Runs everywhere; the
    real full disk is the tmpfs test below."""
    import rlft.training.checkpoint as ckpt

    out = tmp_path / "zipfull"
    real_save = ckpt.torch.save

    def save(obj, f, *args, **kwargs):
        if obj["step"] == 2:
            f.write(b"x" * 4096)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1864896 vs 1864788")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(RunDirError) as info:
        train(sft(root, out, training={"precision": "fp32"}, checkpoint={"every": 1}))
    message = str(info.value)
    assert "no space left on the device of" in message and "trainer_state.pt" in message  # which file
    assert "a checkpoint needs about" in message and "MB is free there now" in message  # how much
    assert "step-00000001, still the newest" in message and f"rlft train --resume {out}" in message  # the fix
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert ckpt.find_latest(out / "checkpoints").name == "step-00000001"


def test_a_bug_during_a_save_keeps_its_traceback_but_not_the_partial_folder(root, tmp_path, monkeypatch):
    """Only write failures become a RunDirError; anything else (a bug) keeps its own exception, but
    the partial folder goes either way (it used to stay for any non-OSError)."""
    import rlft.training.checkpoint as ckpt

    out = tmp_path / "bug"
    monkeypatch.setattr(ckpt, "rng_state", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train(sft(root, out, training={"precision": "fp32", "max_steps": 1}))
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MB tmpfs (root only); a tiny model's checkpoint is ~11 MB, so the second save fills it."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_real_full_disk_is_one_error_and_the_run_resumes_once_space_is_back(root, small_disk, tmp_path,
                                                                             monkeypatch, capsys):
    """A real full disk (16 MB tmpfs, checkpoint.every=1): before the fix this ended in torch's
    `unexpected pos` traceback and left `.tmp-step-2/` filling the disk. Now: one error naming the
    file, the space needed and free, and the fix; the partial folder removed; step 1 still newest;
    the run resumes once the disk is bigger."""
    import subprocess

    import yaml

    import rlft.training.checkpoint as ckpt

    out = small_disk / "run"
    cfg = sft(root, out, training={"precision": "fp32", "max_steps": 3, "epochs": 2}, checkpoint={"every": 1})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    err = " ".join(assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml"))).split())
    assert "no space left on the device of" in err and "step-00000002" in err
    assert "a checkpoint needs about 1" in err and "MB is free there now" in err
    assert "step-00000001, still the newest" in err and "the partial save was removed" in err
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert ckpt.find_latest(out / "checkpoints").name == "step-00000001"
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # the cause fixed
    result = run_main(monkeypatch, capsys, "train", "--resume", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["step"] == 3


def test_tiny_model_refuses_to_replace_a_model(tmp_path, monkeypatch, capsys):
    target = tmp_path / "m"
    assert run_main(monkeypatch, capsys, "tiny-model", str(target)).returncode == 0
    before = (target / "model.safetensors").read_bytes()
    err = assert_clean_user_error(run_main(monkeypatch, capsys, "tiny-model", str(target), "--seed", "5"))
    assert "would replace what it holds" in err and "--force" in err
    assert (target / "model.safetensors").read_bytes() == before
    assert run_main(monkeypatch, capsys, "tiny-model", str(target), "--seed", "5", "--force").returncode == 0
    assert (target / "model.safetensors").read_bytes() != before


# -- errors at the start, not at the end -------------------------------------------------------

@pytest.mark.parametrize("section, setting, value, expected", [
    ("eval", "correct_component", "corect", "eval.correct_component='corect' is not a reward component"),
    ("checkpoint", "keep_best", "eval/acuracy", "checkpoint.keep_best='eval/acuracy' is not a metric"),
    ("monitor", "early_stop", {"metric": "reward/meen"}, "monitor.early_stop.metric='reward/meen' is not a metric"),
])
def test_late_settings_are_checked_before_the_first_step(root, tmp_path, section, setting, value, expected):
    out = tmp_path / "typo"
    cfg = grpo(root, out, data={"eval": str(root / "prompts.jsonl")}, **{section: {setting: value}})
    cfg["rewards"][0]["name"] = "correct"
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")) as info:
        train(cfg)
    assert "Did you mean" in str(info.value)
    assert not (out / "metrics.jsonl").exists()  # nothing trained


def test_eval_metrics_without_held_out_data_say_what_is_missing(root, tmp_path):
    with pytest.raises(ConfigError, match=r"eval/ metrics need held-out data: set data\.eval"):
        train(grpo(root, tmp_path / "noeval", checkpoint={"keep_best": "eval/accuracy"}))


def test_a_failing_final_evaluation_keeps_the_trained_steps(root, tmp_path):
    # the reward raises on the held-out rows only (they carry no answer of the kind it wants):
    # found at the end, after training; the steps must not be lost
    (tmp_path / "picky.py").write_text(
        "def picky(prompt, completion, answer, **row):\n"
        "    if answer == 'held-out':\n"
        "        raise RuntimeError('cannot score held-out rows')\n"
        "    return float(len(completion) % 3)\n")
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "Count to 3.", "answer": "held-out"}) + "\n")
    out = tmp_path / "evalfail"
    cfg = grpo(root, out, data={"eval": str(tmp_path / "heldout.jsonl")})
    cfg["rewards"] = [{"fn": f"{tmp_path / 'picky.py'}:picky"}]
    with pytest.raises(RlftError, match="the evaluation after step 2 failed") as info:
        train(cfg)
    assert "The trained weights are safe" in str(info.value)
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert (out / "final" / "model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "eval_failed" and "cannot score held-out rows" in summary["error"]


def test_a_run_without_a_single_update_says_so(root, tmp_path, capsys):
    cfg = grpo(root, tmp_path / "flat", algorithm={"kl_coef": 0.0})
    cfg["rewards"] = [{"fn": f"{root / 'reward.py'}:constant"}]
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["optimizer_steps"] == 0
    assert "no optimizer step was taken in 2 steps" in summary["warning"]
    assert "no optimizer step was taken" in " ".join(capsys.readouterr().err.split())
    assert json.loads((tmp_path / "flat" / "summary.json").read_text())["warning"] == summary["warning"]


def test_pipeline_stages_data_is_checked_before_the_first_stage(root, tmp_path):
    import yaml

    from rlft.pipeline import run_pipeline

    later = grpo(root, "unused", data={"train": str(tmp_path / "missing.jsonl")})
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "pipe"),
        "stages": [{"name": "sft", "config": sft(root, "unused")}, {"name": "grpo", "config": later}]}))
    with pytest.raises(ConfigError, match=r"stage grpo: data\.train not found: .*missing\.jsonl"):
        run_pipeline(tmp_path / "pipe.yaml")
    assert not (tmp_path / "pipe" / "sft").exists()  # the first stage never started


def test_eval_of_a_run_uses_its_settings_and_keeps_its_summary(root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "evalrun"
    cfg = grpo(root, out, eval={"max_new_tokens": 6, "num_samples": 2, "temperature": 1.0})
    train(cfg)
    before = (out / "summary.json").read_text()
    result = run_main(monkeypatch, capsys, "eval", str(out), "--data", str(root / "prompts.jsonl"))
    assert result.returncode == 0, result.stderr
    assert (out / "summary.json").read_text() == before  # training's summary untouched
    saved = json.loads((out / "evals" / "prompts.json").read_text())
    assert saved["settings"]["eval"]["max_new_tokens"] == 6 and saved["settings"]["eval"]["num_samples"] == 2
    assert saved["settings"]["rewards"][0]["fn"].endswith("reward.py:digits")  # the run's own reward
    assert "eval/pass@2" in saved["metrics"]
    assert "results saved to" in " ".join(result.stderr.split())
