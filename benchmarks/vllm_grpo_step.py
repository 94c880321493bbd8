"""One GRPO step with the vLLM rollout engine vs rlft's HF engine, same work, same process layout.

    .venv/bin/python benchmarks/vllm_grpo_step.py [--steps 6] [--threads 1] [--repeats 2]

The ~28M model (`rlft tiny-model --size small`, random weights), 4 prompts x G = 8, at most 128
new tokens, temperature 1.0, k3 KL to the initial model (beta 0.04), fp32, one optimizer step per
rollout. Each run is its own `rlft train` process; the engines alternate (hf, vllm, hf, vllm ...)
so a drift in the machine's speed hits both. Per run: the median over steps 2.. of `time/step`,
`time/generate` (sampling, weight sync included) and the rest of the step; the vLLM engine's
start-up (import, build) is outside the steps and reported as the process's wall time.
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
WORK = HERE / "work" / "vllm_step"


def build_model() -> Path:
    model = WORK / "model-small"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "rlft", "tiny-model", str(model), "--size", "small", "--force"],
                       check=True, capture_output=True)
    return model


def write_config(model: Path, engine: str, steps: int, threads: int, tag: str) -> Path:
    out = WORK / f"run-{engine}-{tag}"
    cfg = {"method": "grpo", "output_dir": str(out), "seed": 0, "adopt_output_dir": True,
           "model": {"path": str(model), "device": "cpu"},
           "data": {"train": str(HERE / "prompts.jsonl")},
           "training": {"learning_rate": 1e-5, "max_steps": steps, "num_threads": threads, "precision": "fp32",
                        "lr_scheduler": "constant"},
           "rollout": {"engine": engine, "group_size": 8, "prompts_per_step": 4, "max_new_tokens": 128,
                       "temperature": 1.0},
           "algorithm": {"kl_coef": 0.04},
           "rewards": [{"fn": f"{HERE / 'rewards.py'}:digit_share"}],
           "checkpoint": {"every": 1000}, "logging": {"progress": False}, "monitor": {"enabled": []}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg: Path, threads: int) -> dict:
    out = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlft", "train", str(cfg)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"rlft train {cfg} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.median(r["time/step"] for r in rows)
    gen = statistics.median(r["time/generate"] for r in rows)
    return {"s_per_step": step, "generate_s": gen, "rest_s": step - gen,
            "tokens_per_step": statistics.median(r["completion/tokens"] for r in rows),
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "vllm_grpo_step.json"))
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model = build_model()
    results = []
    for i in range(args.repeats):
        for engine in ("hf", "vllm"):
            res = {"engine": engine, "repeat": i, **run(write_config(model, engine, args.steps, args.threads, str(i)),
                                                        args.threads)}
            results.append(res)
            print(f"{engine:4s} run {i}: {res['s_per_step']:.2f} s/step (generate {res['generate_s']:.2f}, "
                  f"rest {res['rest_s']:.2f}), {res['tokens_per_step']:.0f} tokens/step, process {res['wall_s']} s",
                  flush=True)
    by = {e: statistics.median(r["s_per_step"] for r in results if r["engine"] == e) for e in ("hf", "vllm")}
    gen = {e: statistics.median(r["generate_s"] for r in results if r["engine"] == e) for e in ("hf", "vllm")}
    summary = {"step_speedup": by["hf"] / by["vllm"], "generate_speedup": gen["hf"] / gen["vllm"]}
    print(f"vLLM vs HF engine: step {summary['step_speedup']:.2f}x, generation {summary['generate_speedup']:.2f}x")
    Path(args.out).write_text(json.dumps({"load": os.getloadavg(), "threads": args.threads, "steps": args.steps,
                                          "results": results, **summary}, indent=2))


if __name__ == "__main__":
    main()
