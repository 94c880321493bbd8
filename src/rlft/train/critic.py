"""PPO's value model: a separate critic or a value head on the policy's backbone.

Either way `values(batch, hidden)` gives `[n, T]` values aligned with the completion log-probs:
the value of token t is read from the state that generated it (position P + t - 1), so GAE sees
V(s_t) for every sampled token and 0 after the last one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlft.config import Config, LoraConfig
from rlft.models.loading import apply_lora, resolve_dtype
from rlft.rollout.batch import RolloutBatch
from rlft.train.logprobs import position_ids_for
from rlft.train.optim import build_optimizer, build_scheduler, clip_gradients


class SeparateCritic:
    """`AutoModelForTokenClassification` with one label, from `critic.path` (a reward model's score
    head is reused) or the policy checkpoint (new head); its own AdamW and schedule."""

    needs_policy_hidden = False
    shares_policy_optimizer = False

    def __init__(self, config: Config, device: torch.device, pad_token_id: int, total_updates: int):
        from transformers import AutoConfig, AutoModelForTokenClassification

        c = config.critic
        path = c.path or config.model.path
        model_config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=config.model.trust_remote_code)
        model_config.classifier_dropout = 0.0  # values must not be noisy
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=model_config, dtype=resolve_dtype(config.model.dtype, device),
            trust_remote_code=config.model.trust_remote_code)
        model.config.pad_token_id = pad_token_id
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if c.lora:
            lora = config.lora.model_copy(update={"enabled": True}) if config.lora.enabled else LoraConfig(enabled=True)
            model = apply_lora(model, lora, task_type="TOKEN_CLS")
        self.model = model.to(device)
        self.max_grad_norm = config.training.max_grad_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        training = config.training.model_copy(update={"learning_rate": c.learning_rate or config.training.learning_rate})
        self.optimizer = build_optimizer(self.params, training)
        self.scheduler = build_scheduler(self.optimizer, training, total_updates)

    def values(self, sub: RolloutBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        t = sub.completion_len
        out = self.model(input_ids=sub.input_ids, attention_mask=sub.attention_mask,
                         position_ids=position_ids_for(sub.attention_mask))
        return out.logits[:, -(t + 1):-1, 0].float()  # [n, t]

    def step(self) -> dict[str, float]:
        norm = float(clip_gradients(self.params, self.max_grad_norm))
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic/grad_norm": norm}

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def state_dict(self) -> dict[str, Any]:
        full = not hasattr(self.model, "peft_config")  # under LoRA only the trained tensors change
        weights = {k: v.detach().clone() for k, v in self.model.state_dict(keep_vars=True).items()
                   if full or v.requires_grad}
        return {"weights": weights, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["weights"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def export(self, out: Path) -> None:
        model = self.model.merge_and_unload() if hasattr(self.model, "merge_and_unload") else self.model
        model.save_pretrained(out)


class SharedValueHead(nn.Module):
    """A linear value head on the policy's last hidden state; trained by the policy's optimizer
    with the value loss added to the policy loss (scaled by `critic.value_coef`)."""

    needs_policy_hidden = True
    shares_policy_optimizer = True

    def __init__(self, hidden_size: int, device: torch.device):
        super().__init__()
        self.head = nn.Linear(hidden_size, 1, device=device)
        nn.init.zeros_(self.head.weight)  # start from V = 0: advantages begin as plain returns
        nn.init.zeros_(self.head.bias)

    def values(self, sub: RolloutBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("the shared value head needs the policy's hidden states")
        return self.head(hidden.float()).squeeze(-1)  # [n, t]

    def step(self) -> dict[str, float]:
        return {}  # stepped with the policy

    def export(self, out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, str(out / "value_head.safetensors"))


def build_critic(config: Config, session: Any, total_updates: int) -> SeparateCritic | SharedValueHead:
    policy = session.policy
    if config.critic.kind == "shared":
        base = policy.model.get_base_model() if policy.is_lora else policy.model
        head = SharedValueHead(base.config.hidden_size, policy.device)
        session.add_parameters(list(head.parameters()))
        return head
    return SeparateCritic(config, policy.device, policy.tokenizer.pad_token_id, total_updates)
