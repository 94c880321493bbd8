"""A short soak (benchmarks/soak.py): GRPO, async k = 1 and an agent run with the calculator, each in
a child process sampled from here; after warm-up RSS grows less than 5 % and open fds, child
processes and threads do not grow at all. The full-length version is `python benchmarks/soak.py`.
Minutes: `-m slow` only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def _soak_module():
    if "rlft_bench_soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("rlft_bench_soak", SOAK)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (its dataclasses look their module up)
        spec.loader.exec_module(module)
    return sys.modules["rlft_bench_soak"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "steps", "warmup"), [("grpo", 100, 20), ("async", 60, 15), ("agent", 60, 15)])
def test_a_short_soak_leaks_nothing(tmp_path_factory, name, steps, warmup):
    soak = _soak_module()
    work = tmp_path_factory.getbasetemp() / "soak"  # the models and prompts, built once for the three runs
    plan = soak.plan(name, steps=steps, warmup=warmup)  # samples and checkpoints scaled with the steps
    assert plan.checkpoint_every < steps and plan.warmup in plan.sample_steps
    (record,) = soak.soak([name], work=work, plans={name: plan})
    report = soak.table([record])
    assert record["returncode"] == 0, f"the run failed; its log: {record['log']}\n{report}"
    assert record["steps_done"] == steps, report
    verdict = record["verdict"]
    assert verdict["rss_growth"] < soak.RSS_GROWTH_LIMIT, report
    for key in soak.COUNTS:
        assert verdict[f"{key}_growth"] <= 0, f"{key} grew after warm-up\n{report}\n{record.get('fd_targets', '')}"
    assert verdict["ok"], report
    assert len(record["samples"]) == len(plan.sample_steps)
