"""Decoding image files into 8-bit RGB without lying about their pixels.

Trainers get this wrong in quiet ways (FIELD_NOTES item 10): Pillow's ``convert("RGB")`` clamps
16-bit images to near-white, EXIF rotation is ignored, transparent pixels become whatever colour the
encoder left under them, and truncated files either crash a run mid-epoch or load half grey.
Here every file ends in one of two ways: an upright 8-bit RGB image whose pixels are what the file
says, or an :class:`ImageRejected` with a short stable ``reason`` that the dataset report can count.

Two steps:

- :func:`probe` reads the header only (no pixel decode) and rejects files that are empty, not images,
  decompression bombs, too small, or in a pixel mode we cannot convert faithfully.
- :func:`load_rgb` decodes fully: EXIF orientation applied, alpha composited onto a background,
  CMYK/LAB/palette/16-bit/float converted by their real range, optionally at reduced size.

:func:`load_mask` decodes a loss mask (a mask file's gray level, or an image's alpha channel) by the
same rules, upright and at full size.

Conversion rules (``load_rgb``):

- 1, L, P, RGB, RGBX, CMYK, YCbCr, LAB, HSV: Pillow's conversion to RGB, which is exact for these.
- Alpha (RGBA, LA, PA, RGBa, and L/RGB/P with a ``transparency`` key or index): plain alpha-over onto
  ``background``: ``out = fg * a + bg * (1 - a)`` per channel, rounded (no premultiplication).
- I;16, I;16L, I;16B, I;16N (16-bit PNG and TIFF grayscale): ``round(x / 257)``, i.e. the full 16-bit
  range maps onto 0-255. A 16-bit ``transparency`` value becomes a binary alpha mask.
- I (32-bit integer; Pillow uses it for 16-bit PGM and older Pillows for 16-bit PNG): values that fit
  in 0-65535 are treated as 16-bit (``x / 257``); otherwise the float rule below.
- F (32-bit float TIFF): NaN or infinite pixels reject the file as "corrupt". Negative values clip to
  0. If the maximum is <= 1 the data is taken to be in [0, 1] (``x * 255``); otherwise it is scaled by
  its own maximum (``x / max * 255``), since a float file states no white point.
- 16-bit RGB/RGBA PNGs: Pillow (13) opens these as 8-bit "RGB"/"RGBA" itself, keeping the high byte of
  each sample (``x >> 8``, within 1 of ``round(x / 257)``), and 16-bit gray+alpha PNGs as "RGBA". That
  is a faithful reduction, so they need nothing more; Pillow reads 16-bit RGB TIFFs the same way.
- La (premultiplied gray+alpha) and anything else Pillow may add: rejected as "unsupported mode".

Known limits: ICC profiles are not applied (pixels are taken as sRGB). Corrupt entropy-coded data in
a JPEG is concealed by libjpeg rather than reported, so such a JPEG loads with damaged pixels; a PNG's
CRCs and zlib stream catch the same damage. Multi-frame files (GIF, APNG, MPO, multi-page TIFF) give
their first frame.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from PIL import ExifTags, Image, ImageFile, UnidentifiedImageError

REASONS = (
    "empty file",
    "not an image",
    "truncated",
    "corrupt",
    "too small",
    "decompression bomb",
    "unsupported mode",
    "missing file",
    "unreachable",
)


class ImageRejected(Exception):
    """An image file that cannot be used; .reason is a short stable code, str() is a sentence."""

    def __init__(self, reason: str, path: Path | str | None = None, detail: str | None = None) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown ImageRejected reason {reason!r}; expected one of {REASONS}")
        self.reason = reason
        self.path = Path(path) if isinstance(path, str) else path
        self.detail = detail or reason
        super().__init__(f"{self.path}: {self.detail}" if self.path is not None else self.detail)

    def __reduce__(self) -> tuple[type[ImageRejected], tuple[str, Any, str]]:
        # DataLoader workers pickle exceptions back to the main process; keep all three fields.
        return (type(self), (self.reason, self.path, self.detail))


@dataclass(frozen=True)
class ImageInfo:
    """What the header says; width and height are the upright size (EXIF orientation applied)."""

    width: int
    height: int
    mode: str
    format: str | None


# Raster formats we read. The allow-list keeps Pillow away from plugins that run external programs
# (EPS runs Ghostscript) or that identify files by a weak guess (TGA has no signature, so random
# bytes or a text file can "open" as one), which would turn garbage into pixels.
_FORMATS = ("JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "JPEG2000", "AVIF", "QOI")

# File signatures of those formats: a file that starts like one but will not open is "corrupt" or
# "truncated"; one that starts like none of them is "not an image".
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"WEBP", 8, "WEBP"),
    (b"BM", 0, "BMP"),
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"II+\x00", 0, "TIFF"),
    (b"MM\x00+", 0, "TIFF"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", 0, "JPEG2000"),
    (b"\xff\x4f\xff\x51", 0, "JPEG2000"),
    (b"ftypavi", 4, "AVIF"),
    (b"qoif", 0, "QOI"),
) + tuple((b"P" + bytes([c]), 0, "PPM") for c in b"123456f")

# Modes whose conversion to 8-bit RGB is exact (see the module docstring).
_SUPPORTED_MODES = frozenset(
    {"1", "L", "P", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "LA", "PA", "RGBa"}
    | {"I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
)
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa"})

# ImageOps.exif_transpose's table: EXIF orientation -> the transpose that makes the image upright.
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = frozenset({5, 6, 7, 8})

_truncated_warned = False


def probe(path: Path, min_size: int, max_pixels: int) -> ImageInfo:
    """Read the header only and return the upright size, mode and format, or raise ImageRejected.

    Rejects: "empty file", "not an image", "truncated"/"corrupt" (a known signature whose header will
    not parse), "decompression bomb" (more than ``max_pixels`` pixels, or over Pillow's own hard
    limit ``2 * Image.MAX_IMAGE_PIXELS``), "too small" (shorter upright side below ``min_size``),
    "unsupported mode". Pillow's DecompressionBombWarning is silenced: ``max_pixels`` is the policy.
    """
    path = Path(path) if isinstance(path, str) else path
    with _open(path) as im:
        w, h = im.size
        if w * h > max_pixels:
            raise ImageRejected(
                "decompression bomb",
                path,
                f"{w}x{h} is {w * h:,} pixels, more than data.max_image_pixels ({max_pixels:,}); "
                "it could be a decompression bomb",
            )
        _check_mode(im, path)
        if _orientation(im, header_only=True) in _SWAPS_SIDES:
            w, h = h, w
        if min(w, h) < min_size:
            raise ImageRejected(
                "too small",
                path,
                f"{w}x{h} has a shorter side below data.min_image_size ({min_size} pixels)",
            )
        return ImageInfo(width=w, height=h, mode=im.mode, format=im.format)


def load_rgb(
    path: Path,
    background: tuple[int, int, int] = (255, 255, 255),
    min_target: tuple[int, int] | None = None,
) -> Image.Image:
    """Decode fully into an upright 8-bit RGB image, or raise ImageRejected.

    ``min_target`` is an upright (width, height): the image is then decoded at the smallest size that
    still covers it on both sides, using JPEG DCT scaling (``draft``: 1/2, 1/4, 1/8, so the full-size
    buffer is never allocated) and then ``Image.reduce`` by an integer factor (box filter). An image
    already smaller than the target is returned at full size, never upscaled. Aspect ratio can shift
    by under one pixel per side from rounding up.
    """
    path = Path(path) if isinstance(path, str) else path
    with _open(path) as im:
        _check_mode(im, path)
        target = None
        if min_target is not None:
            tw, th = (max(1, int(side)) for side in min_target)
            if im.format in ("JPEG", "MPO"):  # EXIF is in the header: orientation known before decode
                if _orientation(im, header_only=True) in _SWAPS_SIDES:
                    tw, th = th, tw
                im.draft("RGB", (tw, th))  # DCT scaling: decodes at 1/2, 1/4 or 1/8, still >= target
            target = (tw, th)
        _decode(im, path)
        orientation = _orientation(im, header_only=False)
        if target is not None and orientation in _SWAPS_SIDES and im.format not in ("JPEG", "MPO"):
            target = (target[1], target[0])  # target in stored orientation, as the pixels are
        out = _to_rgb(im, background, path)
    if target is not None:
        factor = min(out.width // target[0], out.height // target[1])
        if factor >= 2:
            out = out.reduce(factor)
    method = _TRANSPOSE.get(orientation)
    if method is not None:
        out = out.transpose(method)
    out.info.pop("exif", None)  # orientation is applied; a stale tag would rotate it twice downstream
    return out


def load_mask(path: Path, *, alpha: bool = False) -> Image.Image | None:
    """An upright 8-bit grayscale ("L") loss mask at the file's full size, or raise ImageRejected.

    A mask file gives its gray level (a colour mask its luminance, transparent pixels black): 255
    trains fully, 0 not at all. With ``alpha`` the file is the training image itself and its alpha
    channel is the mask; None when it has none (every pixel opaque).
    """
    path = Path(path) if isinstance(path, str) else path
    with _open(path) as im:
        _check_mode(im, path)
        _decode(im, path)
        orientation = _orientation(im, header_only=False)
        if alpha:
            out = _split_alpha(im, path)[1]
        else:
            out = _to_rgb(im, (0, 0, 0), path).convert("L")
    if out is None:
        return None
    method = _TRANSPOSE.get(orientation)
    return out if method is None else out.transpose(method)


# --------------------------------------------------------------------------------------------------
# Opening and decoding with verdicts


def _refuse_truncated() -> None:
    """Another library may have set ImageFile.LOAD_TRUNCATED_IMAGES, which makes Pillow fill a cut
    file with grey instead of failing. Turn it back off (once, with a warning): we never train on that.
    """
    global _truncated_warned
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        if not _truncated_warned:
            _truncated_warned = True
            warnings.warn(
                "PIL.ImageFile.LOAD_TRUNCATED_IMAGES was enabled by another module; zerotrain turned it "
                "off so that truncated images are rejected instead of decoded with missing pixels",
                RuntimeWarning,
                stacklevel=3,
            )


@contextmanager
def _open(path: Path) -> Iterator[ImageFile.ImageFile]:
    """Open ``path`` for Pillow (header only), closing the file on exit, turning failures into verdicts."""
    _refuse_truncated()
    with _binary(path) as fp:
        prefix = fp.read(16)
        if not prefix:
            raise ImageRejected("empty file", path, "the file is empty (0 bytes)")
        fp.seek(0)
        try:
            with _quiet_pillow():
                im = Image.open(fp, formats=_formats())
        except UnidentifiedImageError:
            raise _unidentified(path, fp, prefix) from None
        except Exception as exc:
            if isinstance(exc, MemoryError):
                raise
            raise _verdict(path, exc) from exc
        with im:
            yield im


@contextmanager
def _binary(path: Any) -> Iterator[IO[bytes]]:
    """A file's bytes, or a packed image's (a tar member, a table row, a URL: data.sources.Packed), read whole;
    what cannot be read at all is a verdict: missing, unreachable (a URL's timeout), truncated (a cut shard)."""
    if isinstance(path, (str, Path)):
        with open(path, "rb") as fp:
            yield fp
        return
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise ImageRejected("missing file", path, f"not found ({err})") from None
    except EOFError as err:
        raise ImageRejected("truncated", path, f"the shard is truncated ({err})") from None
    except (OSError, TimeoutError) as err:
        raise ImageRejected("unreachable", path, f"cannot be read ({type(err).__name__}: {err})") from None
    yield io.BytesIO(data)


def _decode(im: ImageFile.ImageFile, path: Path) -> None:
    try:
        with _quiet_pillow():
            im.load()
    except Exception as exc:
        if isinstance(exc, MemoryError):
            raise
        raise _verdict(path, exc, im) from exc


@contextmanager
def _quiet_pillow() -> Iterator[None]:
    """Pillow warns about bombs (``max_pixels`` is our policy) and damaged metadata it skips past (a
    verdict, if any, comes from the exception). Thousands of such lines would bury a training log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        yield


def _formats() -> tuple[str, ...]:
    Image.init()
    return tuple(f for f in _FORMATS if f in Image.OPEN)


def _sniff(prefix: bytes) -> str | None:
    for magic, offset, fmt in _MAGIC:
        if prefix[offset : offset + len(magic)] == magic:
            return fmt
    return None


def _unidentified(path: Path, fp: IO[bytes], prefix: bytes) -> ImageRejected:
    """Pillow could not identify the file: say whether it is no image at all, or a damaged one."""
    fmt = _sniff(prefix)
    if fmt is None or fmt not in Image.OPEN:
        return ImageRejected(
            "not an image",
            path,
            "not an image file: it does not start like a " + ", ".join(_formats()) + " file",
        )
    # It starts like `fmt` but Pillow's opener failed. Run that opener alone to learn why.
    factory = Image.OPEN[fmt][0]
    fp.seek(0)
    try:
        with _quiet_pillow():
            factory(fp, str(path)).close()
    except Exception as exc:
        if isinstance(exc, MemoryError):
            raise
        verdict = _verdict(path, exc)
        return ImageRejected(verdict.reason, path, f"{fmt} header cannot be read: {verdict.detail}")
    return ImageRejected("corrupt", path, f"starts like a {fmt} file but Pillow cannot open it")


_TRUNCATED = re.compile(
    r"truncat|end of file|\bEOF\b|premature|unexpected end|not enough|requires a buffer|chunk b''\)",
    re.IGNORECASE,
)
_BAD_MODE = re.compile(
    r"(unknown|unsupported|not supported).*mode|mode.*(unknown|unsupported)", re.IGNORECASE
)


def _verdict(path: Path, exc: BaseException, im: Image.Image | None = None) -> ImageRejected:
    """Classify an exception raised by Pillow while opening or decoding."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, Image.DecompressionBombError):
        return ImageRejected(
            "decompression bomb",
            path,
            f"rejected by Pillow's decompression bomb check ({text}); raise PIL.Image.MAX_IMAGE_PIXELS "
            "if such images are intended",
        )
    if isinstance(exc, (EOFError, struct.error)) or _TRUNCATED.search(text):
        return ImageRejected("truncated", path, f"the file is truncated ({text})")
    if _BAD_MODE.search(text):
        return ImageRejected("unsupported mode", path, f"the pixel format is not supported ({text})")
    if _shorter_than_declared(path, im):
        return ImageRejected("truncated", path, f"the file is shorter than its header declares ({text})")
    return ImageRejected("corrupt", path, f"the image data is corrupt ({type(exc).__name__}: {text})")


def _shorter_than_declared(path: Path, im: Image.Image | None) -> bool:
    """Evidence of truncation where the decoder only says "error": a missing end marker (JPEG EOI, PNG
    IEND, GIF trailer) or a declared length past the end of the file (WebP RIFF size, BMP file size,
    TIFF first IFD and its entries, strip and tile extents).
    Only consulted after a failure, so a header that lies about its length cannot reject a good file.
    """
    try:
        with _binary(path) as fp:
            size = fp.seek(0, 2)
            fp.seek(0)
            head = fp.read(16)
            fp.seek(max(0, size - 64))
            tail = fp.read().rstrip(b"\x00")  # some writers pad after the end marker
            if head[:3] == b"\xff\xd8\xff":
                return not tail.endswith(b"\xff\xd9")  # EOI
            if head[:8] == b"\x89PNG\r\n\x1a\n":
                return not tail.endswith(b"IEND\xaeB`\x82")
            if head[:4] == b"GIF8":
                return not tail.endswith(b";")  # trailer
            if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
                return int.from_bytes(head[4:8], "little") + 8 > size
            if head[:2] == b"BM":
                return int.from_bytes(head[2:6], "little") > size
            if head[:4] in (b"II*\x00", b"MM\x00*"):  # classic TIFF: 2-byte count, 12-byte entries
                order = "little" if head[:2] == b"II" else "big"
                ifd, count_size, entry_size = int.from_bytes(head[4:8], order), 2, 12
            elif head[:4] in (b"II+\x00", b"MM\x00+"):  # BigTIFF: 8-byte count, 20-byte entries
                order = "little" if head[:2] == b"II" else "big"
                ifd, count_size, entry_size = int.from_bytes(head[8:16], order), 8, 20
            else:
                ifd = None
            if ifd is not None:
                if ifd + count_size > size:
                    return True
                fp.seek(ifd)
                entries = int.from_bytes(fp.read(count_size), order)
                if ifd + count_size + entries * entry_size > size:
                    return True
        tags = getattr(im, "tag_v2", None)
        if tags is not None:
            for offsets_tag, counts_tag in ((273, 279), (324, 325)):  # strips, tiles
                offsets, counts = tags.get(offsets_tag), tags.get(counts_tag)
                if offsets is not None and counts is not None:
                    offsets = offsets if isinstance(offsets, tuple) else (offsets,)
                    counts = counts if isinstance(counts, tuple) else (counts,)
                    if any(o + c > size for o, c in zip(offsets, counts)):
                        return True
    except (OSError, TypeError, ValueError, ImageRejected):
        return False
    return False


def _check_mode(im: Image.Image, path: Path) -> None:
    if im.mode not in _SUPPORTED_MODES:
        raise ImageRejected(
            "unsupported mode",
            path,
            f"pixel mode {im.mode!r} cannot be converted to RGB faithfully",
        )


def _orientation(im: ImageFile.ImageFile, *, header_only: bool) -> int:
    """EXIF (or XMP) orientation 1-8; 1 when absent or unreadable.

    With ``header_only`` this never decodes pixels: for PNG that means an eXIf chunk placed after the
    image data is not seen (Pillow would decode the whole image to reach it).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if header_only and im.format == "PNG" and "exif" not in im.info:
                exif = Image.Image.getexif(im)
            else:
                exif = im.getexif()
            value = exif.get(ExifTags.Base.Orientation, 1)
    except (OSError, SyntaxError, ValueError, TypeError, KeyError, IndexError, struct.error):
        # broken EXIF is no reason to drop the pixels; take them as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


# --------------------------------------------------------------------------------------------------
# Pixel conversion


def _to_rgb(im: Image.Image, background: tuple[int, int, int], path: Path) -> Image.Image:
    """Convert a loaded image of any supported mode to a new 8-bit RGB image (alpha composited)."""
    rgb, alpha = _split_alpha(im, path)
    return _composite(rgb, alpha, background) if alpha is not None else rgb


def _split_alpha(im: Image.Image, path: Path) -> tuple[Image.Image, Image.Image | None]:
    """A loaded image of any supported mode as a new 8-bit RGB image and its 8-bit alpha channel, None
    where every pixel is opaque."""
    mode = im.mode
    if mode in ("I", "F") or mode.startswith("I;16"):
        gray, alpha = _high_range_gray(im, path)
        return gray.convert("RGB"), alpha
    if mode in _ALPHA_MODES or mode == "P" or "transparency" in im.info:
        rgba = im.convert("RGBA")  # applies palette alpha and transparency keys / indices
        alpha = rgba.getchannel("A")
        return rgba.convert("RGB"), None if alpha.getextrema() == (255, 255) else alpha
    return im.convert("RGB"), None  # always a new image, detached from the file


def _composite(rgb: Image.Image, alpha: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    out = Image.new("RGB", rgb.size, tuple(int(c) for c in background))
    out.paste(rgb, (0, 0), alpha)  # out = rgb * a/255 + background * (1 - a/255), rounded
    return out


def _high_range_gray(im: Image.Image, path: Path) -> tuple[Image.Image, Image.Image | None]:
    """16-bit, 32-bit integer or float grayscale -> 8-bit L by the range rules, plus a key-colour alpha."""
    arr = np.asarray(im)
    alpha = None
    key = im.info.get("transparency")
    if isinstance(key, int) and im.mode != "F":
        alpha = Image.fromarray(np.where(arr == key, 0, 255).astype(np.uint8))
    if im.mode != "F" and arr.size and (arr.min() < 0 or arr.max() > 65535):
        arr = arr.astype(np.float32)  # 32-bit integers outside 16 bits: the float rule
    if arr.dtype.kind in "ui":
        scaled = (arr.astype(np.uint32) * 255 + 32767) // 65535  # round(x / 257), exact in integers
        return Image.fromarray(scaled.astype(np.uint8)), alpha
    arr = arr.astype(np.float32, copy=False)
    if arr.size and not np.isfinite(arr).all():
        raise ImageRejected("corrupt", path, "the float image has NaN or infinite pixel values")
    arr = np.clip(arr, 0.0, None)
    peak = float(arr.max()) if arr.size else 0.0
    scale = 255.0 if peak <= 1.0 else 255.0 / peak
    return Image.fromarray(np.rint(arr * scale).astype(np.uint8)), alpha
