"""Measurements beside the training runs, each run in its own process by `grpo_vs_trl.py`.

    python benchmarks/probes.py gen SPEC.json      # rlft HFEngine vs plain model.generate, tokens/s
    python benchmarks/probes.py matmul SPEC.json   # matmul GFLOP/s on this CPU at the large model's shapes

gen: the same batch for both: the first `prompts_per_step` prompts x n = group_size samples,
temperature 1.0, no top-k / top-p, stop on <|im_end|>, at most `max_new_tokens`. rlft's engine
(`rlft.rollout.hf.HFEngine`, its own KV-cache loop that also records each token's log-prob and
drops finished rows) against `model.generate(do_sample=True, num_return_sequences=n)`. Tokens are
counted up to and including the stop token. One warm-up call each, then `repeats` interleaved
timed calls; the median tokens/s is reported.

matmul: `F.linear` (x @ W^T, as nn.Linear runs) and the weight-gradient product (g^T @ x) at the
shapes of the large model's linears, for the row counts of a training forward (all tokens of
the batch) and of a decode step (one token per sequence).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _prompts(path: str) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows]


def gen(spec: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt, end_of_turn_ids
    from rlft.rollout.contract import SamplingParams
    from rlft.rollout.hf import HFEngine

    torch.set_num_threads(int(spec["threads"]))
    tok = load_tokenizer(ModelConfig(path=spec["model_dir"]))
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    all_prompts = _prompts(spec["prompts"])
    prompt_lens = [len(encode_prompt(tok, [{"role": "user", "content": p}])) for p in all_prompts]
    batch = [encode_prompt(tok, [{"role": "user", "content": p}]) for p in all_prompts[: spec["prompts_per_step"]]]
    n, max_new = int(spec["group_size"]), int(spec["max_new_tokens"])
    stop_ids = end_of_turn_ids(tok)
    engine = HFEngine(model, tok, stop_ids, torch.device("cpu"), seed=0)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new)

    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    stop = torch.tensor(stop_ids)
    torch.manual_seed(0)

    def run_rlft() -> int:
        return sum(len(c.completion_ids) for c in engine.generate(batch, params))

    def run_hf() -> int:
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=max_new,
                             eos_token_id=stop_ids, pad_token_id=tok.pad_token_id)
        new = out[:, width:]
        is_stop = torch.isin(new, stop)
        lengths = torch.full((new.shape[0],), new.shape[1], dtype=torch.long)
        stopped = is_stop.any(1)
        lengths[stopped] = is_stop.int().argmax(1)[stopped] + 1
        return int(lengths.sum())

    results: dict[str, list[float]] = {"rlft_engine": [], "hf_generate": []}
    tokens: dict[str, list[int]] = {"rlft_engine": [], "hf_generate": []}
    runners = {"rlft_engine": run_rlft, "hf_generate": run_hf}
    for fn in runners.values():  # warm-up
        fn()
    for _ in range(int(spec["repeats"])):
        for name, fn in runners.items():
            start = time.perf_counter()
            k = fn()
            dt = time.perf_counter() - start
            results[name].append(k / dt)
            tokens[name].append(k)
    out = {name: {"tokens_per_s": statistics.median(v), "tokens_per_s_all": v, "tokens_per_call": tokens[name]}
           for name, v in results.items()}
    out["rlft_vs_generate"] = out["rlft_engine"]["tokens_per_s"] / out["hf_generate"]["tokens_per_s"]
    out["batch"] = {"prompts": len(batch), "n": n, "max_new_tokens": max_new, "stop_ids": stop_ids}
    out["prompt_tokens"] = {"mean": statistics.mean(prompt_lens), "min": min(prompt_lens), "max": max(prompt_lens)}
    return out


def _gflops(fn, flops: float, min_time: float = 0.5) -> float:
    for _ in range(3):
        fn()
    iters, start = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and iters >= 3:
            return flops * iters / elapsed / 1e9


def matmul(spec: dict) -> dict:
    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    d, inter, vocab = spec["hidden"], spec["intermediate"], spec["vocab"]
    rows = {"train": int(spec["train_rows"]), "decode": int(spec["decode_rows"])}
    shapes = [(d, d), (d, inter), (inter, d), (d, vocab)]  # (in, out) of the model's linears
    out: dict[str, list[dict]] = {"train": [], "decode": []}
    with torch.no_grad():
        for kind, m in rows.items():
            for k, n in shapes:
                x, w = torch.randn(m, k), torch.randn(n, k)
                rec = {"m": m, "k": k, "n": n,
                       "linear_gflops": _gflops(lambda: F.linear(x, w), 2.0 * m * k * n)}
                if kind == "train":
                    g = torch.randn(m, n)
                    rec["weight_grad_gflops"] = _gflops(lambda: g.t() @ x, 2.0 * m * k * n)
                out[kind].append(rec)
    best_train = max(max(r["linear_gflops"], r["weight_grad_gflops"]) for r in out["train"])
    return {"shapes": out, "best_gflops": best_train,
            "decode_gflops": statistics.median(r["linear_gflops"] for r in out["decode"]),
            "threads": torch.get_num_threads()}


def main() -> None:
    what, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    result = {"gen": gen, "matmul": matmul}[what](spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
