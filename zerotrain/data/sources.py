"""Datasets as they are shared, besides a folder of files: Hugging Face datasets (a save_to_disk folder, parquet
shards, a hub dataset id through the Hugging Face cache), WebDataset tar shards, CSV/TSV/parquet manifests of
image paths or URLs, any of them local or remote through fsspec (s3://, gs://, https://).

An image that is not a file of its own (a tar member, a table row, a URL) is a Packed: it names its source and
key (what a verdict prints: "shards-0003.tar:000123.jpg", "train-00000.parquet:row 12", the URL) and reads its
bytes on demand. Its content identity, which the cache key holds, is its shard's or table's (size and mtime, or
ETag) with its key, or for a URL the hash of what the URL answered.

pyarrow (parquet and Arrow) and fsspec's backends (aiohttp for http, s3fs, gcsfs) are imported where they are
needed; a missing one is one line naming the extra to install.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from zerotrain.config.sections import DatasetConfig, has_pattern, is_remote
from zerotrain.errors import ZerotrainError

_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
# The library fsspec reads each protocol with, and zerotrain's extra that installs it.
_EXTRAS = {"http": ("aiohttp", "remote"), "https": ("aiohttp", "remote"), "s3": ("s3fs", "s3"),
           "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"}
# Default column names, the first present is used.
IMAGE_COLUMNS = ("image", "jpg", "png", "webp", "file_name", "path", "url")
CAPTION_COLUMNS = ("text", "caption", "prompt")
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow")
HUB = "hf://datasets/"

Kind = Literal["folder", "jsonl", "table", "webdataset"]


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace patterns: shards-{0000..0099}.tar (zero-padded as written), {a,b}; several in a row."""
    found = _BRACES.search(pattern)
    if found is None:
        return [pattern]
    body, head, tail = found.group(1), pattern[:found.start()], pattern[found.end():]
    numbers = _RANGE.match(body)
    if numbers:
        first, last = int(numbers.group(1)), int(numbers.group(2))
        width = len(numbers.group(1)) if numbers.group(1).startswith("0") else 0
        step = 1 if last >= first else -1
        choices = [str(n).zfill(width) for n in range(first, last + step, step)]
    else:
        choices = body.split(",")
    return [head + choice + rest for choice in choices for rest in expand_braces(tail)]


def detect(location: Path | str | list[str]) -> Kind:
    """The kind of a dataset's path, from its form (format: auto); a list's from its first item."""
    if isinstance(location, list):
        return detect(location[0]) if not Path(location[0]).is_dir() else "table"
    text = str(location)
    if isinstance(location, Path) and location.is_dir():
        if (location / "state.json").is_file() or any(location.glob("*.arrow")):
            return "table"  # save_to_disk
        if any(itertools.islice(location.glob("*.parquet"), 1)) or any(location.glob("data/*.parquet")):
            return "table"
        return "folder"
    suffix = PurePosixPath(expand_braces(text)[0].split("?")[0]).suffix.lower()
    if text.startswith(HUB) or suffix in TABLE_SUFFIXES or text.endswith("/"):
        return "table"
    if suffix == ".tar":
        return "webdataset"
    return "jsonl" if suffix == ".jsonl" else "folder"


def filesystem(location: str, timeout: float = 60.0) -> tuple[Any, str]:
    """fsspec's filesystem and path for a local path or a URL. A missing backend is one line naming the extra."""
    import fsspec

    scheme = location.split("://")[0].lower() if is_remote(location) else "file"
    options: dict[str, Any] = {}
    try:
        if scheme in ("http", "https"):
            import aiohttp

            options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=timeout)}
        return fsspec.core.url_to_fs(location, **options)
    except ImportError as err:
        library, extra = _EXTRAS.get(scheme, (err.name or f"fsspec's {scheme} backend", None))
        how = f"pip install 'zerotrain[{extra}]'" if extra else f"install {library}"
        raise ZerotrainError(f"{location}: reading {scheme}:// needs {library}, which is not installed: {how}") from None
    except ValueError as err:
        raise ZerotrainError(f"{location}: no fsspec filesystem reads {scheme}:// ({err})") from None


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ZerotrainError("reading parquet and Arrow datasets needs pyarrow: pip install 'zerotrain[datasets]'"
                             ) from None
    return pyarrow


def identity_of(info: dict[str, Any]) -> tuple:
    """A remote or local file's content identity from fsspec's info: its ETag where the store gives one, else its
    size and modification time."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return ("etag", str(etag).strip('"'))
    mtime = info.get("mtime") or info.get("LastModified") or info.get("Last-Modified") or info.get("updated") \
        or info.get("created")
    return ("size", int(info.get("size") or 0), str(mtime))


@dataclass(frozen=True)
class Packed:
    """An image (or mask) that is not a file of its own: a tar member, a row of a table, or a URL."""

    source: str
    """The shard's or table's path or URL; the image's URL for kind url."""
    key: str = ""
    """The tar member's name, or "row N" of a table; empty for a URL."""
    kind: Literal["tar", "table", "url"] = "url"
    identity: tuple = ()
    """The source's content identity (its size and mtime, or ETag); empty for a URL (the content's hash)."""
    offset: int = 0
    """tar: where the member's bytes start; table: the row."""
    size: int = 0
    """tar: the member's length in bytes."""
    column: str = ""
    """table: the column that holds the image's bytes."""
    timeout: float = field(default=60.0, compare=False)

    def __str__(self) -> str:
        return f"{self.source}:{self.key}" if self.key else self.source

    @property
    def name(self) -> str:
        return PurePosixPath(self.key if self.kind == "tar" else self.source.split("?")[0]).name

    @property
    def stem(self) -> str:
        name = self.name if self.kind != "table" else f"{PurePosixPath(self.source).stem}_{self.offset}"
        return name.split(".")[0] if self.kind == "tar" else PurePosixPath(name).stem

    def is_file(self) -> bool:
        return True  # whether it reads is the probe's verdict

    def read_bytes(self) -> bytes:
        """Its bytes; OSError (FileNotFoundError for a missing one, TimeoutError) when they cannot be read."""
        if self.kind == "tar":
            return _read_range(self.source, self.offset, self.size, self.timeout)
        if self.kind == "table":
            return _table(self.source, self.timeout).image_bytes(self.offset, self.column)
        data = _fetch(self.source, self.timeout)
        _URL_HASHES[self.source] = hashlib.sha256(data).hexdigest()
        return data

    def content_identity(self) -> tuple:
        """What the cache key holds of it: its source, key and content identity."""
        if self.kind == "url":
            if self.source not in _URL_HASHES:
                self.read_bytes()
            return (self.source, "sha256", _URL_HASHES[self.source])
        return (str(self), *self.identity)


Locator = Path | Packed


def identity(location: Locator) -> tuple:
    """What the cache key holds of an image's file: its path, size and mtime; of a packed image, its source, key
    and content identity. OSError for a file that is gone."""
    if isinstance(location, Packed):
        return location.content_identity()
    stat = location.stat()
    return str(location.resolve()), stat.st_size, stat.st_mtime_ns
_URL_HASHES: dict[str, str] = {}


def _fetch(location: str, timeout: float, start: int | None = None, end: int | None = None) -> bytes:
    """A file's or URL's bytes (from start to end); FileNotFoundError, TimeoutError or OSError when they do not
    come."""
    fs, path = filesystem(location, timeout)
    try:
        return fs.cat_file(path, start=start, end=end)
    except FileNotFoundError:
        raise
    except Exception as err:  # aiohttp's errors, asyncio's timeouts: the store did not answer
        if isinstance(err, TimeoutError) or "Timeout" in type(err).__name__:
            raise TimeoutError(f"no answer within {timeout:g} s") from None
        if isinstance(err, OSError):
            raise
        raise OSError(f"{type(err).__name__}: {err}") from None


def _read_range(location: str, offset: int, size: int, timeout: float) -> bytes:
    if not is_remote(location):
        with open(location, "rb") as fp:
            fp.seek(offset)
            data = fp.read(size)
    else:
        data = _fetch(location, timeout, offset, offset + size)
    if len(data) != size:
        raise EOFError(f"{location} ends inside member at byte {offset} ({len(data)} of {size} bytes)")
    return data


class _Table:
    """One parquet or Arrow file, its rows read a row group at a time (the last one kept)."""

    def __init__(self, location: str, timeout: float) -> None:
        pa = _pyarrow()
        self.location = location
        if location.endswith(".arrow"):
            source = pa.memory_map(location) if not is_remote(location) else io.BytesIO(_fetch(location, timeout))
            try:
                self.table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                self.table = pa.ipc.open_file(source).read_all()
            self.parquet, self.starts = None, [0]
        else:
            fs, path = filesystem(location, timeout)
            self.parquet = pa.parquet.ParquetFile(fs.open(path, "rb") if is_remote(location) else path)
            meta = self.parquet.metadata
            self.starts = list(itertools.accumulate((meta.row_group(g).num_rows for g in range(meta.num_row_groups)),
                                                    initial=0))
        self._group: tuple[int, str, Any] | None = None

    @property
    def schema(self) -> Any:
        return self.table.schema if self.parquet is None else self.parquet.schema_arrow

    def columns(self, names: list[str]) -> dict[str, list]:
        if self.parquet is None:
            return {name: self.table.column(name).to_pylist() for name in names}
        return {name: values.to_pylist() for name, values in zip(names, self.parquet.read(columns=names).columns,
                                                                  strict=True)}

    def image_bytes(self, row: int, column: str) -> bytes:
        if self.parquet is None:
            value = self.table.column(column)[row].as_py()
        else:
            group = next(g for g in range(len(self.starts) - 1) if self.starts[g] <= row < self.starts[g + 1])
            if self._group is None or self._group[:2] != (group, column):
                self._group = (group, column, self.parquet.read_row_group(group, columns=[column]).column(0))
            value = self._group[2][row - self.starts[group]].as_py()
        if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
            if value.get("bytes"):
                return value["bytes"]
            if value.get("path"):
                return _local_or_remote(_beside(self.location, value["path"]))
        if isinstance(value, (bytes, bytearray)) and value:
            return bytes(value)
        raise FileNotFoundError(f"{column} is empty in this row")


def _local_or_remote(location: str) -> bytes:
    return _fetch(location, 60.0) if is_remote(location) else Path(location).read_bytes()


@lru_cache(maxsize=4)
def _table(location: str, timeout: float) -> _Table:
    return _Table(location, timeout)


def _beside(base: str, relative: str) -> str:
    """A path or URL a table or manifest names, relative to the table's own folder."""
    if is_remote(relative) or Path(relative).is_absolute():
        return relative
    if is_remote(base):
        return base.rsplit("/", 1)[0] + "/" + relative
    return str(Path(base).parent / relative)


def _embedded(type_: Any) -> bool:
    """Whether an Arrow column holds the images' bytes (datasets' Image struct, or binary)."""
    pa = _pyarrow()
    if pa.types.is_struct(type_):
        return type_.get_field_index("bytes") >= 0
    return pa.types.is_binary(type_) or pa.types.is_large_binary(type_)


# --------------------------------------------------------------------------------------------------
# Listing a source's entries

@dataclass
class Listing:
    """What a source gave: (image, texts or None, mask) per entry, and (where, why, rejected) per problem."""

    entries: list[tuple[Locator, list[str] | None, Locator | None]] = field(default_factory=list)
    problems: list[tuple[Locator, str, bool]] = field(default_factory=list)


def _where(index: int) -> str:
    return f"data.datasets[{index}]"


def source_files(dataset: DatasetConfig, index: int, suffixes: tuple[str, ...]) -> list[tuple[str, tuple]]:
    """The files a table or shard dataset names, with each one's content identity: a file, a folder of them
    (split by data.datasets[].split where names say so), a brace pattern, or a hub dataset id."""
    locations = dataset.path if isinstance(dataset.path, list) else [str(dataset.path)]
    location = locations[0] if len(locations) == 1 else ", ".join(locations)
    if location.startswith(HUB):
        locations = [_hub_snapshot(location, index)]
    if isinstance(dataset.path, Path) and (dataset.path / "state.json").is_file():
        state = json.loads((dataset.path / "state.json").read_text())
        names = [dataset.path / f["filename"] for f in state.get("_data_files", [])]
        return [(str(p), _local_identity(p)) for p in names]
    out = []
    for name in (name for given in locations for name in expand_braces(given)):
        fs, path = filesystem(name, dataset.timeout_seconds)
        try:
            folder = fs.isdir(path)
            if folder:
                found = sorted(p for p in fs.find(path) if p.lower().endswith(suffixes))
                found = _split(found, dataset.split)
                out += [(_unstrip(name, path, p), identity_of(fs.info(p))) for p in found]
            else:
                out.append((name, identity_of(fs.info(path))))
        except FileNotFoundError:
            if not has_pattern(location):
                raise ZerotrainError(f"{_where(index)}.path: {name} does not exist") from None
    if not out:
        raise ZerotrainError(f"{_where(index)}.path: {location} names no {'/'.join(suffixes)} file (a pattern that "
                             "matches nothing, or an empty folder)")
    return out


def _unstrip(name: str, path: str, found: str) -> str:
    """fsspec's path of a file under a folder, as a location like the folder's own (URL or local)."""
    if not is_remote(name):
        return found
    return name.rstrip("/") + "/" + found[len(path.rstrip("/")) + 1:]


def _split(paths: list[str], split: str) -> list[str]:
    """The files of one split, where file or folder names say which split they hold (train-00000-of-00002.parquet,
    data/train/...); every file where none does."""
    named = re.compile(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)")
    chosen = [p for p in paths if named.search(p.rsplit("/", 1)[-1]) or f"/{split}/" in p]
    return chosen or paths


def _local_identity(path: Path) -> tuple:
    stat = path.stat()
    return ("size", stat.st_size, stat.st_mtime_ns)


def _hub_snapshot(location: str, index: int) -> str:
    """A hub dataset's local snapshot (hf://datasets/owner/name[@revision]), downloaded into the Hugging Face cache
    or found there (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, revision = location[len(HUB):].strip("/").partition("@")
    fetch = {"repo_type": "dataset", "revision": revision or None, "cache_dir": constants.HF_HUB_CACHE,
             "allow_patterns": ["*.parquet", "*.arrow", "*.csv", "*.tsv", "*.json", "*.md"]}
    try:
        try:
            return snapshot_download(repo, local_files_only=bool(constants.HF_HUB_OFFLINE), **fetch)
        except RepositoryNotFoundError:
            raise
        except (HfHubHTTPError, OSError) as err:  # no network: what the cache holds, if it holds it
            if constants.HF_HUB_OFFLINE or isinstance(err, LocalEntryNotFoundError):
                raise
            return snapshot_download(repo, local_files_only=True, **fetch)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ZerotrainError(f"{_where(index)}.path: the hub dataset {repo} cannot be fetched ({first}); check the id, "
                             "your token (HF_TOKEN) for a gated dataset, or set HF_HUB_OFFLINE=0") from None


def _column(given: str | None, names: list[str], defaults: tuple[str, ...], what: str, field_name: str,
            where: str, source: str, required: bool = True) -> str | None:
    if given is not None:
        if given not in names:
            raise ZerotrainError(f"{where}.{field_name}: {source} has no column {given!r} (its columns: "
                                 f"{', '.join(names)})")
        return given
    found = next((name for name in defaults if name in names), None)
    if found is None and required:
        raise ZerotrainError(f"{where}: {source} has none of the {what} columns {', '.join(defaults)} (its columns: "
                             f"{', '.join(names)}); name it with {where}.{field_name}")
    return found


def _texts(value: Any) -> list[str] | None:
    """A caption cell: a text, a list of texts, or nothing (None: no caption)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (list, tuple)):
        texts = [str(v).strip() for v in value if v is not None and str(v).strip()]
        return texts or None
    return [str(value).strip()]


def table_entries(dataset: DatasetConfig, index: int) -> Listing:
    """A Hugging Face dataset (save_to_disk, parquet shards, a hub id) or a CSV/TSV/parquet manifest: each row's
    image (its bytes in the table, or a path or URL), caption and optional mask."""
    listing = Listing()
    for location, identity in source_files(dataset, index, TABLE_SUFFIXES):
        suffix = PurePosixPath(location.split("?")[0]).suffix.lower()
        if suffix in (".csv", ".tsv"):
            _csv_rows(dataset, index, location, suffix, listing)
            continue
        try:
            table = _table(location, dataset.timeout_seconds)
            names = list(table.schema.names)
        except (OSError, ValueError) as err:  # pyarrow's errors (ArrowInvalid, ArrowIOError) for a file that is not one
            raise ZerotrainError(f"{_where(index)}.path: {location} is not a readable {suffix[1:]} file "
                                 f"({type(err).__name__}: {err})") from None
        where = _where(index)
        image = _column(dataset.image_column, names, IMAGE_COLUMNS, "image", "image_column", where, location)
        caption = _column(dataset.caption_column, names, CAPTION_COLUMNS, "caption", "caption_column", where,
                          location, required=False)
        mask = _column(dataset.mask_column, names, (), "mask", "mask_column", where, location, required=False)
        embedded = {name: _embedded(table.schema.field(name).type) for name in (image, mask) if name}
        wanted = [name for name in (caption, *(n for n, e in embedded.items() if not e)) if name]
        values = table.columns(wanted)
        rows = table.table.num_rows if table.parquet is None else table.parquet.metadata.num_rows
        def locate(name: str | None, row: int, location: str = location, identity: tuple = identity,
                   embedded: dict = embedded, values: dict = values) -> Locator | None:
            if name is None:
                return None
            if embedded[name]:
                return Packed(location, f"row {row}", "table", identity, row, 0, name, dataset.timeout_seconds)
            return _named(location, values[name][row], dataset.timeout_seconds)

        for row in range(rows):
            found = locate(image, row)
            texts = _texts(values[caption][row]) if caption else None
            if found is None:
                listing.problems.append((Packed(location, f"row {row}", "table", identity, row), "no image in the row",
                                         True))
                continue
            listing.entries.append((found, texts, locate(mask, row)))
    return listing


def _named(base: str, value: Any, timeout: float) -> Locator | None:
    """A manifest's image cell: a path (relative to the manifest) or a URL."""
    if not isinstance(value, str) or not value.strip():
        return None
    location = _beside(base, value.strip())
    return Packed(location, timeout=timeout) if is_remote(location) else Path(location)


def _csv_rows(dataset: DatasetConfig, index: int, location: str, suffix: str, listing: Listing) -> None:
    fs, path = filesystem(location, dataset.timeout_seconds)
    with fs.open(path, "rb") as fp:
        data = fp.read()
    text = data.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ",")
    names = list(reader.fieldnames or [])
    where = _where(index)
    image = _column(dataset.image_column, names, IMAGE_COLUMNS, "image", "image_column", where, location)
    caption = _column(dataset.caption_column, names, CAPTION_COLUMNS, "caption", "caption_column", where, location,
                      required=False)
    mask = _column(dataset.mask_column, names, (), "mask", "mask_column", where, location, required=False)
    for number, row in enumerate(reader, start=2):  # line 1 is the header
        found = _named(location, row.get(image), dataset.timeout_seconds)
        where_row = Packed(location, f"line {number}", "table")
        if found is None:
            listing.problems.append((where_row, "no image in the row", True))
            continue
        cell = row.get(caption) if caption else None
        try:
            texts = _texts(cell.encode("utf-8").decode("utf-8") if cell else None)
        except UnicodeEncodeError:
            listing.problems.append((found, f"caption not UTF-8 ({location} line {number})", True))
            continue
        listing.entries.append((found, texts, _named(location, row.get(mask), dataset.timeout_seconds) if mask
                                else None))


_WDS_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext: key up to the name's first dot


def tar_entries(dataset: DatasetConfig, index: int) -> Listing:
    """WebDataset shards: members that share a key are one sample; key.jpg (any image extension) is the image,
    key.txt or key.json ("caption" or data.datasets[].caption_column) its caption, key.mask.png its mask."""
    listing = Listing()
    for shard, identity in source_files(dataset, index, (".tar",)):
        def packed(member: tarfile.TarInfo, shard: str = shard, identity: tuple = identity) -> Packed:
            return Packed(shard, member.name, "tar", identity, member.offset_data, member.size,
                          timeout=dataset.timeout_seconds)
        samples: dict[str, dict[str, tarfile.TarInfo]] = {}
        captions: dict[tuple[str, str], bytes] = {}
        try:
            for member, read in _members(shard, dataset.timeout_seconds):
                found = _WDS_KEY.match(member.name)
                if not member.isfile() or found is None:
                    continue
                key, ext = found.group(1), found.group(2).lower()
                samples.setdefault(key, {})[ext] = member
                if ext in ("txt", "json"):
                    captions[(key, ext)] = read()
        except (tarfile.TarError, EOFError, OSError) as err:
            why = f"shard unreadable after {len(samples)} samples ({type(err).__name__}: {err}); those are used"
            listing.problems.append((Packed(shard, "", "tar", identity), why, True))
        for key, members in samples.items():
            image = next((m for ext, m in members.items() if "." + ext in IMAGE_EXTENSIONS), None)
            mask = next((m for ext, m in members.items() if ext.startswith("mask.")
                         and "." + ext[5:] in IMAGE_EXTENSIONS), None)
            if image is None:
                why = f"no image in the sample (members: {', '.join(sorted(members))})"
                listing.problems.append((Packed(shard, key, "tar", identity), why, False))
                continue
            try:
                texts = _tar_caption(captions, key, dataset.caption_column)
            except ValueError as err:
                listing.problems.append((packed(image), str(err), True))
                continue
            listing.entries.append((packed(image), texts, packed(mask) if mask is not None else None))
    return listing


def _members(shard: str, timeout: float) -> Iterator[tuple[tarfile.TarInfo, Callable[[], bytes]]]:
    """Each member of a tar shard with a reader of its bytes, in order; headers only are read otherwise."""
    fs, path = filesystem(shard, timeout)
    with fs.open(path, "rb") as fp, tarfile.open(fileobj=fp, mode="r:") as archive:
        for member in archive:
            yield member, lambda member=member: archive.extractfile(member).read()
        # tarfile ends quietly at a header cut short; what follows the last member is zeros in a whole shard.
        fp.seek(archive.offset)
        if fp.read(1024).strip(b"\0"):
            raise tarfile.ReadError("unexpected end of data in a member's header")


def _tar_caption(captions: dict[tuple[str, str], bytes], key: str, column: str | None) -> list[str] | None:
    """A sample's caption: key.txt, or key.json's caption (or text) field. ValueError names what is wrong."""
    if (key, "txt") in captions:
        try:
            return _texts(captions[(key, "txt")].decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"caption not UTF-8 ({key}.txt)") from None
    if (key, "json") in captions:
        try:
            record = json.loads(captions[(key, "json")].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{key}.json is not UTF-8 JSON ({err})") from None
        names = (column,) if column else CAPTION_COLUMNS
        return _texts(next((record[n] for n in names if isinstance(record, dict) and n in record), None))
    return None
