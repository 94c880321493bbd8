"""Each prompt once per group, measured: plain vs shared prefix on a long-prompt workload.

    PYTHONPATH=src python benchmarks/shared_prefix.py [--prompt-len 512] [--new-tokens 128] [--group 8]
        [--prompts 2] [--repeats 2] [--threads 2] [--modes off auto]

Times, each in a fresh child process (so each gets its own peak RSS), alternating the order of
the modes between repeats (a loaded machine drifts; both sides see the same drift):
- `update`: the reference's log-probs (no gradient) and one GRPO update of the ~30M-parameter
  `small` model (fp32, policy forward + backward with the k3 KL term, AdamW step; micro-batches
  of one group), `training.shared_prefix` off vs auto;
- `sample`: the HF engine sampling `--new-tokens` tokens for G rows per prompt, one prefill per
  row vs one per prompt; whether both sampled the same completions is checked.
Rows: `--prompts` prompts of about `--prompt-len` tokens (lengths differ by a few tokens), G
completions each of 3/4 to all of `--new-tokens` tokens (fixed random tokens for `update`, so
both modes train on the same rows). Writes benchmarks/results/shared_prefix.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import run_child  # noqa: E402


def rows(args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prompts and, per prompt, G completions of token ids (seeded: the same in every child)."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for i in range(args.prompts):
        prompts.append(torch.randint(10, 1000, (args.prompt_len - 4 * i,), generator=g).tolist())
        lengths = torch.randint(args.new_tokens * 3 // 4, args.new_tokens + 1, (args.group,), generator=g)
        completions.append([torch.randint(10, 1000, (int(n),), generator=g).tolist() for n in lengths])
    return prompts, completions


def child_update(args, model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlft.rollout.batch import RolloutBatch
    from rlft.rollout.contract import Completion
    from rlft.training.online.update import UpdateSettings, batch_logprobs, policy_update

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, completions = rows(args)
    outs, groups = [], []
    for i, (p, comps) in enumerate(zip(prompts, completions)):
        for c in comps:
            outs.append(Completion(p, c, "", [-2.0] * len(c), "stop", i))
            groups.append(i)
    batch = RolloutBatch.from_completions(outs, groups, 0, torch.device("cpu"))
    advantages = torch.linspace(-1.0, 1.0, batch.size)[:, None].expand_as(batch.completion_mask).clone()
    s = UpdateSettings(temperature=1.0, advantage="group_norm", std_floor=1e-4, gamma=1.0, lam=1.0,
                       kl_in_reward=False, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_estimator="k3",
                       kl_in_loss=True, entropy_coef=0.0, loss_agg="token_mean", loss_constant=None, epochs=1,
                       minibatches=1, micro_batch_size=args.group, mask_truncated=False, packing=True,
                       shared_prefix=args.mode)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)

    class Trainer:
        def __init__(self):
            self.policy = type("P", (), {"model": policy})()

        def autocast(self):
            import contextlib

            return contextlib.nullcontext()

        def backward(self, loss):
            loss.backward()

        def optimizer_step(self, loss_value):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return True, 0.0

    warm = batch.select(torch.arange(2))  # first-use probes and one-time set-up, outside the timings
    for model in (reference, policy):
        batch_logprobs(model, warm, 1.0, None, packing=True, shared_prefix=args.mode)
    start = time.perf_counter()
    ref = batch_logprobs(reference, batch, 1.0, args.group, packing=True, shared_prefix=args.mode)
    reference_s = time.perf_counter() - start
    start = time.perf_counter()
    metrics = policy_update(Trainer(), batch, advantages, ref, 0.04, s, torch.Generator())
    update_s = time.perf_counter() - start
    return {"reference_s": reference_s, "update_s": update_s, "loss": metrics["loss"],
            "ref_logprob_sum": float(ref.sum()), "rows": batch.size, "tokens": int(batch.attention_mask.sum())}


def child_sample(args, model_dir: Path) -> dict:
    import torch

    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_policy
    from rlft.rollout.contract import SamplingParams
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    policy = load_policy(ModelConfig(path=str(model_dir), dtype="fp32"), LoraConfig())
    engine = HFEngine(policy.model, policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer),
                      torch.device("cpu"), seed=0, share_prefill=args.mode != "off")
    prompts, _ = rows(args)
    engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=2))  # one-time set-up, outside the timing
    start = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens))
    sample_s = time.perf_counter() - start
    digest = hashlib.sha256(json.dumps([c.completion_ids for c in out]).encode()).hexdigest()[:16]
    return {"sample_s": sample_s, "completions_sha": digest, "new_tokens": sum(len(c.completion_ids) for c in out),
            "logprobs": [c.logprobs for c in out]}


def run(args, what: str, mode: str, work: Path) -> dict:
    out = work / f"{what}-{mode}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what, "--mode", mode, "--out", str(out),
           "--work", str(work), *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                                  ("prompt_len", "new_tokens", "group", "prompts", "threads"))]
    res = run_child(cmd, work / "logs" / f"{what}-{mode}.log", args.threads)
    if res["rc"] != 0:
        raise SystemExit(f"{what} {mode} failed: see {res['log']}")
    return {**json.loads(out.read_text()), "peak_rss_mb": res["peak_rss_mb"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["off", "auto"],
                    help="training.shared_prefix values, the first one the baseline (sample: off = a prefill per row)")
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "shared_prefix.json")
    ap.add_argument("--what", nargs="+", default=["update", "sample"], choices=["update", "sample"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlft-bench-shared-prefix"))
    ap.add_argument("--child", choices=["update", "sample"])
    ap.add_argument("--mode", default="off")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model_dir = args.work / "small"
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = (child_update if args.child == "update" else child_sample)(args, model_dir)
        args.out.write_text(json.dumps(result))
        return 0
    if not (model_dir / "model.safetensors").is_file():
        from rlft.models.tiny import build_tiny_model

        build_tiny_model(model_dir, size="small", seed=0)
    load = [os.getloadavg()]
    results: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in args.modes} for w in args.what}
    for r in range(args.repeats):
        for what in args.what:
            for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                results[what][mode].append(run(args, what, mode, args.work))
                print(f"repeat {r + 1} {what} {mode}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in results[what][mode][-1].items()
                                  if k.endswith("_s") or k == "peak_rss_mb"), flush=True)
    load.append(os.getloadavg())
    report(args, results, load)
    return 0


def report(args, results: dict, load: list) -> None:
    base, others = args.modes[0], args.modes[1:]
    table = []
    for what, keys in (("update", ("reference_s", "update_s")), ("sample", ("sample_s",))):
        for key in keys if what in results else ():
            runs = results[what]
            row = {"what": key[:-2]}
            for m in args.modes:
                row[f"{m}_s"] = statistics.median(x[key] for x in runs[m])
                row[f"{m}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs[m])
            for m in others:
                row[f"{m}_speedup"] = row[f"{base}_s"] / row[f"{m}_s"]
            table.append(row)
    checks = {}
    if "sample" in results:
        shas = {m: {x["completions_sha"] for x in results["sample"][m]} for m in args.modes}
        checks["same_completions"] = all(shas[m] == shas[base] for m in args.modes) and len(shas[base]) == 1
        lp = {m: results["sample"][m][0]["logprobs"] for m in args.modes}
        checks["logprob_max_diff"] = max((abs(x - y) for m in others for ra, rb in zip(lp[base], lp[m])
                                          for x, y in zip(ra, rb)), default=0.0)
    if "update" in results:
        loss = {m: results["update"][m][0]["loss"] for m in args.modes}
        checks["loss_max_diff"] = max(abs(loss[m] - loss[base]) for m in args.modes)
    print(f"\nprompts {args.prompts} x G {args.group}, prompt ~{args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{args.threads} threads, medians of {args.repeats}; load average {load[0][0]:.1f} -> {load[1][0]:.1f}")
    print(f"{'':10}" + "".join(f"{m + ' s':>10}" for m in args.modes) + "".join(f"{m + ' x':>9}" for m in others)
          + "".join(f"{'RSS MB ' + m:>13}" for m in args.modes))
    for row in table:
        print(f"{row['what']:10}" + "".join(f"{row[m + '_s']:10.2f}" for m in args.modes)
              + "".join(f"{row[m + '_speedup']:8.2f}x" for m in others)
              + "".join(f"{row[m + '_peak_rss_mb']:13.0f}" for m in args.modes))
    print(json.dumps(checks))
    for runs in results.values():
        for xs in runs.values():
            for x in xs:
                x.pop("logprobs", None)
    args.results.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "load_average": load,
                                        "table": table, "checks": checks, "runs": results}, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    sys.exit(main())
