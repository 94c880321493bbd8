"""An SFT term in online RL (`algorithm.sft_mix`): the "ptx" regulariser of InstructGPT (Ouyang et
al. 2022, eq. 2), gamma * E_{x ~ D_sft}[log pi(x)] added to the RL objective, so the policy keeps
what supervised data taught it (format, a retention set) while the rewards move it.

Each optimizer step of the policy update adds `coef` x the mean token NLL of one batch of SFT rows
to the policy loss. The rows come from their own seeded stream (epoch after epoch, like prompts),
whose position is checkpointed, so a resumed run sees the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

from rlft.config import Config
from rlft.data.order import PromptSampler
from rlft.data.readers import read_rows
from rlft.data.sft_examples import SftExample, collate_sft, make_sft_encoder
from rlft.data.tool_transcripts import tool_transcripts
from rlft.data.validate import check_rows
from rlft.models.forward import sft_token_nll
from rlft.models.template import end_of_turn_ids
from rlft.training.distributed import SINGLE, World

_STREAM_SALT = 7919  # the SFT rows' order is not the prompts' order


class SftMix:
    def __init__(self, examples: list[SftExample], coef: float, batch_size: int, seed: int, pad_id: int,
                 world: World = SINGLE, packing: bool = False):
        self.examples, self.coef, self.batch_size, self.pad_id, self.world = examples, coef, batch_size, pad_id, world
        self.packing = packing
        self.sampler = PromptSampler(len(examples), seed + _STREAM_SALT, shuffle=True)

    def __call__(self, model: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """coef x mean NLL per target token of the next batch (this rank's share of it: the ranks'
        losses add up to the batch's)."""
        rows = self.sampler.take(self.batch_size)[self.world.rank::self.world.size] or [0]
        batch = collate_sft([self.examples[i] for i in rows], self.pad_id)
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        nll = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"], self.packing)
        tokens = self.world.sum([float(batch["target_mask"][:, 1:].sum())])[0]
        mean_nll = nll / max(tokens, 1.0)
        return self.coef * mean_nll, {"sft_mix/nll": self.world.sum([float(mean_nll.detach())])[0]}

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


def build_sft_mix(config: Config, tokenizer: Any, world: World = SINGLE) -> SftMix | None:
    """The run's SFT term, its rows read and checked before training starts; None when off."""
    a, d = config.algorithm, config.data
    if not a.sft_mix:
        return None
    # with tools, the SFT rows are shown the tools and written in the call syntax the episodes use
    transcripts = None
    if config.agent is not None:
        transcripts = tool_transcripts(config.agent, tokenizer)
    encode = make_sft_encoder(tokenizer, end_of_turn_ids(tokenizer), d.max_length, d.max_prompt_length,
                              transcripts=transcripts)
    examples = check_rows(read_rows(a.sft_mix, d.split, d.max_row_bytes), encode, a.sft_mix,
                          "algorithm.sft_mix SFT", d.on_invalid)
    return SftMix(examples, a.sft_mix_coef, a.sft_mix_batch_size, config.seed, tokenizer.pad_token_id, world,
                  config.training.packing)
