"""`rlft eval`: accuracy / mean reward / pass@k of a model or a run on a held-out prompt file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlft.config import EvalConfig, LoraConfig, ModelConfig, RewardSpec
from rlft.data.readers import read_rows
from rlft.data.prompts import make_prompt_encoder
from rlft.data.validate import check_rows
from rlft.errors import RlftError
from rlft.eval.generation import EvalResult, evaluate_prompts
from rlft.models.loading import load_policy
from rlft.rewards.scoring import RewardScorer
from rlft.rollout import build_engine


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
                   prefix: str = "eval/", write_summary: bool = True) -> EvalResult:
    model_dir, run_dir = resolve_model(target)
    policy = load_policy(ModelConfig(path=str(model_dir), device=device), LoraConfig())
    scorer = RewardScorer(rewards) if rewards else None
    encode = make_prompt_encoder(policy.tokenizer, max_prompt_length, scorer.required_fields if scorer else ())
    examples = check_rows(read_rows(data, split), encode, data, "eval prompt")
    engine = build_engine(policy, seed, batch_size=cfg.batch_size)
    result = evaluate_prompts(engine, examples, cfg, scorer, prefix=prefix, seed=seed)
    if run_dir is not None and write_summary:
        from rlft.monitor.rundir import RunDir

        RunDir(run_dir).update_summary({**result.metrics, f"{prefix}data": str(data)})
    return result


def write_records(result: EvalResult, path: str | Path) -> None:
    with Path(path).open("w") as f:
        for rec in result.records:
            f.write(json.dumps(rec) + "\n")


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
