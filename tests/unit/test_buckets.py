"""Aspect buckets: the shapes, the assignment, the resize-and-crop, and the histogram."""

import math
import random
from fractions import Fraction

import pytest
from PIL import Image

from zerotrain.config import ModelConfig
from zerotrain.data.buckets import (
    CropPlan,
    apply_crop,
    assign_bucket,
    bucket_step,
    format_histogram,
    histogram,
    make_buckets,
    plan_crop,
)
from zerotrain.families import of
from zerotrain.models.catalog import resolve_model

CASES = [(1024, 64, 2.0), (1024, 64, 4.0), (512, 16, 1.5), (1000, 64, 2.0), (768, 32, 3.0), (1024, 128, 1.0)]


@pytest.mark.parametrize(("resolution", "step", "max_ar"), CASES)
def test_buckets_follow_the_rule(resolution, step, max_ar):
    buckets = make_buckets(resolution, step, max_ar)
    area = resolution * resolution
    assert buckets == sorted(set(buckets))
    assert set(buckets) == {(h, w) for w, h in buckets}, "symmetric under transpose"
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= area
        assert max(w, h) <= max_ar * min(w, h) + 1e-9
        # As close to R^2 as the step allows: one more step on the height would exceed R^2, or,
        # for the transpose of such a bucket, one more step on the width would.
        assert w * (h + step) > area or (w + step) * h > area
        assert w * h > area - step * max(w, h)
    if resolution % step == 0:
        assert (resolution, resolution) in buckets


def test_known_buckets_at_1024():
    buckets = make_buckets(1024, 64, 2.0)
    assert buckets == [
        (704, 1408), (768, 1344), (832, 1216), (896, 1152), (960, 1088), (1024, 1024),
        (1088, 960), (1152, 896), (1216, 832), (1344, 768), (1408, 704),
    ]


def test_no_bucket_is_dominated():
    buckets = make_buckets(1024, 64, 8.0)
    for w, h in buckets:
        assert not any(bw == w and bh > h or bh == h and bw > w for bw, bh in buckets)
    assert max(h / w for w, h in buckets) <= 8.0
    assert max(h / w for w, h in buckets) > 6.0


def test_square_only_and_impossible():
    assert make_buckets(1024, 64, 1.0) == [(1024, 1024)]
    with pytest.raises(ValueError, match="step"):
        make_buckets(64, 128, 2.0)


@pytest.mark.parametrize(("config_step", "factor", "expected"), [(64, 16, 64), (8, 16, 16), (24, 16, 48), (64, 64, 64)])
def test_bucket_step_respects_pixel_factor(config_step, factor, expected):
    step = bucket_step(config_step, factor)
    assert step == expected
    assert step % factor == 0 and step % config_step == 0 and step >= factor


def test_bucket_step_with_catalog_pixel_factors():
    for name in ("flux-dev", "sdxl-base", "sd3.5-medium"):
        spec = resolve_model(ModelConfig(name_or_path=name))
        factor = of(spec).pixel_factor(spec)
        step = bucket_step(8, factor)
        assert step == factor
        assert all(w % factor == 0 and h % factor == 0 for w, h in make_buckets(1024, step, 2.0))


def test_assign_nearest_log_aspect():
    buckets = make_buckets(1024, 64, 2.0)
    assert assign_bucket(1024, 1024, buckets) == (1024, 1024)
    assert assign_bucket(3000, 3000, buckets) == (1024, 1024)
    assert assign_bucket(1216, 832, buckets) == (1216, 832)
    assert assign_bucket(100, 3000, buckets) == (704, 1408), "extreme portrait goes to the tallest"
    assert assign_bucket(3000, 100, buckets) == (1408, 704), "extreme landscape goes to the widest"
    for w, h in [(640, 480), (480, 640), (1920, 1080), (333, 777)]:
        best = min(abs(math.log(w / h) - math.log(bw / bh)) for bw, bh in buckets)
        bw, bh = assign_bucket(w, h, buckets)
        assert abs(math.log(w / h) - math.log(bw / bh)) == pytest.approx(best)


def test_assign_ties_go_to_larger_area():
    # 1:2 and 2:1 buckets of the same aspect distance from a square image: the larger wins.
    assert assign_bucket(100, 100, [(512, 1024), (1024, 512)]) == (1024, 512)
    assert assign_bucket(100, 100, [(64, 128), (1024, 512)]) == (1024, 512)
    assert assign_bucket(100, 100, [(512, 512), (1024, 1024)]) == (1024, 1024)


def test_center_crop_offsets_are_exact():
    plan = plan_crop(2000, 1000, (1024, 1024), "center", None)
    assert plan == CropPlan(
        bucket=(1024, 1024), original_size=(2000, 1000), resized_size=(2048, 1024),
        crop_left=512, crop_top=0, upscaled=True,
    )
    plan = plan_crop(3000, 4000, (832, 1216), "center", None)
    # Width binds: 832 / 3000 scale gives a height of 1109.3 < 1216, so the height binds instead.
    assert plan.resized_size == (912, 1216)
    assert (plan.crop_left, plan.crop_top) == (40, 0)
    assert not plan.upscaled
    odd = plan_crop(1025, 1024, (1024, 1024), "center", None)
    assert odd.resized_size == (1025, 1024) and odd.crop_left == 0 and not odd.upscaled


@pytest.mark.parametrize("size", [(20, 30), (100, 3000), (3000, 100), (4000, 3000), (1025, 333), (777, 1024)])
def test_resize_covers_the_bucket_and_keeps_aspect(size):
    w, h = size
    bucket = assign_bucket(w, h, make_buckets(1024, 64, 2.0))
    plan = plan_crop(w, h, bucket, "center", None)
    rw, rh = plan.resized_size
    assert rw >= bucket[0] and rh >= bucket[1]
    # One side lands exactly on the bucket; the other is the source side at the same scale,
    # rounded up to a whole pixel.
    if rw == bucket[0]:
        assert rh == math.ceil(Fraction(h * bucket[0], w))
    else:
        assert rh == bucket[1] and rw == math.ceil(Fraction(w * bucket[1], h))
    assert plan.upscaled == (rw > w or rh > h)


def test_tiny_image_is_upscaled():
    bucket = assign_bucket(20, 30, make_buckets(1024, 64, 2.0))
    assert bucket == (832, 1216)
    plan = plan_crop(20, 30, bucket, "center", None)
    assert plan.upscaled
    assert plan.resized_size == (832, 1248)
    assert (plan.crop_left, plan.crop_top) == (0, 16)


def test_random_crop_in_bounds_and_seeded():
    plans = [plan_crop(3000, 1000, (1024, 1024), "random", random.Random(seed)) for seed in range(50)]
    for plan in plans:
        assert plan.resized_size == (3072, 1024)
        assert 0 <= plan.crop_left <= 3072 - 1024 and plan.crop_top == 0
    assert len({p.crop_left for p in plans}) > 10
    again = [plan_crop(3000, 1000, (1024, 1024), "random", random.Random(seed)) for seed in range(50)]
    assert again == plans
    with pytest.raises(ValueError, match="rng"):
        plan_crop(3000, 1000, (1024, 1024), "random", None)
    with pytest.raises(ValueError, match="center"):
        plan_crop(3000, 1000, (1024, 1024), "middle", None)


def test_apply_crop_positions_content():
    # No resize: a 256x128 image into a 128x128 bucket, center crop from x=64.
    image = Image.new("RGB", (256, 128))
    image.putpixel((70, 10), (255, 0, 0))
    plan = plan_crop(256, 128, (128, 128), "center", None)
    out = apply_crop(image, plan)
    assert out.size == (128, 128)
    assert out.getpixel((6, 10)) == (255, 0, 0)
    assert out.getbbox() == (6, 10, 7, 11), "the marker is the only non-black pixel"

    # Downscaled by 2: an 8x8 white block at (140, 20) lands at (70, 10) in the resized image,
    # (6, 10) after the crop, 4x4 pixels.
    image = Image.new("L", (512, 256))
    image.paste(255, (140, 20, 148, 28))
    plan = plan_crop(512, 256, (128, 128), "center", None)
    assert plan.resized_size == (256, 128) and plan.crop_left == 64
    out = apply_crop(image, plan)
    assert out.size == (128, 128)
    assert out.getpixel((8, 12)) > 200
    assert out.getpixel((2, 12)) < 30 and out.getpixel((14, 12)) < 30


def test_apply_crop_is_exactly_bucket_sized():
    rng = random.Random(0)
    buckets = make_buckets(256, 16, 2.0)
    for w, h in [(20, 30), (100, 700), (701, 99), (257, 255), (64, 64)]:
        bucket = assign_bucket(w, h, buckets)
        plan = plan_crop(w, h, bucket, "random", rng)
        assert apply_crop(Image.new("RGB", (w, h)), plan).size == bucket
    with pytest.raises(ValueError, match="plan"):
        apply_crop(Image.new("RGB", (10, 10)), plan_crop(20, 30, (64, 64), "center", None))


def test_histogram_and_format():
    assignments = [(1024, 1024)] * 812 + [(832, 1216)] * 300 + [(1216, 832)] * 139 + [(704, 1408)] * 300
    hist = histogram(assignments)
    assert hist == [((1024, 1024), 812), ((704, 1408), 300), ((832, 1216), 300), ((1216, 832), 139)]
    lines = format_histogram(hist, total=len(assignments), bar_width=20)
    assert lines == [
        "1024x1024  1:1.00  812 ( 52.4%) ##########",
        "704x1408   1:2.00  300 ( 19.3%) ####",
        "832x1216   1:1.46  300 ( 19.3%) ####",
        "1216x832   1.46:1  139 (  9.0%) ##",
    ]
    assert format_histogram([((64, 64), 1)], total=10_000) == ["64x64  1:1.00  1 (  0.0%) #"]
    assert format_histogram([], total=0) == []
