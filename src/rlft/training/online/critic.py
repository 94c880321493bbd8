"""PPO's value side: a separate critic model, or a value head on the policy's backbone.

A critic turns a scored rollout into GAE advantages (keeping its pre-update values and the
returns as regression targets), then learns from them:
- `SeparateCritic` (`critic.kind: separate`) is its own token-classification model with its own
  AdamW; `update()` runs its epochs over the batch after the policy update.
- `SharedValueHead` (`critic.kind: shared`) reads the policy's last hidden state; its value loss
  joins the policy loss through `policy_term()` (one forward, one optimizer).
Values are aligned with the completion log-probs: the value of token t is read from the state
that generated it (position P + t - 1), so GAE sees V(s_t) for every sampled token and 0 after
the last one. During `critic.warmup_steps` only the critic learns (a fresh head is noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlft.algorithms import ADVANTAGE_ESTIMATORS, aggregate, clipped_value_loss, whiten
from rlft.config import Config, CriticConfig, LoraConfig
from rlft.errors import RlftError
from rlft.models.folder_checks import check_model_folder, check_value_model_weights
from rlft.models.forward import completion_logprobs, logits_run, position_ids_for, shared_layout
from rlft.models.hub import hub_source
from rlft.models.loading import apply_lora, resolve_dtype
from rlft.models.precision import autocast_to
from rlft.monitor.stats import MetricAccumulator
from rlft.rollout.batch import RolloutBatch
from rlft.training.distributed import SINGLE, World, full_state_dict, loss_scale, reshard, shard
from rlft.training.online.update import ExtraLoss, Trainer, UpdateSettings, lockstep_chunks, minibatch_schedule
from rlft.training.optim import build_optimizer, build_scheduler, clip_gradients


class Critic(Protocol):
    targets: "_ValueTargets"  # GAE over the (global) batch's values; keeps this rank's targets

    def values(self, batch: RolloutBatch, world: World) -> Tensor:
        """Pre-update values of the batch's completion tokens  # [N, T]"""

    def trains_policy(self, step: int) -> bool:
        """False during the warm-up steps, when only the critic learns."""

    def policy_term(self) -> ExtraLoss | None:
        """A value-loss term for the policy's optimizer (shared head), or None."""

    def update(self, trainer: Trainer, batch: RolloutBatch, generator: torch.Generator,
               policy_trained: bool) -> dict[str, float]:
        """Learn from the batch's returns, where the policy update (if it ran) did not already."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export(self, out: Path) -> None: ...


class _ValueTargets:
    """What both critics share: GAE over their values, the targets, the clipped value loss."""

    def __init__(self, cfg: CriticConfig, s: UpdateSettings, gamma: float, lam: float, std_floor: float):
        self.cfg, self.settings = cfg, s
        self.gamma, self.lam, self.std_floor = gamma, lam, std_floor
        self.old_values: Tensor | None = None  # [N, T]
        self.returns: Tensor | None = None  # [N, T]

    def gae_advantages(self, values: Tensor, mask: Tensor, group_ids: Tensor, token_rewards: Tensor, valid: Tensor,
                       rows: tuple[int, int]) -> tuple[Tensor, dict[str, float]]:
        """GAE advantages `[N, T]` of the (global) batch, whitened over it if configured; keeps the
        values and returns of this rank's `rows` [first, stop) as the update's targets."""
        adv, metrics = ADVANTAGE_ESTIMATORS["gae"](token_rewards, mask, group_ids, valid,
                                                   values=values, gamma=self.gamma, lam=self.lam)
        returns = adv + values * mask
        if self.cfg.whiten_advantages:
            adv = whiten(adv, mask & valid[:, None], std_floor=self.std_floor)
        metrics["value/returns_mean"] = float(returns[mask].mean())
        first, stop = rows
        self.old_values, self.returns = values[first:stop], returns[first:stop]
        return adv, metrics

    def value_loss(self, values: Tensor, rows: Tensor, mask: Tensor, num_tokens: float) -> tuple[Tensor, dict]:
        """Token-mean clipped value loss of these rows over the minibatch's `num_tokens`."""
        t = values.shape[1]
        per_token, m = clipped_value_loss(values, self.old_values[rows, :t], self.returns[rows, :t], mask,
                                          clip=self.cfg.value_clip)
        loss = aggregate(per_token, mask, "token_mean", num_tokens=num_tokens)
        m["value/loss"] = float(loss.detach()) * num_tokens / max(float(mask.sum()), 1.0)
        return loss, m

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.loss_mask(self.settings.mask_truncated)

    def minibatches(self, batch: RolloutBatch, generator: torch.Generator, world: World):
        """(micro-batch row sets, global token count) per minibatch, epochs x minibatches like the
        policy; in lockstep over ranks (a None row set: a throwaway micro-batch, see rl_update)."""
        s, mask = self.settings, self.loss_mask(batch)
        for chunk in minibatch_schedule(batch.size, s, generator, batch.input_ids.device):
            chunk = chunk[mask[chunk].any(-1)]
            if s.shared_prefix != "off":  # a group's rows in one micro-batch: one copy of their prompt
                chunk = chunk[batch.group_ids[chunk].argsort(stable=True)]
            tokens = world.sum([float(mask[chunk].sum())])[0]
            if tokens == 0:
                continue
            sets = list(chunk.split(s.micro_batch_size or max(chunk.numel(), 1))) if chunk.numel() else []
            yield sets + [None] * (int(world.max([len(sets)])[0]) - len(sets)), tokens


class SeparateCritic:
    """`AutoModelForTokenClassification` with one label, from `critic.path` (a reward model's score
    head is reused) or the policy checkpoint (new head); its own AdamW and schedule."""

    def __init__(self, config: Config, device: torch.device, pad_token_id: int, s: UpdateSettings, total_steps: int,
                 world: World = SINGLE, compute_dtype: torch.dtype | None = None):
        from transformers import AutoConfig, AutoModelForTokenClassification

        c, m = config.critic, config.model

        given, field = (c.path, "critic.path") if c.path else (m.path, "model.path")
        check_model_folder(given, field)  # a local path that is not there: "no such folder", never a hub-id error
        path = hub_source(given, None if c.path else m.revision, field)
        try:
            model_config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=m.trust_remote_code)
            model_config.classifier_dropout = 0.0  # values must not be noisy
            model, info = AutoModelForTokenClassification.from_pretrained(
                path, config=model_config, dtype=resolve_dtype(m.dtype, device), trust_remote_code=m.trust_remote_code,
                output_loading_info=True)
        except (OSError, ValueError) as exc:  # a config or weights transformers cannot read as a value model
            raise RlftError(f"{field} {given!r}: cannot load it as the critic (a one-logit token classifier): "
                            f"{exc}\nFix: point {field} at a model folder of the policy's family") from None
        check_value_model_weights(model, info, given, field)
        model.config.pad_token_id = pad_token_id
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if c.lora:
            lora = config.lora.model_copy(update={"enabled": True}) if config.lora.enabled else LoraConfig(enabled=True)
            model = apply_lora(model, lora, task_type="TOKEN_CLS")
        self.model = shard(model.to(device), world)  # sharded like the policy in a distributed run
        self.world = world
        self.compute_dtype = compute_dtype  # autocast (bf16-mixed) or None
        self.targets = _ValueTargets(c, s, config.algorithm.gamma, config.algorithm.lam, config.algorithm.std_floor)
        self.warmup_steps = c.warmup_steps
        self.max_grad_norm = config.training.max_grad_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        training = config.training.model_copy(update={"learning_rate": c.learning_rate or config.training.learning_rate})
        self.optimizer = build_optimizer(self.params, training)
        self.scheduler = build_scheduler(self.optimizer, training, total_steps * s.epochs * s.minibatches)

    def _values(self, sub: RolloutBatch) -> Tensor:
        """The value of token t from the state that generated it  # [n, t] (0 on padding when the
        rows share prompts, else whatever the padded forward gives there: both are masked)."""
        t = sub.completion_len
        with autocast_to(sub.input_ids.device, self.compute_dtype):
            shared = shared_layout(self.model, self.model, logits_run(self.model), sub.input_ids, sub.attention_mask,
                                   sub.input_ids.shape[1] - t, self.targets.settings.shared_prefix)
            if shared is None:
                out = self.model(input_ids=sub.input_ids, attention_mask=sub.attention_mask,
                                 position_ids=position_ids_for(sub.attention_mask))
                return out.logits[:, -(t + 1):-1, 0].float()
            layout, mask = shared
            logits = self.model(input_ids=layout.input_ids, attention_mask=mask,
                                position_ids=layout.position_ids).logits  # [bins, L, 1]
        index = layout.flat_index[:, -(t + 1):-1]  # [n, t]; -1 where the state is padding
        return logits.reshape(-1)[index.clamp(min=0)].float().where(index >= 0, 0.0)

    @torch.no_grad()
    def values(self, batch: RolloutBatch, world: World) -> Tensor:
        self.model.eval()
        return _batch_values(batch, self.targets.settings.micro_batch_size, world, self._values)

    def trains_policy(self, step: int) -> bool:
        return step >= self.warmup_steps

    def policy_term(self) -> None:
        return None

    def update(self, trainer: Trainer, batch: RolloutBatch, generator: torch.Generator,
               policy_trained: bool) -> dict[str, float]:
        self.model.train()
        stats = MetricAccumulator()
        mask = self.targets.loss_mask(batch)
        for micro_sets, num_tokens in self.targets.minibatches(batch, generator, self.world):
            for rows in micro_sets:
                real = rows is not None
                rows = rows if real else torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
                sub = batch.select(rows)
                sub_mask = mask[rows, : sub.completion_len]
                loss, m = self.targets.value_loss(self._values(sub), rows, sub_mask, num_tokens)
                (loss * (loss_scale(self.world) if real else 0.0)).backward()
                if real:
                    stats.add(m, float(sub_mask.sum()))
            norm = float(clip_gradients(self.params, self.max_grad_norm))
            if torch.isfinite(torch.tensor(norm)):
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            stats.add({"critic/grad_norm": norm})
        return stats.reduce(self.world).means()

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and schedule, keyed by names (a distributed run's come whole: gathered
        from the shards, so they load on any number of ranks)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True) if self.world.active else None
        reshard(self.model)  # its optimizer holds the shards (a values() forward may have left others)
        return {"weights": get_model_state_dict(self.model, options=options),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True) if self.world.active else None
        reshard(self.model)
        set_model_state_dict(self.model, state["weights"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])

    def export(self, out: Path) -> None:
        weights = full_state_dict(self.model, self.world)  # collective: every rank calls it
        if not self.world.main:
            return
        model = self.model
        if self.world.active:  # a plain copy to save the gathered weights with
            from transformers import AutoModelForTokenClassification

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            model = AutoModelForTokenClassification.from_config(base.config)
            model.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                                   for k, v in weights.items() if "lora_" not in k}, strict=False)
        elif hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.save_pretrained(out)


class SharedValueHead:
    """A linear value head on the policy's last hidden state, trained by the policy's optimizer
    with the value loss added to the policy loss (scaled by `critic.value_coef`)."""

    needs_hidden = True

    def __init__(self, config: Config, hidden_size: int, device: torch.device, s: UpdateSettings,
                 world: World = SINGLE):
        self.head = nn.Linear(hidden_size, 1, device=device)
        nn.init.zeros_(self.head.weight)  # start from V = 0: advantages begin as plain returns
        nn.init.zeros_(self.head.bias)
        if world.active:  # its gradients are reduced over ranks with the policy's
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.head)
        self.world = world
        self.targets = _ValueTargets(config.critic, s, config.algorithm.gamma, config.algorithm.lam,
                                     config.algorithm.std_floor)
        self.coef, self.warmup_steps = config.critic.value_coef, config.critic.warmup_steps
        self._policy_model: Any = None

    def attach(self, policy_model: Any) -> "SharedValueHead":
        self._policy_model = policy_model
        return self

    def _hidden(self, sub: RolloutBatch) -> Tensor:
        s = self.targets.settings
        _, _, hidden = completion_logprobs(self._policy_model, sub.input_ids, sub.attention_mask, sub.completion_len,
                                           hidden=True, packing=s.packing, shared_prefix=s.shared_prefix)
        return hidden  # [n, t, H]

    def _values(self, hidden: Tensor) -> Tensor:
        # fp32 even under bf16 autocast (which would make the head's output bf16): one dot product per
        # token is cheap, and values feed fp32 GAE and value targets
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.float()).squeeze(-1)  # [n, t]

    @torch.no_grad()
    def values(self, batch: RolloutBatch, world: World) -> Tensor:
        model = self._policy_model
        was_training = model.training
        model.eval()
        out = _batch_values(batch, self.targets.settings.micro_batch_size, world, lambda sub: self._values(self._hidden(sub)))
        model.train(was_training)
        return out

    def trains_policy(self, step: int) -> bool:
        return step >= self.warmup_steps

    def policy_term(self) -> ExtraLoss:
        return self

    def __call__(self, sub: RolloutBatch, rows: Tensor, hidden: Tensor | None, mask: Tensor,
                 num_tokens: float) -> tuple[Tensor, dict[str, float]]:
        """The value loss on the policy forward's hidden states, weighted for the shared optimizer."""
        loss, m = self.targets.value_loss(self._values(hidden), rows, mask, num_tokens)
        return self.coef * loss, m

    def update(self, trainer: Trainer, batch: RolloutBatch, generator: torch.Generator,
               policy_trained: bool) -> dict[str, float]:
        """Warm-up only (otherwise the head learned through policy_term): fit the head on the
        backbone's detached hidden states, stepping the shared optimizer with the head's gradient
        alone (parameters without a gradient are left untouched)."""
        if policy_trained:
            return {}
        stats = MetricAccumulator()
        mask = self.targets.loss_mask(batch)
        for micro_sets, num_tokens in self.targets.minibatches(batch, generator, self.world):
            loss_value = 0.0
            for rows in micro_sets:
                real = rows is not None
                rows = rows if real else torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
                sub = batch.select(rows)
                sub_mask = mask[rows, : sub.completion_len]
                with torch.no_grad(), trainer.autocast():
                    hidden = self._hidden(sub)
                loss, m = self.targets.value_loss(self._values(hidden), rows, sub_mask, num_tokens)
                trainer.backward(loss * (loss_scale(self.world) if real else 0.0))
                if real:
                    loss_value += float(loss.detach())
                    stats.add(m, float(sub_mask.sum()))
            trainer.optimizer_step(loss_value)
        return stats.reduce(self.world).means()

    def state_dict(self) -> dict[str, Any]:
        return {k: v.contiguous() for k, v in full_state_dict(self.head, self.world).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.world.active:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.head, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.head.load_state_dict(state)

    def export(self, out: Path) -> None:
        from safetensors.torch import save_file

        weights = self.state_dict()  # collective in a distributed run
        if self.world.main:
            out.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(out / "value_head.safetensors"))


def _batch_values(batch: RolloutBatch, micro: int | None, world: World, values_of: Any) -> Tensor:
    """`values_of(sub_batch)` over the batch in micro-batches, in lockstep over ranks  # [N, T]"""
    out = torch.zeros_like(batch.sampling_logprobs)
    for rows in lockstep_chunks(world, batch.size, micro):
        sub = batch.select(rows if rows is not None else torch.arange(1))
        values = values_of(sub)
        if rows is not None:
            out[rows.to(out.device), : sub.completion_len] = values
    return out


def build_critic(config: Config, session: Any, s: UpdateSettings, total_steps: int) -> Critic:
    policy, world = session.policy, session.world
    if config.critic.kind == "shared":
        base = policy.model.get_base_model() if policy.is_lora else policy.model
        head = SharedValueHead(config, base.config.hidden_size, policy.device, s, world).attach(policy.model)
        session.add_module("value_head", head.head)
        return head
    # its own optimizer without a loss scale: it computes in bf16 under bf16-mixed, else in fp32
    precision = getattr(session, "precision", None)
    dtype = torch.bfloat16 if precision is not None and precision.compute_dtype == torch.bfloat16 else None
    return SeparateCritic(config, policy.device, policy.tokenizer.pad_token_id, s, total_steps, world, dtype)
