"""`make bench`: TRL's GRPOTrainer and rlft's GRPO on identical work, back to back.

    python benchmarks/grpo_vs_trl.py            # tiny-full, tiny-lora, large-full, 20 steps each
    python benchmarks/grpo_vs_trl.py --quick    # smoke run: tiny workloads, 6 steps

Work (identical for both frameworks)
- Models built once with rlft's own builder (`rlft tiny-model --size tiny|small`, random weights,
  Qwen2 architecture, byte-level tokenizer, ChatML template) into `benchmarks/work/models/`; both
  frameworks load the same files. Generation stops on the checkpoint's EOS ids (`<|im_end|>`, `<|endoftext|>`).
- Prompts: `benchmarks/prompts.jsonl` ("What is A + B?", every prompt the same length in tokens),
  rendered with the same chat template (checked token for token before TRL trains).
- Reward: `benchmarks/rewards.py` (share of digit characters), the same function for both.
- GRPO: G = 8 completions for each of 4 prompts per step (32 per optimizer step, one
  forward/backward over all 32, one optimizer step per generation, mu = 1), temperature 1.0,
  no top-k/top-p, k3 KL in the loss with beta = 0.04, clip 0.2, group-std-normalised advantages,
  token-mean loss over the batch, AdamW lr 1e-5 with cosine decay and no warmup, grad-norm clip
  1.0, fp32, seed 0, `--threads` torch threads (default 2), 20 steps.
- Workloads: tiny-full (~1M params, 32 new tokens), tiny-lora (LoRA r=16, alpha=32, dropout 0.05
  on all linear layers), large-full (~28M params, 128 new tokens).

Measured
- s/step: the wall time of one optimizer step *including generation*: prompts -> sampling ->
  reward -> reference log-probs -> policy forward/backward -> clip -> optimizer step. rlft logs
  it as `time/step` in `metrics.jsonl` (from before the rollout to after the optimizer step); for
  TRL a TrainerCallback times `on_step_begin` -> `on_step_end`, which encloses the same span
  (TRL generates inside `training_step`). Logging and checkpointing are outside both. Reported:
  the median over steps 5-20 (the first steps pay one-time costs).
- tokens/s: generated (completion) tokens over the measured steps / their summed step time.
  rlft logs `completion/tokens`; for TRL it is `completions/mean_length` x 32.
- peak RSS: each framework runs in its own process; its `ru_maxrss` from `os.wait4` (includes
  imports and model loading).
- final reward mean: the reward mean of the last step's 32 completions.
- speedup: TRL s/step / rlft s/step (> 1: rlft is faster).
- Generation: rlft's engine vs plain `model.generate` on the same batch (probes.py gen).
- FLOP bound for large-full: FLOPs of one step (generation with a KV cache, reference forward,
  policy forward + backward, from the model's shapes and the measured token counts) divided by
  the best matmul GFLOP/s measured on this CPU at the model's shapes (probes.py matmul).

Writes `benchmarks/results/grpo_vs_trl.json`; logs and run folders go to `benchmarks/work/`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

GROUP_SIZE, PROMPTS_PER_STEP = 8, 4
TEMPERATURE, KL_COEF, LEARNING_RATE, SEED = 1.0, 0.04, 1e-5, 0
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
WORKLOADS = {
    "tiny-full": {"model": "tiny", "lora": False, "max_new_tokens": 32},
    "tiny-lora": {"model": "tiny", "lora": True, "max_new_tokens": 32},
    "large-full": {"model": "small", "lora": False, "max_new_tokens": 128},
}
QUICK_WORKLOADS = ["tiny-full", "tiny-lora"]


# ---------------------------------------------------------------------------------------------
# Processes


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"})
    return env


def run_child(cmd: list[str], log: Path, threads: int) -> dict:
    """Run `cmd` from the repo root; return its exit code, wall time and peak RSS (this child only)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=child_env(threads))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    return {"rc": proc.returncode, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "log": rel(log)}


def rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def tail(path: str, n: int = 25) -> str:
    lines = (ROOT / path).read_text(errors="replace").splitlines()
    return "\n".join("    " + ln for ln in lines[-n:])


def rlft_command() -> list[str]:
    script = Path(sys.executable).parent / "rlft"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlft.cli"]


# ---------------------------------------------------------------------------------------------
# Setup


def build_models(work: Path, names: set[str], threads: int) -> dict[str, Path]:
    out = {}
    for size in sorted(names):
        folder = work / "models" / size
        if not (folder / "model.safetensors").is_file():
            print(f"building the {size} model in {rel(folder)} ...", flush=True)
            res = run_child([*rlft_command(), "tiny-model", str(folder), "--size", size, "--seed", str(SEED)],
                            work / "logs" / f"build-{size}.log", threads)
            if res["rc"] != 0:
                raise SystemExit(f"building the {size} model failed:\n{tail(res['log'])}")
        out[size] = folder
    return out


def model_shapes(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    # q, k, v (with bias in Qwen2), o, gate/up/down, two RMSNorms per layer; final norm.
    per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * inter + 2 * d
    body = layers * per_layer + d
    head = d * cfg["vocab_size"]  # tied with the embedding, but its matmul runs for every scored position
    return {"hidden": d, "intermediate": inter, "layers": layers, "vocab": cfg["vocab_size"],
            "body_params": body, "lm_head_params": head, "total_params": body + head}


# ---------------------------------------------------------------------------------------------
# The two frameworks


def run_rlft(name: str, wl: dict, model_dir: Path, args, work: Path) -> dict:
    out_dir = work / "runs" / f"{name}-rlft"
    shutil.rmtree(out_dir, ignore_errors=True)  # an existing run dir would be resumed, not restarted
    config = {
        "method": "grpo",
        "output_dir": rel(out_dir),
        "seed": SEED,
        "model": {"path": rel(model_dir), "device": "cpu", "dtype": "fp32"},
        "lora": {"enabled": wl["lora"], **LORA, "target_modules": "all-linear"},
        "data": {"train": rel(HERE / "prompts.jsonl")},
        "training": {"learning_rate": LEARNING_RATE, "lr_scheduler": "cosine", "warmup_ratio": 0.0,
                     "max_grad_norm": 1.0, "max_steps": args.steps, "num_threads": args.threads},
        "rollout": {"group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "temperature": TEMPERATURE,
                    "top_p": 1.0, "top_k": 0, "max_new_tokens": wl["max_new_tokens"]},
        "algorithm": {"kl_coef": KL_COEF},
        "rewards": [{"fn": "benchmarks/rewards.py:digit_share"}],
        "logging": {"progress": False},
    }
    cfg_path = work / "configs" / f"{name}-rlft.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    res = run_child([*rlft_command(), "train", rel(cfg_path)], work / "logs" / f"{name}-rlft.log", args.threads)
    res["config"] = rel(cfg_path)
    metrics = out_dir / "metrics.jsonl"
    if res["rc"] == 0 and metrics.is_file():
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        res["steps"] = [{"step": r["step"], "time": r["time/step"], "completion_tokens": r["completion/tokens"],
                         "reward_mean": r.get("reward/mean"), "kl": r.get("kl"), "entropy": r.get("entropy"),
                         "time_generate": r.get("time/generate"), "time_train": r.get("time/train")}
                        for r in rows if "time/step" in r]
    return res


def run_trl(name: str, wl: dict, model_dir: Path, args, work: Path) -> dict:
    out_dir = work / "runs" / f"{name}-trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    spec = {"model_dir": rel(model_dir), "prompts": rel(HERE / "prompts.jsonl"), "output_dir": rel(out_dir),
            "lora": LORA if wl["lora"] else None, "max_new_tokens": wl["max_new_tokens"], "steps": args.steps,
            "group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "temperature": TEMPERATURE,
            "kl_coef": KL_COEF, "learning_rate": LEARNING_RATE, "seed": SEED, "threads": args.threads,
            "result": rel(work / "results" / f"{name}-trl.json")}
    spec_path = work / "configs" / f"{name}-trl.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path = ROOT / spec["result"]
    result_path.unlink(missing_ok=True)
    res = run_child([sys.executable, rel(HERE / "trl_worker.py"), rel(spec_path)],
                    work / "logs" / f"{name}-trl.log", args.threads)
    res["config"] = rel(spec_path)
    if res["rc"] == 0 and result_path.is_file():
        res.update(json.loads(result_path.read_text()))
    return res


def summarise(res: dict, first: int) -> dict:
    steps = res.get("steps") or []
    measured = [s for s in steps if s["step"] >= first]
    if res["rc"] != 0 or not measured:
        return {"ok": False}
    times = [s["time"] for s in measured]
    tokens = [s["completion_tokens"] for s in measured if s["completion_tokens"] is not None]
    last = steps[-1]
    gen = [s.get("time_generate") for s in measured]
    split = {}
    if all(g is not None for g in gen):  # sampling vs everything else (reward, reference, update)
        split = {"generate_s_per_step": statistics.median(gen),
                 "rest_s_per_step": statistics.median(t - g for t, g in zip(times, gen))}
    return {"ok": True, "s_per_step": statistics.median(times), **split,
            "tokens_per_s": sum(tokens) / sum(times) if len(tokens) == len(times) else None,
            "completion_tokens_per_step": statistics.mean(tokens) if tokens else None,
            "final_reward_mean": last["reward_mean"], "steps_done": len(steps)}


# ---------------------------------------------------------------------------------------------
# Probes


def run_probe(kind: str, spec: dict, name: str, work: Path, threads: int) -> dict:
    spec = {**spec, "result": rel(work / "results" / f"probe-{name}.json")}
    spec_path = work / "configs" / f"probe-{name}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    res = run_child([sys.executable, rel(HERE / "probes.py"), kind, rel(spec_path)],
                    work / "logs" / f"probe-{name}.log", threads)
    if res["rc"] != 0:
        print(f"  probe {name} failed (exit {res['rc']}):\n{tail(res['log'])}", flush=True)
        return {"ok": False, **res}
    return {"ok": True, **json.loads((ROOT / spec["result"]).read_text())}


def step_flops(shapes: dict, rows: int, prompt_len: float, completion_tokens: float) -> dict:
    """FLOPs of one GRPO step (matmuls only; attention score products and elementwise work left out,
    so the bound is a true lower bound on time). P_body = non-embedding weights, P_head = lm_head."""
    pb, ph = shapes["body_params"], shapes["lm_head_params"]
    prompt_tokens = rows * prompt_len
    # Generation: prefill over the prompt (logits for the last position only), then one decode
    # forward per generated token except the last one of each row.
    gen = 2 * pb * prompt_tokens + 2 * ph * rows + (completion_tokens - rows) * 2 * (pb + ph)
    fwd = 2 * pb * (prompt_tokens + completion_tokens) + 2 * ph * completion_tokens  # logits for completion only
    return {"generation": gen, "reference_forward": fwd, "policy_forward_backward": 3 * fwd,
            "total": gen + 4 * fwd}


# ---------------------------------------------------------------------------------------------
# Output


def versions(threads: int) -> dict:
    def v(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": v("torch"), "transformers": v("transformers"), "trl": v("trl"), "peft": v("peft"),
            "accelerate": v("accelerate"), "datasets": v("datasets"), "rlft": v("rlft"),
            "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(), "threads": threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "platform": platform.platform()}


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(workloads: list[dict], generation: list[dict], bound: dict | None, first: int, last: int) -> None:
    head = f"{'workload':<11} {'framework':<6} {'s/step':>8} {'(sample':>8} {'+ rest)':>8} {'gen tok/s':>10} " \
           f"{'peak RSS MB':>12} {'final reward':>13} {'speedup':>8}"
    print(f"\nGRPO step time, median over steps {first}-{last} (speedup = TRL s/step / rlft s/step; sample = "
          "time in generation, rest = reward + reference + update, medians each)")
    print(head)
    print("-" * len(head))
    for w in workloads:
        for fw in ("rlft", "trl"):
            s = w[fw]
            speed = fmt(w["speedup"], ".2f") + "x" if fw == "rlft" and w["speedup"] else ""
            print(f"{w['name']:<11} {fw:<6} {fmt(s.get('s_per_step')):>8} {fmt(s.get('generate_s_per_step')):>8} "
                  f"{fmt(s.get('rest_s_per_step')):>8} {fmt(s.get('tokens_per_s'), '.1f'):>10} "
                  f"{fmt(s.get('peak_rss_mb'), '.0f'):>12} {fmt(s.get('final_reward_mean'), '.3f'):>13} {speed:>8}")
    if generation:
        print("\nGeneration, same batch (4 prompts x 8 samples), tokens/s")
        print(f"{'model':<7} {'new tok':>7} {'rlft engine':>12} {'model.generate':>15} {'ratio':>7}")
        for g in generation:
            print(f"{g['model']:<7} {g['max_new_tokens']:>7} {fmt(g.get('rlft_engine_tokens_per_s'), '.1f'):>12} "
                  f"{fmt(g.get('hf_generate_tokens_per_s'), '.1f'):>15} {fmt(g.get('rlft_vs_generate'), '.2f'):>7}")
    if bound:
        print(f"\nlarge-full FLOP bound: {bound['total_gflop']:.1f} GFLOP/step at {bound['best_gflops']:.1f} GFLOP/s "
              f"(best measured matmul) = {bound['bound_s']:.2f} s/step; rlft {fmt(bound.get('rlft_s_per_step'), '.2f')}"
              f" s/step = {fmt(bound.get('rlft_over_bound'), '.1f')}x the bound"
              f" (shape-aware bound {bound['shape_aware_bound_s']:.2f} s: "
              f"{fmt(bound.get('rlft_over_shape_aware_bound'), '.1f')}x)")


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workloads, 6 steps, no FLOP probe")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="subset of workloads to run")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 20; --quick: 6)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every process (default 2)")
    ap.add_argument("--gen-repeats", type=int, default=5, help="timed calls per engine in the generation probe")
    ap.add_argument("--no-probes", action="store_true", help="skip the generation and matmul probes")
    ap.add_argument("--work", type=Path, default=HERE / "work", help="models, configs, logs, run folders")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "grpo_vs_trl.json")
    args = ap.parse_args()
    args.steps = args.steps or (6 if args.quick else 20)
    names = args.workloads or (QUICK_WORKLOADS if args.quick else list(WORKLOADS))
    first = 5 if args.steps >= 10 else min(3, args.steps)
    work = args.work.resolve()
    load_start = os.getloadavg()
    started = time.time()

    models = build_models(work, {WORKLOADS[n]["model"] for n in names}, args.threads)
    shapes = {size: model_shapes(folder) for size, folder in models.items()}

    workloads = []
    for i, name in enumerate(names):
        wl = WORKLOADS[name]
        order = ["rlft", "trl"] if i % 2 == 0 else ["trl", "rlft"]
        runs = {}
        for fw in order:
            print(f"[{name}] {fw}: {args.steps} steps ...", flush=True)
            runner = run_rlft if fw == "rlft" else run_trl
            runs[fw] = runner(name, wl, models[wl["model"]], args, work)
            s = summarise(runs[fw], first)
            if s["ok"]:
                print(f"[{name}] {fw}: {s['s_per_step']:.3f} s/step, peak RSS {runs[fw]['peak_rss_mb']:.0f} MB, "
                      f"wall {runs[fw]['wall_s']:.0f} s", flush=True)
            else:
                print(f"[{name}] {fw} FAILED (exit {runs[fw]['rc']}), log {runs[fw]['log']}:\n"
                      f"{tail(runs[fw]['log'])}", flush=True)
        entry = {"name": name, "model": wl["model"], "params": shapes[wl["model"]]["total_params"],
                 "lora": wl["lora"], "max_new_tokens": wl["max_new_tokens"], "steps": args.steps,
                 "measured_steps": [first, args.steps], "order": order}
        for fw in ("rlft", "trl"):
            s = summarise(runs[fw], first)
            entry[fw] = {**s, "peak_rss_mb": runs[fw]["peak_rss_mb"], "wall_s": runs[fw]["wall_s"],
                         "rc": runs[fw]["rc"], "log": runs[fw]["log"], "config": runs[fw].get("config"),
                         "step_times": [st["time"] for st in runs[fw].get("steps") or []],
                         "steps_detail": runs[fw].get("steps") or []}
            for key in ("torch_threads", "trainable_params", "optim", "eos_token_ids", "train_wall_s", "loss_type",
                        "beta", "activation_checkpointing", "bf16", "per_device_train_batch_size",
                        "generation_batch_size", "steps_per_generation"):
                if key in runs[fw]:
                    entry[fw][key] = runs[fw][key]
        ok = entry["rlft"]["ok"] and entry["trl"]["ok"]
        entry["speedup"] = entry["trl"]["s_per_step"] / entry["rlft"]["s_per_step"] if ok else None
        for fw in ("rlft", "trl"):
            for key in ("s_per_step", "peak_rss_mb", "tokens_per_s", "final_reward_mean"):
                entry[f"{fw}_{key}"] = entry[fw].get(key)
        workloads.append(entry)

    generation, bound, matmul = [], None, None
    if not args.no_probes:
        for size in sorted({WORKLOADS[n]["model"] for n in names}, key=["tiny", "small"].index):
            max_new = max(WORKLOADS[n]["max_new_tokens"] for n in names if WORKLOADS[n]["model"] == size)
            print(f"[probe] generation, {size} model, {max_new} new tokens ...", flush=True)
            g = run_probe("gen", {"model_dir": rel(models[size]), "prompts": rel(HERE / "prompts.jsonl"),
                                  "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                                  "max_new_tokens": max_new, "threads": args.threads, "repeats": args.gen_repeats},
                          f"gen-{size}", work, args.threads)
            rec = {"model": size, "max_new_tokens": max_new, "ok": g["ok"]}
            if g["ok"]:
                rec.update({"rlft_engine_tokens_per_s": g["rlft_engine"]["tokens_per_s"],
                            "hf_generate_tokens_per_s": g["hf_generate"]["tokens_per_s"],
                            "rlft_vs_generate": g["rlft_vs_generate"], "prompt_tokens": g["prompt_tokens"],
                            "detail": g})
            generation.append(rec)
        large = next((w for w in workloads if w["name"] == "large-full"), None)
        if large is not None:
            sh = shapes["small"]
            gen_small = next((g for g in generation if g["model"] == "small" and g["ok"]), None)
            prompt_len = gen_small["prompt_tokens"]["mean"] if gen_small else 21.0
            rows = GROUP_SIZE * PROMPTS_PER_STEP
            print("[probe] matmul GFLOP/s ...", flush=True)
            matmul = run_probe("matmul", {**{k: sh[k] for k in ("hidden", "intermediate", "vocab")},
                                          "train_rows": int(rows * (prompt_len + large["max_new_tokens"])),
                                          "decode_rows": rows, "threads": args.threads}, "matmul", work, args.threads)
            tokens = large["rlft"].get("completion_tokens_per_step") or rows * large["max_new_tokens"]
            if matmul["ok"]:
                f = step_flops(sh, rows, prompt_len, tokens)
                best, dec = matmul["best_gflops"] * 1e9, matmul["decode_gflops"] * 1e9
                decode_flops = (tokens - rows) * 2 * (sh["body_params"] + sh["lm_head_params"])
                bound = {"flops": f, "total_gflop": f["total"] / 1e9, "best_gflops": matmul["best_gflops"],
                         "decode_gflops": matmul["decode_gflops"], "bound_s": f["total"] / best,
                         "shape_aware_bound_s": (f["total"] - decode_flops) / best + decode_flops / dec,
                         "prompt_tokens": prompt_len, "completion_tokens_per_step": tokens, "rows": rows,
                         "params": sh, "matmul": matmul}
                for fw in ("rlft", "trl"):
                    s = large[fw].get("s_per_step")
                    bound[f"{fw}_s_per_step"] = s
                    bound[f"{fw}_over_bound"] = s / bound["bound_s"] if s else None
                    bound[f"{fw}_over_shape_aware_bound"] = s / bound["shape_aware_bound_s"] if s else None

    result = {
        "workloads": workloads,
        "generation": generation,
        "flop_bound": bound,
        "versions": versions(args.threads),
        "settings": {
            "group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "temperature": TEMPERATURE,
            "kl_coef": KL_COEF, "learning_rate": LEARNING_RATE, "lr_scheduler": "cosine, no warmup", "seed": SEED,
            "steps": args.steps, "measured_steps": [first, args.steps], "threads": args.threads, "lora": LORA,
            "quick": args.quick, "step_time": "rollout + reward + reference + update + optimizer step "
                                             "(rlft time/step; TRL on_step_begin->on_step_end)"},
        "machine_load": {"loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(workloads, generation, bound, first, args.steps)
    print(f"\nwrote {rel(args.out)} (load average {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
    failed = [f"{w['name']}/{fw}" for w in workloads for fw in ("rlft", "trl") if not w[fw]["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
