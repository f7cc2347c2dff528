"""Datasets in the forms they are shared, written from examples/tiny-data's 8 images and captions by the real
libraries (datasets' save_to_disk and to_parquet, pyarrow, tarfile as WebDataset's writers lay shards out, csv),
a Hugging Face cache holding a hub dataset as huggingface_hub lays it out, and a file server on 127.0.0.1 that
answers range requests as object stores and web servers do.

    rows = tiny_rows()                       # [(stem, PNG bytes, caption)] x 8
    write_save_to_disk(tmp / "hf", rows)     # datasets.Dataset.save_to_disk, an Image feature
    write_parquet(tmp / "pq", rows)          # two shards: train-00000-of-00002.parquet, ...
    write_shards(tmp / "wds", rows)          # shards-0000.tar, shards-0001.tar (key.png + key.txt)
    with FileServer(tmp) as server:          # server.url + "/wds/shards-{0000..0001}.tar"
        ...
"""

from __future__ import annotations

import csv
import io
import tarfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_DATA = REPO / "examples" / "tiny-data"


def tiny_rows() -> list[tuple[str, bytes, str]]:
    """(stem, image bytes, caption) of each of examples/tiny-data's images."""
    return [(p.stem, p.read_bytes(), p.with_suffix(".txt").read_text().strip())
            for p in sorted(TINY_DATA.glob("*.png"))]


def _dataset(rows: list[tuple[str, bytes, str]]):
    import datasets

    return datasets.Dataset.from_dict({"image": [{"bytes": data, "path": None} for _, data, _ in rows],
                                       "text": [caption for *_, caption in rows]},
                                      features=datasets.Features({"image": datasets.Image(),
                                                                  "text": datasets.Value("string")}))


def write_save_to_disk(folder: Path, rows: list[tuple[str, bytes, str]]) -> Path:
    """A folder written by datasets' save_to_disk (Arrow files, state.json), its images an Image feature."""
    _dataset(rows).save_to_disk(str(folder))
    return folder


def write_parquet(folder: Path, rows: list[tuple[str, bytes, str]], shards: int = 2, split: str = "train") -> Path:
    """A folder of parquet shards as the hub holds a dataset: data/<split>-0000K-of-0000N.parquet, by to_parquet."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    per = (len(rows) + shards - 1) // shards
    for k in range(shards):
        write_parquet_file(folder / "data" / f"{split}-{k:05d}-of-{shards:05d}.parquet", rows[k * per:(k + 1) * per])
    return folder


def write_parquet_file(path: Path, rows: list[tuple[str, bytes, str]]) -> Path:
    _dataset(rows).to_parquet(str(path))
    return path


def write_shards(folder: Path, rows: list[tuple[str, bytes, str]], per_shard: int = 4,
                 caption: str = "txt") -> str:
    """WebDataset tar shards of `per_shard` samples (key.png, and key.txt or key.json {"caption": ...});
    returns their brace pattern, relative to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    count = (len(rows) + per_shard - 1) // per_shard
    for k in range(count):
        write_shard(folder / f"shards-{k:04d}.tar", rows[k * per_shard:(k + 1) * per_shard], caption)
    return f"shards-{{0000..{count - 1:04d}}}.tar"


def write_shard(path: Path, rows: list[tuple[str, bytes, str]], caption: str = "txt") -> Path:
    members = []
    for stem, data, text in rows:
        members += [(f"{stem}.png", data), (f"{stem}.{caption}", text.encode() if caption == "txt"
                                             else f'{{"caption": "{text}"}}'.encode())]
    return write_tar(path, members)


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            archive.addfile(info, io.BytesIO(data))
    return path


def write_files(folder: Path, rows: list[tuple[str, bytes, str]]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for stem, data, _ in rows:
        (folder / f"{stem}.png").write_bytes(data)
        out.append(folder / f"{stem}.png")
    return out


def write_csv(path: Path, images: list[str], captions: list[str], delimiter: str = ",",
              header: tuple[str, str] = ("image", "caption")) -> Path:
    """A manifest of image paths or URLs with their captions."""
    with open(path, "w", newline="", encoding="utf-8") as fp:
        writer = csv.writer(fp, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(zip(images, captions, strict=True))
    return path


def write_parquet_manifest(path: Path, images: list[str], captions: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"file_name": images, "caption": captions}), path)
    return path


def hub_cache(cache: Path, repo: str, source: Path, commit: str = "0" * 40) -> Path:
    """A hub dataset in a Hugging Face cache as huggingface_hub lays it out (datasets--org--name: refs/main, and
    snapshots/<commit>/ holding `source`'s files), for HF_HUB_OFFLINE=1 with HF_HUB_CACHE=cache."""
    import shutil

    root = cache / f"datasets--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(source, root / "snapshots" / commit, dirs_exist_ok=True)
    return root


def write_every_form(root: Path, server: FileServer) -> dict[str, Path | str]:
    """examples/tiny-data's 8 images in every form besides a folder, under `root` (which `server` serves): a
    save_to_disk folder, parquet shards, a hub dataset id in root/hub (HF_HUB_CACHE), WebDataset shards local and
    over HTTP, a CSV of URLs over HTTP, a TSV of paths and a parquet manifest. The data.datasets path of each."""
    rows = tiny_rows()
    captions = [caption for *_, caption in rows]
    write_save_to_disk(root / "hf", rows)
    hub_cache(root / "hub", "org/tiny-shapes", write_parquet(root / "pq", rows))
    pattern = write_shards(root / "wds", rows)
    images = [f"files/{p.name}" for p in write_files(root / "files", rows)]
    write_csv(root / "list.tsv", images, captions, "\t")
    write_parquet_manifest(root / "list.parquet", images, captions)
    write_csv(root / "urls.csv", [f"{server.url}/{name}" for name in images], captions)
    return {"save_to_disk": root / "hf", "parquet shards": root / "pq", "hub id": "hf://datasets/org/tiny-shapes",
            "webdataset": root / "wds" / pattern, "webdataset over http": f"{server.url}/wds/{pattern}",
            "csv of urls over http": f"{server.url}/urls.csv", "tsv of paths": root / "list.tsv",
            "parquet manifest": root / "list.parquet"}


class FileServer:
    """Serves `folder` over HTTP on 127.0.0.1 with Range requests (206), as S3, GCS and web servers answer them;
    a path under /slow/ answers after `delay` seconds. `requests` records every (method, path, Range)."""

    def __init__(self, folder: Path, delay: float = 5.0) -> None:
        self.requests: list[tuple[str, str, str]] = []
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def log_message(self, *args) -> None:
                pass

            def send_head(self):
                server.requests.append((self.command, self.path, self.headers.get("Range", "")))
                if self.path.startswith("/slow/"):
                    time.sleep(delay)
                    self.path = self.path[len("/slow"):]
                wanted = self.headers.get("Range", "")
                target = Path(self.translate_path(self.path))
                if not wanted.startswith("bytes=") or not target.is_file():
                    return super().send_head()
                size = target.stat().st_size
                first, _, last = wanted[len("bytes="):].partition("-")
                start, end = int(first), min(int(last) if last else size - 1, size - 1)
                data = target.read_bytes()[start:end + 1]
                self.send_response(206)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                return io.BytesIO(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up on /slow/ (its timeout) closed the connection: expected

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
