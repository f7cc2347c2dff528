"""From a folder of images to batches: discover, enforce the data policy, plan buckets and
crops, build or top up the cache (distributed across ranks), and read it back through the
global-epoch sampler. `zerotrain cache` and the training run both go through prepare()."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zerotrain.config.sections import RunConfig
from zerotrain.data.buckets import format_histogram, histogram
from zerotrain.data.cache import (
    BuildReport,
    CachedDataset,
    Planned,
    build,
    encode_dtype,
    model_folder,
    plan_items,
    write_index,
)
from zerotrain.data.dataset import Discovery, Verdict, discover, enforce, epoch_samples
from zerotrain.data.sampler import BucketBatchSampler, EpochPlan
from zerotrain.distributed import Topology, barrier, gather_objects, patient_barrier
from zerotrain.errors import ZerotrainError
from zerotrain.faults import ignore_stop_signals
from zerotrain.models.catalog import check_trainable
from zerotrain.protocols import ModelSpec


@dataclass
class Prepared:
    discovery: Discovery
    planned: list[Planned]
    """Items the cache holds, in a fixed order; sample indices refer to this list."""
    samples: list[int]
    """planned index of every sample of an epoch (items repeated by their dataset's count)."""
    report: BuildReport
    rejected: list[Verdict]

    def summary(self) -> list[str]:
        lines = self.discovery.summary()
        lines += [f"rejected: {v.reason}: {v.path}" for v in self.rejected[:3]]
        if len(self.rejected) > 3:
            lines.append(f"rejected while encoding: {len(self.rejected)} in all")
        lines.append(f"cache: {self.report.latents_encoded} images and {self.report.texts_encoded} captions encoded "
                     f"on this rank, {self.report.latents_cached} images and {self.report.texts_cached} captions "
                     "already cached")
        lines += format_histogram(histogram([self.planned[i].crop.bucket for i in self.samples]), len(self.samples))
        return lines

    def epoch(self, global_batch: int) -> EpochPlan:
        """One epoch in global terms: the same for any world size with this global batch."""
        return bucket_sampler(self, global_batch, global_batch, Topology(0, 1, 0), 0).plan()


def bucket_sampler(prepared: Prepared, global_batch: int, micro_batch: int, topo: Topology,
                   seed: int) -> BucketBatchSampler:
    try:
        samples = [prepared.planned[i] for i in prepared.samples]
        return BucketBatchSampler(batch_groups(samples), global_batch, micro_batch, topo.world_size,
                                  topo.rank, seed, [(len(p.text_keys), p.item.caption_dropout) for p in samples])
    except ValueError as err:
        raise ZerotrainError(f"training.global_batch_size={global_batch}: {err}") from err


def batch_groups(samples: list[Planned]) -> list[int]:
    """The sampler's group id of each sample: its bucket id, and for edit samples also its references'
    sizes (Planned.group), so that every tensor of a batch stacks. Samples without references keep
    their bucket id, and so the sampler's fingerprint of a text-to-image run."""
    sizes = sorted({p.group[1] for p in samples if p.reference_crops})
    span = max(p.bucket_id for p in samples) + 1 if samples else 1
    return [p.bucket_id + span * (1 + sizes.index(p.group[1])) if p.reference_crops else p.bucket_id for p in samples]


def prepare(run: RunConfig, spec: ModelSpec, topo: Topology, device: str | torch.device = "cpu",
            source: Path | None = None) -> Prepared:
    """Everything up to a cache that holds every usable sample, encoded with the VAE and text encoders in
    `source` (the model's local folder, data.cache.model_folder's; fetched here for the encoders alone
    when not given). Every rank calls it."""
    check_trainable(spec)  # on every rank, before anything is fetched
    discovery = discover(run.data)
    from zerotrain.models.conditioning import encoders_identity

    if source is None:
        source = model_folder(spec, run, topo, "encode")
    identity = encoders_identity(spec, source, encode_dtype(device))
    planned, skipped = plan_items(discovery, run, spec, identity)
    discovery.verdicts += skipped
    enforce(discovery, run.data)
    report = build(planned, run, spec, source, topo.rank, topo.world_size, device)
    patient_barrier("every rank's share of the cache build")
    # One verdict an item: a control that does not decode rejects both its text and its latents (edit models
    # whose text encoder reads it), on one rank or two.
    rejected = list({v.path: v for part in gather_objects(report.rejected) for v in part}.values())
    bad = {v.path for v in rejected}
    kept = [p for p in planned if p.item.image not in bad]
    if topo.is_main:
        index = write_index(run.data.cache_dir)
        absent = [p for p in kept if p.latent_key not in index["latents"]
                  or any(key not in index["text"] for key in p.all_text_keys())]
        if absent:
            raise ZerotrainError(f"the cache at {run.data.cache_dir} lacks {len(absent)} entries after the build "
                                 f"(first: {absent[0].item.image}); run zerotrain cache again")
    barrier()
    samples = epoch_samples([p.item for p in kept], discovery.shares, run.training.seed)
    discovery.verdicts += rejected
    enforce(discovery, run.data)
    return Prepared(discovery, kept, samples, report, rejected)


def make_loader(prepared: Prepared, run: RunConfig, micro_batch: int, topo: Topology,
                pin_memory: bool = False) -> tuple[torch.utils.data.DataLoader, BucketBatchSampler]:
    """DataLoader over the cache for this rank, with the global-epoch bucket sampler."""
    dataset = CachedDataset([prepared.planned[i] for i in prepared.samples], run.data.cache_dir, run.data.flip,
                            loss_weights=any(p.item.loss_weight != 1.0 for p in prepared.planned),
                            masks=any(p.item.mask is not None for p in prepared.planned),
                            unmasked_weight=run.data.unmasked_weight)
    sampler = bucket_sampler(prepared, run.training.global_batch_size, micro_batch, topo, run.training.seed)
    workers = run.data.num_workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
        prefetch_factor=2 if workers else None, persistent_workers=bool(workers),
        worker_init_fn=ignore_stop_signals if workers else None)
    return loader, sampler
