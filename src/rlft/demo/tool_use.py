"""`rlft demo --tools`: a model learns to use a calculator. SFT on a sloppy annotator's tool-use
transcripts (most skip the tool and guess), then GRPO with the calculator in the episodes.

SmolLM2-135M-Instruct cannot carry in two-digit sums, and given a calculator in its system prompt
it never calls it. The cold start teaches the call syntax and the answer format from transcripts
in which only some problems are worked with the tool (demo/tool_traces.py); imitation learns to
guess as often as the annotator did. GRPO then samples whole episodes with the calculator
(rollout/agent/turns.py) and pays only right final answers (the `math` reward, nothing for format), so
what it can learn is that calling pays. Held-out accuracy is measured on greedy episodes before
SFT, after SFT and after RL, with the tool-call rate and tool error rate of each
(demo/episodes.py), on problems no stage trained on (the word-problem demo's disjoint split).

The tools are shown by a compact block (agent.tools_prompt): the default JSON schemas would make
each prompt ~250 tokens instead of ~135, and on a CPU every stage's cost is mostly prompt tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from rlft.api import train
from rlft.demo import tool_traces, word_problems
from rlft.demo.arithmetic import question
from rlft.demo.episodes import EpisodeEval, evaluate_episodes
from rlft.demo.smollm2 import _peak_rss_mb, imported_model, paired_gain
from rlft.errors import RlftError
from rlft.models.tiny import build_tiny_model
from rlft.monitor.console import console

TOOLS_PROMPT = "Tools:\n{signatures}\nTo call a tool, {syntax} and end your turn."
TASKS = ("word_problems", "sums")


@dataclass(frozen=True)
class ToolDemoSettings:
    """The SmolLM2 run's settings (`rlft demo --model smollm2 --tools`); TINY_SETTINGS: the tiny model's."""

    seed: int = 0
    task: str = "word_problems"  # or 'sums': "What is a + b?" (the tiny model's variant, see task_splits)
    operands: tuple[int, int] = (10, 99)  # 'sums': the range of a and b
    system: str = tool_traces.TOOL_SYSTEM_PROMPT
    tools_prompt: str = TOOLS_PROMPT
    heldout: int = 300  # the word-problem demo's split: make_splits(seed, train_rows, heldout)
    train_rows: int = 1000
    sft_rows: int = 160  # transcripts, from the first training rows
    # The annotator calls the calculator on 30% of the transcripts. SFT then imitates the guessing
    # (greedy episodes call on 3% of held-out problems), which leaves RL something to learn.
    call_rate: float = 0.3
    guess_accuracy: float = 0.6  # share of its guesses that are right
    lead_ins: tuple[str, ...] = tool_traces.LEAD_INS  # what it may write before a call
    answer: str = tool_traces.Annotator.answer  # how it writes the final answer
    answer_after_call: str | None = None  # and after a call, if otherwise
    format_regex: str = word_problems.FORMAT_REGEX  # the answer form the held-out report counts
    sft_epochs: int = 1
    sft_lr: float = 1e-3  # LoRA; the loss falls from 1.1 to 0.1-0.2 by step 10 of 20
    sft_batch_size: int = 8
    sft_lr_scheduler: str = "cosine"  # after 10% warmup
    # Prompts: the training rows after the transcripts'. 6 steps: calls per training episode went
    # 0.19 -> 0.72 by step 4; a 12-step probe (200 transcripts) gave 0.90 on the first 50 problems.
    rl_steps: int = 6
    rl_lr: float = 5e-4
    group_size: int = 8
    prompts_per_step: int = 4
    temperature: float = 1.0
    parser: str = "hermes"  # agent.parser; llama3_json: calls are written arguments first (see arguments_first)
    max_new_tokens: int = 48  # per turn: a call is 33-41 tokens, an answer ~17
    max_turns: int = 3
    max_total_tokens: int = 192
    lora: bool = True  # LoRA in both stages (a random tiny model trains all its weights)
    lora_r: int = 16
    lora_alpha: float = 32
    micro_batch_size: int = 8
    eval_batch_size: int = 100
    threads: int = 1  # a shared 2-core machine: one thread per process keeps timings honest
    precision: str = "auto"


# The tiny model's variant (random init, 1M parameters). It must learn from scratch to copy the
# numbers of the question into the call and the calculator's result into its reply, and SFT is
# where it can: a few hundred steps when everything it copies sits at fixed distances. Hence:
# both operands 50-99 (every sum has three digits), calls written arguments first in Llama-3
# JSON (arguments_first), no lead-ins, and after a call the reply is the result alone. Guesses
# restate the sum and are always wrong (guess_accuracy 0): right ones teach a model that cannot
# add to predict sums, which slowed the copying down. The model is built with init_std 0.08
# (TINY_INIT_STD; see models/tiny.py).
TINY_SETTINGS = ToolDemoSettings(
    task="sums", operands=(50, 99), system="Solve it.", tools_prompt="Tools: calculator.", heldout=50,
    train_rows=2000, sft_rows=1500, call_rate=0.45, guess_accuracy=0.0, lead_ins=("",),
    answer="{expression} = {value}", answer_after_call="{value}", format_regex=r"(\d+ \+ \d+ = )?\d+",
    sft_epochs=2, sft_lr=3e-3, sft_batch_size=8, rl_steps=6, rl_lr=3e-4, parser="llama3_json",
    max_new_tokens=64, max_turns=2, max_total_tokens=140, lora=False, eval_batch_size=50, precision="fp32")
TINY_INIT_STD = 0.08


def settings_for(model: str, **overrides: Any) -> ToolDemoSettings:
    """The demo's settings for `model` ('smollm2' or 'tiny'), with `overrides`."""
    from dataclasses import replace

    return replace(ToolDemoSettings() if model == "smollm2" else TINY_SETTINGS, **overrides)


def agent_section(s: ToolDemoSettings) -> dict[str, Any]:
    return {"tools": ["calculator"], "tools_prompt": s.tools_prompt, "parser": s.parser, "max_turns": s.max_turns,
            "max_total_tokens": s.max_total_tokens}


def write_data(out: Path, s: ToolDemoSettings) -> dict[str, Any]:
    """The transcripts (SFT), the RL prompts and the held-out prompts, all with the tool system
    prompt; transcripts and RL prompts come from disjoint training rows."""
    splits = task_splits(s)
    train, heldout = splits["train"], splits["heldout"]
    if s.sft_rows + s.prompts_per_step * s.rl_steps > len(train):
        raise RlftError(f"the tool demo needs {s.sft_rows} transcripts and {s.prompts_per_step * s.rl_steps} RL "
                        f"prompts from {len(train)} training rows; raise train_rows")
    annotator = tool_traces.Annotator(s.call_rate, s.guess_accuracy, tuple(s.lead_ins), s.answer,
                                       s.answer_after_call)
    out.mkdir(parents=True, exist_ok=True)
    traces = tool_traces.sloppy_traces(train[:s.sft_rows], s.seed, annotator, s.system)
    if s.parser == "llama3_json":
        traces = [arguments_first(t) for t in traces]
    rl = tool_traces.tool_prompts(train[s.sft_rows:], s.system)
    held = tool_traces.tool_prompts(heldout, s.system)
    paths = {"traces": out / "traces.jsonl", "rl_prompts": out / "rl_prompts.jsonl", "heldout": out / "heldout.jsonl"}
    for name, rows in (("traces", traces), ("rl_prompts", rl), ("heldout", held)):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    kinds = [t["trace"] for t in traces]
    return {"paths": paths, "heldout_rows": held,
            "traces": {k: kinds.count(k) for k in ("call", "guess_right", "guess_wrong")}}


def task_splits(s: ToolDemoSettings) -> dict[str, list[dict[str, Any]]]:
    """Disjoint training and held-out problems. 'word_problems': the SmolLM2 demo's own split;
    'sums': "What is a + b?" for a, b in `operands`, the tiny demo's question, a few tokens for a
    model that has to learn to read it from scratch."""
    if s.task == "word_problems":
        return word_problems.make_splits(s.seed, s.train_rows, s.heldout)
    if s.task != "sums":
        raise RlftError(f"tool demo task must be one of {', '.join(TASKS)}, got {s.task!r}")
    import random

    lo, hi = s.operands
    problems = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(s.seed).shuffle(problems)
    if len(problems) < s.heldout + s.train_rows:
        raise RlftError(f"operands {s.operands} give {len(problems)} problems; the split needs "
                        f"{s.heldout + s.train_rows}")
    problems = problems[:s.heldout + s.train_rows]
    rows = [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b), "op": "+", "a": a, "b": b}
            for a, b in problems]
    return {"heldout": rows[:s.heldout], "train": rows[s.heldout:]}


def arguments_first(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace with each call written in its turn's text, Llama-3 JSON with the arguments before
    the name: {"parameters": {"expression": "25 + 60"}, "name": "calculator"} (the parser reads
    either order). A random tiny model must learn to copy the numbers from the question into the
    call; this puts them ~25 tokens after the question instead of ~55 (Hermes, name first). In 150
    SFT steps on call rows alone it copied arguments-first calls from step ~100 (two seeds); Hermes
    calls were at most starting to be copied by the end (four tries)."""
    messages = []
    for m in trace["messages"]:
        if m.get("tool_calls"):
            text = "; ".join(json.dumps({"parameters": c["function"]["arguments"], "name": c["function"]["name"]})
                             for c in m["tool_calls"])
            m = {"role": m["role"], "content": text}
        messages.append(m)
    return {**trace, "messages": messages}


def configs(out: Path, model: Path, paths: dict[str, Path], s: ToolDemoSettings) -> dict[str, dict[str, Any]]:
    """SFT with LoRA on the transcripts, then GRPO with LoRA from its merged `final/`."""
    lora = {"enabled": s.lora, "r": s.lora_r, "alpha": s.lora_alpha, "dropout": 0.0, "target_modules": "all-linear"}
    shared = {"precision": s.precision, "num_threads": s.threads}
    common = {"seed": s.seed, "agent": agent_section(s), "logging": {"progress": True}, "lora": lora}
    sft = {"method": "sft", "output_dir": str(out / "runs" / "sft"), "model": {"path": str(model), "device": "cpu"},
           "data": {"train": str(paths["traces"]), "max_length": 512},
           "training": {"learning_rate": s.sft_lr, "batch_size": s.sft_batch_size, "epochs": s.sft_epochs,
                        "warmup_ratio": 0.1, "lr_scheduler": s.sft_lr_scheduler, **shared}, **common}
    grpo = {"method": "grpo", "output_dir": str(out / "runs" / "grpo"),
            "model": {"path": str(out / "runs" / "sft" / "final"), "device": "cpu"},
            "data": {"train": str(paths["rl_prompts"]), "max_prompt_length": 256},
            "training": {"learning_rate": s.rl_lr, "max_steps": s.rl_steps, "lr_scheduler": "constant", **shared},
            "rollout": {"group_size": s.group_size, "prompts_per_step": s.prompts_per_step,
                        "max_new_tokens": s.max_new_tokens, "temperature": s.temperature},
            # no KL term: a short run, and it saves the reference forward; only right answers are paid
            "algorithm": {"kl_coef": 0.0, "micro_batch_size": s.micro_batch_size},
            "rewards": [{"fn": "math", "name": "correct", "weight": 1.0}],
            "checkpoint": {"keep_last": 1}, **common}
    grpo["logging"] = {"progress": True, "sample_every": 4, "num_samples": 4}
    return {"sft": sft, "grpo": grpo}


def heldout_eval(model: Path, rows: list[dict[str, Any]], s: ToolDemoSettings) -> EpisodeEval:
    return evaluate_episodes(model, rows, agent_section(s), max_new_tokens=s.max_new_tokens,
                             batch_size=s.eval_batch_size, seed=s.seed, format_regex=s.format_regex)


def run_tool_demo(model: Path, out_dir: str | Path, settings: ToolDemoSettings, label: str,
                  import_s: float = 0.0) -> dict[str, Any]:
    """Base eval, SFT on the transcripts, SFT eval, GRPO with the calculator, RL eval; writes
    OUT/results.json and OUT/configs/{sft,grpo}.yaml and returns the results."""
    import torch


    s = settings
    out = Path(out_dir)
    torch.set_num_threads(s.threads)
    started, cpu_started, load = time.perf_counter(), time.process_time(), _load()
    for stale in (out / "runs" / "sft", out / "runs" / "grpo"):  # a second demo starts afresh
        shutil.rmtree(stale, ignore_errors=True)
    data = write_data(out / "data", s)
    cfgs = configs(out, model, data["paths"], s)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    for name, cfg in cfgs.items():
        (out / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    held = data["heldout_rows"]
    times: dict[str, float] = {"import": import_s}

    def timed(name: str, fn: Any) -> Any:
        t = time.perf_counter()
        value = fn()
        times[name] = time.perf_counter() - t
        return value

    how = "LoRA" if s.lora else "all weights"
    console.print(f"1/5 base model: greedy episodes with the calculator on {len(held)} held-out problems")
    base = timed("base_eval", lambda: heldout_eval(model, held, s))
    _say(base, times["base_eval"])
    t = data["traces"]
    console.print(f"2/5 SFT ({how}) on {s.sft_rows} transcripts: {t['call']} use the calculator, "
                  f"{t['guess_right']} guess right, {t['guess_wrong']} guess wrong")
    _completed(timed("sft", lambda: train(cfgs["sft"])), out / "runs" / "sft")
    console.print("3/5 SFT model: the same held-out episodes")
    sft = timed("sft_eval", lambda: heldout_eval(out / "runs" / "sft" / "final", held, s))
    _say(sft, times["sft_eval"])
    console.print(f"4/5 GRPO ({how}) with the calculator: {s.rl_steps} steps x {s.prompts_per_step} prompts x "
                  f"{s.group_size} episodes; reward = right final answer (math), nothing for format")
    _completed(timed("grpo", lambda: train(cfgs["grpo"])), out / "runs" / "grpo")
    console.print("5/5 RL model: the same held-out episodes")
    rl = timed("rl_eval", lambda: heldout_eval(out / "runs" / "grpo" / "final", held, s))
    _say(rl, times["rl_eval"])
    times["total_without_import"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    results = summarize(label, {"base": base, "sft": sft, "rl": rl}, out / "runs" / "grpo" / "metrics.jsonl",
                        s, data["traces"], times)
    results["load_average"] = {"start": load, "end": _load()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    for name, evaluated in (("base", base), ("sft", sft), ("rl", rl)):  # every held-out episode, to read
        (out / f"episodes_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluated.records))
    print_results(results, out)
    return results


def run_smollm2_tool_demo(out_dir: str | Path = "demo-tools", settings: ToolDemoSettings | None = None,
                          cache: Path | None = None) -> dict[str, Any]:
    """`rlft demo --model smollm2 --tools`: SmolLM2-135M-Instruct (imported once, as the SmolLM2 demo)."""

    console.rule("[bold]rlft demo --tools: SmolLM2-135M-Instruct learns to use a calculator (SFT, then GRPO)")
    model, import_s = imported_model(cache)
    console.print(f"model: {model} ({'imported in %.0f s' % import_s if import_s else 'already imported'})")
    return run_tool_demo(model, out_dir, settings or ToolDemoSettings(), "SmolLM2-135M-Instruct", import_s)


def run_tiny_tool_demo(out_dir: str | Path = "demo-tools", settings: ToolDemoSettings | None = None) -> dict[str, Any]:
    """`rlft demo --tools`: the tiny random model's variant (TINY_SETTINGS)."""

    s = settings or TINY_SETTINGS
    console.rule("[bold]rlft demo --tools: a tiny random model learns to use a calculator (SFT, then GRPO)")
    model = build_tiny_model(Path(out_dir) / "base-model", seed=s.seed, overwrite=True, init_std=TINY_INIT_STD)
    return run_tool_demo(model, out_dir, s, "tiny (random init)")


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on Windows
        return None


def _completed(summary: dict[str, Any], run: Path) -> None:
    if summary.get("status") != "completed":
        raise RlftError(f"the tool demo's training run stopped ({summary.get('status')}); see {run}")


def _say(result: EpisodeEval, seconds: float) -> None:
    m = result.metrics
    console.print(f"    accuracy {m['accuracy']:.3f}, tool-call rate {m['tool_call_rate']:.3f}, "
                  f"tool error rate {m['tool_error_rate']:.3f} ({seconds:.0f} s)")


def summarize(label: str, evals: dict[str, EpisodeEval], metrics_path: Path, s: ToolDemoSettings,
              traces: dict[str, int], times: dict[str, float]) -> dict[str, Any]:
    correct = {name: [r["correct"] for r in e.records] for name, e in evals.items()}
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    curve = [{"step": r["step"], "correct": r.get("reward/correct"), "tool_calls": r.get("agent/tool_calls_mean"),
              "tool_error_rate": r.get("agent/tool_error_rate")} for r in rows if "reward/correct" in r]
    gains = {f"{b}_to_{a}": dict(zip(("gain", "paired_se"), paired_gain(correct[b], correct[a])))
             for b, a in (("base", "sft"), ("sft", "rl"), ("base", "rl"))}
    return {"model": label, "settings": asdict(s), "heldout_size": len(correct["base"]), "traces": traces,
            **{name: e.metrics for name, e in evals.items()}, "gains": gains, "reward_curve": curve,
            "samples": [{name: evals[name].records[i] for name in evals} for i in range(3)],
            "seconds": {k: round(v, 1) for k, v in times.items()}, "peak_rss_mb": _peak_rss_mb()}


def print_results(results: dict[str, Any], out: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{results['model']}: held-out episodes with the calculator ({results['heldout_size']} "
                        "problems never trained on; greedy)")
    for col in ("", "accuracy", "calls", "tool errors", "in form", "acc. | call", "acc. | none", "turns"):
        table.add_column(col)
    for key, label in (("base", "base"), ("sft", "SFT"), ("rl", "SFT + GRPO")):
        m = results[key]
        table.add_row(label, f"{m['accuracy']:.3f} ± {m['accuracy_se']:.3f}", f"{m['tool_call_rate']:.3f}",
                      f"{m['tool_error_rate']:.3f}", f"{m['format_compliance']:.3f}", _rate(m["accuracy_with_call"]),
                      _rate(m["accuracy_without_call"]), f"{m['turns_mean']:.2f}")
    console.print(table)
    console.print("calls: share of episodes with a tool call; tool errors: failed calls per call; in form: final "
                  "answers in the expected form; acc. | call, | none: accuracy of the episodes with / without one")
    g, sec = results["gains"], results["seconds"]
    console.print(f"RL - SFT {g['sft_to_rl']['gain']:+.3f} ± {g['sft_to_rl']['paired_se']:.3f}, RL - base "
                  f"{g['base_to_rl']['gain']:+.3f} ± {g['base_to_rl']['paired_se']:.3f} (paired s.e.)")
    console.print(f"{sec['total_without_import']:.0f} s in all (CPU {sec['cpu']:.0f} s; load average "
                  f"{results['load_average']['start']} -> {results['load_average']['end']}): base eval "
                  f"{sec['base_eval']:.0f} s, SFT {sec['sft']:.0f} s + eval {sec['sft_eval']:.0f} s, GRPO "
                  f"{sec['grpo']:.0f} s + eval {sec['rl_eval']:.0f} s")
    curve = [p for p in results["reward_curve"] if p["correct"] is not None]
    if curve:
        console.print("GRPO training episodes (share correct / calls per episode): " + "  ".join(
            f"step {p['step']}: {p['correct']:.2f}/{p['tool_calls'] or 0:.2f}" for p in curve))
    for sample in results["samples"][:2]:
        console.print(f"\n[bold]{escape(sample['base']['question'])}[/]")
        for name in ("base", "sft", "rl"):
            r = sample[name]
            turns = " | ".join(m["content"].replace("\n", " ") for m in r["transcript"])
            console.print(f"  {name:>4} ({'right' if r['correct'] else 'wrong'}): {escape(turns[:160])}")
    console.print(f"\noutputs: {out}/results.json, every held-out episode in {out}/episodes_{{base,sft,rl}}.jsonl, "
                  f"runs in {out}/runs/ (metrics.jsonl, samples.jsonl, final/), configs in {out}/configs/")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # None: no episode in that group
