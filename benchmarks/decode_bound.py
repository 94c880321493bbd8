"""Where the hf engine's decode time goes on CPU, against two bounds: the machine's memory
bandwidth (every decode step reads all the weights) and the same matmuls without rlft around them.

    OMP_NUM_THREADS=1 python benchmarks/decode_bound.py [--size small] [--rows 32] [--tokens 128]

Measures, in one process on `--threads` threads (fp32):
- `read GB/s`: summing a 400 MB tensor (what streaming weights from DRAM can reach);
- `bare matmuls`: one decode step's projections (q|k|v, o, gate|up, down of every layer, and the
  head) for `--rows` rows as plain `F.linear` calls on the model's own weights, in the model's
  layout and as [in, out] copies (`x @ w`), timed over repeated steps (weights not cache-resident
  for the ~28M model: 109 MB);
- `engine`: `HFEngine.generate` of rows x tokens (4 prompts, G = rows / 4), tokens/s and ms/step,
  with torch.profiler's split of its time (matmuls, attention's bmm, the rest).
The engine's matmul ms/step next to the bare matmuls' says what rlft adds around them; the bare
matmuls' GB/s next to `read GB/s` says how far the BLAS kernel is from the bandwidth bound.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from rlft.config import LoraConfig, ModelConfig  # noqa: E402
from rlft.models.loading import load_policy  # noqa: E402
from rlft.models.template import encode_prompt, end_of_turn_ids  # noqa: E402
from rlft.models.tiny import build_tiny_model  # noqa: E402
from rlft.rollout.contract import SamplingParams  # noqa: E402
from rlft.rollout.hf import HFEngine  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), fp32, "
          f"model size {args.size}, {args.rows} rows")

    big = torch.randn(100_000_000)
    read = big.numel() * 4 / timed(big.sum, 5) / 1e9
    del big
    print(f"read bandwidth: {read:.1f} GB/s")

    folder = Path(tempfile.mkdtemp(prefix="rlft-decode-bound-")) / "model"
    build_tiny_model(folder, size=args.size, seed=0)
    policy = load_policy(ModelConfig(path=str(folder), dtype="fp32"), LoraConfig())
    model = policy.model
    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), a.o_proj.weight.detach(),
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), m.down_proj.weight.detach()]
    weights.append(model.lm_head.weight.detach())
    inputs = {w.shape[1]: torch.randn(args.rows, w.shape[1]) for w in weights}
    nbytes = sum(w.numel() for w in weights) * 4
    flops = 2 * args.rows * sum(w.numel() for w in weights)
    copies = [w.t().contiguous() for w in weights]
    for name, step in (("model layout, F.linear", lambda: [F.linear(inputs[w.shape[1]], w) for w in weights]),
                       ("[in, out] copies, x @ w", lambda: [inputs[w.shape[0]] @ w for w in copies])):
        dt = timed(step, 20)
        print(f"bare matmuls ({name}): {dt * 1e3:.1f} ms/step over {nbytes / 1e6:.0f} MB of weights = "
              f"{nbytes / dt / 1e9:.1f} GB/s, {flops / dt / 1e9:.0f} GFLOP/s")

    tok = policy.tokenizer
    prompts = [encode_prompt(tok, [{"role": "user", "content": f"Count from {i} to {i + 40}, one number a line."}])
               for i in range(4)]
    params = SamplingParams(n=args.rows // 4, temperature=1.0, max_new_tokens=args.tokens)
    engine = HFEngine(model, tok, end_of_turn_ids(tok), policy.device, seed=0)
    engine.generate(prompts, params)  # warm-up
    from torch.profiler import profile

    start = time.perf_counter()
    with profile() as prof:
        out = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(c.completion_ids) for c in out)
    steps = max(len(c.completion_ids) for c in out)
    by_op = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    total = sum(by_op.values())
    mm = sum(by_op.get(k, 0.0) for k in ("aten::mm", "aten::addmm"))
    bmm = by_op.get("aten::bmm", 0.0)
    print(f"engine: {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tokens/s, {steps} decode steps, "
          f"{wall / steps * 1e3:.1f} ms/step; profiled); time split: matmuls {mm / total:.0%} "
          f"({mm / steps * 1e3:.1f} ms/step), attention bmm {bmm / total:.0%}, the rest {1 - (mm + bmm) / total:.0%}")


if __name__ == "__main__":
    main()
