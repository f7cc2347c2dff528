"""Aspect-ratio buckets: which (width, height) shapes an image may train at, which one each image
goes to, and how it is resized and cropped to fit exactly.

Every image trains at a bucket of about R x R pixels whose aspect is nearest its own, so little is
cropped away and every batch (drawn from one bucket by the sampler) has a single shape.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from PIL import Image

Bucket = tuple[int, int]
"""(width, height) in pixels."""

# Aspect comparisons are between ratios of small integers; this absorbs float rounding only.
_EPS = 1e-9


def bucket_step(config_step: int, pixel_factor: int) -> int:
    """The step bucket sides are multiples of: the least common multiple of the configured step
    and the model's pixel factor (VAE downsampling times patching), so that every side is a
    multiple of both and the step is never below the pixel factor. 64 with factor 16 -> 64;
    8 with factor 16 -> 16; 24 with factor 16 -> 48."""
    if config_step < 1 or pixel_factor < 1:
        raise ValueError(f"bucket step ({config_step}) and pixel factor ({pixel_factor}) must be positive")
    return math.lcm(config_step, pixel_factor)


def _within_aspect(width: int, height: int, max_aspect_ratio: float) -> bool:
    return max(width, height) <= max_aspect_ratio * min(width, height) + _EPS


def _tallest(width: int, area: int, step: int) -> int:
    """The largest multiple of step h with width * h <= area (0 when there is none)."""
    return area // width // step * step


def make_buckets(resolution: int, step: int, max_aspect_ratio: float) -> list[Bucket]:
    """All bucket shapes for a target resolution R.

    The rule: for every width w that is a multiple of step, take the tallest height h, also a
    multiple of step, with w * h <= R * R, and keep (w, h) and its transpose (h, w) when
    max(w, h) / min(w, h) <= max_aspect_ratio. Then drop any candidate that another candidate
    beats on one side while matching the other (same height and wider, or same width and taller):
    it would waste pixels. (The transpose matters at the aspect limit: at R=1024, step 64, limit
    2, width 704 would take height 1472, too tall, but (704, 1408) enters as the transpose of
    (1408, 704).) So no bucket exceeds R * R pixels, each is as large as the step allows for its
    shape, the list is symmetric under swapping width and height, and (R, R) is in it whenever R
    is a multiple of step. Sorted by (width, height), without duplicates.
    """
    if resolution < 1 or step < 1:
        raise ValueError(f"resolution ({resolution}) and step ({step}) must be positive")
    if max_aspect_ratio < 1.0:
        raise ValueError(f"max_aspect_ratio must be at least 1.0, got {max_aspect_ratio}")
    area = resolution * resolution
    # Past R * sqrt(max_aspect_ratio) a side's partner would have to be flatter than allowed.
    longest = math.floor(resolution * math.sqrt(max_aspect_ratio) + _EPS) // step * step
    candidates: set[Bucket] = set()
    for side in range(step, longest + 1, step):
        other = _tallest(side, area, step)
        if other and _within_aspect(side, other, max_aspect_ratio):
            candidates.add((side, other))
            candidates.add((other, side))
    widest_at_height: dict[int, int] = {}
    tallest_at_width: dict[int, int] = {}
    for width, height in candidates:
        widest_at_height[height] = max(widest_at_height.get(height, 0), width)
        tallest_at_width[width] = max(tallest_at_width.get(width, 0), height)
    buckets = sorted(
        (width, height) for width, height in candidates
        if widest_at_height[height] == width and tallest_at_width[width] == height
    )
    if not buckets:
        raise ValueError(
            f"no bucket fits resolution {resolution} with step {step}; the step must not exceed the resolution"
        )
    return buckets


def assign_bucket(width: int, height: int, buckets: list[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's, measured as |log(w/h) - log(bw/bh)| so
    that 2:1 and 1:2 are equally far from 1:1. Ties go to the larger bucket, then the wider one."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if not buckets:
        raise ValueError("no buckets to assign to")
    aspect = math.log(width / height)
    return min(
        buckets,
        key=lambda b: (round(abs(aspect - math.log(b[0] / b[1])), 12), -b[0] * b[1], -b[0]),
    )


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes exactly its bucket's size: resize to cover the bucket with the aspect
    preserved, then crop. SDXL's micro-conditioning records original_size and (crop_top,
    crop_left)."""

    bucket: Bucket
    original_size: tuple[int, int]
    """(width, height) of the upright source image."""
    resized_size: tuple[int, int]
    """(width, height) after the resize: at least the bucket on both sides, aspect preserved,
    rounded up."""
    crop_left: int
    """Left edge of the crop in the resized image."""
    crop_top: int
    """Top edge of the crop in the resized image."""
    upscaled: bool
    """The resize enlarged the image on either side (data.upscale decides whether that is allowed)."""


def plan_crop(
    width: int, height: int, bucket: Bucket, crop: Literal["center", "random"], rng: random.Random | None,
) -> CropPlan:
    """Resize (width, height) to cover bucket and choose the crop. crop="random" needs rng (seed it
    for reproducible crops); crop="center" ignores it and, for an odd margin, leaves the extra
    pixel at the right or bottom."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    bucket_w, bucket_h = bucket
    # Integer arithmetic so that the binding side lands exactly on the bucket; the other side is
    # rounded up so that it still covers the bucket.
    if bucket_w * height >= bucket_h * width:
        resized = (bucket_w, max(bucket_h, -(-height * bucket_w // width)))
    else:
        resized = (max(bucket_w, -(-width * bucket_h // height)), bucket_h)
    spare_w, spare_h = resized[0] - bucket_w, resized[1] - bucket_h
    if crop == "center":
        left, top = spare_w // 2, spare_h // 2
    elif crop == "random":
        if rng is None:
            raise ValueError('crop="random" needs an rng (random.Random) so that crops are reproducible')
        left, top = rng.randint(0, spare_w), rng.randint(0, spare_h)
    else:
        raise ValueError(f'crop must be "center" or "random", got {crop!r}')
    return CropPlan(
        bucket=(bucket_w, bucket_h), original_size=(width, height), resized_size=resized,
        crop_left=left, crop_top=top, upscaled=resized[0] > width or resized[1] > height,
    )


def apply_crop(image: Image.Image, plan: CropPlan) -> Image.Image:
    """Resize image (LANCZOS) to plan.resized_size and crop it to plan.bucket; the result is
    exactly bucket-sized. The image is the original, or a reduced decode of it that still covers
    resized_size (JPEG draft mode / Image.reduce in images.load_rgb)."""
    (width, height), (ow, oh), (rw, rh) = image.size, plan.original_size, plan.resized_size
    if image.size != plan.original_size and not (min(rw, ow) <= width <= ow and min(rh, oh) <= height <= oh):
        raise ValueError(f"the plan is for a {plan.original_size} image (or a reduced decode covering "
                         f"{plan.resized_size}), got {image.size}")
    resized = image.resize(plan.resized_size, Image.Resampling.LANCZOS)
    width, height = plan.bucket
    return resized.crop((plan.crop_left, plan.crop_top, plan.crop_left + width, plan.crop_top + height))


def histogram(assignments: list[Bucket]) -> list[tuple[Bucket, int]]:
    """(bucket, images) pairs, most images first; equal counts in bucket order."""
    return sorted(Counter(assignments).items(), key=lambda item: (-item[1], item[0]))


def _aspect_label(bucket: Bucket) -> str:
    width, height = bucket
    return f"{width / height:.2f}:1" if width > height else f"1:{height / width:.2f}"


def format_histogram(hist: list[tuple[Bucket, int]], total: int, bar_width: int = 40) -> list[str]:
    """One line per bucket, e.g. "1024x1024  1:1.00   812 (64.9%) ##########": size, aspect
    (long side relative to the short one), images, share of total, and a bar of bar_width
    characters for 100%."""
    if not hist:
        return []
    sizes = [f"{w}x{h}" for (w, h), _ in hist]
    aspects = [_aspect_label(bucket) for bucket, _ in hist]
    size_width, aspect_width = max(map(len, sizes)), max(map(len, aspects))
    count_width = max(len(str(count)) for _, count in hist)
    lines = []
    for size, aspect, (_, count) in zip(sizes, aspects, hist):
        share = count / total if total else 0.0
        bar = "#" * max(1 if count else 0, round(share * bar_width))
        lines.append(
            f"{size:<{size_width}}  {aspect:<{aspect_width}}  {count:>{count_width}} ({share:6.1%}) {bar}".rstrip()
        )
    return lines
