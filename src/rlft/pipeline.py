"""`rlft pipeline`: stages run in order, each in its own run directory, each starting from an
earlier stage's export (e.g. sft -> dpo -> grpo, or sft -> reward_model -> ppo).

    output_dir: runs/pipeline
    stages:
      - {name: sft, config: examples/sft.yaml}
      - {name: dpo, config: examples/dpo.yaml}                      # starts from sft's final/
      - {name: grpo, config: examples/grpo.yaml, overrides: [training.max_steps=20]}

A stage starts from the previous stage's `final/` (or from the stage named in `from:`), and
`{name}` anywhere in its overrides or inline config is replaced by that stage's `final/` path
(e.g. `rewards.0.args.path={reward_model}`). A config file is looked up from the working
directory, then beside the pipeline file.

Every stage's config is built and validated before the first stage runs (each stage's `final/`
path is known in advance), so a typo in the last stage fails in seconds, not after hours of
training. Completed stages are skipped on a re-run, so a pipeline continues where it stopped; an
unfinished stage resumes from its checkpoints; a completed stage whose config has changed since
stops the pipeline rather than being silently reused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlft.api import train
from rlft.config import Config, apply_override, load_config
from rlft.config.load import load_yaml
from rlft.data.fingerprint import training_sources
from rlft.data.readers import looks_like_windows
from rlft.errors import ConfigError
from rlft.monitor.catalogue import preflight
from rlft.monitor.console import console
from rlft.monitor.rundir import RunDir
from rlft.paths import is_named_source

STAGE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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
    raw = load_yaml(path.read_text(), path) or {}
    try:
        pipeline = Pipeline.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid pipeline: {exc}") from None
    names = [s.name for s in pipeline.stages]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"{path}: stages need unique names (got {names})")
    bad = [n for n in names if not STAGE_NAME.fullmatch(n)]
    if bad:
        raise ConfigError(f"{path}: stage names become directory names; use letters, digits, '_', '-' and '.' "
                          f"(got {bad})")
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


def _read_stage_file(stage: Stage, base: Path) -> dict[str, Any]:
    for candidate in (Path(stage.config), base / stage.config):
        if candidate.is_file():
            try:
                return load_yaml(candidate.read_text(), candidate) or {}
            except ConfigError as exc:
                raise ConfigError(f"stage {stage.name}: {exc}") from None
    raise ConfigError(f"stage {stage.name}: config file not found: {stage.config} "
                      f"(looked in the working directory and in {base})")


def stage_config(stage: Stage, pipeline: Pipeline, previous: str | None, finals: dict[str, str],
                 base: Path = Path("."), extra: list[str] | None = None) -> Config:
    """`extra`: the command line's overrides, applied to every stage after its own."""
    source = stage.config if isinstance(stage.config, dict) else _read_stage_file(stage, base)
    raw = _substitute(source, finals)
    overrides = [_substitute(o, finals) for o in [*stage.overrides, *(extra or [])]]
    overrides.append(f"output_dir={Path(pipeline.output_dir) / stage.name}")
    start = stage.start_from if stage.start_from is not None else previous
    if start not in (None, "none"):
        if start not in finals:
            earlier = ", ".join(finals) or "none"
            raise ConfigError(f"stage {stage.name}: from: {start!r} is not an earlier stage (earlier: {earlier})")
        overrides.append(f"model.path={finals[start]}")
    try:
        return load_config(raw, overrides)
    except ConfigError as exc:
        where = "inline config" if isinstance(stage.config, dict) else stage.config
        raise ConfigError(f"stage {stage.name} ({where}): {exc}") from None


def plan_pipeline(path: str | Path, overrides: list[str] | None = None) -> tuple[Pipeline, list[tuple[Stage, Config]]]:
    """Every stage's resolved config, validated, before anything runs. `overrides` (a.b=value, as
    for rlft train) apply to every stage; `output_dir=DIR` sets the pipeline's own output_dir."""
    pipeline, base = load_pipeline(path)
    extra = []
    for item in overrides or []:
        apply_override({}, item)  # the syntax, checked with train's parser and messages
        key, _, value = item.partition("=")
        if key.strip() == "output_dir":
            pipeline = pipeline.model_copy(update={"output_dir": value.strip()})
        else:
            extra.append(item)
    root = Path(pipeline.output_dir)
    finals: dict[str, str] = {}
    planned, previous = [], None
    for stage in pipeline.stages:
        cfg = stage_config(stage, pipeline, previous, finals, base, extra)
        _check_stage(stage, cfg)
        planned.append((stage, cfg))
        finals[stage.name] = str(root / stage.name / "final")
        previous = stage.name
    return pipeline, planned


def _check_stage(stage: Stage, cfg: Config) -> None:
    """What a stage reads that exists before the pipeline runs (its data files) and its late
    settings (eval, best-checkpoint and early-stop metrics), checked before the first stage trains."""
    for setting, source in training_sources(cfg) + [("data.eval", cfg.data.eval)]:
        if source and not is_named_source(source) and not Path(source).exists():
            hint = (f"write it with '/' ({source!r} is a Windows-style path)" if looks_like_windows(source)
                    else "correct the path (relative paths are read from the working directory)")
            raise ConfigError(f"stage {stage.name}: {setting} not found: {source}\nFix: {hint}")
    try:
        preflight(cfg)
    except ConfigError as exc:
        raise ConfigError(f"stage {stage.name}: {exc}") from None


def _completed(stage: Stage, cfg: Config) -> dict[str, Any] | None:
    """The summary of a stage that already completed with this config; None if it has not run
    to completion. A completed stage whose config has changed is an error, not a skip."""
    run = RunDir(cfg.output_dir)
    if not run.summary_path.is_file():
        return None
    summary = json.loads(run.summary_path.read_text())
    if summary.get("status") != "completed":
        return None
    changed = run.config_changes(cfg) if run.config_path.is_file() else []
    if changed:
        raise ConfigError(
            f"stage {stage.name}: {run.root} completed with a different config ({', '.join(changed[:5])}).\n"
            f"Fix: delete {run.root} (and the stages after it) to train it again, or set another output_dir")
    return summary


def run_pipeline(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    pipeline, planned = plan_pipeline(path, overrides)
    root = Path(pipeline.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for i, (stage, cfg) in enumerate(planned, start=1):
        done = _completed(stage, cfg)
        console.rule(f"[bold]stage {i}/{len(planned)}: {stage.name} ({cfg.method})"
                     + (" - already complete, skipped" if done else ""))
        summary = done if done is not None else train(cfg)
        results[stage.name] = summary
        if summary.get("status") != "completed":
            break
    (root / "pipeline_summary.json").write_text(json.dumps(results, indent=2, default=str))
    return results
