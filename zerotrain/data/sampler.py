"""The global-epoch bucket batch sampler: an epoch is one pass over the data whatever the world
size, every optimizer step draws from one bucket, and every rank yields the same number of
micro-batches, so no rank waits forever at the end of an epoch (FIELD_NOTES 6 and 7).

Per epoch, with a generator seeded from (seed, epoch):
1. shuffle each bucket's sample indices;
2. cut each bucket into groups of exactly global_batch samples; the remainder (< global_batch) of
   each bucket is dropped for this epoch and reported by plan() (a different subset each epoch,
   since the shuffle changes);
3. shuffle the order of the groups: group k is optimizer step k;
4. split each group into world_size x accumulation micro-batches of micro_batch samples; rank r
   takes the r-th run of accumulation consecutive micro-batches.

Steps 1-3 never look at the world size, so the steps per epoch, the dropped samples and the
samples of each step are the same on 1 or 64 GPUs with the same global batch; only how a step's
samples are split across ranks differs. That is also why a run can resume on a different number
of GPUs at the exact sample it stopped at.

Resume position: the training loop calls advance() after each optimizer step, and state_dict()
records the optimizer steps taken in the epoch. The position is deliberately not derived from
the batches __iter__ has yielded: a DataLoader with workers pulls batches from its batch sampler
ahead of the training step (prefetch), so "yielded" runs ahead of "trained on" and a resume from
it would skip samples. __iter__ starts from the position at the moment iteration begins; advance()
during that iteration only moves the position recorded for the next state_dict().
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpochPlan:
    """What one epoch consists of; identical on every rank and for every world size with the same
    global batch, and for every epoch (only the order changes between epochs)."""

    steps: int
    """Optimizer steps per epoch (global)."""
    samples: int
    """Samples used per epoch (global): steps * global_batch."""
    dropped: int
    """Samples left out of each epoch by the per-bucket remainders."""
    dropped_by_bucket: dict[int, int]
    """Bucket id -> samples it drops per epoch; buckets that drop none are not listed."""


class BucketBatchSampler:
    """Yields this rank's micro-batches (lists of sample indices) for the current epoch; pass it to
    torch.utils.data.DataLoader(batch_sampler=...).

    Usage in the training loop:
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)          # keeps the resume position when the epoch is unchanged
            for i, batch in enumerate(loader):
                ...forward/backward...
                if (i + 1) % accumulation == 0:
                    engine.step(); sampler.advance()
    """

    def __init__(
        self, buckets: list[int] | np.ndarray, global_batch: int, micro_batch: int, world_size: int, rank: int,
        seed: int, texts: list[tuple[int, float]] | None = None,
        choices: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """buckets[i] is the bucket id of sample i; with dataset repeats, a repeated image appears
        once per repeat and each appearance is its own sample. texts[i]: how many texts sample i
        may train with and its caption dropout (or choices: the two as arrays); where any sample has a
        choice, the micro-batches hold (sample, text) pairs (text_choices)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if micro_batch < 1 or global_batch < 1 or global_batch % (micro_batch * world_size):
            raise ValueError(
                f"global batch {global_batch} is not micro-batch {micro_batch} x accumulation x world size "
                f"{world_size} for any whole accumulation; make it a multiple of {micro_batch * world_size}"
            )
        ids = np.asarray(buckets)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("buckets must be a non-empty list of integer bucket ids, one per sample")
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulation = global_batch // (micro_batch * world_size)
        self.seed = seed
        # A fingerprint of the sample -> bucket map, so that resuming onto a changed dataset fails
        # loudly instead of replaying a different order.
        self._digest = hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest()[:16]
        self.num_samples = int(ids.size)
        order = np.argsort(ids, kind="stable")
        bucket_ids, starts = np.unique(ids[order], return_index=True)
        self._members = dict(zip(bucket_ids.tolist(), np.split(order, starts[1:])))
        remainders = {b: len(m) % global_batch for b, m in self._members.items()}
        steps = sum(len(m) // global_batch for m in self._members.values())
        if steps == 0:
            raise ValueError(
                f"no bucket holds a whole global batch of {global_batch} samples "
                f"(largest holds {max(len(m) for m in self._members.values())}); lower the global batch, "
                "add repeats or data, or use fewer buckets"
            )
        self._plan = EpochPlan(
            steps=steps, samples=steps * global_batch, dropped=sum(remainders.values()),
            dropped_by_bucket={b: r for b, r in remainders.items() if r},
        )
        self._epoch = 0
        self._step = 0
        self._groups: np.ndarray | None = None
        if texts:
            choices = (np.asarray([c for c, _ in texts]), np.asarray([d for _, d in texts], dtype=np.float64))
        if choices is not None and len(choices[0]) != ids.size:
            raise ValueError(f"{len(choices[0])} text choices for {ids.size} samples")
        choosing = choices is not None and bool(((choices[0] > 1) | (choices[1] > 0)).any())
        self._texts = (np.asarray(choices[0], dtype=np.int64), np.asarray(choices[1], dtype=np.float64)) \
            if choosing else None
        self._choices: np.ndarray | None = None

    def plan(self) -> EpochPlan:
        return self._plan

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A new epoch starts at step 0; setting the current epoch
        again keeps the position, so a loop may call this right after load_state_dict()."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._step, self._groups, self._choices = epoch, 0, None, None

    def advance(self, steps: int = 1) -> None:
        """Record that the training loop finished this many more optimizer steps of the epoch."""
        if steps < 0 or self._step + steps > self._plan.steps:
            raise ValueError(
                f"cannot advance {steps} steps from step {self._step} of an epoch of {self._plan.steps}"
            )
        self._step += steps

    def _epoch_groups(self) -> np.ndarray:
        """(steps, global_batch) sample indices of the current epoch, step by step."""
        if self._groups is None:
            # SeedSequence and the legacy RandomState stream are both frozen across NumPy
            # versions, so a resume after an upgrade still replays the same order.
            entropy = np.random.SeedSequence([self.seed % 2**64, self._epoch]).generate_state(4)
            rng = np.random.RandomState(entropy)
            groups = []
            for members in self._members.values():
                shuffled = rng.permutation(members)
                full = len(shuffled) // self.global_batch * self.global_batch
                groups.append(shuffled[:full].reshape(-1, self.global_batch))
            stacked = np.concatenate(groups)
            self._groups = stacked[rng.permutation(len(stacked))]
        return self._groups

    def text_choices(self) -> np.ndarray | None:
        """Per sample of the current epoch, the text it trains with: an index into its texts, or
        -1 for the empty caption (with probability its caption dropout, else one of its texts
        uniformly). Drawn from (seed, epoch) alone, so the same on any world size and on resume;
        None where no sample has a choice."""
        if self._texts is None:
            return None
        if self._choices is None:
            entropy = np.random.SeedSequence([self.seed % 2**64, self._epoch, 1]).generate_state(4)
            draws = np.random.RandomState(entropy).random_sample((2, self.num_samples))
            counts, dropout = self._texts
            picks = np.minimum((draws[1] * counts).astype(np.int64), counts - 1)
            self._choices = np.where(draws[0] < dropout, -1, picks)
        return self._choices

    def __iter__(self) -> Iterator[list]:
        """This rank's micro-batches from the current position to the end of the epoch: lists of
        sample indices, or of (sample, text choice) pairs where samples choose their text. The
        position is read here, when iteration starts, not at the first next()."""
        per_rank = self.micro_batch * self.accumulation
        mine = self._epoch_groups()[self._step:, self.rank * per_rank:(self.rank + 1) * per_rank]
        choices = self.text_choices()
        if choices is None:
            return (micro_batch.tolist() for micro_batch in mine.reshape(-1, self.micro_batch))
        return ([(i, int(choices[i])) for i in micro_batch.tolist()]
                for micro_batch in mine.reshape(-1, self.micro_batch))

    def __len__(self) -> int:
        """Micro-batches this rank yields in a whole epoch (the same on every rank); an iteration
        resumed at step k yields (steps - k) * accumulation of them."""
        return self._plan.steps * self.accumulation

    def state_dict(self) -> dict:
        """The position to resume from: {"epoch", "step" (optimizer steps done in the epoch),
        "seed"}, plus what must match for the order to be the same (the global batch and the
        dataset's sample -> bucket map). The world size is not part of it."""
        return {
            "epoch": self._epoch, "step": self._step, "seed": self.seed, "global_batch": self.global_batch,
            "num_samples": self.num_samples, "buckets_digest": self._digest,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where state_dict() was taken: the next iteration yields the remaining
        micro-batches of that epoch, on any world size with the same global batch."""
        expected = {"seed": self.seed, "global_batch": self.global_batch, "num_samples": self.num_samples,
                    "buckets_digest": self._digest}
        changed = [f"{key} {state.get(key)!r} -> {value!r}" for key, value in expected.items()
                   if state.get(key) != value]
        if changed:
            raise ValueError(
                "cannot resume the sampling order exactly, the run changed since the checkpoint: "
                + ", ".join(changed)
            )
        self._epoch, self._step, self._groups, self._choices = 0, 0, None, None
        self.set_epoch(int(state["epoch"]))
        self.advance(int(state["step"]))
