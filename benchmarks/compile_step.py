"""`training.compile` off vs on, measured on whole GRPO runs (issue 27).

    PYTHONPATH=src python benchmarks/compile_step.py [--workloads long-prompt large-full] [--steps 20]
        [--repeats 1] [--threads 2] [--warm]

Each run is `rlft train` in a child process (its own peak RSS), float32, the ~28M-parameter
`small` model, the defaults otherwise (packing on, shared_prefix auto); off and on alternate, and
the order flips from one workload (and repeat) to the next, so a drifting machine load hits both.
- long-prompt: 2 prompts of ~512 tokens per step, G = 8, 128 new tokens (the workload of
  shared_prefix.py, as a real run);
- large-full: grpo_vs_trl.py's workload: 4 prompts x G = 8, 128 new tokens (prompts.jsonl).
Every "on" run starts with an empty TorchInductor cache (a first run on a machine: the compile
cost a user pays); `--warm` adds an "on" run that reuses that cache (a second run of the same model).

Reported per run, from metrics.jsonl: step 1 (where the compiles happen), s/step (median of the
steps after warm-up), the update phase (`time/train`: reference log-probs, policy forward/backward,
optimizer step) and sampling (`time/generate`), the cumulative wall time at step 20 (the sum of
`time/step`; extrapolated with the steady s/step when fewer steps ran, and flagged), and the peak
RSS. Compile time = on's step 1 minus off's step 1. The 1-minute load average is recorded around
every run (other jobs share this machine). Writes benchmarks/results/compile_step.json.

`--interleaved N`: whole runs on a shared machine move by 2x from step to step, so the update is
also timed in one child process per workload, eager and compiled alternating N times on the same
rows (fixed random tokens, shapes as in the workload): the reference's log-probs plus one GRPO
update (`policy_update`: forward, backward, AdamW step). Both see the same load; the first compiled
round holds the compiles (reported as such).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, build_models, rel, run_rlft, tail  # noqa: E402

HORIZON = 20  # the issue's "typical run's first 20 steps"
WORKLOADS = {
    "long-prompt": {"model": "small", "lora": False, "max_new_tokens": 128, "prompts_per_step": 2,
                    "prompt_tokens": 512},
    "large-full": {"model": "small", "lora": False, "max_new_tokens": 128},
}


def long_prompts(path: Path, tokenizer_dir: Path, target: int, n: int = 16) -> Path:
    """`n` prompts of about `target` tokens (a question behind a long run of numbers), each different."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for i in range(n):
        words, k = [], i
        while len(tok(" ".join(words))["input_ids"]) < target - 16:
            words.extend(str((k * 7919 + j * 104729) % 1000) for j in range(16))
            k += 1
        rows.append({"prompt": "Add up: " + " ".join(words) + f". What is the sum {i}?", "answer": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def child_interleaved(name: str, model_dir: Path, rounds: int, out: Path) -> None:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    import shared_prefix  # its rows(): fixed random tokens, prompts differing by a few tokens
    from rlft.models.compiled import compiled_forwards
    from rlft.rollout.batch import RolloutBatch
    from rlft.rollout.contract import Completion
    from rlft.training.online.update import UpdateSettings, batch_logprobs, policy_update

    wl = WORKLOADS[name]
    shape = argparse.Namespace(prompts=wl.get("prompts_per_step", 4), prompt_len=wl.get("prompt_tokens", 16),
                               new_tokens=wl["max_new_tokens"], group=8)
    prompts, completions = shared_prefix.rows(shape)  # ids < 1000: the small model's vocabulary is 1024
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    outs, groups = [], []
    for i, (p, comps) in enumerate(zip(prompts, completions)):
        for c in comps:
            outs.append(Completion([t % vocab for t in p], [t % vocab for t in c], "", [-2.0] * len(c), "stop", i))
            groups.append(i)
    batch = RolloutBatch.from_completions(outs, groups, 0, torch.device("cpu"))
    advantages = torch.linspace(-1.0, 1.0, batch.size)[:, None].expand_as(batch.completion_mask).clone()
    s = UpdateSettings(temperature=1.0, advantage="group_norm", std_floor=1e-4, gamma=1.0, lam=1.0,
                       kl_in_reward=False, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_estimator="k3",
                       kl_in_loss=True, entropy_coef=0.0, loss_agg="token_mean", loss_constant=None, epochs=1,
                       minibatches=1, micro_batch_size=None, mask_truncated=False, packing=True,
                       shared_prefix="auto")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # lr 0: every round trains the same weights

    class Trainer:
        policy = argparse.Namespace(model=None)
        compiled = False

        def autocast(self):
            return compiled_forwards(self.compiled)

        def backward(self, loss):
            loss.backward()

        def optimizer_step(self, loss_value):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return True, 0.0

    trainer = Trainer()
    trainer.policy.model = policy
    warm = batch.select(torch.arange(2))  # first-use probes outside the timings
    for model in (reference, policy):
        batch_logprobs(model, warm, 1.0, None, packing=True, shared_prefix="auto")
    times: dict[str, list[float]] = {"off": [], "on": []}
    losses: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds + 1):  # round 0 of "on" compiles
        for mode in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
            trainer.compiled = mode == "on"
            start = time.perf_counter()
            with trainer.autocast():
                ref = batch_logprobs(reference, batch, 1.0, None, packing=True, shared_prefix="auto")
            metrics = policy_update(trainer, batch, advantages, ref, 0.04, s, torch.Generator())
            times[mode].append(time.perf_counter() - start)
            losses[mode].append(metrics["loss"])
            print(f"round {r} {mode}: {times[mode][-1]:.2f} s", flush=True)
    with contextlib.suppress(Exception):
        times["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out.write_text(json.dumps({"times": times, "losses": losses, "rows": batch.size,
                               "tokens": int(batch.attention_mask.sum())}))


def interleaved(name: str, model_dir: Path, args, work: Path) -> dict:
    from harness import run_child

    out = work / f"interleaved-{name}.json"
    cache = args.inductor_cache or Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    load_before = os.getloadavg()
    res = run_child([sys.executable, str(Path(__file__).resolve()), "--child-interleaved", name, "--rounds",
                     str(args.interleaved), "--out", str(out), "--work", str(work), "--threads", str(args.threads)],
                    work / "logs" / f"interleaved-{name}.log", args.threads)
    if res["rc"] != 0:
        return {"ok": False, "log": res["log"]}
    data = json.loads(out.read_text())
    off, on = data["times"]["off"], data["times"]["on"]
    row = {"ok": True, "workload": name, "rows": data["rows"], "tokens": data["tokens"],
           "off_update_s": statistics.median(off[1:]), "on_update_s": statistics.median(on[1:]),
           "first_on_s": on[0], "first_off_s": off[0], "compile_s": on[0] - statistics.median(off[1:]),
           "loss_max_diff": max(abs(a - b) for a, b in zip(data["losses"]["off"], data["losses"]["on"])),
           "load_average": [load_before, os.getloadavg()], "peak_rss_mb": res["peak_rss_mb"], "times": data["times"]}
    row["update_speedup"] = row["off_update_s"] / row["on_update_s"]
    saved = row["off_update_s"] - row["on_update_s"]
    row["break_even_steps"] = row["compile_s"] / saved if saved > 0 else None
    if args.warm:  # the same child again on the now-filled inductor cache: a second run of this model
        warm = run_child([sys.executable, str(Path(__file__).resolve()), "--child-interleaved", name, "--rounds", "1",
                          "--out", str(out), "--work", str(work), "--threads", str(args.threads)],
                         work / "logs" / f"interleaved-{name}-warm.log", args.threads)
        if warm["rc"] == 0:
            times = json.loads(out.read_text())["times"]
            row["warm_first_on_s"] = times["on"][0]
            row["warm_compile_s"] = times["on"][0] - statistics.median(times["off"][1:] or times["off"])
            row["warm_times"] = times
            print(f"[{name}] warm cache: first compiled round {times['on'][0]:.1f} s", flush=True)
    print(f"[{name}] interleaved update: off {row['off_update_s']:.2f} s, on {row['on_update_s']:.2f} s "
          f"({row['update_speedup']:.2f}x), first compiled round {on[0]:.1f} s (compile ~{row['compile_s']:.0f} s), "
          f"break-even {row['break_even_steps'] if row['break_even_steps'] is None else round(row['break_even_steps'])}"
          f" steps, load {load_before[0]:.1f}", flush=True)
    return row


def one_run(name: str, mode: str, wl: dict, model_dir: Path, args, work: Path, cache: Path) -> dict:
    settings = [f"training.compile={'true' if mode != 'off' else 'false'}"]
    if wl.get("prompt_tokens"):
        settings += [f"data.train={rel(work / 'long_prompts.jsonl')}", "data.max_prompt_length=640",
                     f"rollout.prompts_per_step={wl['prompts_per_step']}"]
    run_args = argparse.Namespace(threads=args.threads, time_limit=args.time_limit, rlft_set=settings)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # the child's inductor cache (empty: a cold compile)
    os.environ["TORCH_LOGS"] = "recompiles"  # counted in the log: lengths must not recompile
    load_before = os.getloadavg()
    res = run_rlft(f"{name}-{mode}", wl, model_dir, run_args, work, args.steps)
    res["load_average"] = [load_before, os.getloadavg()]
    res["recompiles"] = Path(res["log"] if Path(res["log"]).is_absolute() else HERE.parent / res["log"]) \
        .read_text(errors="replace").count("Recompiling function")
    return res


def summarise(res: dict, steps: int) -> dict:
    rows = res.get("steps") or []
    if res["rc"] != 0 or not rows:
        return {"ok": False, "rc": res["rc"], "steps_done": len(rows), "log": res["log"]}
    times = [r["time"] for r in rows]
    later = times[2:] or times[1:] or times  # steps 3.. : past the compiles and first-use probes
    s_per_step = statistics.median(later)
    cumulative = sum(times[:HORIZON]) + max(HORIZON - len(times), 0) * s_per_step
    train = [r["time_train"] for r in rows[2:] or rows if r.get("time_train") is not None]
    gen = [r["time_generate"] for r in rows[2:] or rows if r.get("time_generate") is not None]
    return {"ok": True, "steps_done": len(rows), "step1_s": times[0], "step2_s": times[1] if len(times) > 1 else None,
            "s_per_step": s_per_step, "update_s_per_step": statistics.median(train) if train else None,
            "update_step1_s": rows[0].get("time_train"),
            "generate_s_per_step": statistics.median(gen) if gen else None,
            f"wall_at_step_{HORIZON}_s": cumulative, "wall_extrapolated": len(times) < HORIZON,
            "peak_rss_mb": res["peak_rss_mb"], "process_wall_s": res["wall_s"], "recompiles": res["recompiles"],
            "load_average": res["load_average"], "step_times": times,
            "train_times": [r.get("time_train") for r in rows], "rewards": [r.get("reward_mean") for r in rows],
            "kl": [r.get("kl") for r in rows], "log": res["log"], "config": res.get("config")}


def compare(name: str, runs: dict) -> dict:
    off, on = runs["off"], runs["on"]
    row = {"workload": name}
    if not (off["ok"] and on["ok"]):
        return {**row, "ok": False}
    compile_s = on["step1_s"] - off["step1_s"]
    saved = off["s_per_step"] - on["s_per_step"]
    row.update({"ok": True, "compile_s": compile_s, "off_s_per_step": off["s_per_step"], "on_s_per_step": on["s_per_step"],
                "off_update_s": off["update_s_per_step"], "on_update_s": on["update_s_per_step"],
                "update_speedup": off["update_s_per_step"] / on["update_s_per_step"],
                f"off_wall_{HORIZON}_s": off[f"wall_at_step_{HORIZON}_s"],
                f"on_wall_{HORIZON}_s": on[f"wall_at_step_{HORIZON}_s"],
                "off_rss_mb": off["peak_rss_mb"], "on_rss_mb": on["peak_rss_mb"],
                "break_even_steps": compile_s / saved if saved > 0 else None,
                "pays_within_20": on[f"wall_at_step_{HORIZON}_s"] < off[f"wall_at_step_{HORIZON}_s"],
                "extrapolated": off["wall_extrapolated"] or on["wall_extrapolated"],
                "on_recompiles": on["recompiles"]})
    if "on-warm" in runs and runs["on-warm"]["ok"]:
        warm = runs["on-warm"]
        row.update({"warm_compile_s": warm["step1_s"] - off["step1_s"], "warm_s_per_step": warm["s_per_step"],
                    f"warm_wall_{HORIZON}_s": warm[f"wall_at_step_{HORIZON}_s"]})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=HORIZON)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="also an 'on' run reusing the first one's inductor cache")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per run")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlft-bench-compile"))
    ap.add_argument("--results", type=Path, default=HERE / "results" / "compile_step.json")
    ap.add_argument("--interleaved", type=int, default=0, help="rounds of the in-process eager/compiled update timing")
    ap.add_argument("--inductor-cache", type=Path, help="interleaved: this TorchInductor cache (default: a new, "
                    "empty one; pass a filled one to time more rounds without the cold compile)")
    ap.add_argument("--no-runs", action="store_true", help="only the interleaved update timing")
    ap.add_argument("--child-interleaved", choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child_interleaved:
        import torch

        torch.set_num_threads(args.threads)
        child_interleaved(args.child_interleaved, args.work / "models" / "small", args.rounds, args.out)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    models = build_models(args.work, {"small"}, args.threads)
    if "long-prompt" in args.workloads:
        long_prompts(args.work / "long_prompts.jsonl", models["small"], WORKLOADS["long-prompt"]["prompt_tokens"])
    started = time.time()
    table, detail = [], {}
    k = 0
    timed = [interleaved(name, models["small"], args, args.work) for name in args.workloads] if args.interleaved else []
    for r in range(0 if args.no_runs else args.repeats):
        for name in args.workloads:
            modes = ["off", "on"] if k % 2 == 0 else ["on", "off"]
            k += 1
            cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=args.work))
            runs = {}
            for mode in modes + (["on-warm"] if args.warm else []):
                print(f"[{name}] compile {mode}: {args.steps} steps ...", flush=True)
                res = one_run(name, mode, WORKLOADS[name], models["small"], args, args.work, cache)
                runs[mode] = summarise(res, args.steps)
                s = runs[mode]
                if s["ok"]:
                    print(f"[{name}] {mode}: step 1 {s['step1_s']:.1f} s, {s['s_per_step']:.2f} s/step "
                          f"(update {s['update_s_per_step']:.2f}), wall at step {HORIZON} "
                          f"{s[f'wall_at_step_{HORIZON}_s']:.0f} s{' (extrapolated)' if s['wall_extrapolated'] else ''},"
                          f" RSS {s['peak_rss_mb']:.0f} MB, recompiles {s['recompiles']}, load "
                          f"{s['load_average'][0][0]:.1f}->{s['load_average'][1][0]:.1f}", flush=True)
                else:
                    print(f"[{name}] {mode} FAILED:\n{tail(s['log'])}", flush=True)
            detail[f"{name}#{r}"] = {"order": modes, **runs}
            table.append(compare(name, runs))
    report(table)
    args.results.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "started": started, "wall_s": time.time() - started,
                                        "table": table, "interleaved": timed, "runs": detail}, indent=1))
    print(f"wrote {rel(args.results)}")
    return 0


def report(table: list[dict]) -> None:
    print(f"\n{'workload':12}{'compile s':>10}{'s/step off':>11}{'on':>7}{'update off':>11}{'on':>7}"
          f"{'wall@20 off':>12}{'on':>7}{'RSS MB off':>11}{'on':>7}")
    for row in table:
        if not row["ok"]:
            print(f"{row['workload']:12} FAILED")
            continue
        print(f"{row['workload']:12}{row['compile_s']:10.1f}{row['off_s_per_step']:11.2f}{row['on_s_per_step']:7.2f}"
              f"{row['off_update_s']:11.2f}{row['on_update_s']:7.2f}{row[f'off_wall_{HORIZON}_s']:12.0f}"
              f"{row[f'on_wall_{HORIZON}_s']:7.0f}{row['off_rss_mb']:11.0f}{row['on_rss_mb']:7.0f}"
              + ("  (wall extrapolated)" if row["extrapolated"] else ""))


if __name__ == "__main__":
    sys.exit(main())
