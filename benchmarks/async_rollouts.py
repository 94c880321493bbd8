"""Asynchronous rollouts: the same GRPO work synchronous vs `rollout.async_steps` k = 1 and k = 2.

    python benchmarks/async_rollouts.py                    # both workloads, 8 steps per run
    python benchmarks/async_rollouts.py --workload agent   # one of them
    python benchmarks/async_rollouts.py --steps 4          # shorter

Workloads, each run four ways from the same model, data and seed:
- agent: the tiny model (`--agent-model small` for the ~28M one) after a short SFT that teaches
  it to answer with a call to `lookup` (below), a tool that sleeps 100-500 ms; episodes of up to 4
  turns of up to 96 tokens, so up to 3 rounds of calls per step (the calls of a round run
  concurrently; a round waits for its slowest call); 4 prompts x 4 episodes;
- small: the ~28M model (`rlft tiny-model --size small`, 27M parameters), single-turn GRPO on
  benchmarks/prompts.jsonl with the digit-share reward, 4 prompts x 8 completions of up to 48 tokens.
Modes: `sync` gives both cores to each phase in turn (training.num_threads=2), as the issue asks;
`sync-1t` is the synchronous run on one thread, the faster one on a loaded machine (two OpenMP
threads busy-wait on each other, training/threads.py); `k=1` and `k=2` give one core to the sampler
thread and one to the trainer (num_threads=1, which torch applies in each thread), generating in the
sampler thread (rollout.sampler=thread: one process, one GIL); `k=1 proc` and `k=2 proc` generate in
a child process (rollout.sampler=process, one thread there); the `cont` modes (agent workload) run
the agent's turns with agent.schedule=continuous (a slow call holds up only its own episode), the
others in rounds. Every run uses rollout_correction=tis, so the loss is the same.
`--modes "k=1 proc" sync-1t` runs a subset; `--lr` sets every run's learning rate (default 5e-5,
at which the agent workload's episodes keep calling the tool over 8 steps). `--engine vllm` samples
with an in-process vLLM engine instead of the hf one (the `proc` modes, hf only, are skipped; `k=1
cont` is the sampler thread with continuous turns).

Per run: s/step (median over steps 2.., the first step has nothing to overlap with), completion
tokens/s over those steps, the idle share of each side, the held-out reward (eval/reward_mean after
the last step: 32 held-out prompts x 4 samples at temperature 1, single-turn) and the wall time.
Idle shares from the per-step metrics: trainer idle = time/rollout_wait / time/step (sync: the time
it spent sampling); sampler idle = 1 - (time/generate + time/score) / time/step. The machine's
1-minute load average is recorded before each run (other jobs share it). Writes
benchmarks/results/async_rollouts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, ROOT, build_models, rel, rlft_command, run_child, tail  # noqa: E402

# (name, async_steps, torch threads, rollout.sampler, agent.schedule): sync as the issue asks (both
# cores for each phase), and sync on one thread, which a loaded machine can favour (busy-waiting
# OpenMP threads, see training/threads.py); async with the sampler's engine in the trainer's process
# (a thread, sharing its GIL) or in a child process; the agent's turns in rounds or continuous
# (agent.schedule; the small workload has no agent, its "cont" rows are not run)
MODES = (("sync", 0, 2, "auto", "rounds"), ("sync-1t", 0, 1, "auto", "rounds"), ("k=1", 1, 1, "thread", "rounds"),
         ("k=2", 2, 1, "thread", "rounds"), ("k=1 proc", 1, 1, "process", "rounds"),
         ("k=2 proc", 2, 1, "process", "rounds"), ("sync cont", 0, 2, "auto", "continuous"),
         ("k=1 proc cont", 1, 1, "process", "continuous"), ("k=2 proc cont", 2, 1, "process", "continuous"),
         ("k=1 cont", 1, 1, "thread", "continuous"))
TOOL = f"{rel(Path(__file__).resolve())}:lookup"


def lookup(query: str) -> str:
    """Look a question up in a slow service.

    Args:
        query: the question to look up
    """
    # 100-500 ms, a fixed function of the query: the same episodes wait as long in every run
    time.sleep(0.1 + 0.4 * (zlib.crc32(query.encode()) % 1000) / 1000)
    return f"result for {query[:40]}"


def held_out(path: Path) -> Path:
    """32 'What is a + b?' prompts with another seed than benchmarks/prompts.jsonl."""
    rng = random.Random(12345)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
            for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(32))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# The tiny models' ChatML template, plus one short system line when tools are given: the template
# presents the tools itself (rlft then adds no tools block of its own), so prompts stay ~40 tokens
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}{%- for t in tools %}"
                  "{{- t['function']['name'] + '(query) ' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
                  "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
                  " + '<|im_end|>' + '\\n' }}{%- endfor %}"
                  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def tool_sft_data(path: Path) -> Path:
    """Rows whose answer is a `lookup` call, after the system line the template shows the tools with."""
    rows = []
    for line in (HERE / "prompts.jsonl").read_text().splitlines():
        question = json.loads(line)["prompt"]
        call = json.dumps({"name": "lookup", "arguments": {"query": question}})
        rows.append({"messages": [{"role": "system", "content": "Tools: lookup(query) "},
                                  {"role": "user", "content": question},
                                  {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_tool_model(work: Path, base: Path, threads: int) -> Path:
    """The model after a short SFT on tool calls (a random model never writes one)."""
    out = work / "runs" / f"async-agent-sft-{base.name}"
    if (out / "final" / "model.safetensors").is_file():
        return out / "final"
    template = work / "async-tools-template.jinja"
    template.write_text(TOOLS_TEMPLATE)
    config = {"method": "sft", "output_dir": rel(out), "seed": 0,
              "model": {"path": rel(base), "device": "cpu", "chat_template": rel(template)},
              "data": {"train": rel(tool_sft_data(work / "async-tool-sft.jsonl")), "max_length": 128},
              "training": {"learning_rate": 3e-3, "batch_size": 16, "epochs": 30, "max_steps": 100,
                           "num_threads": threads, "lr_scheduler": "cosine", "warmup_ratio": 0.1,
                           "precision": "fp32"},
              "logging": {"progress": False}}
    path = work / "configs" / "async-agent-sft.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    print("[async] SFT: teaching the model to call lookup ...", flush=True)
    res = run_child([*rlft_command(), "train", rel(path)], work / "logs" / "async-agent-sft.log", threads)
    if res["rc"] != 0:
        raise SystemExit(f"the tool SFT failed:\n{tail(res['log'])}")
    return out / "final"


def grpo_config(name: str, workload: str, model: Path, k: int, threads: int, steps: int, evals: Path,
                work: Path, sampler: str = "auto", schedule: str = "rounds", lr: float = 5e-5,
                seed: int = 0, engine: str = "hf") -> dict:
    agent = workload == "agent"
    vllm = {"engine": "vllm", "vllm": {"kv_cache_bytes": 1 << 28}} if engine == "vllm" else {}
    return {
        "method": "grpo", "output_dir": rel(work / "runs" / name), "seed": seed,
        "model": {"path": rel(model), "device": "cpu"},
        "data": {"train": rel(HERE / "prompts.jsonl"), "eval": rel(evals), "max_prompt_length": 128},
        "training": {"learning_rate": lr, "max_steps": steps, "num_threads": threads, "precision": "fp32",
                     "lr_scheduler": "constant"},
        "rollout": {"group_size": 4 if agent else 8, "prompts_per_step": 4, "max_new_tokens": 96 if agent else 48,
                    "async_steps": k, "sampler": sampler, **vllm},
        "algorithm": {"rollout_correction": "tis"},
        "rewards": [{"fn": "benchmarks/rewards.py:digit_share"}],
        # sampled, 4 per prompt: greedy answers of a random model flip between degenerate loops
        # (digit share 0 or ~1) at the smallest weight change
        "eval": {"max_examples": 32, "max_new_tokens": 32, "batch_size": 128, "temperature": 1.0, "num_samples": 4},
        "logging": {"progress": False},
        **({"agent": {"tools": [TOOL], "max_turns": 4, "max_total_tokens": 480,
                                "schedule": schedule}} if agent else {}),
    }


def summarise(rows: list[dict]) -> dict:
    steps = [r for r in rows if "time/step" in r]
    measured = [r for r in steps if r["step"] >= 2] or steps
    step_s = [r["time/step"] for r in measured]
    busy = [(r["time/generate"] + r["time/score"]) / r["time/step"] for r in measured]
    waited = [r["time/rollout_wait"] / r["time/step"] for r in measured]
    out = {"s_per_step": statistics.median(step_s),
           "tokens_per_s": sum(r["completion/tokens"] for r in measured) / sum(step_s),
           # async: a batch's sampling can span more than one step (k = 2), so busy can pass 100%
           "sampler_idle": max(0.0, 1 - statistics.mean(busy)), "trainer_idle": statistics.mean(waited),
           "train_reward_last": steps[-1]["reward/mean"], "heldout_reward": steps[-1].get("eval/reward_mean"),
           "staleness_max": max(r["rollout/staleness_max"] for r in steps), "steps": len(steps)}
    if "agent/tool_calls_mean" in steps[-1]:
        out["tool_calls_per_episode"] = statistics.mean(r["agent/tool_calls_mean"] for r in steps)
    return out


def run_workload(workload: str, args, work: Path) -> list[dict]:
    size = args.agent_model if workload == "agent" else "small"
    model = build_models(work, {size}, 2)[size]
    if workload == "agent":
        model = sft_tool_model(work, model, 2)
    evals = held_out(work / "async-heldout.jsonl")
    results = []
    for mode, k, threads, sampler, schedule in MODES:
        if (args.modes and mode not in args.modes) or (schedule != "rounds" and workload != "agent") or \
                (args.engine == "vllm" and sampler == "process"):
            continue
        name = f"async-{workload}-{mode.replace('=', '').replace(' ', '-')}" + (f"-seed{args.seed}" if args.seed else "") \
            + ("-vllm" if args.engine == "vllm" else "")
        cfg = grpo_config(name, workload, model, k, threads, args.steps, evals, work, sampler, schedule, args.lr,
                          args.seed, args.engine)
        path = work / "configs" / f"{name}.yaml"
        path.write_text(json.dumps(cfg))
        shutil.rmtree(ROOT / cfg["output_dir"], ignore_errors=True)  # an existing run would be continued
        load = os.getloadavg()[0]
        print(f"[async] {workload} {mode}: {args.steps} steps (load {load:.2f}) ...", flush=True)
        res = run_child([*rlft_command(), "train", rel(path)], work / "logs" / f"{name}.log", threads,
                        args.time_limit)
        metrics = ROOT / cfg["output_dir"] / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.is_file() else []
        if (res["rc"] != 0 and not res["time_limited"]) or len(rows) < 2:
            print(f"[async] {name} failed (exit {res['rc']}):\n{tail(res['log'])}", flush=True)
            results.append({"workload": workload, "mode": mode, "async_steps": k, "ok": False, "log": res["log"]})
            continue
        results.append({"workload": workload, "mode": mode, "async_steps": k, "threads": threads, "sampler": sampler,
                        "schedule": schedule, "ok": True,
                        "partial": res["time_limited"], "load_before": load, "wall_s": res["wall_s"],
                        **summarise(rows), "log": res["log"]})
    syncs = [r for r in results if r["ok"] and r["async_steps"] == 0]
    for r in results:
        if syncs and r["ok"]:
            r["speedup_vs_sync"] = syncs[0]["s_per_step"] / r["s_per_step"]
            r["speedup_vs_best_sync"] = min(s["s_per_step"] for s in syncs) / r["s_per_step"]
    return results


def table(results: list[dict]) -> str:
    head = ("| workload | mode | s/step | vs sync | vs best sync | tokens/s | sampler idle | trainer idle "
            "| held-out reward | wall s | load |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        if not r["ok"]:
            lines.append(f"| {r['workload']} | {r['mode']} | failed: {r['log']} ||||||||||")
            continue
        reward = "n/a" if r["heldout_reward"] is None else f"{r['heldout_reward']:.4f}"
        mode = r["mode"] + (f" ({r['steps']} steps, time limit)" if r["partial"] else "")
        lines.append(f"| {r['workload']} | {mode} | {r['s_per_step']:.2f} | {r.get('speedup_vs_sync', 0):.2f}x "
                     f"| {r.get('speedup_vs_best_sync', 0):.2f}x "
                     f"| {r['tokens_per_s']:.0f} | {r['sampler_idle']:.0%} | {r['trainer_idle']:.0%} | {reward} "
                     f"| {r['wall_s']:.0f} | {r['load_before']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["small", "agent", "both"], default="both")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5, help="training.learning_rate of every run")
    parser.add_argument("--seed", type=int, default=0, help="the GRPO runs' seed (the SFT'd model stays)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout.engine of every GRPO run")
    parser.add_argument("--agent-model", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--modes", nargs="+", choices=[m[0] for m in MODES], help="run only these (default: all)")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds per run (then: the steps it did)")
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "async_rollouts.json")
    args = parser.parse_args()
    work = args.work.resolve()
    results = []
    for workload in (["agent", "small"] if args.workload == "both" else [args.workload]):
        results += run_workload(workload, args, work)
    out = args.out
    out.write_text(json.dumps({"steps": args.steps, "cores": os.cpu_count(), "engine": args.engine,
                               "results": results}, indent=1))
    print(table(results))
    print(f"written {rel(out)}")


if __name__ == "__main__":
    main()
