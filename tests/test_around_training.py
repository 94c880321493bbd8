"""What happens around the training loop, end to end on the tiny model: mixed data sources in
online and offline runs, the SFT term in online RL (`algorithm.sft_mix`), evaluation suites during
training and from `rlft eval RUN` (the memory check before loading weights: test_memory_fit.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from conftest import arithmetic_rows, make_config, run_main, write_jsonl
from rlft.api import train
from rlft.models.tiny import build_tiny_model

REWARDS = '''
def digits(prompt, completion, **row):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

def constant(prompt, completion, **row):
    return 0.5

def exact(prompt, completion, answer, **row):
    return 1.0 if completion.strip() == answer else 0.0
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("around")
    build_tiny_model(root / "model", seed=0)
    (root / "rewards.py").write_text(REWARDS)
    write_jsonl(root / "easy.jsonl", [{"prompt": f"Count to {i}.", "answer": str(i)} for i in range(12)])
    write_jsonl(root / "hard.jsonl", [{"prompt": f"Spell {i} backwards.", "answer": str(i)[::-1]} for i in range(4)])
    write_jsonl(root / "sft.jsonl", arithmetic_rows(32, seed=3))
    return root


def _online(root, name, rewards=("digits",), **sections):
    cfg = {
        "method": "grpo", "output_dir": str(root / "runs" / name), "seed": 0,
        "model": {"path": str(root / "model")}, "data": {"train": str(root / "easy.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": 4, "num_threads": 1, "lr_scheduler": "constant"},
        "rollout": {"group_size": 2, "prompts_per_step": 4, "max_new_tokens": 8},
        "rewards": [{"fn": f"{root / 'rewards.py'}:{fn}"} for fn in rewards],
        "logging": {"progress": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _metrics(run):
    """metrics.jsonl's rows, after checking every key is one the metric catalogue knows (the names
    `checkpoint.keep_best` and `monitor.early_stop.metric` are checked against at start-up)."""
    from rlft.config import load_config
    from rlft.monitor.catalogue import metric_names

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = load_config(run / "config.yaml")
    names, prefixes = metric_names(config, [s.component for s in config.rewards])
    unknown = {k for r in rows for k in r if k not in names and not k.startswith(prefixes)}
    assert not unknown, unknown
    return rows


def test_online_mixing_draws_the_stated_proportions_and_logs_each_source(root):
    # weights 3:1 over an epoch of 16 rows -> 12 'easy' and 4 'hard' prompts; 4 prompts per step,
    # so the 4 steps are exactly one epoch and must hold exactly those counts
    cfg = _online(root, "mixed", data={"train": [{"path": str(root / "easy.jsonl"), "weight": 3},
                                                 {"path": str(root / "hard.jsonl"), "weight": 1}],
                                       "mix_epoch_size": 16},
                  rewards=("exact", "digits"))
    train(cfg)
    rows = _metrics(root / "runs" / "mixed")
    assert len(rows) == 4
    group = 2 * 4  # completions per step
    counts = Counter()
    # A source without prompts in a step logs no keys that step; every source that has them logs
    # all three, read by index (a `.get(key, 0.0)` here let a missing or renamed key pass).
    for r in rows:
        present = [k[len("data/source/"):-len("_frac")] for k in r if k.startswith("data/source/")]
        assert present and set(present) <= {"easy", "hard"}
        assert sum(r[f"data/source/{s}_frac"] for s in present) == pytest.approx(1.0, rel=1e-12)
        for source in present:
            counts[source] += round(r[f"data/source/{source}_frac"] * group)
            assert 0.0 <= r[f"accuracy/source/{source}"] <= 1.0
        # each source's mean reward, weighted by its share, is the step's mean reward
        mixed = sum(r[f"data/source/{s}_frac"] * r[f"reward/source/{s}"] for s in present)
        assert mixed == pytest.approx(r["reward/mean"], rel=1e-9, abs=1e-12)
    assert counts == {"easy": 12 * 2, "hard": 4 * 2}  # completions = prompts x group size


def test_sft_reads_a_list_of_sources(root, tmp_path):
    """Each source contributes the rows it was given, from its own file. (Before: only
    `status == completed` was checked, which a run that read one source twice also passes.)
    rows 12 + 4 = 16 per epoch, batch 4 -> 4 steps are exactly one epoch."""
    from rlft.config import load_config
    from rlft.training.offline.loop import make_objective, run_offline

    other = write_jsonl(tmp_path / "other.jsonl", arithmetic_rows(8, seed=9))
    config = load_config(make_config(
        root / "model", root / "sft.jsonl", tmp_path / "run",
        data={"train": [{"path": str(root / "sft.jsonl"), "rows": 12}, {"path": str(other), "rows": 4}]},
        training={"batch_size": 4, "max_steps": 4, "precision": "fp32"}))
    objective = make_objective(config)
    trained_on = []  # every example a training loss saw, in order
    loss = objective.loss

    def spy(model, examples, norm):
        trained_on.extend(examples)
        return loss(model, examples, norm)

    objective.loss = spy
    summary = run_offline(config, objective)
    assert summary["status"] == "completed" and summary["step"] == 4
    assert Counter(ex.source for ex in trained_on) == {"sft": 12, "other": 4}
    for ex in trained_on:  # the tag names the file the row was read from (`where` is FILE:LINE)
        assert ex.where.rsplit(":", 1)[0] == str(root / "sft.jsonl" if ex.source == "sft" else other)
    # within one epoch no source repeats a row before it is used up
    assert len({ex.where for ex in trained_on}) == 16
    rows = _metrics(tmp_path / "run")
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_sft_mix_moves_a_policy_the_rewards_leave_alone(root):
    # a constant reward gives every group zero advantage and beta=0 removes the KL term, so without
    # the SFT term nothing moves; with it, the parameters change and the SFT rows' NLL falls
    train(_online(root, "flat", rewards=("constant",), algorithm={"kl_coef": 0.0}))
    before = load_file(str(root / "model" / "model.safetensors"))
    after_flat = load_file(str(root / "runs" / "flat" / "final" / "model.safetensors"))
    assert all(torch.equal(before[k], after_flat[k]) for k in before)

    mixed = _online(root, "ptx", rewards=("constant",), algorithm={"kl_coef": 0.0, "sft_mix": str(root / "sft.jsonl"), "sft_mix_coef": 1.0,
                                            "sft_mix_batch_size": 8},
                    training={"max_steps": 6})
    train(mixed)
    rows = _metrics(root / "runs" / "ptx")
    nll = [r["sft_mix/nll"] for r in rows]
    assert nll[-1] < nll[0] - 0.5, nll  # lr 1e-2 on 32 rows: the NLL drops by several nats
    after = load_file(str(root / "runs" / "ptx" / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sft_mix_rows_resume_where_they_stopped():
    from rlft.data.sft_examples import SftExample
    from rlft.training.online.sft_mix import SftMix

    examples = [SftExample("row", [1, 2, 3], [0, 1, 1], [], "", {}) for _ in range(10)]
    a = SftMix(examples, 0.1, 3, seed=5, pad_id=0)
    a.sampler.take(3), a.sampler.take(3)
    b = SftMix(examples, 0.1, 3, seed=5, pad_id=0)
    b.load_state_dict(a.state_dict())
    assert a.sampler.take(7) == b.sampler.take(7)  # crosses an epoch boundary


def test_suites_run_during_online_training_and_from_rlft_eval(root, monkeypatch, capsys):
    suites = [{"name": "target", "data": str(root / "easy.jsonl"), "max_examples": 4, "every": 2,
               "rewards": [{"fn": f"{root / 'rewards.py'}:exact"}], "sampling": {"max_new_tokens": 6}},
              {"name": "retention", "data": str(root / "hard.jsonl"), "max_examples": 4,
               "rewards": [{"fn": f"{root / 'rewards.py'}:digits"}], "sampling": {"max_new_tokens": 6}}]
    cfg = _online(root, "suites", eval={"suites": suites}, training={"eval_every": 3})
    summary = train(cfg)
    run = root / "runs" / "suites"
    rows = _metrics(run)
    target_steps = [r["step"] for r in rows if "eval/target/accuracy" in r]
    retention_steps = [r["step"] for r in rows if "eval/retention/reward_mean" in r]
    assert target_steps == [2, 4]  # its own `every`, and after the last step
    assert retention_steps == [3, 4]  # training.eval_every, and after the last step
    assert "eval/retention/reward_gap" in rows[-1]  # train reward minus held-out reward
    assert summary["eval/target/accuracy"] == rows[-1]["eval/target/accuracy"]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s.get("suite") for s in samples} >= {"target", "retention"}  # each suite's completions

    result = run_main(monkeypatch, capsys, "eval", str(run))
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads((run / "evals" / "suites.json").read_text())
    text = json.dumps(saved)
    assert "eval/target/accuracy" in text and "eval/retention/reward_mean" in text


def test_rlft_eval_without_data_or_suites_is_one_clear_error(root, monkeypatch, capsys):
    from conftest import assert_clean_user_error

    result = run_main(monkeypatch, capsys, "eval", str(root / "model"))
    assert "--data" in assert_clean_user_error(result)


def test_suites_run_during_sft(root, tmp_path):
    suite = {"name": "arith", "data": str(root / "sft.jsonl"), "max_examples": 4, "sampling": {"max_new_tokens": 6},
             "rewards": [{"fn": "math", "weight": 1.0}]}
    cfg = make_config(root / "model", root / "sft.jsonl", tmp_path / "run", eval={"suites": [suite]},
                      training={"batch_size": 8, "max_steps": 4, "eval_every": 2})
    train(cfg)
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "eval/arith/accuracy" in r] == [2, 4]


def test_data_screen_and_pairs_run_with_the_configs_own_model(root, tmp_path, monkeypatch, capsys):
    # the real plumbing (the config's model, engine and rewards); `parity` makes every prompt's
    # pass rate the share of its samples with an even length
    (tmp_path / "r.py").write_text("def parity(prompt, completion, **row):\n    return float(len(completion) % 2 == 0)\n")
    cfg = _online(root, "screen", rollout={"max_new_tokens": 6})
    cfg["rewards"] = [{"fn": f"{tmp_path / 'r.py'}:parity"}]
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    result = run_main(monkeypatch, capsys, "data", "screen", str(tmp_path / "c.yaml"), "--samples", "4",
                      "--low", "0.25", "--high", "0.75", "--out", str(tmp_path / "kept.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
    kept, easy, hard = (int(result.stdout.split(word)[1].split()[0].strip(",")) for word in ("kept", "too easy", "too hard"))
    assert kept + easy + hard == 12
    assert len((tmp_path / "kept.jsonl").read_text().splitlines()) == kept

    result = run_main(monkeypatch, capsys, "data", "pairs", str(tmp_path / "c.yaml"), "--samples", "4",
                      "--out", str(tmp_path / "pairs.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(len(p["chosen"]) % 2 == 0 != len(p["rejected"]) % 2 for p in pairs)
