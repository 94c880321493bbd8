"""Export: `final/` is a plain Hugging Face checkpoint with the logits of the trained model (with
and without LoRA), carries the peft adapter and the template record, and a run started from it
with a different chat template stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CHANGED_TEMPLATE, make_config
from rlft import api
from rlft.config import LoraConfig, ModelConfig, load_config
from rlft.errors import TemplateMismatchError
from rlft.models.loading import load_policy, load_tokenizer
from rlft.models.template import TEMPLATE_RECORD, encode_prompt, template_record
from rlft.training.offline.loop import run_offline


def _batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of different lengths, right-padded: input_ids, attention_mask  # [2, T]"""
    rows = [encode_prompt(tokenizer, [{"role": "user", "content": "What is 31 + 4?"}]),
            encode_prompt(tokenizer, [{"role": "user", "content": "What is 7 + 250? Answer briefly."}])]
    width = max(map(len, rows))
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    ids, mask = batch
    model.eval()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return logits[mask.bool()]  # [n_real_tokens, V]: padded positions are not compared


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


# -- full fine-tuning -------------------------------------------------------------------------

def test_export_matches_the_trained_model(sft_run, qwen_path):
    final = sft_run.root / "final"
    batch = _batch(sft_run.policy.tokenizer)
    exported = _logits(_plain(final), batch)
    trained = _logits(sft_run.policy.model, batch)
    torch.testing.assert_close(exported, trained, atol=1e-5, rtol=0)
    # the last checkpoint holds the same weights
    checkpoint = _logits(_plain(sft_run.root / "checkpoints" / "step-00000040" / "model"), batch)
    torch.testing.assert_close(checkpoint, trained, atol=1e-5, rtol=0)
    # and training changed the model
    assert (exported - _logits(_plain(qwen_path), batch)).abs().max() > 1e-1


def test_export_carries_tokenizer_template_and_record(sft_run):
    final = sft_run.root / "final"
    record = json.loads((final / TEMPLATE_RECORD).read_text())
    tok = load_tokenizer(ModelConfig(path=str(final)))
    assert record == template_record(tok) == template_record(sft_run.policy.tokenizer)
    text = "a  b\n\tc 12 + 3"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_a_run_from_final_with_a_changed_template_stops(sft_run, sft_data, tmp_path):
    final = sft_run.root / "final"
    config = make_config(final, sft_data["train"], tmp_path / "next", model={"chat_template": CHANGED_TEMPLATE})
    with pytest.raises(TemplateMismatchError) as info:
        api.train(config)
    message = str(info.value)
    assert str(final) in message
    assert "first difference at character 225" in message  # see test_template for the count
    assert not (tmp_path / "next" / "metrics.jsonl").exists()
    # the same template as the checkpoint's goes through
    policy = load_policy(ModelConfig(path=str(final), device="cpu"), LoraConfig())
    assert template_record(policy.tokenizer) == json.loads((final / TEMPLATE_RECORD).read_text())


# -- LoRA -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, qwen_path, sft_data):
    root = tmp_path_factory.mktemp("lora_run")
    config = load_config(make_config(
        qwen_path, sft_data["train"], root / "run",
        lora={"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0},
        training={"learning_rate": 1e-2, "batch_size": 8, "max_steps": 4}))
    policy = load_policy(config.model, config.lora)
    summary = run_offline(config, policy=policy)
    return config, policy, summary


def test_lora_export_matches_base_plus_adapter(lora_run, qwen_path):
    from peft import PeftModel

    config, policy, summary = lora_run
    root = config.output_dir
    final = summary["final_model"]
    assert summary["status"] == "completed" and summary["step"] == 4
    batch = _batch(policy.tokenizer)
    base = _logits(_plain(qwen_path), batch)

    # the end-of-training model: base weights + the adapter of the last checkpoint (unmerged)
    trained = _logits(PeftModel.from_pretrained(_plain(qwen_path), f"{root}/checkpoints/step-00000004/adapter"),
                      batch)
    assert (trained - base).abs().max() > 1e-2  # four steps at lr 1e-2 moved the adapter

    merged = _plain(final)
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain checkpoint
    torch.testing.assert_close(_logits(merged, batch), trained, atol=1e-5, rtol=0)

    # final/adapter/ is a peft adapter folder that reproduces the same model on the base
    adapter = PeftModel.from_pretrained(_plain(qwen_path), f"{final}/adapter")
    torch.testing.assert_close(_logits(adapter, batch), trained, atol=1e-5, rtol=0)
    adapter_config = json.loads(open(f"{final}/adapter/adapter_config.json").read())
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16

    # the in-memory policy was merged by the export and is the same model
    assert not policy.is_lora
    torch.testing.assert_close(_logits(policy.model, batch), trained, atol=1e-5, rtol=0)


def test_lora_export_has_template_record_and_reloads(lora_run):
    config, _, summary = lora_run
    final = summary["final_model"]
    assert Path(final, TEMPLATE_RECORD).is_file()
    # a later run (e.g. RL after SFT) can start from final/: the template check passes
    policy = load_policy(ModelConfig(path=final, device="cpu"), LoraConfig(enabled=True, r=4))
    assert policy.is_lora
