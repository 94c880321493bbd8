"""Your own agent program as the episode (`agent.program: "my_agent.py:run"`).

`async def run(client, row) -> float | dict` gets an `openai.AsyncOpenAI` client whose base URL is
the policy's endpoint for this episode (rollout/agent/endpoint.py) and the data row (its fields,
and `messages`: the prompt conversation); it runs whatever loop it likes (its tools, memory, prompt
assembly) and returns the episode's reward, or reward components (`rewards: [{fn: program}]` reads
them). The driver runs a batch's episodes concurrently in one event loop and samples their model
calls on the run's engine as they arrive.

Token-exact: the training sequences are built from the calls as recorded, never from text. A call
whose rendered prompt extends the previous call's prompt and sampled ids continues one sequence
(what lies between is inserted, loss-masked); a call that does not (the program re-rendered the
history: dropped reasoning, reformatted a tool call, cut old turns) starts a new sequence, each one
exact, and `agent/prefix_breaks` counts it. A split episode's sequences share its reward and its
group, and count once in the group's baseline (algorithms.per_episode).

A program that raises, outlives `agent.episode_timeout_s`, or never calls the model ends its
episode with nothing to train and reward 0; `agent/errors/program_*` counts each kind (as failed
tool calls are counted), `agent/program_error_rate` is their share of the step's episodes, and the
health monitor's tool_errors detector sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlft.errors import ConfigError
from rlft.rewards.user_code import load_user_function
from rlft.rollout.agent.endpoint import PolicyEndpoint, RecordedCall
from rlft.rollout.agent.environments import EpisodeRow, default_rows
from rlft.rollout.agent.tool_calls import Parser
from rlft.rollout.contract import Completion, Engine, Episode, SamplingParams

log = logging.getLogger(__name__)

_WAIT_S = 0.02  # how long the driver waits for more calls before it samples what waits


@dataclass
class Sequence_:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: str = "stop"
    text: str = ""


def episode_sequences(calls: Sequence[RecordedCall]) -> tuple[list[Sequence_], int]:
    """The training sequences of an episode's recorded calls, and how many times the prefix broke."""
    out: list[Sequence_] = []
    breaks = 0
    for call in calls:
        cur = out[-1] if out else None
        if cur is not None:
            context = cur.prompt_ids + cur.ids
            if call.prompt_ids[:len(context)] == context:
                inserted = call.prompt_ids[len(context):]
                cur.ids += inserted + call.completion_ids
                cur.logprobs += [0.0] * len(inserted) + call.logprobs
                cur.mask += [0] * len(inserted) + [1] * len(call.completion_ids)
                cur.finish, cur.text = call.finish_reason, call.text
                continue
            breaks += 1
        out.append(Sequence_(list(call.prompt_ids), list(call.completion_ids), list(call.logprobs),
                             [1] * len(call.completion_ids), call.finish_reason, call.text))
    return out, breaks


def load_program(ref: str) -> Callable[..., Any]:
    fn = load_user_function(ref, "agent program")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(f"agent.program {ref!r} must be an async function: async def run(client, row) -> "
                          "float | dict")
    return fn


class ProgramDriver:
    """The turn driver's place for `agent.program`: `run` has TurnDriver's signature."""

    def __init__(self, engine: Engine, tokenizer: Any, program: Callable[..., Any], parser: Parser,
                 max_total_tokens: int, episode_timeout_s: float, tools_block: str | None = None):
        self.engine, self.tokenizer, self.program = engine, tokenizer, program
        self.max_total_tokens, self.episode_timeout_s = max_total_tokens, episode_timeout_s
        self.endpoint = PolicyEndpoint(tokenizer, parser, tools_block)
        self.encoder = self.endpoint._encoder(None)  # prompts as rendered without tools
        # one batch at a time: an async run's sampler thread and the loop's evaluation share the driver, and
        # a batch owns the endpoint's settings, episode names and queue (and a program's batch_context)
        self._batch = threading.Lock()

    def run(self, prompts: Sequence[list[dict[str, Any]]], params: SamplingParams, first_prompt: int = 0,
            rows: Sequence[EpisodeRow] | None = None, engine: Engine | None = None) -> list[Completion]:
        with self._batch:
            return self._run(prompts, params, first_prompt, rows, engine or self.engine)

    def _run(self, prompts: Sequence[list[dict[str, Any]]], params: SamplingParams, first_prompt: int,
             rows: Sequence[EpisodeRow] | None, engine: Engine) -> list[Completion]:
        engine.generate([], params, first_prompt=first_prompt)  # this batch's call: its named streams continue it
        self.endpoint.params = params
        rows = rows or default_rows(len(prompts), first_prompt)
        episodes = [(i, k, f"e{first_prompt + i}.{k}") for i in range(len(prompts)) for k in range(params.n)]
        for *_, key in episodes:
            self.endpoint.open_episode(key, self.max_total_tokens)
        outcomes = asyncio.run(self._run_all(engine, episodes, prompts, rows))
        out = []
        for (i, _, key), (value, error) in zip(episodes, outcomes):
            out += self._completions(i, prompts[i], key, value, error)
        return out

    async def _run_all(self, engine: Engine, episodes: list[tuple[int, int, str]], prompts: Sequence[Any],
                       rows: Sequence[EpisodeRow]) -> list[tuple[Any, str | None]]:
        import openai

        batch = getattr(self.program, "batch_context", None)  # what a program holds while a batch runs
        async with batch() if batch is not None else contextlib.nullcontext():
            tasks = [asyncio.ensure_future(self._episode(openai, key, {**rows[i].fields,
                                                                       "messages": list(prompts[i])}))
                     for i, _, key in episodes]
            loop = asyncio.get_running_loop()
            while not all(t.done() for t in tasks):  # sample what the programs asked for, on this thread
                await loop.run_in_executor(None, self.endpoint.serve_pending, engine, _WAIT_S)
            return [t.result() for t in tasks]

    async def _episode(self, openai: Any, key: str, row: dict[str, Any]) -> tuple[Any, str | None]:
        client = openai.AsyncOpenAI(base_url=self.endpoint.base_url(key), api_key=self.endpoint.key, max_retries=0,
                                    timeout=self.episode_timeout_s)
        try:
            value = await asyncio.wait_for(self.program(client, row), self.episode_timeout_s)
            return value, None
        except asyncio.TimeoutError:
            log.warning("agent program episode %s ran past agent.episode_timeout_s=%s", key, self.episode_timeout_s)
            return None, "program_timeout"
        except Exception as exc:  # noqa: BLE001  (the program's own failure: counted, the batch goes on)
            log.warning("agent program episode %s raised %s: %s", key, type(exc).__name__, exc)
            return None, "program_raised"
        finally:
            await client.close()

    def _completions(self, index: int, prompt: list[dict[str, Any]], key: str, value: Any,
                     error: str | None) -> list[Completion]:
        calls = self.endpoint.take_episode(key)
        if error is None and not calls:
            error = "program_no_call"
        seqs, breaks = episode_sequences(calls)
        record = Episode(list(prompt), turns=len(calls), max_tokens=self.max_total_tokens,
                         program_reward=value if error is None else None, program_ok=error is None,
                         prefix_breaks=breaks)
        if error is not None:  # nothing of a failed episode is trained on: one masked token after its prompt
            record.errors[error] = 1
            record.ended_on_error = True
            prompt_ids = seqs[0].prompt_ids if seqs else self.encoder.prompt_ids(prompt)
            seqs = [Sequence_(prompt_ids, [self._filler()], [0.0], [0], "stop", "")]
        return [Completion(prompt_ids=s.prompt_ids, completion_ids=s.ids, text=s.text, logprobs=s.logprobs,
                           finish_reason=s.finish, prompt_index=index,
                           loss_mask=s.mask, episode=record) for s in seqs]

    def _filler(self) -> int:
        """A token for an episode with nothing sampled (trained on with mask 0: nothing)."""
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else 0

    def close(self) -> None:
        self.endpoint.close()


def program_driver(cfg: Any, engine: Engine, tokenizer: Any, parser: Parser,
                   program: Callable[..., Any] | None = None) -> ProgramDriver:
    """The driver of `agent.program` (or of `program`, an environment's episode program)."""
    driver = ProgramDriver(engine, tokenizer, program or load_program(cfg.program), parser, cfg.max_total_tokens,
                           cfg.episode_timeout_s, cfg.tools_prompt)
    log.info("agent endpoint on 127.0.0.1:%d", driver.endpoint.port)
    return driver
