"""Multi-turn episodes with tools, token-exact: the turn driver between an engine and the collector.

    prompt -> [sample a turn -> parse calls -> run tools -> insert the observation]* -> Completion

With an environment (rollout/agent/environments.py), a turn without tool calls is its action instead:
the environment steps on the turn's text, its reward is recorded, and its observation is inserted
as a `user` message the same way, until it is done. An environment call has a time limit
(agent.env_step_timeout_s): a late step ends its episode there, a late reset stops the run.

Token-in, token-out: the sequence trained on is the prompt, then each turn's sampled ids as the
engine returned them, then each observation's ids, encoded once. History is never decoded and
re-encoded (the drift behind trl#5224 and verl#3720), so what the loss sees is what was sampled.
The Completion's `loss_mask` is 1 on sampled ids and 0 on observation ids; RolloutBatch makes it
the loss mask of every loss and metric, and sampling log-probs of observation ids are 0.

An observation is what the chat template puts between the assistant's end-of-turn and the next
assistant header, tool messages included: the tail of one render after a marker standing for the
assistant's text. When the turn ended on the template's end-of-turn token, that token is already
in the sampled ids and is left out of the tail; otherwise (EOS, a stop string) the tail brings it.

Limits: `max_turns` assistant turns; `max_total_tokens`, one budget for everything after the
prompt (sampled and inserted tokens): a turn is cut where the budget ends (a prefix of a sample is
a sample; the episode ends as 'length'), and an observation that would fill it ends the episode as
truncated, never inserted in part. Schedules (agent.schedule): `rounds` samples the turns of all live
episodes in one engine call per round (n=1 each) and runs the round's calls before the next;
`continuous` hands each turn to the engine's continuous batch (rollout/continuous.py) as soon as
its episode's calls have returned, so a slow call holds up only its own episode. A later turn's
sampling stream is named by (global prompt index, sample, turn) within the request the first turn
made, so an episode is the same whichever episodes share its rounds (or decode steps) and
whichever rank runs it.

The re-render check (`check_drift`) measures what a decode-and-re-encode pipeline would have
trained on instead: the finished transcript through the template, tokenized, against the trained
sequence; `agent/retokenize_drift` is the mean number of trained tokens from the first
difference on (a sampled text the tokenizer would split differently shows up there).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlft.errors import ConfigError
from rlft.models.template import Messages, encode_text, end_of_turn_ids
from rlft.rollout.agent.environments import (EnvironmentSource, EpisodeEnv, EpisodeRow, default_rows, env_counts,
                                             env_metrics)
from rlft.rollout.agent.tool_calls import Parser, hermes
from rlft.rollout.agent.tools import (EPISODE_ERRORS, ERROR_KINDS, PROGRAM_ERRORS, PendingCall, Tool, ToolResult,
                                     start_call)
from rlft.rollout.continuous import TurnRequest
from rlft.rollout.contract import Completion, Engine, Episode, SamplingParams

_MARKER = "\x00RLFT_ASSISTANT\x00"
_PROBE: Messages = [{"role": "user", "content": "What is 2 + 3?"}]

TOOLS_BLOCK = (
    "You can call tools. Their JSON schemas:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, {syntax} and end your turn; each result comes back in a tool message. When you are done, "
    "answer without a call.")


def signature(schema: dict[str, Any]) -> str:
    """One line for a tool: `name(arg: type, opt?: type): description` (a compact {signatures} entry;
    the JSON schemas cost a small model's prompt ~100 tokens a tool)."""
    fn = schema["function"]
    params = fn.get("parameters", {})
    required = set(params.get("required", []))
    args = ", ".join(f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
                     for name, spec in params.get("properties", {}).items())
    return f"{fn['name']}({args}): {fn.get('description', '').strip()}".rstrip(": ")


def tools_block(block: str, schemas: list[dict[str, Any]], call_syntax: str) -> str:
    """`block` with its fields filled in by plain replacement (no format string: a block may hold
    JSON braces as they are)."""
    return (block.replace("{schemas}", "\n".join(json.dumps(s) for s in schemas))
            .replace("{signatures}", "\n".join(signature(s) for s in schemas)).replace("{syntax}", call_syntax))


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024
    max_tool_output_tokens: int = 256
    tool_timeout_s: float = 10.0
    max_calls_per_turn: int = 4
    on_tool_error: str = "observe"  # 'end': a turn with a failed call ends the episode (agent.on_tool_error)
    env_step_timeout_s: float = 60.0  # per environment reset / step (agent.env_step_timeout_s)


class ObservationEncoder:
    """Prompts and observations through the chat template, tools presented the template's way (its
    `tools=` argument) or, for a template without tool support, as a system block (`block`, by default
    TOOLS_BLOCK; agent.tools_prompt) that teaches `call_syntax`, the parser's own (tool_calls.py)."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], call_syntax: str = hermes.syntax,
                 block: str | None = None):
        self.tokenizer, self.schemas, self.call_syntax = tokenizer, schemas, call_syntax
        self.block = TOOLS_BLOCK if block is None else block
        plain = self._apply(_PROBE, True, None)
        self.native_tools = bool(schemas) and self._apply(_PROBE, True, schemas) != plain
        self.eot_ids = set(end_of_turn_ids(tokenizer))
        self._check_template()

    def _apply(self, messages: Messages, generation: bool, tools: list[dict] | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)

    def with_tools(self, messages: Messages) -> Messages:
        if not self.schemas or self.native_tools:
            return list(messages)
        block = tools_block(self.block, self.schemas, self.call_syntax)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]

    def render(self, messages: Messages, generation: bool) -> str:
        return self._apply(self.with_tools(messages), generation, self.schemas if self.native_tools else None)

    def prompt_ids(self, messages: Messages) -> list[int]:
        return encode_text(self.tokenizer, self.render(messages, True))

    def observation_ids(self, prompt: Messages, tool_messages: Messages, last_sampled: int | None) -> list[int]:
        text = self.render([*prompt, {"role": "assistant", "content": _MARKER}, *tool_messages], True)
        tail = text[text.index(_MARKER) + len(_MARKER):]
        ids = encode_text(self.tokenizer, tail)
        if last_sampled is not None and last_sampled in self.eot_ids and ids and ids[0] == last_sampled:
            ids = ids[1:]  # the model sampled the end-of-turn token itself
        return ids

    def turn_end_id(self) -> int | None:
        """The token a sampled turn ends on: the one the template puts right after the assistant's
        text when it ends turns (ChatML's <|im_end|>), else EOS (the observation tail then brings
        the template's own ending); None when there is neither."""
        text = self.render([*_PROBE, {"role": "assistant", "content": _MARKER}], False)
        tail = encode_text(self.tokenizer, text.split(_MARKER, 1)[1])
        if tail and tail[0] in self.eot_ids:
            return tail[0]
        return self.tokenizer.eos_token_id

    def _check_template(self) -> None:
        """Refuse at start-up a template this driver cannot insert observations with."""
        prompt = self.render(_PROBE, True)
        probe_tool = [{"role": "tool", "name": "probe", "content": "RLFT_TOOL_OUTPUT"}]
        full = self.render([*_PROBE, {"role": "assistant", "content": _MARKER}, *probe_tool], True)
        fix = ("Fix: set model.chat_template to a template that renders assistant turns and 'tool' messages "
               "(e.g. ChatML), or use the model's own instruct template.")
        if _MARKER not in full or "RLFT_TOOL_OUTPUT" not in full.split(_MARKER, 1)[1]:
            raise ConfigError("agent: the chat template drops the assistant's text or 'tool' messages from a "
                              f"conversation, so tool results cannot be shown to the model.\n{fix}")
        if not full.split(_MARKER, 1)[0].startswith(prompt):  # the prompt as sampled from must stay as it was
            raise ConfigError("agent: the chat template renders a conversation's earlier part differently once a "
                              f"later turn is added (not prefix-preserving), so turns cannot be appended.\n{fix}")


@dataclass
class _Live:
    """One episode being built."""

    index: int  # episode number in the request
    prompt_index: int
    prompt: Messages
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt  # [L]
    logprobs: list[float] = field(default_factory=list)  # [L], 0 on inserted ids
    mask: list[int] = field(default_factory=list)  # [L], 1 on sampled ids
    record: Episode | None = None
    last_text: str = ""
    finish: str = "stop"
    env: EpisodeEnv | None = None  # its environment instance, if the driver has one


class TurnDriver:
    """Samples whole episodes: `run(prompts, params)` returns params.n Completions per prompt,
    grouped by prompt like `Engine.generate`, each one whole episode. `schedule`: 'rounds' (every
    live episode's next turn in one engine call, after the slowest call of the round) or
    'continuous' (each turn joins the engine's batch when its episode is ready; an engine without
    a continuous batch keeps rounds). `should_stop`: polled while an environment call runs (a
    Ctrl-C: ScoringInterrupted, as while rewards run)."""

    STEPS_PER_POLL = 8  # continuous: decode steps between looks at the running tool calls

    def __init__(self, engine: Engine, tokenizer: Any, tools: list[Tool], parser: Parser,
                 limits: AgentLimits = AgentLimits(), check_drift: bool = True,
                 environment: EnvironmentSource | None = None, tools_prompt: str | None = None,
                 schedule: str = "rounds", should_stop: Callable[[], bool] | None = None):
        self.engine, self.tokenizer, self.parser, self.limits = engine, tokenizer, parser, limits
        self.schedule, self.should_stop = schedule, should_stop
        self.check_drift, self.environment = check_drift, environment
        self.tools = {t.name: t for t in tools}
        self.encoder = ObservationEncoder(tokenizer, [t.schema for t in tools], parser.syntax, tools_prompt)

    def run(self, prompts: Sequence[Messages], params: SamplingParams, first_prompt: int = 0,
            rows: Sequence[EpisodeRow] | None = None, engine: Engine | None = None) -> list[Completion]:
        """`rows`: each prompt's row, which an environment is started from (default: no fields).
        `engine`: what this call's turns sample from, when not the driver's own (an async run's
        evaluations sample on the loop's engine while its sampler thread uses the driver's)."""
        engine = engine or self.engine
        lim = self.limits
        prompts, envs = self._start_environments(prompts, params.n, first_prompt, rows)
        prompt_ids = [self.encoder.prompt_ids(m) for m in prompts]
        if self.environment is not None:  # a first observation may have lengthened the prompt
            for row, ids in zip(rows or default_rows(len(prompts), first_prompt), prompt_ids):
                self.environment.check_prompt(row, len(ids))
        live = [_Live(i * params.n + k, i, list(m), ids, env=envs[i][k],
                      record=Episode(list(m), max_tokens=lim.max_total_tokens,
                                     env_rewards=None if envs[i][k] is None else []))
                for i, (m, ids) in enumerate(zip(prompts, prompt_ids)) for k in range(params.n)]
        opener = getattr(engine, "continuous", None) if self.schedule == "continuous" else None
        batch = None if opener is None else opener(params)
        if batch is None:
            self._rounds(engine, live, params, first_prompt)
        else:
            self._continuous(batch, live, params, first_prompt)
        if self.check_drift:
            for ep in live:
                ep.record.retokenize_drift = self._drift(ep)
        return [self._completion(e) for e in live]

    def _rounds(self, engine: Engine, live: list[_Live], params: SamplingParams, first_prompt: int) -> None:
        """Every live episode's next turn in one engine call, then every call of the round."""
        lim, turn = self.limits, 0
        while live:
            turn += 1
            budget = max(lim.max_total_tokens - len(e.ids) for e in live)
            turn_params = dataclasses.replace(params, n=params.n if turn == 1 else 1,
                                              max_new_tokens=min(params.max_new_tokens, budget))
            if turn == 1:
                outs = engine.generate([e.prompt_ids for e in live[::params.n]], turn_params,
                                            first_prompt=first_prompt)
            else:
                outs = engine.generate([e.prompt_ids + e.ids for e in live], turn_params,
                                            streams=[self._stream_name(e, params.n, first_prompt, turn) for e in live])
            wanting: list[tuple[_Live, list]] = []
            going_on = []
            for ep, out in zip(live, outs):
                calls = self._take_turn(ep, out, turn, params.stop)
                if calls:
                    wanting.append((ep, self._start_calls(calls)))
                elif self._acts(ep) and self._step_environment(ep, turn):
                    going_on.append(ep)
            going_on += [ep for ep, started in wanting if self._observe(ep, started)]
            live = sorted(going_on, key=lambda e: e.index)  # each round's requests in episode order

    def _continuous(self, batch: Any, live: list[_Live], params: SamplingParams, first_prompt: int) -> None:
        """Each episode's next turn joins the engine's batch as soon as the episode can take it (its
        calls returned), while the other episodes keep decoding (rollout/continuous.py)."""
        n = params.n

        def request(ep: _Live) -> TurnRequest:
            turn = ep.record.turns + 1
            room = min(params.max_new_tokens, self.limits.max_total_tokens - len(ep.ids))
            if turn == 1:
                return TurnRequest(ep.index, ep.prompt_ids, room, ep.prompt_index,
                                   index=(first_prompt + ep.prompt_index) * n + ep.index % n, share=ep.prompt_index)
            return TurnRequest(ep.index, ep.prompt_ids + ep.ids, room, ep.prompt_index,
                               name=self._stream_name(ep, n, first_prompt, turn))

        by_index = {ep.index: ep for ep in live}
        batch.add([request(ep) for ep in live])
        waiting: list[tuple[_Live, list]] = []  # episodes whose calls are running
        busy = True
        while busy or waiting:
            answered = [w for w in waiting if all(call.ready(self.limits.tool_timeout_s) for _, call in w[1])]
            if answered:
                waiting = [w for w in waiting if w not in answered]
                batch.add([request(ep) for ep, started in answered if self._observe(ep, started)])
                busy = True
            if not busy:  # every episode waits on a tool: sleep until one of them returns
                PendingCall.wait_any([[call for _, call in started] for _, started in waiting],
                                     self.limits.tool_timeout_s)
                continue
            finished, busy = batch.step(self.STEPS_PER_POLL)
            for key, out in finished:
                ep = by_index[key]
                turn = ep.record.turns + 1
                calls = self._take_turn(ep, out, turn, params.stop)
                if calls:
                    waiting.append((ep, self._start_calls(calls)))
                elif self._acts(ep) and self._step_environment(ep, turn):
                    batch.add([request(ep)])
                    busy = True

    @staticmethod
    def _stream_name(ep: _Live, n: int, first_prompt: int, turn: int) -> str:
        """A later turn's sampling stream: (global prompt index, sample, turn)."""
        return f"{first_prompt + ep.prompt_index}/{ep.index - ep.prompt_index * n}/{turn}"

    @staticmethod
    def _acts(ep: _Live) -> bool:
        """A turn without calls that the episode's environment answers (a turn cut by a length
        limit is no finished action)."""
        return ep.env is not None and ep.finish == "stop" and not ep.record.max_turns_reached

    def _start_environments(self, prompts: Sequence[Messages], n: int, first_prompt: int,
                            rows: Sequence[EpisodeRow] | None) -> tuple[list[Messages], list[list]]:
        """Each prompt's group of environment instances, reset, and its prompt (a first observation
        takes the place of the row's last message); [None] * n per prompt without an environment."""
        if self.environment is None:
            return list(prompts), [[None] * n for _ in prompts]
        rows = rows or default_rows(len(prompts), first_prompt)
        started = [self.environment.start(m, row, n, self.limits.env_step_timeout_s, self.should_stop)
                   for m, row in zip(prompts, rows)]
        return [m for m, _ in started], [envs for _, envs in started]

    def _step_environment(self, ep: _Live, turn: int) -> bool:
        """Step the episode's environment on its turn's text; whether it goes on, with the
        observation inserted as a user message."""
        result = ep.env.step(ep.last_text, self.limits.env_step_timeout_s, self.should_stop)
        record = ep.record
        if result is None:  # late: ends as a late tool call under on_tool_error=end ('stop', nothing inserted)
            record.env_timed_out = True
            return False
        record.env_rewards.append(result.reward)
        # the last allowed turn's action still earns its reward; its observation has no reader
        if result.done or turn >= self.limits.max_turns:
            record.env_done, record.max_turns_reached = result.done, not result.done
            record.env_final = result.observation
            return False
        inserted = self._insert(ep, [{"role": "user", "content": result.observation}])
        if inserted is None:
            record.env_final = result.observation
            return False
        record.env_tokens += inserted
        return True

    def _drift(self, ep: _Live) -> int:
        """Trained tokens from the first one where the re-rendered transcript's tokens differ."""
        # an assistant turn's calls are in its text already; a template would render tool_calls twice
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in ep.record.messages]
        rendered = encode_text(self.tokenizer, self.encoder.render(messages, False))
        trained = ep.prompt_ids + ep.ids
        same = 0
        for a, b in zip(rendered, trained):
            if a != b:
                break
            same += 1
        return len(trained) - same

    def _take_turn(self, ep: _Live, out: Completion, turn: int, stop: tuple[str, ...] = ()) -> list:
        """Append the sampled turn; the calls it makes when the episode goes on, else []."""
        room = self.limits.max_total_tokens - len(ep.ids)
        ids, logprobs, text, finish = out.completion_ids, out.logprobs, out.text, out.finish_reason
        if len(ids) > room:  # cut where the budget ends: the first `room` tokens are a sample as well
            ids, logprobs, finish = ids[:room], logprobs[:room], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ep.ids += ids
        ep.logprobs += logprobs
        ep.mask += [1] * len(ids)
        ep.last_text, ep.finish = text, finish
        ep.record.turns = turn
        # parsed from every sampled token: an engine's text stops before a stop string, the ids do not
        full = self.tokenizer.decode(ids, skip_special_tokens=True) if stop else text
        calls = self.parser(full) if finish == "stop" else []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        valid = [c for c in calls if c.error is None]
        if valid:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in valid]
        ep.record.messages.append(message)
        if calls and turn >= self.limits.max_turns:
            ep.record.max_turns_reached = True
            return []
        return calls

    def _start_calls(self, calls: list) -> list[tuple[str, PendingCall]]:
        """Start a turn's calls, each in its own thread (an unreadable or surplus call gets its
        error result at once)."""
        lim = self.limits
        started = []
        for i, call in enumerate(calls):
            if i >= lim.max_calls_per_turn:
                result = ToolResult(f"Error: at most {lim.max_calls_per_turn} tool calls per turn", "too_many_calls")
            elif call.error is not None:
                result = ToolResult(f"Error: the tool call could not be read; to call a tool, {self.parser.syntax}",
                                    call.error)
            else:
                started.append((call.name, start_call(self.tools, call.name, call.arguments)))
                continue
            started.append((call.name or "?", PendingCall(result)))
        return started

    def _observe(self, ep: _Live, started: list[tuple[str, PendingCall]]) -> bool:
        """Collect a turn's calls (each under its time limit) and append their observation;
        whether the episode goes on."""
        lim = self.limits
        messages, failed = [], False
        for name, call in started:
            result = call.result(lim.tool_timeout_s)
            ep.record.tool_calls += 1
            if result.error is not None:
                ep.record.errors[result.error] = ep.record.errors.get(result.error, 0) + 1
                failed = True
            if call.immediate is None:
                ep.record.tool_latency_s.append(result.seconds)
            messages.append({"role": "tool", "name": name,
                             "content": cut_tool_output(self.tokenizer, result.text, lim.max_tool_output_tokens)})
        if failed and lim.on_tool_error == "end":  # ends as the model left it: 'stop', no results shown
            ep.record.ended_on_error = True
            return False
        inserted = self._insert(ep, messages)
        if inserted is None:
            return False
        ep.record.tool_tokens += inserted
        return True

    def _insert(self, ep: _Live, messages: Messages) -> int | None:
        """Append an observation (its ids encoded once, loss-masked) and its messages; the number of
        ids inserted, or None when it would leave no room for a reply (the episode ends there)."""
        obs = self.encoder.observation_ids(ep.prompt, messages, ep.ids[-1] if ep.ids else None)
        if len(ep.ids) + len(obs) >= self.limits.max_total_tokens:
            ep.record.budget_truncated, ep.finish = True, "length"  # the transcript ends as the model saw it
            return None
        ep.record.messages += messages
        ep.ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [0] * len(obs)
        return len(obs)

    @staticmethod
    def _completion(ep: _Live) -> Completion:
        return Completion(prompt_ids=ep.prompt_ids, completion_ids=ep.ids, text=ep.last_text, logprobs=ep.logprobs,
                          finish_reason=ep.finish, prompt_index=ep.prompt_index, loss_mask=ep.mask, episode=ep.record)


def cut_tool_output(tokenizer: Any, text: str, limit: int) -> str:
    """Tool output beyond `limit` tokens is cut there, with a marker the model can read (rollouts and
    SFT transcripts alike, so the model is trained on the results it will be shown)."""
    ids = encode_text(tokenizer, text)
    if len(ids) <= limit:
        return text
    return tokenizer.decode(ids[:limit]) + f"\n[output cut: {len(ids) - limit} more tokens]"


def episode_counts(completions: Sequence[Completion]) -> dict[str, float]:
    """What `episode_metrics` divides: sums over the episodes (and the slowest call), which add up
    over ranks (a key ending in 'max' takes the maximum, as MetricAccumulator.reduce does)."""
    records = list({id(c.episode): c.episode for c in completions if c.episode is not None}.values())  # a split
    # program episode is several completions with one record
    latency = [s for r in records for s in r.tool_latency_s]
    drift = [r.retokenize_drift for r in records if r.retokenize_drift is not None]
    counts = {"episodes": float(len(records)), "turns": float(sum(r.turns for r in records)),
              "tool_calls": float(sum(r.tool_calls for r in records)),
              "tool_tokens": float(sum(r.tool_tokens for r in records)),
              "tokens": float(sum(len(c.completion_ids) for c in completions if c.episode is not None)),
              "budget_truncated": float(sum(r.budget_truncated for r in records)),
              "max_turns_reached": float(sum(r.max_turns_reached for r in records)),
              "ended_on_error": float(sum(r.ended_on_error for r in records)),
              "latency_sum": sum(latency), "latency_n": float(len(latency)), "latency_max": max(latency, default=0.0),
              "drift_sum": float(sum(drift)), "drift_n": float(len(drift)), "drifted": float(sum(d > 0 for d in drift)),
              "prefix_breaks": float(sum(r.prefix_breaks for r in records)),
              "programs": float(sum(r.program_ok is not None for r in records))}
    counts.update({f"errors/{kind}": float(sum(r.errors.get(kind, 0) for r in records)) for kind in EPISODE_ERRORS})
    counts.update(env_counts(records))
    return counts


def episode_metrics(completions: Sequence[Completion], reduce: Any = None) -> dict[str, float]:
    """A step's agent metrics: turns and calls per episode, tool errors by kind (counts, and the
    share of calls that failed), the share of inserted tokens, budget truncations, tool latency.
    `reduce`: counts -> counts summed over every rank's episodes (a distributed run), so the
    metrics are the whole step's; every rank must call it (it runs collectives)."""
    c = episode_counts(completions)
    if reduce is not None:
        c = reduce(c)
    n, calls = c["episodes"], c["tool_calls"]
    if not n:
        return {}
    # every kind a run can have, zeros included (a detector sums the last steps of each): the program
    # kinds when its episodes are an agent program's
    errors = {kind: c[f"errors/{kind}"] for kind in EPISODE_ERRORS
              if kind in ERROR_KINDS or c[f"errors/{kind}"] or (kind in PROGRAM_ERRORS and c["programs"])}
    out = {"agent/turns_mean": c["turns"] / n,
           "agent/tool_calls_mean": calls / n,
           "agent/tool_error_rate": sum(errors.get(k, 0.0) for k in ERROR_KINDS) / calls if calls else 0.0,
           "agent/tool_token_frac": c["tool_tokens"] / max(c["tokens"], 1.0),
           "agent/budget_truncated": c["budget_truncated"],
           "agent/max_turns_reached": c["max_turns_reached"],
           "agent/ended_on_error": c["ended_on_error"],
           "agent/tool_latency_mean_s": c["latency_sum"] / c["latency_n"] if c["latency_n"] else 0.0,
           "agent/tool_latency_max_s": c["latency_max"]}
    if c["programs"]:  # an agent program's episodes: the share that raised, timed out or never called the model
        out["agent/program_error_rate"] = sum(c[f"errors/{kind}"] for kind in PROGRAM_ERRORS) / c["programs"]
    if c["prefix_breaks"]:
        out["agent/prefix_breaks"] = c["prefix_breaks"]
    if c["drift_n"]:
        out["agent/retokenize_drift"] = c["drift_sum"] / c["drift_n"]
        out["agent/retokenize_drift_frac"] = c["drifted"] / c["drift_n"]
    out.update({f"agent/errors/{kind}": count for kind, count in errors.items()})
    out.update(env_metrics(c))
    return out
