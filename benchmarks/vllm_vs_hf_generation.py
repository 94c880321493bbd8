"""Rollout throughput: rlft's HF engine vs the vLLM engine, and the vLLM weight-sync cost.

    /work/venv-vllm/bin/python benchmarks/vllm_vs_hf_generation.py            # all cases
    /work/venv-vllm/bin/python benchmarks/vllm_vs_hf_generation.py --cases hf-fp32 vllm-fp32

Work: the ~30M-parameter tiny Qwen2 (`build_tiny_model(size="small")`, random weights, tied
embeddings), 4 chat prompts x G = 8 completions, 128 new tokens, temperature 1.0, no top-k/top-p,
stopping on the checkpoint's end-of-turn/EOS ids, one torch/OpenMP thread, in-process vLLM with
eager execution and a 256 MiB KV cache.

Measured, each case in its own process (a fresh vLLM; timings on a shared machine are noisy):
- tokens/s: completion tokens of `--reps` generate calls / their wall time, after one warm-up
  call (vLLM compiles a small sampler kernel and both engines warm caches on the first call);
- sync s: the median time of `sync_weights()` after the trainer's weights changed in place
  (noise on every trainable tensor): the full state dict for a full fine-tune; the adapter saved
  and loaded as a new LoRA request ('adapter') or the merged weights pushed ('merged') for LoRA;
- noop sync ms: a repeated `sync_weights()` with no change in between (must be near zero).

Prints a table; `--json PATH` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    # name: (engine, dtype, lora, lora_sync)
    "hf-fp32": ("hf", "fp32", False, None),
    "vllm-fp32": ("vllm", "fp32", False, None),
    "vllm-bf16": ("vllm", "bf16", False, None),
    "hf-lora-fp32": ("hf", "fp32", True, None),
    "vllm-lora-adapter-fp32": ("vllm", "fp32", True, "adapter"),
    "vllm-lora-merged-fp32": ("vllm", "fp32", True, "merged"),
}
QUESTIONS = ["What is 12 + 30?", "What is 7 + 58?", "Say hello in one word.", "Name a colour and explain it."]


def run_case(name: str, model_dir: str, reps: int, syncs: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.rollout.contract import SamplingParams
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    engine_kind, dtype, lora, lora_sync = CASES[name]
    policy = load_policy(ModelConfig(path=model_dir, device="cpu"), LoraConfig(enabled=lora))
    stop_ids = generation_stop_ids(policy.model, policy.tokenizer)
    prompts = [list(policy.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"])
               for q in QUESTIONS]
    start = time.perf_counter()
    if engine_kind == "hf":
        engine = HFEngine(policy.model, policy.tokenizer, stop_ids, policy.device, seed=0)
    else:
        from rlft.rollout.vllm_engine import VLLMEngine, VllmSettings

        settings = VllmSettings(dtype=dtype, kv_cache_bytes=256 << 20, lora_sync=lora_sync or "adapter")
        engine = VLLMEngine(policy, stop_ids, seed=0, settings=settings)
        torch.set_num_threads(1)
    build_s = time.perf_counter() - start

    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=128)
    engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=16))  # warm-up
    tokens, elapsed = 0, 0.0
    for _ in range(reps):
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        elapsed += time.perf_counter() - start
        tokens += sum(len(c.completion_ids) for c in completions)
    row = {"case": name, "build_s": round(build_s, 2), "tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1)}

    if engine_kind == "vllm":
        trainable = [p for p in policy.model.parameters() if p.requires_grad]
        times = []
        for i in range(syncs):
            with torch.no_grad():
                for p in trainable:
                    p.add_(torch.randn_like(p) * 1e-3)
            start = time.perf_counter()
            engine.sync_weights()
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.sync_weights()
        row.update(sync_s=round(statistics.median(times), 3), noop_sync_ms=round((time.perf_counter() - start) * 1e3, 3))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=2, help="timed generate calls per case")
    parser.add_argument("--syncs", type=int, default=3, help="timed weight syncs per vLLM case")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.model, args.reps, args.syncs)), flush=True)
        return

    from rlft.models.tiny import build_tiny_model, count_parameters

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "small", size="small"))
        from transformers import AutoModelForCausalLM

        n_params = count_parameters(AutoModelForCausalLM.from_pretrained(model_dir))
        rows = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for case in args.cases:
            cmd = [sys.executable, __file__, "--case", case, "--model", model_dir, "--reps", str(args.reps),
                   "--syncs", str(args.syncs)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{case}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(f"done: {case}", file=sys.stderr, flush=True)

    print(f"\nmodel: tiny Qwen2 size=small, {n_params / 1e6:.1f}M parameters; 4 prompts x G=8, 128 new tokens, "
          f"T=1.0, 1 thread, {args.reps} timed calls\n")
    header = f"{'case':<26}{'tokens/s':>10}{'tokens':>8}{'build s':>9}{'sync s':>9}{'noop sync ms':>14}"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['case']:<26}{r['tokens_per_s']:>10}{r['tokens']:>8}{r['build_s']:>9}"
              f"{r.get('sync_s', '-'):>9}{r.get('noop_sync_ms', '-'):>14}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
