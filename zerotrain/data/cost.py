"""What the cache takes on disk, stated before anything is encoded (issue 49 §2).

- Each image's latents: the VAE's mean and std in bf16 at its bucket's latent size (data.flip: the flipped pair
  too), its loss mask on the latent grid, and each reference's latents (edit training).
- Each distinct caption's embeddings: the denoiser's text inputs, read from the family's own example inputs on the
  meta device (Family.example_inputs, as the planner reads them): the tensors that grow with the caption's length,
  at data.text_tokens, and those that do not (a pooled embedding). A family whose text encoder pads with zeros
  (it has a text mask) stores each caption at its own length, so for it the caption figure is at most.

Each tensor also takes its safetensors header entry (its name, dtype, shape and offsets), about TENSOR_HEADER bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerotrain import families
from zerotrain.protocols import ModelSpec

STORE_BYTES = 2  # bf16
TENSOR_HEADER = 96
"""Bytes of a tensor's entry in its shard's JSON header: a 38-character key, dtype, shape and offsets."""


@dataclass(frozen=True)
class CacheCost:
    images: int
    image_bytes: int
    captions: int
    caption_bytes: int
    """Every distinct caption's embeddings at full length (at most, where captions are stored at their length)."""
    per_caption: int
    at_most: bool
    """Captions are stored at their own length: caption_bytes is an upper bound."""
    missing_bytes: int
    """What the cache does not hold yet (the images and captions still to encode)."""

    @property
    def total(self) -> int:
        return self.image_bytes + self.caption_bytes

    def line(self, free: int | None, where: object) -> str:
        bound = "at most " if self.at_most else ""
        room = f"; {size(free)} free at {where}" if free is not None else ""
        return (f"cache size on disk: {bound}{size(self.total)} for {self.images:,} images ({size(self.image_bytes)}) "
                f"and {self.captions:,} captions ({bound}{size(self.caption_bytes)}, {size(self.per_caption)} each at "
                f"full length); {bound}{size(self.missing_bytes)} of it still to encode{room}")


def size(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps a whole number before the point."""
    n = n or 0
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def caption_bytes(spec: ModelSpec, text_tokens: int) -> tuple[int, bool]:
    """One caption's cached embeddings at text_tokens, and whether shorter captions are stored shorter."""
    import torch
    from torch.utils._pytree import keystr, tree_flatten_with_path

    family = families.of(spec)
    side = 8 * family.pixel_factor(spec)

    def numels(tokens: int, resolution: int) -> list[int]:
        """Each input tensor's elements, but the positions the denoiser is given and the cache does not hold."""
        inputs = family.example_inputs(spec, 1, resolution, resolution, tokens, "meta", torch.bfloat16)
        leaves, _ = tree_flatten_with_path(inputs)
        return [t.numel() if "ids" not in keystr(path) else 0 for path, t in leaves if isinstance(t, torch.Tensor)]

    short, longer, wider = numels(11, side), numels(13, side), numels(11, 2 * side)
    per_token = sum((b - a) // 2 for a, b in zip(short, longer, strict=True) if b != a)
    fixed = sum(a for a, b, c in zip(short, longer, wider, strict=True) if a == b == c and a > 16)
    header = TENSOR_HEADER * len(family.text_outputs)
    trimmed = any("mask" in name for name in family.text_outputs)
    return STORE_BYTES * (per_token * text_tokens + fixed) + header, trimmed


def latent_bytes(spec: ModelSpec, rows: np.ndarray, reference_sizes: list, flip: bool) -> np.ndarray:
    """Each row's latent tensors (data.index rows): mean and std at its bucket's latent size, flipped too with
    flip, its mask where it has one, and each reference's latents."""
    factor, channels = spec.vae_scale_factor, spec.latent_channels
    pair = 2 * (2 if flip else 1)
    grid = (rows["bucket"][:, 0] // factor).astype(np.int64) * (rows["bucket"][:, 1] // factor)
    out = pair * (channels * grid * STORE_BYTES + TENSOR_HEADER) + rows["mask"] * (grid * STORE_BYTES + TENSOR_HEADER)
    if (rows["reference_sizes"] >= 0).any():
        per_set = np.array([sum(channels * (w // factor) * (h // factor) * STORE_BYTES + TENSOR_HEADER
                                for w, h in sizes) * (2 if flip else 1) for sizes in reference_sizes] or [0])
        out = out + np.where(rows["reference_sizes"] >= 0, per_set[np.maximum(rows["reference_sizes"], 0)], 0)
    return out


def cache_cost(spec: ModelSpec, index, text_tokens: int, flip: bool) -> CacheCost:
    """The cache's size for the images a dataset index plans (data.index.Index), and what of it is missing. An image
    listed twice (two datasets naming one file) counts twice."""
    from zerotrain.data.index import ABSENT

    rows, sizes = index.rows, index.meta.get("reference_sizes", [])
    images = int(latent_bytes(spec, rows, sizes, flip).sum()) if len(rows) else 0
    absent = rows["latent_shard"] == ABSENT
    missing_images = int(latent_bytes(spec, rows[absent], sizes, flip).sum()) if absent.any() else 0
    per_caption, trimmed = caption_bytes(spec, text_tokens)
    captions = index.meta.get("unique_texts")
    if captions is None:
        captions = index.unique_texts()
    absent_texts = index.texts["key"][index.texts["shard"] == ABSENT]
    missing_captions = len(np.unique(absent_texts, axis=0)) if len(absent_texts) else 0
    return CacheCost(len(rows), images, captions, captions * per_caption, per_caption, trimmed,
                     missing_images + missing_captions * per_caption)


def estimate(run, spec: ModelSpec) -> CacheCost:
    """The cache's size before the first build, from the datasets' listings (no image is read, captions are):
    every listed image at about data.resolution squared pixels (every bucket has about as many), its mask where it
    has one, and every distinct caption variant (data.dataset.caption_variants), the empty one with caption
    dropout. Images that would be rejected are counted."""
    from zerotrain.data.dataset import caption_variants, listed

    data = run.data
    family = families.of(spec)
    grid = (data.resolution // spec.vae_scale_factor) ** 2
    pair = 2 * (2 if data.flip else 1)
    per_image = pair * (spec.latent_channels * grid * STORE_BYTES + TENSOR_HEADER)
    images, image_bytes, texts = 0, 0, set()
    for index, entries in listed(data):
        dataset = data.datasets[index]
        for entry in entries:
            images += 1
            image_bytes += per_image + (grid * STORE_BYTES + TENSOR_HEADER if entry.mask and data.mask == "file" else 0)
            if entry.texts is not None:
                texts.update(caption_variants(entry.texts, dataset))
            else:
                texts.add(entry.image.stem.replace("_", " ") if data.missing_caption == "filename" else "")
        if (data.caption_dropout if dataset.caption_dropout is None else dataset.caption_dropout) > 0:
            texts.add("")
    per_caption, trimmed = caption_bytes(spec, data.text_tokens or family.default_text_tokens)
    return CacheCost(images, image_bytes, len(texts), len(texts) * per_caption, per_caption, trimmed,
                     image_bytes + len(texts) * per_caption)


def plan_statement(run, spec: ModelSpec) -> str | None:
    """zerotrain plan's line for a config with data: the cache's size as the dataset index at data.cache_dir plans
    it (from the last zerotrain cache or training start), or before the first, as estimate() reckons it from the
    datasets' listings. None without datasets."""
    import shutil

    from zerotrain.data.index import load

    if not run.data.datasets:
        return None
    root = run.data.cache_dir
    free_at = root if root.exists() else next((p for p in root.parents if p.exists()), Path("."))
    free = shutil.disk_usage(free_at).free
    index = load(root)
    if index is None or not len(index):
        cost = estimate(run, spec)
        return (f"{cost.line(free, free_at)} (estimated from the datasets' listings, each image at about "
                f"{run.data.resolution} px square; zerotrain cache states it exactly before it encodes anything)")
    text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
    cost = cache_cost(spec, index, text_tokens, run.data.flip)
    return f"{cost.line(free, root)} (the dataset index at {root}, as last built)"
