"""The chunked LM-head log-prob / entropy function against the plain computation: a hand-computed
case, oracles in float32 (values and gradients to 1e-5) and under bf16 autocast, gradcheck in
float64 through every option (bias, temperature, scale, soft-capping, entropy bonus)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlft.models.head_logprobs import token_logprobs_and_entropy


def plain(hidden, weight, targets, bias=None, temperature=1.0, softcap=None, scale=1.0):
    """The [M, V] computation the chunked function replaces."""
    z = F.linear(hidden, weight, bias).float() * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = F.log_softmax(z / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_hand_computed_case():
    # h = ln 2, weight rows (1, 0, -1): logits (ln 2, 0, -ln 2) -> softmax of (2, 1, 1/2) / 3.5
    # = (4/7, 2/7, 1/7); logp(token 0) = ln(4/7) = -0.5596; entropy = -sum p ln p = 0.7963.
    hidden = torch.tensor([[math.log(2.0)]])
    weight = torch.tensor([[1.0], [0.0], [-1.0]])
    lp, ent = token_logprobs_and_entropy(hidden, weight, torch.tensor([0]), entropy="metric")
    p = [4 / 7, 2 / 7, 1 / 7]
    assert float(lp) == pytest.approx(math.log(4 / 7), abs=1e-6)
    assert float(ent) == pytest.approx(-sum(x * math.log(x) for x in p), abs=1e-6)
    # temperature 2 halves the logits: softmax of (sqrt2, 1, 1/sqrt2) -> logp(token 2) = -ln 2 / 2 - lse
    lp2, _ = token_logprobs_and_entropy(hidden, weight, torch.tensor([2]), temperature=2.0)
    lse = math.log(math.sqrt(2) + 1 + 1 / math.sqrt(2))
    assert float(lp2) == pytest.approx(-math.log(2) / 2 - lse, abs=1e-6)


@pytest.mark.parametrize("options", [
    {},
    {"temperature": 0.7},
    {"bias": True, "temperature": 1.3},
    {"softcap": 2.0, "scale": 1.5},
])
def test_float32_values_and_gradients_match_the_plain_computation(options):
    torch.manual_seed(0)
    n, t, h, v = 3, 7, 16, 211
    hidden = torch.randn(n, t, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.5).requires_grad_()
    bias = torch.randn(v, requires_grad=True) if options.get("bias") else None
    targets = torch.randint(0, v, (n, t))
    kw = {k: options[k] for k in ("temperature", "softcap", "scale") if k in options}
    a, b = torch.randn(n, t), torch.randn(n, t)  # a loss that weighs every log-prob and entropy

    # blocks of 4 tokens x 50 vocabulary ids: 6 token chunks, 5 slices (the last one of 11 ids)
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, bias=bias, entropy="grad", chunk=4, vocab_block=50,
                                         **kw)
    ((a * lp).sum() + (b * ent).sum()).backward()
    ours = [x.grad.clone() for x in (hidden, weight, bias) if x is not None]
    for x in (hidden, weight, bias):
        if x is not None:
            x.grad = None
    ref_lp, ref_ent = plain(hidden, weight, targets, bias, **kw)
    ((a * ref_lp).sum() + (b * ref_ent).sum()).backward()
    theirs = [x.grad for x in (hidden, weight, bias) if x is not None]

    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (n, t)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_gradcheck_float64_through_every_option():
    torch.manual_seed(1)
    hidden = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(23, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(23, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 23, (9,))

    def f(h, w, b):
        return token_logprobs_and_entropy(h, w, targets, bias=b, temperature=0.8, softcap=3.0, scale=0.5,
                                          entropy="grad", chunk=4, vocab_block=7)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_entropy_modes_and_frozen_weight():
    torch.manual_seed(2)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(31, 8)  # frozen head (a reference model): no weight gradient is computed
    targets = torch.randint(0, 31, (6,))
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets)
    assert ent is None
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, entropy="metric")
    assert not ent.requires_grad and lp.requires_grad
    lp.sum().backward()
    h2 = hidden.detach().clone().requires_grad_()
    ref_lp, _ = plain(h2, weight, targets)
    ref_lp.sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-6)
    assert weight.grad is None


def test_block_shape_does_not_change_the_result():
    torch.manual_seed(3)
    # logits spread over ~+-40, so the online log-sum-exp must rescale its running sums often
    hidden, weight = torch.randn(17, 8) * 4, torch.randn(40, 8) * 4
    targets = torch.randint(0, 40, (17,))
    ref, e_ref = plain(hidden, weight, targets)
    for chunk, vocab_block in ((1, 1), (3, 7), (1000, 13), (1000, 1000)):
        lp, ent = token_logprobs_and_entropy(hidden, weight, targets, entropy="metric", chunk=chunk,
                                             vocab_block=vocab_block)
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, e_ref, rtol=1e-5, atol=1e-5)
        alone, _ = token_logprobs_and_entropy(hidden, weight, targets, chunk=chunk, vocab_block=vocab_block)
        torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)  # the log-sum-exp-only path


def test_bf16_autocast_matches_the_plain_computation_under_the_same_autocast():
    # Under autocast both paths run the head matmul in bf16 (8 mantissa bits) and the softmax in
    # float32. They differ only in how the chunked matmuls round and in the float32 accumulation
    # of the weight gradient over chunks, so they agree to bf16 rounding: measured max |diff| is
    # ~2e-3 on log-probs of magnitude ~5, and ~1% of the largest gradient entry.
    torch.manual_seed(4)
    n, h, v = 40, 32, 300
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).requires_grad_()
    targets = torch.randint(0, v, (n,))
    a, b = torch.randn(n), torch.randn(n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = token_logprobs_and_entropy(hidden, weight, targets, entropy="grad", chunk=16, vocab_block=64)
        ((a * lp).sum() + (b * ent).sum()).backward()
        ours = (hidden.grad.clone(), weight.grad.clone())
        hidden.grad = weight.grad = None
        ref_lp, ref_ent = plain(hidden, weight, targets)
        ((a * ref_lp).sum() + (b * ref_ent).sum()).backward()
    assert lp.dtype == torch.float32
    assert weight.grad.dtype == ours[1].dtype == torch.float32  # fp32 master weights get fp32 gradients
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-2)
    for mine, ref in zip(ours, (hidden.grad, weight.grad)):
        torch.testing.assert_close(mine, ref, rtol=0, atol=2e-2 * float(ref.abs().max()))
    print("bf16 max |diff|: logprobs", float((lp - ref_lp).abs().max()), "entropy", float((ent - ref_ent).abs().max()),
          "grad hidden rel", float((ours[0] - hidden.grad).abs().max() / hidden.grad.abs().max()),
          "grad weight rel", float((ours[1] - weight.grad).abs().max() / weight.grad.abs().max()))
