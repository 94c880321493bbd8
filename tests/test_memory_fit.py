"""The memory fit `rlft train` runs before loading weights (rlft.plan.fit), on the tiny model with
an explicit `training.memory_limit_gb`: it keeps the fast path when the plan fits, turns on the
cheapest memory savers that fit when it does not (never a setting the config wrote), and stops with
one error before loading anything when nothing fits.

The tiny GRPO run below (fp32) plans, in MiB: 68.0 as configured; 44.5 with micro-batches of 16
rows, 31.0 with micro-batches of 8; 33.6 with gradient checkpointing; 18.1 at the least (savers
on, rollouts in batches of 4). A limit of 0.04 GiB leaves 0.9 x 40.96 = 36.9 MiB usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import write_jsonl
from rlft.api import train
from rlft.config import load_config
from rlft.errors import RlftError
from rlft.plan.fit import fit_memory
from rlft.training.distributed import World


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(1, 10)])
    (root / "rewards.py").write_text("def digits(prompt, completion, **row):\n"
                                     "    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)\n")
    return root


def _config(qwen_path, data, out, limit, **sections):
    cfg = {"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": str(qwen_path), "device": "cpu"},
           "data": {"train": str(data / "prompts.jsonl")},
           # the hand-computed MiB below are the plain layout's (shared_prefix computes prompts once)
           "training": {"learning_rate": 1e-3, "max_steps": 1, "num_threads": 1, "precision": "fp32",
                        "memory_limit_gb": limit, "shared_prefix": "off"},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 16},
           "rewards": [{"fn": f"{data / 'rewards.py'}:digits"}], "logging": {"progress": False}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _fit(cfg):
    import torch

    return fit_memory(load_config(cfg), World(), torch.device("cpu"))


def test_a_generous_limit_changes_nothing(qwen_path, data, tmp_path):
    config = load_config(_config(qwen_path, data, tmp_path / "run", 1.0))
    fit = fit_memory(config, World(), __import__("torch").device("cpu"))
    assert fit.config is config and fit.changes == {} and fit.message == ""
    assert fit.record["fits"] is True and "longest templated prompt" in fit.record["lengths"]


def test_the_cheapest_saver_that_fits_is_chosen(qwen_path, data, tmp_path):
    # 68.0 MiB does not fit in 36.9; micro-batches of 16 rows (44.5) do not either; of the sets that
    # fit, micro-batches of 8 (31.0 MiB, 280 tokens each: +3% step time) cost less than checkpointing (33.6, +33%)
    fit = _fit(_config(qwen_path, data, tmp_path / "run", 0.04))
    assert fit.changes == {"algorithm.micro_batch_size": 8}
    assert fit.config.algorithm.micro_batch_size == 8 and not fit.config.model.gradient_checkpointing
    assert "turned on algorithm.micro_batch_size=8" in fit.message


def test_checkpointing_is_turned_on_and_the_run_completes(qwen_path, data, tmp_path, capsys):
    # micro-batch written in the config (32: the whole batch) stays; checkpointing (33.6 MiB) fits
    out = tmp_path / "run"
    summary = train(_config(qwen_path, data, out, 0.04, algorithm={"micro_batch_size": 32}))
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())
    assert "turned on model.gradient_checkpointing=true" in text, text
    assert "left as set in the config: algorithm.micro_batch_size=32" in text
    assert summary["status"] == "completed"
    assert summary["memory_fit"]["changes"] == {"model.gradient_checkpointing": True}
    saved = yaml.safe_load((out / "config.yaml").read_text())  # the run's resolved settings
    assert saved["model"]["gradient_checkpointing"] is True and saved["algorithm"]["micro_batch_size"] == 32
    assert json.loads((out / "summary.json").read_text())["memory_fit"]["fits"] is False


def test_the_heap_keeps_its_freed_pages_only_where_memory_is_plentiful(qwen_path, data, tmp_path, monkeypatch):
    """Plenty of memory (the plan takes at most half of what is usable): no trimming between a step's
    phases (training.host_memory); a plan that fits with less room, or needs a saver, keeps trimming."""
    import torch

    import rlft.api as api

    roomy = _fit(_config(qwen_path, data, tmp_path / "a", 1.0))  # 68.0 MiB of 921.6 usable
    assert roomy.roomy and roomy.changes == {} and roomy.record["keeps_freed_pages"] is True
    snug = _fit(_config(qwen_path, data, tmp_path / "b", 0.1))  # 68.0 of 92.2: fits, more than half
    assert not snug.roomy and snug.changes == {} and snug.record["keeps_freed_pages"] is False
    assert not _fit(_config(qwen_path, data, tmp_path / "c", 0.04)).roomy  # a saver was needed
    runs, kept = [], []

    def run_online(cfg, world, trim_heap):
        Path(cfg.output_dir).mkdir(parents=True)  # (the run folder the summary is written to)
        runs.append(trim_heap)
        return {}

    monkeypatch.setattr(api, "run_online", run_online)
    monkeypatch.setattr(api, "keep_freed_pages", lambda device: kept.append(device) or True)
    train(_config(qwen_path, data, tmp_path / "a", 1.0))
    train(_config(qwen_path, data, tmp_path / "b", 0.1))
    assert runs == [False, True] and kept == [torch.device("cpu")]


def test_nothing_fits_is_one_error_before_the_run_starts(qwen_path, data, tmp_path, monkeypatch):
    import rlft.api as api

    monkeypatch.setattr(api, "run_online", lambda *a, **k: pytest.fail("the run started"))
    out = tmp_path / "run"
    # gradient checkpointing written as false in the config: kept, and then nothing fits 36.9 MiB
    cfg = _config(qwen_path, data, out, 0.04, model={"gradient_checkpointing": False},
                  algorithm={"micro_batch_size": 32})
    with pytest.raises(RlftError) as err:
        train(cfg)
    message = str(err.value)
    assert "Stopped before loading the weights" in message
    assert "left as is: model.gradient_checkpointing=false, algorithm.micro_batch_size=32" in message
    assert "gradient checkpointing: 33.6 MiB (fits)" in message  # the way out, from the planner's advice
    assert not out.exists()
    with pytest.raises(RlftError, match=r"still 18\.1 MiB with the memory savers"):
        train(_config(qwen_path, data, out, 0.005))


def test_micro_batches_that_keep_the_matmuls_busy_cost_less_than_thin_ones(qwen_path, data, tmp_path):
    # measured (plan/fit.py): an extra pass over the weights costs ~1% of the step while a
    # micro-batch holds >= BUSY_TOKENS tokens; thinner micro-batches are priced at 5% per pass
    from dataclasses import replace

    from rlft.plan.inputs import plan_input_from_config
    from rlft.plan.fit import BUSY_TOKENS, COST_MICRO, COST_THIN_MICRO, _options
    from rlft.plan.lengths import data_lengths

    def costs(max_new_tokens):
        config = load_config(_config(qwen_path, data, tmp_path / "run", 0.04,
                                     rollout={"max_new_tokens": max_new_tokens}))
        base = plan_input_from_config(config, 1, __import__("torch").device("cpu"), lengths=data_lengths(config))
        by_micro = {o.changes.get("algorithm.micro_batch_size"): o.cost for o in _options(config, base)
                    if "model.gradient_checkpointing" not in o.changes and "rollout.batch_size" not in o.changes}
        return base.seq_len, by_micro

    seq_len, by_micro = costs(16)  # the runs above: rows of 35 tokens
    assert 8 * seq_len >= BUSY_TOKENS > 4 * seq_len
    assert by_micro[None] == 0 and by_micro[16] == pytest.approx(COST_MICRO)
    assert by_micro[8] == pytest.approx(3 * COST_MICRO) and by_micro[4] == pytest.approx(7 * COST_THIN_MICRO)
    seq_len, by_micro = costs(128)  # longer rows: 2 of them keep the matmuls busy
    assert 2 * seq_len >= BUSY_TOKENS > seq_len
    assert by_micro[2] == pytest.approx(15 * COST_MICRO) and by_micro[1] == pytest.approx(31 * COST_THIN_MICRO)
    config = load_config(_config(qwen_path, data, tmp_path / "run", 0.04))
    gpu = replace(plan_input_from_config(config, 1, __import__("torch").device("cpu"), lengths=data_lengths(config)),
                  device_type="cuda")  # not measured on a GPU: every extra pass at the old price
    assert {o.changes.get("algorithm.micro_batch_size"): o.cost for o in _options(config, gpu)
            if len(o.changes) <= 1 and "model.gradient_checkpointing" not in o.changes
            and "rollout.batch_size" not in o.changes}[8] == pytest.approx(3 * COST_THIN_MICRO)


def _fake_cgroups(root, proc_lines, files):
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "cgroup").write_text("\n".join(proc_lines) + "\n")
    for rel, text in files.items():
        path = root / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root / "proc" / "cgroup"), str(root / "fs")


def test_a_cgroup_v2_limit_is_read_up_the_hierarchy(tmp_path):
    from rlft.plan.fit import cgroup_memory_left

    gib = 2**30
    proc, fs = _fake_cgroups(tmp_path, ["0::/pod/box"], {
        "pod/box/memory.max": "max\n", "pod/box/memory.current": f"{gib}\n",
        "pod/memory.max": f"{3 * gib}\n", "pod/memory.current": f"{2 * gib}\n",
        "pod/memory.stat": f"anon 1\ninactive_file {gib // 2}\nactive_file 7\n"})
    # the box has no limit of its own; its parent allows 3 GiB and holds 2, half a GiB of it cache
    assert cgroup_memory_left(proc, fs) == 3 * gib // 2
    proc, fs = _fake_cgroups(tmp_path / "none", ["0::/"], {"memory.current": "5\n"})
    assert cgroup_memory_left(proc, fs) is None  # the root cgroup has no memory.max


def test_a_cgroup_v1_limit_and_no_limit(tmp_path):
    from rlft.plan.fit import cgroup_memory_left

    gib = 2**30
    proc, fs = _fake_cgroups(tmp_path, ["5:cpu,cpuacct:/x", "4:memory:/job/run", "0::/"], {
        "memory/job/run/memory.limit_in_bytes": f"{9223372036854771712}\n",
        "memory/job/run/memory.usage_in_bytes": f"{gib}\n",
        "memory/job/run/memory.stat": f"cache 3\nhierarchical_memory_limit {4 * gib}\ntotal_inactive_file {gib}\n"})
    assert cgroup_memory_left(proc, fs) == 4 * gib  # 4 GiB over the hierarchy, 1 used, 1 of it cache
    proc, fs = _fake_cgroups(tmp_path / "free", ["4:memory:/"], {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "100\n",
        "memory/memory.stat": "hierarchical_memory_limit 9223372036854771712\n"})
    assert cgroup_memory_left(proc, fs) is None
    assert cgroup_memory_left(str(tmp_path / "missing"), fs) is None


def test_the_least_of_ram_cgroup_and_address_space_is_the_budget(qwen_path, data, tmp_path, monkeypatch):
    import rlft.plan.fit as mf

    gib = 2**30
    config = load_config(_config(qwen_path, data, tmp_path / "run", None))  # fp32: 0.75 GiB kept for the runtime
    cpu = __import__("torch").device("cpu")
    monkeypatch.setattr(mf, "_meminfo_available", lambda: 20 * gib)
    monkeypatch.setattr(mf, "cgroup_memory_left", lambda: 4 * gib)
    monkeypatch.setattr(mf, "address_space_left", lambda reserve: None)
    budget = mf.run_budget(config, cpu)
    assert budget.capacity == 4 * gib - mf.RSS_RESERVE and "memory cgroup" in budget.label
    assert mf.run_budget(config, cpu, local_ranks=2).capacity == (4 * gib - mf.RSS_RESERVE) // 2
    monkeypatch.setattr(mf, "address_space_left", lambda reserve: gib)  # each rank has its own, not split
    budget = mf.run_budget(config, cpu, local_ranks=2)
    assert budget.capacity == gib and "RLIMIT_AS" in budget.label
    monkeypatch.setattr(mf, "cgroup_memory_left", lambda: None)
    monkeypatch.setattr(mf, "address_space_left", lambda reserve: None)
    budget = mf.run_budget(config, cpu)
    assert budget.capacity == 20 * gib - mf.RSS_RESERVE and "available RAM" in budget.label


def test_against_ram_the_allocators_slack_grows_with_the_micro_batch(qwen_path, data, tmp_path, monkeypatch):
    # RAM and cgroups count what the allocator keeps resident: SLACK_LAYERS layers' activations of
    # one micro-batch beside the plan, so fewer rows per micro-batch need less beside it
    import rlft.plan.fit as mf
    from rlft.plan.inputs import plan_input_from_config, read_model_config
    from rlft.plan.memory import micro_batch_layer_bytes, plan_memory
    from rlft.plan.lengths import data_lengths

    config = load_config(_config(qwen_path, data, tmp_path / "run", None))
    cpu = __import__("torch").device("cpu")
    model_cfg = read_model_config(str(qwen_path))
    base = plan_input_from_config(config, 1, cpu, lengths=data_lengths(config))
    plan, layer = plan_memory(model_cfg, base).total, micro_batch_layer_bytes(model_cfg, base)
    assert layer > 0
    for resident in (False, True):
        monkeypatch.setattr(mf, "run_budget", lambda *a, **k: mf.Budget("test", 10 * 2**30, resident=resident))
        fit = mf.fit_memory(config, World(), cpu)
        expected = plan + (mf.SLACK_LAYERS * layer if resident else 0)
        assert fit.record["planned_gib"] == round(expected / 2**30, 4) and fit.changes == {}
    # a budget the plan fits but not with the slack beside it: a saver is turned on, and said why
    squeeze = int((plan + mf.SLACK_LAYERS * layer * 0.9) / 0.9)
    monkeypatch.setattr(mf, "run_budget", lambda *a, **k: mf.Budget("test", squeeze, resident=True))
    fit = mf.fit_memory(config, World(), cpu)
    assert fit.changes and "allocator slack" in fit.message


def test_an_online_run_trims_the_heap_only_when_told(qwen_path, data, tmp_path, monkeypatch):
    import rlft.training.online.loop as online

    trims = []
    monkeypatch.setattr(online, "release_free_heap", trims.append)
    for trim in (True, False):
        cfg = _config(qwen_path, data, tmp_path / f"run-{trim}", 1.0,
                      rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4})
        assert online.run_online(load_config(cfg), World(), trim_heap=trim)["status"] == "completed"
        assert len(trims) == 2  # after sampling and after the update of its one step; none when not told
