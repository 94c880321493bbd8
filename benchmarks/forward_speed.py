"""Training-forward speed and memory: padded vs packed rows, and the full-logits head vs the
chunked hidden-state head, on one forward + backward of RL completion log-probs.

    python benchmarks/forward_speed.py                       # small (~30M) model, 16 rows of varied length
    python benchmarks/forward_speed.py --model big-vocab     # hidden 512, 4 layers, vocab 151,936
    python benchmarks/forward_speed.py --quick

Variants (same batch, same loss: a weighted sum of log-probs and entropies over valid tokens):
- `full-logits padded`: the model's own forward with `logits_to_keep` (what rlft did before):
  `[B, Tc + 1, V]` logits, float32 log-softmax kept for backward.
- `chunked padded`: decoder forward on the padded batch, chunked head on valid tokens only.
- `chunked packed`: the same with the rows packed padding-free (bins no longer than the widest row).
- `chunked packed-1seq`: all rows in one sequence (the flash-attention layout), for comparison.
`--profile` adds torch.profiler's top operators per variant (where the time goes).
Timing: median of `--repeats` interleaved runs after one warm-up; peak live tensor bytes from
`rlft.monitor.memory.LiveTensorTracker` in a separate run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from rlft.models import forward  # noqa: E402
from rlft.models.forward import completion_logprobs, forward_logits, lm_head  # noqa: E402
from rlft.monitor.memory import LiveTensorTracker  # noqa: E402


def build_model(kind: str, work: Path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    if kind == "big-vocab":
        cfg = Qwen2Config(vocab_size=151_936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
        return AutoModelForCausalLM.from_config(cfg)
    from rlft.models.tiny import build_tiny_model

    folder = work / "models" / kind
    if not (folder / "model.safetensors").is_file():
        build_tiny_model(folder, size=kind, seed=0, overwrite=True)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def make_batch(rows: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int, seed: int = 0):
    """[left-padded prompt | right-padded completion] with lengths drawn uniformly."""
    rng = random.Random(seed)
    lens = [(rng.randint(*prompt), rng.randint(*completion)) for _ in range(rows)]
    p, t = max(a for a, _ in lens), max(b for _, b in lens)
    ids = torch.randint(10, min(vocab, 1000), (rows, p + t), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for i, (a, b) in enumerate(lens):
        mask[i, p - a:p + b] = 1
    ids = ids * mask
    return ids, mask, t, lens


def old_path(model, ids, mask, tc):
    logits = forward_logits(model, ids, mask, keep=tc + 1)[:, :-1]
    logp = F.log_softmax(logits.float(), -1)
    return logp.gather(-1, ids[:, -tc:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def step(model, variant, ids, mask, tc):
    cm = mask[:, -tc:].bool()
    if variant == "full-logits padded":
        lp, ent = old_path(model, ids, mask, tc)
    else:
        lp, ent = completion_logprobs(model, ids, mask, tc, entropy="grad", packing=variant != "chunked padded")
    loss = ((lp + 0.01 * ent) * cm).sum() / cm.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def set_layout(model, variant):
    head = lm_head(model)
    mode = "single" if variant.endswith("1seq") else "multi"
    forward._HEADS[model] = forward.LmHead(head.decoder, head.module, head.softcap, head.scale, mode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", choices=["tiny", "small", "big-vocab"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 64], help="min/max prompt tokens")
    ap.add_argument("--completion", type=int, nargs=2, default=[16, 256], help="min/max completion tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["full-logits padded", "chunked padded", "chunked packed",
                                                      "chunked packed-1seq"])
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table (top ops by self CPU time) per variant")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 rows, 2 repeats")
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.model, args.rows, args.repeats, args.completion = "tiny", 8, 2, [8, 64]
    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.work).train()
    ids, mask, tc, lens = make_batch(args.rows, tuple(args.prompt), tuple(args.completion), model.config.vocab_size)
    real = int(mask.sum())
    print(f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, vocab "
          f"{model.config.vocab_size}), {args.rows} rows, {real} real tokens of {mask.numel()} padded "
          f"({1 - real / mask.numel():.0%} padding), completion width {tc}, threads {args.threads}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    lm_head(model)  # probe once, outside the timings
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    for r in range(args.repeats + 1):
        for v in args.variants:
            if v.startswith("chunked packed"):
                set_layout(model, v)
            t0 = time.perf_counter()
            step(model, v, ids, mask, tc)
            if r:  # the first round is a warm-up
                times[v].append(time.perf_counter() - t0)
    peaks = {}
    if not args.no_memory:
        for v in args.variants:
            if v.startswith("chunked packed"):
                set_layout(model, v)
            with LiveTensorTracker() as tracker:
                step(model, v, ids, mask, tc)
            peaks[v] = tracker.peak_bytes
    if args.profile:
        for v in args.variants:
            if v.startswith("chunked packed"):
                set_layout(model, v)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(model, v, ids, mask, tc)
            print(f"\nprofile: {v}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    base = statistics.median(times[args.variants[0]])
    print(f"\n{'variant':<22} {'s/fwd+bwd':>10} {'vs first':>9} {'tokens/s':>10} {'peak MiB':>9}")
    result = {"model": args.model, "rows": args.rows, "lengths": lens, "real_tokens": real,
              "padded_tokens": mask.numel(), "threads": args.threads, "loadavg_end": os.getloadavg(), "variants": {}}
    for v in args.variants:
        med = statistics.median(times[v])
        peak = peaks.get(v)
        print(f"{v:<22} {med:>10.3f} {base / med:>8.2f}x {real / med:>10.0f} "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9}")
        result["variants"][v] = {"median_s": med, "times": times[v], "peak_bytes": peak}
    print(f"(load average at end {os.getloadavg()[0]:.1f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
