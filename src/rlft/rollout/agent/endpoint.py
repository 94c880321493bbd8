"""An OpenAI-compatible endpoint in front of the policy, for agent programs (`agent.program`).

FastAPI on uvicorn, bound to 127.0.0.1 with a key made per run. Each episode gets its own base URL,
`http://127.0.0.1:PORT/episodes/<key>/v1`, so every call is recorded for its episode: the prompt ids
as rendered (the policy's chat template, tools given the template's way or as the driver's tools
block), the sampled ids and their log-probs, and the reason the turn ended. Routes:
- POST /v1/chat/completions: `messages` (system, user, assistant with `tool_calls`, tool), `tools`
  (function tools), `tool_choice` auto/none, `max_tokens` / `max_completion_tokens`, `stop`,
  `temperature` (only the run's), `n` (1), `stream` (with `stream_options.include_usage`: the
  whole reply, sampled first, sent as server-sent chunks as OpenAI streams one); the reply's
  `tool_calls` are parsed from the sampled text with the run's tool-call parser;
- POST /v1/completions: `prompt` as text or token ids, the same sampling fields;
- GET /v1/models.
Anything else in a request is refused with a 400 that names the field (never a crash).

The endpoint never samples by itself: requests wait in a queue that the driver's thread drains
(`serve_pending`), calling the run's engine with each request on a named sampling stream (its
episode and call number), so an episode's samples do not depend on how requests were batched.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request  # the openai extra; this module is imported only for agent.program
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlft.rollout.agent.local_server import serve_in_thread
from rlft.rollout.agent.tool_calls import Parser
from rlft.rollout.agent.turns import ObservationEncoder
from rlft.rollout.contract import Completion, SamplingParams



class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # include_usage: a last chunk with the usage
    user: str | None = None
    logprobs: bool | None = None  # recorded either way; the reply carries none


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Request):
    prompt: str | list[int]


@dataclass
class RecordedCall:
    """One model call of an episode, as sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


@dataclass
class _LastCall:
    """An episode's last chat call, to continue it without re-encoding what was sampled."""

    sent: str  # its messages as sent (JSON)
    count: int
    messages: list[dict[str, Any]]  # as the template read them
    prompt_ids: list[int]
    sampled: list[int]
    reply: str  # the reply's key (_message_key)
    encoder: Any


@dataclass
class _Pending:
    episode: str
    prompt_ids: list[int]
    params: SamplingParams
    name: str  # its sampling stream
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None


class RequestError(ValueError):
    """A request the endpoint refuses (a 400 naming the field)."""


def openai_messages_to_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as a Hugging Face chat template reads them: an assistant's tool call
    arguments as an object (OpenAI sends a JSON string), a tool result's `name` from its call."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list):  # content parts: the text ones
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        calls = m.get("tool_calls")
        if calls:
            converted = []
            for call in calls:
                fn = call.get("function", {})
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise RequestError(f"messages: a tool call's arguments are not JSON: {args[:80]!r}") from None
                names[call.get("id", "")] = fn.get("name", "")
                converted.append({"type": "function", "function": {"name": fn.get("name", ""), "arguments": args}})
            m["tool_calls"] = converted
        if m.get("role") == "tool" and "name" not in m:
            m["name"] = names.get(m.get("tool_call_id", ""), "tool")
        out.append(m)
    return out


class PolicyEndpoint:
    """The endpoint of one driver: started once, pointed at an engine and sampling settings per
    batch of episodes (`open_batch`), serving recorded calls until closed."""

    def __init__(self, tokenizer: Any, parser: Parser, tools_block: str | None, model_name: str = "rlft-policy"):
        self.tokenizer, self.parser, self.tools_block, self.model_name = tokenizer, parser, tools_block, model_name
        self.key = secrets.token_urlsafe(24)
        self._encoders: dict[str, ObservationEncoder] = {}
        self.queue: "queue.Queue[_Pending]" = queue.Queue()
        self.records: dict[str, list[RecordedCall]] = {}
        self.raw: dict[str, dict[str, str]] = {}  # episode -> reply content or tool call id -> the text sampled
        self.last: dict[str, _LastCall] = {}
        self.params: SamplingParams | None = None  # the batch's sampling settings
        self.budget: dict[str, int] = {}  # episode -> tokens it may still sample
        self.calls: dict[str, int] = {}  # episode -> calls made (numbered when they arrive: their stream names)
        self._lock = threading.Lock()
        # requests wait for their samples on these threads: as many as may wait at once (asyncio's default
        # executor, a few threads, would cap how many calls one engine batch gathers)
        self._waiting = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="rlft-endpoint-call")
        self._server, self.port = serve_in_thread(self._app(), "rlft-endpoint", "the agent endpoint", lifespan="off")

    def close(self) -> None:
        self._server.should_exit = True
        self._waiting.shutdown(wait=False)

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def open_episode(self, episode: str, budget: int) -> None:
        with self._lock:
            self.records[episode], self.raw[episode], self.budget[episode], self.calls[episode] = [], {}, budget, 0

    def take_episode(self, episode: str) -> list[RecordedCall]:
        with self._lock:
            self.raw.pop(episode, None)
            self.last.pop(episode, None)
            self.budget.pop(episode, None)
            self.calls.pop(episode, None)
            return self.records.pop(episode, [])

    # -- the driver's side: sampling what waits --------------------------------------------------
    def serve_pending(self, engine: Any, wait_s: float) -> int:
        """Sample every request that waits (blocking up to `wait_s` for the first), in one engine
        call per sampling setting; the number served."""
        try:
            first = self.queue.get(timeout=wait_s)
        except queue.Empty:
            return 0
        batch = [first]
        while True:
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        by_params: dict[SamplingParams, list[_Pending]] = {}
        for p in batch:
            by_params.setdefault(p.params, []).append(p)
        for params, group in by_params.items():
            try:
                outs = engine.generate([p.prompt_ids for p in group], params, streams=[p.name for p in group])
            except BaseException as exc:  # every waiting request learns of it; the driver stops the batch
                for p in group:
                    p.error = exc
                    p.done.set()
                raise
            for p, out in zip(group, outs):
                p.result = out
                p.done.set()
        return len(batch)

    # -- the HTTP side ---------------------------------------------------------------------------
    def _app(self) -> Any:
        app = FastAPI(title="rlft agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def refuse(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

        async def handle(request: Request, episode: str, kind: str) -> JSONResponse | StreamingResponse:
            if request.headers.get("authorization", "") != f"Bearer {self.key}":
                return refuse("this endpoint needs the run's key (the client agent.program gets has it)", 401)
            if episode not in self.records:
                return refuse(f"no episode {episode!r} is running (its program's time is up, or it ended)", 404)
            try:
                body = await request.json()
                spec = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(body)
                reply = await asyncio.get_running_loop().run_in_executor(self._waiting, self._answer, episode, spec,
                                                                         kind)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    return refuse(f"{where}: not supported by rlft's endpoint; supported fields: "
                                  f"{', '.join((ChatRequest if kind == 'chat' else CompletionRequest).model_fields)}")
                return refuse(f"{where}: {err['msg']}")
            except (RequestError, json.JSONDecodeError) as exc:
                return refuse(str(exc))
            if spec.stream:  # the reply is whole already: its chunks, as OpenAI streams one
                include_usage = bool((spec.stream_options or {}).get("include_usage"))
                return StreamingResponse(_events(stream_chunks(reply, include_usage)), media_type="text/event-stream")
            return JSONResponse(reply)

        @app.post("/episodes/{episode}/v1/chat/completions")
        async def chat(episode: str, request: Request) -> JSONResponse:
            return await handle(request, episode, "chat")

        @app.post("/episodes/{episode}/v1/completions")
        async def completions(episode: str, request: Request) -> JSONResponse:
            return await handle(request, episode, "text")

        @app.get("/episodes/{episode}/v1/models")
        async def models(episode: str) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                             "owned_by": "rlft"}]})

        return app

    def _encoder(self, tools: list[dict[str, Any]] | None) -> ObservationEncoder:
        schemas = []
        for t in tools or []:
            if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                    or not t["function"].get("name"):
                raise RequestError("tools: rlft's endpoint takes function tools, "
                                   '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
            schemas.append({"type": "function", "function": t["function"]})
        key = json.dumps(schemas, sort_keys=True)
        encoder = self._encoders.get(key)
        if encoder is None:  # concurrent first calls (executor threads): keep the one stored first, since a
            # call continues the last one only with the same encoder (`_continued`)
            encoder = self._encoders.setdefault(key, ObservationEncoder(self.tokenizer, schemas, self.parser.syntax,
                                                                        self.tools_block))
        return encoder

    def _params(self, episode: str, spec: _Request, max_tokens: int | None) -> SamplingParams:
        base = self.params
        if base is None:
            raise RequestError("no batch of episodes is running")
        if spec.n != 1:
            raise RequestError("n: rlft's endpoint samples one choice per request (each is recorded for training); "
                               "send n requests")
        if spec.temperature is not None and abs(spec.temperature - base.temperature) > 1e-9:
            raise RequestError(f"temperature: the run samples at {base.temperature} (rollout.temperature; the "
                               "trainer's log-probs assume it); omit temperature or send that value")
        left = self.budget.get(episode, 0)
        if left <= 0:
            raise RequestError("the episode's token budget (agent.max_total_tokens) is spent")
        cap = min(base.max_new_tokens, left, max_tokens or base.max_new_tokens)
        stop = (spec.stop,) if isinstance(spec.stop, str) else tuple(spec.stop or ())
        return SamplingParams(n=1, temperature=base.temperature, top_p=base.top_p, top_k=base.top_k,
                              max_new_tokens=cap, stop=tuple(base.stop) + stop)

    def _sample(self, episode: str, prompt_ids: list[int], params: SamplingParams) -> Completion:
        with self._lock:  # its stream: the episode's call number, as it arrived (parallel calls each get one)
            call, self.calls[episode] = self.calls[episode], self.calls[episode] + 1
        pending = _Pending(episode, prompt_ids, params, f"{episode}/{call}")
        self.queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise RequestError(f"sampling failed: {type(pending.error).__name__}: {pending.error}")
        out = pending.result
        with self._lock:
            self.records[episode].append(RecordedCall(prompt_ids, list(out.completion_ids), list(out.logprobs),
                                                      out.finish_reason, out.text))
            self.budget[episode] -= len(out.completion_ids)
        return out

    def _answer(self, episode: str, spec: Any, kind: str) -> dict[str, Any]:
        if kind == "text":
            ids = list(spec.prompt) if isinstance(spec.prompt, list) else \
                self.tokenizer.encode(spec.prompt, add_special_tokens=False)
            out = self._sample(episode, ids, self._params(episode, spec, spec.max_tokens))
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "usage": _usage(ids, out),
                    "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}]}
        messages = self._with_raw(episode, spec.messages)
        encoder = self._encoder(spec.tools if spec.tool_choice != "none" else None)
        ids = self._continued(episode, spec.messages, messages, encoder)
        if ids is None:
            ids = encoder.prompt_ids(messages)
        out = self._sample(episode, ids, self._params(episode, spec, spec.max_completion_tokens or spec.max_tokens))
        calls = self.parser(out.text) if spec.tools and spec.tool_choice != "none" else []
        calls = [c for c in calls if c.error is None]
        content = out.text
        for c in calls:
            content = content.replace(c.raw, "")
        message: dict[str, Any] = {"role": "assistant", "content": content.strip() or (None if calls else "")}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
        with self._lock:  # an assistant message sent back as it was renders as the text sampled
            raw = self.raw.get(episode)
            if raw is not None:
                raw[_message_key(message)] = out.text
                self.last[episode] = _LastCall(json.dumps(spec.messages, sort_keys=True), len(spec.messages), messages,
                                               ids, list(out.completion_ids), _message_key(message), encoder)
        finish = "tool_calls" if calls else out.finish_reason
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "usage": _usage(ids, out),
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}

    def _continued(self, episode: str, sent: list[dict[str, Any]], messages: list[dict[str, Any]],
                   encoder: ObservationEncoder) -> list[int] | None:
        """The prompt ids of a call that continues the episode's last one as the turn driver does:
        the same messages, then the reply unchanged, then new messages that are not the assistant's
        (tool results, a user turn), with the same tools. Then the ids are the last call's prompt and
        sampled ids as they were, and the new messages' ids after them (what the template puts
        after an assistant turn, encoded on their own): nothing sampled is re-encoded."""
        last = self.last.get(episode)
        if last is None or encoder is not last.encoder or len(sent) <= last.count:
            return None
        if json.dumps(sent[:last.count], sort_keys=True) != last.sent or _message_key(sent[last.count]) != last.reply:
            return None
        new = messages[last.count + 1:]
        if not new or any(m.get("role") == "assistant" for m in new):
            return None
        tail = encoder.observation_ids(last.messages, new, last.sampled[-1] if last.sampled else None)
        return last.prompt_ids + last.sampled + tail

    def _with_raw(self, episode: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the chat template reads them, where an assistant message this endpoint
        replied with comes back unchanged as the text that was sampled (tool calls as the model wrote
        them, not re-written): its tokens then extend the recorded ones."""
        raw = self.raw.get(episode, {})
        out = []
        for original, converted in zip(messages, openai_messages_to_template(messages)):
            text = raw.get(_message_key(original)) if original.get("role") == "assistant" else None
            out.append({"role": "assistant", "content": text} if text is not None else converted)
        return out


def _message_key(message: dict[str, Any]) -> str:
    calls = [(c.get("id"), c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in message.get("tool_calls") or []]
    return json.dumps([message.get("content") or "", calls])


def _usage(prompt: list[int], out: Completion) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(out.completion_ids),
            "total_tokens": len(prompt) + len(out.completion_ids)}


def stream_chunks(reply: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole reply (`chat.completion` or `text_completion`) as the chunks OpenAI streams: the
    content (and each tool call, whole, at its index), then the finish reason, then (asked for)
    the usage in a chunk without choices."""
    choice = reply["choices"][0]
    chat = reply["object"] == "chat.completion"
    head = {"id": reply["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": reply["created"], "model": reply["model"]}

    def chunk(part: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, **part, "finish_reason": finish, "logprobs": None}]}

    if chat:
        message = choice["message"]
        out = [chunk({"delta": {"role": "assistant", "content": message.get("content") or ""}})]
        out += [chunk({"delta": {"tool_calls": [{"index": i, **call}]}})
                for i, call in enumerate(message.get("tool_calls") or [])]
        out.append(chunk({"delta": {}}, choice["finish_reason"]))
    else:
        out = [chunk({"text": choice["text"]}), chunk({"text": ""}, choice["finish_reason"])]
    if include_usage:
        out.append({**head, "choices": [], "usage": reply["usage"]})
    return out


async def _events(chunks: list[dict[str, Any]]) -> Any:
    for c in chunks:
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"
