"""Finding the training images: folders of images with sidecar captions (the kohya/SimpleTuner
convention) and JSONL manifests, several datasets with repeat counts, and a verdict with a
reason for every file that cannot be used."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zerotrain.config.sections import DataConfig, DatasetConfig
from zerotrain.data import sources
from zerotrain.data.images import ImageInfo, ImageRejected, probe
from zerotrain.data.sources import IMAGE_EXTENSIONS, Locator
from zerotrain.errors import ZerotrainError

# photo.mask.png is the loss mask of photo.jpg (data.mask=file).
MASK_SUFFIX = ".mask"
# Rejections listed by path in a summary; the rest are counted.
SHOWN_PATHS = 3


@dataclass(frozen=True)
class Item:
    """One usable image: where it is, its caption, its upright size, its dataset."""

    image: Locator
    """Its file, or where it is packed (a tar member, a table row, a URL: data.sources.Packed)."""
    caption: str
    width: int
    height: int
    dataset: int
    repeats: int
    captions: tuple[str, ...] = ()
    """Every text a sample of this image may train with (caption_variants); (caption,) when empty."""
    caption_dropout: float = 0.0
    """The share of its samples trained with the empty caption."""
    loss_weight: float = 1.0
    """Its dataset's weight in the loss."""
    mask: Locator | None = None
    """Its loss mask: a mask file, or the image itself where its alpha channel is the mask
    (data.mask=alpha); None to train unmasked."""
    controls: tuple[Path, ...] = ()
    """Edit training: its control (reference) images, in reference order."""
    control_sizes: tuple[tuple[int, int], ...] = ()
    """Each control's upright (width, height)."""
    identity: tuple = ()
    """Its file's identity when it was read (sources.identity: path, size, mtime; a packed image's source, key and
    content identity); () where not known."""

    @property
    def mask_alpha(self) -> bool:
        return self.mask is not None and self.mask == self.image

    @property
    def texts(self) -> tuple[str, ...]:
        return self.captions or (self.caption,)


@dataclass(frozen=True)
class Verdict:
    """A file that was not used as given, and why."""

    path: Locator
    reason: str
    rejected: bool = True
    """False for notes (e.g. a missing caption replaced by the policy)."""


def epoch_samples(items: list[Item], shares: dict[int, float], seed: int = 0) -> list[int]:
    """Item index of every sample of an epoch (sample_rows over the items' datasets and repeats)."""
    return sample_rows(np.array([item.dataset for item in items], dtype=np.int64),
                       np.array([item.repeats for item in items], dtype=np.int64), shares, seed).tolist()


def sample_rows(datasets: np.ndarray, repeats: np.ndarray, shares: dict[int, float], seed: int = 0) -> np.ndarray:
    """Row of every sample of an epoch, sorted, for rows of these datasets and repeat counts. A row of a dataset
    without a share repeats by its count. A dataset with a share s gets round(s x N) samples, N being what makes
    the datasets without a share the rest (1 - the shares) of the epoch, or, where every dataset has a share, one
    sample per image: its images repeat as often as that allows, and a seeded subset of them takes one more
    sample."""
    datasets, repeats = np.asarray(datasets), np.asarray(repeats)
    present = sorted(set(np.unique(datasets).tolist()))
    shared = [d for d in present if d in shares]
    free_rows = np.flatnonzero(~np.isin(datasets, shared)) if shared else np.arange(len(datasets))
    free = np.repeat(free_rows, repeats[free_rows])
    rest = 1.0 - sum(shares[d] for d in shared)
    total = len(free) / rest if len(free) and rest > 1e-9 else len(datasets)
    parts = [free]
    for d in shared:
        indices = np.flatnonzero(datasets == d)
        count = max(1, round(shares[d] * total))
        order = indices.tolist()
        random.Random(f"{seed}-{d}").shuffle(order)
        parts += [np.tile(indices, count // len(indices)), np.array(order[:count % len(indices)], dtype=np.int64)]
    return np.sort(np.concatenate(parts).astype(np.int64))


def folder_repeat_lines(repeat_folders: dict[int, dict[str, int]]) -> list[str]:
    """The summary's line for each dataset read as kohya's repeat folders."""
    lines = []
    for index, folders in sorted(repeat_folders.items()):
        named = ", ".join(f"{name} x{n}" for name, n in sorted(folders.items()))
        lines.append(f"data.datasets[{index}]: kohya repeat folders, each image counted N times: {named} "
                     f"(data.datasets[{index}].folder_repeats: false reads them as plain folders)")
    return lines


@dataclass
class Discovery:
    items: list[Item] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    shares: dict[int, float] = field(default_factory=dict)
    """Dataset index -> its share of each epoch, for the datasets that set one."""
    repeat_folders: dict[int, dict[str, int]] = field(default_factory=dict)
    """Dataset index -> its kohya repeat folders (folder_repeats) that hold images, by name: their N."""
    depends: dict[int, list[str]] = field(default_factory=dict)
    """Dataset index -> the local files its manifest names (images, masks, controls), found or not."""

    @property
    def rejected(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.rejected]

    def samples(self, seed: int = 0) -> list[int]:
        """Item index per sample of an epoch (epoch_samples)."""
        return epoch_samples(self.items, self.shares, seed)

    def summary(self) -> list[str]:
        """Counts by reason with the first few paths, for the person running the job."""
        lines = [f"{len(self.items)} images, {len(self.samples())} samples per epoch with repeats",
                 *folder_repeat_lines(self.repeat_folders)]
        for rejected, label in ((True, "rejected"), (False, "note")):
            by_reason = Counter(v.reason for v in self.verdicts if v.rejected == rejected)
            for reason, count in by_reason.most_common():
                paths = [str(v.path) for v in self.verdicts if v.reason == reason][:SHOWN_PATHS]
                more = f" (+{count - len(paths)} more)" if count > len(paths) else ""
                lines.append(f"{label}: {reason}: {count}: {', '.join(paths)}{more}")
        return lines


def read_caption(path: Path) -> str:
    """A caption file's text, stripped; raises UnicodeDecodeError for text that is not UTF-8."""
    return path.read_bytes().decode("utf-8").strip()


def shuffled_tags(caption: str, orders: int, keep: int) -> list[str]:
    """The caption's comma-separated tags in `orders` shuffled orders (the first `keep` in place),
    drawn from a generator seeded by the caption itself, so that the same caption always gives the
    same orders and the cache stays valid; fewer when there are fewer distinct orders."""
    tags = [tag.strip() for tag in caption.split(",") if tag.strip()]
    fixed, rest = tags[:keep], tags[keep:]
    if orders == 0 or len(rest) < 2:
        return [caption]
    rng = random.Random(hashlib.sha256(caption.encode()).hexdigest())
    out = []
    for _ in range(orders):
        rng.shuffle(rest)
        out.append(", ".join(fixed + rest))
    return list(dict.fromkeys(out))


def caption_variants(texts: list[str], dataset: DatasetConfig) -> tuple[str, ...]:
    """Every text the cache encodes for one image: each of its captions, in each of its tag orders
    (shuffle_tags), after the dataset's caption_prefix; duplicates once, in order."""
    out = [dataset.caption_prefix + variant for text in texts
           for variant in shuffled_tags(text, dataset.shuffle_tags, dataset.keep_tags)]
    return tuple(dict.fromkeys(out))


def _caption_texts(text: str, dataset: DatasetConfig) -> list[str]:
    if not dataset.caption_per_line:
        return [text]
    return [line.strip() for line in text.splitlines() if line.strip()] or [""]


@dataclass(frozen=True)
class Entry:
    """An image as its dataset lists it, before it is checked."""

    image: Locator
    texts: list[str] | None
    """Its captions; None when it has none."""
    mask: Locator | None = None
    """Its mask file; None when it has none."""
    controls: tuple[Path, ...] = ()
    """Its control images, in reference order."""
    missing: str = ""
    """Why a control it should have is missing (a folder dataset whose control folder lacks it)."""


# musubi-tuner's manifest keys for control images: control_path_0, control_path_1, ...
_MUSUBI_CONTROL = re.compile(r"^control_path_(\d+)$")
# kohya's repeat folder: <N>_<name>, directly in the dataset's folder.
_KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")


def folder_repeat(root: Path, image: Path) -> tuple[str, int] | None:
    """The kohya repeat folder (its name and N) an image of the folder dataset at `root` is in: its first-level
    folder, when named <N>_<name>."""
    parts = image.relative_to(root).parts
    found = _KOHYA_FOLDER.match(parts[0]) if len(parts) > 1 else None
    return (parts[0], int(found.group(1))) if found else None


def _folder_entries(dataset: DatasetConfig, discovery: Discovery) -> list[Entry]:
    """An entry per image of a folder; notes stray captions and masks. photo.mask.png is the mask
    of photo.jpg (any image extensions), not an image of its own."""
    files = sorted(p for p in dataset.path.rglob("*") if p.is_file() and not p.name.startswith("."))
    pictures = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    images = [p for p in pictures if p.with_suffix("").suffix != MASK_SUFFIX]
    stems = {p.with_suffix("") for p in images}
    masks: dict[Path, Path] = {}
    for p in pictures:
        stem = p.with_suffix("")
        if stem.suffix == MASK_SUFFIX:
            if stem.with_suffix("") in stems:
                masks[stem.with_suffix("")] = p
            else:
                discovery.verdicts.append(Verdict(p, "mask without image", rejected=False))
    entries = []
    for caption_file in (p for p in files if p.suffix == dataset.caption_extension):
        if caption_file.with_suffix("") not in stems:
            discovery.verdicts.append(Verdict(caption_file, "caption without image", rejected=False))
    control_stems = [_image_stems(folder) for folder in dataset.controls]
    for image in images:
        caption_file = image.with_suffix(dataset.caption_extension)
        mask = masks.get(image.with_suffix(""))
        stem = image.relative_to(dataset.path).with_suffix("")
        found = [by_stem.get(stem) for by_stem in control_stems]
        missing = next((f"control missing: no {folder / stem}.* in control folder {folder}"
                        for folder, path in zip(dataset.controls, found, strict=True) if path is None), "")
        controls = tuple(path for path in found if path is not None)
        if not caption_file.is_file():
            entries.append(Entry(image, None, mask, controls, missing))
            continue
        try:
            entries.append(Entry(image, _caption_texts(read_caption(caption_file), dataset), mask, controls, missing))
        except UnicodeDecodeError:
            discovery.verdicts.append(Verdict(image, f"caption not UTF-8 ({caption_file.name})"))
    return entries


def _image_stems(folder: Path) -> dict[Path, Path]:
    """A control folder's images by their path without extension, relative to the folder."""
    return {p.relative_to(folder).with_suffix(""): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")}


def _manifest_entries(dataset: DatasetConfig, discovery: Discovery) -> list[Entry]:
    root = dataset.path.parent
    entries = []
    for number, line in enumerate(dataset.path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            image, caption, mask = record["image"], record.get("caption"), record.get("mask")
            captions = [caption] if isinstance(caption, str) else caption
            controls = _manifest_controls(record)
            if not isinstance(image, str) or not isinstance(mask, (str, type(None))) or not (captions is None or (
                    isinstance(captions, list) and captions and all(isinstance(c, str) for c in captions))):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            discovery.verdicts.append(Verdict(dataset.path, f"manifest line {number} is not "
                                              '{"image": path, "caption": text or [texts], "mask": path, '
                                              '"control": path or [paths]}'))
            continue
        texts = None if captions is None else [t for c in captions for t in _caption_texts(c.strip(), dataset)]
        entries.append(Entry(root / image, texts, None if mask is None else root / mask,
                             tuple(root / c for c in controls)))
    return entries


def manifest_control_count(path: Path) -> int:
    """The most control images a line of this manifest names (lines that do not parse count 0)."""
    most = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            most = max(most, len(_manifest_controls(json.loads(line))))
        except (json.JSONDecodeError, TypeError, AttributeError):
            continue
    return most


def _manifest_controls(record: dict) -> list[str]:
    """A manifest line's control images: "control" (a path or a list of paths), or musubi-tuner's
    "control_path_0".."control_path_N" in index order. TypeError when they are not paths."""
    control = record.get("control")
    numbered = sorted((int(m.group(1)), value) for key, value in record.items() if (m := _MUSUBI_CONTROL.match(key)))
    if control is not None and numbered:
        raise TypeError("both control and control_path_N")
    controls = [value for _, value in numbered] if numbered else [control] if isinstance(control, str) else control or []
    if not isinstance(controls, list) or not all(isinstance(c, str) for c in controls):
        raise TypeError("controls are not paths")
    return controls


def dataset_kind(dataset: DatasetConfig) -> sources.Kind:
    """How a dataset is laid out: its format, or what its path's form says (sources.detect)."""
    return sources.detect(dataset.path) if dataset.format == "auto" else dataset.format


def listed(data: DataConfig) -> list[tuple[int, list[Entry]]]:
    """Every dataset's entries as it lists them, without reading an image (its captions are read): what the plan
    estimates the cache from before the first build."""
    discovery = Discovery()
    return [(index, _entries(dataset, index, discovery)) for index, dataset in enumerate(data.datasets)]


def _entries(dataset: DatasetConfig, index: int, discovery: Discovery) -> list[Entry]:
    """A dataset's entries, by its kind; a source that cannot be read at all is one line (ZerotrainError)."""
    kind = dataset_kind(dataset)
    local = isinstance(dataset.path, Path)
    if kind == "folder" and local and dataset.path.is_dir():
        return _folder_entries(dataset, discovery)
    if kind == "jsonl" and local and dataset.path.is_file():
        return _manifest_entries(dataset, discovery)
    if kind in ("table", "webdataset"):
        listing = (sources.table_entries if kind == "table" else sources.tar_entries)(dataset, index)
        discovery.verdicts += [Verdict(where, reason, rejected) for where, reason, rejected in listing.problems]
        return [Entry(image, texts, mask) for image, texts, mask in listing.entries]
    if dataset.format != "auto":
        raise ZerotrainError(f"data.datasets[{index}].path: {dataset.path} is not a local {kind} "
                             f"(data.datasets[{index}].format: {kind})")
    raise ZerotrainError(f"data.datasets[{index}].path: {dataset.path} is none of the forms zerotrain reads: a folder "
                         "of images, a .jsonl manifest, a table (a Hugging Face dataset, hf://datasets/owner/name, "
                         ".parquet, .arrow, .csv, .tsv) or WebDataset .tar shards")


def discover(data: DataConfig, only: int | None = None, known: dict[tuple, tuple[int, int]] | None = None
             ) -> Discovery:
    """Every dataset's images (or dataset `only`'s) with captions and sizes (headers only), and a verdict per
    problem. `known`: the upright (width, height) of images by file identity (sources.identity), as an earlier
    start found them, which spares reading their headers. Applies the missing-caption policy; does not apply
    the rejection policy (see enforce)."""
    if not data.datasets:
        raise ZerotrainError("data.datasets is empty: add a folder or a JSONL manifest, e.g. "
                             "--set 'data.datasets=[{path: ./images}]'")
    discovery = Discovery()
    known = known or {}
    for index, dataset in enumerate(data.datasets):
        if only is not None and index != only:
            continue
        entries = _entries(dataset, index, discovery)
        if dataset_kind(dataset) in ("jsonl", "table"):
            discovery.depends[index] = sorted({str(p) for e in entries for p in (e.image, e.mask, *e.controls)
                                               if isinstance(p, Path)})
        dropout = data.caption_dropout if dataset.caption_dropout is None else dataset.caption_dropout
        if dataset.share is not None:
            discovery.shares[index] = dataset.share
        items_before = len(discovery.items)
        kohya = dataset.folder_repeats and dataset_kind(dataset) == "folder"
        for entry in entries:
            image, texts, mask_file = entry.image, entry.texts, entry.mask
            if not image.is_file():
                discovery.verdicts.append(Verdict(image, "missing file"))
                continue
            if entry.missing:
                discovery.verdicts.append(Verdict(image, entry.missing))
                continue
            repeats, folder = dataset.repeats, folder_repeat(dataset.path, image) if kohya else None
            if folder is not None:
                discovery.repeat_folders.setdefault(index, {})[folder[0]] = folder[1]
                if folder[1] == 0:
                    discovery.verdicts.append(Verdict(image, f"in kohya folder {folder[0]}: 0 repeats, not trained "
                                                             "(as kohya reads it)", rejected=False))
                    continue
                repeats *= folder[1]
            if texts is None:
                if data.missing_caption == "skip":
                    discovery.verdicts.append(Verdict(image, "no caption (skipped by data.missing_caption)"))
                    continue
                texts = [image.stem.replace("_", " ") if data.missing_caption == "filename" else ""]
                discovery.verdicts.append(Verdict(image, f"no caption (using {data.missing_caption})", rejected=False))
            try:
                ident, info = _known_info(image, known)
                info = info or probe(image, data.min_image_size, data.max_image_pixels)
                ident = ident or sources.identity(image)
            except ImageRejected as err:
                discovery.verdicts.append(Verdict(image, err.reason))
                continue
            except OSError:
                discovery.verdicts.append(Verdict(image, "missing file"))
                continue
            mask = image if data.mask == "alpha" else mask_file if data.mask == "file" else None
            problem = _mask_problem(mask, image, info, data) if mask is not None and mask != image else None
            if problem:
                discovery.verdicts.append(Verdict(image, problem))
                continue
            sizes, problem = _control_sizes(entry.controls, data)
            if problem:
                discovery.verdicts.append(Verdict(image, problem))
                continue
            variants = caption_variants(texts, dataset)
            discovery.items.append(Item(image, variants[0], info.width, info.height, index, repeats,
                                        variants, dropout, dataset.loss_weight, mask, entry.controls, sizes, ident))
        _same_control_count(discovery, items_before, index)
    return discovery


def _known_info(image: Locator, known: dict[tuple, tuple[int, int]]) -> tuple[tuple | None, ImageInfo | None]:
    """The image's identity and its size as an earlier start read it, where its file is unchanged since (Item.identity
    then and now); (None, None) where not known."""
    if not known or (isinstance(image, sources.Packed) and image.kind == "url"):  # a URL's identity is its bytes
        return None, None
    try:
        ident = sources.identity(image)
    except OSError:
        return None, None
    size = known.get(ident)
    return ident, (ImageInfo(size[0], size[1], "", None) if size is not None else None)


def _control_sizes(controls: tuple[Path, ...], data: DataConfig) -> tuple[tuple[tuple[int, int], ...], str]:
    """Each control's upright size, or why one cannot be used (missing, unreadable, too small)."""
    sizes = []
    for control in controls:
        if not control.is_file():
            return (), f"control {control} is missing"
        try:
            found = probe(control, data.min_image_size, data.max_image_pixels)
        except ImageRejected as err:
            return (), f"control {control}: {err.reason}"
        sizes.append((found.width, found.height))
    return tuple(sizes), ""


def _same_control_count(discovery: Discovery, start: int, index: int) -> None:
    """Reject the images of dataset `index` (its items from `start` on) whose control count differs
    from the count most of them have: every sample of a dataset takes as many references."""
    items = discovery.items[start:]
    counts = Counter(len(item.controls) for item in items)
    if len(counts) < 2:
        return
    usual = counts.most_common(1)[0][0]
    kept = []
    for item in items:
        if len(item.controls) == usual:
            kept.append(item)
        else:
            discovery.verdicts.append(Verdict(item.image, f"{len(item.controls)} control images where the other "
                                              f"images of data.datasets[{index}] have {usual}"))
    discovery.items[start:] = kept


def _mask_problem(mask: Path, image: Path, info: ImageInfo, data: DataConfig) -> str | None:
    """Why an image's mask file cannot weight its loss (it is missing, unreadable or of another
    size), or None."""
    if not mask.is_file():
        return f"mask {mask} is missing"
    try:
        found = probe(mask, 1, data.max_image_pixels)
    except ImageRejected as err:
        return f"mask {mask.name}: {err.reason}"
    if (found.width, found.height) != (info.width, info.height):
        return f"mask {mask.name} is {found.width}x{found.height}, its image {info.width}x{info.height}"
    return None


def enforce_counts(counts: dict[str, list], items: int, data: DataConfig) -> None:
    """The rejection policy over verdict counts (reason -> [rejected, count, first paths], data.index's view):
    strict stops at the first rejected file; skip stops only when more than data.max_rejected_fraction of the
    images were rejected."""
    rejected = {reason: entry for reason, entry in counts.items() if entry[0] and entry[1]}
    if not rejected:
        if not items:
            raise ZerotrainError("no usable images in data.datasets")
        return
    reason, (_, _, paths) = next(iter(rejected.items()))
    if data.bad_files == "strict":
        raise ZerotrainError(f"{paths[0]}: {reason} (data.bad_files=strict; fix or remove the file, or set "
                             "data.bad_files=skip)")
    total = sum(entry[1] for entry in rejected.values()) + items
    if total - items > data.max_rejected_fraction * total:
        reasons = ", ".join(f"{r} x{entry[1]}" for r, entry in sorted(rejected.items(), key=lambda kv: -kv[1][1]))
        raise ZerotrainError(f"{total - items} of {total} images rejected ({reasons}), more than "
                             f"data.max_rejected_fraction={data.max_rejected_fraction:g}; first: {paths[0]}")
    if not items:
        raise ZerotrainError("no usable images in data.datasets")


def enforce(discovery: Discovery, data: DataConfig) -> None:
    """The rejection policy: strict stops at the first rejected file; skip stops only when more
    than data.max_rejected_fraction of the images were rejected."""
    rejected = discovery.rejected
    if not rejected:
        return
    if data.bad_files == "strict":
        first = rejected[0]
        raise ZerotrainError(f"{first.path}: {first.reason} (data.bad_files=strict; fix or remove the file, or "
                             "set data.bad_files=skip)")
    total = len(rejected) + len(discovery.items)
    if len(rejected) > data.max_rejected_fraction * total:
        reasons = ", ".join(f"{r} x{n}" for r, n in Counter(v.reason for v in rejected).most_common())
        raise ZerotrainError(
            f"{len(rejected)} of {total} images rejected ({reasons}), more than "
            f"data.max_rejected_fraction={data.max_rejected_fraction:g}; first: {rejected[0].path}"
        )
    if not discovery.items:
        raise ZerotrainError("no usable images in data.datasets")
