"""The latent and text-embedding cache: encode once with the family's real VAE and text
encoders, store safetensors shards, train from memory-mapped shards.

Layout of data.cache_dir:
    latents/<rank>-<uuid>.safetensors   tensors "<key>.mean", "<key>.std" (+ ".flip_mean", ".flip_std",
                                        ".mask" (h, w) where the image has a loss mask, and
                                        ".ref<i>" (+ ".ref<i>_flip") per reference of an edit sample)
    text/<rank>-<uuid>.safetensors      tensors "<key>.<name>", name as the family's encode_prompt outputs,
                                        each without its trailing all-zero rows (the padding of a
                                        caption shorter than data.text_tokens), whose full length the
                                        shard's metadata "lengths" keeps; reading pads them back
    index.json                          key -> shard, merged after every build (a speed-up only)

Keys are content addresses. A latent key hashes the image file's identity (path, size,
mtime), its mask file's where it has one, each control image's and its crop (edit training), its
bucket and crop, the VAE's identity and the stored dtype; a text key hashes the
caption, the text encoders' identity and the sequence length. A changed image or caption gets a
new key, so only it is encoded again; nothing else needs invalidating.

Shards are written to a temporary name and renamed when complete, so a build killed halfway
leaves only whole shards (and stray temporaries, removed on the next build), and a rerun
encodes only what is missing. Under torch.distributed every rank encodes its share of what is
missing; rank 0 merges the index after a barrier."""

from __future__ import annotations

import hashlib
import json
import os
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from safetensors import safe_open
from safetensors.torch import save_file

from zerotrain import families
from zerotrain.config.sections import RunConfig
from zerotrain.data.buckets import CropPlan, apply_crop, assign_bucket, bucket_step, make_buckets, plan_crop
from zerotrain.data.dataset import Discovery, Item, Verdict
from zerotrain.data.images import ImageRejected, load_mask, load_rgb
from zerotrain.data.index import Index, from_planned, key_text
from zerotrain.data.sources import identity as file_identity
from zerotrain.distributed import Topology, barrier, on_each_node
from zerotrain.errors import ZerotrainError
from zerotrain.models.fine_tune import fine_tune_folder
from zerotrain.models.hub import Purpose, model_files
from zerotrain.protocols import ModelSpec

CACHE_VERSION = 1
STORE_DTYPE = torch.bfloat16  # training runs in bf16; halves the cache
# Items per shard: big enough that opening shards is cheap, small enough that a kill loses little.
SHARD_ITEMS = 64


@dataclass(frozen=True)
class Planned:
    """One item as the cache holds it."""

    item: Item
    crop: CropPlan
    bucket_id: int
    latent_key: str
    text_keys: tuple[str, ...]
    """One per text the item may train with (Item.texts), in that order."""
    empty_key: str = ""
    """The empty caption's key where the item's samples drop their caption (caption_dropout), else ""."""
    reference_crops: tuple[CropPlan, ...] = ()
    """Edit training: how each control image becomes its reference (its bucket: the reference's
    size, Family.reference_size)."""

    @property
    def group(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """What the samples of one batch share: the target's bucket and every reference's size."""
        return self.bucket_id, tuple(crop.bucket for crop in self.reference_crops)

    @property
    def text_key(self) -> str:
        return self.text_keys[0]

    def all_text_keys(self) -> list[str]:
        """Every text key a sample of this item may read."""
        return [*self.text_keys, *([self.empty_key] if self.empty_key else [])]

    def texts(self) -> dict[str, str]:
        """Text key -> the text it encodes."""
        return {**dict(zip(self.text_keys, self.item.texts)), **({self.empty_key: ""} if self.empty_key else {})}


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def encode_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on a GPU (T5-XXL alone is 19 GB in fp32), fp32 on the CPU (which lacks fast bf16)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def model_folder(spec: ModelSpec, run: RunConfig, topo: Topology, purpose: Purpose = "train") -> Path:
    """The local diffusers folder holding every file a run of `purpose` reads (models.hub): a local folder
    checked, a hub repo downloaded into the Hugging Face cache by local rank 0 of each node while the node's
    other ranks wait, and checked. The catalog's tiny-* models are built under data.cache_dir/models (by
    rank 0: transformers saves files on rank 0 only), since they have no published weights. With
    model.denoiser, training's folder is the base's with the fine-tune in place of its denoiser, written
    once per node (models.fine_tune). Every rank calls it, before anything is encoded."""
    from zerotrain.models.tiny import TINY_NAMES, ensure_tiny_pipeline

    if spec.pretrained is None and spec.name in TINY_NAMES:
        root = run.data.cache_dir / "models"
        if topo.is_main:
            ensure_tiny_pipeline(spec.name, root)
        barrier()
        folder = ensure_tiny_pipeline(spec.name, root)
    else:
        folder = on_each_node(model_files, topo, spec, run.model.revision, purpose)
    if spec.denoiser is not None and purpose == "train":
        return on_each_node(fine_tune_folder, topo, spec, folder, run)
    return folder


def plan_items(discovery: Discovery, run: RunConfig, spec: ModelSpec, identity: str) -> tuple[list[Planned], list[Verdict]]:
    """Bucket, crop and keys for every item; items too small for their bucket are skipped when
    data.upscale=skip."""
    data = run.data
    family = families.of(spec)
    buckets = make_buckets(data.resolution, bucket_step(data.bucket_step, family.pixel_factor(spec)), data.max_aspect_ratio)
    text_tokens = data.text_tokens or family.default_text_tokens
    check_references(discovery, spec, data.flip)
    planned, skipped = [], []
    for item in discovery.items:
        bucket = assign_bucket(item.width, item.height, buckets)
        # A random crop is drawn once per image and seed, so the cache stays valid across runs.
        rng = random.Random(_digest(run.training.seed, str(item.image)))
        crop = plan_crop(item.width, item.height, bucket, data.crop, rng)
        if crop.upscaled and data.upscale == "skip":
            skipped.append(Verdict(item.image, f"smaller than its bucket {bucket[0]}x{bucket[1]} (data.upscale=skip)"))
            continue
        references = tuple(reference_crop(family.reference_size(spec, bucket, size, data.control_resolution), size,
                                          crop, (item.width, item.height)) for size in item.control_sizes)
        controls = [("control", *file_identity(path), plan) for path, plan in zip(item.controls, references, strict=True)]
        latent_key = _digest(CACHE_VERSION, *(item.identity or file_identity(item.image)), crop, identity, str(STORE_DTYPE), data.flip,
                             *([("mask", item.mask_alpha, *file_identity(item.mask))] if item.mask else []), *controls)
        # A text encoder that reads the references with the caption makes them part of the text's address (as it
        # reads them: over data.background where transparent).
        seen = [*controls, ("background", data.background), *family.text_reference_identity(spec)] \
            if family.text_reads_references and controls else []
        text_keys = tuple(text_key(text, identity, text_tokens, spec, *seen) for text in item.texts)
        empty = text_key("", identity, text_tokens, spec, *seen) if item.caption_dropout > 0 else ""
        planned.append(Planned(item, crop, buckets.index(bucket), latent_key, text_keys, empty, references))
    return planned, skipped


def check_references(discovery: Discovery, spec: ModelSpec, flip: bool = False) -> None:
    """One line when a dataset gives references to a model that takes none, or more than it takes, or
    asks for flipped edits of a model whose text encoder reads the references (a flipped sample would need
    its caption encoded again with the flipped images, which the cache does not do)."""
    family = families.of(spec)
    most = family.max_references(spec)
    counts: dict[int, int] = {}
    for item in discovery.items:
        counts[item.dataset] = max(counts.get(item.dataset, 0), len(item.controls))
    if flip and family.text_reads_references and any(counts.values()):
        raise ZerotrainError(f"data.flip: {family.title}'s text encoder reads each control image with the caption, "
                             "and zerotrain encodes that text for the images as they are, not flipped; set "
                             "data.flip: false for edit training")
    for dataset, count in sorted(counts.items()):
        if count and not most:
            raise ZerotrainError(f"data.datasets[{dataset}]: {count} control image(s) per target, but "
                                 f"{spec.name} ({family.pipeline_name(spec)}) {family.no_references(spec)}; remove "
                                 "its controls, or train an edit model (flux-kontext-dev, FLUX.2, FLUX.3 [klein])")
        if count > most:
            raise ZerotrainError(f"data.datasets[{dataset}]: {count} control images per target, but "
                                 f"{family.pipeline_name(spec)} takes at most {most}; give each target fewer")


def reference_crop(size: tuple[int, int], control: tuple[int, int], target_crop: CropPlan,
                   target: tuple[int, int]) -> CropPlan:
    """How a control image becomes a reference of `size`: cropped as its target is where it has the
    target's size and the reference the bucket's (so that a random crop cuts both alike), else
    resized to cover `size` and cropped at the centre."""
    if control == target and size == target_crop.bucket:
        return target_crop
    return plan_crop(*control, size, "center", None)


def text_key(text: str, identity: str, text_tokens: int, spec: ModelSpec, *images: Any) -> str:
    """A caption's content address: the text, the text encoders' identity and the sequence length (and the
    identity and crop of each reference image the text encoder reads with it)."""
    return _digest(CACHE_VERSION, text, identity, text_tokens, spec.family, *images)


def shard_index(folder: Path) -> dict[str, str]:
    """key -> shard file name, from the headers of every complete shard in `folder`."""
    index: dict[str, str] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                index[name.split(".", 1)[0]] = shard.name
    return index


def write_shard(folder: Path, rank: int, tensors: dict[str, torch.Tensor], trim: bool = False) -> Path:
    """Write a shard under a temporary name and rename it when complete. With trim, each tensor is
    stored without its trailing all-zero rows (dim 0), its full length in the metadata's "lengths"
    (a caption zero-padded to 512 tokens of Krea 2's (12, 2560) stacks is 31 MB; its own 30 tokens 2 MB)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{rank:04d}-{uuid.uuid4().hex[:12]}.safetensors"
    tmp = final.with_suffix(".tmp")
    metadata = {"version": str(CACHE_VERSION)}
    if trim:
        kept = {name: _kept_rows(tensor) for name, tensor in tensors.items()}
        lengths = {name: len(tensors[name]) for name, rows in kept.items() if rows < len(tensors[name])}
        tensors = {name: tensor[:kept[name]] if name in lengths else tensor for name, tensor in tensors.items()}
        metadata["lengths"] = json.dumps(lengths, separators=(",", ":"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, final)
    return final


def _kept_rows(tensor: torch.Tensor) -> int:
    """The rows of `tensor` (dim 0) up to its last one that is not all zeros (at least one row)."""
    nonzero = tensor.reshape(len(tensor), -1).ne(0).any(dim=1).nonzero()
    return int(nonzero[-1]) + 1 if len(nonzero) else min(1, len(tensor))


def stored_lengths(handle: Any) -> dict[str, int]:
    """A text shard's full lengths of its trimmed tensors (write_shard); empty for older shards."""
    return json.loads((handle.metadata() or {}).get("lengths", "{}"))


def untrimmed(tensor: torch.Tensor, length: int | None) -> torch.Tensor:
    """A stored tensor padded back with zero rows to its full length."""
    if length is None or length == len(tensor):
        return tensor
    return torch.cat([tensor, tensor.new_zeros(length - len(tensor), *tensor.shape[1:])])


class RateColumn(ProgressColumn):
    """Items per second, e.g. '12.3 images/s'."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0:.1f} {task.fields.get('unit', 'items')}/s")


def progress_bar(enabled: bool) -> Progress:
    """A rich progress bar with count, rate and ETA; plain lines when stdout is not a terminal."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), RateColumn(),
                    TimeRemainingColumn(), disable=not enabled, transient=False)


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _shards(batches: list[list], items: int) -> Iterator[list[list]]:
    """Consecutive batches, grouped into shards of at most `items` entries (a larger batch alone)."""
    shard: list[list] = []
    count = 0
    for batch in batches:
        if shard and count + len(batch) > items:
            yield shard
            shard, count = [], 0
        shard.append(batch)
        count += len(batch)
    if shard:
        yield shard


@dataclass
class BuildReport:
    latents_encoded: int
    texts_encoded: int
    latents_cached: int
    texts_cached: int
    rejected: list[Verdict]


def build(planned: list[Planned], run: RunConfig, spec: ModelSpec, source: Path, rank: int = 0, world: int = 1,
          device: str | torch.device = "cpu", batch_size: int = 4, show_progress: bool = True) -> BuildReport:
    """Encode whatever the cache is missing; this rank takes every world-th missing entry."""
    from zerotrain.models.conditioning import encode_latent_moments, encode_prompts, free, load_encoders

    root = run.data.cache_dir
    latents_dir, text_dir = root / "latents", root / "text"
    have_latents, have_texts = shard_index(latents_dir), shard_index(text_dir)
    # Every rank must see the same cache before anyone writes, or the shares would not line up.
    barrier()
    unique_latents = {p.latent_key: p for p in planned}
    unique_texts: dict[str, str] = {}
    owners: dict[str, list[Planned]] = {}  # text key -> the items that train with it
    for p in planned:
        for key, text in p.texts().items():
            unique_texts[key] = text
            owners.setdefault(key, []).append(p)
    missing_latents = [p for key, p in unique_latents.items() if key not in have_latents]
    missing_texts = [(key, text, owners[key][-1]) for key, text in unique_texts.items() if key not in have_texts]
    # Work is dealt out in whole same-bucket batches, so the cache does not depend on the world size.
    by_bucket: dict[int, list[Planned]] = {}
    for p in missing_latents:
        by_bucket.setdefault(p.bucket_id, []).append(p)
    latent_batches = [batch for group in by_bucket.values() for batch in _chunks(group, batch_size)]
    # A caption the text encoder reads with its sample's references is encoded alone, with them.
    reads = families.of(spec).text_reads_references
    alone = {key for key, _, p in missing_texts if reads and p.reference_crops}
    text_batches = [*_chunks([entry for entry in missing_texts if entry[0] not in alone], batch_size),
                    *([entry] for entry in missing_texts if entry[0] in alone)]
    mine_latent_batches, mine_text_batches = latent_batches[rank::world], text_batches[rank::world]
    mine_latents = [p for batch in mine_latent_batches for p in batch]
    mine_texts = [p for batch in mine_text_batches for p in batch]
    rejected: list[Verdict] = []
    if mine_latents or mine_texts:
        encoders = load_encoders(spec, source, device=device, dtype=encode_dtype(device))
        try:
            text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
            with progress_bar(show_progress and rank == 0) as bars:
                captions = bars.add_task("encoding captions", total=len(mine_texts), unit="captions")
                images = bars.add_task("encoding images", total=len(mine_latents), unit="images")
                for shard in _shards(mine_text_batches, SHARD_ITEMS):
                    tensors = {}
                    for batch in shard:
                        bars.advance(captions, len(batch))
                        try:
                            pictures = ([reference_images(p, run.data.background) for _, _, p in batch]
                                        if batch[0][0] in alone else None)
                        except ControlRejected as err:  # every item that trains with this text (their latents too)
                            rejected += [Verdict(q.item.image, err.verdict.reason) for q in owners[batch[0][0]]]
                            continue
                        out = encode_prompts(encoders, [text for _, text, _ in batch], text_tokens, pictures)
                        for i, (key, _, _) in enumerate(batch):
                            tensors.update({f"{key}.{name}": value[i].to(STORE_DTYPE).cpu()
                                            for name, value in out.items()})
                    if tensors:
                        write_shard(text_dir, rank, tensors, trim=True)
                for shard in _shards(mine_latent_batches, SHARD_ITEMS):
                    tensors = {}
                    for batch in shard:
                        rejected += _encode_images(encoders, batch, run, device, tensors, encode_latent_moments)
                        bars.advance(images, len(batch))
                    if tensors:
                        write_shard(latents_dir, rank, tensors)
        finally:
            free(encoders)
    return BuildReport(len(mine_latents), len(mine_texts), len(unique_latents) - len(missing_latents),
                       len(unique_texts) - len(missing_texts), rejected)


def _encode_images(encoders, batch: list[Planned], run: RunConfig, device, tensors: dict, encode_moments) -> list[Verdict]:
    """Decode, crop and encode one same-bucket batch into `tensors`; files that fail to decode
    now (truncated data past the header, a file that vanished) become verdicts."""
    pixels, kept, masks, rejected = [], [], [], []
    for p in batch:
        try:
            image = load_rgb(p.item.image, run.data.background, min_target=p.crop.resized_size)
        except (ImageRejected, OSError) as err:
            rejected.append(Verdict(p.item.image, getattr(err, "reason", "unreadable")))
            continue
        try:
            mask = load_mask(p.item.mask, alpha=p.item.mask_alpha) if p.item.mask is not None else None
        except (ImageRejected, OSError) as err:
            rejected.append(Verdict(p.item.image, f"mask {p.item.mask.name}: {getattr(err, 'reason', 'unreadable')}"))
            continue
        masks.append(mask)
        cropped = apply_crop(image, p.crop)
        array = torch.frombuffer(bytearray(cropped.tobytes()), dtype=torch.uint8)
        pixels.append(array.view(cropped.height, cropped.width, 3).permute(2, 0, 1))
        kept.append(p)
    if not kept:
        return rejected
    x = torch.stack(pixels).to(device=device, dtype=torch.float32) / 127.5 - 1.0
    variants = [("", x)] + ([("flip_", torch.flip(x, dims=[3]))] if run.data.flip else [])
    for prefix, images in variants:
        mean, std = encode_moments(encoders, images.to(encoders.vae.dtype))
        for i, p in enumerate(kept):
            tensors[f"{p.latent_key}.{prefix}mean"] = mean[i].to(STORE_DTYPE).cpu()
            tensors[f"{p.latent_key}.{prefix}std"] = std[i].to(STORE_DTYPE).cpu()
    for p, mask in zip(kept, masks, strict=True):
        if p.item.mask is not None:
            tensors[f"{p.latent_key}.mask"] = latent_mask(mask, p.crop, mean.shape[-2:])
    rejected += _encode_references(encoders, kept, run, device, tensors, encode_moments)
    return rejected


def _encode_references(encoders, kept: list[Planned], run: RunConfig, device, tensors: dict,
                       encode_moments) -> list[Verdict]:
    """Each item's references, encoded one at a time (their sizes differ) into `tensors` as
    "<key>.ref<i>" (and ".ref<i>_flip" with data.flip): the normalized posterior mean, which is what
    the edit pipelines encode (retrieve_latents' argmax). An item whose control fails to decode now
    loses all its tensors and becomes a verdict."""
    rejected = []
    for p in kept:
        try:
            images = reference_images(p, run.data.background)
        except ControlRejected as err:
            rejected.append(err.verdict)
            for name in [k for k in tensors if k.startswith(f"{p.latent_key}.")]:
                del tensors[name]
            continue
        for i, image in enumerate(images):
            array = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            x = array.view(image.height, image.width, 3).permute(2, 0, 1)[None].to(device=device, dtype=torch.float32)
            x = x / 127.5 - 1.0
            variants = [("", x)] + ([("_flip", torch.flip(x, dims=[3]))] if run.data.flip else [])
            for suffix, pixels in variants:
                mean, _ = encode_moments(encoders, pixels.to(encoders.vae.dtype))
                tensors[f"{p.latent_key}.ref{i}{suffix}"] = mean[0].to(STORE_DTYPE).cpu()
    return rejected


class ControlRejected(Exception):
    """A control image that does not decode now; its verdict rejects the item."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


def reference_images(p: Planned, background: Any) -> list[Image.Image]:
    """An edit item's control images as its references: decoded (over `background` where transparent) and
    cropped to their reference size (Planned.reference_crops), as the VAE, and a text encoder that reads
    them, see them."""
    images = []
    for control, crop in zip(p.item.controls, p.reference_crops, strict=True):
        try:
            images.append(apply_crop(load_rgb(control, background, min_target=crop.resized_size), crop))
        except (ImageRejected, OSError) as err:
            raise ControlRejected(Verdict(p.item.image, f"control {control}: {getattr(err, 'reason', 'unreadable')}")) from None
    return images


def latent_mask(mask: Image.Image | None, crop: CropPlan, grid: tuple[int, int]) -> torch.Tensor:
    """A loss mask (images.load_mask) on the latent grid (h, w), in [0, 1]: cropped as its image is, then
    each latent pixel the mean of the pixels it covers (area interpolation). None, an alpha mask of an
    opaque image, gives all ones. Flipped samples flip it when they are drawn."""
    if mask is None:
        return torch.ones(tuple(grid), dtype=STORE_DTYPE)
    cropped = apply_crop(mask, crop)
    pixels = torch.frombuffer(bytearray(cropped.tobytes()), dtype=torch.uint8).view(1, 1, cropped.height, cropped.width)
    area = torch.nn.functional.interpolate(pixels.float() / 255.0, size=tuple(grid), mode="area")
    return area[0, 0].clamp(0.0, 1.0).to(STORE_DTYPE)


def write_index(root: Path) -> dict[str, dict[str, str]]:
    """Merge every shard's keys into index.json (atomically) and remove stray temporaries."""
    for tmp in root.glob("*/*.tmp"):
        tmp.unlink(missing_ok=True)
    index = {"version": CACHE_VERSION, "latents": shard_index(root / "latents"), "text": shard_index(root / "text")}
    tmp = root / f"index.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, root / "index.json")
    return index


def read_index(root: Path) -> dict[str, dict[str, str]]:
    """index.json when it is current, else rebuilt from the shards (index.json is only a speed-up)."""
    path = root / "index.json"
    if path.is_file():
        try:
            index = json.loads(path.read_text())
            if index.get("version") == CACHE_VERSION:
                return index
        except ValueError:
            pass
    return {"version": CACHE_VERSION, "latents": shard_index(root / "latents"), "text": shard_index(root / "text")}


class CachedDataset(torch.utils.data.Dataset):
    """Training samples read only from the cache, through memory-mapped safetensors shards.

    Sample i is row samples[i] of the dataset index (data.index: the rows of prepare's index, mapped and shared
    by the DataLoader's workers, or an index of a list of Planned made here); a sample is a dict of tensors:
    latent mean and std (the VAE's posterior, so training draws a fresh latent each time), the text
    conditioning, and the bucket, original size and crop offsets that SDXL's micro-conditioning needs."""

    def __init__(self, planned: list[Planned] | Index, root: Path, flip: bool = False, loss_weights: bool = False,
                 masks: bool = False, unmasked_weight: float = 0.0, samples: np.ndarray | None = None) -> None:
        if isinstance(planned, Index):
            index = planned
        else:
            cache = read_index(root)
            index = from_planned(planned, cache["latents"], cache["text"])
        missing = index.missing()
        if len(missing):
            first = index.planned(missing[:1])[0].item.image
            raise ZerotrainError(f"{len(missing)} images are not in the cache at {root} (first: {first}); "
                                 "run `zerotrain cache --config ...` first")
        self.index, self.root, self.flip = index, root, flip
        self.samples = np.arange(len(index)) if samples is None else samples
        self.loss_weights = loss_weights  # each sample carries its dataset's loss_weight
        self.masks, self.unmasked_weight = masks, unmasked_weight  # each sample carries a loss_mask (h, w)
        self._handles: dict[str, Any] = {}
        self._text_names: dict[str, list[str]] = {}
        self._text_lengths: dict[str, dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _open(self, kind: str, name: str):
        handle = self._handles.get(f"{kind}/{name}")
        if handle is None:  # opened lazily, so each DataLoader worker has its own handles
            handle = self._handles[f"{kind}/{name}"] = safe_open(self.root / kind / name, framework="pt")
        return handle

    def __getitem__(self, i: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        """Sample i, or (i, choice) as the sampler's text_choices give it: the choice-th of its
        texts, or the empty caption for -1."""
        i, choice = i if isinstance(i, tuple) else (i, 0)
        index = self.index
        row = index.rows[int(self.samples[i])]
        text_row = int(row["empty"]) if choice < 0 else int(row["text_start"]) + choice
        latent_key, key = key_text(row["latent"]), index.text_key(text_row)
        latents = self._open("latents", index.latent_shards[row["latent_shard"]])
        text_shard = index.text_shards[index.texts["shard"][text_row]]
        text = self._open("text", text_shard)
        width, height = (int(v) for v in row["original"])
        sample = {
            "latent_mean": latents.get_tensor(f"{latent_key}.mean"),
            "latent_std": latents.get_tensor(f"{latent_key}.std"),
            "original_size": torch.tensor((height, width)),  # (height, width), as diffusers orders it
            "crop_top_left": torch.tensor(tuple(int(v) for v in row["crop"])),
            "target_size": torch.tensor((int(row["bucket"][1]), int(row["bucket"][0]))),
        }
        if self.loss_weights:
            sample["loss_weight"] = torch.tensor(float(row["loss_weight"]), dtype=torch.float32)
        if self.masks:  # ones for an unmasked image in a run with masks: every sample of a batch has one
            mask = (latents.get_tensor(f"{latent_key}.mask").float() if row["mask"]
                    else torch.ones(sample["latent_mean"].shape[-2:]))
            sample["loss_mask"] = self.unmasked_weight + (1.0 - self.unmasked_weight) * mask
        if self.flip:  # horizontally flipped moments; the training step picks one of the two per sample
            sample["latent_flip_mean"] = latents.get_tensor(f"{latent_key}.flip_mean")
            sample["latent_flip_std"] = latents.get_tensor(f"{latent_key}.flip_std")
        for r in range(int(row["references"])):  # edit training: each reference's clean latents
            sample[f"reference_{r}"] = latents.get_tensor(f"{latent_key}.ref{r}")
            if self.flip:
                sample[f"reference_{r}_flip"] = latents.get_tensor(f"{latent_key}.ref{r}_flip")
        lengths = self._lengths(text_shard, text)
        for name in self._names(text_shard, text)[key]:
            sample[name] = untrimmed(text.get_tensor(f"{key}.{name}"), lengths.get(f"{key}.{name}"))
        return sample

    def _lengths(self, shard: str, handle: Any) -> dict[str, int]:
        lengths = self._text_lengths.get(shard)
        if lengths is None:
            lengths = self._text_lengths[shard] = stored_lengths(handle)
        return lengths

    def _names(self, shard: str, handle: Any) -> dict[str, list[str]]:
        """key -> the names of its text tensors in one shard (each family's encode_prompt outputs)."""
        names = self._text_names.get(shard)
        if names is None:
            names = self._text_names[shard] = {}
            for entry in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                key, name = entry.split(".", 1)
                names.setdefault(key, []).append(name)
        return names

    def __getstate__(self) -> dict:  # open handles do not cross process boundaries
        return {**self.__dict__, "_handles": {}, "_text_names": {}, "_text_lengths": {}}
