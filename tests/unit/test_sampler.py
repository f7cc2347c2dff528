"""The global-epoch bucket sampler, with every rank of a world simulated in one process."""

import json
from collections import Counter

import pytest
import torch

from zerotrain.data.sampler import BucketBatchSampler

# Bucket sizes chosen so that remainders modulo 24 are all different: 0, 5, 23, 13, 7.
SIZES = {0: 96, 1: 53, 2: 23, 3: 61, 4: 7}
GLOBAL = 24
WORLDS = [(1, 3), (2, 2), (3, 1), (8, 3), (8, 1), (3, 2)]  # (world size, micro-batch); 24 = micro x accum x world


def interleaved_buckets(sizes=SIZES):
    """Sample i's bucket, with the buckets' samples interleaved rather than contiguous."""
    pending = {b: n for b, n in sizes.items()}
    out = []
    while any(pending.values()):
        for b in sizes:
            if pending[b]:
                out.append(b)
                pending[b] -= 1
    return out


BUCKETS = interleaved_buckets()


def samplers(world, micro, buckets=BUCKETS, seed=7, global_batch=GLOBAL):
    return [BucketBatchSampler(buckets, global_batch, micro, world, rank, seed) for rank in range(world)]


def run_epoch(world, micro, epoch, buckets=BUCKETS, seed=7):
    """Each rank's micro-batches for one epoch."""
    ranks = samplers(world, micro, buckets, seed)
    for s in ranks:
        s.set_epoch(epoch)
    return [list(s) for s in ranks]


def step_sets(per_rank, micro, world):
    """The samples of each optimizer step, gathered from every rank."""
    accumulation = GLOBAL // (micro * world)
    steps = len(per_rank[0]) // accumulation
    return [
        sorted(i for rank in per_rank for mb in rank[k * accumulation:(k + 1) * accumulation] for i in mb)
        for k in range(steps)
    ]


@pytest.mark.parametrize(("world", "micro"), WORLDS)
def test_epoch_covers_kept_samples_once(world, micro):
    per_rank = run_epoch(world, micro, epoch=0)
    plan = samplers(world, micro)[0].plan()
    lengths = {len(batches) for batches in per_rank}
    assert lengths == {len(samplers(world, micro)[0])}, "every rank yields the same number of micro-batches"
    assert len(per_rank[0]) == plan.steps * GLOBAL // (micro * world)
    used = [i for batches in per_rank for mb in batches for i in mb]
    assert len(used) == len(set(used)) == plan.samples == plan.steps * GLOBAL
    assert all(len(mb) == micro for batches in per_rank for mb in batches)
    assert all(len({BUCKETS[i] for i in mb}) == 1 for batches in per_rank for mb in batches)
    # Dropped samples are exactly each bucket's remainder.
    dropped = Counter(BUCKETS) - Counter(BUCKETS[i] for i in used)
    assert dict(dropped) == plan.dropped_by_bucket == {1: 5, 2: 23, 3: 13, 4: 7}
    assert plan.dropped == 48 and plan.samples + plan.dropped == len(BUCKETS)
    assert plan.steps == 4 + 2 + 0 + 2 + 0


@pytest.mark.parametrize(("world", "micro"), WORLDS)
def test_every_step_is_one_bucket(world, micro):
    per_rank = run_epoch(world, micro, epoch=3)
    for samples in step_sets(per_rank, micro, world):
        assert len(samples) == GLOBAL
        assert len({BUCKETS[i] for i in samples}) == 1


def test_plan_and_steps_identical_across_world_sizes():
    reference_plan = samplers(1, 3)[0].plan()
    for epoch in (0, 1):
        reference = step_sets(run_epoch(1, 3, epoch), 3, 1)
        for world, micro in WORLDS:
            assert samplers(world, micro)[0].plan() == reference_plan
            assert step_sets(run_epoch(world, micro, epoch), micro, world) == reference


def test_deterministic_per_seed_and_epoch():
    first = run_epoch(3, 2, epoch=1)
    assert run_epoch(3, 2, epoch=1) == first
    assert run_epoch(3, 2, epoch=2) != first
    assert run_epoch(3, 2, epoch=1, seed=8) != first
    # Negative and huge seeds work too.
    assert run_epoch(2, 2, epoch=0, seed=-1) == run_epoch(2, 2, epoch=0, seed=-1)
    assert len(run_epoch(2, 2, epoch=0, seed=2**70)[0]) == len(run_epoch(2, 2, epoch=0)[0])


def test_epochs_drop_different_samples():
    used = [{i for batches in run_epoch(1, 24, epoch) for mb in batches for i in mb} for epoch in range(4)]
    assert len(set.union(*used)) > len(used[0])


def test_set_epoch_keeps_position_only_for_the_same_epoch():
    sampler = samplers(1, 24)[0]
    sampler.set_epoch(2)
    sampler.advance(3)
    sampler.set_epoch(2)
    assert sampler.state_dict()["step"] == 3
    sampler.set_epoch(3)
    assert sampler.state_dict()["step"] == 0


@pytest.mark.parametrize(("world", "micro"), [(1, 3), (2, 2), (3, 1), (8, 3)])
@pytest.mark.parametrize("stop", [0, 1, 4, 7, 8])
def test_resume_mid_epoch(world, micro, stop):
    accumulation = GLOBAL // (micro * world)
    uninterrupted = run_epoch(world, micro, epoch=5)
    ranks = samplers(world, micro)
    for sampler in ranks:
        sampler.set_epoch(5)
        for _ in range(stop):
            sampler.advance()
    states = [json.loads(json.dumps(s.state_dict())) for s in ranks]  # as a checkpoint stores it
    assert all(s["epoch"] == 5 and s["step"] == stop and s["seed"] == 7 for s in states)
    for rank, state in enumerate(states):
        restored = BucketBatchSampler(BUCKETS, GLOBAL, micro, world, rank, seed=7)
        restored.load_state_dict(state)
        restored.set_epoch(5)  # what a training loop does right after loading
        assert list(restored) == uninterrupted[rank][stop * accumulation:]


def test_resume_on_a_different_world_size():
    """Steps are global, so 5 steps on 3 ranks then the rest on 8 ranks covers the epoch exactly."""
    before = samplers(3, 1)
    for s in before:
        s.set_epoch(1)
    first = [list(s)[:5 * 8] for s in before]
    for s in before:
        s.advance(5)
    after = samplers(8, 3)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    rest = [list(s) for s in after]
    combined = step_sets(first, 1, 3) + step_sets(rest, 3, 8)
    assert combined == step_sets(run_epoch(1, 3, epoch=1), 3, 1)


def test_iteration_is_a_snapshot_of_the_position():
    """A DataLoader prefetches: advancing during iteration must not change what it yields."""
    sampler = samplers(2, 2)[0]
    full = list(sampler)
    seen = []
    for mb in sampler:
        seen.append(mb)
        if len(seen) % 6 == 0:
            sampler.advance()
    assert seen == full
    assert sampler.state_dict()["step"] == sampler.plan().steps
    assert list(sampler) == []
    # The position is read when iteration starts, before the first batch is taken.
    sampler.set_epoch(1)
    epoch_1 = run_epoch(2, 2, epoch=1)[0]
    started = iter(sampler)
    sampler.advance(2)
    assert list(started) == epoch_1
    assert list(sampler) == epoch_1[2 * 6:]


def test_load_state_rejects_a_changed_run():
    sampler = samplers(2, 2)[0]
    sampler.advance(2)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="seed"):
        BucketBatchSampler(BUCKETS, GLOBAL, 2, 2, 0, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        BucketBatchSampler(BUCKETS, 48, 2, 2, 0, seed=7).load_state_dict(state)
    changed = list(BUCKETS)
    changed[0], changed[1] = changed[1], changed[0]
    with pytest.raises(ValueError, match="buckets_digest"):
        BucketBatchSampler(changed, GLOBAL, 2, 2, 0, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="advance"):
        sampler.advance(sampler.plan().steps)


def test_repeats_are_distinct_samples():
    """With repeats, image j appears as samples j, j + n, j + 2n; each is used once per epoch."""
    images = [0] * 31 + [1] * 18 + [2] * 5
    repeats = 4
    buckets = images * repeats  # per bucket: 124, 72 and 20 samples
    per_rank = run_epoch(2, 2, epoch=0, buckets=buckets)
    plan = BucketBatchSampler(buckets, GLOBAL, 2, 2, 0, seed=7).plan()
    used = [i for batches in per_rank for mb in batches for i in mb]
    assert len(used) == len(set(used)) == plan.samples == 120 + 72
    assert plan.dropped_by_bucket == {0: 4, 2: 20}
    per_image = Counter(i % len(images) for i in used)
    # Bucket 1 is kept whole: each of its images is used once per repeat within the epoch.
    assert all(per_image[j] == repeats for j in range(31, 49))
    assert all(per_image[j] <= repeats for j in range(31))
    assert not any(per_image[j] for j in range(49, 54))


@pytest.mark.parametrize(("global_batch", "micro", "world"), [(24, 5, 1), (24, 2, 5), (10, 4, 1), (8, 3, 8), (0, 1, 1)])
def test_rejects_a_batch_that_breaks_the_invariant(global_batch, micro, world):
    with pytest.raises(ValueError, match="global batch"):
        BucketBatchSampler(BUCKETS, global_batch, micro, world, 0, seed=0)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="rank"):
        BucketBatchSampler(BUCKETS, GLOBAL, 1, 2, 2, seed=0)
    with pytest.raises(ValueError, match="whole global batch"):
        BucketBatchSampler([0] * 23 + [1] * 23, GLOBAL, 1, 1, 0, seed=0)
    with pytest.raises(ValueError, match="integer bucket ids"):
        BucketBatchSampler([], GLOBAL, 1, 1, 0, seed=0)


def test_works_as_a_dataloader_batch_sampler():
    dataset = torch.arange(len(BUCKETS))
    sampler = samplers(2, 3)[1]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    assert len(loader) == len(sampler)
    assert [batch.tolist() for batch in loader] == list(sampler)
