"""`rlft demo`: SFT teaches the format, RL teaches being right.

The task is two-digit addition with a worked carry step ("7+8=15, carry 1. 4+3+1=8. The answer
is 85."). The SFT data comes from a sloppy annotator who forgets to add the carry in
most carry cases: SFT imitates its data, mistakes included -- the model learns the format and
to forget carries. GRPO with a verifiable reward (is the final answer right?) then teaches it to
add correctly. The held-out problems never
appear in SFT or RL data.

Everything runs through the public pipeline: a tiny model written with `save_pretrained`, YAML
configs in `OUT/configs/`, `rlft.train`, and the same evaluation as `rlft eval`.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlft.api import train
from rlft.config import load_config
from rlft.demo.arithmetic import make_datasets
from rlft.eval.run import evaluate_suites
from rlft.models.tiny import build_tiny_model
from rlft.monitor.console import console
from rlft.monitor.report import write_report

FORMAT_REGEX = r"\d\+\d=\d+, carry [01]\. \d\+\d\+[01]=\d+\. The answer is \d+\."


@dataclass(frozen=True)
class DemoSettings:
    seed: int = 0
    heldout: int = 200
    sft_rows: int = 2000
    rl_rows: int = 2000
    forget_rate: float = 0.7  # share of carry cases where the annotator drops the carry
    sft_epochs: int = 10
    sft_lr: float = 3e-3
    rl_steps: int = 50
    rl_lr: float = 1e-4
    group_size: int = 8
    prompts_per_step: int = 16
    threads: int | None = 1  # a ~1M model gains nothing from intra-op threads; on a busy machine they stall
    engine: str = "hf"  # the GRPO rollout engine: hf, or vllm
    precision: str = "auto"  # training.precision of both stages


def _rewards() -> list[dict[str, Any]]:
    return [{"fn": "math", "name": "correct", "weight": 1.0},
            {"fn": "regex", "name": "format", "weight": 0.1, "args": {"pattern": FORMAT_REGEX, "mode": "fullmatch"}}]


def _eval_section(data: dict[str, Path]) -> dict[str, Any]:
    """Held-out evaluation as two suites, run after each stage's last step: `target` (carry
    problems: what RL must fix) and `retention` (no-carry problems: what SFT taught, RL must keep)."""
    suite = {"rewards": _rewards(), "correct_component": "correct", "format_regex": FORMAT_REGEX,
             "max_examples": None, "sampling": {"max_new_tokens": 48}}
    return {"max_examples": None, "max_new_tokens": 48, "format_regex": FORMAT_REGEX, "correct_component": "correct",
            "suites": [{"name": "target", "data": str(data["heldout_carry"]), **suite},
                       {"name": "retention", "data": str(data["heldout_nocarry"]), **suite}]}


def configs(out: Path, model: Path, data: dict[str, Path], s: DemoSettings) -> dict[str, dict[str, Any]]:
    common = {"seed": s.seed, "logging": {"progress": True}, "eval": _eval_section(data), "rewards": _rewards()}
    shared = {"num_threads": s.threads} if s.threads else {}
    shared["precision"] = s.precision
    sft = {"method": "sft", "output_dir": str(out / "runs" / "sft"), "model": {"path": str(model)},
           "data": {"train": str(data["sft"])},
           "training": {"learning_rate": s.sft_lr, "batch_size": 32, "epochs": s.sft_epochs, "warmup_ratio": 0.05,
                        **shared}, **common}
    grpo = {"method": "grpo", "output_dir": str(out / "runs" / "grpo"),
            "model": {"path": str(out / "runs" / "sft" / "final")},
            "data": {"train": str(data["rl_prompts"])},
            "training": {"learning_rate": s.rl_lr, "max_steps": s.rl_steps, "lr_scheduler": "constant", **shared},
            "rollout": {"group_size": s.group_size, "prompts_per_step": s.prompts_per_step, "max_new_tokens": 48,
                        "temperature": 1.0, "engine": s.engine},
            "algorithm": {"kl_coef": 0.0}, **common}
    return {"sft": sft, "grpo": grpo}


def run_demo(out_dir: str | Path = "demo-output", settings: DemoSettings | None = None) -> dict[str, Any]:
    s = settings or DemoSettings()
    out = Path(out_dir)
    started = time.perf_counter()
    console.rule("[bold]rlft demo: SFT teaches the format, RL teaches being right")
    for stale in (out / "runs" / "sft", out / "runs" / "grpo"):  # a second demo starts afresh
        shutil.rmtree(stale, ignore_errors=True)                 # rather than "nothing to train"
    data = make_datasets(out / "data", s.seed, s.heldout, s.sft_rows, s.rl_rows, s.forget_rate)
    model = build_tiny_model(out / "base-model", seed=s.seed, overwrite=True)  # the demo's own folder
    cfgs = configs(out, model, data, s)
    (out / "configs").mkdir(exist_ok=True)
    for name, cfg in cfgs.items():
        (out / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    results: dict[str, Any] = {"seed": s.seed, "heldout_size": s.heldout}
    console.print(f"1/3 base model (random init, {_count(model)} parameters): evaluating on {s.heldout} held-out problems")
    results["base"] = _heldout(evaluate_suites(model, load_config(cfgs["sft"])).metrics)
    console.print("2/3 SFT on sloppy worked solutions (carries often forgotten)")
    results["sft"] = _heldout(train(load_config(cfgs["sft"])))  # the suites ran after its last step
    console.print("3/3 GRPO from the SFT model; reward = is the final answer right (math) + 0.1 x format")
    results["rl"] = _heldout(train(load_config(cfgs["grpo"])))
    results["reward_curve"] = _reward_curve(out / "runs" / "grpo" / "metrics.jsonl")
    for name in ("base", "sft", "rl"):
        results[f"{name}_accuracy"] = results[name]["heldout/accuracy"]
    results["seconds"] = round(time.perf_counter() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _print_table(results, out)
    report = write_report([out / "runs" / "sft", out / "runs" / "grpo"], out / "report.html")
    console.print(f"report of both runs (curves, samples, health events): {report}")
    return results


def _heldout(metrics: dict[str, Any]) -> dict[str, float]:
    """The two suites' metrics, and the whole held-out set's (the suites weighted by their sizes)."""
    out = {k: v for k, v in metrics.items() if k.startswith(("eval/target/", "eval/retention/"))}
    sizes = {name: metrics[f"eval/{name}/num_prompts"] for name in ("target", "retention")}
    for key in ("accuracy", "format_compliance", "length_mean"):
        total = sum(metrics[f"eval/{name}/{key}"] * n for name, n in sizes.items())
        out[f"heldout/{key}"] = total / sum(sizes.values())
    return out


def _count(model_dir: Path) -> str:
    from safetensors.torch import load_file

    return f"{sum(t.numel() for t in load_file(model_dir / 'model.safetensors').values()) / 1e6:.2f}M"


def _reward_curve(metrics_path: Path, points: int = 6) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rows = [r for r in rows if "reward/correct" in r]
    if not rows:
        return []
    stride = max(1, len(rows) // points)
    picked = rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])
    return [{"step": r["step"], "correct": round(r["reward/correct"], 3)} for r in picked]


def _print_table(results: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    table = Table(title=f"held-out accuracy ({results['heldout_size']} problems never seen in training)")
    for col in ("model", "accuracy", "target: carry", "retention: no carry", "format compliance",
                "mean length (tokens)"):
        table.add_column(col)
    for name, label in (("base", "base (random init)"), ("sft", "SFT (sloppy data)"), ("rl", "SFT + GRPO")):
        m = results[name]
        table.add_row(label, f"{m['heldout/accuracy']:.3f}", f"{m['eval/target/accuracy']:.3f}",
                      f"{m['eval/retention/accuracy']:.3f}", f"{m['heldout/format_compliance']:.3f}",
                      f"{m['heldout/length_mean']:.1f}")
    console.print(table)
    curve = "  ".join(f"step {p['step']}: {p['correct']:.2f}" for p in results["reward_curve"])
    console.print(f"GRPO training reward (share of correct answers): {curve}")
    gain = results["rl_accuracy"] - results["sft_accuracy"]
    console.print(f"RL - SFT = {gain:+.3f} held-out accuracy, in {results['seconds']:.0f} s")
    console.print(f"outputs: {out}/results.json, runs in {out}/runs/ (metrics.jsonl, samples.jsonl, final/), "
                  f"configs in {out}/configs/")
