"""The lean decode step computes what the model's own forward computes (oracle: transformers)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlft.config import LoraConfig
from rlft.models.loading import apply_lora
from rlft.rollout.fast_decode import LeanDecoder
from rlft.models.forward import position_ids_for


def _model(kind: str, **extra):
    dims = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=0)
    dims.update(extra)
    config = Qwen2Config(**dims) if kind == "qwen2" else LlamaConfig(**dims)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # make biases and norms non-trivial so a dropped term would show
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _left_padded(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def _compare(model, steps=6, atol=1e-5, rtol=1e-4, dtype=None):
    """Lean steps against the model's forward over the whole sequence; `dtype`: the decoder's cast."""
    ids, mask = _left_padded([5, 9, 7], model.config.vocab_size)
    future = torch.randint(1, model.config.vocab_size, (3, steps), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        pos = position_ids_for(mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        lean = LeanDecoder.build(model, ids.shape[1] + steps, dtype)
        assert lean is not None
        lean.load_cache(cache)
        attention, next_pos = mask, pos[:, -1:] + 1
        for t in range(steps):
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            got = lean.step(future[:, t], next_pos, attention.bool())
            full_ids = torch.cat([ids, future[:, : t + 1]], dim=1)
            want = model(input_ids=full_ids, attention_mask=attention, position_ids=position_ids_for(attention),
                         use_cache=False).logits[:, -1]
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
            next_pos = next_pos + 1
    return lean


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_lean_decode_matches_the_model_forward(kind):
    _compare(_model(kind))


def test_weights_and_cache_are_cast_once_to_the_rollout_dtype():
    """Under bf16 autocast the decoder keeps bf16 copies of the (fused) weights and a bf16 KV cache
    instead of letting autocast cast the fp32 weights and the float32 keys (RoPE's output) in every
    layer of every step (generation 6.8 -> 3.1 s in the bench's large-full-defaults run, bf16 CPU).
    Its logits agree with the model's own autocast forward to bf16 rounding: 4 ulps of the largest logit
    (|logit| < 0.6 here, ulp 2^-9), 8e-3; measured: equal on this CPU."""
    model = _model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = _compare(model, steps=4, atol=8e-3, rtol=0.0, dtype=torch.bfloat16)
    assert {lean.layers[0].qkv[0].dtype, lean.layers[0].down[0].dtype, lean.keys[0].dtype,
            lean.values[0].dtype} == {torch.bfloat16}
    assert lean.head is None  # a trained head: autocast's own cached cast serves it
    assert next(model.parameters()).dtype == torch.float32  # the model itself untouched
    model.lm_head.weight.requires_grad_(False)  # frozen (as under LoRA): cast once by the decoder
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = _compare(model, steps=4, atol=8e-3, rtol=0.0, dtype=torch.bfloat16)
    assert lean.head[0].dtype == torch.bfloat16


def test_grouped_query_attention():
    _compare(_model("llama", num_key_value_heads=2))


def test_lora_deltas_are_folded_in_without_touching_the_model():
    model = _model("qwen2")
    peft_model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    peft_model.eval()
    _compare(peft_model)
    after = peft_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_row_selection_keeps_the_remaining_rows_exact():
    model = _model("llama")
    ids, mask = _left_padded([4, 6, 5], model.config.vocab_size)
    with torch.no_grad():
        pos = position_ids_for(mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        lean = LeanDecoder.build(model, ids.shape[1] + 2)
        lean.load_cache(out["cache"] if "cache" in out else out["past_key_values"])
        keep = torch.tensor([0, 2])
        lean.select(keep)
        attention = torch.cat([mask[keep], torch.ones((2, 1), dtype=mask.dtype)], dim=1)
        token = torch.tensor([7, 11])
        got = lean.step(token, pos[keep, -1:] + 1, attention.bool())
        full = torch.cat([ids[keep], token[:, None]], dim=1)
        want = model(input_ids=full, attention_mask=attention, position_ids=position_ids_for(attention)).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_unsupported_models_fall_back():
    model = _model("qwen2", use_sliding_window=True, sliding_window=4)
    assert LeanDecoder.build(model, 64) is None
    gelu = _model("llama", hidden_act="gelu")
    assert LeanDecoder.build(gelu, 64) is None
