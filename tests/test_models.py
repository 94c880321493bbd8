"""Loading the policy: dtype/device errors, LoRA, and the reference model used for KL terms."""

from __future__ import annotations

import pytest
import torch

from rlft.config import LoraConfig, ModelConfig
from rlft.errors import RlftError
from rlft.models.loading import Reference, load_policy
from rlft.models.template import encode_prompt
from rlft.models.forward import sft_token_nll


def _inputs(tokenizer) -> torch.Tensor:
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "What is 17 + 25? Think step by step."}])
    return torch.tensor([ids])  # [1, T]


@torch.no_grad()
def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.float()


@pytest.fixture(scope="module")
def base_model(qwen_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_path).eval()


# -- dtype / device -----------------------------------------------------------------------------

def test_fp16_on_cpu_is_a_clear_error(qwen_path):
    with pytest.raises(RlftError) as info:
        load_policy(ModelConfig(path=str(qwen_path), dtype="fp16", device="cpu"), LoraConfig())
    message = str(info.value)
    assert "model.dtype=fp16" in message and "CPU" in message
    assert "bf16 or fp32" in message  # the fix


def test_bf16_on_cpu_loads_bf16_weights(qwen_path):
    policy = load_policy(ModelConfig(path=str(qwen_path), dtype="bf16", device="cpu"), LoraConfig())
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    assert policy.device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_a_clear_error(qwen_path):
    with pytest.raises(RlftError, match="no CUDA GPU is visible; use model.device=cpu"):
        load_policy(ModelConfig(path=str(qwen_path), device="cuda"), LoraConfig())


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(RlftError, match="no such folder"):  # more cases: test_model_folders.py
        load_policy(ModelConfig(path=str(tmp_path / "nope"), device="cpu"), LoraConfig())


# -- LoRA and the reference model ---------------------------------------------------------------

def test_lora_policy_trains_only_adapters(qwen_path):
    policy = load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig(enabled=True, r=4))
    assert policy.is_lora
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    # all-linear on 4 layers: q, k, v, o, gate, up, down = 7 modules x 4 layers x (A, B)
    assert len(names) == 7 * 4 * 2


def test_lora_reference_is_the_base_model(qwen_path, base_model):
    policy = load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig(enabled=True, r=4, dropout=0.0))
    input_ids = _inputs(policy.tokenizer)
    # peft starts lora_B at zero (adapter = identity); make it non-trivial
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    policy.model.train()
    base = _logits(base_model, input_ids)
    with_adapter = _logits(policy.model.eval(), input_ids)
    policy.model.train()
    assert (with_adapter - base).abs().max() > 1e-2  # the adapter changes the logits

    reference = Reference(policy)
    with reference.model() as ref:
        ref_logits = _logits(ref, input_ids)
    torch.testing.assert_close(ref_logits, base, atol=1e-6, rtol=0)
    # leaving the context restores the adapters and the training mode
    assert policy.model.training
    torch.testing.assert_close(_logits(policy.model.eval(), input_ids), with_adapter, atol=1e-6, rtol=0)
    assert reference.state_dict() is None  # nothing to checkpoint: the base weights are the reference


def test_full_reference_is_a_frozen_copy(qwen_path, base_model):
    policy = load_policy(ModelConfig(path=str(qwen_path), device="cpu"), LoraConfig())
    reference = Reference(policy)
    input_ids = _inputs(policy.tokenizer)
    with reference.model() as ref:
        before = _logits(ref, input_ids)
        assert all(not p.requires_grad for p in ref.parameters())
        ref_ptrs = {p.data_ptr() for p in ref.parameters()}
    assert not ref_ptrs & {p.data_ptr() for p in policy.model.parameters()}
    torch.testing.assert_close(before, _logits(base_model, input_ids), atol=1e-6, rtol=0)

    # a few optimizer steps on the policy
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    for _ in range(2):
        loss = sft_token_nll(policy.model, input_ids, torch.ones_like(input_ids), mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert (_logits(policy.model.eval(), input_ids) - before).abs().max() > 1e-2  # the policy moved

    with reference.model() as ref:
        assert torch.equal(_logits(ref, input_ids), before)  # the reference did not


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(qwen_path, lora):
    """Recomputing activations in backward changes memory, not maths: same loss, same gradients
    (and it is really on: the model recomputes inside its layers' backward)."""
    from rlft.models.forward import sft_token_nll

    ids = torch.randint(5, 400, (3, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    targets = mask.bool().clone()
    targets[:, :8] = False
    grads, losses = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # same LoRA init both times
        policy = load_policy(ModelConfig(path=str(qwen_path), gradient_checkpointing=checkpointing),
                             LoraConfig(enabled=lora, dropout=0.0))
        base = policy.model.get_base_model() if lora else policy.model
        assert base.is_gradient_checkpointing == checkpointing
        policy.model.train()
        loss = sft_token_nll(policy.model, ids, mask, targets)
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
