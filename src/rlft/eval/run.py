"""`rlft eval`: accuracy / mean reward / pass@k of a model or a run on a held-out prompt file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlft.config import (AgentConfig, Config, EvalConfig, LoraConfig, ModelConfig, RewardSpec, ScoringConfig,
                         VllmSettings, load_config)
from rlft.data.prompts import PromptExample, make_prompt_encoder
from rlft.data.readers import DEFAULT_MAX_ROW_BYTES, read_rows
from rlft.data.validate import check_rows
from rlft.errors import RlftError
from rlft.eval.generation import EvalResult, evaluate_prompts
from rlft.eval.parts import EvalParts
from rlft.eval.suites import prepare_suites, run_suites
from rlft.models.loading import LoadedModel, is_adapter_export, load_adapter_export, load_policy
from rlft.monitor.catalogue import logged_only_part
from rlft.monitor.console import console
from rlft.rewards.scoring import RewardScorer, build_scorer
from rlft.rollout.agent import reward_specs


def resolve_model(target: str | Path) -> tuple[Path, Path | None]:
    """(model folder, run folder or None): a run directory evaluates its `final/` export."""
    path = Path(target)
    if (path / "config.yaml").is_file() and (path / "final").is_dir():
        return path / "final", path
    if (path / "config.yaml").is_file():
        raise RlftError(f"{path} is a run directory without a final export yet; finish or resume the run first")
    return path, None


def evaluate_model(target: str | Path, data: str, rewards: list[RewardSpec], cfg: EvalConfig, *,
                   split: str = "train", seed: int = 0, max_prompt_length: int = 4096, device: str = "auto",
                   prefix: str = "eval/", scoring: ScoringConfig | None = None,
                   max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, engine: str = "hf",
                   vllm: VllmSettings | None = None, agent: AgentConfig | None = None) -> EvalResult:
    """`agent`: each answer is a multi-turn episode with these tools and limits (a run's own agent
    section, so its numbers compare with the run's)."""
    model_dir, _ = resolve_model(target)
    rewards = reward_specs(rewards, agent)  # a verifiers environment's: its rubric's
    problem = logged_only_part(rewards, cfg.correct_component)
    if problem is not None:
        raise RlftError(problem)
    scorer = build_scorer(rewards, scoring) if rewards else None
    check_correct_component(cfg, scorer)  # before the model loads and anything is generated
    policy, examples = load_with_prompts(model_dir, data, split=split, max_prompt_length=max_prompt_length,
                                         device=device, required_fields=scorer.required_fields if scorer else (),
                                         max_row_bytes=max_row_bytes, agent=agent)
    warn_if_cut(cfg, len(examples), data)
    with EvalParts.build(policy, seed=seed, engine=engine, batch_size=cfg.batch_size, vllm=vllm, agent=agent,
                         prompt_sets=[examples], max_prompt_length=max_prompt_length, scorer=scorer) as parts:
        return evaluate_prompts(parts.engine, examples, cfg, scorer, prefix=prefix, seed=seed, driver=parts.driver)


def evaluate_suites(target: str | Path, settings: Config, *, device: str = "auto", engine: str = "hf",
                    ) -> EvalResult:
    """Every suite of `settings.eval.suites` on one model (as training runs them after its last
    step); records carry their suite's name."""
    model_dir, _ = resolve_model(target)
    policy = load_model_dir(model_dir, device)
    d = settings.data
    suites = prepare_suites(settings.eval.suites, policy.tokenizer, d.max_prompt_length, d.on_invalid,
                            settings.scoring, settings.agent)
    with EvalParts.build(policy, seed=settings.seed, engine=engine, batch_size=settings.eval.batch_size,
                         vllm=settings.rollout.vllm, agent=settings.agent, prompt_sets=[p.examples for p in suites],
                         max_prompt_length=d.max_prompt_length) as parts:
        metrics, records = run_suites(parts.engine, suites, 0, 0, settings.seed, driver=parts.driver)
    return EvalResult(metrics, [{"suite": name, **r} for name, recs in records.items() for r in recs])


def warn_if_cut(cfg: EvalConfig, rows: int, data: str) -> None:
    """Say when eval.max_examples leaves rows out: an accuracy on part of a file must not pass for
    the accuracy on all of it."""
    if cfg.max_examples is not None and rows > cfg.max_examples:
        console.print(f"[bold yellow]warning: evaluating the first {cfg.max_examples} of the {rows} rows of {data} "
                      f"(eval.max_examples={cfg.max_examples}); --max-examples all evaluates every row",
                      highlight=False)


def check_correct_component(cfg: EvalConfig, scorer: RewardScorer | None) -> None:
    """eval.correct_component must name one of the rewards (or a part `name/part` of a dict reward)."""
    name = cfg.correct_component
    if name is None or scorer is None:
        return
    names = [n for n, *_ in scorer.components]
    if not any(name == n or name.startswith(n + "/") for n in names):
        raise RlftError(f"eval.correct_component {name!r} is not a reward component (rewards: {', '.join(names)}).\n"
                        f"Fix: name one of them, e.g. eval.correct_component={names[0]}, or leave it unset to use "
                        "the first reward")


def load_model_dir(model_dir: Path, device: str = "auto") -> LoadedModel:
    """A model folder to evaluate; an adapter-only export (LoRA on a 4-bit base) as its base as
    trained plus the adapter."""
    if is_adapter_export(model_dir):
        return load_adapter_export(model_dir, device)
    return load_policy(ModelConfig(path=str(model_dir), device=device), LoraConfig())


def load_with_prompts(model_dir: Path, data: str, *, split: str = "train", max_prompt_length: int = 4096,
                      device: str = "auto", required_fields: tuple[str, ...] = (),
                      max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, agent: AgentConfig | None = None,
                      ) -> tuple[LoadedModel, list[PromptExample]]:
    """The model of a folder and the data's prompt rows, encoded with its own tokenizer and chat
    template (rows missing a field in `required_fields` are reported before anything is generated)."""
    policy = load_model_dir(model_dir, device)
    encode = make_prompt_encoder(policy.tokenizer, max_prompt_length, required_fields)
    return policy, check_rows(read_rows(data, split, max_row_bytes, agent), encode, data, "eval prompt")


def run_settings(run_dir: Path, overrides: list[str] | None = None) -> Config:
    """The config a run trained and evaluated with: its rewards, eval, scoring and data settings
    are what `rlft eval RUN` uses unless told otherwise, so its numbers compare with the run's own."""
    return load_config(run_dir / "config.yaml", overrides)


def save_run_eval(run_dir: Path, data: str, result: EvalResult, settings: dict[str, Any]) -> Path:
    """Keep an evaluation apart from the training summary: `RUN/evals/<data name>.json` with the
    settings it ran under; a later evaluation of the same data goes to `<data name>-2.json`, `-3`,
    ... (see `write_new`): evaluations with other settings never replace each other."""
    text = json.dumps({"data": data, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": settings,
                       "metrics": result.metrics}, indent=2, default=str)
    return write_new(run_dir / "evals", data_stem(data), text)


def write_new(folder: Path, stem: str, text: str) -> Path:
    """Write `text` to folder/<stem>.json, or the first of <stem>-2.json, <stem>-3.json, ... that
    does not exist yet (created exclusively: two evaluations finishing together get two files)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with path.open("x") as f:
                f.write(text)
            return path
        except FileExistsError:
            n += 1


def data_stem(data: str) -> str:
    """The name results on `data` are saved under: `heldout` for heldout.jsonl or hf:org/heldout."""
    return Path(data.removeprefix("hf:")).name.removesuffix(".jsonl").removesuffix(".parquet") or "eval"


def write_records(result: EvalResult, path: str | Path) -> None:
    with Path(path).open("w") as f:
        for rec in result.records:
            f.write(json.dumps(rec) + "\n")


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
