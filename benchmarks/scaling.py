"""rlft's GRPO step time over the group size G and the completion length: is the per-step cost
linear in G x length (completion tokens per step)?

    python benchmarks/scaling.py                     # tiny model, G in {4, 8, 16}, lengths {64, 128, 256}
    python benchmarks/scaling.py --model small --steps 4
    python benchmarks/scaling.py --quick             # G in {4, 8}, lengths {32, 64}, 3 steps

Same work as `grpo_vs_trl.py` (4 prompts per step, the digit-share reward, k3 KL, one optimizer step
per rollout) with G x 4 completions of at most `length` new tokens; rlft only. For each cell: the
median step time over the measured steps, completion tokens per step, tokens/s, and the step time
per completion token. A least-squares line time = a + b x tokens over all cells gives the fixed
cost a, the per-token cost b and R^2; linear scaling means the per-token cost stays flat (up to
the fixed cost's share in the small cells) and R^2 is close to 1. Also run by
`grpo_vs_trl.py --scaling`. Writes `benchmarks/results/scaling.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, build_models, first_measured, rel, run_rlft, summarise, tail  # noqa: E402


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x, with R^2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"fixed_s": a, "s_per_token": b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def run_scaling(model: str, groups: list[int], lengths: list[int], steps: int, args, work: Path) -> dict:
    models = build_models(work, {model}, args.threads)
    first = first_measured(steps)
    cells = []
    for g in groups:
        for length in lengths:
            name = f"scaling-{model}-g{g}-l{length}"
            print(f"[scaling] {model} G={g} length={length}: {steps} steps ...", flush=True)
            wl = {"model": model, "lora": False, "max_new_tokens": length, "group_size": g, "defaults": True}
            res = run_rlft(name, wl, models[model], args, work, steps)
            s = summarise(res, first)
            if not s["ok"]:
                print(f"[scaling] {name} FAILED (exit {res['rc']}), log {res['log']}:\n{tail(res['log'])}", flush=True)
            cells.append({"group_size": g, "max_new_tokens": length, "rows": g * 4, **s,
                          "peak_rss_mb": res["peak_rss_mb"], "log": res["log"]})
    ok = [c for c in cells if c["ok"] and c.get("completion_tokens_per_step")]
    fit = fit_line([c["completion_tokens_per_step"] for c in ok], [c["s_per_step"] for c in ok]) if len(ok) > 1 else None
    return {"model": model, "steps": steps, "measured_from": first, "cells": cells, "fit": fit}


def print_scaling(result: dict) -> None:
    print(f"\nrlft GRPO step time vs G x length ({result['model']} model, 4 prompts per step, median over steps "
          f"{result['measured_from']}-{result['steps']})")
    head = (f"{'G':>3} {'length':>6} {'rows':>5} {'s/step':>8} {'tokens':>7} {'tok/s':>7} {'ms/token':>9} "
            f"{'sample':>7} {'rest':>7} {'fit s':>7} {'RSS MB':>7}")
    print(head)
    print("-" * len(head))
    fit = result.get("fit")
    for c in result["cells"]:
        if not c["ok"]:
            print(f"{c['group_size']:>3} {c['max_new_tokens']:>6} {c['rows']:>5}  FAILED")
            continue
        tok = c["completion_tokens_per_step"]
        pred = fit["fixed_s"] + fit["s_per_token"] * tok if fit else None
        print(f"{c['group_size']:>3} {c['max_new_tokens']:>6} {c['rows']:>5} {c['s_per_step']:>8.3f} {tok:>7.0f} "
              f"{c['tokens_per_s']:>7.0f} {1000 * c['s_per_step'] / tok:>9.3f} "
              f"{c.get('generate_s_per_step', float('nan')):>7.3f} {c.get('rest_s_per_step', float('nan')):>7.3f} "
              f"{pred if pred is not None else float('nan'):>7.3f} {c['peak_rss_mb']:>7.0f}")
    if fit:
        print(f"least squares: step time = {fit['fixed_s']:.3f} s + {1000 * fit['s_per_token']:.3f} ms x completion "
              f"tokens, R^2 = {fit['r2']:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per run before it is stopped")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "scaling.json")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.lengths, args.steps = [4, 8], [32, 64], 3
    load = os.getloadavg()
    started = time.time()
    result = run_scaling(args.model, args.groups, args.lengths, args.steps, args, args.work.resolve())
    result.update({"loadavg_start": load, "loadavg_end": os.getloadavg(), "threads": args.threads,
                   "wall_s": time.time() - started})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_scaling(result)
    print(f"\nwrote {rel(args.out)} (load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
    return 0 if all(c["ok"] for c in result["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
