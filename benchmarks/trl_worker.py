"""TRL side of `grpo_vs_trl.py`: one GRPOTrainer run in its own process (so its peak RSS is its own).

    python benchmarks/trl_worker.py SPEC.json

SPEC holds the workload (model folder, prompts file, LoRA on/off, max new tokens, steps, learning
rate, seed, threads, `defaults`) and where to write the result. The result JSON has, per optimizer
step, the wall time from `on_step_begin` to `on_step_end` (generation + reward + reference forward +
policy forward/backward + clip + optimizer step: the same span as rlft's `time/step`), the
completion tokens and the reward mean TRL logged for that step. Each step is also appended to
SPEC's `steps_log` (JSON lines) as it ends, so a run stopped by the harness's time limit still
reports the steps it finished.

`defaults: true` leaves TRL's precision and memory settings at their defaults (GRPOConfig:
`bf16=True`, i.e. autocast mixed precision with float32 weights, and `gradient_checkpointing=True`);
otherwise both are off, for the identical-float32 comparison.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def load_prompts(path: str) -> list[dict]:
    from harness import prompt_messages, read_rows

    # Conversational prompts (one user turn, or a list of messages such as the long-prompt
    # workload's system context + question): TRL renders them with the chat template, as rlft does.
    return [{"prompt": prompt_messages(r), "answer": r["answer"]} for r in read_rows(path)]


def check_prompt_ids(tokenizer, rows: list[dict], model_dir: str) -> None:
    """TRL must see exactly the prompt tokens rlft sees (rlft renders, then encodes without specials)."""
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt

    rlft_tok = load_tokenizer(ModelConfig(path=model_dir))
    msgs = [r["prompt"] for r in rows]
    trl_ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    for m, ids in zip(msgs, trl_ids):
        if list(ids) != encode_prompt(rlft_tok, m):
            raise SystemExit(f"prompt tokens differ between TRL and rlft for {m!r}")


def step_record(step: int, seconds: float, generate_s: float, h: dict, n_completions: int) -> dict:
    mean_len = h.get("completions/mean_length")
    return {"step": step, "time": seconds, "time_generate": generate_s,
            "completion_tokens": None if mean_len is None else mean_len * n_completions,
            "reward_mean": h.get("reward"), "kl": h.get("kl"), "entropy": h.get("entropy"),
            "clipped_ratio": h.get("completions/clipped_ratio"), "trl_step_time": h.get("step_time")}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    threads = int(spec["threads"])
    torch.set_num_threads(threads)

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import trl_digit_share

    model_dir = spec["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_prompts(spec["prompts"])
    check_prompt_ids(tokenizer, rows, model_dir)

    # float32 weights in both modes: TRL's own loader defaults to float32 too (bf16=True is autocast)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Both stop on the checkpoint's EOS set: rlft stops on the template's end-of-turn token plus the
    # generation_config's eos ids (<|im_end|>, <|endoftext|>), which TRL reads from the same file.
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    g, ppstep = int(spec["group_size"]), int(spec["prompts_per_step"])
    # identical float32 work, or TRL's defaults (bf16 autocast + activation checkpointing)
    precision = {} if spec.get("defaults") else {"bf16": False, "fp16": False, "gradient_checkpointing": False}
    args = GRPOConfig(
        output_dir=spec["output_dir"],
        # One optimizer step = one generation batch of 4 prompts x 8 completions, one forward/backward.
        per_device_train_batch_size=g * ppstep,  # counts completions in TRL
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=g,
        num_iterations=1,
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]), top_p=1.0, top_k=0,
        beta=float(spec["kl_coef"]),
        epsilon=0.2,  # rlft grpo preset: clip_low = clip_high = 0.2
        loss_type="dapo",  # token mean over the global batch == rlft loss_agg=token_mean
        scale_rewards="group",  # group std == rlft advantage=group_norm
        use_bias_correction_kl=False,  # plain k3 KL term in the loss, as rlft
        mask_truncated_completions=False,
        learning_rate=float(spec["learning_rate"]),
        lr_scheduler_type="cosine", warmup_steps=0,  # rlft default: cosine to 0 over max_steps, no warmup
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=int(spec["steps"]),
        seed=int(spec["seed"]),
        use_cpu=True,
        **precision,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = None
    if spec["lora"]:
        lora = spec["lora"]
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                 target_modules="all-linear", task_type="CAUSAL_LM")

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.generate_times: list[float] = []  # time inside TRL's generation call, per step
            self.generate_s = 0.0
            self.threads: int | None = None
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.threads = torch.get_num_threads()

        def on_step_begin(self, args, state, control, **kwargs):
            self.generate_s = 0.0
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)
            self.generate_times.append(self.generate_s)

        def on_log(self, args, state, control, logs=None, **kwargs):
            # TRL logs a step's metrics right after on_step_end: append that step as it finishes
            if logs and "reward" in logs and spec.get("steps_log") and self.times:
                with open(spec["steps_log"], "a") as fh:
                    fh.write(json.dumps(step_record(len(self.times), self.times[-1], self.generate_times[-1],
                                                    logs, g * ppstep)) + "\n")

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_digit_share], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=peft_config, callbacks=[timer])
    # Breakdown only (rlft logs time/generate): time TRL's own generation call, unchanged.
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            timer.generate_s += time.perf_counter() - t0

    trainer._generate_single_turn = timed_generate
    # What TRL actually fed the model: the prompt lengths it tokenized (nothing truncates them in
    # TRL 1.16, which has no max_prompt_length; recorded so the result shows it)
    prompt_lengths: set[int] = set()
    tokenize = getattr(trainer, "_tokenize_prompts", None)
    if tokenize is not None:
        def recorded_tokenize(*a, **k):
            out = tokenize(*a, **k)
            prompt_lengths.update(len(ids) for ids in out[0])
            return out

        trainer._tokenize_prompts = recorded_tokenize
    torch.set_num_threads(threads)  # in case anything above changed it
    start = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - start

    logs = {int(h["step"]): h for h in trainer.state.log_history if "reward" in h}
    steps = [step_record(i, t, timer.generate_times[i - 1], logs.get(i, {}), g * ppstep)
             for i, t in enumerate(timer.times, start=1)]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = {"framework": "trl", "steps": steps, "train_wall_s": train_wall, "torch_threads": timer.threads,
              "trainable_params": trainable, "optim": str(args.optim),
              "eos_token_ids": list(trainer.eos_token_ids), "loss_type": args.loss_type, "beta": args.beta,
              "activation_checkpointing": bool(getattr(args, "activation_checkpointing", args.gradient_checkpointing)),
              "bf16": bool(args.bf16), "gradient_checkpointing": bool(args.gradient_checkpointing),
              "defaults": bool(spec.get("defaults")), "per_device_train_batch_size": args.per_device_train_batch_size,
              "generation_batch_size": args.generation_batch_size, "steps_per_generation": args.steps_per_generation,
              "prompt_token_lengths": sorted(prompt_lengths)}
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
