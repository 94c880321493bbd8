"""Inputs that were accepted but wrong (issue 23): the README's own commands, numbers out of any
sensible range, YAML that silently drops a key, evaluations that overwrite each other, and a
thread count that ignores a busy machine. Each test's docstring says what it caught before."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import assert_clean_user_error, make_config, run_main, write_jsonl
from rlft.config import load_config
from rlft.errors import ConfigError, DataError, RewardError, TrainingHalted

ROOT = Path(__file__).resolve().parents[1]

USER_REWARDS = '''
CALLS = {"n": 0}

def huge(prompt, completion, **row):
    return 1e300

def billion_from_step_2(prompt, completion, **row):
    CALLS["n"] += 1
    return 1e9 if CALLS["n"] > 2 else 0.5

def fine(prompt, completion, **row):
    return 0.5
'''


def _run_dir(root: Path, model: Path, **eval_section) -> Path:
    """A finished-looking run directory: config.yaml (rewards `math` named 'correct', as every
    example sets) and final/ (the tiny model)."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(model, run / "final")
    cfg = make_config(model, root / "prompts.jsonl", run, rewards=[{"fn": "math", "name": "correct"}],
                      eval={"max_new_tokens": 4, "correct_component": "correct", **eval_section})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


@pytest.fixture
def prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)}
                                                    for i in range(6)])


# -- 1. eval --reward on a run whose correct_component is another reward -------------------------

def test_eval_reward_replaces_the_runs_correct_component(tmp_path, qwen_path, prompts, monkeypatch, capsys):
    """Before: every example run sets eval.correct_component=correct, so `rlft eval RUN --reward
    math` generated everything, then died with a raw ValueError ('correct' is not a component).
    Now accuracy comes from the new reward (>= correct_threshold) and the choice is printed."""
    run = _run_dir(tmp_path, qwen_path)
    result = run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts), "--reward", "math",
                      "--samples", "2", "--temperature", "1.0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "accuracy: math >= 1" in result.stdout + result.stderr
    saved = json.loads((run / "evals" / "prompts.json").read_text())
    assert "eval/accuracy" in saved["metrics"] and saved["settings"]["eval"]["correct_component"] is None


def test_a_wrong_correct_component_stops_before_the_model_loads(tmp_path, qwen_path, prompts, monkeypatch, capsys):
    """Before: the check ran after every completion was generated (minutes), as a traceback."""
    import rlft.eval.run as eval_run

    run = _run_dir(tmp_path, qwen_path, correct_component="nope")
    monkeypatch.setattr(eval_run, "load_model_dir", lambda *a, **k: pytest.fail("loaded the model first"))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts)))
    assert "eval.correct_component 'nope' is not a reward component" in stderr and "correct" in stderr


# -- 9. evaluations never overwrite each other; a cut is announced ------------------------------

def test_a_second_eval_gets_its_own_file_and_a_cut_is_announced(tmp_path, qwen_path, prompts, monkeypatch, capsys):
    """Before: evals/<data>.json was replaced by the next evaluation of the same data (other
    settings lost), and only the first eval.max_examples (256) rows were evaluated, silently."""
    run = _run_dir(tmp_path, qwen_path, max_examples=4)
    first = run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts))
    assert first.returncode == 0, first.stdout + first.stderr
    said = first.stdout + first.stderr
    assert "evaluating the first 4 of the 6 rows" in said and "--max-examples all" in said
    second = run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts), "--max-examples", "all",
                      "--temperature", "1.0")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "evaluating the first" not in second.stdout + second.stderr
    a = json.loads((run / "evals" / "prompts.json").read_text())
    b = json.loads((run / "evals" / "prompts-2.json").read_text())
    assert a["settings"]["eval"]["temperature"] == 0.0 and a["settings"]["eval"]["max_examples"] == 4
    assert b["settings"]["eval"]["temperature"] == 1.0 and b["settings"]["eval"]["max_examples"] is None


def test_comparisons_under_a_run_never_overwrite_each_other(tmp_path):
    """Before: RUN/evals/compare-<data>.json was rewritten by every comparison on that data."""
    from types import SimpleNamespace

    from rlft.eval.compare_report import comparison_path, save_comparison

    run = tmp_path / "run"
    comparison = SimpleNamespace(target="a", baseline="b", judge="j", metrics={}, records=[])
    path = comparison_path("data/x.jsonl", run, None)
    saved = [save_comparison(comparison, "data/x.jsonl", path, {"n": i}, keep_existing=True) for i in range(2)]
    assert [p.name for p in saved] == ["compare-x.json", "compare-x-2.json"]
    assert json.loads(saved[0].read_text())["settings"] == {"n": 0}


# -- 2. a config trained again into its finished run ---------------------------------------------

def test_rerunning_into_a_finished_run_says_so_and_the_error_names_another_output_dir(tmp_path, qwen_path, capsys):
    """Before: a longer re-run continued the old run without a word, and a shorter one stopped with
    'nothing to train' whose only fix was raising the step count."""
    from rlft.api import train

    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "completion": "2"}] * 4)
    cfg = make_config(qwen_path, data, tmp_path / "runs" / "sft", data={"max_length": 32},
                      training={"batch_size": 4, "max_steps": 2, "epochs": 5, "precision": "fp32"},
                      eval={"max_examples": 1}, checkpoint={"every": 1})
    assert train(cfg)["status"] == "completed"
    capsys.readouterr()
    with pytest.raises(TrainingHalted) as info:
        train(cfg, ["training.max_steps=1"])
    assert f"output_dir={tmp_path / 'runs' / 'sft-2'}" in str(info.value)
    assert "training.max_steps 2 -> 1" in _said(capsys)
    assert train(cfg, ["training.max_steps=3"])["step"] == 3
    out = _said(capsys)
    assert "already holds this run (newest checkpoint step-00000002)" in out and "-> 3" in out


def _said(capsys) -> str:
    """What the console printed, its line wrapping undone."""
    out = capsys.readouterr()
    return (out.out + out.err).replace("\n", "")


# -- 3. every command that reads a config takes overrides ---------------------------------------

def test_plan_data_and_pipeline_take_overrides_like_train(tmp_path, qwen_path, monkeypatch, capsys):
    """Before: `rlft plan CONFIG a.b=v`, `rlft data screen CONFIG a.b=v` and `rlft pipeline FILE
    a.b=v` stopped with click's 'Got unexpected extra argument'."""
    cfg = tmp_path / "c.yaml"
    train_file = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1?", "completion": "2"}])
    cfg.write_text(yaml.safe_dump(make_config(qwen_path, train_file, tmp_path / "run")))
    done = run_main(monkeypatch, capsys, "plan", str(cfg), "lora.enabled=true", "--memory-gb", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LoRA" in done.stdout or "lora" in done.stdout
    for command in (["plan", str(cfg)], ["data", "screen", str(cfg), "--out", str(tmp_path / "o.jsonl")],
                    ["data", "pairs", str(cfg), "--out", str(tmp_path / "o.jsonl")]):
        stderr = assert_clean_user_error(run_main(monkeypatch, capsys, *command, "training.learning_rat=1"))
        assert "command-line override 'training.learning_rat=1'" in stderr and "learning_rate" in stderr
    pipe = tmp_path / "p.yaml"
    pipe.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "pipe"), "stages": [{"name": "a", "config": str(cfg)}]}))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "pipeline", str(pipe), "training.epochs=0"))
    assert "stage a" in stderr and "command-line override 'training.epochs=0'" in stderr
    from rlft.pipeline import plan_pipeline

    pipeline, [(_, stage)] = plan_pipeline(pipe, ["training.epochs=3", f"output_dir={tmp_path / 'other'}"])
    assert stage.training.epochs == 3 and Path(stage.output_dir) == tmp_path / "other" / "a"


# -- 5. rewards far out of scale -----------------------------------------------------------------

def _scorer(tmp_path: Path, name: str, **kw):
    from rlft.config import RewardSpec
    from rlft.rewards.scoring import RewardScorer

    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    return RewardScorer([RewardSpec(fn=f"{tmp_path / 'user_rewards.py'}:{name}")], 1, **kw)


def test_a_reward_far_out_of_scale_is_a_reward_error(tmp_path):
    """Before: 1e300 ended in a raw OverflowError in Scores.metrics (the std), and 1e9 passed."""
    with pytest.raises(RewardError) as info:
        _scorer(tmp_path, "huge").score(["p"], ["c"], [{}], ["data/train.jsonl:3"])
    message = str(info.value)
    assert "reward 'huge'" in message and "1e+300" in message and "data/train.jsonl:3" in message
    assert "scoring.max_abs_reward=10000" in message
    lenient = _scorer(tmp_path, "huge", on_error="unverifiable")
    assert lenient.score(["p"], ["c"], [{}]).total == [None]
    unbounded = _scorer(tmp_path, "huge", max_abs_reward=None).score(["p", "p"], ["c", "d"], [{}, {}])
    assert unbounded.metrics()["reward/mean"] == 1e300  # and no OverflowError in the std


def test_a_run_whose_reward_jumps_to_1e9_stops_after_saving_the_last_step(tmp_path, qwen_path):
    """Before: rewards of 1e9 trained on silently (Dr. GRPO: every update sign-only)."""
    from rlft.api import train
    from rlft.training import checkpoint as ckpt

    for name in [n for n in sys.modules if n.startswith("rlft_user_")]:
        del sys.modules[name]
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}."} for i in range(4)])
    cfg = {"method": "dr_grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path)},
           "data": {"train": str(prompts)}, "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1},
           "rollout": {"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 4},
           "rewards": [{"fn": f"{tmp_path / 'user_rewards.py'}:billion_from_step_2"}],
           "scoring": {"max_workers": 1}, "logging": {"progress": False}}
    with pytest.raises(TrainingHalted) as info:
        train(cfg)
    assert "reward 'billion_from_step_2'" in str(info.value) and "1e+09" in str(info.value)
    assert ckpt.find_latest(tmp_path / "run" / "checkpoints").name == "step-00000001"


# -- 6. a gold answer that is NaN ----------------------------------------------------------------

def test_a_nan_gold_answer_is_an_invalid_row(tmp_path, qwen_path):
    """Before: the JSON literal NaN became the string 'nan', so 'The answer is nan.' scored 1.0."""
    from rlft.data.prompts import make_prompt_encoder
    from rlft.data.readers import read_rows
    from rlft.data.validate import check_rows
    from transformers import AutoTokenizer

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": NaN}\n{"prompt": "c", "answer": -Infinity}\n')
    with pytest.raises(DataError) as info:
        check_rows(read_rows(str(path)), make_prompt_encoder(AutoTokenizer.from_pretrained(qwen_path), 64, ("answer",)),
                   str(path), "prompt")
    message = str(info.value)
    assert "2 x non-finite 'answer'" in message and f"{path}:2" in message and f"{path}:3" in message


# -- 7. a YAML key given twice --------------------------------------------------------------------

def test_a_key_given_twice_names_the_file_the_key_and_both_lines(tmp_path):
    """Before: seed 0 then seed 5 trained with seed 5, silently."""
    path = tmp_path / "c.yaml"
    path.write_text("method: sft\nseed: 0\noutput_dir: r\nmodel: {path: m}\ndata:\n  train: t.jsonl\nseed: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: the key 'seed' is given twice (lines 2 and 7)")
    path.write_text("output_dir: r\nmodel: {path: m}\ndata:\n  train: t.jsonl\n  eval: e.jsonl\n  train: u.jsonl\n")
    with pytest.raises(ConfigError, match=r"the key 'train' is given twice \(lines 4 and 6\)"):
        load_config(path)


# -- 8. clip ranges --------------------------------------------------------------------------------

@pytest.mark.parametrize("override, why", [
    ("algorithm.clip_low=2", "clip_low must be in (0, 1)"),
    ("algorithm.clip_low=0", "clip_low must be in (0, 1)"),
    ("algorithm.clip_low=1", "only policy_loss=cispo may set 1"),  # a lower bound of 0: no clip below
    ("algorithm.clip_high=0", "clip_high must be > 0"),
    ("algorithm.dual_clip=0.5", "algorithm.dual_clip must be > 1"),
    ("critic.value_clip=0", "greater than 0"),
])
def test_clip_settings_outside_their_range_are_refused_with_the_reason(override, why):
    """Before: clip_low=2 (a negative lower bound: no clipping) and clip_high=0 were accepted."""
    cfg = {"method": "ppo", "output_dir": "r", "model": {"path": "m"}, "data": {"train": "t.jsonl"},
           "rewards": [{"fn": "math"}]}
    with pytest.raises(ConfigError) as info:
        load_config(cfg, [override])
    assert why in str(info.value) and override in str(info.value)


# -- 10. threads on a busy machine ---------------------------------------------------------------

def test_threads_follow_the_load_when_unset_and_a_busy_machine_is_warned_about(monkeypatch):
    """Before: torch's default (one thread per core) was used whatever the load, silently; steps
    ran 10-40x slower with another job on one of two cores."""
    import torch

    from rlft.training import threads

    saved = torch.get_num_threads()
    monkeypatch.setattr(threads, "cores_and_load", lambda: (2, 1.3))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    said: list[tuple[str, bool]] = []
    try:
        assert threads.set_run_threads(None, lambda line, warn: said.append((line, warn))) == 1
        assert said[-1][1] is False and "threads: 1" in said[-1][0] and "load average 1.3" in said[-1][0]
        assert threads.set_run_threads(2, lambda line, warn: said.append((line, warn))) == 2
        assert said[-1][1] is True and "set training.num_threads=1" in said[-1][0].lower()
        monkeypatch.setattr(threads, "cores_and_load", lambda: (2, 0.1))
        assert threads.set_run_threads(None, lambda line, warn: said.append((line, warn))) == 2
        assert "torch's default" in said[-1][0]
    finally:
        torch.set_num_threads(saved)


# -- 4. the README's "Using it" commands, as written ---------------------------------------------

# (the README's command, what this test adds to keep it short: step counts and evaluated rows)
SHORT = ["eval.max_examples=4", "eval.max_new_tokens=8"]
README_COMMANDS = [
    ("rlft tiny-model runs/tiny-model", []),
    ("rlft train examples/sft.yaml", ["training.max_steps=2", *SHORT]),
    ("rlft train examples/grpo.yaml", ["training.max_steps=1", "rollout.prompts_per_step=2",
                                       "rollout.max_new_tokens=8", *SHORT]),
    ("rlft eval runs/grpo --data examples/data/arith_heldout.jsonl --reward math --samples 8 --temperature 1.0",
     ["--max-examples", "4", "--max-new-tokens", "8"]),
    ("rlft eval runs/grpo --data examples/data/arith_heldout.jsonl --compare runs/sft",
     ["--max-examples", "4", "--max-new-tokens", "8"]),
]


def test_the_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """Before: `rlft eval runs/grpo ... --reward math` died after sampling with a raw ValueError
    (the examples' correct_component), and the Python snippet run after the SFT step stopped with
    'nothing to train' (it re-used runs/sft with fewer epochs)."""
    import ast
    import re

    import rlft

    readme = (ROOT / "README.md").read_text()
    using = readme.split("## Using it", 1)[1].split("### Config", 1)[0]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for command, extra in README_COMMANDS:
        assert command in using, command
        done = run_main(monkeypatch, capsys, *command.split()[1:], *extra)
        assert done.returncode == 0, (command, (done.stdout + done.stderr)[-3000:])
    assert (tmp_path / "runs" / "grpo" / "evals" / "arith_heldout.json").is_file()
    assert (tmp_path / "runs" / "grpo" / "evals" / "compare-arith_heldout.json").is_file()
    call = re.search(r'rlft\.train\("examples/sft\.yaml", (\[.*?\])\)', using)
    assert call is not None
    summary = rlft.train("examples/sft.yaml", [*ast.literal_eval(call.group(1)), "training.max_steps=2", *SHORT])
    assert summary["status"] == "completed" and summary["step"] == 2


# -- also: a path in another platform's style ------------------------------------------------------

@pytest.mark.parametrize("source, posix", [(r"C:\data\x.jsonl", "/data/x.jsonl"), (r"data\x.jsonl", "data/x.jsonl")])
def test_a_windows_style_data_path_is_named_as_such(source, posix):
    """Before: 'data file not found' with a hint to check the path, which looks right to its author."""
    from rlft.data.readers import read_rows

    with pytest.raises(DataError) as info:
        read_rows(source)
    assert "Windows style" in str(info.value) and repr(posix) in str(info.value)
