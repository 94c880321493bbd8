"""Run configuration: one pydantic model per section, YAML plus `a.b=value` overrides.

Every field's default and meaning is declared once, in the section's module:

- `model.py`: `model`, `lora`, `teacher`
- `data.py`: `data` (and its mixture sources)
- `training.py`: `training`, `checkpoint`
- `rollout.py`: `rollout` (and its `vllm` settings), `agent`
- `algorithm.py`: the methods and their presets; `algorithm`, `critic`, `dpo`, `reward_model`
- `rewards.py`: `rewards`, `scoring`
- `eval.py`: `eval`
- `monitor.py`: `monitor`, `logging`
- `run.py`: `Config`, every section together, and the checks that span sections
- `load.py`: YAML files, overrides, readable validation errors

The online presets (`grpo`, `dapo`, ...) are resolved when the config is loaded, so the
`config.yaml` saved in a run directory states every value the run used; nothing is changed at run
time. This package's face re-exports what callers use: `from rlft.config import Config`.
"""

from rlft.config.algorithm import (_BASE_PRESET, METHOD_LEARNING_RATES, OFFLINE_METHODS, ONLINE_METHODS, PRESETS,
                                   AlgorithmConfig, CriticConfig, DpoConfig, Method, RewardModelConfig)
from rlft.config.data import DataConfig, MixSource
from rlft.config.eval import EvalConfig, EvalSuite, SuiteSampling
from rlft.config.load import (_section_type, apply_override, dump_config, load_config, load_yaml, validate_config,
                              validate_flags)
from rlft.config.model import LoraConfig, ModelConfig, TeacherConfig
from rlft.config.monitor import LoggerSettings, LoggingConfig, MonitorConfig
from rlft.config.rewards import RewardSpec, ScoringConfig
from rlft.config.rollout import AgentConfig, RolloutConfig, ServerSettings, VllmSettings, check_vllm_sampling
from rlft.config.run import Config, config_warnings
from rlft.config.section import Section, check_device
from rlft.config.training import CheckpointConfig, TrainingConfig

__all__ = ["_BASE_PRESET", "METHOD_LEARNING_RATES", "OFFLINE_METHODS", "ONLINE_METHODS", "PRESETS", "AgentConfig",
           "AlgorithmConfig", "CheckpointConfig", "Config", "CriticConfig", "DataConfig", "DpoConfig", "EvalConfig",
           "EvalSuite", "LoggerSettings", "LoggingConfig", "LoraConfig", "Method", "MixSource", "ModelConfig",
           "MonitorConfig", "RewardModelConfig", "RewardSpec", "RolloutConfig", "ScoringConfig", "Section",
           "ServerSettings", "SuiteSampling", "TeacherConfig", "TrainingConfig", "VllmSettings", "_section_type",
           "apply_override",
           "check_device", "check_vllm_sampling", "config_warnings", "dump_config", "load_config", "load_yaml",
           "validate_config", "validate_flags"]
