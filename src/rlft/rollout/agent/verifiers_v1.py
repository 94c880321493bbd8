"""verifiers 0.4 tasksets (`verifiers.v1`) as agent programs: the verifiers_env adapter's second half.

verifiers 0.4 replaced the classic environments with its v1 stack: an environment is a module
exporting a `vf.Taskset` (its tasks, each scored by the task's `@vf.reward` / `@vf.metric`
methods and plugged judges), run by a harness whose model calls pass through v1's interception
server. `verifiers:NAME` names that module (or a `.py` file); `agent.environment_args` are the
taskset config's fields, as `load_environment`'s keyword arguments are for the classic API.

An episode is `env.run_episode(task, ctx)` with the harness of this module (`RlftChatHarness`:
the task's prompt, one reply, in this process) and the model context pointed at the episode's
endpoint, so v1 builds the trace and scores it as it does anywhere, and the reply is sampled,
recorded and trained on token-exactly by the endpoint. v1's own harnesses (`null`, `bash`,
coding agents) run as programs in uv environments or containers and stream their calls; they
are not used, and tasksets that need tool servers (toolsets) are refused at start.

Rows: every task of the taskset, the prompt as its messages (system prompt first) and the task's
data under `vf_task`, from which the episode rebuilds the task. v1 has no eval split: `verifiers:eval`
is the taskset built with `agent.environment_eval_args` over `environment_args` (e.g. `{split: test}`).

An episode returns `{"reward": the trace's weighted total, <reward>: score, ..., <metric>: value}`;
with `rewards` left out the run's reward is that total (`rubric_spec`), each score logged beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import verifiers.v1 as vf
from pydantic import ValidationError

from rlft import paths
from rlft.config import RewardSpec
from rlft.errors import ConfigError
from rlft.rewards.user_code import describe_exception, indent
from rlft.rollout.agent.environments import hub_module_name

MODEL_NAME = "rlft-policy"
KEY_VAR = "RLFT_VERIFIERS_ENDPOINT_KEY"  # v1 reads a client's key from an environment variable it names
TASK_FIELD = "vf_task"  # a row's task data, as the taskset made it



class RlftChatHarnessConfig(vf.HarnessConfig):
    """rlft's harness takes no settings."""


class RlftChatHarness(vf.Harness[RlftChatHarnessConfig]):
    """The task's prompt (system prompt first), one reply, sent through the rollout's interception
    endpoint in this process (v1's harness contract allows an in-process loop)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, **_: Any) -> Any:
        import openai
        from verifiers.v1.dialects.chat import message_to_wire

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [message_to_wire(m) for m in prompt or []]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["RlftChatHarness"]  # what v1's loader reads from this module
# v1 finds a harness by a module name without dots (it first looks for verifiers.v1.harnesses.<id>)
HARNESS_ID = "rlft_verifiers_harness"
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


def _module_id(ref: str) -> str:
    """The taskset id v1 imports: an installed module (an Environments Hub id `owner/name` as
    `name`, dashes as underscores), or a `.py` file imported here under a name of its own."""
    target = ref.split(":", 1)[1]
    if not target.endswith(".py"):
        return hub_module_name(target)
    path = Path(paths.existing(target))
    # v1 imports a taskset by its lower-cased id; one module per file, however the path was written
    name = f"rlft_verifiers_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}".lower()
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001  (the user's file: named, with its frames)
            del sys.modules[name]
            raise ConfigError(f"agent.environment {ref!r}: importing {path} raised:\n"
                              + indent(describe_exception(exc))) from None
    return name


def load(ref: str, args: dict[str, Any]) -> Any:
    """The v1 env of taskset `ref` configured with `args`, with rlft's harness (verifiers_env.load
    caches it)."""
    module = _module_id(ref)
    where = f"agent.environment {ref!r} (verifiers {sys.modules['verifiers'].__version__} taskset)"
    try:
        config = vf.resolve_env_config({"taskset": {"id": module, **args},
                                        "agent": {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}})
        env = vf.load_environment(config)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise ConfigError(f"{where}: agent.environment_args do not fit its taskset config: {problems}") from None
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{where}: cannot import {exc.name!r}; install the environment's package, or give "
                          "its file: verifiers:path/to/env.py") from None
    except Exception as exc:  # noqa: BLE001  (the taskset's own code)
        raise ConfigError(f"{where}: loading it raised:\n" + indent(describe_exception(exc))) from None
    task_cls = type(env.taskset).task_type()
    if task_cls.toolsets(env.taskset.config.task):
        raise ConfigError(f"{where}: its tasks use tool servers (toolsets), which need one of verifiers' own "
                          "harnesses; rlft runs v1 tasksets with a one-reply chat harness. Use a taskset without "
                          "tools, or write the environment with verifiers 0.3's vf.ToolEnv")
    return env


def rubric_spec() -> RewardSpec:
    """`rewards` left out: the trace's weighted total, its scores logged beside it."""
    return RewardSpec(fn="program", name="rubric", args={"key": "reward", "log_others": True})


def task_records(ref: str, split: str, env: Any) -> list[tuple[str, dict[str, Any]]]:
    """(where, prompt row) for every task of the env's taskset (built for `split` by the caller)."""
    rows = []
    for i, task in enumerate(env.taskset):
        data = task.data.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        rows.append((f"{ref}[{split}]#{i}", {"prompt": _messages(data), TASK_FIELD: data}))
    return rows


def _messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The task's prompt as chat messages (what the harness sends)."""
    prompt = data.get("prompt")
    out = [{"role": "system", "content": data["system_prompt"]}] if data.get("system_prompt") else []
    if isinstance(prompt, str):
        return out + [{"role": "user", "content": prompt}]
    return out + [{k: v for k, v in m.items() if v is not None} for m in prompt or []]


def program(env: Any) -> Callable[..., Any]:
    """The episode program: the task rebuilt from its row, run by v1 on the endpoint's client."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()

    async def run(client: Any, row: dict[str, Any]) -> dict[str, float]:
        if TASK_FIELD not in row:
            raise ValueError(f"the row has no {TASK_FIELD!r}: a verifiers taskset's episodes take its own rows "
                             "(data.train: verifiers:train)")
        os.environ[KEY_VAR] = client.api_key  # the run's endpoint key (one per run)
        ctx = vf.ModelContext(MODEL_NAME, vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                                              api_key_var=KEY_VAR), vf.SamplingConfig())
        task = task_cls(data_cls.model_validate(row[TASK_FIELD]), env.taskset.config.task)
        episode = await env.run_episode(task, ctx)
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if not episode.ok or not episode.traces:
            said = "; ".join(f"{getattr(e, 'type', '')}: {str(getattr(e, 'message', e))[:300]}" for e in errors)
            raise RuntimeError(f"the verifiers episode failed: {said or 'no trace'}")
        trace = episode.traces[0]
        out = {name: float(r.score) for name, r in trace.rewards.items() if r is not None and r.score is not None}
        out.update({name: float(v) for name, v in trace.metrics.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
        out["reward"] = float(trace.reward or 0.0)
        return out

    run.batch_context = env.serving  # v1's interception server, held while a batch's episodes run
    return run
