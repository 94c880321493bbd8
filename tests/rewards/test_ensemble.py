"""The `reward_model_ensemble` reward on tiny random Qwen2 sequence classifiers built here: each
member's score against a direct forward on its own rendering (one member with another tokenizer
and no chat template), the combinations by hand, the notes, the length penalty in the policy's
tokens, and the errors for a bad ensemble."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.config import RewardSpec
from rlft.errors import ConfigError
from rlft.models.tiny import build_tokenizer
from rlft.rewards import RewardScorer
from rlft.rewards.ensemble import combine_scores

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Hi"]
COMPLETIONS = ["4", "Blue, or maybe green.", "Hello there!"]


def _save(path, seed: int, vocab: int, template: bool):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_tokenizer(vocab)
    if not template:
        tokenizer.chat_template = None
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Two members with the tiny tokenizer and its chat template; a third with another vocabulary
    and no template (it scores the plain text)."""
    out = []
    for seed, vocab, template in ((0, 256, True), (1, 256, True), (2, 300, False)):
        path = tmp_path_factory.mktemp(f"rm{seed}")
        out.append((str(path), *_save(path, seed, vocab, template)))
    return out


def _direct(model, tokenizer, prompt: str, completion: str) -> float:
    """A member's score by hand: its own rendering, one unpadded sequence, logit 0."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": completion}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    else:
        ids = tokenizer(prompt + completion, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits[0, 0].item()


def _scorer(paths, **args):
    return RewardScorer([RewardSpec(fn="reward_model_ensemble", name="ens", args={"paths": paths, **args})], warn=None)


def test_members_score_their_own_rendering_and_are_combined(members):
    assert len(members[0][2]) != len(members[2][2])  # the third member's vocabulary differs
    direct = [[_direct(m, t, p, c) for p, c in zip(PROMPTS, COMPLETIONS)] for _, m, t in members]  # [K][N]
    out = _scorer([p for p, *_ in members]).score(PROMPTS, COMPLETIONS, [{} for _ in PROMPTS])
    for i in range(len(PROMPTS)):
        scores = [d[i] for d in direct]
        mean = sum(scores) / 3
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3)  # ddof 0
        assert [out.info[f"ens/member_{k}"][i] for k in range(3)] == pytest.approx(scores, rel=1e-4, abs=1e-5)
        assert out.total[i] == pytest.approx(mean, rel=1e-4, abs=1e-5)
        assert out.info["ens/disagreement"][i] == pytest.approx(std, rel=1e-4, abs=1e-5)
    assert out.info["disagreement"] == out.info["ens/disagreement"]  # weight 1: the same in total units
    m = out.metrics()
    assert m["reward/disagreement"] == pytest.approx(sum(out.info["ens/disagreement"]) / 3)
    assert m["reward/ens/member_2"] == pytest.approx(sum(direct[2]) / 3, rel=1e-4)


def test_min_and_pessimistic_from_the_same_members(members):
    paths = [p for p, *_ in members[:2]]
    rows = [{} for _ in PROMPTS]
    mean = _scorer(paths).score(PROMPTS, COMPLETIONS, rows)
    low = _scorer(paths, combine="min").score(PROMPTS, COMPLETIONS, rows)
    careful = _scorer(paths, combine="pessimistic", lam=2.0).score(PROMPTS, COMPLETIONS, rows)
    for i in range(len(PROMPTS)):
        a, b = mean.info["ens/member_0"][i], mean.info["ens/member_1"][i]
        # two members: std (ddof 0) = |a - b| / 2
        assert low.total[i] == pytest.approx(min(a, b), abs=1e-6)
        assert careful.total[i] == pytest.approx((a + b) / 2 - 2.0 * abs(a - b) / 2, abs=1e-6)
        assert careful.info["ens/disagreement"][i] == pytest.approx(abs(a - b) / 2, abs=1e-6)


def test_combine_scores_by_hand():
    # scores 1, 2, 6: mean 3; std = sqrt((4 + 1 + 9) / 3) = sqrt(14/3) = 2.160247
    assert combine_scores([1.0, 2.0, 6.0], "mean") == pytest.approx((3.0, 2.160247))
    assert combine_scores([1.0, 2.0, 6.0], "min")[0] == 1.0
    assert combine_scores([1.0, 2.0, 6.0], "pessimistic", 0.5)[0] == pytest.approx(3.0 - 0.5 * 2.160247)
    assert combine_scores([4.0, 4.0], "pessimistic", 3.0) == (4.0, 0.0)  # agreement costs nothing


def test_length_penalty_counts_the_policys_tokens_once(members):
    paths = [p for p, *_ in members[:2]]
    plain = _scorer(paths).score(PROMPTS[:1], COMPLETIONS[:1], [{"completion_tokens": 6}])
    shaped = _scorer(paths, length_coef=0.5).score(PROMPTS[:1], COMPLETIONS[:1], [{"completion_tokens": 6}])
    # 0.5 * ln(1 + 6), whatever either member's tokenizer makes of "4"
    assert shaped.total[0] == pytest.approx(plain.total[0] - 0.5 * math.log(7), abs=1e-6)
    assert shaped.info["ens/disagreement"] == plain.info["ens/disagreement"]


@pytest.mark.parametrize("args, message", [
    ({"paths": ["{0}"]}, "at least two"),
    ({"paths": ["{0}", "{0}/"]}, "more than once"),
    ({"paths": ["{0}", "{1}"], "combine": "median"}, "args.combine"),
    ({"paths": ["{0}", "{1}"], "lam": 1.0}, "only applies to combine: pessimistic"),
    ({"paths": ["{0}", "{1}"], "combine": "pessimistic", "lam": -1}, "args.lam"),
])
def test_bad_ensembles_are_one_config_error(members, args, message):
    args = {**args, "paths": [p.format(members[0][0], members[1][0]) for p in args["paths"]]}
    with pytest.raises(ConfigError, match=message):
        RewardScorer([RewardSpec(fn="reward_model_ensemble", args=args)])


def test_grpo_logs_the_disagreement_every_step_under_names_the_catalogue_knows(members, tmp_path):
    """A short GRPO run scored by a two-member ensemble (weight 2): reward/disagreement is twice
    the component's own, each step; every key logged is one the metric catalogue lists, so
    monitor.reward_disagreement.metric is checked at start-up like any metric name."""
    import json

    from rlft.api import train
    from rlft.config import load_config
    from rlft.models.tiny import build_tiny_model
    from rlft.monitor.catalogue import metric_names

    model = build_tiny_model(tmp_path / "model", seed=0)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    run = tmp_path / "run"
    train({"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(model)},
           "data": {"train": str(tmp_path / "prompts.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 2, "num_threads": 1},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
           "rewards": [{"fn": "reward_model_ensemble", "name": "ens", "weight": 2.0,
                        "args": {"paths": [members[0][0], members[1][0]], "combine": "pessimistic", "lam": 0.5}}],
           "logging": {"progress": False, "sample_every": 1, "num_samples": 1}})
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["reward/ens/disagreement"] > 0  # two random models never agree exactly
        assert r["reward/disagreement"] == pytest.approx(2 * r["reward/ens/disagreement"])
    names, prefixes = metric_names(load_config(run / "config.yaml"), ["ens"])
    assert not {k for r in rows for k in r if k not in names and not k.startswith(prefixes)}
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    a, b = sample["info"]["ens/member_0"], sample["info"]["ens/member_1"]
    # the component's value: mean - 0.5 * std, std = |a - b| / 2 for two members
    assert sample["components"]["ens"] == pytest.approx((a + b) / 2 - 0.5 * abs(a - b) / 2, abs=1e-6)
