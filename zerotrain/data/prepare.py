"""From datasets to batches: discover, enforce the data policy, plan buckets and crops, keep it all in the dataset
index (data.index), build or top up the cache (distributed across ranks), and read it back through the
global-epoch sampler. `zerotrain cache` and the training run both go through prepare().

Rank 0 brings the index up to date (each dataset reused where nothing it depends on changed, else discovered and
planned again) while the others wait; every rank then maps the index, encodes its share of what the cache lacks,
and trains from the index's arrays: no start probes an image that the index already knows."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from zerotrain import families
from zerotrain.config.sections import RunConfig
from zerotrain.data import index as data_index
from zerotrain.data.buckets import CropPlan, format_histogram, histogram
from zerotrain.data.cache import (
    CACHE_VERSION,
    BuildReport,
    CachedDataset,
    Planned,
    build,
    encode_dtype,
    model_folder,
    plan_items,
    read_index,
    write_index,
)
from zerotrain.data.cost import cache_cost, size
from zerotrain.data.dataset import Item, Verdict, discover, enforce_counts, folder_repeat_lines, sample_rows
from zerotrain.data.index import DatasetRecord, Index
from zerotrain.data.sampler import BucketBatchSampler, EpochPlan
from zerotrain.distributed import Topology, barrier, gather_objects, patient_barrier
from zerotrain.errors import ZerotrainError
from zerotrain.faults import ignore_stop_signals
from zerotrain.models.catalog import check_trainable
from zerotrain.protocols import ModelSpec

SHOWN_PATHS = 3


@dataclass
class Prepared:
    index: Index
    """Every planned image that the cache holds, in a fixed order; sample indices refer to its rows."""
    samples: np.ndarray
    """Row of every sample of an epoch (rows repeated by their dataset's count)."""
    report: BuildReport
    rejected: list[Verdict]
    """What this start's build rejected (the index keeps every start's, as counts)."""
    counts: dict[str, list] = field(default_factory=dict)
    """reason -> [rejected, count, first paths] of every verdict, discovery's and builds'."""
    repeat_folders: dict[int, dict[str, int]] = field(default_factory=dict)
    found: tuple[int, int] = (0, 0)
    """(images, samples per epoch) as planned, before this start's build rejected any."""
    _planned: list[Planned] | None = None

    @property
    def planned(self) -> list[Planned]:
        """Each row's whole plan (read from the index's plans; a start that only trains never needs them)."""
        if self._planned is None:
            self._planned = self.index.planned(range(len(self.index)))
        return self._planned

    def summary(self) -> list[str]:
        lines = [f"{self.found[0]} images, {self.found[1]} samples per epoch with repeats",
                 *folder_repeat_lines(self.repeat_folders)]
        for rejected, label in ((True, "rejected"), (False, "note")):
            for reason, (_, count, paths) in sorted(((r, c) for r, c in self.counts.items() if c[0] == rejected),
                                                    key=lambda rc: -rc[1][1]):
                more = f" (+{count - len(paths)} more)" if count > len(paths) else ""
                lines.append(f"{label}: {reason}: {count}: {', '.join(paths)}{more}")
        lines += [f"rejected: {v.reason}: {v.path}" for v in self.rejected[:SHOWN_PATHS]]
        if len(self.rejected) > SHOWN_PATHS:
            lines.append(f"rejected while encoding: {len(self.rejected)} in all")
        lines.append(f"cache: {self.report.latents_encoded} images and {self.report.texts_encoded} captions encoded "
                     f"on this rank, {self.report.latents_cached} images and {self.report.texts_cached} captions "
                     "already cached")
        rows = self.samples
        _, first, counts = np.unique(self.index.rows["bucket_id"][rows], return_index=True, return_counts=True)
        buckets = [tuple(int(v) for v in self.index.rows["bucket"][rows[i]]) for i in first]
        lines += format_histogram(histogram(dict(zip(buckets, counts.tolist(), strict=True))), len(rows))
        return lines

    def epoch(self, global_batch: int) -> EpochPlan:
        """One epoch in global terms: the same for any world size with this global batch."""
        return bucket_sampler(self, global_batch, global_batch, Topology(0, 1, 0), 0).plan()


def bucket_sampler(prepared: Prepared, global_batch: int, micro_batch: int, topo: Topology,
                   seed: int) -> BucketBatchSampler:
    rows = prepared.samples
    try:
        return BucketBatchSampler(prepared.index.groups(rows), global_batch, micro_batch, topo.world_size,
                                  topo.rank, seed, choices=(prepared.index.rows["texts"][rows],
                                                            np.where(prepared.index.rows["empty"][rows] >= 0,
                                                                     prepared.index.rows["dropout"][rows], 0.0)))
    except ValueError as err:
        raise ZerotrainError(f"training.global_batch_size={global_batch}: {err}") from err


def fingerprint(run: RunConfig, spec: ModelSpec, identity: str) -> str:
    """What the index's plans depend on besides the datasets' files: the encoders, the family, the seed where
    crops are random, and the data section's fields that change what is found or how it is planned (not those
    that only judge it, such as bad_files, or only read it, such as num_workers)."""
    data = run.data.model_dump(mode="json", exclude={"datasets", "cache_dir", "num_workers", "bad_files",
                                                     "max_rejected_fraction", "unmasked_weight", "index_check"})
    seed = run.training.seed if run.data.crop == "random" else None
    # The plans are pickled: a version whose Item or Planned has other fields plans again rather than unpickle them.
    shapes = [[f.name for f in fields(kind)] for kind in (Item, Planned, CropPlan)]
    return data_index.digest(data_index.INDEX_VERSION, CACHE_VERSION, shapes, identity, spec.family, spec.name, data,
                             seed)


def stage(run: RunConfig, spec: ModelSpec, identity_: str) -> None:
    """Rank 0: the dataset index brought up to date and written, each dataset reused where nothing it depends on
    changed since, else discovered and planned again (its unchanged images' sizes taken from the index, not their
    headers). Raises the data policy's ZerotrainError."""
    root, data = run.data.cache_dir, run.data
    current = fingerprint(run, spec, identity_)
    old = data_index.load(root)
    if old is not None and old.meta.get("fingerprint") != current:
        old = None
    prior = [DatasetRecord.from_json(r) for r in old.meta["datasets"]] if old is not None else []
    parts: list[tuple[Index, list[Planned] | None]] = []
    records: list[DatasetRecord] = []
    for i, dataset in enumerate(data.datasets):
        before = prior[i] if i < len(prior) else None
        if before is not None and data_index.signature(dataset, before.depends, data.index_check) == before.signature:
            parts.append((data_index.take(old, np.arange(*before.rows)), None))
            records.append(before)
            continue
        discovery = discover(data, only=i, known=_known_sizes(old, before) if before is not None else None)
        planned, skipped = plan_items(discovery, run, spec, identity_)
        discovery.verdicts += skipped
        depends = discovery.depends.get(i, [])
        records.append(DatasetRecord(data_index.signature(dataset, depends, data.index_check),
                                     verdicts=data_index.verdict_counts(discovery.verdicts),
                                     repeat_folders={k: int(v) for k, v in discovery.repeat_folders.get(i, {}).items()},
                                     depends=depends))
        parts.append((data_index.from_planned(planned), planned))
    start = 0
    for (part, _), record in zip(parts, records, strict=True):
        record.rows = (start, start + len(part))
        start += len(part)
    enforce_counts(data_index.merge_counts(r.verdicts for r in records), start, data)
    unchanged = old is not None and len(prior) == len(records) and all(fresh is None for _, fresh in parts)
    if unchanged:
        if _shards_present(root, old) and not len(old.missing()):
            return  # a resumed start: nothing to write
        # The cache changed under the index (a build that was stopped, shards removed): look its keys up again.
        refreshed = data_index.with_shards(old, *_cache_maps(root))
        refreshed.meta.update(unique_latents=refreshed.unique_latents(), unique_texts=refreshed.unique_texts())
        data_index.write(root, refreshed, old._plans)
        return
    folder = data_index.folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    plans = folder / f"plans.{os.getpid()}.tmp"
    data_index.write_plans(plans, parts, old)
    merged = data_index.concatenate([part for part, _ in parts],
                                    {"fingerprint": current, "datasets": [r.to_json() for r in records]})
    merged = data_index.with_shards(merged, *_cache_maps(root))
    merged.meta.update(unique_latents=merged.unique_latents(), unique_texts=merged.unique_texts())
    data_index.write(root, merged, plans)


def _known_sizes(old: Index, before: DatasetRecord) -> dict[tuple, tuple[int, int]]:
    """A changed dataset's images as the index knows them: file identity -> upright (width, height)."""
    return {p.item.identity: (p.item.width, p.item.height) for p in old.planned(range(*before.rows))
            if p.item.identity}


def _cache_maps(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    cache = read_index(root)
    return cache["latents"], cache["text"]


def _shards_present(root: Path, index: Index) -> bool:
    """Whether every shard the index names is still in the cache."""
    for kind, names in (("latents", index.latent_shards), ("text", index.text_shards)):
        try:
            if not set(names) <= set(os.listdir(root / kind)):
                return False
        except OSError:
            return not names
    return True


def _agree(failure: str | None) -> None:
    """Every rank raises rank 0's ZerotrainError (rank 0 alone did the work that found it)."""
    failure = gather_objects(failure)[0]
    if failure is not None:
        raise ZerotrainError(failure)


def prepare(run: RunConfig, spec: ModelSpec, topo: Topology, device: str | torch.device = "cpu",
            source: Path | None = None) -> Prepared:
    """Everything up to a cache that holds every usable sample, encoded with the VAE and text encoders in
    `source` (the model's local folder, data.cache.model_folder's; fetched here for the encoders alone
    when not given), and the dataset index that describes it. Every rank calls it."""
    check_trainable(spec)  # on every rank, before anything is fetched
    from zerotrain.models.conditioning import encoders_identity

    if source is None:
        source = model_folder(spec, run, topo, "encode")
    identity_ = encoders_identity(spec, source, encode_dtype(device))
    root, data = run.data.cache_dir, run.data
    failure = None
    if topo.is_main:
        try:
            stage(run, spec, identity_)
        except ZerotrainError as err:
            failure = str(err)
    patient_barrier("rank 0's index of the datasets")
    _agree(failure)
    index = data_index.load(root)
    if topo.is_main:
        try:
            state_cost(run, spec, index)
        except ZerotrainError as err:
            failure = str(err)
    _agree(failure)
    # What the summary reports as found: the verdicts of discovery and of earlier builds (this build's are listed
    # on their own), the images and samples as planned.
    counts = data_index.merge_counts(DatasetRecord.from_json(r).verdicts for r in index.meta["datasets"])
    shares = {i: d.share for i, d in enumerate(data.datasets) if d.share is not None}
    found = (len(index), len(sample_rows(index.rows["dataset"], index.rows["repeats"], shares, run.training.seed)))
    missing = index.missing()
    rejected: list[Verdict] = []
    if len(missing):
        absent_latents = index.unique_latents(np.flatnonzero(index.rows["latent_shard"] == data_index.ABSENT))
        absent = index.texts["key"][index.texts["shard"] == data_index.ABSENT]
        absent_texts = len(np.unique(absent, axis=0)) if len(absent) else 0
        planned = index.planned(missing)
        built = build(planned, run, spec, source, topo.rank, topo.world_size, device)
        patient_barrier("every rank's share of the cache build")
        # One verdict an item: a control that does not decode rejects both its text and its latents (edit models
        # whose text encoder reads it), on one rank or two.
        rejected = list({v.path: v for part in gather_objects(built.rejected) for v in part}.values())
        failure = None
        if topo.is_main:
            try:
                _finish(root, index, missing, planned, rejected)
            except ZerotrainError as err:
                failure = str(err)
        barrier()
        _agree(failure)
        index = data_index.load(root)
        report = BuildReport(built.latents_encoded, built.texts_encoded, index.meta["unique_latents"] - absent_latents,
                             index.meta["unique_texts"] - absent_texts, rejected)
    else:
        report = BuildReport(0, 0, index.meta["unique_latents"], index.meta["unique_texts"], [])
    records = [DatasetRecord.from_json(r) for r in index.meta["datasets"]]
    enforce_counts(data_index.merge_counts(r.verdicts for r in records), len(index), data)
    samples = sample_rows(index.rows["dataset"], index.rows["repeats"], shares, run.training.seed)
    folders = {i: r.repeat_folders for i, r in enumerate(records) if r.repeat_folders}
    return Prepared(index, samples, report, rejected, counts, folders, found)


def state_cost(run: RunConfig, spec: ModelSpec, index: Index) -> None:
    """Rank 0, before anything is encoded: the cache's size on disk for this dataset and family, and what of it is
    still to encode; one line refusing the build where the disk cannot hold that."""
    text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
    cost = cache_cost(spec, index, text_tokens, run.data.flip)
    root = run.data.cache_dir
    free = shutil.disk_usage(root).free
    print(cost.line(free, root), flush=True)
    if cost.missing_bytes > free:
        raise ZerotrainError(f"data.cache_dir: {root} has {size(free)} free, and the cache needs {size(cost.missing_bytes)} "
                             f"more for this dataset ({cost.images:,} images, {cost.captions:,} captions; "
                             f"{size(cost.total)} in all); free space there, or set data.cache_dir to a larger disk")


def _finish(root: Path, index: Index, missing: np.ndarray, planned: list[Planned], rejected: list[Verdict]) -> None:
    """Rank 0, after a build: the index with every key's shard, without the images the build rejected (their
    verdicts counted in their datasets' records, so that later starts report them without trying again)."""
    cache = write_index(root)
    bad = {v.path: v for v in rejected}
    dropped = np.array([row for row, p in zip(missing.tolist(), planned, strict=True) if p.item.image in bad],
                       dtype=np.int64)
    records = [DatasetRecord.from_json(r) for r in index.meta["datasets"]]
    for p in planned:
        if p.item.image in bad:
            record = records[p.item.dataset]
            record.verdicts = data_index.merge_counts([record.verdicts,
                                                       data_index.verdict_counts([bad[p.item.image]])])
    keep = np.setdiff1d(np.arange(len(index)), dropped)
    kept = data_index.with_shards(data_index.take(index, keep), cache["latents"], cache["text"])
    dataset = kept.rows["dataset"]
    for i, record in enumerate(records):
        rows = np.flatnonzero(dataset == i)
        record.rows = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (int(np.searchsorted(dataset, i)),) * 2
    absent = kept.missing()
    if len(absent):
        first = kept.planned(absent[:1])[0].item.image
        raise ZerotrainError(f"the cache at {root} lacks {len(absent)} entries after the build (first: {first}); "
                             "run zerotrain cache again")
    kept.meta.update(datasets=[r.to_json() for r in records], unique_latents=kept.unique_latents(),
                     unique_texts=kept.unique_texts())
    data_index.write(root, kept, index._plans)


def make_loader(prepared: Prepared, run: RunConfig, micro_batch: int, topo: Topology,
                pin_memory: bool = False) -> tuple[torch.utils.data.DataLoader, BucketBatchSampler]:
    """DataLoader over the cache for this rank, with the global-epoch bucket sampler. The dataset reads the index's
    mapped rows: its workers share them rather than copy them."""
    rows = prepared.index.rows
    dataset = CachedDataset(prepared.index, run.data.cache_dir, run.data.flip,
                            loss_weights=bool((rows["loss_weight"] != 1.0).any()), masks=bool(rows["mask"].any()),
                            unmasked_weight=run.data.unmasked_weight, samples=prepared.samples)
    sampler = bucket_sampler(prepared, run.training.global_batch_size, micro_batch, topo, run.training.seed)
    workers = run.data.num_workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
        prefetch_factor=2 if workers else None, persistent_workers=bool(workers),
        worker_init_fn=ignore_stop_signals if workers else None)
    return loader, sampler
