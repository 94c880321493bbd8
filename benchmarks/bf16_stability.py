"""Is bf16-mixed SFT of a tiny random-init model less stable than fp32 (issue 22)?

Trains the tiny Qwen2 model (`rlft.models.tiny`, ~1M parameters, random weights) on chat rows
"What is a + b?" -> "The answer is N." with rlft's own pieces -- `load_policy`, `sft_token_nll`
(packed rows, chunked head), `Precision.autocast`, AdamW + cosine schedule + clipping from
`training/optim.py` -- the way the offline loop does, for several seeds in each precision, and
prints held-out exact-match accuracy and eval loss per seed, with means and spreads.

Accuracy is teacher-forced exact match: every completion token (and the end of turn) is the
argmax at its position -- what greedy decoding would produce, without generating.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bf16_stability.py --seeds 0 1 2 3 4 5
    ... --precisions bf16-mixed --ablate head-fp32          # one cause at a time (see ABLATIONS)
    ... --grad-cosine                                         # one step's gradients, bf16 vs fp32

The seed sets the data order (and, with --vary-init, the initial weights).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from rlft.config import LoraConfig, ModelConfig, TrainingConfig
from rlft.data.sft_examples import collate_sft, make_sft_encoder
from rlft.data.readers import Row
from rlft.models import head_logprobs
from rlft.models.forward import sft_token_nll
from rlft.models.loading import load_policy
from rlft.models.precision import Precision
from rlft.models.template import end_of_turn_ids
from rlft.models.tiny import build_tiny_model
from rlft.training.optim import build_optimizer, build_scheduler, clip_gradients

MODELS = Path("/tmp/rlft_bf16_stability")


def arithmetic_rows(n: int, seed: int, top: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """Chat rows 'What is a + b?' -> 'The answer is N.' (a, b <= top), distinct problems."""
    rng = random.Random(seed)
    seen, rows = set(exclude), []
    while len(rows) < n:
        a, b = rng.randint(0, top), rng.randint(0, top)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"The answer is {a + b}."}]})
    return rows


def model_path(init_seed: int) -> Path:
    out = MODELS / f"tiny-{init_seed}"
    if not (out / "config.json").exists():
        build_tiny_model(out, seed=init_seed, overwrite=True)
    return out


# ---------------------------------------------------------------------------------------------
# Ablations: each moves one part of the bf16-mixed computation back to float32


@contextmanager
def head_fp32():
    """The chunked LM head's matmuls (logits and their backward) in float32 under autocast."""
    old = head_logprobs.compute_dtype
    head_logprobs.compute_dtype = lambda hidden, weight: torch.float32
    try:
        yield
    finally:
        head_logprobs.compute_dtype = old


@contextmanager
def attn_fp32():
    """Scaled-dot-product attention (not the q/k/v/o projections) in float32 under autocast."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    old = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            out, w = old(module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs)
        return out, w

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = old


def _fp32_module_forward(modules):
    """Run these modules' forwards with autocast off (their inputs cast to float32)."""
    handles = []
    for m in modules:
        old = m.forward

        def fwd(*args, _old=old, **kwargs):
            args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            with torch.autocast("cpu", enabled=False):
                return _old(*args, **kwargs)

        m.forward = fwd
        handles.append((m, old))
    return handles


ABLATIONS = {
    "head-fp32": "LM head logits + their backward in fp32",
    "attn-fp32": "sdpa attention in fp32",
    "mlp-fp32": "MLP blocks in fp32",
    "attn-proj-fp32": "q/k/v/o projections (whole self-attention module) in fp32",
    "eval-fp32": "evaluate with autocast off (training unchanged)",
    "no-clip": "no gradient clipping",
    "perturb-init": "round the initial weights to bf16 once (a bf16-sized nudge), then train as asked",
}


@contextmanager
def ablated(names: list[str], model):
    with ExitStack() as stack:
        if "head-fp32" in names:
            stack.enter_context(head_fp32())
        if "attn-fp32" in names:
            stack.enter_context(attn_fp32())
        patched = []
        layers = model.model.layers
        if "mlp-fp32" in names:
            patched += _fp32_module_forward([layer.mlp for layer in layers])
        if "attn-proj-fp32" in names:
            patched += _fp32_module_forward([layer.self_attn for layer in layers])
        try:
            yield
        finally:
            for m, old in patched:
                m.forward = old


# ---------------------------------------------------------------------------------------------


def load(init_seed: int):
    policy = load_policy(ModelConfig(path=str(model_path(init_seed)), device="cpu"), LoraConfig(), torch.float32)
    tok = policy.tokenizer
    encode = make_sft_encoder(tok, end_of_turn_ids(tok), 128)
    return policy, encode


def encode_rows(encode, rows):
    return [encode(Row(f"rows#{i}", r)) for i, r in enumerate(rows)]


def task(args, encode):
    """(train, held-out) examples: disjoint problems with operands up to args.max_operand."""
    train_rows = arithmetic_rows(args.train_rows, 1000, args.max_operand)
    used = {r["messages"][0]["content"] for r in train_rows}
    heldout_rows = [r for r in arithmetic_rows(args.train_rows + args.eval_rows, 2000, args.max_operand)
                    if r["messages"][0]["content"] not in used][:args.eval_rows]
    return encode_rows(encode, train_rows), encode_rows(encode, heldout_rows)


@torch.no_grad()
def evaluate(model, examples, pad_id: int, precision: Precision) -> tuple[float, float]:
    """(exact-match accuracy, mean token NLL) on `examples`, teacher-forced."""
    model.eval()
    correct, nll, count = 0, 0.0, 0
    for i in range(0, len(examples), 64):
        batch = collate_sft(examples[i:i + 64], pad_id)
        with precision.autocast(torch.device("cpu")):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        logits = out.logits.float()[:, :-1]  # [B, T-1, V]: position t predicts token t+1
        targets = batch["input_ids"][:, 1:]
        mask = batch["target_mask"][:, 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        nll += float(-(logp * mask).sum())
        count += int(mask.sum())
        hit = (logits.argmax(-1) == targets) | ~mask
        correct += int(hit.all(-1).sum())
    model.train()
    return correct / len(examples), nll / count


def train_once(args, seed: int, precision_name: str, ablate: list[str]) -> dict:
    init_seed = seed if args.vary_init else 0
    policy, encode = load(init_seed)
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    train, heldout = task(args, encode)
    precision = Precision(precision_name, "benchmark")
    eval_precision = Precision("fp32", "eval-fp32") if "eval-fp32" in ablate else precision
    cfg = TrainingConfig(learning_rate=args.lr, max_grad_norm=None if "no-clip" in ablate else args.max_grad_norm,
                         lr_scheduler=args.scheduler, warmup_ratio=args.warmup)
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    if "perturb-init" in ablate:
        with torch.no_grad():
            for prm in params:
                prm.copy_(prm.to(torch.bfloat16).float())
    optimizer = build_optimizer(params, cfg)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch * args.epochs)
    rng = random.Random(seed)
    curve, t0 = [], time.perf_counter()
    model.train()
    with ablated(ablate, model):
        for epoch in range(args.epochs):
            order = list(range(len(train)))
            rng.shuffle(order)
            for s in range(steps_per_epoch):
                examples = [train[i] for i in order[s * args.batch_size:(s + 1) * args.batch_size]]
                norm = float(sum(sum(e.target_mask[1:]) for e in examples))
                batch = collate_sft(examples, pad_id)
                with precision.autocast(torch.device("cpu")):
                    loss = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"],
                                         packing=True) / norm
                loss.backward()
                clip_gradients(params, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if args.curve and (epoch + 1) % args.curve == 0:
                curve.append(round(evaluate(model, heldout, pad_id, eval_precision)[0], 3))
        acc, eval_loss = evaluate(model, heldout, pad_id, eval_precision)
    out = {"seed": seed, "precision": precision_name, "ablate": ablate, "accuracy": acc, "eval_loss": eval_loss,
           "train_loss": float(loss.detach()), "seconds": round(time.perf_counter() - t0, 1)}
    if curve:
        out["curve"] = curve
    return out


# ---------------------------------------------------------------------------------------------
# Gradient agreement: one step's gradients under bf16-mixed vs fp32, per parameter tensor


def grad_cosines(args, steps_before: int, ablate: list[str]) -> list[tuple[str, float, float]]:
    """Train `steps_before` fp32 steps (seed 0), then compare one batch's gradients under
    bf16-mixed (with `ablate`) and fp32: (name, cosine, relative error) per tensor, worst first."""
    policy, encode = load(0)
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    train, _ = task(args, encode)
    cfg = TrainingConfig(learning_rate=args.lr, max_grad_norm=args.max_grad_norm, lr_scheduler="constant")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)

    def grads(precision: Precision, examples) -> dict[str, torch.Tensor]:
        norm = float(sum(sum(e.target_mask[1:]) for e in examples))
        batch = collate_sft(examples, pad_id)
        with precision.autocast(torch.device("cpu")):
            loss = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"],
                                 packing=True) / norm
        loss.backward()
        out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    b = args.batch_size
    for s in range(steps_before):
        examples = [train[(s * b + i) % len(train)] for i in range(b)]
        g = grads(Precision("fp32", ""), examples)
        for n, prm in model.named_parameters():
            prm.grad = g.get(n)
        clip_gradients(params, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    examples = train[:b]
    ref = grads(Precision("fp32", ""), examples)
    with ablated(ablate, model):
        low = grads(Precision("bf16-mixed", ""), examples)
    rows = []
    for n, g in ref.items():
        h = low[n]
        cos = float(torch.nn.functional.cosine_similarity(g.flatten().double(), h.flatten().double(), dim=0))
        rel = float((h - g).norm() / g.norm().clamp_min(1e-30))
        rows.append((n, cos, rel))
    return sorted(rows, key=lambda r: r[1])


def summarise(results: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["precision"], ",".join(r["ablate"]) or "-"), []).append(r)
    print(f"\n{'precision':<11} {'ablation':<22} {'seeds':<14} {'accuracy per seed':<44} {'mean':>6} {'sd':>6} "
          f"{'min':>5} {'eval loss mean':>14}")
    for (prec, abl), rs in groups.items():
        accs = [r["accuracy"] for r in rs]
        losses = [r["eval_loss"] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"{prec:<11} {abl:<22} {','.join(str(r['seed']) for r in rs):<14} "
              f"{' '.join(f'{a:.2f}' for a in accs):<44} {statistics.mean(accs):6.3f} {sd:6.3f} {min(accs):5.2f} "
              f"{statistics.mean(losses):14.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    p.add_argument("--ablate", nargs="*", default=[], choices=sorted(ABLATIONS),
                   help="; ".join(f"{k}: {v}" for k, v in ABLATIONS.items()))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-operand", type=int, default=9, help="operands 0..N (9: 100 problems)")
    p.add_argument("--train-rows", type=int, default=70)
    p.add_argument("--eval-rows", type=int, default=30)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--warmup", type=float, default=0.0)
    p.add_argument("--vary-init", action="store_true", help="the seed also sets the initial weights")
    p.add_argument("--curve", type=int, default=0, help="also evaluate every N epochs")
    p.add_argument("--grad-cosine", type=int, nargs="*", default=None, metavar="STEPS",
                   help="instead of training: gradient agreement after these many fp32 steps")
    p.add_argument("--json", type=Path, help="append each result as a JSON line here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.grad_cosine is not None:
        for steps in args.grad_cosine or [0]:
            rows = grad_cosines(args, steps, args.ablate)
            print(f"\nafter {steps} fp32 steps, bf16-mixed{'+' + ','.join(args.ablate) if args.ablate else ''} vs fp32 "
                  f"gradients (worst 8 of {len(rows)} tensors; median cosine "
                  f"{statistics.median(r[1] for r in rows):.5f}):")
            for n, cos, rel in rows[:8]:
                print(f"  {n:<48} cos {cos:.5f}  rel err {rel:.4f}")
        return
    results = []
    for seed in args.seeds:
        for prec in args.precisions:
            r = train_once(args, seed, prec, args.ablate)
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    summarise(results)


if __name__ == "__main__":
    sys.exit(main())
