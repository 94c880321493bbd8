"""Continuous batching for the hf engine: turns join and leave one decode batch as they come.

The turn driver's `continuous` schedule (agent.schedule) hands this batch each turn as soon as its
episode can take it (its tool calls returned, its observation inserted), and takes each finished
turn as soon as it ends, while the other episodes keep decoding. An episode waiting on a slow tool
then holds up nothing but itself; with the `rounds` schedule every episode waits for the slowest
call of its round.

    batch = engine.continuous(params)         # claims one engine call, as a request's first turn does
    batch.add([TurnRequest(...), ...])       # prefilled when the next step starts
    finished, busy = batch.step(max_steps)   # decode until a turn ends (or max_steps tokens)

Same samples as `HFEngine.generate`: a turn draws from the stream a round would give it (indexed
for a first turn, named by (prompt, sample, turn) for a later one, both within the claimed call)
and token t of a turn takes its stream's t-th uniform, so a turn's tokens do not depend on when it
joined. What does depend on it is float rounding: the rows a token is computed beside change the
padding and the kernels' blocking in the last bit, so unlike `rounds` a run is not bitwise
reproducible when tool latencies vary (tests/test_continuous.py measures how close it stays).

The KV cache is LeanDecoder's (rollout/fast_decode.py): a joining row's prefill is right-aligned
with the rows in flight (`LeanDecoder.merge`), columns no row attends to are dropped then, and
each row keeps its own key mask and positions. A model LeanDecoder cannot run has no continuous
batch (`HFEngine.continuous` returns None) and the driver keeps rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from rlft.models.forward import position_ids_for
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.fast_decode import LeanDecoder, left_padded
from rlft.rollout.seeds import request_seeds


@dataclass
class TurnRequest:
    """One turn to sample: `ids` the whole context (prompt and episode so far), at most
    `max_new_tokens` new ones. Its stream: `index` (a first turn: completion index
    (first_prompt + i) * n + k of the request) or `name` (a later turn's episode name)."""

    key: Hashable  # the caller's handle, returned with the finished turn
    ids: list[int]
    max_new_tokens: int
    prompt_index: int = 0
    index: int | None = None
    name: str | None = None
    share: Hashable | None = None  # requests with the same share key have the same ids: one prefill


class ContinuousBatch:
    def __init__(self, engine: Any, params: SamplingParams, call: int, decoder: LeanDecoder):
        """`decoder`: a LeanDecoder of the engine's model as it is now (LoRA folded in); its
        buffers are made as rows join."""
        self.engine, self.params, self.call, self.decoder = engine, params, call, decoder
        self.queue: list[TurnRequest] = []
        self.rows: list[TurnRequest] = []  # the rows being decoded, in batch order
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.logits: torch.Tensor | None = None  # [B, V]: each row's next-token logits
        self.mask: torch.Tensor | None = None  # [B, L] bool: each row's valid keys
        self.next_pos: torch.Tensor | None = None  # [B, 1]
        self.uniforms: torch.Tensor | None = None  # [B, T]: each row's stream, one draw a token

    def add(self, requests: list[TurnRequest]) -> None:
        self.queue += requests

    def step(self, max_steps: int) -> tuple[list[tuple[Hashable, Completion]], bool]:
        """Decode until at least one turn has ended or `max_steps` tokens; (the ended turns, whether
        any turn is still in the batch or queued)."""
        finished: list[tuple[Hashable, Completion]] = []
        with self.engine.sampling():
            self._admit()
            for _ in range(max_steps):
                if not self.rows or finished:
                    break
                finished += self._decode_one()
        return finished, bool(self.rows or self.queue)

    # -- joining -------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill the queued turns (up to the engine's batch size) and merge them into the batch."""
        room = (self.engine.batch_size or len(self.queue) + len(self.rows)) - len(self.rows)
        if not self.queue or room <= 0:
            return
        joining, self.queue = self.queue[:room], self.queue[room:]
        engine = self.engine
        rows = [(r.key if r.share is None else ("share", r.share), r.ids) for r in joining]
        input_ids, attention = left_padded([ids for _, ids in rows], engine.pad_id, engine.device)
        width = input_ids.shape[1]
        positions = position_ids_for(attention)
        logits, cache = engine._prefill(rows, input_ids, attention, positions)
        start = 0  # the columns no row in flight attends to any more are dropped
        if self.rows:
            start = int(self.mask.any(0).nonzero()[0])
        elif self.mask is not None:
            start = self.mask.shape[1]
        kept = 0 if self.mask is None else self.mask.shape[1] - start
        remaining = [r.max_new_tokens - len(t) for r, t in zip(self.rows, self.tokens)]
        capacity = max(kept, width) + max(remaining + [r.max_new_tokens for r in joining])
        old_at, new_at = self.decoder.merge(cache, start, capacity)
        length = self.decoder.length
        mask = torch.zeros((len(self.rows) + len(rows), length), dtype=torch.bool, device=engine.device)
        if self.mask is not None:
            mask[: len(self.rows), old_at:] = self.mask[:, start:]
        mask[len(self.rows):, new_at:] = attention.bool()
        self.mask = mask
        self.next_pos = positions[:, -1:] + 1 if self.next_pos is None else \
            torch.cat([self.next_pos, positions[:, -1:] + 1])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits.to(self.logits.dtype)])
        self.rows += joining
        self.tokens += [[] for _ in joining]
        self.logprobs += [[] for _ in joining]
        if self.params.temperature > 0:
            self.uniforms = self._joined_uniforms(joining)

    def _seed(self, r: TurnRequest) -> int:
        """The seed `generate` gives the same turn: completion `index` of a request, or stream `name`."""
        e = self.engine
        if r.name is not None:
            return request_seeds(e._seed, e._stream, self.call, 1, 1, streams=[r.name])[0]
        return request_seeds(e._seed, e._stream, self.call, 1, 1, first_prompt=r.index)[0]

    def _joined_uniforms(self, joining: list[TurnRequest]) -> torch.Tensor:
        """[B, T] uniforms, padded to the longest row's: the rows in flight keep theirs."""
        new = [self.engine._uniforms([self._seed(r)], r.max_new_tokens)[0] for r in joining]
        old = [] if self.uniforms is None else list(self.uniforms[: len(self.rows) - len(joining)])
        width = max(len(u) for u in old + new)
        out = new[0].new_zeros((len(old) + len(new), width))
        for i, u in enumerate(old + new):
            out[i, : len(u)] = u
        return out

    # -- decoding ------------------------------------------------------------------------------
    def _decode_one(self) -> list[tuple[Hashable, Completion]]:
        """Sample one token for every row; finished rows leave; the rest run one decode step."""
        engine, params = self.engine, self.params
        t = torch.tensor([len(tok) for tok in self.tokens], device=engine.device)  # [B]
        u = None if self.uniforms is None else self.uniforms[torch.arange(len(self.rows)), t]
        token, logprob = engine._sample(self.logits, params, u)
        done = (token[:, None] == engine.stop_ids).any(-1)
        stopped = done.clone()
        for r, (tok, lp) in enumerate(zip(token.tolist(), logprob.tolist())):
            self.tokens[r].append(tok)
            self.logprobs[r].append(lp)
        if params.stop:
            hit = engine._hit_stop_string([tok[-16:] for tok in self.tokens], params.stop)
            done |= hit
            stopped |= hit
        lengths = torch.tensor([len(tok) for tok in self.tokens], device=engine.device)
        done |= lengths >= torch.tensor([r.max_new_tokens for r in self.rows], device=engine.device)
        finished = [(self.rows[r].key, self._completion(r, bool(stopped[r]))) for r in done.nonzero().flatten().tolist()]
        if finished:
            keep = (~done).nonzero().squeeze(-1)
            self._select(keep)
            token = token[keep]
            if not self.rows:
                return finished
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.logits = self.decoder.step(token, self.next_pos, self.mask)
        self.next_pos = self.next_pos + 1
        return finished

    def _select(self, keep: torch.Tensor) -> None:
        rows = keep.tolist()
        self.rows = [self.rows[r] for r in rows]
        self.tokens = [self.tokens[r] for r in rows]
        self.logprobs = [self.logprobs[r] for r in rows]
        self.decoder.select(keep)
        self.logits, self.mask, self.next_pos = self.logits[keep], self.mask[keep], self.next_pos[keep]
        if self.uniforms is not None:
            self.uniforms = self.uniforms[keep]

    def _completion(self, r: int, stopped: bool) -> Completion:
        request = self.rows[r]
        return self.engine._completion(request.prompt_index, request.ids, list(self.tokens[r]), list(self.logprobs[r]),
                                       stopped, self.params.stop)
