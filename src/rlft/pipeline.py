"""`rlft pipeline`: stages run in order, each in its own run directory, each starting from an
earlier stage's export (seed 002 §2.4: e.g. sft -> dpo -> grpo, or sft -> reward_model -> ppo).

    output_dir: runs/pipeline
    stages:
      - {name: sft, config: examples/sft.yaml}
      - {name: dpo, config: examples/dpo.yaml}                      # starts from sft's final/
      - {name: grpo, config: examples/grpo.yaml, overrides: [training.max_steps=20]}

A stage starts from the previous stage's `final/` (or from the stage named in `from:`), and
`{name}` anywhere in its overrides or inline config is replaced by that stage's `final/` path
(e.g. `rewards.0.args.path={reward_model}`). Completed stages are skipped on a re-run, so a
pipeline continues where it stopped; an unfinished stage resumes from its checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlft.config import load_config
from rlft.errors import ConfigError


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Stage name; also its run directory under the pipeline's output_dir.")
    config: str | dict[str, Any] = Field(description="A config file, or the config inline.")
    overrides: list[str] = Field(default_factory=list, description="a.b=value overrides for this stage.")
    start_from: str | None = Field(None, alias="from", description="Stage whose final/ is model.path (default: "
                                                                  "the previous one; 'none' keeps model.path).")


class Pipeline(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_dir: str
    stages: list[Stage]


def load_pipeline(path: str | Path) -> tuple[Pipeline, Path]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pipeline file not found: {path}")
    try:
        pipeline = Pipeline.model_validate(yaml.safe_load(path.read_text()) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{path}: invalid pipeline: {exc}") from None
    names = [s.name for s in pipeline.stages]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"{path}: stages need unique names (got {names})")
    return pipeline, path.parent


def _substitute(value: Any, finals: dict[str, str]) -> Any:
    if isinstance(value, str):
        for name, final in finals.items():
            value = value.replace("{" + name + "}", final)
        return value
    if isinstance(value, dict):
        return {k: _substitute(v, finals) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, finals) for v in value]
    return value


def stage_config(stage: Stage, pipeline: Pipeline, previous: str | None, finals: dict[str, str]):
    if isinstance(stage.config, dict):
        source = stage.config
    elif Path(stage.config).is_file():
        source = yaml.safe_load(Path(stage.config).read_text()) or {}
    else:
        raise ConfigError(f"stage {stage.name}: config file not found: {stage.config}")
    raw = _substitute(source, finals)
    overrides = [_substitute(o, finals) for o in stage.overrides]
    overrides.append(f"output_dir={Path(pipeline.output_dir) / stage.name}")
    start = stage.start_from if stage.start_from is not None else previous
    if start not in (None, "none"):
        if start not in finals:
            raise ConfigError(f"stage {stage.name}: from: {start!r} is not an earlier stage ({', '.join(finals)})")
        overrides.append(f"model.path={finals[start]}")
    return load_config(raw, overrides)


def run_pipeline(path: str | Path) -> dict[str, Any]:
    from rlft.api import train
    from rlft.monitor.console import console

    pipeline, _ = load_pipeline(path)
    root = Path(pipeline.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    finals: dict[str, str] = {}
    results: dict[str, Any] = {}
    previous = None
    for i, stage in enumerate(pipeline.stages, start=1):
        cfg = stage_config(stage, pipeline, previous, finals)
        run = Path(cfg.output_dir)
        summary_path = run / "summary.json"
        done = summary_path.is_file() and json.loads(summary_path.read_text()).get("status") == "completed"
        console.rule(f"[bold]stage {i}/{len(pipeline.stages)}: {stage.name} ({cfg.method})"
                     + (" - already complete, skipped" if done else ""))
        summary = json.loads(summary_path.read_text()) if done else train(cfg)
        results[stage.name] = summary
        if summary.get("status") != "completed":
            break
        finals[stage.name] = str(run / "final")
        previous = stage.name
    (root / "pipeline_summary.json").write_text(json.dumps(results, indent=2, default=str))
    return results
