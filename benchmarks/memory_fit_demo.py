"""The memory fit under a memory limit: the same GRPO run, twice, under one RLIMIT_AS cap or in one
memory cgroup (`--cgroup-limit-gb`: a container's limit on resident memory; needs write access to
the cgroup fs).

1. `fast path`: `training.memory_limit_gb: 1000` tells the planner the run has 1000 GiB, so it keeps
   the fast path, as rlft did before the memory fit (one forward/backward over all 32 sequences,
   no checkpointing);
2. `auto`: rlft's defaults: the planner reads the RLIMIT_AS cap as the budget and turns on what
   makes the plan fit.

    PYTHONPATH=src python benchmarks/memory_fit_demo.py --memory-limit-gb 3.5 [--size small]
    PYTHONPATH=src python benchmarks/memory_fit_demo.py --cgroup-limit-gb 2.25 --precision auto --steps 4

The workload is the bench's large-full one (~28M model, 4 prompts x G 8, up to 128 new tokens,
fp32 by default so it behaves alike on every CPU; `--precision auto` for rlft's default), 2 steps.
Printed per run: exit code, wall time, peak RSS, the process's peak address space (VmPeak), in a
cgroup its peak and OOM kills, and the memory-fit line rlft printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (GROUP_SIZE, KL_COEF, LEARNING_RATE, PROMPTS_PER_STEP, SEED, build_models,  # noqa: E402
                     rel, run_child, tail)

HERE = Path(__file__).resolve().parent
# prints the child's peak address space at exit (VmPeak; RLIMIT_AS caps it)
WRAPPER = ("import atexit, runpy, sys\n"
           "def peak():\n"
           "    for ln in open('/proc/self/status'):\n"
           "        if ln.startswith(('VmPeak', 'VmHWM')): print('memory_fit_demo', ln.strip(), flush=True)\n"
           "atexit.register(peak)\n"
           "sys.argv = ['rlft', 'train', sys.argv[1]]\n"
           "runpy.run_module('rlft', run_name='__main__')\n")


def config(name: str, model: Path, work: Path, new_tokens: int, steps: int, limit: float | None,
           precision: str = "fp32") -> Path:
    training = {"learning_rate": LEARNING_RATE, "max_steps": steps, "num_threads": 1, "precision": precision}
    if limit is not None:
        training["memory_limit_gb"] = limit
    cfg = {"method": "grpo", "output_dir": rel(work / "runs" / name), "seed": SEED,
           "model": {"path": rel(model), "device": "cpu"}, "data": {"train": rel(HERE / "prompts.jsonl")},
           "training": training,
           "rollout": {"group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "max_new_tokens": new_tokens},
           "algorithm": {"kl_coef": KL_COEF}, "rewards": [{"fn": "benchmarks/rewards.py:digit_share"}],
           "logging": {"progress": False}}
    path = work / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(name: str, cfg: Path, work: Path, memory_limit_gb: float | None, cgroup_limit_gb: float | None) -> dict:
    import shutil

    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    res = run_child([sys.executable, "-c", WRAPPER, rel(cfg)], work / "logs" / f"{name}.log", 1,
                    memory_limit_gb=memory_limit_gb, cgroup_limit_gb=cgroup_limit_gb)
    log = (Path(__file__).resolve().parent.parent / res["log"]).read_text(errors="replace")
    flat = " ".join(log.split())
    for line in log.splitlines():
        if line.startswith("memory_fit_demo Vm"):
            key, value = line.split()[1].rstrip(":"), int(line.split()[2])
            res[key.lower() + "_mb"] = round(value / 1024, 1)
    start = flat.find("memory: the plan")
    res["fit"] = flat[start:flat.find(")", flat.find("step time", start)) + 1] if start >= 0 else ""
    summary = work / "runs" / name / "summary.json"
    res["status"] = json.loads(summary.read_text()).get("status") if summary.is_file() else "no summary"
    if res["rc"] != 0:
        res["error_tail"] = tail(res["log"], 6)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    limit = ap.add_mutually_exclusive_group(required=True)
    limit.add_argument("--memory-limit-gb", type=float, help="RLIMIT_AS of each run (GiB)")
    limit.add_argument("--cgroup-limit-gb", type=float, help="a memory cgroup of this size for each run (GiB)")
    ap.add_argument("--precision", default="fp32", help="training.precision of both runs (default fp32)")
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", choices=["fast", "auto"], help="run one of the two")
    ap.add_argument("--work", type=Path, default=HERE / "work")
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")]))
    model = build_models(args.work, {args.size}, 1)[args.size]
    runs = {"fast": 1000.0, "auto": None}
    for name, limit in runs.items():
        if args.only and name != args.only:
            continue
        cfg = config(f"memfit-{name}", model, args.work, args.new_tokens, args.steps, limit, args.precision)
        res = run(f"memfit-{name}", cfg, args.work, args.memory_limit_gb, args.cgroup_limit_gb)
        cap = (f"RLIMIT_AS {args.memory_limit_gb:g} GiB" if args.memory_limit_gb else
               f"cgroup {args.cgroup_limit_gb:g} GiB (peak {res['cgroup_peak_mb']:.0f} MB, "
               f"{res['oom_kills']} OOM kill(s))")
        print(f"{name:<5} {cap}: rc {res['rc']}, {res['status']}, {res['wall_s']:.0f} s, "
              f"peak RSS {res['peak_rss_mb']:.0f} MB, VmPeak {res.get('vmpeak_mb', '?')} MB", flush=True)
        if res["fit"]:
            print(f"      {res['fit']}")
        if res.get("error_tail"):
            print(res["error_tail"])


if __name__ == "__main__":
    main(sys.argv[1:])
