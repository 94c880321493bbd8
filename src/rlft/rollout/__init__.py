"""Rollout engines and what they return.

- `contract.py`: `Completion`, `Engine`, `SamplingParams`, what every engine honours
- `engines.py`: `build_engine`, the one way to make an engine (`hf` or `vllm`)
- `hf.py`, `continuous.py`, `fast_decode.py`: the HF engine (the training model itself)
- `vllm_engine.py`, `vllm_weights.py`, `vllm_worker.py`: the colocated vLLM engine (an optional extra)
- `sampler_process.py`: an engine in a process of its own (async runs)
- `batch.py`, `seeds.py`: completions as training tensors; per-request sampling streams
- `agent/`: multi-turn episodes with tools and environments, above the engines
"""

from rlft.rollout.contract import Completion, Engine, SamplingParams
from rlft.rollout.engines import build_engine, rollout_dtype, rollout_engine, sampling_params

__all__ = ["Completion", "Engine", "SamplingParams", "build_engine", "rollout_dtype", "rollout_engine",
           "sampling_params"]
