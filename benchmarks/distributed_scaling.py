"""SFT and GRPO throughput on 1 vs 2 ranks (torchrun, FSDP2 over gloo on CPU; NCCL on GPUs).

    .venv/bin/python benchmarks/distributed_scaling.py [--size small] [--threads 1] [--steps 6]

Builds the ~28M model (`rlft tiny-model --size small`) once under benchmarks/work/, runs the same
global batch on one process and on two ranks, and prints tokens/s (median over the steps after
the first) and the speed-up. With T threads per rank, two ranks use 2T cores: on a 2-core machine
compare 1 rank x 2 threads with 2 ranks x 1 thread (the default pairs), or expect little gain --
the ranks also pay the all-gathers of FSDP and the whole-weights sync of their rollout copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
WORK = HERE / "work" / "distributed"


def build(size: str) -> Path:
    model = WORK / f"model-{size}"
    if not (model / "model.safetensors").is_file():
        from rlft.models.tiny import build_tiny_model

        build_tiny_model(model, size=size, seed=0, overwrite=True)
    rows = [{"prompt": f"What is {a} + {b}?", "completion": f"{a}+{b} is {a + b}. The answer is {a + b}.",
             "answer": str(a + b)} for a in range(10, 30) for b in range(10, 20)]
    (WORK / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (WORK / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                                for r in rows))
    return model


def config(model: Path, method: str, out: Path, steps: int, threads: int) -> Path:
    cfg = {"method": method, "output_dir": str(out), "seed": 0, "model": {"path": str(model), "device": "cpu"},
           "training": {"learning_rate": 1e-5, "max_steps": steps, "num_threads": threads, "batch_size": 16},
           "checkpoint": {"every": 1000}, "logging": {"progress": False},
           "monitor": {"enabled": []}, "adopt_output_dir": True}
    if method == "sft":
        cfg["data"] = {"train": str(WORK / "sft.jsonl"), "max_length": 64}
    else:
        cfg["data"] = {"train": str(WORK / "prompts.jsonl")}
        cfg["rollout"] = {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 64}
        cfg["rewards"] = [{"fn": "math"}]
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg: Path, ranks: int, threads: int) -> dict:
    out = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    rlft = [sys.executable, "-m", "rlft"]
    command = [*rlft, "train", str(cfg)] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "rlft",
         "train", str(cfg)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens_key = "completion/tokens" if "completion/tokens" in rows[0] else "tokens"
    time_key = "time/step" if "time/step" in rows[0] else "step_time"
    per_step = [r[tokens_key] / r[time_key] for r in rows[1:]]
    return {"tokens_per_s": statistics.median(per_step), "s_per_step": statistics.median(r[time_key] for r in rows[1:]),
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(HERE / "results" / "distributed_scaling.json"))
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model = build(args.size)
    results = []
    for method in ("sft", "grpo"):
        for ranks, threads in ((1, 1), (1, 2), (2, 1)):
            cfg = config(model, method, WORK / f"{method}-{ranks}x{threads}", args.steps, threads)
            res = {"method": method, "ranks": ranks, "threads_per_rank": threads, **run(cfg, ranks, threads)}
            results.append(res)
            print(f"{method:5s} {ranks} rank(s) x {threads} thread(s): {res['tokens_per_s']:8.1f} tokens/s, "
                  f"{res['s_per_step']:.3f} s/step", flush=True)
    Path(args.out).write_text(json.dumps({"size": args.size, "load": os.getloadavg(), "results": results}, indent=2))
    for method in ("sft", "grpo"):
        base = next(r for r in results if r["method"] == method and r["ranks"] == 1 and r["threads_per_rank"] == 2)
        two = next(r for r in results if r["method"] == method and r["ranks"] == 2)
        print(f"{method}: 2 ranks x 1 thread / 1 rank x 2 threads = {two['tokens_per_s'] / base['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
