"""The dataset index: what every start needs of every image, as arrays, computed once.

The first build writes it beside the cache (data.cache_dir/dataset-index/). Per planned image, one row of fixed
size: its latent key, the range of its text keys, its bucket and crop, its dataset, repeats, loss weight and
caption dropout, and the cache shards that hold its tensors. Every rank and DataLoader worker maps the rows
read-only, so a node's processes share one copy through the page cache, and no Python object exists per image.
Each image's whole plan (data.cache.Planned) is kept too, pickled, for the builds that need it; a start that
encodes nothing never reads it.

A start checks each dataset by what it depends on, never by an image's header: a folder's listing with each
file's size and mtime (its control folders too), a shard's or table's identity (size and mtime, or ETag), a
manifest's identity and the local files it names. Where nothing changed, and the run plans images as the index
did (its fingerprint: the encoders, the data section's planning fields, the family), the index is the plan. A
dataset that changed is discovered again, its unchanged images' headers taken from the index rather than read.

Files, each written under a temporary name and renamed; meta.json last, naming the generation of the others:
    meta.json                fingerprint, datasets (signature, rows, verdict counts, kohya folders), shard names
    rows-<gen>.npy           ROW per planned image, in the cache's order
    texts-<gen>.npy          TEXT per text key of each image (its captions' variants, then its empty caption)
    plans-<gen>.bin          pickled Planned per row; rows' "plan" field is its offset
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.config.sections import DatasetConfig

INDEX_VERSION = 1
INDEX_DIR = "dataset-index"

ROW = np.dtype([
    ("latent", "u1", (16,)), ("latent_shard", "<i4"), ("text_start", "<i8"), ("texts", "<i4"),
    ("empty", "<i8"), ("bucket_id", "<i4"), ("bucket", "<i4", (2,)), ("original", "<i4", (2,)),
    ("crop", "<i4", (2,)), ("dataset", "<i4"), ("repeats", "<i4"), ("loss_weight", "<f4"), ("dropout", "<f8"),
    ("mask", "u1"), ("references", "u1"), ("reference_sizes", "<i4"), ("plan", "<i8"),
])
"""One planned image. latent: its key's 16 bytes. text_start, texts: its text keys' rows in TEXT (captions'
variants in order). empty: the empty caption's TEXT row, -1 where it never drops its caption. bucket: (width,
height); original: the image's (width, height); crop: (top, left). reference_sizes: the id (meta's
reference_sizes) of its references' sizes, -1 without references. plan: its Planned's offset in plans-<gen>.bin."""
TEXT = np.dtype([("key", "u1", (16,)), ("shard", "<i4")])
ABSENT = -1


def key_bytes(key: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(key), dtype=np.uint8)


def key_text(row: np.ndarray) -> str:
    return bytes(row).hex()


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass
class DatasetRecord:
    """What the index keeps of one dataset between starts."""

    signature: str
    rows: tuple[int, int] = (0, 0)
    """Its planned images' rows [start, stop)."""
    verdicts: dict[str, list] = field(default_factory=dict)
    """reason -> [rejected, count, first paths] of its discovery."""
    repeat_folders: dict[str, int] = field(default_factory=dict)
    depends: list[str] = field(default_factory=list)
    """Local files it names outside its own folder or files (a manifest's images): checked by size and mtime."""

    def to_json(self) -> dict[str, Any]:
        return {"signature": self.signature, "rows": list(self.rows), "verdicts": self.verdicts,
                "repeat_folders": self.repeat_folders, "depends": self.depends}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> DatasetRecord:
        return cls(value["signature"], tuple(value["rows"]), value["verdicts"], value["repeat_folders"],
                   value["depends"])


class Index:
    """The rows and text keys of every planned image, with the shard names and, on disk, their plans."""

    def __init__(self, rows: np.ndarray, texts: np.ndarray, meta: dict[str, Any], plans: Path | list | None = None,
                 root: Path | None = None):
        self.rows, self.texts, self.meta = rows, texts, meta
        self.latent_shards: list[str] = meta.get("latent_shards", [])
        self.text_shards: list[str] = meta.get("text_shards", [])
        self._plans = plans
        self._root = root
        """The cache folder it was mapped from: a pickled copy (a DataLoader worker's) maps it again."""

    def __getstate__(self) -> dict[str, Any]:
        if self._root is not None:
            return {"root": self._root, "generation": self.meta["generation"]}
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "root" in state:
            mapped = load(state["root"])
            if mapped is None or mapped.meta["generation"] != state["generation"]:
                raise RuntimeError(f"the dataset index at {state['root']} changed while a worker was starting")
            state = mapped.__dict__
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.rows)

    def latent_key(self, row: int) -> str:
        return key_text(self.rows["latent"][row])

    def text_key(self, text_row: int) -> str:
        return key_text(self.texts["key"][text_row])

    def text_rows(self, row: int) -> range:
        start = int(self.rows["text_start"][row])
        return range(start, start + int(self.rows["texts"][row]))

    def planned(self, rows: Iterable[int], *, rows_of: np.ndarray | None = None) -> list:
        """The Planned of each of these rows (read from plans-<gen>.bin, or the list it was made from); rows_of:
        rows of another index (a take() of this one) whose plan offsets point into this one's file."""
        table = self.rows if rows_of is None else rows_of
        if isinstance(self._plans, list):
            return [self._plans[int(table["plan"][r])] for r in rows]
        if self._plans is None:
            raise ValueError("this index keeps no plans")
        out = []
        with open(self._plans, "rb") as fp:
            for r in rows:
                fp.seek(int(table["plan"][r]))
                out.append(pickle.load(fp))
        return out

    def spans(self) -> np.ndarray:
        """How many TEXT rows each row owns: its captions' variants, and its empty caption where it has one."""
        return self.rows["texts"].astype(np.int64) + (self.rows["empty"] >= 0)

    def text_table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The TEXT rows these rows own, in order."""
        starts, spans = self.rows["text_start"][rows].astype(np.int64), self.spans()[rows]
        if not len(spans):
            return np.zeros(0, np.int64)
        before = np.concatenate([[0], np.cumsum(spans)[:-1]])
        return np.repeat(starts - before, spans) + np.arange(int(spans.sum()))

    def missing(self) -> np.ndarray:
        """Rows whose latents or any of whose texts no shard holds."""
        by_row = self.rows["latent_shard"] == ABSENT
        text_absent = self.texts["shard"] == ABSENT
        if text_absent.any():
            owners = np.repeat(np.arange(len(self.rows)), self.spans())
            by_row = by_row.copy()
            by_row[owners[text_absent]] = True
        return np.flatnonzero(by_row)

    def unique_latents(self, rows: np.ndarray | None = None) -> int:
        keys = self.rows["latent"] if rows is None else self.rows["latent"][rows]
        return len(np.unique(keys, axis=0)) if len(keys) else 0

    def unique_texts(self, rows: np.ndarray | None = None) -> int:
        keys = self.texts["key"] if rows is None else self.texts["key"][self.text_table_rows(rows)]
        return len(np.unique(keys, axis=0)) if len(keys) else 0

    def groups(self, rows: np.ndarray) -> np.ndarray:
        """The sampler's group of each of these rows: its bucket id, and for edit samples also its references'
        sizes, so that every tensor of a batch stacks (a text-to-image sample's group is its bucket id, as it was)."""
        bucket = self.rows["bucket_id"][rows].astype(np.int64)
        ids = self.rows["reference_sizes"][rows]
        if not (ids >= 0).any():
            return bucket
        names = [tuple(map(tuple, s)) for s in self.meta["reference_sizes"]]
        present = sorted({names[s] for s in np.unique(ids[ids >= 0]).tolist()})
        rank = np.array([present.index(n) if n in present else 0 for n in names])
        span = int(bucket.max()) + 1
        return np.where(ids >= 0, bucket + span * (1 + rank[np.maximum(ids, 0)]), bucket)


def from_planned(planned: list, latent_shard: dict[str, str] | None = None, text_shard: dict[str, str] | None = None,
                 plans: Path | list | None = None, meta: dict | None = None, offsets: list[int] | None = None) -> Index:
    """An index of these Planned (shard names from the cache's key -> shard maps; ABSENT where a key is in none)."""
    latent_shard, text_shard = latent_shard or {}, text_shard or {}
    meta = dict(meta or {})
    latent_names = sorted(set(latent_shard.values()))
    text_names = sorted(set(text_shard.values()))
    latent_ids = {name: i for i, name in enumerate(latent_names)}
    text_ids = {name: i for i, name in enumerate(text_names)}
    sizes: dict[tuple, int] = {}
    rows = np.zeros(len(planned), dtype=ROW)
    keys: list[str] = []
    for i, p in enumerate(planned):
        row = rows[i]
        row["latent"] = key_bytes(p.latent_key)
        row["latent_shard"] = latent_ids.get(latent_shard.get(p.latent_key, ""), ABSENT)
        row["text_start"], row["texts"] = len(keys), len(p.text_keys)
        keys += p.text_keys
        row["empty"] = len(keys) if p.empty_key else ABSENT  # right after its captions': TEXT rows are per row
        keys += [p.empty_key] if p.empty_key else []
        row["bucket_id"] = p.bucket_id
        row["bucket"] = p.crop.bucket
        row["original"] = p.crop.original_size
        row["crop"] = (p.crop.crop_top, p.crop.crop_left)
        row["dataset"], row["repeats"] = p.item.dataset, p.item.repeats
        row["loss_weight"], row["dropout"] = p.item.loss_weight, p.item.caption_dropout
        row["mask"], row["references"] = p.item.mask is not None, len(p.reference_crops)
        row["reference_sizes"] = sizes.setdefault(p.group[1], len(sizes)) if p.reference_crops else ABSENT
        row["plan"] = offsets[i] if offsets is not None else i
    texts = np.zeros(len(keys), dtype=TEXT)
    if keys:
        texts["key"] = np.frombuffer(bytes.fromhex("".join(keys)), dtype=np.uint8).reshape(-1, 16)
        texts["shard"] = [text_ids.get(text_shard.get(key, ""), ABSENT) for key in keys]
    meta.update(latent_shards=latent_names, text_shards=text_names,
                reference_sizes=[list(map(list, size)) for size in sizes])
    return Index(rows, texts, meta, plans if plans is not None else list(planned))


def with_shards(index: Index, latent_shard: dict[str, str], text_shard: dict[str, str]) -> Index:
    """The index with every key's shard looked up again (after a build wrote more shards)."""
    latent_names = sorted(set(latent_shard.values()))
    text_names = sorted(set(text_shard.values()))
    latent_ids = {name: i for i, name in enumerate(latent_names)}
    text_ids = {name: i for i, name in enumerate(text_names)}
    rows, texts = index.rows.copy(), index.texts.copy()
    rows["latent_shard"] = [latent_ids.get(latent_shard.get(key_text(k), ""), ABSENT) for k in rows["latent"]]
    texts["shard"] = [text_ids.get(text_shard.get(key_text(k), ""), ABSENT) for k in texts["key"]]
    meta = {**index.meta, "latent_shards": latent_names, "text_shards": text_names}
    return Index(rows, texts, meta, index._plans)


def take(index: Index, keep: np.ndarray) -> Index:
    """The index of these rows only (their text rows renumbered; plans as they were)."""
    texts = index.texts[index.text_table_rows(keep)].copy()
    spans = index.spans()[keep]
    rows = index.rows[keep].copy()
    rows["text_start"] = np.concatenate([[0], np.cumsum(spans)[:-1]]) if len(rows) else rows["text_start"]
    rows["empty"] = np.where(rows["empty"] >= 0, rows["text_start"] + rows["texts"], ABSENT)
    return Index(rows, texts, index.meta, index._plans)


def concatenate(parts: list[Index], meta: dict) -> Index:
    """One index of several (each dataset's), their shard names and reference sizes merged."""
    latent_names = sorted({n for p in parts for n in p.latent_shards})
    text_names = sorted({n for p in parts for n in p.text_shards})
    size_names = sorted({tuple(map(tuple, s)) for p in parts for s in p.meta.get("reference_sizes", [])})
    rows, texts, offset = [], [], 0
    for part in parts:
        r, t = part.rows.copy(), part.texts.copy()
        r["latent_shard"] = _renumber(r["latent_shard"], part.latent_shards, latent_names)
        t["shard"] = _renumber(t["shard"], part.text_shards, text_names)
        sizes = [tuple(map(tuple, s)) for s in part.meta.get("reference_sizes", [])]
        r["reference_sizes"] = _renumber(r["reference_sizes"], sizes, size_names)
        r["text_start"] += offset
        r["empty"] = np.where(r["empty"] >= 0, r["empty"] + offset, ABSENT)
        offset += len(t)
        rows.append(r)
        texts.append(t)
    merged = {**meta, "latent_shards": latent_names, "text_shards": text_names,
              "reference_sizes": [list(map(list, s)) for s in size_names]}
    return Index(np.concatenate(rows) if rows else np.zeros(0, ROW), np.concatenate(texts) if texts else
                 np.zeros(0, TEXT), merged, None)


def _renumber(ids: np.ndarray, names: list, merged: list) -> np.ndarray:
    if not len(names):
        return ids
    lookup = {name: i for i, name in enumerate(merged)}
    table = np.array([lookup[name] for name in names], dtype=ids.dtype)
    return np.where(ids >= 0, table[np.maximum(ids, 0)], ABSENT)


# --------------------------------------------------------------------------------------------------
# On disk


def folder(root: Path) -> Path:
    return root / INDEX_DIR


def write_plans(path: Path, parts: list[tuple[Index, list | None]], old: Index | None) -> None:
    """plans-*.bin for these parts (each an index and its fresh Planned, or None where its rows' plans are in
    `old`'s file): the old file copied where most of it is still used (its offsets stay valid), each fresh plan
    appended, and the parts' rows' "plan" offsets set."""
    reused = sum(len(part) for part, fresh in parts if fresh is None)
    copy = old is not None and reused and reused * 2 >= len(old)
    with open(path, "wb") as fp:
        if copy:
            with open(old._plans, "rb") as source:
                shutil.copyfileobj(source, fp, 16 << 20)
        for part, fresh in parts:
            if fresh is None and copy:
                continue
            plans = fresh if fresh is not None else old.planned(range(len(part)), rows_of=part.rows)
            offsets = part.rows["plan"]
            for i, plan in enumerate(plans):
                offsets[i] = fp.tell()
                pickle.dump(plan, fp, protocol=pickle.HIGHEST_PROTOCOL)


def write(root: Path, index: Index, plans: Path) -> Index:
    """Write the index's rows and texts as a new generation, and meta.json naming them and `plans` (its rows'
    plans file, moved into the index's folder where it is elsewhere); other generations are removed. Returns
    it as read back (mapped)."""
    out = folder(root)
    out.mkdir(parents=True, exist_ok=True)
    gen = uuid.uuid4().hex[:12]
    if plans.parent != out or plans.suffix != ".bin":
        os.replace(plans, out / f"plans-{gen}.bin")
        plans = out / f"plans-{gen}.bin"
    for name, array in (("rows", index.rows), ("texts", index.texts)):
        with open(out / f"{name}-{gen}.npy.tmp", "wb") as fp:
            np.save(fp, np.ascontiguousarray(array))
        os.replace(out / f"{name}-{gen}.npy.tmp", out / f"{name}-{gen}.npy")
    meta = {**index.meta, "version": INDEX_VERSION, "generation": gen, "plans": plans.name}
    (out / "meta.json.tmp").write_text(json.dumps(meta))
    os.replace(out / "meta.json.tmp", out / "meta.json")
    for stale in out.iterdir():
        if stale.name not in (f"rows-{gen}.npy", f"texts-{gen}.npy", plans.name, "meta.json"):
            stale.unlink(missing_ok=True)
    return load(root)


def load(root: Path) -> Index | None:
    """The index as written last, its arrays mapped read-only; None where there is none or it cannot be read."""
    out = folder(root)
    try:
        meta = json.loads((out / "meta.json").read_text())
        if meta.get("version") != INDEX_VERSION:
            return None
        gen = meta["generation"]
        rows = np.load(out / f"rows-{gen}.npy", mmap_mode="r")
        texts = np.load(out / f"texts-{gen}.npy", mmap_mode="r")
        if rows.dtype != ROW or texts.dtype != TEXT or not (out / meta["plans"]).is_file():
            return None
        return Index(rows, texts, meta, out / meta["plans"], root=root)
    except (OSError, ValueError, KeyError):
        return None


def indexed_entries(root: Path) -> int:
    """How many images the dataset index at this cache folder holds (0 where there is none yet)."""
    index = load(root)
    return len(index) if index is not None else 0


# --------------------------------------------------------------------------------------------------
# What a dataset depends on


def signature(dataset: DatasetConfig, depends: list[str], check: str = "files") -> str:
    """A digest of everything a dataset's images are read from, without opening an image: its folder's files (and
    control folders') with their sizes and mtimes (check "folders": each folder's mtime and listing); its shards',
    tables' or manifest's identities; the local files a manifest names (`depends`), each with its size and mtime,
    or absent (check "folders": their folders' mtimes and listings)."""
    from zerotrain.data import sources
    from zerotrain.data.dataset import dataset_kind

    digest = hashlib.sha256(dataset.model_dump_json().encode())
    kind = dataset_kind(dataset)
    if kind == "folder" and isinstance(dataset.path, Path):
        for root in (dataset.path, *dataset.controls):
            _walk(str(root), digest, files=check == "files")
    elif kind == "jsonl" and isinstance(dataset.path, Path):
        _stat(str(dataset.path), digest)
    else:
        suffixes = (".tar",) if kind == "webdataset" else sources.TABLE_SUFFIXES
        for location, identity in sources.source_files(dataset, -1, suffixes):
            digest.update(f"{location}\0{identity}\n".encode())
    if check == "files":
        for path in depends:
            _stat(path, digest)
    else:
        for folder in sorted({os.path.dirname(path) for path in depends}):
            _listing(folder, digest)
    return digest.hexdigest()[:32]


def _walk(root: str, digest: Any, files: bool) -> None:
    """A folder tree into the digest, folder by folder: each file's name, size and mtime (files), or each folder's
    mtime and its names."""
    stack = [root]
    while stack:
        top = stack.pop()
        names, folders = [], []
        try:
            with os.scandir(top) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=True):
                        folders.append(entry.name)
                    elif files:
                        try:
                            stat = entry.stat()
                            names.append(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}")
                        except OSError:
                            names.append(f"{entry.name}\0gone")
                    else:
                        names.append(entry.name)
            mtime = "" if files else str(os.stat(top).st_mtime_ns)
        except OSError:
            digest.update(f"{top}\0unreadable\n".encode())
            continue
        names.sort()
        digest.update(f"{top}\0{mtime}\n".encode() + "\n".join(names).encode() + b"\n")
        stack += [os.path.join(top, name) for name in sorted(folders, reverse=True)]


def _listing(folder: str, digest: Any) -> None:
    try:
        names = sorted(os.listdir(folder))
        digest.update(f"{folder}\0{os.stat(folder).st_mtime_ns}\n".encode() + "\0".join(names).encode() + b"\n")
    except OSError:
        digest.update(f"{folder}\0absent\n".encode())


def _stat(path: str, digest: Any) -> None:
    try:
        stat = os.stat(path)
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    except OSError:
        digest.update(f"{path}\0absent\n".encode())


def verdict_counts(verdicts: list) -> dict[str, list]:
    """reason -> [rejected, count, first paths] (the summary's view of a dataset's verdicts)."""
    out: dict[str, list] = {}
    for v in verdicts:
        entry = out.setdefault(v.reason, [v.rejected, 0, []])
        entry[1] += 1
        if len(entry[2]) < 3:
            entry[2].append(str(v.path))
    return out


def merge_counts(parts: Iterable[dict[str, list]]) -> dict[str, list]:
    out: dict[str, list] = {}
    for part in parts:
        for reason, (rejected, count, paths) in part.items():
            entry = out.setdefault(reason, [rejected, 0, []])
            entry[1] += count
            entry[2] = (entry[2] + list(paths))[:3]
    return out


def counted(counts: dict[str, list], rejected: bool) -> Counter:
    return Counter({reason: count for reason, (r, count, _) in counts.items() if r == rejected})
