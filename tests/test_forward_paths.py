"""`rlft.models.forward` on real transformers models: the hidden-state path (decoder + chunked head)
against the model's own logits, for tied embeddings, LoRA (on the body and on lm_head), Gemma-2
soft-capping and an unknown logit scaling; and the memory it saves with a 151,936-token vocabulary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import take_grads
from rlft.models.forward import completion_logprobs, forward_logits, lm_head, position_ids_for, sft_token_nll

PROMPTS = [[5, 9, 31, 7], [12, 40], [3, 3, 8]]
COMPLETIONS = [[44, 61, 2, 17, 90], [8, 11], [70, 71, 72, 73]]


def rollout_batch(prompts=PROMPTS, completions=COMPLETIONS):
    """[left-padded prompt | right-padded completion], as `RolloutBatch` lays it out."""
    p, t = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p + t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (pr, co) in enumerate(zip(prompts, completions)):
        ids[i, p - len(pr):p], ids[i, p:p + len(co)] = torch.tensor(pr), torch.tensor(co)
        mask[i, p - len(pr):p + len(co)] = 1
    return ids, mask, t


def plain_completion(model, ids, mask, tc, temperature):
    """The oracle: the model's own full logits, log-softmax, gather."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False).logits
    logp = F.log_softmax(logits[:, -tc - 1:-1].float() / temperature, -1)
    lp = logp.gather(-1, ids[:, -tc:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def loss_of(lp, ent, mask):
    """A loss that weighs every valid token differently (so a misplaced token would show)."""
    w = torch.arange(1, lp.numel() + 1, dtype=torch.float32).view_as(lp) / lp.numel()
    return ((w * lp + 0.1 * w.flip(-1) * ent) * mask).sum()


def compare_with_plain(model, temperature=0.9, expect_fused=True):
    ids, mask, tc = rollout_batch()
    cmask = mask[:, -tc:].bool()
    lp, ent = completion_logprobs(model, ids, mask, tc, temperature, entropy="grad")
    assert (lm_head(model) is not None and lm_head(model).fused) == expect_fused
    loss_of(lp, ent, cmask).backward()
    ours = take_grads(model)
    ref_lp, ref_ent = plain_completion(model, ids, mask, tc, temperature)
    loss_of(ref_lp, ref_ent, cmask).backward()
    theirs = take_grads(model)
    torch.testing.assert_close(lp[cmask], ref_lp[cmask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[cmask], ref_ent[cmask], rtol=1e-5, atol=1e-5)
    assert float(lp[~cmask].abs().sum()) == 0.0  # padding positions are 0, not garbage
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        scale = float(theirs[name].abs().max())
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-5 * max(scale, 1e-6), msg=name)
    return ours


@pytest.fixture()
def qwen(qwen_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()


def test_tied_head_matches_the_models_logits_values_and_gradients(qwen):
    head = lm_head(qwen)
    assert head.module.weight is qwen.get_input_embeddings().weight  # tied: one tensor, two uses
    assert head.packing == "multi" and head.softcap is None and head.scale == 1.0
    grads = compare_with_plain(qwen)
    assert "model.embed_tokens.weight" in grads  # the head's gradient lands on the shared embedding


def test_sft_nll_matches_cross_entropy_of_the_models_logits(qwen):
    ids, mask, _ = rollout_batch()
    targets = mask.bool().clone()
    targets[:, :4] = False  # the prompt region is not a target
    nll = sft_token_nll(qwen, ids, mask, targets)
    logits = qwen(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask)).logits
    sel = targets[:, 1:]
    ref = F.cross_entropy(logits[:, :-1][sel], ids[:, 1:][sel], reduction="sum")
    torch.testing.assert_close(nll, ref, rtol=1e-6, atol=1e-5)


def test_lora_on_the_body_uses_the_fused_head_and_its_reference_is_the_base(qwen_path, qwen):
    from rlft.config import LoraConfig
    from rlft.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(qwen, LoraConfig(enabled=True, r=4, dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # peft starts B at 0; make the adapter matter
    grads = compare_with_plain(model)
    assert grads and all("lora_" in n for n in grads)
    ids, mask, tc = rollout_batch()
    with torch.no_grad(), model.disable_adapter():
        ref, _ = completion_logprobs(model, ids, mask, tc)
        base_lp, _ = plain_completion(model.get_base_model(), ids, mask, tc, 1.0)
    with torch.no_grad():
        adapted, _ = completion_logprobs(model, ids, mask, tc)
    cmask = mask[:, -tc:].bool()
    torch.testing.assert_close(ref[cmask], base_lp[cmask], rtol=1e-5, atol=1e-5)
    assert float((adapted - ref)[cmask].abs().max()) > 1e-2  # adapters on vs off differ


def test_lora_on_lm_head_falls_back_to_the_plain_head(qwen):
    from rlft.config import LoraConfig
    from rlft.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(qwen, LoraConfig(enabled=True, r=4, dropout=0.0, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    grads = compare_with_plain(model, expect_fused=False)
    assert any("lm_head.lora_" in n for n in grads)  # the head's adapter is trained through this path


def test_gemma2_final_logit_softcapping_is_applied():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    # cap 0.5 on random logits of size ~1: tanh bends them a lot, so a missing cap would show
    cfg = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                       attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).train()
    assert lm_head(model).softcap == 0.5 and lm_head(model).fused
    compare_with_plain(model)


def test_an_unknown_logit_scaling_is_detected_and_served_by_the_full_forward(qwen):
    original = qwen.forward

    def scaled(*args, **kwargs):  # a model that post-processes its logits in a way rlft does not know
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    qwen.forward = scaled
    assert lm_head(qwen) is None
    compare_with_plain(qwen, expect_fused=False)  # still exact: the model's own logits are used


def test_big_vocabulary_peak_memory_is_a_fraction_of_the_full_logits_path(qwen_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlft.monitor.memory import LiveTensorTracker

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).train()
    rows, prompt, tc = 4, 16, 48
    ids = torch.randint(0, cfg.vocab_size, (rows, prompt + tc))
    mask = torch.ones_like(ids)
    cmask = mask[:, -tc:].bool()

    def old_path():  # what forward.py did before: [B, Tc + 1, V] logits, log-softmax kept for backward
        logits = forward_logits(model, ids, mask, keep=tc + 1)[:, :-1]
        logp = F.log_softmax(logits.float(), -1)
        return logp.gather(-1, ids[:, -tc:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def new_path():
        return completion_logprobs(model, ids, mask, tc, entropy="grad")

    peaks, grads = {}, {}
    lm_head(model)  # the one-time probe runs outside the measurement
    for name, path in (("old", old_path), ("new", new_path)):
        with LiveTensorTracker() as tracker:
            lp, ent = path()
            loss_of(lp, ent, cmask).backward()
        peaks[name] = tracker.peak_bytes
        grads[name] = take_grads(model)
        del lp, ent
    weights = sum(p.numel() * 4 for p in model.parameters())  # 39 MB, the embedding almost all of it
    logits_bytes = rows * tc * cfg.vocab_size * 4  # one [4, 48, V] float32 tensor: 117 MB
    print(f"peak live tensor bytes: old {peaks['old'] / 2**20:.0f} MiB, new {peaks['new'] / 2**20:.0f} MiB "
          f"(weights {weights / 2**20:.0f} MiB, one logits tensor {logits_bytes / 2**20:.0f} MiB)")
    assert peaks["old"] > weights + 3 * logits_bytes  # the old path holds several [B, T, V] tensors
    assert peaks["new"] < 0.35 * peaks["old"]
    assert peaks["new"] < 2 * weights + logits_bytes  # weights + their gradient + a few chunks
    for name in grads["old"]:  # and it is the same gradient
        scale = float(grads["old"][name].abs().max())
        torch.testing.assert_close(grads["new"][name], grads["old"][name], rtol=1e-4, atol=1e-5 * scale, msg=name)
