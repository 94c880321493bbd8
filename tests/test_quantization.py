"""model.quantization=4bit (QLoRA) on a machine without a GPU: the clear errors, the exact
BitsAndBytesConfig and peft preparation the loader asks for (captured, not run: 4-bit weights
need bitsandbytes on CUDA), the adapter-only export and its reload."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging

import pytest
import torch
import yaml

from conftest import assert_clean_user_error, make_config, run_main, write_jsonl
from rlft.config import EvalConfig, LoraConfig, ModelConfig
from rlft.errors import ConfigError, RlftError
from rlft.eval import run as eval_run
from rlft.models import loading
from rlft.models.loading import (QuantizedBase, Reference, check_4bit_support, export_model, is_adapter_export,
                                 load_adapter_export, load_policy, load_reward_model)

LORA = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)


def test_4bit_without_lora_is_refused_before_anything_loads(tmp_path):
    cfg = ModelConfig(path=str(tmp_path / "no-such-model"), device="cpu", quantization="4bit")
    with pytest.raises(ConfigError) as err:  # the config is named first, not the missing folder
        load_policy(cfg, LoraConfig())
    assert str(err.value) == "model.quantization=4bit: 4-bit weights cannot be trained directly; set lora.enabled: true"


def test_missing_bitsandbytes_and_gpu_are_one_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(RlftError) as err:
        check_4bit_support(torch.device("cpu"))
    text = str(err.value)
    assert text.count("\n") == 1 and "pip install 'rlft[qlora]'" in text
    assert "bitsandbytes is not installed" in text and "model.device resolves to cpu" in text
    with pytest.raises(RlftError, match="needs bitsandbytes on a CUDA GPU: bitsandbytes is not installed\n"):
        check_4bit_support(torch.device("cuda:0"))  # on a GPU machine only the package is missing


def test_bitsandbytes_version_and_device(monkeypatch):
    installed = {"version": "0.45.5"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed["version"])
    check_4bit_support(torch.device("cuda:1"))  # new enough, on CUDA: nothing to say
    with pytest.raises(RlftError, match=r"model.device resolves to cpu") as err:
        check_4bit_support(torch.device("cpu"))
    assert "not installed" not in str(err.value)
    installed["version"] = "0.41.3"
    with pytest.raises(RlftError, match=r"bitsandbytes 0.41.3 is older than 0.43"):
        check_4bit_support(torch.device("cuda:0"))


def test_this_machine_gets_the_clear_error_through_the_cli(monkeypatch, capsys, qwen_path, sft_data, tmp_path):
    config = make_config(qwen_path, sft_data["train"], tmp_path / "run", model={"path": str(qwen_path),
                         "device": "cpu", "quantization": "4bit"}, lora={"enabled": True})
    path = tmp_path / "qlora.yaml"
    path.write_text(yaml.safe_dump(config))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(path)))
    assert "model.quantization=4bit needs bitsandbytes on a CUDA GPU" in stderr
    config["lora"] = {"enabled": False}
    path.write_text(yaml.safe_dump(config))
    stderr = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(path)))
    assert "set lora.enabled: true" in stderr


def test_reward_model_training_is_not_quantised(qwen_path):
    with pytest.raises(ConfigError, match="reward-model training"):
        load_reward_model(ModelConfig(path=str(qwen_path), device="cpu", quantization="4bit"), LORA)


@pytest.fixture
def captured_4bit_load(monkeypatch):
    """load_policy as on a GPU with bitsandbytes, with `from_pretrained` and peft's
    `prepare_model_for_kbit_training` recorded: the quantisation arguments are captured and
    dropped, so the weights load in fp32 on CPU (nothing here runs in 4 bits)."""
    import peft
    from transformers import AutoModelForCausalLM

    calls: dict[str, dict] = {}
    real_load = AutoModelForCausalLM.from_pretrained.__func__
    real_prepare = peft.prepare_model_for_kbit_training

    def from_pretrained(cls, path, *args, **kwargs):
        calls["from_pretrained"] = dict(kwargs)
        kwargs.pop("quantization_config", None)
        kwargs.pop("device_map", None)
        return real_load(cls, path, *args, **kwargs)

    def prepare(model, **kwargs):
        calls["prepare"] = kwargs
        return real_prepare(model, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(peft, "prepare_model_for_kbit_training", prepare)
    monkeypatch.setattr(loading, "check_4bit_support", lambda device: None)
    # "auto" finds a GPU; the weights stay on the CPU (device_map is dropped, a 4-bit model is not moved)
    monkeypatch.setattr(loading, "resolve_device", lambda name: torch.device("cuda:0" if name == "auto" else name))
    return calls


def test_4bit_load_asks_for_nf4_double_quant_bf16(captured_4bit_load, qwen_path):
    from transformers import BitsAndBytesConfig

    cfg = ModelConfig(path=str(qwen_path), quantization="4bit", gradient_checkpointing=True)
    policy = load_policy(cfg, LORA)
    kwargs = captured_4bit_load["from_pretrained"]
    q = kwargs["quantization_config"]
    assert isinstance(q, BitsAndBytesConfig)
    assert (q.load_in_4bit, q.load_in_8bit, q.bnb_4bit_quant_type, q.bnb_4bit_compute_dtype,
            q.bnb_4bit_use_double_quant) == (True, False, "nf4", torch.bfloat16, True)
    assert kwargs["device_map"] == {"": 0}  # placed on the GPU as it loads, never moved after
    assert captured_4bit_load["prepare"] == {"use_gradient_checkpointing": True,
                                             "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert policy.is_lora and policy.quantized_base == QuantizedBase(str(qwen_path), None, "4bit")
    assert policy.model.base_model.model.is_gradient_checkpointing
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base is frozen, only adapters train
    assert Reference(policy).frozen_copy is None  # KL reference: the same base with adapters disabled


def test_no_quantization_loads_as_before(captured_4bit_load, qwen_path):
    load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LORA)
    assert "quantization_config" not in captured_4bit_load["from_pretrained"]
    assert "device_map" not in captured_4bit_load["from_pretrained"] and "prepare" not in captured_4bit_load


def test_4bit_export_writes_the_adapter_and_reloads_it(captured_4bit_load, qwen_path, tmp_path, caplog, monkeypatch):
    policy = load_policy(ModelConfig(path=str(qwen_path), quantization="4bit"), LORA)
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter an effect the reload must keep
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        trained = policy.model(input_ids=ids).logits
    with caplog.at_level(logging.WARNING, logger="rlft.models.loading"):
        out = export_model(policy, tmp_path / "final")
    assert "holds the LoRA adapter only" in caplog.text and str(qwen_path) in caplog.text
    assert policy.is_lora  # nothing was merged
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    record = json.loads((out / "adapter_base.json").read_text())
    assert (record["base"], record["quantization"]) == (str(qwen_path.resolve()), "4bit")
    assert is_adapter_export(out) and not is_adapter_export(qwen_path)

    # reloading needs the same 4-bit base: the loader asks for it exactly as in training
    captured_4bit_load.clear()
    reloaded = load_adapter_export(out)
    assert captured_4bit_load["from_pretrained"]["quantization_config"].bnb_4bit_quant_type == "nf4"
    with torch.no_grad():
        again = reloaded.model(input_ids=ids).logits
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)  # the adapter came back, exactly
    with reloaded.model.disable_adapter(), torch.no_grad():
        assert (reloaded.model(input_ids=ids).logits - trained).abs().max() > 1e-3  # and it matters

    # `rlft eval` on such a folder generates from base + adapter (here the CPU copy of the reload)
    asked = []

    def load_on_cpu(folder, device):
        asked.append(folder)
        return dataclasses.replace(reloaded, device=torch.device("cpu"))

    monkeypatch.setattr(eval_run, "load_adapter_export", load_on_cpu)
    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 3?"}, {"prompt": "Say hi."}])
    result = eval_run.evaluate_model(out, str(rows), [], EvalConfig(max_new_tokens=4), device="cpu")
    assert asked == [out] and len(result.records) == 2 and result.metrics["eval/num_prompts"] == 2

    # here, unpatched, the reload stops at the clear error (no bitsandbytes, no GPU)
    monkeypatch.undo()
    with pytest.raises(RlftError, match="needs bitsandbytes on a CUDA GPU"):
        load_adapter_export(out, device="cpu")


@pytest.mark.parametrize("update, fix", [
    ({}, "set lora.enabled: true"),
    ({"method": "reward_model", "lora": {"enabled": True}}, "reward-model training is not quantised"),
    ({"method": "grpo", "lora": {"enabled": True}, "rewards": [{"fn": "math"}], "rollout": {"engine": "vllm"}},
     "use rollout.engine=hf"),
])
def test_impossible_4bit_combinations_fail_when_the_config_loads(tmp_path, update, fix):
    from rlft.config import load_config

    cfg = make_config(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                      model={"path": str(tmp_path / "model"), "quantization": "4bit"})
    with pytest.raises(ConfigError, match=fix):
        load_config({**cfg, **update})
