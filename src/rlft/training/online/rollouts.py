"""Where the online loop's scored rollouts come from: sampled in turn with training
(`rollout.async_steps` k = 0), or by a sampler thread running up to k optimizer steps ahead.

Version-exact pacing. Version v is the policy after the trainer has trained on v rollout batches.
Batch b (the b-th the loop trains on, from 0) is sampled from version max(0, b - k), exactly: the
sampler waits for that version and the trainer waits for batch b. So a run's completions and
weights do not depend on which side is faster, staleness b - version is min(b, k), and no sample
is thrown away for being late (discarding late samples biases training toward short episodes,
tinker-cookbook#822). k = 0 is the synchronous loop: the loop calls the same `RolloutMaker`
itself, with the live weights.

The sampler thread owns its engine (only it calls generate and sync_weights) and samples from its
own copy of the policy, into which it loads the CPU snapshot the trainer published for the version
it needs. Pacing bounds the queue: at most k + 1 finished batches wait, and at most k + 1
snapshots are held. With rollout.sampler=process (rollout/sampler_process.py) the engine's token
generation runs in a child process that maps the copy's storages: the thread still loads the
snapshot (the push) and runs the turn driver, the rewards and this queue.

Several ranks (torchrun): each rank's sampler thread samples its share of every batch's prompts,
as the synchronous run does (`collect_rollout`), and never issues a collective: those of a batch
(the episode metrics' sums, the vote on a failure) run in the loop's thread when it takes the
batch, and publishing reads the trainer's whole weights after the session gathered them from
the shards (`sync`, the mirror sync every synchronous step runs), every rank together.

Checkpoints: in an async run the queue is the state part that holds the prompt order and the
sampling streams. Saving it first lets the sampler finish every batch that needs only versions
which exist (b <= trained + k), so the saved batches, prompt order and streams resume to the same
trajectory as a run that never stopped. The saved batches are the whole step's (every rank's
share, gathered in the loop's thread), so a run resumes on any number of ranks, as a synchronous
one does: each rank takes its share again.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlft.data.order import PromptSampler
from rlft.data.prompts import PromptExample
from rlft.errors import ConfigError, EnvironmentFailed, RewardError, RlftError, ServerError
from rlft.rewards.scores import Scores
from rlft.rewards.scoring import RewardScorer
from rlft.rollout.contract import Completion, Engine, SamplingParams
from rlft.training import checkpoint as ckpt
from rlft.training.distributed import SINGLE, World
from rlft.training.online.collect import Rollout, collect_rollout, first_failure, reduce_rollout

log = logging.getLogger(__name__)


class SamplerFailed(RlftError):
    """The sampler thread stopped on an error; the loop halts with a checkpoint and names it."""


@dataclass
class RolloutMaker:
    """One batch of scored rollouts from the prompt order, the engine and the rewards; the same
    call in both modes (the loop's own thread at k = 0, the sampler thread at k > 0)."""

    engine: Engine
    sampler: PromptSampler
    prompts: list[PromptExample]
    scorer: Any  # RewardScorer, or a SharedScorer when evaluations score beside the sampler
    params: SamplingParams
    prompts_per_step: int
    dynamic_sampling: bool = False
    max_rounds: int = 3
    world: World = SINGLE
    driver: Any = None  # a TurnDriver: multi-turn episodes

    def make(self, version: int) -> Rollout:
        rollout = collect_rollout(self.engine, self.sampler, self.prompts, self.scorer, self.params,
                                  self.prompts_per_step, self.dynamic_sampling, self.max_rounds, self.world,
                                  self.driver)
        rollout.scoring_report = self.scorer.take_report()
        for c in rollout.completions:
            c.policy_version = version
        return rollout

    def reduce(self, rollout: Rollout) -> None:
        """The batch's metrics over every rank (collectives): in the loop's thread, when it takes it."""
        reduce_rollout(rollout, self.world, episodes=self.driver is not None)

    def parts(self) -> dict[str, Any]:
        """What sampling advances: the prompt order and the engine's sampling streams (the same
        on every rank: every rank draws every prompt and counts every engine call)."""
        return {"sampler": self.sampler, "engine": self.engine}


def check_async_ranks(config: Any) -> None:
    """What rollout.async_steps > 0 cannot do on several ranks yet, with the reason (checked by the
    launcher before ranks start, and by each rank under a plain torchrun)."""
    r = config.rollout
    if r.sampler_device != "auto":
        raise ConfigError(f"rollout.sampler_device={r.sampler_device} names one device, and under torchrun every "
                          "rank would sample on it: each rank's sampler uses its own GPU; drop "
                          "rollout.sampler_device, or run in one process")


def staleness_metrics(batch: int, completions: list[Completion]) -> dict[str, float]:
    """Batches trained between sampling and this update, over the batch's completions."""
    ages = [batch - c.policy_version for c in completions if c.policy_version is not None] or [0]
    return {"rollout/staleness_mean": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages))}


class StepStart:
    """The state parts a rollout changes (data order, the engine's sampler) and the global RNGs, as
    they were when a step began: restored when the step is abandoned, so the checkpoint saved
    then equals the one the last completed step would have saved."""

    def __init__(self, parts: dict[str, Any], rng: bool = True):
        self.parts = parts
        self.states = {name: copy.deepcopy(part.state_dict()) for name, part in parts.items()}
        self.rng = ckpt.rng_state() if rng else None

    def restore(self) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(self.states[name])
        if self.rng is not None:
            ckpt.set_rng_state(self.rng)


class SyncRollouts:
    """k = 0: each batch is sampled when the loop asks for it, from the weights as they are."""

    def __init__(self, maker: RolloutMaker):
        self.maker = maker
        self.consumed = 0  # batches trained: the version the next batch samples from
        self._start: StepStart | None = None

    def parts(self) -> dict[str, Any]:
        return self.maker.parts()

    def start(self, step: int) -> None:
        """After a resume: versions continue from the step (a checkpoint of a synchronous run
        keeps no count of batches whose updates were all skipped)."""
        self.consumed = step

    def take(self) -> Rollout:
        start = time.perf_counter()
        self._start = StepStart(self.parts())
        failed: BaseException | None = None
        try:
            rollout = self.maker.make(self.consumed)
        except Exception as exc:  # noqa: BLE001  (on one rank alone it must stop every rank: the vote below)
            failed = exc
        if not self.maker.dynamic_sampling:  # (its rounds voted already, each before the next one's collectives)
            failed = first_failure(self.maker.world, failed, "sampling or scoring its share of the batch")
        if failed is not None:  # every rank stops at this step (the loop then saves, together)
            raise failed
        self.maker.reduce(rollout)
        rollout.metrics.update(staleness_metrics(self.consumed, rollout.completions))
        rollout.metrics["time/rollout_wait"] = time.perf_counter() - start
        return rollout

    def restore(self) -> None:
        """Undo the taken batch: the step that drew it is abandoned."""
        if self._start is not None:
            self._start.restore()

    def trained(self) -> None:
        """The taken batch is used up (its updates applied or skipped): the engine takes the weights."""
        self._start = None
        self.consumed += 1
        try:
            self.maker.engine.sync_weights()
        except ServerError:  # the step is done but not yet counted: the next batch's push tries again and
            pass  # stops the run there (`take`), where the loop saves the steps done

    def close(self, wait: bool = True) -> None:
        """Nothing runs beside the loop."""


class SharedScorer:
    """A RewardScorer shared by the sampler thread and the loop's evaluations: each score call and
    the report of its timeouts and errors are taken under one lock, so neither side's counts end
    up in the other's report."""

    def __init__(self, scorer: RewardScorer, lock: threading.Lock):
        self._scorer, self._lock = scorer, lock
        self._metrics: dict[str, float] = {}
        self._lines: list[str] = []

    def score(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            scores = self._scorer.score(*args, **kwargs)
            metrics, lines = self._scorer.take_report()
        for key, value in metrics.items():
            self._metrics[key] = self._metrics.get(key, 0.0) + value
        self._lines += lines
        return scores

    def take_report(self) -> tuple[dict[str, float], list[str]]:
        out = (self._metrics or {"reward/timeouts": 0.0, "reward/errors": 0.0}, self._lines)
        self._metrics, self._lines = {}, []
        return out

    def __getattr__(self, name: str) -> Any:  # components, required_fields, ...
        if name.startswith("_"):  # not yet set (a copy being built): no recursion through _scorer
            raise AttributeError(name)
        return getattr(self._scorer, name)


def sampler_copy(policy: Any, device: torch.device | None = None, holds_only: bool = False) -> Any:
    """A LoadedModel whose module is a copy of `policy`'s (unsharded) one, on `device` (None: the
    policy's): what the sampler thread samples from (hf; rollout.sampler_device) or pushes to its
    engine (vllm: `holds_only`, kept on the CPU where it only holds weights, while the engine's
    device stays the policy's), while the trainer updates the original. Its parameters keep their
    requires_grad flags: on CPU a no-grad forward took other kernels with them off (log-probs
    differed in the 7th digit), and the sampler must compute what the live module would."""
    model = copy.deepcopy(policy.model)
    if device is None:
        return dataclasses.replace(policy, model=model, mirror=None)
    model.to(device)
    return dataclasses.replace(policy, model=model, mirror=None, **({} if holds_only else {"device": device}))


def trained_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters an update changes (all of a full fine-tune, the adapter under LoRA), by name."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class AsyncRollouts:
    """k > 0: a sampler thread makes batch b from version max(0, b - k) into a queue the loop
    takes batch b from (see the module docstring)."""

    def __init__(self, maker: RolloutMaker, k: int, trainer_model: Any, sampler_model: Any,
                 sync: Callable[[], None] = lambda: None):
        """`trainer_model`: whole weights (a distributed run's mirror), brought up to the trained
        ones by `sync` (a collective there) before each publish."""
        self.maker, self.k, self._sync = maker, k, sync
        self._trained = trained_tensors(trainer_model)
        own = dict(sampler_model.named_parameters())
        self._targets = [(name, own[name]) for name, _ in self._trained]
        self._cv = threading.Condition()
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}  # version -> CPU weights
        self._ready: dict[int, Rollout] = {}  # batch index -> scored rollout, not yet taken
        self.consumed = 0  # batches trained: the newest version
        self._next = 0  # the batch the sampler makes next
        self._taken: Rollout | None = None  # the batch the loop is training on
        self._failure: tuple[int, BaseException, str] | None = None  # (batch, error, what the sampler did)
        self._stop = False
        self._thread: threading.Thread | None = None

    def parts(self) -> dict[str, Any]:
        return {"rollouts": self}  # the prompt order and streams are saved with the queue, at rest

    # -- the loop's side --------------------------------------------------------------------
    def start(self, step: int) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._run, name="rlft-sampler", daemon=True)
        self._thread.start()

    def take(self) -> Rollout:
        start = time.perf_counter()
        b = self.consumed
        failed: BaseException | None = None
        with self._cv:
            try:
                self._wait(lambda: b in self._ready or self._failure is not None and self._failure[0] <= b)
            except SamplerFailed as exc:
                failed = exc
            if failed is None and b not in self._ready:
                failed = self._failure_error()
            if failed is None:
                self._taken = self._ready.pop(b)
        failed = first_failure(self.maker.world, failed, "in its rollout sampler")
        if failed is not None:  # every rank stops at this batch (the loop then saves, together)
            raise failed
        rollout = self._taken
        self.maker.reduce(rollout)
        rollout.metrics.update(staleness_metrics(b, rollout.completions))
        rollout.metrics["time/rollout_wait"] = time.perf_counter() - start
        return rollout

    def restore(self) -> None:
        with self._cv:
            if self._taken is not None:
                self._ready[self.consumed], self._taken = self._taken, None

    def trained(self) -> None:
        with self._cv:
            self._taken = None
            self.consumed += 1
        self._publish()

    def _publish(self) -> None:
        """A CPU copy of the trainer's weights as version `consumed`; the sampler loads it when a
        batch needs it (the trainer's own tensors are never read by the sampler thread)."""
        self._sync()
        snapshot = {name: p.detach().to("cpu", copy=True) for name, p in self._trained}
        with self._cv:
            self._snapshots[self.consumed] = snapshot
            self._cv.notify_all()

    def _wait(self, ready: Any) -> None:
        """Wait on the condition in slices, so the loop's signal handlers run while it waits."""
        while not ready():
            if self._thread is not None and not self._thread.is_alive() and not ready():
                raise SamplerFailed("the sampler thread ended without a result (see the log)")
            self._cv.wait(timeout=0.5)

    def _failure_error(self) -> BaseException:
        _, exc, doing = self._failure
        if isinstance(exc, (RewardError, EnvironmentFailed)):  # the loop names these as a synchronous run does
            return exc
        return SamplerFailed(f"the rollout sampler failed while {doing}: {type(exc).__name__}: {exc}")

    def close(self, wait: bool = True) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if wait and self._thread is not None:
            self._thread.join()

    # -- checkpointed state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Drain first: every batch that needs only published versions (b <= consumed + k) is
        finished, and the sampler waits, so the prompt order and streams are read at rest. A
        sampler that failed stopped short of that: the older versions its next batches need are
        saved too (a resume has only the checkpoint's weights, the newest version).

        Every rank calls this together (the session saves in the loop's thread): the ranks'
        shares are gathered into whole batches, up to the batch the least advanced sampler (one
        that failed) reached, with that rank's prompt order and streams."""
        with self._cv:
            self._wait(lambda: self._next > self.consumed + self.k or self._failure is not None)
            batches = ([self._taken] if self._taken is not None else []) + \
                      [self._ready[b] for b in sorted(self._ready)]  # batches consumed .. next - 1
            local = {"next": self._next, "rollouts": batches,
                     "parts": {name: part.state_dict() for name, part in self.maker.parts().items()}}
            own = dict(self._snapshots)
        world = self.maker.world
        ranks = world.gather(local)
        low = min(ranks, key=lambda r: r["next"])
        needed = range(max(0, low["next"] - self.k), self.consumed)
        older = {v: w for v, w in own.items() if v in needed}
        if needed:  # a sampler failed (the same on every rank): one of them kept every version
            for part in world.gather(older):
                older.update(part)
        whole = [merge_shares(list(shares)) for shares in zip(*(r["rollouts"] for r in ranks))] \
            if world.active else batches
        return {"first": self.consumed, "next": low["next"], "rollouts": whole[: low["next"] - self.consumed],
                "snapshots": older, "parts": low["parts"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world = self.maker.world
        first, stop = world.share(self.maker.prompts_per_step)  # this rank's groups, as collect_rollout shares them
        self.consumed, self._next = state["first"], state["next"]
        self._ready = {state["first"] + i: rank_share(r, first, stop, world.main) if world.active else r
                       for i, r in enumerate(state["rollouts"])}
        self._snapshots = dict(state["snapshots"])
        for name, part in self.maker.parts().items():
            part.load_state_dict(state["parts"][name])

    # -- the sampler's side -------------------------------------------------------------------
    def _run(self) -> None:
        loaded = None
        while True:
            with self._cv:
                b = self._next
                version = max(0, b - self.k)
                waited = time.perf_counter()
                while not self._stop and version not in self._snapshots:
                    self._cv.wait()
                if self._stop:
                    return
                snapshot = self._snapshots[version]
                for old in [v for v in self._snapshots if v < version]:
                    del self._snapshots[old]
                waited = time.perf_counter() - waited
            undo = StepStart(self.maker.parts(), rng=False)  # the global RNGs are the trainer's
            doing = f"loading the weights of version {version} into its engine (the push) for batch {b + 1}"
            try:
                if loaded != version:
                    self._load(snapshot)
                    loaded = version
                doing = f"making batch {b + 1}"
                rollout = self.maker.make(version)
            except BaseException as exc:  # the loop stops with a checkpoint when it reaches batch b
                undo.restore()
                log.error("the rollout sampler failed at batch %d", b + 1, exc_info=True)
                with self._cv:
                    self._failure = (b, exc, doing)
                    self._cv.notify_all()
                return
            rollout.metrics["time/sampler_wait"] = waited
            with self._cv:
                self._ready[b] = rollout
                self._next = b + 1
                self._cv.notify_all()

    def _load(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, target in self._targets:
                target.copy_(snapshot[name])
        self.maker.engine.sync_weights()  # vLLM: pushes the copy's new weights


def merge_shares(shares: list[Rollout]) -> Rollout:
    """The ranks' shares of one batch (in rank order, the order of the step's prompts) as the
    whole batch. Timings are rank 0's (what it logs); the scorer's counts are summed."""
    report: dict[str, float] = {}
    for share in shares:
        for key, value in share.scoring_report[0].items():
            report[key] = report.get(key, 0.0) + value
    return Rollout([e for s in shares for e in s.examples], [c for s in shares for c in s.completions],
                   [g for s in shares for g in s.group_ids], Scores.concat([s.scores for s in shares]),
                   dict(shares[0].metrics), (report, [line for s in shares for line in s.scoring_report[1]]))


def rank_share(rollout: Rollout, first: int, stop: int, main: bool) -> Rollout:
    """A rank's share of a whole batch: the completions of groups [first, stop). The scorer's
    counts and warnings go to rank 0 alone (the loop sums them over ranks)."""
    pick = [i for i, g in enumerate(rollout.group_ids) if first <= g < stop]
    counts, lines = rollout.scoring_report
    report = (counts, lines) if main else ({key: 0.0 for key in counts}, [])
    return Rollout([rollout.examples[i] for i in pick], [rollout.completions[i] for i in pick],
                   [rollout.group_ids[i] for i in pick], rollout.scores.subset(pick), dict(rollout.metrics), report)
