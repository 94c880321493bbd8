"""Does every method learn as well under bf16-mixed as in fp32? Same configs, several seeds, both
precisions, on the tiny model; prints the held-out metric of each run and the mean +- spread.

    PYTHONPATH=src python benchmarks/precision_parity.py [--seeds 0 1 2] [--methods sft grpo ...] [--out FILE]

Tasks (all built here, nothing downloaded):
- sft: chat arithmetic "What is a + b?" -> "The answer is N." from random init; held-out format
  compliance and eval loss;
- dpo, reward_model: the demo's carry-annotation preference pairs; held-out preference accuracy;
- online methods (grpo, dr_grpo, dapo, rloo, reinforce_pp, ppo separate / shared): a dense reward
  (share of digits in the completion) on "Count to N." prompts; held-out mean reward.
bf16-mixed is forced with training.precision, so the table means the same on every machine (on a
CPU without bf16 units it is just slower).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

DIGITS = '''
def digits(prompt, completion, **row):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''
ONLINE = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo-separate", "ppo-shared")
METHODS = ("sft", "dpo", "reward_model", *ONLINE)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def arithmetic(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                 {"role": "assistant", "content": f"The answer is {a + b}."}]})
    return out


def make_data(root: Path) -> dict[str, str]:
    from rlft.demo.arithmetic import preference_rows, split_problems

    train_problems, heldout_problems = split_problems(seed=0, heldout=64)
    (root / "reward.py").write_text(DIGITS)
    return {
        "sft_train": write_jsonl(root / "sft.jsonl", arithmetic(256, 1)),
        "sft_eval": write_jsonl(root / "sft_eval.jsonl", arithmetic(32, 2)),
        "pref_train": write_jsonl(root / "pairs.jsonl", preference_rows(train_problems[:256], seed=3)),
        "pref_eval": write_jsonl(root / "pairs_eval.jsonl", preference_rows(heldout_problems, seed=4)),
        "prompts": write_jsonl(root / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(16)]),
        "heldout": write_jsonl(root / "heldout.jsonl", [{"prompt": f"Count to {i}."} for i in range(100, 116)]),
        "reward": f"{root / 'reward.py'}:digits",
    }


def config(method: str, precision: str, seed: int, model: Path, data: dict, out: Path) -> tuple[dict, tuple[str, ...]]:
    """The run's config and the summary keys of its held-out metrics."""
    base = {"output_dir": str(out), "seed": seed, "model": {"path": str(model), "device": "cpu"},
            "logging": {"progress": False},
            "training": {"precision": precision, "num_threads": 1, "lr_scheduler": "constant"}}
    if method == "sft":
        return {**base, "method": "sft", "data": {"train": data["sft_train"], "eval": data["sft_eval"], "max_length": 128},
                "training": {**base["training"], "learning_rate": 3e-3, "batch_size": 16, "max_steps": 40},
                "eval": {"format_regex": r"The answer is \d+\.", "max_examples": 32, "max_new_tokens": 12}}, \
            ("eval/loss", "eval/format_compliance")
    if method in ("dpo", "reward_model"):
        return {**base, "method": method, "data": {"train": data["pref_train"], "eval": data["pref_eval"], "max_length": 160},
                "training": {**base["training"], "learning_rate": 1e-3, "batch_size": 16, "max_steps": 16}}, \
            ("eval/rewards/accuracy",) if method == "dpo" else ("eval/accuracy",)
    name, _, kind = method.partition("-")
    cfg = {**base, "method": name, "data": {"train": data["prompts"], "eval": data["heldout"]},
           "training": {**base["training"], "learning_rate": 1e-2, "max_steps": 10},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 12},
           "eval": {"temperature": 1.0, "num_samples": 4, "max_new_tokens": 12},
           "rewards": [{"fn": data["reward"]}]}
    if kind:
        cfg["critic"] = {"kind": kind, "warmup_steps": 2}
        cfg["training"]["max_steps"] = 12
    return cfg, ("eval/reward_mean",)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from rlft.api import train
    from rlft.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="rlft-parity-"))
    model = build_tiny_model(root / "model", seed=0)
    data = make_data(root)
    results: list[dict] = []
    for method in args.methods:
        for precision in ("fp32", "bf16-mixed"):
            for seed in args.seeds:
                out = root / f"{method}-{precision}-{seed}"
                cfg, keys = config(method, precision, seed, model, data, out)
                start = time.perf_counter()
                summary = train(cfg)
                torch.set_num_threads(1)
                seconds = round(time.perf_counter() - start, 1)
                for key in keys:
                    if summary.get(key) is None:
                        raise SystemExit(f"{method}: summary has no {key}; eval keys: "
                                         f"{sorted(k for k in summary if k.startswith('eval/'))}")
                    results.append({"method": method, "precision": precision, "seed": seed, "metric": key,
                                    "value": summary[key], "seconds": seconds})
                    print(json.dumps(results[-1]), flush=True)
    print(f"\n{'method':<14} {'metric':<24} {'fp32 (per seed)':<28} {'bf16-mixed (per seed)':<28} diff of means")
    for method, metric in dict.fromkeys((r["method"], r["metric"]) for r in results):
        rows = {p: [r["value"] for r in results if (r["method"], r["metric"], r["precision"]) == (method, metric, p)]
                for p in ("fp32", "bf16-mixed")}
        cells = {p: " ".join(f"{v:.3f}" for v in vs) + f" ({statistics.mean(vs):.3f})" for p, vs in rows.items()}
        diff = statistics.mean(rows["bf16-mixed"]) - statistics.mean(rows["fp32"])
        print(f"{method:<14} {metric:<24} {cells['fp32']:<28} {cells['bf16-mixed']:<28} {diff:+.3f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
