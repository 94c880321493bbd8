"""The memory planner against measured peaks of real rlft runs on the ~30M-parameter model (CPU).

For each case it runs two training steps through `rlft.api.train` under
`rlft.monitor.memory.LiveTensorTracker` (peak bytes of live tensor storages, per phase) and prints
the planner's estimate for the same setting next to it:

    PYTHONPATH=src python benchmarks/plan_vs_measured.py [--size small|tiny] [--cases sft,grpo,...]

`--qwen7b` prints the planner's figures for Qwen2.5-7B (tests/fixtures/qwen2.5-7b/config.json) on
one H100 80GB instead, full fine-tune and LoRA, SFT and GRPO (nothing is run).

Rows have one token length each (prompts 'Count to N.' with one-digit N; sums of two-digit numbers
that all have three digits), so the planner's lengths are the run's lengths. The rollouts stop on
a digit (rollout.stop) so that finished rows are dropped from the KV cache mid-generation, the
copy the planner counts.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlft.api import train
from rlft.monitor.memory import LiveTensorTracker, track_phase
from rlft.plan.memory import PlanInput, plan_memory

CASES = {
    # name: (method, lora, training.precision, gradient checkpointing, micro-batch); the precision is
    # pinned: `auto` would be bf16-mixed on CPUs with AMX / AVX512-BF16 and fp32 elsewhere
    "sft": ("sft", False, "fp32", False, 16),
    "sft-accum": ("sft", False, "fp32", False, 4),
    "sft-lora-bf16": ("sft", True, "bf16", False, 16),
    "sft-mixed": ("sft", False, "bf16-mixed", False, 16),
    "grpo": ("grpo", False, "fp32", False, None),
    "grpo-ckpt": ("grpo", False, "fp32", True, None),
    "grpo-lora": ("grpo", True, "fp32", False, None),
    "grpo-bf16": ("grpo", False, "bf16", False, None),
    "grpo-mixed": ("grpo", False, "bf16-mixed", False, None),
    "grpo-lora-mixed": ("grpo", True, "bf16-mixed", False, None),
    "grpo-ckpt-mixed": ("grpo", False, "bf16-mixed", True, None),
}
NEW_TOKENS, GROUP, PROMPTS = 24, 8, 4


def write_data(root: Path) -> None:
    rng = random.Random(0)
    with (root / "sft.jsonl").open("w") as f:
        for _ in range(32):
            a, b = rng.randint(50, 99), rng.randint(50, 99)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"The answer is {a + b}."}]}) + "\n")
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(1, 10):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    (root / "rewards.py").write_text("def digits(prompt, completion, **row):\n"
                                     "    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)\n")


def lengths(model: Path, root: Path) -> dict[str, int]:
    from rlft.config import ModelConfig
    from rlft.data.readers import read_rows
    from rlft.data.sft_examples import make_sft_encoder
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt, end_of_turn_ids

    tok = load_tokenizer(ModelConfig(path=str(model)))
    sft = [make_sft_encoder(tok, end_of_turn_ids(tok), 128)(r) for r in read_rows(str(root / "sft.jsonl"))]
    prompts = {len(encode_prompt(tok, [{"role": "user", "content": f"Count to {i}."}])) for i in range(1, 10)}
    assert len({len(e.input_ids) for e in sft}) == 1 and len(prompts) == 1, "rows must share one length"
    return {"sft_len": len(sft[0].input_ids), "sft_targets": sum(sft[0].target_mask), "prompt_len": prompts.pop()}


def run_case(name: str, model: Path, root: Path, dims: dict[str, int]) -> dict[str, float]:
    import rlft.training.offline.loop as offline
    import rlft.training.online.loop as online
    from rlft.rollout.hf import HFEngine

    method, lora, precision, ckpt, micro = CASES[name]
    dtype = "fp32" if precision.endswith("-mixed") else precision  # the weights: fp32 masters under -mixed
    base = {"output_dir": str(root / "runs" / name), "seed": 0, "lora": {"enabled": lora},
            "model": {"path": str(model), "device": "cpu", "gradient_checkpointing": ckpt},
            "logging": {"progress": False}}
    if method == "sft":
        config = {**base, "method": "sft", "data": {"train": str(root / "sft.jsonl"), "max_length": 128},
                  "training": {"learning_rate": 1e-4, "batch_size": 16, "micro_batch_size": micro, "max_steps": 2,
                               "num_threads": 1, "precision": precision}}
        setting = PlanInput(method="sft", micro_batch_size=micro, batch_size=16, seq_len=dims["sft_len"],
                            completion_len=dims["sft_targets"], lora=lora, precision=precision, param_dtype=dtype,
                            gradient_checkpointing=ckpt, device_type="cpu")
    else:
        config = {**base, "method": "grpo", "data": {"train": str(root / "prompts.jsonl")},
                  "training": {"learning_rate": 1e-4, "max_steps": 2, "num_threads": 1, "precision": precision},
                  "rollout": {"group_size": GROUP, "prompts_per_step": PROMPTS, "max_new_tokens": NEW_TOKENS,
                              "stop": ["7"]},
                  "rewards": [{"fn": f"{root / 'rewards.py'}:digits"}]}
        rows = GROUP * PROMPTS
        setting = PlanInput(method="online", micro_batch_size=rows, batch_size=rows, lora=lora, precision=precision,
                            param_dtype=dtype, gradient_checkpointing=ckpt, device_type="cpu",
                            seq_len=dims["prompt_len"] + NEW_TOKENS, completion_len=NEW_TOKENS, group_size=GROUP,
                            prompts_per_step=PROMPTS, reference=True, shared_prefix="auto")  # the config default
    tracker = LiveTensorTracker()
    patched = [(HFEngine, "generate", track_phase(tracker, HFEngine, "generate", "rollout")),
               (online, "policy_update", track_phase(tracker, online, "policy_update", "update")),
               (offline, "_train_step", track_phase(tracker, offline, "_train_step", "update"))]
    start = time.perf_counter()
    try:
        with tracker:
            train(config)
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
    from transformers import AutoConfig

    plan = plan_memory(AutoConfig.from_pretrained(model), setting)
    return {"measured": tracker.peak_bytes, "planned": plan.total, "phases": tracker.phase_peaks,
            "planned_phases": plan.phases, "seconds": time.perf_counter() - start}


QWEN7B = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen2.5-7b"
STATE = {"weights", "weights (fp32 master)", "weights (frozen base)", "LoRA weights", "gradients", "LoRA gradients",
         "AdamW states", "LoRA AdamW states"}


def qwen7b_table(device: str = "H100 80GB") -> str:
    """Markdown rows: SFT (micro-batch 4 x 2048 tokens, batch 16) and GRPO (G 8 x 4 prompts, prompt
    512 + completion 1024, micro-batch 4, KL reference, hf engine), full and LoRA r=16."""
    from transformers import AutoConfig

    from rlft.plan.advice import Verdict
    from rlft.plan.memory import GiB, device_capacity

    cfg = AutoConfig.from_pretrained(QWEN7B)
    label, capacity = device_capacity(device)
    sft = dict(method="sft", micro_batch_size=4, batch_size=16, seq_len=2048, completion_len=1024)
    grpo = dict(method="online", micro_batch_size=4, batch_size=32, seq_len=1536, completion_len=1024, reference=True)
    mixed = dict(precision="bf16-mixed", param_dtype="bf16")
    cases = [("SFT full, bf16-mixed", {**sft, **mixed}),
             ("SFT full, pure bf16 + ckpt", {**sft, "gradient_checkpointing": True}),
             ("SFT LoRA r16, bf16", {**sft, "lora": True}),
             ("SFT LoRA r16, bf16 + ckpt", {**sft, "lora": True, "gradient_checkpointing": True}),
             ("GRPO full, bf16-mixed", {**grpo, **mixed}),
             ("GRPO full, pure bf16 + ckpt", {**grpo, "gradient_checkpointing": True}),
             ("GRPO LoRA r16, bf16", {**grpo, "lora": True}),
             ("GRPO LoRA r16, bf16 + ckpt", {**grpo, "lora": True, "gradient_checkpointing": True})]
    lines = [f"| setting | static GiB | peak GiB (phase) | on {label} |", "|---|---|---|---|"]
    for name, fields in cases:
        plan = plan_memory(cfg, PlanInput(**fields))
        state = sum(c.bytes for c in plan.components if c.name in STATE)
        verdict = Verdict(label, capacity, plan.total)
        gap = (verdict.usable - plan.total) / GiB
        lines.append(f"| {name} | {state / GiB:.1f} | {plan.total / GiB:.1f} ({plan.peak_phase}) | "
                     + (f"fits, {gap:.1f} GiB headroom |" if verdict.fits else f"does not fit, {-gap:.1f} GiB short |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--qwen7b", action="store_true", help="print the Qwen2.5-7B plans instead (no runs)")
    args = parser.parse_args(argv)
    if args.qwen7b:
        print(qwen7b_table())
        return
    torch.set_num_threads(1)
    from rlft.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="plan_vs_measured_"))
    try:
        model = build_tiny_model(root / "model", size=args.size)
        write_data(root)
        dims = lengths(model, root)
        mib = 2**20
        print(f"{'case':<15} {'measured MiB':>13} {'planned MiB':>12} {'error':>7}   phases measured / planned (MiB)")
        for name in args.cases.split(","):
            r = run_case(name, model, root, dims)
            planned = dict(r["planned_phases"])
            # the measured 'update' phase spans forward, backward (with recomputation) and the step
            planned["update"] = max(planned.get(p, 0) for p in ("update", "recompute", "optimizer"))
            phases = "  ".join(f"{p} {r['phases'][p] / mib:.0f}/{planned.get(p, 0) / mib:.0f}"
                               for p in ("rollout", "update") if p in r["phases"])
            print(f"{name:<15} {r['measured'] / mib:13.1f} {r['planned'] / mib:12.1f} "
                  f"{r['planned'] / r['measured'] - 1:+7.1%}   {phases}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
