"""zerotrain.data.images: every bad-image case ends in a verdict, every good one in honest pixels.

All images are generated in tmp_path. A PNG writer in this file produces the 16-bit RGB(A) PNGs that
Pillow cannot write itself.
"""

from __future__ import annotations

import os
import pickle
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from zerotrain.data import images
from zerotrain.data.images import ImageInfo, ImageRejected, load_rgb, probe

RED, GREEN, BLUE, WHITE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)


def px(img: Image.Image, x: int, y: int) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(img)[y, x])


def close(a, b, tol: int) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b, strict=True))


def write_png16(path: Path, arr: np.ndarray) -> Path:
    """A 16-bit PNG (gray, gray+alpha, RGB or RGBA by channel count) from a uint16 array (h, w[, c])."""
    arr = arr if arr.ndim == 3 else arr[..., None]
    h, w, c = arr.shape
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    rows = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return path


def rejected(path: Path, reason: str, **kwargs) -> ImageRejected:
    """load_rgb rejects with `reason` and returns no image; the message names the file."""
    with pytest.raises(ImageRejected) as info:
        load_rgb(path, **kwargs)
    assert info.value.reason == reason, str(info.value)
    assert str(path) in str(info.value)
    return info.value


def probe_rejected(path: Path, reason: str, min_size: int = 1, max_pixels: int = 10**9) -> None:
    with pytest.raises(ImageRejected) as info:
        probe(path, min_size, max_pixels)
    assert info.value.reason == reason, str(info.value)


# ---------------------------------------------------------------------------------------------------
# High bit depth


def test_16bit_gray_png_keeps_its_gradient(tmp_path):
    n = 64
    k = np.arange(n + 1)
    path = tmp_path / "g16.png"
    Image.fromarray(np.round(65535 * k / n).astype(np.uint16)[None, :].repeat(3, 0)).save(path)
    assert probe(path, 1, 10**6) == ImageInfo(width=n + 1, height=3, mode="I;16", format="PNG")
    out = load_rgb(path)
    assert out.mode == "RGB" and out.size == (n + 1, 3)
    got = np.asarray(out)[1]
    expected = np.round(255 * k / n)
    assert np.abs(got.astype(int) - expected[:, None]).max() <= 1
    assert (got[:, 0] == got[:, 1]).all() and (got[:, 0] == got[:, 2]).all()
    assert np.unique(got[:, 0]).size > 60  # the gradient survives; Pillow's convert("RGB") gives 0 and 255
    assert set(np.unique(np.asarray(Image.open(path).convert("RGB")))) <= {0, 255}


def test_16bit_gray_png_transparency_key_becomes_alpha(tmp_path):
    path = tmp_path / "g16t.png"
    Image.fromarray(np.array([[1000, 40000, 65535]], dtype=np.uint16)).save(path, transparency=40000)
    out = load_rgb(path, background=(10, 20, 30))
    assert px(out, 0, 0) == (4, 4, 4) and px(out, 1, 0) == (10, 20, 30) and px(out, 2, 0) == WHITE


@pytest.mark.parametrize("byteorder", ["I;16", "I;16B"])
def test_16bit_tiff_scaled_by_16_bit_range(tmp_path, byteorder):
    values = np.array([0, 257, 32896, 51400, 65535], dtype=np.uint16)
    img = Image.frombytes(byteorder, (5, 1), values.astype("<u2" if byteorder == "I;16" else ">u2").tobytes())
    path = tmp_path / "g16.tif"
    img.save(path)
    assert Image.open(path).mode == byteorder
    out = load_rgb(path)
    assert [px(out, x, 0)[0] for x in range(5)] == [0, 1, 128, 200, 255]


def test_16bit_pgm_in_mode_I(tmp_path):
    path = tmp_path / "g.pgm"  # Pillow opens 16-bit PGM as mode "I", scaled to 0-65535
    path.write_bytes(b"P5\n3 1\n65535\n" + np.array([0, 32896, 65535], ">u2").tobytes())
    assert probe(path, 1, 100).mode == "I"
    out = load_rgb(path)
    assert [px(out, x, 0) for x in range(3)] == [BLACK, (128, 128, 128), WHITE]


def test_16bit_rgb_png(tmp_path):
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 65536, (6, 7, 3), dtype=np.uint16)
    arr[0, 0] = (65535, 32896, 0)
    path = write_png16(tmp_path / "rgb16.png", arr)
    assert probe(path, 1, 100).width == 7
    out = load_rgb(path)
    got = np.asarray(out).astype(int)
    assert out.mode == "RGB" and px(out, 0, 0) == (255, 128, 0)
    assert np.abs(got - np.round(arr / 257)).max() <= 1


def test_16bit_rgba_and_gray_alpha_png_composited(tmp_path):
    rgba = np.zeros((1, 3, 4), np.uint16)
    rgba[0, 0] = (65535, 0, 0, 65535)  # opaque red
    rgba[0, 1] = (0, 65535, 0, 0)  # fully transparent green: must not show
    rgba[0, 2] = (0, 0, 65535, 32896)  # half blue
    out = load_rgb(write_png16(tmp_path / "rgba16.png", rgba), background=(200, 100, 0))
    assert px(out, 0, 0) == RED and px(out, 1, 0) == (200, 100, 0)
    assert close(px(out, 2, 0), (100, 50, 128), 1)

    la = np.array([[[65535, 65535], [0, 0], [32896, 65535]]], np.uint16)
    out = load_rgb(write_png16(tmp_path / "la16.png", la), background=(0, 0, 255))
    assert px(out, 0, 0) == WHITE and px(out, 1, 0) == BLUE and close(px(out, 2, 0), (128,) * 3, 1)


def test_float_tiff_unit_range_and_scaled_by_max(tmp_path):
    unit = np.linspace(0, 1, 11, dtype=np.float32)[None, :]
    path = tmp_path / "f.tif"
    Image.fromarray(unit).save(path)
    assert Image.open(path).mode == "F"
    got = np.asarray(load_rgb(path))[0, :, 0]
    assert got.tolist() == np.rint(unit[0] * 255).astype(int).tolist()

    hdr = np.array([[-1.0, 0.0, 2.0, 4.0]], dtype=np.float32)  # max 4: scaled by it; negatives clip
    Image.fromarray(hdr).save(path)
    assert np.asarray(load_rgb(path))[0, :, 0].tolist() == [0, 0, 128, 255]


def test_float_tiff_with_nan_is_corrupt(tmp_path):
    path = tmp_path / "nan.tif"
    Image.fromarray(np.array([[0.5, np.nan]], dtype=np.float32)).save(path)
    rejected(path, "corrupt")


# ---------------------------------------------------------------------------------------------------
# Orientation


def marked(size: tuple[int, int]) -> Image.Image:
    """Grey image with a red block at the top-left corner and a green one at the top-right."""
    img = Image.new("RGB", size, (128, 128, 128))
    img.paste(RED, (0, 0, 16, 16))
    img.paste(GREEN, (size[0] - 16, 0, size[0], 16))
    return img


# How a camera stores an upright picture under each EXIF orientation (EXIF 2.32, tag 0x0112):
# 6 means "rotate 90 degrees clockwise to view", so the stored pixels are the upright ones turned 90
# degrees counter-clockwise (PIL's ROTATE_90).
STORED_FROM_UPRIGHT = {
    1: None,
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def save_oriented(path: Path, stored: Image.Image, orientation: int, **kwargs) -> Path:
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, exif=exif, **kwargs)
    return path


@pytest.mark.parametrize("fmt", ["png", "jpg"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_comes_out_upright(tmp_path, orientation, fmt):
    upright = marked((64, 32))
    method = STORED_FROM_UPRIGHT[orientation]
    stored = upright if method is None else upright.transpose(method)
    path = save_oriented(tmp_path / f"o{orientation}.{fmt}", stored, orientation, quality=95)
    info = probe(path, 32, 10**6)
    assert (info.width, info.height) == (64, 32)
    out = load_rgb(path)
    assert out.size == (64, 32) and "exif" not in out.info
    tol = 0 if fmt == "png" else 40
    assert close(px(out, 4, 4), RED, tol) and close(px(out, 59, 4), GREEN, tol)
    assert close(px(out, 4, 27), (128, 128, 128), tol) and close(px(out, 59, 27), (128, 128, 128), tol)


def test_orientation_6_and_8_jpeg_by_hand(tmp_path):
    stored = Image.new("RGB", (64, 32), (128, 128, 128))
    stored.paste(RED, (0, 0, 16, 16))  # red at the stored top-left
    # 6: the viewer turns the picture 90 degrees clockwise, so stored top-left lands at top-right.
    out = load_rgb(save_oriented(tmp_path / "six.jpg", stored, 6, quality=95))
    assert out.size == (32, 64)
    assert close(px(out, 28, 4), RED, 40) and close(px(out, 4, 4), (128, 128, 128), 40)
    # 8: turned 90 degrees counter-clockwise, stored top-left lands at bottom-left.
    out = load_rgb(save_oriented(tmp_path / "eight.jpg", stored, 8, quality=95))
    assert out.size == (32, 64)
    assert close(px(out, 4, 60), RED, 40) and close(px(out, 4, 4), (128, 128, 128), 40)


# ---------------------------------------------------------------------------------------------------
# Alpha and colour modes


def test_rgba_composited_onto_background(tmp_path):
    arr = np.zeros((2, 3, 4), np.uint8)
    arr[:, 0] = (0, 255, 0, 0)  # transparent, green underneath: must not leak
    arr[:, 1] = (255, 0, 0, 128)  # half red
    arr[:, 2] = (0, 0, 255, 255)  # opaque blue
    path = tmp_path / "rgba.png"
    Image.fromarray(arr, "RGBA").save(path)
    bg = (10, 20, 30)
    out = load_rgb(path, background=bg)
    assert out.mode == "RGB"
    assert px(out, 0, 0) == bg and px(out, 2, 1) == BLUE
    expected = tuple(round((f * 128 + b * 127) / 255) for f, b in zip(RED, bg, strict=True))
    assert close(px(out, 1, 0), expected, 1)
    assert px(load_rgb(path), 0, 0) == WHITE  # the default background


def test_palette_with_transparency_index_png_and_gif(tmp_path):
    img = Image.new("P", (4, 1))
    img.putpalette([0, 255, 0, 255, 0, 0, 0, 0, 255] + [0] * 759)  # index 0 green, 1 red, 2 blue
    img.putdata([0, 1, 2, 0])
    for name in ("p.png", "p.gif"):
        path = tmp_path / name
        img.save(path, transparency=0)
        out = load_rgb(path, background=(7, 8, 9))
        assert [px(out, x, 0) for x in range(4)] == [(7, 8, 9), RED, BLUE, (7, 8, 9)], name


def test_palette_with_partial_alpha_table(tmp_path):
    img = Image.new("P", (3, 1))
    img.putpalette([255, 0, 0] * 3 + [0] * 759)
    img.putdata([0, 1, 2])
    path = tmp_path / "pa.png"
    img.save(path, transparency=bytes([0, 128, 255]))  # tRNS with one alpha per palette entry
    out = load_rgb(path, background=(0, 0, 0))
    assert px(out, 0, 0) == BLACK and close(px(out, 1, 0), (128, 0, 0), 1) and px(out, 2, 0) == RED


def test_gray_alpha_la(tmp_path):
    arr = np.array([[[200, 0], [200, 255], [200, 128]]], np.uint8)
    path = tmp_path / "la.png"
    Image.fromarray(arr, "LA").save(path)
    out = load_rgb(path, background=(0, 0, 255))
    assert px(out, 0, 0) == BLUE and px(out, 1, 0) == (200, 200, 200)
    assert close(px(out, 2, 0), (100, 100, 227), 1)


def test_gray_and_bilevel(tmp_path):
    Image.fromarray(np.array([[0, 77, 255]], np.uint8)).save(tmp_path / "l.png")
    out = load_rgb(tmp_path / "l.png")
    assert [px(out, x, 0) for x in range(3)] == [BLACK, (77, 77, 77), WHITE]
    Image.fromarray(np.array([[False, True]])).save(tmp_path / "b.png")
    assert Image.open(tmp_path / "b.png").mode == "1"
    out = load_rgb(tmp_path / "b.png")
    assert [px(out, x, 0) for x in range(2)] == [BLACK, WHITE]


def test_cmyk_jpeg_colours(tmp_path):
    img = Image.new("CMYK", (64, 16))
    for i, ink in enumerate([(0, 255, 255, 0), (255, 0, 255, 0), (0, 0, 0, 0), (0, 0, 0, 255)]):
        img.paste(ink, (16 * i, 0, 16 * i + 16, 16))
    path = tmp_path / "cmyk.jpg"
    img.save(path, quality=95)
    assert probe(path, 1, 10**6).mode == "CMYK"
    out = load_rgb(path)
    assert out.mode == "RGB"
    for i, rgb in enumerate([RED, GREEN, WHITE, BLACK]):
        assert close(px(out, 16 * i + 8, 8), rgb, 12), (i, px(out, 16 * i + 8, 8))


# ---------------------------------------------------------------------------------------------------
# Bad files


@pytest.fixture
def photo() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


@pytest.mark.parametrize("fmt", ["jpg", "png"])
@pytest.mark.parametrize("keep", [0.5, 0.95])
def test_truncated_jpeg_and_png(tmp_path, photo, fmt, keep):
    full = tmp_path / f"full.{fmt}"
    photo.save(full)
    data = full.read_bytes()
    path = tmp_path / f"cut.{fmt}"
    path.write_bytes(data[: int(len(data) * keep)])
    assert probe(path, 1, 10**6).width == 128  # the header is intact ...
    rejected(path, "truncated")  # ... the pixels are not


def test_truncated_header(tmp_path, photo):
    photo.save(tmp_path / "full.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "full.png").read_bytes()[:20])
    probe_rejected(tmp_path / "cut.png", "truncated")
    rejected(tmp_path / "cut.png", "truncated")


def test_truncated_even_if_another_library_enabled_load_truncated_images(tmp_path, photo, monkeypatch):
    photo.save(tmp_path / "full.jpg")
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "full.jpg").read_bytes()[:2000])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    monkeypatch.setattr(images, "_truncated_warned", False)
    with pytest.warns(RuntimeWarning, match="LOAD_TRUNCATED_IMAGES"):
        rejected(tmp_path / "cut.jpg", "truncated")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_corrupt_png_data(tmp_path, photo):
    photo.save(tmp_path / "ok.png")
    data = bytearray((tmp_path / "ok.png").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # damaged IDAT, file length and IEND intact
    (tmp_path / "bad.png").write_bytes(bytes(data))
    assert probe(tmp_path / "bad.png", 1, 10**6).height == 96
    rejected(tmp_path / "bad.png", "corrupt")


def test_random_bytes_named_png_is_not_an_image(tmp_path):
    path = tmp_path / "noise.png"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    probe_rejected(path, "not an image")
    rejected(path, "not an image")


def test_png_signature_then_random_bytes_is_corrupt(tmp_path):
    path = tmp_path / "fake.png"
    noise = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + noise + b"\x00\x00\x00\x00IEND\xaeB`\x82")
    probe_rejected(path, "corrupt")
    rejected(path, "corrupt")


def test_zero_byte_file(tmp_path):
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    probe_rejected(path, "empty file")
    rejected(path, "empty file")


def test_text_file_named_jpg(tmp_path):
    path = tmp_path / "caption.jpg"
    path.write_text("a photo of a cat sitting on a red sofa\n")
    probe_rejected(path, "not an image")
    rejected(path, "not an image")


def test_postscript_is_not_opened(tmp_path):
    path = tmp_path / "doc.jpg"  # Pillow's EPS plugin would run Ghostscript on this
    path.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n")
    probe_rejected(path, "not an image")


def test_too_small_uses_upright_shorter_side(tmp_path):
    Image.new("RGB", (100, 63), RED).save(tmp_path / "small.png")
    probe_rejected(tmp_path / "small.png", "too small", min_size=64)
    Image.new("RGB", (100, 64), RED).save(tmp_path / "ok.png")
    assert probe(tmp_path / "ok.png", 64, 10**6) == ImageInfo(100, 64, "RGB", "PNG")
    assert px(load_rgb(tmp_path / "ok.png"), 99, 63) == RED


def test_decompression_bomb_by_max_pixels(tmp_path):
    Image.new("RGB", (100, 100), RED).save(tmp_path / "big.png")
    with pytest.raises(ImageRejected) as info:
        probe(tmp_path / "big.png", 1, 9_999)
    assert info.value.reason == "decompression bomb" and "10,000 pixels" in str(info.value)
    assert probe(tmp_path / "big.png", 1, 10_000).width == 100
    assert px(load_rgb(tmp_path / "big.png"), 50, 50) == RED


def test_pillow_decompression_bomb_error_and_warning_are_verdicts(tmp_path, monkeypatch):
    Image.new("RGB", (100, 100), RED).save(tmp_path / "big.png")  # 10,000 pixels
    Image.new("RGB", (40, 40), RED).save(tmp_path / "mid.png")  # 1,600 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow errors above 2,000, warns above 1,000
    probe_rejected(tmp_path / "big.png", "decompression bomb")
    rejected(tmp_path / "big.png", "decompression bomb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's warning must neither escape nor crash
        assert probe(tmp_path / "mid.png", 1, 10**6).width == 40
        assert px(load_rgb(tmp_path / "mid.png"), 39, 39) == RED
        probe_rejected(tmp_path / "mid.png", "decompression bomb", max_pixels=1_599)


def test_unsupported_mode(tmp_path, monkeypatch):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    monkeypatch.setattr(images, "_SUPPORTED_MODES", frozenset({"L"}))
    probe_rejected(tmp_path / "x.png", "unsupported mode")
    rejected(tmp_path / "x.png", "unsupported mode")


def test_rejection_pickles_for_dataloader_workers(tmp_path):
    (tmp_path / "e.png").write_bytes(b"")
    with pytest.raises(ImageRejected) as info:
        load_rgb(tmp_path / "e.png")
    back = pickle.loads(pickle.dumps(info.value))
    assert (back.reason, back.path, str(back)) == ("empty file", tmp_path / "e.png", str(info.value))
    with pytest.raises(ValueError):
        ImageRejected("broken")


def test_no_file_left_open(tmp_path, photo):
    photo.save(tmp_path / "ok.jpg")
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "ok.jpg").read_bytes()[:3000])
    (tmp_path / "txt.jpg").write_text("hello")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(20):
        load_rgb(tmp_path / "ok.jpg", min_target=(32, 24))
        probe(tmp_path / "ok.jpg", 1, 10**6)
        for bad in ("cut.jpg", "txt.jpg"):
            with pytest.raises(ImageRejected):
                load_rgb(tmp_path / bad)
    if before is None:
        pytest.skip("no /proc/self/fd to count open files on this platform")
    assert len(os.listdir("/proc/self/fd")) == before


# ---------------------------------------------------------------------------------------------------
# Reduced decoding


@pytest.fixture(scope="module")
def huge_jpeg(tmp_path_factory) -> Path:
    img = Image.new("RGB", (12000, 8000), RED)
    img.paste(BLUE, (0, 0, 1200, 800))  # top-left tenth is blue
    path = tmp_path_factory.mktemp("huge") / "huge.jpg"
    img.save(path, quality=80)
    return path


def test_large_jpeg_uses_draft_and_never_decodes_full_size(huge_jpeg, monkeypatch):
    decoded_sizes = []
    real_load = ImageFile.ImageFile.load

    def spy(self):
        decoded_sizes.append(self.size)  # load() allocates exactly this buffer
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    info = probe(huge_jpeg, 64, 200_000_000)
    assert (info.width, info.height) == (12000, 8000)
    out = load_rgb(huge_jpeg, min_target=(1024, 683))
    assert set(decoded_sizes) == {(1500, 1000)}  # DCT-scaled by 1/8: 1.5 MP instead of 96 MP
    assert out.size == (1500, 1000) and out.width >= 1024 and out.height >= 683
    assert close(px(out, 20, 20), BLUE, 8) and close(px(out, 1400, 900), RED, 8)


def test_draft_target_follows_exif_orientation(tmp_path):
    stored = Image.new("RGB", (1600, 800), RED)
    stored.paste(BLUE, (0, 0, 200, 200))
    path = save_oriented(tmp_path / "rot.jpg", stored, 6, quality=90)
    out = load_rgb(path, min_target=(200, 400))  # upright target; stored target is 400x200
    assert out.size == (200, 400)
    assert close(px(out, 190, 10), BLUE, 12) and close(px(out, 10, 390), RED, 12)


def test_reduce_for_non_jpeg_and_no_upscale(tmp_path):
    img = Image.new("RGB", (400, 300), RED)
    img.paste(GREEN, (0, 0, 200, 300))
    img.save(tmp_path / "p.png")
    out = load_rgb(tmp_path / "p.png", min_target=(100, 70))
    assert out.size == (100, 75)  # factor 4 is the largest that keeps both sides >= target
    assert px(out, 10, 10) == GREEN and px(out, 90, 70) == RED
    assert load_rgb(tmp_path / "p.png", min_target=(1000, 1000)).size == (400, 300)
    assert load_rgb(tmp_path / "p.png", min_target=(201, 10)).size == (400, 300)


@pytest.mark.parametrize(
    ("fmt", "kwargs"), [("webp", {}), ("tiff", {"compression": "tiff_deflate"}), ("gif", {})]
)
def test_truncated_where_the_decoder_only_says_error(tmp_path, photo, fmt, kwargs):
    """libwebp, libtiff and the GIF reader give no "truncated" message; the file's own lengths tell."""
    full = tmp_path / f"full.{fmt}"
    photo.save(full, **kwargs)
    data = full.read_bytes()
    (tmp_path / f"cut.{fmt}").write_bytes(data[: len(data) // 2])
    rejected(tmp_path / f"cut.{fmt}", "truncated")
    assert load_rgb(full).size == (128, 96)
