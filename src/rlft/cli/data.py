"""`rlft data ...`: dataset tools that need a model -- difficulty screening and model-sampled
preference pairs -- and inter-annotator agreement of labelled pairs.

Generation and scoring go through `Plumbing`, a small Protocol; `default_plumbing` builds it from a
training config with the config's engine and rewards, and, when the config has an agent section,
whole multi-turn episodes with its tools (screening; pairs stay single-turn answers).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, List, Optional, Protocol, Sequence

import typer

from rlft.errors import ConfigError

app = typer.Typer(help="Dataset tools: difficulty screening, sampled preference pairs, annotator agreement.",
                  no_args_is_help=True, add_completion=False)


class Plumbing(Protocol):
    tokenizer: Any

    def sample(self, examples: list[Any], k: int) -> Sequence[Any]:
        """k completions per prompt example, grouped by prompt (as `Engine.generate`)."""

    def rewards(self, examples: Sequence[Any], answers: Sequence[Any]) -> Any:
        """`rlft.rewards.scoring.Scores` of answer i (a text, or the Completion `sample` returned)
        to prompt examples[i]."""


class ModelPlumbing:
    """The config's model (hf engine, rollout sampling settings) and its reward components."""

    def __init__(self, config: Any):
        from rlft.eval.parts import EvalParts
        from rlft.rollout import sampling_params
        from rlft.rollout.agent import reward_specs

        if not reward_specs(config.rewards, config.agent):
            raise ConfigError("rlft data: the config has no rewards; add e.g. rewards: [{fn: math}]")
        self.parts = EvalParts.from_config(config)  # the prompts are checked when read (`_prompts`)
        self.tokenizer, self.engine, self.driver = self.parts.policy.tokenizer, self.parts.engine, self.parts.driver
        self.scorer = self.parts.scorer
        self.params = sampling_params(config.rollout)
        self.drawn = 0  # prompts sampled so far: the next chunk's first global index (its streams)
        self.required = self.scorer.required_fields
        self.correct_component = config.eval.correct_component or self.scorer.components[0][0]

    def sample(self, examples: list[Any], k: int) -> Sequence[Any]:
        params = replace(self.params, n=k)
        first, self.drawn = self.drawn, self.drawn + len(examples)  # chunks come in order
        if self.driver is not None:  # whole episodes, scored as training scores them
            from rlft.rollout.agent.environments import EpisodeRow

            rows = [EpisodeRow(e.where, e.fields, first + i) for i, e in enumerate(examples)]
            return self.driver.run([e.messages for e in examples], params, first_prompt=first, rows=rows)
        return self.engine.generate([e.prompt_ids for e in examples], params, first_prompt=first)

    def rewards(self, examples: Sequence[Any], answers: Sequence[Any]) -> Any:
        from rlft.rewards.scoring import score_completions, scoring_row

        if answers and not isinstance(answers[0], str):  # Completions: their finish reason, length, episode
            return score_completions(self.scorer, list(examples), list(answers), self.params.max_new_tokens)
        rows = [scoring_row(e.fields, "stop", 0, self.params.max_new_tokens, e.messages, e.rendered) for e in examples]
        return self.scorer.score([e.prompt_text for e in examples], list(answers), rows)


# swapped by the caller (tests, another engine): config -> Plumbing
default_plumbing: Callable[[Any], Plumbing] = ModelPlumbing


def _prompts(config: Any, plumbing: Plumbing) -> tuple[list[Any], list[Any]]:
    """(rows, examples) of `data.train`, aligned: rows dropped by validation are dropped from both."""
    from rlft.data.prompts import make_prompt_encoder
    from rlft.data.readers import read_rows
    from rlft.data.validate import check_rows

    if not isinstance(config.data.train, str):
        raise ConfigError("rlft data: data.train lists several sources; screen or pair one file at a time "
                          "(override it: data.train=FILE)")
    rows = read_rows(config.data.train, config.data.split, agent=config.agent)
    encode = make_prompt_encoder(plumbing.tokenizer, config.data.max_prompt_length, getattr(plumbing, "required", ()))
    examples = check_rows(rows, encode, config.data.train, "prompt", config.data.on_invalid)
    parts = getattr(plumbing, "parts", None)
    if parts is not None:  # episodes: the prompts as they will be, with the tool descriptions
        parts.check_prompts(examples)
    kept = {e.where for e in examples}
    return [r for r in rows if r.where in kept], examples


def run_screen(config: Any, plumbing: Plumbing, samples: int, low: float, high: float, out: Path,
               threshold: float | None = None) -> str:
    from rlft.data.screen import screen_prompts, write_screen
    from rlft.monitor.stats import MetricAccumulator
    from rlft.rollout.agent.turns import episode_counts

    rows, examples = _prompts(config, plumbing)
    component = getattr(plumbing, "correct_component", None)
    threshold = config.eval.correct_threshold if threshold is None else threshold

    def score(example: Any, answer: Any) -> float | None:
        scores = plumbing.rewards([example], [answer])
        return scores.components[component][0] if component in scores.components else scores.total[0]

    episodes = MetricAccumulator()  # the episodes' counts, summed chunk by chunk

    def sample(chunk: list[Any], k: int) -> list[Any]:
        out = list(plumbing.sample(chunk, k))
        episodes.add(episode_counts([c for c in out if getattr(c, "episode", None) is not None]))
        return out

    try:
        result = screen_prompts(examples, sample, score, samples, low, high, threshold)
    except ValueError as exc:
        raise ConfigError(f"rlft data screen: {exc}") from None
    kept_path, rates_path = write_screen(rows, result, out)
    c = result.counts
    return (f"screened {len(examples)} prompts with {samples} samples each: kept {c['kept']}, too easy "
            f"{c['too_easy']} (> {high}), too hard {c['too_hard']} (< {low}), unscored {c['unscored']}\n"
            f"{_episodes_line(episodes.sums())}{result.histogram()}\nkept rows: {kept_path}\npass rates: {rates_path}")


def _episodes_line(counts: dict[str, float]) -> str:
    """How the screened episodes used their tools (nothing for single-turn answers)."""
    from rlft.rollout.agent.turns import episode_metrics

    if not counts.get("episodes"):
        return ""
    m = episode_metrics([], reduce=lambda _: counts)
    return (f"episodes: {m['agent/turns_mean']:.2f} turns and {m['agent/tool_calls_mean']:.2f} tool calls per "
            f"episode, tool error rate {m['agent/tool_error_rate']:.2f}\n")


def check_pairs_config(config: Any) -> None:
    if getattr(config, "agent", None) is not None:
        raise ConfigError("rlft data pairs: a preference pair holds two single-turn answers, but the config's agent "
                          "section makes each answer a multi-turn episode with tools; drop the agent section for "
                          "pairs (override: agent=null)")


def run_pairs(config: Any, plumbing: Plumbing, samples: int, margin: float, out: Path) -> str:
    from rlft.data.sampled_pairs import sample_pairs, write_pairs

    check_pairs_config(config)
    _, examples = _prompts(config, plumbing)

    def score(example: Any, texts: list[str]) -> list[float | None]:
        return plumbing.rewards([example] * len(texts), texts).total

    try:
        rows, counts = sample_pairs(examples, plumbing.sample, score, samples, margin)
    except ValueError as exc:
        raise ConfigError(f"rlft data pairs: {exc}") from None
    path = write_pairs(rows, out)
    s = counts.skipped
    return (f"{counts.pairs} pairs from {counts.prompts} prompts ({samples} samples each) -> {path}\n"
            f"skipped {counts.skipped_total}: {s['small_gap']} with a score gap <= {margin}, "
            f"{s['unscored']} with fewer than two scored samples, {s['identical']} identical best/worst")


@app.command("screen")
def screen(
    config: Path = typer.Argument(..., help="Training config: model, data.train, rewards, rollout sampling."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides: section.key=value ... (as rlft train)."),
    samples: int = typer.Option(8, "--samples", min=1, help="Completions per prompt."),
    low: float = typer.Option(0.1, "--low", help="Keep prompts with pass rate >= this."),
    high: float = typer.Option(0.9, "--high", help="... and <= this."),
    out: Path = typer.Option(..., "--out", help="JSONL of the kept rows (pass rates go next to it)."),
) -> None:
    """Keep the prompts the model solves sometimes: pass rate over SAMPLES in [LOW, HIGH]."""
    from rlft.config import load_config
    from rlft.paths import config_file_problem, output_file_problem, stop_on

    stop_on(config_file_problem(config, "CONFIG"), output_file_problem(out, "--out", "the kept rows", "kept.jsonl"))
    cfg = load_config(config, list(overrides or []))
    typer.echo(run_screen(cfg, default_plumbing(cfg), samples, low, high, out))


@app.command("pairs")
def pairs(
    config: Path = typer.Argument(..., help="Training config: model, data.train (prompts), rewards."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides: section.key=value ... (as rlft train)."),
    samples: int = typer.Option(8, "--samples", min=2, help="Completions per prompt."),
    margin: float = typer.Option(0.0, "--margin", min=0.0, help="Keep a pair when best - worst score > this."),
    out: Path = typer.Option(..., "--out", help="JSONL of preference rows {prompt, chosen, rejected, margin}."),
) -> None:
    """Preference pairs from the model's own samples: best vs worst by reward."""
    from rlft.config import load_config
    from rlft.paths import config_file_problem, output_file_problem, stop_on

    stop_on(config_file_problem(config, "CONFIG"), output_file_problem(out, "--out", "the pairs", "pairs.jsonl"))
    cfg = load_config(config, list(overrides or []))
    check_pairs_config(cfg)  # before the model loads
    typer.echo(run_pairs(cfg, default_plumbing(cfg), samples, margin, out))


@app.command("agreement")
def agreement_cmd(data: str = typer.Argument(..., help="Preference rows with a 'labels' list per row.")) -> None:
    """Percent agreement and Krippendorff's alpha of annotators' labels."""
    from rlft.data.agreement import agreement, read_labels
    from rlft.data.readers import read_rows
    from rlft.paths import data_file_problem, stop_on

    stop_on(data_file_problem(data, "DATA"))
    rows = read_rows(data)
    bad = [r for r in rows if r.data is None]
    if bad:
        raise ConfigError(f"{bad[0].where}: {bad[0].error}")
    result = agreement(read_labels(rows))
    for key, value in result.metrics().items():
        typer.echo(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


def register(app_: typer.Typer) -> None:
    app_.add_typer(app, name="data", help="Dataset tools: screen prompts by difficulty, sample preference pairs.")
