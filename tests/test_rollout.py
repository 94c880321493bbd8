"""The HF rollout engine: stopping, grouping, seeding, and log-probs that match the trainer's."""

from __future__ import annotations

import pytest
import torch

from rlft.config import LoraConfig, ModelConfig
from rlft.models.loading import load_policy
from rlft.models.template import encode_prompt, end_of_turn_ids
from rlft.models.tiny import build_tiny_model
from rlft.rollout.contract import SamplingParams
from rlft.rollout.batch import RolloutBatch
from rlft.rollout.hf import HFEngine
from rlft.models.forward import completion_logprobs


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("rollout") / "m", seed=1)
    return load_policy(ModelConfig(path=str(path)), LoraConfig())


def _prompts(policy, texts):
    return [encode_prompt(policy.tokenizer, [{"role": "user", "content": t}]) for t in texts]


def _engine(policy, seed=0, batch_size=None):
    return HFEngine(policy.model, policy.tokenizer, end_of_turn_ids(policy.tokenizer), policy.device, seed=seed,
                    batch_size=batch_size)


def test_greedy_matches_generate(policy):
    prompts = _prompts(policy, ["What is 2 + 3?", "Say something long, please, and keep going."])
    stop = end_of_turn_ids(policy.tokenizer)
    outs = _engine(policy).generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for prompt, out in zip(prompts, outs):
        ref = policy.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=stop, pad_token_id=policy.tokenizer.pad_token_id)
        assert out.completion_ids == ref[0, len(prompt):].tolist()
        assert out.prompt_ids == prompt


def test_grouping_lengths_and_finish_reasons(policy):
    prompts = _prompts(policy, ["a", "bb bb", "c c c c c c"])
    outs = _engine(policy).generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))
    assert [o.prompt_index for o in outs] == [0] * 4 + [1] * 4 + [2] * 4
    stop = set(end_of_turn_ids(policy.tokenizer))
    for o in outs:
        assert len(o.completion_ids) == len(o.logprobs) <= 6
        if o.finish_reason == "stop":
            assert o.completion_ids[-1] in stop and not stop & set(o.completion_ids[:-1])
        else:
            assert len(o.completion_ids) == 6 and not stop & set(o.completion_ids)


def test_stops_on_end_of_turn_token(policy):
    """Force the end-of-turn token with a logit bias: every completion stops at once."""
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    bias = torch.zeros(len(policy.tokenizer))
    bias[im_end] = 100.0
    hook = policy.model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        outs = _engine(policy).generate(_prompts(policy, ["x", "y"]), SamplingParams(n=2, max_new_tokens=8))
    finally:
        hook.remove()
    assert all(o.finish_reason == "stop" and o.completion_ids == [im_end] and o.text == "" for o in outs)


def test_seeded_and_batch_size_independent_of_grouping(policy):
    prompts = _prompts(policy, ["one", "two"])
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8)
    a = _engine(policy, seed=7).generate(prompts, params)
    b = _engine(policy, seed=7).generate(prompts, params)
    c = _engine(policy, seed=8).generate(prompts, params)
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b]
    assert [o.completion_ids for o in a] != [o.completion_ids for o in c]


def test_sampling_logprobs_match_training_forward(policy):
    """Old log-probs come from the engine, so they must equal what the trainer computes for the
    same ids (no decode -> re-encode anywhere), here with temperature scaling."""
    prompts = _prompts(policy, ["What is 12 + 7?", "hi"])
    outs = _engine(policy).generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=10))
    batch = RolloutBatch.from_completions(outs, [o.prompt_index for o in outs], policy.tokenizer.pad_token_id,
                                          policy.device)
    with torch.no_grad():
        lp, _ = completion_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                    temperature=0.7)
    mask = batch.completion_mask
    torch.testing.assert_close(lp[mask], batch.sampling_logprobs[mask], atol=2e-5, rtol=1e-4)
    # the batch holds exactly the sampled ids, right after each (left-padded) prompt
    for i, o in enumerate(outs):
        assert batch.input_ids[i, -batch.completion_len:][: len(o.completion_ids)].tolist() == o.completion_ids


def test_top_k_one_is_greedy(policy):
    prompts = _prompts(policy, ["greedy?"])
    greedy = _engine(policy).generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    topk = _engine(policy, seed=3).generate(prompts, SamplingParams(n=3, temperature=1.0, top_k=1, max_new_tokens=8))
    assert all(o.completion_ids == greedy[0].completion_ids for o in topk)


def test_tiny_top_p_is_greedy(policy):
    prompts = _prompts(policy, ["nucleus"])
    greedy = _engine(policy).generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    nucleus = _engine(policy, seed=3).generate(prompts, SamplingParams(n=3, top_p=1e-6, max_new_tokens=8))
    assert all(o.completion_ids == greedy[0].completion_ids for o in nucleus)


def test_stop_string_truncates_text(policy):
    prompts = _prompts(policy, ["stop strings"])
    free = _engine(policy).generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))[0]
    assert len(free.text) >= 3, "the fixture model must produce some text"
    marker = free.text[1:3]
    out = _engine(policy).generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, stop=(marker,)))[0]
    assert out.finish_reason == "stop"
    assert marker not in out.text and free.text.startswith(out.text)
    assert len(out.completion_ids) <= len(free.completion_ids)


def test_select_trims_padding_without_changing_logprobs(policy):
    prompts = _prompts(policy, ["short", "a much longer prompt with many more tokens in it"])
    outs = _engine(policy).generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10))
    batch = RolloutBatch.from_completions(outs, [o.prompt_index for o in outs], policy.tokenizer.pad_token_id,
                                          policy.device)
    sub = batch.select(torch.tensor([0, 1]))  # the short prompt's group only
    assert sub.input_ids.shape[1] < batch.input_ids.shape[1]
    with torch.no_grad():
        full, _ = completion_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.completion_len)
        part, _ = completion_logprobs(policy.model, sub.input_ids, sub.attention_mask, sub.completion_len)
    m = sub.completion_mask
    torch.testing.assert_close(part[m], full[:2, : sub.completion_len][m], atol=2e-5, rtol=1e-4)


def test_a_completion_is_the_same_in_any_batch_and_on_any_rank(policy):
    """Each completion samples from its own stream (run seed, call, global index): p1's samples are
    the same generated beside p0, alone as the second prompt of a step (a rank's share), or in
    micro-batches of 3 -- the property that makes N ranks sample what one process does."""
    prompts = _prompts(policy, ["What is 2 + 3?", "Count to five, slowly."])
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10)
    together = _engine(policy, seed=3).generate(prompts, params)
    alone = _engine(policy, seed=3).generate(prompts[1:], params, first_prompt=1)
    chunked = _engine(policy, seed=3, batch_size=3).generate(prompts, params)
    assert [c.completion_ids for c in together[4:]] == [c.completion_ids for c in alone]
    assert [c.completion_ids for c in together] == [c.completion_ids for c in chunked]
    assert len({tuple(c.completion_ids) for c in together}) > 4  # and the samples do differ
    other_seed = _engine(policy, seed=4).generate(prompts, params)
    assert [c.completion_ids for c in other_seed] != [c.completion_ids for c in together]


@pytest.mark.parametrize("fast_decode", [True, False])
def test_one_prefill_per_prompt_samples_what_a_prefill_per_row_does(policy, fast_decode):
    """The n samples of a prompt share its prefill (one row per distinct prompt through the model,
    its KV cache copied to the n rows): the same completions as one prefill per row, log-probs
    equal to fp32 rounding, through the lean decoder and the model's own; also when a batch
    (batch_size 3) splits a prompt's samples."""
    prompts = _prompts(policy, ["What is 2 + 3?", "Count to five, slowly.", "x"])  # 3 prompt lengths
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10)
    prefill_rows = []
    hook = policy.model.register_forward_pre_hook(
        lambda mod, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        out = {}
        for share in (False, True):
            for batch_size in (None, 3):
                engine = HFEngine(policy.model, policy.tokenizer, end_of_turn_ids(policy.tokenizer), policy.device,
                                  seed=5, batch_size=batch_size, fast_decode=fast_decode, share_prefill=share)
                out[share, batch_size] = engine.generate(prompts, params)
    finally:
        hook.remove()
    # per row: 12 rows, then 3 + 3 + 3 + 3; shared: 3 prompts, then batches of rows {0,0,0}, {0,1,1}, ...
    assert prefill_rows == [12, 3, 3, 3, 3, 3, 1, 2, 2, 1]
    for batch_size in (None, 3):
        plain, shared = out[False, batch_size], out[True, batch_size]
        assert [c.completion_ids for c in shared] == [c.completion_ids for c in plain]
        for a, b in zip(plain, shared):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-5, atol=1e-5)
    assert len({tuple(c.completion_ids) for c in out[True, None]}) > 6  # and the samples do differ
