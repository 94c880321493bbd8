"""The `llm_judge` reward: a chat model behind an OpenAI-compatible endpoint grades each answer by a
rubric; the same judge compares two answers for `rlft eval --compare --judge llm_judge`.

- The judge sees the rubric, the conversation that was answered (system prompt and earlier turns
  included, as the trainer passes them), the answer, optionally a reference answer (a row field,
  `reference_field`), and an instruction for the reply's form (`reply_format`: a "Score: N" line,
  a "Verdict: W" line, or a JSON object). Its reply is read by `judge_replies.parse_score`
  whatever the form asked for.
- The reward is the score mapped from `score_range` to [0, 1], or the verdict's value
  (`verdicts`). A reply without a readable score, or no reply (see `judge_http` for retries and
  time limits), is None: unverifiable, counted, and the run stops with a checkpoint once a step's
  share passes scoring.max_infra_error_rate.
- Every sample carries notes (`Scored.info`): the judge's `reply` (in samples.jsonl), the
  `error` when there was none, the judge's own number (`raw`), and 0/1 flags `failed` and
  `unparsable` whose step means are logged as `reward/<name>/failed` and `.../unparsable`.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

from rlft.rewards.judge_http import Endpoint, Reply, chat_url
from rlft.rewards.judge_replies import parse_pair_verdict, parse_score
from rlft.rewards.scores import Scored
from rlft.rewards.scoring import register_reward

REPLY_FORMATS = ("score", "verdict", "json")
DEFAULT_VERDICTS = {"correct": 1.0, "incorrect": 0.0, "yes": 1.0, "no": 0.0, "pass": 1.0, "fail": 0.0}
SHOWN_REPLY = 160  # characters of a reply quoted in a warning line


def format_conversation(messages: list[dict[str, Any]]) -> str:
    """A conversation as text the judge reads: one `### role` heading per turn.

    >>> print(format_conversation([{"role": "user", "content": "Hi"}]))
    ### user
    Hi
    """
    blocks = []
    for m in messages:
        text = m.get("content") if isinstance(m.get("content"), str) else str(m.get("content") or "")
        if m.get("tool_calls"):  # an agent's turn: what it called is part of what is judged
            text += f"\n(tool calls: {m['tool_calls']})"
        blocks.append(f"### {m.get('role', 'user')}\n{text}")
    return "\n".join(blocks)


class RubricPrompt:
    """What the judge is sent for one answer, or for a pair of answers."""

    def __init__(self, rubric: str, reply_format: str, score_range: tuple[float, float], verdicts: dict[str, float],
                 reference_field: str | None, system: str | None):
        self.rubric, self.reference_field, self.system = rubric.strip(), reference_field, system
        low, high = score_range
        words = ", ".join(verdicts)
        self.instruction = {
            "score": f'End your reply with the line "Score: N", where N is a number from {low:g} to {high:g}.',
            "verdict": f'End your reply with the line "Verdict: W", where W is one of: {words}.',
            "json": f'End your reply with a JSON object {{"score": N}}, where N is a number from {low:g} to {high:g}.',
        }[reply_format]

    def single(self, prompt: Any, completion: str, row: dict[str, Any]) -> list[dict[str, str]]:
        sections = [self.rubric, "## Conversation\n" + format_conversation(_answered(prompt, completion, row)),
                    "## Answer to grade\n" + completion]
        if self.reference_field is not None:
            sections.append("## Reference answer\n" + str(row.get(self.reference_field, "")))
        return self._messages(sections + [self.instruction])

    def pair(self, messages: list[dict[str, Any]], answer_a: str, answer_b: str) -> list[dict[str, str]]:
        return self._messages([self.rubric, "## Conversation\n" + format_conversation(messages),
                               "## Answer A\n" + answer_a, "## Answer B\n" + answer_b,
                               'Compare the two answers by the rubric above. End your reply with the line '
                               '"Verdict: A", "Verdict: B" or "Verdict: tie".'])

    def _messages(self, sections: list[str]) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": "\n\n".join(sections)}]


def _answered(prompt: Any, completion: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation the completion answers: the trainer's `messages` (an agent episode's
    transcript ends with the completion itself, which is shown once, as the answer), else the
    prompt as one user turn."""
    messages = list(row.get("messages") or [{"role": "user", "content": prompt}])
    if messages and messages[-1].get("role") == "assistant" and messages[-1].get("content") == completion:
        messages = messages[:-1]
    return messages


class LLMJudge:
    """A reward function (`fn(prompt, completion, **row)` and `fn.batch`) and a pairwise judge
    (`compare`) over one endpoint; see the module docstring."""

    def __init__(self, endpoint: Endpoint, prompt: RubricPrompt, score_range: tuple[float, float],
                 verdicts: dict[str, float]):
        self.endpoint, self.prompt, self.score_range, self.verdicts = endpoint, prompt, score_range, verdicts
        self.required_fields = (prompt.reference_field,) if prompt.reference_field else ()
        self.longest_call_s = endpoint.longest_request_s
        self.longest_call_why = (f"{endpoint.max_retries + 1} attempts of up to {endpoint.timeout_s:g}s with "
                                 f"back-off from {endpoint.backoff_s:g}s")
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "failed": 0, "unparsable": 0}
        self._first: dict[str, str] = {}

    def __call__(self, prompt: Any, completion: str, **row: Any) -> Scored:
        return self.batch([prompt], [completion], [row])[0]

    def batch(self, prompts: list[Any], completions: list[str], rows: list[dict[str, Any]]) -> list[Scored]:
        replies = self.endpoint.ask_all([self.prompt.single(p, c, r) for p, c, r in zip(prompts, completions, rows)])
        return [self._score(reply) for reply in replies]

    def compare(self, items: list[tuple[list[dict[str, Any]], str, str]]) -> list[tuple[str | None, Reply]]:
        """("a" | "b" | "tie" | None, the reply) for each (conversation, answer A, answer B)."""
        replies = self.endpoint.ask_all([self.prompt.pair(m, a, b) for m, a, b in items])
        verdicts = [parse_pair_verdict(r.text) if r.text is not None else None for r in replies]
        for verdict, reply in zip(verdicts, replies):
            self._count(reply, verdict is None)
        return list(zip(verdicts, replies))

    def _score(self, reply: Reply) -> Scored:
        parsed = parse_score(reply.text, *self.score_range, self.verdicts) if reply.text is not None else None
        self._count(reply, parsed is None)
        info = {"reply": reply.text, "error": reply.error, "raw": parsed[1] if parsed else None,
                "attempts": reply.attempts, "failed": float(reply.text is None),
                "unparsable": float(reply.text is not None and parsed is None)}
        return Scored(parsed[0] if parsed else None, info)

    def _count(self, reply: Reply, unreadable: bool) -> None:
        with self._lock:
            self._counts["calls"] += 1
            if reply.text is None:
                self._counts["failed"] += 1
                self._first.setdefault("failed", reply.error or "")
            elif unreadable:
                self._counts["unparsable"] += 1
                self._first.setdefault("unparsable", repr(reply.text[:SHOWN_REPLY]))

    def take_warnings(self) -> list[str]:
        """What went wrong since the last call (the scorer prints these once per step)."""
        with self._lock:
            counts, first = self._counts, self._first
            self._counts, self._first = {"calls": 0, "failed": 0, "unparsable": 0}, {}
        n, lines = counts["calls"], []
        if counts["failed"]:
            lines.append(f"{counts['failed']} of {n} judge requests failed; counted as unverifiable "
                         f"(first: {first['failed']})")
        if counts["unparsable"]:
            lines.append(f"{counts['unparsable']} of {n} judge replies had no readable verdict; counted as "
                         f"unverifiable (first: {first['unparsable']}; samples.jsonl keeps the replies of the samples it logs)")
        return lines


@register_reward("llm_judge")
def llm_judge(base_url: str, model: str, rubric: str, reply_format: str = "score",
              score_range: tuple[float, float] | list[float] = (0.0, 10.0), verdicts: dict[str, float] | None = None,
              reference_field: str | None = None, system: str | None = None, temperature: float = 0.0,
              max_tokens: int = 512, max_concurrency: int = 8, timeout_s: float = 15.0, max_retries: int = 2,
              backoff_s: float = 2.0, api_key_env: str | None = None) -> LLMJudge:
    """Grade answers with the chat model `model` served at `base_url` (see the module docstring).
    `api_key_env` names the environment variable holding an API key (never the key itself: the
    config is saved with the run).

    The time defaults fit scoring.timeout_s's 60 s, which must cover one sample's worst case:
    3 attempts x 15 s (512 reply tokens at ~35 tokens/s) + back-off 2 + 4 s = 51 s."""
    _check_args(rubric, reply_format, score_range, max_concurrency, timeout_s, max_retries, backoff_s, max_tokens)
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"args.model={model!r}; give the model name the endpoint serves (for `vllm serve NAME`: NAME)")
    verdicts = _check_verdicts(DEFAULT_VERDICTS if verdicts is None else verdicts)
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"args.api_key_env={api_key_env!r}, but that environment variable is not set; export "
                             "it before starting, or drop api_key_env for an endpoint without a key")
    low, high = (float(x) for x in score_range)
    endpoint = Endpoint(chat_url(base_url), model, timeout_s=timeout_s, max_retries=max_retries,
                        backoff_s=backoff_s, max_concurrency=max_concurrency, api_key=api_key,
                        sampling={"temperature": temperature, "max_tokens": max_tokens})
    prompt = RubricPrompt(rubric, reply_format, (low, high), verdicts, reference_field, system)
    return LLMJudge(endpoint, prompt, (low, high), verdicts)


def _check_args(rubric: Any, reply_format: Any, score_range: Any, max_concurrency: Any, timeout_s: Any,
                max_retries: Any, backoff_s: Any, max_tokens: Any) -> None:
    """ValueError naming the arg and its fix (build_reward turns it into a ConfigError)."""
    if not isinstance(rubric, str) or not rubric.strip():
        raise ValueError("args.rubric is empty; write what the judge should reward, e.g. rubric: 'Score how "
                         "correct and complete the answer is.'")
    if reply_format not in REPLY_FORMATS:
        raise ValueError(f"args.reply_format={reply_format!r}; choose one of {', '.join(REPLY_FORMATS)}")
    if (not isinstance(score_range, (list, tuple)) or len(score_range) != 2
            or not all(isinstance(x, (int, float)) for x in score_range) or not score_range[0] < score_range[1]):
        raise ValueError(f"args.score_range={score_range!r}; write [LOW, HIGH] with LOW < HIGH, e.g. [0, 10]")
    for name, value, least in (("max_concurrency", max_concurrency, 1), ("max_retries", max_retries, 0),
                               ("max_tokens", max_tokens, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"args.{name}={value!r}; it must be a whole number >= {least}")
    for name, value in (("timeout_s", timeout_s), ("backoff_s", backoff_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or \
                (name == "timeout_s" and value == 0):
            raise ValueError(f"args.{name}={value!r}; it must be a number of seconds"
                             + (" > 0" if name == "timeout_s" else " >= 0"))


def _check_verdicts(verdicts: Any) -> dict[str, float]:
    """Verdict words (matched in any case) and their rewards."""
    if not isinstance(verdicts, dict) or not verdicts or not all(
            isinstance(k, str) and k.strip().isalpha() and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in verdicts.items()):
        raise ValueError(f"args.verdicts={verdicts!r}; write one-word verdicts and their rewards, e.g. "
                         "{correct: 1.0, incorrect: 0.0}")
    return {k.strip().lower(): float(v) for k, v in verdicts.items()}
