"""Head-to-head win rate: `rlft eval TARGET --data FILE --compare BASELINE`.

Both models answer every prompt of the data file under the same eval settings (sampling,
max_new_tokens, num_samples) from the same seed; answer j of TARGET to a prompt is paired with
answer j of BASELINE to it. With an agent section (the run's or --config's tools, environment and
limits) each answer is a whole episode sampled through the turn driver, as `rlft eval` samples them;
the judge compares the episodes' final answers (their last assistant turns), and each pair's record
keeps both episodes (turns, tool calls, transcript). Each pair is judged one of three ways:

- rewards (`--reward`, or the run's / config's rewards): each answer is scored alone; the higher
  total reward wins, totals within 1e-9 tie. A pair where either reward is unverifiable (None) is
  left out of the win rate and counted as `unscored`.
- a judge function (`--judge module:function` or `file.py:function`), see `JUDGE_CONTRACT`. Which
  model's answer is shown as "a" is drawn per pair from the seed (`judge_positions`), so a judge
  with a position bias (LLM judges prefer the first answer: Zheng et al. 2023, arXiv:2306.05685)
  favours neither model on average; verdicts are mapped back to TARGET / BASELINE.
- an LLM judge (`--judge llm_judge`, or `--judge NAME` for the `llm_judge` reward named NAME in
  the run's or --config's rewards): the chat model behind its endpoint is shown both answers
  under its rubric, in the same seeded random order per pair as a judge function. A request that
  fails or a reply without a readable verdict leaves the pair unscored (counted, the reply kept
  in the pair's record), as an unverifiable reward does.
- a reward model (`--judge-model PATH`): the `reward_model` reward scores each answer alone, as
  with rewards.

Win rate = (wins + ties / 2) / judged pairs, with a 95% Wilson interval
(`rlft.eval.metrics.win_rate`). With num_samples > 1 the pairs of one prompt are counted as
independent, so the interval is then narrower than the prompts alone would justify.
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
import numbers
import random
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from rlft.config import AgentConfig, EvalConfig, RewardSpec, ScoringConfig, VllmSettings
from rlft.data.prompts import PromptExample
from rlft.data.readers import DEFAULT_MAX_ROW_BYTES
from rlft.errors import ConfigError, RlftError
from rlft.eval.generation import sample_answers
from rlft.eval.metrics import WinRate, win_rate
from rlft.eval.parts import EvalParts
from rlft.eval.run import load_with_prompts, resolve_model, warn_if_cut
from rlft.models.folder_checks import check_model_folder, check_reward_model_architecture, saved_architectures
from rlft.models.loading import is_adapter_export, resolve_device
from rlft.rewards.scoring import RewardScorer, build_scorer, score_completions
from rlft.rewards.user_code import describe_exception, indent, load_user_function, source_file
from rlft.rollout.contract import Completion

log = logging.getLogger(__name__)
TIE_MARGIN = 1e-9  # reward totals this close are a tie (float noise, not a preference)
JUDGE_CONTRACT = ('judge(prompt, answer_a, answer_b, **row) returns "a", "b" or "tie", or a number in [-1, 1] '
                  '(> 0: a is better, < 0: b is better, 0: tie)')
VERDICT_NAMES = {1: "win", 0: "tie", -1: "loss", None: "unscored"}  # from TARGET's side


@dataclass
class Answers:
    """One model's answers: `completions[i]` answers `examples[completions[i].prompt_index]`."""

    examples: list[PromptExample]
    completions: list[Completion]

    def example(self, i: int) -> PromptExample:
        return self.examples[self.completions[i].prompt_index]


@dataclass
class Judged:
    """Per pair: +1 TARGET better, -1 BASELINE better, 0 tie, None unscored; `details[i]` goes
    into pair i's record (scores, or what the judge was shown and said)."""

    verdicts: list[int | None]
    details: list[dict[str, Any]]


class Judge(Protocol):
    description: str
    required_fields: tuple[str, ...]  # row fields every prompt must carry

    def judge(self, target: Answers, baseline: Answers, seed: int, max_new_tokens: int) -> Judged: ...


# ---------------------------------------------------------------------------------------------
# Pure parts: verdicts, positions, the tally


def score_verdicts(target: Sequence[float | None], baseline: Sequence[float | None],
                   margin: float = TIE_MARGIN) -> list[int | None]:
    """+1 / 0 / -1 per pair from two scores (higher is better; |difference| <= margin is a tie);
    None when either score is None (unverifiable).

    >>> score_verdicts([1.0, 0.5, 0.2, None], [0.0, 0.5 + 1e-12, 0.7, 1.0])
    [1, 0, -1, None]
    """
    out: list[int | None] = []
    for t, b in zip(target, baseline, strict=True):
        out.append(None if t is None or b is None else 0 if abs(t - b) <= margin else 1 if t > b else -1)
    return out


def judge_positions(n: int, seed: int) -> list[bool]:
    """For each of n pairs, whether TARGET's answer is shown as "a" (a fair coin per pair, drawn
    from `seed` alone, so a comparison is reproducible and both models get each slot about half
    the time)."""
    rng = random.Random(seed)
    return [rng.random() < 0.5 for _ in range(n)]


def parse_judgement(value: Any, judge_name: str, where: str) -> int:
    """A judge's return value as +1 (a better), -1 (b better) or 0 (tie); anything else is one
    RlftError naming the judge, the row and the accepted values."""
    if isinstance(value, str) and value.strip().lower() in ("a", "b", "tie"):
        return {"a": 1, "b": -1, "tie": 0}[value.strip().lower()]
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and -1 <= value <= 1:
        return 0 if value == 0 else 1 if value > 0 else -1
    raise RlftError(f"judge {judge_name!r} returned {reprlib.repr(value)} ({type(value).__name__}) for {where}; "
                    f"it must return \"a\", \"b\" or \"tie\", or a number in [-1, 1]\n"
                    f"Contract: {JUDGE_CONTRACT}")


def tally(verdicts: Sequence[int | None]) -> tuple[WinRate, int]:
    """(win rate of TARGET over the judged pairs, number of unscored pairs)."""
    judged = [float(v) for v in verdicts if v is not None]
    if not judged:
        raise RlftError(f"no pair of answers could be judged: all {len(verdicts)} were unscored (a reward "
                        "returned None for every pair); check the rewards on a few rows first")
    return win_rate(judged, [0.0] * len(judged), tie_margin=0.0), len(verdicts) - len(judged)


# ---------------------------------------------------------------------------------------------
# Judges


class RewardJudge:
    """Score each answer alone with rewards (a reward model is one): the higher total wins."""

    def __init__(self, scorer: RewardScorer, description: str):
        self.scorer, self.description = scorer, description
        self.required_fields = scorer.required_fields

    def judge(self, target: Answers, baseline: Answers, seed: int, max_new_tokens: int) -> Judged:
        n = len(target.completions)
        t = score_completions(self.scorer, [target.example(i) for i in range(n)], target.completions, max_new_tokens)
        b = score_completions(self.scorer, [baseline.example(i) for i in range(n)], baseline.completions,
                              max_new_tokens)
        details = [{"target_reward": tr, "baseline_reward": br} for tr, br in zip(t.total, b.total)]
        return Judged(score_verdicts(t.total, b.total), details)


class FunctionJudge:
    """A user's `judge(prompt, answer_a, answer_b, **row)`, shown the two answers in a seeded
    random order per pair (see `judge_positions`)."""

    def __init__(self, fn: Callable[..., Any], ref: str):
        self.fn, self.ref, self.description = fn, ref, f"judge function {ref}"
        self._names, self._takes_all, self.required_fields = _judge_signature(fn, ref)

    def judge(self, target: Answers, baseline: Answers, seed: int, max_new_tokens: int) -> Judged:
        n = len(target.completions)
        first = judge_positions(n, seed)
        verdicts: list[int | None] = []
        details = []
        for i in range(n):
            example = target.example(i)
            t_text, b_text = target.completions[i].text, baseline.completions[i].text
            a, b = (t_text, b_text) if first[i] else (b_text, t_text)
            row = {**example.fields, "messages": example.messages}
            if not self._takes_all:
                row = {k: v for k, v in row.items() if k in self._names}
            try:
                value = self.fn(example.prompt_text, a, b, **row)
            except Exception as exc:  # noqa: BLE001  (the user's code: any error is theirs to see)
                raise RlftError(f"judge {self.ref!r} failed on {example.where}:\n"
                                + indent(describe_exception(exc, source_file(self.fn)))) from None
            said = parse_judgement(value, self.ref, example.where)
            verdicts.append(said if first[i] else -said)  # "a" was BASELINE's answer: flip back
            details.append({"shown_as_a": "target" if first[i] else "baseline",
                            "judge_said": value if isinstance(value, (int, float)) else str(value)})
        return Judged(verdicts, details)


class LLMPairJudge:
    """An `llm_judge` reward's model asked which of two answers is better, shown them in a seeded
    random order per pair (see `judge_positions`); no verdict leaves the pair unscored."""

    def __init__(self, llm: Any, name: str):
        self.llm, self.description = llm, f"LLM judge {name} ({llm.endpoint.model} at {llm.endpoint.url})"
        self.required_fields: tuple[str, ...] = ()  # the pairwise prompt shows no reference answer

    def judge(self, target: Answers, baseline: Answers, seed: int, max_new_tokens: int) -> Judged:
        n = len(target.completions)
        first = judge_positions(n, seed)
        items = []
        for i in range(n):
            t_text, b_text = target.completions[i].text, baseline.completions[i].text
            items.append((target.example(i).messages, *((t_text, b_text) if first[i] else (b_text, t_text))))
        verdicts: list[int | None] = []
        details = []
        for i, (said, reply) in enumerate(self.llm.compare(items)):
            a_better = {"a": 1, "b": -1, "tie": 0}.get(said) if said is not None else None
            verdicts.append(None if a_better is None else a_better if first[i] else -a_better)
            details.append({"shown_as_a": "target" if first[i] else "baseline", "judge_said": said,
                            "judge_reply": reply.text, **({"judge_error": reply.error} if reply.error else {})})
        for line in self.llm.take_warnings():
            log.warning("LLM judge: %s", line)
        return Judged(verdicts, details)


def _llm_judge(rewards: Sequence[RewardSpec], name: str, scoring: ScoringConfig | None) -> LLMPairJudge:
    """The judge of the `llm_judge` reward called `name` among `rewards` (`llm_judge`: the only one)."""
    judges = [r for r in rewards if r.fn == "llm_judge"]
    found = [r for r in judges if r.component == name or name == "llm_judge"]
    names = ", ".join(r.component for r in judges)
    if len(found) > 1:
        raise RlftError(f"--judge {name}: the rewards hold several llm_judge rewards ({names}); give --judge NAME "
                        "with one of those names")
    if not found:
        held = f" named {name!r} (they have: {names})" if judges else ""
        raise RlftError(f"--judge {name}: the run's (or --config's) rewards have no llm_judge reward{held}.\n"
                        "Fix: put the judge in a config's rewards, e.g. {fn: llm_judge, args: {base_url: "
                        "http://127.0.0.1:8000/v1, model: MODEL, rubric: ...}}, and pass --config")
    scorer = build_scorer([found[0]], scoring)  # its args checked as training checks them
    return LLMPairJudge(scorer.components[0][1], found[0].component)


def _judge_signature(fn: Callable[..., Any], ref: str) -> tuple[set[str], bool, tuple[str, ...]]:
    """(row fields it names, whether it takes **row, row fields it requires); one ConfigError when
    it cannot be called as judge(prompt, answer_a, answer_b, **row)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: call it with everything
        return set(), True, ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not takes_varargs:
        raise ConfigError(f"judge {ref!r} takes {len(positional)} positional argument(s); it is called as "
                          f"{JUDGE_CONTRACT.split(' returns')[0]}\nFix: def judge(prompt, answer_a, answer_b, **row)")
    named = [p for p in positional[3:] if p.kind != p.POSITIONAL_ONLY] + \
        [p for p in params if p.kind == p.KEYWORD_ONLY]
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
    required = tuple(p.name for p in named if p.default is p.empty and p.name != "messages")
    return {p.name for p in named}, takes_all, required


def build_judge(rewards: Sequence[RewardSpec], judge: str | None = None, judge_model: str | None = None,
                scoring: ScoringConfig | None = None, device: str = "auto") -> Judge:
    """The judge a comparison uses: a function, an LLM judge of the rewards (`judge` without a
    ':'), a reward model, or the rewards (in that order of precedence; the caller refuses
    contradictory flags)."""
    if judge and ":" not in judge:
        return _llm_judge(rewards, judge, scoring)
    if judge:
        return FunctionJudge(load_user_function(judge, what="judge"), judge)
    if judge_model:
        check_model_folder(judge_model, "--judge-model")
        check_reward_model_architecture(saved_architectures(judge_model), judge_model, "--judge-model")
        spec = RewardSpec(fn="reward_model", name="judge_model",
                          args={"path": str(judge_model), "device": str(resolve_device(device))})
        return RewardJudge(build_scorer([spec], scoring), f"reward model {judge_model}")
    if not rewards:
        raise RlftError("a comparison needs a judge: --reward NAME (repeatable; the higher total reward wins), "
                        "--judge module:function, or --judge-model REWARD_MODEL_FOLDER (or a run or --config "
                        "with rewards)")
    return RewardJudge(build_scorer(list(rewards), scoring), "rewards " + ", ".join(r.component for r in rewards))


# ---------------------------------------------------------------------------------------------
# The comparison


@dataclass
class Comparison:
    target: str
    baseline: str
    judge: str
    result: WinRate
    unscored: int
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        pairs = self.result.wins + self.result.ties + self.result.losses
        return {**self.result.metrics(), "pairs": float(pairs), "unscored": float(self.unscored)}


def model_folders(target: str | Path, baseline: str | Path) -> dict[str, Path]:
    """{"TARGET": folder, "BASELINE": folder} (a run's final/), both checked before anything loads."""

    dirs = {}
    for role, where in (("TARGET", target), ("BASELINE", baseline)):
        dirs[role], _ = resolve_model(where)
        if not is_adapter_export(dirs[role]):
            check_model_folder(str(dirs[role]), f"{role} ({where})")
    return dirs


def answer_prompts(model_dir: Path, data: str, cfg: EvalConfig, *, seed: int, split: str, max_prompt_length: int,
                   device: str, required_fields: tuple[str, ...], max_row_bytes: int, engine: str,
                   vllm: VllmSettings | None, agent: AgentConfig | None = None) -> Answers:
    """One model's answers to the data's prompts (with `agent`: whole episodes through the turn
    driver, with its tools and limits; the answer is the last assistant turn); the model is
    released before returning, so two models are never loaded at once."""
    policy, examples = load_with_prompts(model_dir, data, split=split, max_prompt_length=max_prompt_length,
                                         device=device, required_fields=required_fields, max_row_bytes=max_row_bytes,
                                         agent=agent)
    warn_if_cut(cfg, len(examples), data)
    parts = EvalParts.build(policy, seed=seed, engine=engine, batch_size=cfg.batch_size, vllm=vllm, agent=agent,
                            prompt_sets=[examples], max_prompt_length=max_prompt_length)
    try:
        examples, completions = sample_answers(parts.engine, examples, cfg, seed, driver=parts.driver)
    finally:
        parts.close()
        del policy, parts
        gc.collect()
        _empty_cuda_cache()
    return Answers(examples, completions)


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare_models(target: str | Path, baseline: str | Path, data: str, cfg: EvalConfig, judge: Judge, *,
                   seed: int = 0, split: str = "train", max_prompt_length: int = 4096, device: str = "auto",
                   max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, engine: str = "hf",
                   vllm: VllmSettings | None = None, agent: AgentConfig | None = None) -> Comparison:
    """TARGET's win rate against BASELINE on `data`'s prompts (see the module docstring); `agent`:
    both answer with episodes (a run's agent section, as `rlft eval` of the run samples them)."""
    dirs = model_folders(target, baseline)
    options = dict(seed=seed, split=split, max_prompt_length=max_prompt_length, device=device,
                   required_fields=judge.required_fields, max_row_bytes=max_row_bytes, engine=engine, vllm=vllm,
                   agent=agent)
    ours = answer_prompts(dirs["TARGET"], data, cfg, **options)
    theirs = answer_prompts(dirs["BASELINE"], data, cfg, **options)
    _check_paired(ours, theirs, data)
    judged = judge.judge(ours, theirs, seed, cfg.max_new_tokens)
    result, unscored = tally(judged.verdicts)
    records = [{"where": ours.example(i).where, "prompt": ours.example(i).prompt_text,
                "target": ours.completions[i].text, "baseline": theirs.completions[i].text,
                "target_finish": ours.completions[i].finish_reason,
                "baseline_finish": theirs.completions[i].finish_reason,
                "verdict": VERDICT_NAMES[v], **episode_record(ours, theirs, i), **detail}
               for i, (v, detail) in enumerate(zip(judged.verdicts, judged.details))]
    return Comparison(str(target), str(baseline), judge.description, result, unscored, records)


def episode_record(ours: Answers, theirs: Answers, i: int) -> dict[str, Any]:
    """Pair i's episodes, when the answers are episodes: each side's turns, tool calls and
    transcript after the prompt (its assistant and tool turns; the answer judged is the last)."""
    out: dict[str, Any] = {}
    for side, answers in (("target", ours), ("baseline", theirs)):
        episode = answers.completions[i].episode
        if episode is not None:
            out.update({f"{side}_turns": episode.turns, f"{side}_tool_calls": episode.tool_calls,
                        f"{side}_transcript": episode.messages[len(answers.example(i).messages):]})
    return out


def _check_paired(ours: Answers, theirs: Answers, data: str) -> None:
    """Both models answered the same rows the same number of times (each encodes the rows with its
    own tokenizer, so a length limit could in principle keep different rows)."""
    a = [(ours.example(i).where, c.prompt_index) for i, c in enumerate(ours.completions)]
    b = [(theirs.example(i).where, c.prompt_index) for i, c in enumerate(theirs.completions)]
    if a != b:
        raise RlftError(f"{data}: TARGET and BASELINE did not answer the same rows ({len(a)} vs {len(b)} answers); "
                        "both must accept every row (check max_prompt_length against both tokenizers)")
