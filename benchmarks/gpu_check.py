"""GPU check: every training method end to end on CUDA at bf16-mixed (what `precision: auto`
picks on a bf16 GPU), with step times and peak memory.

    python benchmarks/gpu_check.py OUT_DIR [--size small]

Runs SFT, GRPO (full, LoRA, vLLM engine), DAPO (LoRA + checkpointing), RLOO, REINFORCE++, PPO
(separate critic and shared value head), asynchronous GRPO (k = 1: hf full and LoRA, vLLM, and the
sampler on a second GPU where there is one), DPO and reward-model training for a few steps each on the
~27M-parameter test model, times rlft's rollout engine against `model.generate` on the same batch,
then runs the test suite's CUDA-only tests (`pytest -m cuda`: QLoRA with bitsandbytes, fp16-mixed's
loss scaler, bf16-mixed, NCCL on 2+ GPUs, vLLM sleep mode, the planner against
torch.cuda.max_memory_allocated). Writes OUT_DIR/gpu_check.json and OUT_DIR/pytest-cuda.txt.
Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def stage(results: dict, name: str, fn) -> None:
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        info = fn() or {}
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2),
                         "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1), **info}
    except Exception:
        results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    print(name, json.dumps(results[name])[:400], flush=True)


def step_times(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["time/step"] for r in rows if "time/step" in r) or \
        sorted(r["step_time"] for r in rows if "step_time" in r)
    last = rows[-1]
    keep = {k: last[k] for k in ("reward/mean", "loss", "kl", "eval/accuracy", "eval/rewards/accuracy") if k in last}
    return {"median_step_s": times[len(times) // 2] if times else None, "steps": len(times), **keep}


def main() -> None:
    out = Path(sys.argv[1])
    size = sys.argv[sys.argv.index("--size") + 1] if "--size" in sys.argv else "small"
    out.mkdir(parents=True, exist_ok=True)
    from rlft.api import train
    from rlft.models.tiny import build_tiny_model

    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "size": size}
    work = Path("/tmp/rlft-gpu")
    model = build_tiny_model(work / "model", size=size, seed=0, overwrite=True)
    data = REPO / "examples" / "data"
    fmt = r"\d\+\d=\d+, carry [01]\. \d\+\d\+[01]=\d+\. The answer is \d+\."
    common = {"seed": 0, "logging": {"progress": False}, "model": {"path": str(model), "device": "cuda"}}
    mixed = {"precision": "bf16-mixed"}
    rl_rewards = [{"fn": "regex", "name": "format", "args": {"pattern": fmt, "mode": "fullmatch"}}]

    def sft():
        cfg = {**common, "method": "sft", "output_dir": str(work / "sft"),
               "data": {"train": str(data / "arith_sft.jsonl")},
               "training": {**mixed, "learning_rate": 1e-3, "batch_size": 64, "max_steps": 60}}
        train(cfg)
        return step_times(work / "sft")

    def online(name, method, **extra):
        cfg = {**common, "method": method, "output_dir": str(work / name),
               "model": {**common["model"], "path": str(work / "sft" / "final")},
               "data": {"train": str(data / "arith_rl_prompts.jsonl")}, "rewards": rl_rewards,
               "training": {**mixed, "learning_rate": 1e-5, "max_steps": 6},
               "rollout": {"group_size": 8, "prompts_per_step": 16, "max_new_tokens": 48}}
        for key, value in extra.items():
            cfg[key] = {**cfg.get(key, {}), **value}
        train(cfg)
        return step_times(work / name)

    def preference(name, method):
        cfg = {**common, "method": method, "output_dir": str(work / name),
               "model": {**common["model"], "path": str(work / "sft" / "final")},
               "data": {"train": str(data / "arith_pref_train.jsonl"), "eval": str(data / "arith_pref_heldout.jsonl")},
               "training": {**mixed, "learning_rate": 1e-4, "batch_size": 32, "max_steps": 10}}
        train(cfg)
        return step_times(work / name)

    def generation():
        from rlft.config import LoraConfig, ModelConfig
        from rlft.models.loading import load_policy
        from rlft.models.template import encode_prompt, end_of_turn_ids
        from rlft.rollout.contract import SamplingParams
        from rlft.rollout.hf import HFEngine

        policy = load_policy(ModelConfig(path=str(work / "sft" / "final"), dtype="bf16", device="cuda"), LoraConfig())  # sampling only
        prompts = [encode_prompt(policy.tokenizer, [{"role": "user", "content": f"What is {10 + i} + {30 + i}?"}])
                   for i in range(16)]
        engine = HFEngine(policy.model, policy.tokenizer, end_of_turn_ids(policy.tokenizer), policy.device)
        params = SamplingParams(n=8, max_new_tokens=64)
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        rlft_s = time.perf_counter() - t
        tokens = sum(len(o.completion_ids) for o in outs)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), policy.tokenizer.pad_token_id, device="cuda")
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(do_sample=True, num_return_sequences=8, max_new_tokens=64, temperature=1.0, top_k=0,
                      eos_token_id=end_of_turn_ids(policy.tokenizer), pad_token_id=policy.tokenizer.pad_token_id)
        policy.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen = policy.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t
        hf_tokens = int((gen[:, width:] != policy.tokenizer.pad_token_id).sum())
        return {"rlft_tokens_per_s": round(tokens / rlft_s), "hf_generate_tokens_per_s": round(hf_tokens / hf_s)}

    stage(results, "sft", sft)
    stage(results, "grpo_full", lambda: online("grpo_full", "grpo"))
    stage(results, "grpo_lora", lambda: online("grpo_lora", "grpo", lora={"enabled": True, "r": 16, "alpha": 32}))
    stage(results, "dapo_lora_ckpt", lambda: online("dapo", "dapo", lora={"enabled": True},
                                                   model={"gradient_checkpointing": True}))
    stage(results, "grpo_vllm", lambda: online("grpo_vllm", "grpo", rollout={"engine": "vllm"}))
    # issue 26: a sampler thread one step ahead (hf, vLLM), and on a GPU of its own where there are two
    correct = {"rollout_correction": "tis"}
    stage(results, "grpo_async_k1", lambda: online("grpo_async", "grpo", rollout={"async_steps": 1}, algorithm=correct))
    stage(results, "grpo_async_k1_lora", lambda: online("grpo_async_lora", "grpo", rollout={"async_steps": 1},
                                                        algorithm=correct, lora={"enabled": True}))
    stage(results, "grpo_vllm_async_k1", lambda: online("grpo_vllm_async", "grpo", algorithm=correct,
                                                        rollout={"engine": "vllm", "async_steps": 1}))
    if torch.cuda.device_count() > 1:
        stage(results, "grpo_async_sampler_gpu1", lambda: online(
            "grpo_async_gpu1", "grpo", algorithm=correct,
            rollout={"async_steps": 1, "sampler_device": "cuda:1"}, model={"device": "cuda:0"}))
    else:
        results["grpo_async_sampler_gpu1"] = {"ok": True, "skipped": "one GPU: rollout.sampler_device needs a second"}
    stage(results, "rloo", lambda: online("rloo", "rloo"))
    stage(results, "reinforce_pp", lambda: online("reinforce_pp", "reinforce_pp"))
    stage(results, "ppo_separate", lambda: online("ppo", "ppo", critic={"warmup_steps": 1}))
    stage(results, "ppo_shared", lambda: online("ppo_shared", "ppo", critic={"kind": "shared", "warmup_steps": 1}))
    stage(results, "dpo", lambda: preference("dpo", "dpo"))
    stage(results, "reward_model", lambda: preference("rm", "reward_model"))
    stage(results, "generation", generation)
    stage(results, "pytest_cuda", lambda: cuda_tests(out))
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print("ALL OK" if all(v.get("ok", True) for v in results.values() if isinstance(v, dict)) else "FAILURES")


def cuda_tests(out: Path) -> dict:
    """tests/ marked `cuda` (skipped on machines without a GPU), in a fresh process; raises when
    one fails, so the stage records the failure."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=3600)
    (out / "pytest-cuda.txt").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m cuda: {summary}\n{done.stdout[-2500:]}")
    return {"summary": summary}


if __name__ == "__main__":
    main()
