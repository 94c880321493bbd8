"""How completions are sampled (`rollout`, its `vllm` settings) and how agents take turns (`agent`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlft import paths
from rlft.config.section import Section, _local, check_device


class VllmSettings(Section):
    """The vLLM engine, used when `rollout.engine` is vllm (and by `rlft eval --engine vllm` of a run): its
    dtype, its memory (KV cache, share of the GPU, sleeping while the trainer updates), CUDA graphs, tensor
    parallelism, whether it runs in the trainer's process, and how LoRA weights reach it. The hf engine
    ignores it. See guides/scaling.md#vllm-rollouts."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Engine weight dtype; 'auto': the run's rollout dtype (bf16 under bf16-mixed, "
                            "else the trainer's weights').")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV-cache size in bytes; None: gpu_memory_utilization decides on GPU, 1 GiB on CPU.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="GPU memory fraction vLLM may take (weights + KV cache); the trainer shares the GPU.")
    enforce_eager: bool | None = Field(
        None, description="Run without CUDA graphs / compilation; None: eager on CPU, graphs on GPU.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model over (needs in_process=false).")
    in_process: bool = Field(
        True, description="Run vLLM's engine core in the trainer's process (fast weight push); false: worker processes.")
    sleep: bool = Field(
        False, description="GPU only: free the engine's KV cache and offload its weights while the trainer updates.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion the engine accepts; None: the checkpoint's limit.")
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged", description="LoRA: push the merged weights (plain model, faster rollouts on CPU) or the adapter "
                              "as a new LoRA request (vLLM's LoRA kernels; a cheaper push for large models).")


class ServerSettings(Section):
    """Rollout servers (`rollout.servers`): `rlft serve` processes that sample for the run on their own
    devices or machines, and receive the trainer's weights after every update. How the run reaches them
    (the key's environment variable, timeouts, retries), where the weight broadcast meets them, and how a
    LoRA policy's weights travel. See guides/scaling.md#rollout-servers."""

    api_key_env: str = Field(
        "RLFT_SERVER_API_KEY", min_length=1,
        description="Environment variable holding the servers' API key (the key itself is never written to "
                    "the run directory or a log); unset: no key is sent.")
    timeout_s: float = Field(600.0, gt=0, description="Longest wait for one request or weight round.")
    max_retries: int = Field(
        2, ge=0, description="A request whose server fails moves to another server at most this many times; a "
                             "failed server leaves the rotation, and with none left the run stops with a checkpoint.")
    max_concurrent_requests: int = Field(
        64, ge=1, description="Requests in flight across the servers (one per prompt group).")
    sync_address: str = Field(
        "auto", description="This machine's address the servers' workers connect to for the weight broadcast; "
                            "auto: the address on the route to each server.")
    lora_sync: Literal["merged", "adapter"] = Field(
        "adapter", description="LoRA: send the adapter (saved under adapter_dir, loaded by vLLM at run time; the "
                               "servers must read that path) or the merged weights (over the weight transfer).")
    adapter_dir: str | None = Field(
        None, description="Where adapter versions are saved for the servers (a shared path across machines); "
                          "None: the run's server-adapters/ folder.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="For rlft plan: the devices each server splits the model over (what rlft serve "
                             "--tensor-parallel-size was given); the run itself reads nothing from it.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="For rlft plan: the share of each server device vLLM takes (rlft serve "
                                     "--gpu-memory-utilization).")


class RolloutConfig(Section):
    """How the online methods sample completions: the engine (hf or vllm), prompts per step and completions
    per prompt (the group), temperature, top-p / top-k, completion length and stop strings, and asynchronous
    sampling while the trainer trains (`async_steps`). Offline methods do not sample and ignore it. See
    guides/methods/index.md, and guides/async.md for `async_steps`."""

    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine for rollouts.")
    group_size: int = Field(8, description="Completions sampled per prompt (G); at least 2.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts per rollout step.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0: off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: off).")
    max_new_tokens: int = Field(256, ge=1, description="Longest completion; reaching it is finish reason 'length'.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (end-of-turn and EOS always stop).")
    batch_size: int | None = Field(None, ge=1, description="Sequences generated per forward (default: all at once).")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="hf engine: the dtype rollouts compute in; auto: training's compute dtype (bf16 under "
                            "bf16-mixed). The engine/trainer log-prob gap this causes is logged "
                            "(rollout/logprob_diff_*). The vLLM engine: rollout.vllm.dtype.")
    fast_decode: bool = Field(
        True, description="hf engine: lean decode step for Llama/Qwen2/Mistral (falls back to the model's forward).")
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="rollout.engine=vllm settings.")
    servers: list[str] = Field(
        default_factory=list, description="URLs of rlft serve processes to sample on (rollout.engine=vllm), e.g. "
                                          "[http://10.0.0.5:8000]; empty: the engine runs in the trainer's process.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="rollout.servers settings.")
    async_steps: int = Field(
        0, ge=0, description="k: a sampler thread generates the next batches while the trainer trains, at most k "
                             "optimizer steps behind (batch j samples from the weights after exactly max(0, j-k) "
                             "steps, so a run does not depend on timing); 0: generate, then train, in turn. k > 0 "
                             "needs algorithm.rollout_correction (tis or bypass). Under torchrun each rank's "
                             "sampler samples its share of the prompts.")
    sampler: Literal["auto", "process", "thread"] = Field(
        "auto", description="With async_steps > 0 and the hf engine, where tokens are generated: 'process', an "
                            "HFEngine in a child process sampling from a shared-memory copy of the policy (its own "
                            "interpreter: no GIL shared with the trainer); 'thread', in the sampler thread of the "
                            "trainer's process. The sampler thread runs tools, rewards and the queue either way; "
                            "both give the same completions. auto: process on CPU in one process (faster there: "
                            "benchmarks/async_rollouts.py), thread on GPUs and under torchrun (process not tested "
                            "there yet). The vLLM engine runs its own workers (rollout.vllm).")
    sampler_device: str = Field(
        "auto", description="With async_steps > 0 and the hf engine, the device the sampler's copy of the policy "
                            "samples on: e.g. 'cuda:1' keeps generation (weights, KV cache) off the trainer's GPU "
                            "on a machine with several; each published version is copied to it. auto: the "
                            "trainer's device (model.device). One process only (under torchrun each rank samples "
                            "on its own GPU).")

    @field_validator("sampler_device", mode="before")
    @classmethod
    def _known_sampler_device(cls, value: Any) -> Any:
        return check_device(str(value), "rollout.sampler_device") if isinstance(value, (str, int)) else value

    @field_validator("servers")
    @classmethod
    def _server_urls(cls, urls: list[str]) -> list[str]:
        from urllib.parse import urlparse

        for url in urls:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
                raise ValueError(f"rollout.servers: {url!r} is not a server URL; write http://HOST:PORT, as rlft serve "
                                 "prints it")
        if len(set(urls)) != len(urls):
            raise ValueError("rollout.servers lists a server twice")
        return [u.rstrip("/") for u in urls]

    @model_validator(mode="after")
    def _vllm_sampling(self) -> "RolloutConfig":
        if self.servers and self.engine != "vllm":
            raise ValueError("rollout.servers are vLLM servers: set rollout.engine=vllm (or drop rollout.servers)")
        if self.engine == "vllm":
            check_vllm_sampling(self.temperature, self.top_p, self.top_k, "rollout")
            if self.sampler == "process":
                raise ValueError("rollout.sampler=process runs the hf engine in a child process; the vLLM engine "
                                 "has its own worker processes (rollout.vllm): drop rollout.sampler or set it to auto")
        return self


# vLLM's largest accepted temperature
VLLM_MAX_TEMPERATURE = 2.0


def check_vllm_sampling(temperature: float, top_p: float, top_k: int, where: str) -> None:
    """What the vLLM engine cannot do the way the trainer needs it (see rlft.rollout.vllm_engine)."""
    if temperature > 0 and (top_p < 1.0 or top_k):
        raise ValueError(f"{where}: the vLLM engine reports log-probs renormalised over the top-p / top-k tokens, "
                         "which differ from the trainer's log_softmax(logits / temperature); set top_p=1.0 and "
                         "top_k=0, or use rollout.engine=hf")
    if temperature > VLLM_MAX_TEMPERATURE:
        raise ValueError(f"{where}.temperature={temperature}: the vLLM engine accepts at most "
                         f"{VLLM_MAX_TEMPERATURE} (vLLM's limit); lower it or use rollout.engine=hf")


class AgentConfig(Section):
    """Multi-turn rollouts with tools and/or an environment (online methods; either engine, any number
    of ranks): each assistant turn is sampled, its tool calls run, their results inserted (never
    trained on); a turn without calls is the environment's action, its observation inserted alike.
    Held-out evals, eval suites, `rlft eval` of the run and `rlft data screen` run episodes too.
    With method sft (the cold start on tool-use transcripts): `tools` and `parser` say how the
    rows are shown (the tools in the prompt, each call in the parser's syntax) and
    `max_tool_output_tokens` cuts results as rollouts do; the environment and the episode limits apply to
    rollouts only. See guides/agents.md."""

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call: built-in 'calculator', or 'module:function' / 'file.py:function' "
                    "(type hints and a docstring with Args: give the schema the template shows).")
    environment: str | None = Field(
        None, description="What answers a turn without tool calls: 'module:Class' / 'file.py:Class' (reset(**row), "
                          "step(text) -> (observation, reward, done); see rlft/rollout/agent/environments.py) or "
                          "'gem:<env id>' (gem-llm's games, e.g. gem:game:GuessTheNumber-v0-easy; pip install "
                          "'rlft[gem]'), or 'openenv:http://HOST:PORT' / 'openenv:module:Class' (an OpenEnv "
                          "server, or one served in this process; pip install 'rlft[openenv]'). One instance per "
                          "episode, made as Class(seed=..., **environment_args). Or 'verifiers:my_env' / "
                          "'verifiers:path/env.py': a verifiers environment (load_environment(**environment_args)) "
                          "that runs its own rollouts and rubric through the policy's endpoint, as agent.program "
                          "does; pip install 'rlft[verifiers]'.")
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the environment's class (for gem: gem.make; for "
                                          "openenv: its reset, besides action_field, observation_field and "
                                          "keep_prompt; for verifiers: load_environment, or a 0.4 taskset's "
                                          "config fields).")
    environment_eval_args: dict[str, Any] = Field(
        default_factory=dict, description="verifiers 0.4 tasksets, which have no eval split: the taskset config "
                                          "fields (over environment_args) that make its held-out tasks, read by "
                                          "data.eval: verifiers:eval (e.g. {split: test}).")
    max_turns: int = Field(4, ge=1, description="Assistant turns per episode (each at most rollout.max_new_tokens); "
                                                "a call on the last one is not run.")
    max_total_tokens: int = Field(
        1024, ge=1, description="One budget for everything after the prompt (sampled and tool tokens); an "
                                "observation that would fill it ends the episode as truncated.")
    max_tool_output_tokens: int = Field(256, ge=1, description="A tool result longer than this is cut, with a marker.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Time limit per tool call; a late call is an error result.")
    env_step_timeout_s: float = Field(
        60.0, gt=0, description="Time limit per environment call (reset, step). A late step ends its episode "
                                "there, as a late tool call does under on_tool_error=end (it cannot go on as under "
                                "observe: the environment is still inside that step), counted as env/step_timeouts; "
                                "a late reset stops the run with the last completed step saved (its episodes have "
                                "no prompt). 60 s: environments run one call at a time, so a healthy step takes "
                                "well under a second (a step of seconds already makes a rollout of many episodes "
                                "slow); a minute leaves room for a grader or simulated user that calls a service, "
                                "and cuts a hung call in a minute instead of holding the run forever.")
    max_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; further ones get an error result.")
    check_drift: bool = Field(
        True, description="Re-render each finished episode through the template and log how many trained tokens "
                          "differ from it (agent/retokenize_drift): what re-tokenising would have trained on.")
    parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="Tool-call syntax: hermes = <tool_call>{json}</tool_call> (Qwen, Hermes); llama3_json = "
                            "the whole turn is {\"name\": ..., \"parameters\": {...}} (Llama 3.1-3.3); auto picks "
                            "from the chat template (hermes when it names neither).")
    tools_prompt: str | None = Field(
        None, description="For a chat template without tool support: the system-prompt block that presents the "
                          "tools, with {schemas} (their JSON schemas, one a line), {signatures} (one "
                          "'name(arg: type): description' line a tool) and {syntax} (how the parser reads a call) "
                          "filled in; other braces stay as written. Default: the JSON schemas and the call syntax "
                          "(rollout/agent/turns.py TOOLS_BLOCK). Templates with tool support present tools their own way.")
    on_tool_error: Literal["observe", "end"] = Field(
        "observe", description="A turn whose calls include a failed one: observe = the model reads the error results "
                               "and goes on; end = the episode ends there (finish 'stop', nothing inserted).")
    schedule: Literal["rounds", "continuous"] = Field(
        "rounds", description="How episodes share the engine: rounds = every live episode's next turn in one batch, "
                              "after the slowest tool call of the round (bitwise reproducible); continuous = each "
                              "turn joins the decode batch as soon as its episode's calls return, so a slow call "
                              "holds up only its own episode (faster with slow tools; the same sampling streams, but "
                              "which rows share a batch follows tool timing, so float rounding is not reproducible "
                              "bit for bit). The hf engine (LLaMA-family models; others keep rounds) or vLLM (each "
                              "turn a request added to the running engine).")
    program: str | None = Field(
        None, description="Your own agent loop as the episode: 'file.py:run' / 'module:run', an `async def "
                          "run(client, row) -> float | dict` given an openai.AsyncOpenAI client on the policy's "
                          "endpoint and the data row; its return value is the episode's reward (rewards: "
                          "[{fn: program}]). Every model call is recorded and trained on token-exactly; tools live "
                          "in the program (the OpenAI tools API), not in agent.tools. Needs pip install "
                          "'rlft[openai]'.")
    episode_timeout_s: float = Field(
        300.0, gt=0, description="agent.program: time limit for one episode; a program still running then ends "
                                 "with nothing trained and reward 0 (agent/errors/program_timeout).")

    @model_validator(mode="after")
    def _program_alone(self) -> "AgentConfig":
        if self.program is not None and (self.tools or self.environment):
            raise ValueError("agent.program runs its own loop (its tools go through the OpenAI tools API): drop "
                             "agent.tools and agent.environment, or drop agent.program")
        if self.environment_eval_args and not (self.environment or "").startswith("verifiers:"):
            raise ValueError("agent.environment_eval_args configures a verifiers taskset's held-out tasks; "
                             "agent.environment is not a verifiers environment (drop it)")
        if self.environment is not None and self.environment.startswith("verifiers:"):
            if self.tools:
                raise ValueError(f"agent.environment {self.environment!r} runs its own rollouts (a vf.ToolEnv brings "
                                 "its tools): drop agent.tools")
        return self

    @field_validator("environment")
    @classmethod
    def _environment_ref(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("verifiers:"):
            target = value[len("verifiers:"):]
            if not target or ":" in target:
                raise ValueError(f"agent.environment {value!r}: write it as 'verifiers:my_env' (an importable module "
                                 "or installed environment) or 'verifiers:path/env.py', whose load_environment "
                                 "makes the environment")
            if target.endswith(".py"):
                return "verifiers:" + paths.existing(_local(target, f"agent.environment {value!r}"))
            return value
        if value is None or value.startswith("gem:"):
            if value == "gem:":
                raise ValueError("agent.environment 'gem:' names no environment; write e.g. "
                                 "gem:game:GuessTheNumber-v0-easy")
            return value
        prefix = "openenv:" if value.startswith("openenv:") else ""
        if prefix and value[len(prefix):].startswith(("http://", "https://", "ws://", "wss://")):
            return value
        target, sep, attr = value[len(prefix):].rpartition(":")
        if not sep or not target or not attr:
            if prefix:
                raise ValueError(f"agent.environment {value!r}: write it as 'openenv:http://HOST:PORT' (a running "
                                 "server), 'openenv:module:Class' or 'openenv:path/file.py:app'")
            raise ValueError(f"agent.environment {value!r}: write it as 'module:Class', 'path/file.py:Class' or "
                             "'gem:<env id>'")
        if target.endswith(".py"):
            _local(target, f"agent.environment {value!r}")
        return prefix + paths.function_ref(value[len(prefix):])

    @model_validator(mode="after")
    def _tools_or_environment(self) -> "AgentConfig":
        if not self.tools and self.environment is None and self.program is None:
            raise ValueError("agent: give tools (agent.tools) or an environment (agent.environment), or both, or "
                             "your own agent loop (agent.program); without any an episode is one turn (drop the "
                             "agent section)")
        return self
