"""verifiers environments (`agent.environment: verifiers:my_env`): trained with their own dataset,
rollout loop and rubric, through the policy's OpenAI-compatible endpoint.

A verifiers environment is a module with `load_environment(**kwargs)` returning a
`vf.SingleTurnEnv`, `vf.MultiTurnEnv` or `vf.ToolEnv` (verifiers' classic API: 0.1 to 0.3), or,
with verifiers 0.4 installed, a module exporting a `vf.Taskset` (its v1 stack: verifiers_v1.py;
what follows is the classic half). `verifiers:NAME` imports NAME (an installed environment
package, `vf-math` as `vf_math`, a hub id `owner/name` as `name`) or `verifiers:path/to/env.py`, and
calls `load_environment(**agent.environment_args)`.

The environment drives itself: each episode is `env.run_rollout(row, client, ...)` with a verifiers
client around the `openai.AsyncOpenAI` client of an agent program (rollout/agent/program.py), so
every model call goes through the endpoint and is trained on token-exactly; the rubric then scores
the rollout. The episode's program value is the rubric's per-function scores plus `reward` (its
weighted total), which `{fn: program, args: {key: NAME}}` rewards read. With `rewards` left out,
the run's rewards are one such component per rubric function with the rubric's weight
(`reward_specs`): the summed reward is the rubric's, and each function (a parser's format reward
too) is logged as `reward/<function>`.

Data: `data.train: verifiers:train` reads the dataset of the run's `agent.environment`,
`verifiers:eval` its `eval_dataset` (`rlft eval RUN --data verifiers:eval`); the readers get the
agent section (`dataset_records`). An environment is loaded once per (name, args) in a process.

Sampling is the run's: of the environment's `sampling_args` only `max_tokens` (as a cap) is sent;
temperature and the rest come from `rollout` (the trainer's log-probs assume them), and what is
left out is logged once.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import signal
import threading
from typing import Any, Callable

from rlft import paths
from rlft.config import RewardSpec
from rlft.errors import ConfigError, DataError
from rlft.rewards.user_code import describe_exception, indent, load_user_function
from rlft.rollout.agent.environments import hub_module_name
from rlft.rollout.agent.gem_env import import_quietly, root_logging_kept

log = logging.getLogger(__name__)

PREFIX = "verifiers:"
SPLITS = {"train": "dataset", "eval": "eval_dataset"}
INSTALL_HINT = "agent.environment 'verifiers:...' needs the verifiers package: pip install 'rlft[verifiers]'"
MODEL_NAME = "rlft-policy"
_SENT_SAMPLING_ARGS = ("max_tokens", "max_completion_tokens")

_loaded: dict[str, Any] = {}  # (name, args) as JSON -> the environment (a cache: loading runs user code)


def is_verifiers(ref: str | None) -> bool:
    return ref is not None and ref.startswith(PREFIX)


def import_verifiers() -> Any:
    """verifiers, its logging set-up undone (it adds handlers)."""
    return import_quietly("verifiers", INSTALL_HINT)


@functools.cache
def is_v1() -> bool:
    """Whether the installed verifiers is 0.4's v1 stack (tasksets) rather than the classic
    environments (0.1 to 0.3): each has its half of the adapter."""
    vf = import_verifiers()
    try:
        vf.Environment, vf.OpenAIChatCompletionsClient  # noqa: B018  (the classic API, lazily imported)
        return False
    except AttributeError:
        pass
    with root_logging_kept():
        try:
            import verifiers.v1  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"agent.environment 'verifiers:...': verifiers {getattr(vf, '__version__', '?')} has "
                              f"neither the classic environments nor a loadable v1 stack ({exc}); install "
                              "'rlft[verifiers]'") from None
    return True


def _v1() -> Any:
    from rlft.rollout.agent import verifiers_v1  # lazy: imports verifiers 0.4's stack, there only

    return verifiers_v1


def load(ref: str, args: dict[str, Any]) -> Any:
    """The environment `verifiers:NAME` with `args` (a 0.4 taskset's env with verifiers 0.4),
    loaded once and checked."""
    if ref.endswith(".py"):  # one environment however its path was written
        ref = PREFIX + paths.existing(ref[len(PREFIX):])
    key = json.dumps([ref, args], sort_keys=True, default=str)
    if key not in _loaded:
        _loaded[key] = (_v1().load if is_v1() else _load)(ref, args)
    return _loaded[key]


def _load(ref: str, args: dict[str, Any]) -> Any:
    vf = import_verifiers()
    target = ref[len(PREFIX):]
    if not target.endswith(".py"):
        target = hub_module_name(target)
    fn = load_user_function(f"{target}:load_environment", what=f"agent.environment {ref!r}")
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as exc:
        raise ConfigError(f"agent.environment {ref!r}: load_environment cannot take agent.environment_args "
                          f"{sorted(args)}: {exc}") from None
    except ValueError:
        pass
    with _signals_kept():  # verifiers' Environment installs its own SIGINT/SIGTERM handlers
        try:
            env = fn(**args)
        except Exception as exc:  # noqa: BLE001  (the environment's own code: named, with its frames)
            raise ConfigError(f"agent.environment {ref!r}: load_environment raised:\n"
                              + indent(describe_exception(exc))) from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"agent.environment {ref!r}: load_environment returned a {type(env).__name__}, not a "
                          "verifiers Environment (vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv, ...)")
    rubric = env.rubric
    if rubric.has_group_rewards:
        raise ConfigError(f"agent.environment {ref!r}: its rubric has group reward functions (they score a group "
                          "of rollouts together); rlft scores each episode on its own, so use per-rollout "
                          "reward functions")
    names = rubric._get_reward_func_names()
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"agent.environment {ref!r}: its rubric has several functions named {twice} (lambdas, or "
                          "one function in two rubrics); each is a reward component named after its function, so "
                          "give them distinct names (def), or write rewards yourself ({fn: program, args: {key: "
                          "reward}} trains on the rubric's total)")
    if "reward" in names:
        raise ConfigError(f"agent.environment {ref!r}: a rubric function is named 'reward', which names the "
                          "rubric's total; rename it")
    return env


class _signals_kept:
    """Keeps the process's SIGINT / SIGTERM handlers as they were around `load_environment`."""

    def __enter__(self) -> None:
        self.main = threading.current_thread() is threading.main_thread()
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if self.main else {}

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def rubric_components(env: Any) -> list[tuple[str, float]]:
    """(function name, weight) of the environment's rubric, in its order (weight 0: a metric)."""
    rubric = env.rubric
    return list(zip(rubric._get_reward_func_names(), rubric._get_reward_weights()))


def reward_specs(rewards: list[Any], agent: Any) -> list[Any]:
    """The run's reward components: `rewards` as given, or with none given and a verifiers
    environment, one program component per rubric function with its weight (the summed reward is
    the rubric's; each function is logged)."""
    if rewards or agent is None or not is_verifiers(agent.environment):
        return rewards
    if is_v1():  # the trace's weighted total, each score logged beside it
        return [_v1().rubric_spec()]
    return [RewardSpec(fn="program", name=name, weight=float(weight), args={"key": name})
            for name, weight in rubric_components(load(agent.environment, agent.environment_args))]


def dataset_records(source: str, agent: Any) -> list[tuple[str, dict[str, Any]]]:
    """`verifiers:train` / `verifiers:eval`: the dataset of the agent section's environment as
    (where, prompt row) pairs."""
    split = source[len(PREFIX):]
    if split not in SPLITS:
        raise DataError(f"data source {source!r}: write verifiers:train (the environment's dataset) or "
                        "verifiers:eval (its eval_dataset)")
    if agent is None or not is_verifiers(agent.environment):
        raise DataError(f"data source {source!r} reads the dataset of agent.environment 'verifiers:...', and this "
                        "config's agent section names none; set agent.environment (with rlft eval: evaluate the "
                        "run directory, whose config names it)")
    ref = agent.environment
    if is_v1():  # a taskset: no split of its own, its config (environment_eval_args) makes the held-out tasks
        if split == "eval" and not agent.environment_eval_args:
            raise DataError(f"data source verifiers:eval: {ref!r} is a verifiers {import_verifiers().__version__} "
                            "taskset, which has no eval split; set agent.environment_eval_args to the taskset "
                            "config that makes its held-out tasks (e.g. {split: test}), or give data.eval another "
                            "source")
        args = {**agent.environment_args, **(agent.environment_eval_args if split == "eval" else {})}
        return _v1().task_records(ref, split, load(ref, args))
    env = load(ref, agent.environment_args)
    try:  # an environment may build its datasets lazily (a dataset source): its own code runs here
        dataset = env.build_dataset() if split == "train" else env.build_eval_dataset()
    except Exception as exc:  # noqa: BLE001  (the environment's own code: named, with its frames)
        raise DataError(f"data source {source!r}: building the {SPLITS[split]} of environment {ref!r} raised:\n"
                        + indent(describe_exception(exc))) from None
    if dataset is None:
        other = "data.eval" if split == "eval" else "data.train"
        raise DataError(f"data source {source!r}: environment {ref!r} has no {SPLITS[split]}; give {other} "
                        f"another source, or add a{'n eval_dataset' if split == 'eval' else ' dataset'} to the "
                        "environment")
    return [(f"{ref}[{split}]#{i}", _row(record)) for i, record in enumerate(dataset)]


def _row(record: dict[str, Any]) -> dict[str, Any]:
    """A dataset record as a prompt row: its messages without the None fields a dataset adds."""
    out = dict(record)
    prompt = out.get("prompt")
    if isinstance(prompt, list):
        out["prompt"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
    return out


def program(ref: str, env: Any) -> Callable[..., Any]:
    """The episode program of the environment `ref`: its rollout on the endpoint's client, its
    rubric's scores returned as {function: score, ..., "reward": total}."""
    vf = import_verifiers()
    sampling = {k: v for k, v in (env.sampling_args or {}).items() if k in _SENT_SAMPLING_ARGS and v is not None}
    dropped = sorted(k for k, v in (env.sampling_args or {}).items()
                     if k not in _SENT_SAMPLING_ARGS and k != "n" and v not in (None, {}, 1))
    if dropped:
        log.info("verifiers environment %s: its sampling_args %s are left to rlft's rollout settings", ref, dropped)

    async def run(client: Any, row: dict[str, Any]) -> dict[str, float]:
        rollout_input = {k: v for k, v in row.items() if k != "messages"}
        rollout_input["prompt"] = row["messages"]
        rollout_input.setdefault("example_id", 0)
        out = await env.run_rollout(rollout_input, vf.OpenAIChatCompletionsClient(client), MODEL_NAME, dict(sampling))
        scores = {name: float(value) for name, value in (out.get("metrics") or {}).items()}
        scores["reward"] = float(out.get("reward") or 0.0)
        return scores

    return run


def verifiers_driver(cfg: Any, engine: Any, tokenizer: Any, parser: Any) -> Any:
    """An agent-program driver whose program is the environment's rollout and rubric."""
    from rlft.rollout.agent.program import program_driver  # lazy: FastAPI and uvicorn (the openai extra)

    env = load(cfg.environment, cfg.environment_args)
    run = _v1().program(env) if is_v1() else program(cfg.environment, env)
    return program_driver(cfg, engine, tokenizer, parser, run)
