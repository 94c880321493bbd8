"""The bf16_stability.py workload with no rlft code: plain transformers + torch.autocast.

Same tiny random-init Qwen2 checkpoint (build it with `rlft tiny-model DIR` or by running
bf16_stability.py once, which writes /tmp/rlft_bf16_stability/tiny-0), same rows, learning rate,
schedule and clipping; the loss is the model's own (`labels=`: logits upcast to fp32, cross-entropy
in fp32), autocast is `torch.autocast("cpu", dtype=torch.bfloat16)` around forward, as in TRL /
the transformers Trainer with bf16=True. Answers whether the spread over seeds belongs to
bf16 autocast itself rather than to rlft.

    OMP_NUM_THREADS=1 python benchmarks/bf16_plain_autocast.py --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def rows(n: int, seed: int, top: int, exclude=frozenset()) -> list[tuple[int, int]]:
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        a, b = rng.randint(0, top), rng.randint(0, top)
        if (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out


def encode(tok, a: int, b: int) -> tuple[list[int], list[int]]:
    """(input ids, labels with -100 on the prompt)"""
    prompt = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                     add_generation_prompt=True)
    full = prompt + f"The answer is {a + b}.<|im_end|>\n"
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"][:-1]  # through <|im_end|>
    return ids, [-100] * len(p_ids) + ids[len(p_ids):]


def collate(batch, pad: int):
    width = max(len(i) for i, _ in batch)
    ids = torch.full((len(batch), width), pad)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (i, l) in enumerate(batch):
        ids[r, :len(i)], labels[r, :len(l)], mask[r, :len(i)] = torch.tensor(i), torch.tensor(l), 1
    return ids, mask, labels


def run(args, seed: int, bf16: bool) -> tuple[float, float]:
    tok = AutoTokenizer.from_pretrained(args.model)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    train_pairs = rows(args.train_rows, 1000, args.max_operand)
    train = [encode(tok, a, b) for a, b in train_pairs]
    heldout = [encode(tok, a, b) for a, b in rows(args.eval_rows, 2000, args.max_operand, exclude=set(train_pairs))]
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps = math.ceil(len(train) / args.batch_size) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    rng = random.Random(seed)
    model.train()
    for _ in range(args.epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        for s in range(0, len(order), args.batch_size):
            ids, mask, labels = collate([train[i] for i in order[s:s + args.batch_size]], tok.pad_token_id)
            with cast:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    correct, nll, count = 0, 0.0, 0
    with torch.no_grad(), cast:
        for s in range(0, len(heldout), 64):
            ids, mask, labels = collate(heldout[s:s + 64], tok.pad_token_id)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1]
            target, keep = labels[:, 1:], labels[:, 1:] != -100
            logp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0)[..., None]).squeeze(-1)
            nll, count = nll - float((logp * keep).sum()), count + int(keep.sum())
            correct += int(((logits.argmax(-1) == target) | ~keep).all(-1).sum())
    return correct / len(heldout), nll / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/rlft_bf16_stability/tiny-0")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16-autocast"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--train-rows", type=int, default=70)
    p.add_argument("--eval-rows", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    acc: dict[str, list[float]] = {k: [] for k in args.precisions}
    for seed in args.seeds:
        for prec in args.precisions:
            t0 = time.perf_counter()
            a, l = run(args, seed, prec != "fp32")
            acc[prec].append(a)
            print(f"seed {seed} {prec:<14} accuracy {a:.3f}  eval loss {l:.3f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    for prec, v in acc.items():
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(f"{prec:<14} per seed {' '.join(f'{x:.2f}' for x in v)}  mean {statistics.mean(v):.3f}  sd {sd:.3f}  "
              f"min {min(v):.2f}")


if __name__ == "__main__":
    main()
