"""The environments of OpenEnv (openenv-core: environments served over HTTP with reset/step) by
address: `agent.environment: openenv:http://HOST:PORT` steps a server that runs already;
`openenv:module:Class` (an `openenv.core.Environment` subclass) or `openenv:module:app` (the FastAPI
app that `openenv.core.create_app` made, as an environment's server/app.py has it) is served in
this process, on 127.0.0.1 at a free port (uvicorn on a thread of its own), through the same
server code a deployment runs.

An rlft episode is one OpenEnv session: a WebSocket to the server's /ws (the library's
GenericEnvClient), opened when the episode's instance is made and closed when the episode is done
or its instance dropped. (The server's HTTP /reset and /step make a fresh environment per request:
they hold no episode.) A server admits `max_concurrent_envs` sessions at once (create_app's
argument, 1 by default); rlft holds one per episode of a rollout.

- reset: `reset(seed=..., **agent.environment_args)` (the server passes what its reset accepts).
  The seed is the episode's (the same for a group), so reset must draw from it.
- step: the turn's text is the action's text field: the one string field of the action's schema,
  or `environment_args.action_field`. Other required fields are refused at start.
- observation: the one field of the observation (done, reward and metadata are not fields), or
  `environment_args.observation_field`; a value that is not a string, or several fields, are
  shown as JSON. An empty first observation (or `environment_args.keep_prompt: true`) keeps the
  row's prompt. The reward None counts 0.

`action_field`, `observation_field` and `keep_prompt` are read here; the other environment_args go
to reset. Calls run on one event loop thread shared by every session (the driver's threads wait on
it), with no time limit of their own: agent.env_step_timeout_s is the limit, as for any
environment. A step the server answers with an error, or a session it drops, raises here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import ipaddress
import json
import os
import socket
import threading
import typing
import weakref
from typing import Any, Callable, Coroutine
from urllib.parse import urlsplit

from rlft.errors import ConfigError
from rlft.rewards.user_code import load_user_function
from rlft.rollout.agent.local_server import serve_in_thread

INSTALL_HINT = "agent.environment 'openenv:...' needs the openenv-core package: pip install 'rlft[openenv]'"
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
OPTIONS = ("action_field", "observation_field", "keep_prompt")  # environment_args read here, not sent to reset
NOT_FIELDS = ("done", "reward", "metadata")  # the server sends these beside the observation, not in it
SESSIONS = 4096  # what an in-process server admits (one session per live episode)
CONNECT_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 10.0  # a closing session waits this long for the server to close it (then closes itself)


def import_openenv() -> Any:
    try:
        import openenv.core
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return openenv.core


def openenv_factory(target: str, args: dict[str, Any]) -> Callable[[int], "OpenEnvEnvironment"]:
    """Finds the server (or serves the app) and reads its schema now, before training starts."""
    ref = f"openenv:{target}"
    core = import_openenv()
    options = {k: args[k] for k in OPTIONS if k in args}
    reset_args = {k: v for k, v in args.items() if k not in OPTIONS}
    if "seed" in reset_args:
        raise ConfigError(f"agent.environment_args for {ref!r}: drop `seed`; each episode's reset gets the seed "
                          "rlft draws for it (from the run's seed), so that a group shares one start")
    if not isinstance(options.get("keep_prompt", False), bool):
        raise ConfigError(f"agent.environment_args.keep_prompt for {ref!r} is {options['keep_prompt']!r}, not "
                          "true or false")
    local = None
    if target.startswith(URL_SCHEMES):
        url = target.rstrip("/")
    else:
        local = LocalServer(_app_of(core, load_user_function(target, what=f"agent.environment {ref!r}"), ref,
                                    reset_args))
        url = local.url
    schema = _schema(url, ref)
    return OpenEnvServer(ref, url, local, _action_field(schema, options.get("action_field"), ref),
                         _observation_field(schema, options.get("observation_field"), ref),
                         options.get("keep_prompt", False), reset_args, core.GenericEnvClient)


class OpenEnvServer:
    """One server (with what was read from its schema); called with a seed, it opens an episode."""

    def __init__(self, ref: str, url: str, local: "LocalServer | None", action_field: str,
                 observation_field: str | None, keep_prompt: bool, reset_args: dict[str, Any], client_cls: Any):
        self.ref, self.url, self.local = ref, url, local
        self.action_field, self.observation_field, self.keep_prompt = action_field, observation_field, keep_prompt
        self.reset_args, self.client_cls = reset_args, client_cls

    def __call__(self, seed: int) -> "OpenEnvEnvironment":
        return OpenEnvEnvironment(self, seed)

    def text(self, observation: Any) -> str:
        """What the model is shown of an observation (the fields the server sent)."""
        value = observation
        if self.observation_field is not None:
            if not isinstance(observation, dict) or self.observation_field not in observation:
                fields = sorted(observation) if isinstance(observation, dict) else observation
                raise RuntimeError(f"the server's observation has no field {self.observation_field!r} "
                                   f"(it sent {fields!r}); correct agent.environment_args.observation_field")
            value = observation[self.observation_field]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class OpenEnvEnvironment:
    """One OpenEnv session as an rlft environment (see rollout/agent/environments.py)."""

    def __init__(self, server: OpenEnvServer, seed: int):
        self.server, self.seed = server, seed % 2**32  # numpy's legacy seeding takes 32 bits
        _wait_for_closes()  # the sessions of episodes that ended: their slots on the server are free again
        client = server.client_cls(base_url=server.url, connect_timeout_s=CONNECT_TIMEOUT_S,
                                   message_timeout_s=None)  # the driver's time limit is the limit
        try:
            _run(client.connect())
        except ConnectionError as exc:  # the library's: "Failed to connect to ws://...: ..."
            raise RuntimeError(f"cannot open a session on the OpenEnv server at {server.url}: {exc.__cause__ or exc}"
                               "; is it still running?") from None
        self.client = client
        self._close = weakref.finalize(self, _close_later, client)  # when done, or when the episode is dropped
        self._close.atexit = False  # at exit the connection just drops (the server frees its slot then too)

    def reset(self, **row: Any) -> str | None:
        result = self._call("reset", self.client.reset(seed=self.seed, **self.server.reset_args))
        text = self.server.text(result.observation)
        return None if self.server.keep_prompt or text == "" else text

    def step(self, text: str) -> tuple[str, float, bool]:
        result = self._call("step", self.client.step({self.server.action_field: text}))
        done = bool(result.done)
        if done:  # nothing follows: the session's slot is free for the next episode
            self._close()
        return self.server.text(result.observation), float(result.reward or 0.0), done

    def _call(self, what: str, coro: Coroutine[Any, Any, Any]) -> Any:
        from websockets.exceptions import ConnectionClosed  # lazy: openenv-core's dependency

        try:
            return _run(coro)
        except ConnectionClosed as exc:
            said = _run(_last_word(self.client))  # a server that refuses a session says why, then closes it
            if said is not None:
                raise RuntimeError(_server_error(self.server.url, what, said)) from None
            raise RuntimeError(f"the OpenEnv server at {self.server.url} closed the session during {what} "
                               f"({exc}); did it stop?") from None
        except RuntimeError as exc:
            message = str(exc)
            if not message.startswith("Server error:"):
                raise
            raise RuntimeError(_server_error(self.server.url, what, message)) from None


async def _last_word(client: Any) -> str | None:
    """The error a closed session's server sent before it closed, as the library words errors."""
    ws = getattr(client, "_ws", None)
    if ws is None:
        return None
    try:
        message = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
    except Exception:
        return None
    data = message.get("data") if isinstance(message, dict) and message.get("type") == "error" else None
    if not isinstance(data, dict):
        return None
    return f"Server error: {data.get('message')} (code: {data.get('code')})"


def _server_error(url: str, what: str, message: str) -> str:
    """The library's 'Server error: MESSAGE (code: CODE)' as what happened and what to do."""
    detail = message[len("Server error:"):].strip()
    if "CAPACITY_REACHED" in detail:
        return (f"the OpenEnv server at {url} refused the session: {detail}. rlft holds one session per episode "
                "of a rollout (rollout.prompts_per_step x rollout.group_size at once). Serve it with "
                "create_app(..., max_concurrent_envs=N) for at least that many (its environment class must set "
                "SUPPORTS_CONCURRENT_SESSIONS = True), or sample fewer episodes at once")
    if "VALIDATION_ERROR" in detail and what == "step":
        return (f"the OpenEnv server at {url} refused the action as invalid: {detail}; the action's other fields "
                "may have constraints the turn's text does not meet")
    return f"the OpenEnv server at {url} answered {what} with an error: {detail}"


# -- the event loop every session's calls run on -------------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_loop_lock = threading.RLock()  # re-entrant: a session's finalizer may run wherever its episode is dropped
_closing: set[concurrent.futures.Future] = set()  # sessions being closed


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """coro's value, run on the shared loop; the caller's thread waits (the driver's time limit
    abandons it, and the coroutine finishes on the loop)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():  # a forked process has the loop but not its thread
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="rlft-openenv", daemon=True).start()
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def _close_later(client: Any) -> None:
    """Close a session without waiting: ask the server to close it and let it (a client that
    closes first makes the library's server log an exception), then close what remains."""
    async def close() -> None:
        ws = getattr(client, "_ws", None)
        if ws is not None:
            try:
                await ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(ws.wait_closed(), CLOSE_WAIT_S)
            except Exception:  # already closed, or the server is still inside a late step
                pass
        try:
            await client.close()
        except Exception:
            pass

    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(close(), _loop)
        except RuntimeError:  # the interpreter is shutting down
            return
        _closing.add(future)
    future.add_done_callback(_closed)


def _closed(future: concurrent.futures.Future) -> None:
    with _loop_lock:
        _closing.discard(future)


def _wait_for_closes() -> None:
    """Until the sessions being closed are (the server frees a slot before it closes the socket):
    a server that admits exactly a rollout's episodes then has room for the next rollout's."""
    with _loop_lock:
        pending = list(_closing)
    if pending:
        concurrent.futures.wait(pending, timeout=CLOSE_WAIT_S + 5)


# -- finding the server and reading its schema ---------------------------------------------------

def _schema(url: str, ref: str) -> dict[str, Any]:
    """GET /schema: the action's and the observation's JSON schemas. One ConfigError naming the
    address when nothing answers there, or not an OpenEnv server."""
    import httpx  # lazy: openenv-core's dependency

    parts = urlsplit(url)
    base = url.replace("ws", "http", 1) if parts.scheme in ("ws", "wss") else url
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(parts.hostname or "")).is_loopback
    except (OSError, ValueError):
        loopback = False
    try:  # no proxy for a server on this machine (as the library's client does)
        response = httpx.get(f"{base}/schema", timeout=CONNECT_TIMEOUT_S, trust_env=not loopback)
    except httpx.HTTPError as exc:
        raise ConfigError(f"agent.environment {ref!r}: no server answers at {base} ({type(exc).__name__}: {exc})\n"
                          "Fix: start the environment's server first (in its folder: uvicorn server.app:app "
                          "--host 127.0.0.1 --port 8000, or its Docker image) and check the address") from None
    try:
        schema = response.json() if response.status_code == 200 else None
    except ValueError:
        schema = None
    if not isinstance(schema, dict) or not all(isinstance(schema.get(k), dict) for k in ("action", "observation")):
        raise ConfigError(f"agent.environment {ref!r}: {base}/schema answered {response.status_code}, not an "
                          "OpenEnv server's schema (openenv-core's create_app serves /schema and /ws); check the "
                          "address")
    return schema


def _action_field(schema: dict[str, Any], chosen: str | None, ref: str) -> str:
    """The action field the turn's text goes into."""
    action = schema["action"]
    props = {k: v for k, v in action.get("properties", {}).items() if k != "metadata"}
    texts = [k for k, v in props.items() if _is_text(v, action)]

    def fail(problem: str) -> ConfigError:
        shown = ", ".join(f"{k} ({_type_name(v, action)})" for k, v in props.items()) or "none"
        return ConfigError(f"agent.environment {ref!r}: {problem}\nIts action ({action.get('title', 'Action')}) "
                           f"has the fields: {shown}. rlft's action is the turn's text, put in one text field.")

    if chosen is not None:
        if chosen not in props:
            raise fail(f"agent.environment_args.action_field {chosen!r} is not a field of its action")
        if chosen not in texts:
            raise fail(f"agent.environment_args.action_field {chosen!r} is not a text (string) field")
    elif len(texts) == 1:
        chosen = texts[0]
    elif not texts:
        raise fail("its action has no text field, so a turn's text cannot be its action (an action of numbers or "
                   "tool calls is not supported)")
    else:
        raise fail(f"its action has several text fields: name the one for the turn's text as "
                   f"agent.environment_args.action_field (one of {', '.join(texts)})")
    others = [k for k in action.get("required", []) if k not in (chosen, "metadata")]
    if others:
        raise fail(f"its action also requires {', '.join(others)}, which rlft cannot fill from the turn's text")
    return chosen


def _observation_field(schema: dict[str, Any], chosen: str | None, ref: str) -> str | None:
    """The observation field shown to the model; None: all of them, as JSON."""
    props = [k for k in schema["observation"].get("properties", {}) if k not in NOT_FIELDS]
    if chosen is not None:
        if chosen not in props:
            raise ConfigError(f"agent.environment {ref!r}: agent.environment_args.observation_field {chosen!r} is "
                              f"not a field of its observation (it has: {', '.join(props) or 'none'})")
        return chosen
    return props[0] if len(props) == 1 else None


def _resolve(prop: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref", "")
    if ref.startswith("#/$defs/"):
        return root.get("$defs", {}).get(ref.rpartition("/")[2], prop)
    return prop


def _is_text(prop: dict[str, Any], root: dict[str, Any]) -> bool:
    prop = _resolve(prop, root)
    if prop.get("type") == "string":
        return True
    options = prop.get("anyOf", []) + prop.get("oneOf", [])
    return any(_resolve(o, root).get("type") == "string" for o in options)


def _type_name(prop: dict[str, Any], root: dict[str, Any]) -> str:
    prop = _resolve(prop, root)
    if "type" in prop:
        return str(prop["type"])
    options = [_resolve(o, root).get("type", "?") for o in prop.get("anyOf", []) + prop.get("oneOf", [])]
    return " | ".join(map(str, options)) or prop.get("title", "?")


# -- serving an environment in this process ------------------------------------------------------

def _app_of(core: Any, obj: Any, ref: str, reset_args: dict[str, Any]) -> Any:
    """The ASGI app to serve: `obj` itself (an app), or one made for an Environment subclass the
    way an environment's server/app.py makes it."""
    from starlette.applications import Starlette  # lazy: FastAPI's base, openenv-core's dependency

    if isinstance(obj, Starlette):
        return obj
    if not (inspect.isclass(obj) and issubclass(obj, core.Environment)):
        raise ConfigError(f"agent.environment {ref!r}: is a {type(obj).__name__}, neither an OpenEnv Environment "
                          "subclass nor the app openenv.core.create_app made")
    if not getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise ConfigError(f"agent.environment {ref!r}: {obj.__name__} does not set SUPPORTS_CONCURRENT_SESSIONS = "
                          "True, so OpenEnv serves it one session at a time, and rlft holds one per episode of a "
                          "rollout\nFix: set it in the class when its instances share no state")
    action_cls, observation_cls = _model_classes(core, obj)
    if action_cls is None or observation_cls is None:
        raise ConfigError(f"agent.environment {ref!r}: cannot tell {obj.__name__}'s action and observation classes"
                          f"\nFix: annotate its step (def step(self, action: MyAction, ...) -> MyObservation), or "
                          f"subclass Environment[MyAction, MyObservation, State], or name the app create_app made")
    try:  # a server drops what reset does not take without a word: here it is said
        inspect.signature(obj.reset).bind_partial(None, **reset_args)
    except TypeError as exc:
        raise ConfigError(f"agent.environment {ref!r}: {obj.__name__}.reset cannot take agent.environment_args "
                          f"{sorted(reset_args)}: {exc}") from None
    except ValueError:
        pass
    return core.create_fastapi_app(obj, action_cls, observation_cls, max_concurrent_envs=SESSIONS)


def _model_classes(core: Any, cls: type) -> tuple[type | None, type | None]:
    """Its action and observation classes: from step's annotations, else Environment[A, O, S]."""
    def pick(candidates: Any, base: type) -> type | None:
        return next((c for c in candidates if inspect.isclass(c) and issubclass(c, base) and c is not base), None)

    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # an annotation that does not resolve
        hints = {}
    action, observation = pick([hints.get("action")], core.Action), pick([hints.get("return")], core.Observation)
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            params = typing.get_args(base)
            action = action or pick(params, core.Action)
            observation = observation or pick(params, core.Observation)
    return action, observation


class LocalServer:
    """An ASGI app served by uvicorn on 127.0.0.1 (a free port) on a daemon thread, until dropped."""

    def __init__(self, app: Any):
        server, port = serve_in_thread(app, "rlft-openenv-server", "the OpenEnv app")
        self.url = f"http://127.0.0.1:{port}"
        # dropped with its last episode: stopped once their sessions are closed (a server that stops with
        # sessions open logs an exception for each); at exit its daemon thread just ends
        weakref.finalize(self, _stop_later, server).atexit = False


def _stop_later(server: Any) -> None:
    def stop() -> None:
        _wait_for_closes()
        server.should_exit = True

    threading.Thread(target=stop, name="rlft-openenv-stop", daemon=True).start()
