"""A million images that start in seconds (issue 49 §2): the dataset index's first build, a resumed start, and the
RSS per process with 2 DataLoader workers, for one dataset of N entries in three forms: a folder (N images and N
captions in 1,000 subfolders), parquet (100 shards, images embedded as the datasets Image feature) and WebDataset
(100 tar shards, key.png + key.txt). The images are 4,096 real PNG files (48 to 96 px, 3 aspect ratios) and 4,096
captions, repeated under distinct keys: in the folder as hard links (distinct paths, so distinct cache keys), in
the shards as copies of their bytes. Every form holds the same N entries.

Per form, each in a fresh process (the index's files in the page cache, as on a node that trained yesterday; the
resumed starts measured again with --resumed-only on a quiet machine, 3 each, the median kept; the folder with
both data.index_check settings):
  first       rank 0's index build (data.prepare.stage: discover every image's header, plan, write the index)
  resumed     prepare() over a cache that holds every entry, as a resumed run's start does, then make_loader with
              2 workers and 8 batches read; its seconds, and each process's RSS and USS (its private pages) with
              the workers' own, against the plan's figure (planner.dataset_entry_bytes per entry per process)
The cache's tensors for N entries are written once per form by the benchmark itself (one element each, under the
keys the index planned, in shards of 64 as a build writes them; encoding a million images on 2 CPU cores would
take hours and the tiny model's real latents 64 GB of disk, and a start maps the shards' names, never their
tensors). The loader's 8 batches are read from those tensors, so its figures are the loader's, not a real batch's.

--before PATH runs the same first build with the code at PATH (a git worktree of an earlier commit, which reads
folders only and has no index, so that every start was a first build): its seconds and RSS.

    python benchmarks/dataset_index.py [--entries 1000000] [--forms folder,parquet,webdataset] [--before /tmp/old]

Writes benchmarks/results/dataset_index.json. Goal: a resumed start in under 10 s on the 2-core machine, and at
most 200 bytes of metadata per entry per process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTINCT = 4096
SIZES = [(64, 64), (48, 80), (80, 48), (96, 96)]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def distinct_files(root: Path) -> list[tuple[bytes, str]]:
    """DISTINCT real PNGs (a colour gradient each) and captions."""
    import numpy as np
    from PIL import Image

    out = []
    for i in range(DISTINCT):
        width, height = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([(x * 255 // width + i) % 256, (y * 255 // height + 7 * i) % 256,
                           np.full_like(x, i % 256)], axis=-1).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "PNG")
        out.append((buffer.getvalue(), f"a gradient number {i % 997}, tile {i % 13}"))
    return out


def make_folder(root: Path, n: int, files: list[tuple[bytes, str]]) -> Path:
    folder = root / "folder"
    if (folder / ".complete").is_file():
        return folder
    originals = root / "originals"
    originals.mkdir(parents=True, exist_ok=True)
    for i, (png, caption) in enumerate(files):
        (originals / f"{i}.png").write_bytes(png)
        (originals / f"{i}.txt").write_text(caption)
    for i in range(n):
        sub = folder / f"{i // 1000:04d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        for suffix in (".png", ".txt"):
            os.link(originals / f"{i % DISTINCT}{suffix}", sub / f"{i:07d}{suffix}")
    (folder / ".complete").write_text("")
    return folder


def make_parquet(root: Path, n: int, files: list[tuple[bytes, str]], shards: int = 100) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "parquet"
    if (folder / ".complete").is_file():
        return folder
    (folder / "data").mkdir(parents=True, exist_ok=True)
    per = n // shards
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for k in range(shards):
        rows = range(k * per, (k + 1) * per if k < shards - 1 else n)
        images = pa.array([{"bytes": files[i % DISTINCT][0], "path": None} for i in rows], type=image_type)
        table = pa.table({"image": images, "text": [files[i % DISTINCT][1] for i in rows]})
        pq.write_table(table, folder / "data" / f"train-{k:05d}-of-{shards:05d}.parquet", row_group_size=1000)
    (folder / ".complete").write_text("")
    return folder


def make_shards(root: Path, n: int, files: list[tuple[bytes, str]], shards: int = 100) -> str:
    folder = root / "webdataset"
    pattern = f"shards-{{0000..{shards - 1:04d}}}.tar"
    if (folder / ".complete").is_file():
        return str(folder / pattern)
    folder.mkdir(parents=True, exist_ok=True)
    per = n // shards
    for k in range(shards):
        with tarfile.open(folder / f"shards-{k:04d}.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
            for i in range(k * per, (k + 1) * per if k < shards - 1 else n):
                png, caption = files[i % DISTINCT]
                for name, data in ((f"{i:07d}.png", png), (f"{i:07d}.txt", caption.encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    archive.addfile(info, io.BytesIO(data))
    (folder / ".complete").write_text("")
    return str(folder / pattern)


# --------------------------------------------------------------------------------------------------
# The children: each measures in a process of its own.

def child_overrides(path: str, cache: Path, models: Path) -> list[str]:
    return ["model.name_or_path=tiny-flux", f"data.datasets=[{{path: '{path}'}}]", "data.resolution=64",
            "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={cache}", "data.num_workers=2",
            "training.global_batch_size=8", f"planner.cache_dir={models}",
            *(["data.index_check=folders"] if os.environ.get("ZEROTRAIN_BENCH_CHECK") == "folders" else [])]


def memory(pid: int) -> dict[str, int]:
    from benchmarks.loader_workers_ram import smaps

    rollup = smaps(pid)
    return {"rss": rollup.get("Rss", 0), "uss": rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
            "pss": rollup.get("Pss", 0)}


def planned_run(path: str, cache: Path, models: Path):
    """The child's run config, model spec and encoders' identity (the same calls in the code before the index)."""
    from zerotrain.config import load_config
    from zerotrain.data.cache import encode_dtype, model_folder
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.models.conditioning import encoders_identity

    run = load_config(None, child_overrides(path, cache, models))
    spec = resolve_model(run.model)
    return run, spec, encoders_identity(spec, model_folder(spec, run, Topology(0, 1, 0), "encode"), encode_dtype("cpu"))


def run_first(path: str, cache: Path, models: Path) -> dict:
    """Rank 0's first index build, alone."""
    from zerotrain.data.prepare import stage

    run, spec, identity = planned_run(path, cache, models)
    before = memory(os.getpid())
    start = time.perf_counter()
    stage(run, spec, identity)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 1), "memory_before": before, "memory_after": memory(os.getpid())}


def fill_cache(path: str, cache: Path, models: Path) -> dict:
    """The cache's shards for every entry the index planned (zeros of the tiny model's shapes, written through
    data.cache.write_shard as a build writes them), and the index's shard names looked up (a start's refresh)."""
    import numpy as np
    import torch

    from zerotrain.data import index as data_index
    from zerotrain.data.cache import SHARD_ITEMS, write_shard

    index = data_index.load(cache)
    start = time.perf_counter()
    # Keys whose shard is gone (a cache removed under its index) are written again too.
    present = {kind: set(os.listdir(cache / kind)) if (cache / kind).is_dir() else set() for kind in ("latents", "text")}
    gone = {kind: np.array([name not in present[kind] for name in names] or [True])
            for kind, names in (("latents", index.latent_shards), ("text", index.text_shards))}
    latent_rows = np.flatnonzero((index.rows["latent_shard"] == data_index.ABSENT)
                                 | gone["latents"][np.maximum(index.rows["latent_shard"], 0)])
    # One element each: a start maps the shards' names, never their tensors (a million of the tiny model's real
    # latents would take 64 GB of disk).
    mean = torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    for chunk in range(0, len(latent_rows), SHARD_ITEMS):
        tensors = {}
        for row in latent_rows[chunk:chunk + SHARD_ITEMS]:
            key = index.latent_key(int(row))
            tensors[f"{key}.mean"], tensors[f"{key}.std"] = mean.clone(), mean.clone()
        write_shard(cache / "latents", 0, tensors)
    text_rows = np.flatnonzero((index.texts["shard"] == data_index.ABSENT) | gone["text"][np.maximum(index.texts["shard"], 0)])
    keys = sorted({index.text_key(t) for t in text_rows.tolist()})
    embeds, pooled = torch.ones(1, 1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    for chunk in range(0, len(keys), SHARD_ITEMS):
        write_shard(cache / "text", 0, {f"{key}.{name}": value for key in keys[chunk:chunk + SHARD_ITEMS]
                                        for name, value in (("prompt_embeds", embeds.clone()),
                                                            ("pooled_prompt_embeds", pooled.clone()))}, trim=True)
    from zerotrain.data.cache import write_index

    write_index(cache)
    return {"seconds": round(time.perf_counter() - start, 1), "latents": len(latent_rows), "texts": len(keys)}


def run_resumed(path: str, cache: Path, models: Path) -> dict:
    """A start over a cache that holds every entry, then a loader with 2 workers reading 8 batches."""
    from zerotrain.config import load_config
    from zerotrain.data.prepare import make_loader, prepare
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.memory import dataset_index_bytes

    topo = Topology(0, 1, 0)
    run = load_config(None, child_overrides(path, cache, models))
    spec = resolve_model(run.model)
    before = memory(os.getpid())
    start = time.perf_counter()
    prepared = prepare(run, spec, topo)
    seconds = time.perf_counter() - start
    assert prepared.report.latents_encoded == 0, "the cache should hold every entry"
    after_prepare = memory(os.getpid())
    loader, _ = make_loader(prepared, run, 1, topo)
    batches = iter(loader)
    for _ in range(8):
        next(batches)
    workers = [memory(w.pid) for w in batches._workers]
    main = memory(os.getpid())
    entries = len(prepared.index)
    sampler = loader.batch_sampler
    held = {"index rows (mapped)": prepared.index.rows.nbytes, "index texts (mapped)": prepared.index.texts.nbytes,
            "samples": prepared.samples.nbytes,
            "sampler": sum(a.nbytes for a in sampler._members.values()) + sampler._groups.nbytes
            + sum(a.nbytes for a in (sampler._texts or ())) + (0 if sampler._choices is None else sampler._choices.nbytes)}
    return {"seconds": round(seconds, 2), "entries": entries, "samples": len(prepared.samples),
            "memory_before": before, "memory_after_prepare": after_prepare, "memory_with_loader": main,
            "workers": workers, "arrays": held, "array_bytes_per_entry": round(sum(held.values()) / entries, 1),
            "planned_bytes_per_process": dataset_index_bytes(entries),
            "planned_bytes_per_entry": round(dataset_index_bytes(entries) / entries, 1)}


def run_before(path: str, cache: Path, models: Path) -> dict:
    """The code before the index (a worktree on sys.path first): every start discovered and planned every image."""
    from zerotrain.data.cache import plan_items
    from zerotrain.data.dataset import discover

    run, spec, identity = planned_run(path, cache, models)
    before = memory(os.getpid())
    start = time.perf_counter()
    discovery = discover(run.data)
    planned, _ = plan_items(discovery, run, spec, identity)
    seconds = time.perf_counter() - start
    after = memory(os.getpid())
    return {"seconds": round(seconds, 1), "entries": len(planned), "memory_before": before, "memory_after": after,
            "uss_per_entry": round((after["uss"] - before["uss"]) / max(1, len(planned)), 1)}


CHILDREN = {"first": run_first, "fill": fill_cache, "resumed": run_resumed, "before": run_before}


def child(kind: str, path: str, cache: Path, models: Path, tree: Path, check: str = "files") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(tree),
           "ZEROTRAIN_BENCH_CHECK": check}
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--path", path, "--cache", str(cache),
                          "--models", str(models), "--tree", str(tree)], env=env, capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"{kind} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--forms", default="folder,parquet,webdataset")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/zerotrain-dataset-index"))
    parser.add_argument("--before", type=Path, help="a worktree of the code before the index")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dataset_index.json")
    parser.add_argument("--resumed-only", action="store_true",
                        help="measure the resumed starts again (3 each, the median kept) over the caches a full run "
                             "left, on a quiet machine, and update --out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(args.tree))
        sys.path.insert(1, str(REPO))
        print(json.dumps(CHILDREN[args.child](args.path, args.cache, args.models)))
        return
    root = args.workdir / str(args.entries)
    root.mkdir(parents=True, exist_ok=True)
    if args.resumed_only:
        results = json.loads(args.out.read_text())
        for form, entry in results["forms"].items():
            for check in ("files", "folders") if form == "folder" else ("files",):
                cache = root / f"cache-{form}"
                warm = child("resumed", entry["path"], cache, args.workdir / "models", REPO, check)
                runs = sorted((child("resumed", entry["path"], cache, args.workdir / "models", REPO, check)
                               for _ in range(3)), key=lambda r: r["seconds"])
                key = "resumed" if check == "files" else "resumed_index_check_folders"
                entry[key] = {**runs[1], "seconds_of_3": [r["seconds"] for r in runs],
                              "first_start_in_this_mode_seconds": warm["seconds"]}
                log(f"{form} ({check}): resumed start {[r['seconds'] for r in runs]} s")
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        return
    models = args.workdir / "models"
    files = distinct_files(root)
    makers = {"folder": lambda: str(make_folder(root, args.entries, files)),
              "parquet": lambda: str(make_parquet(root, args.entries, files)),
              "webdataset": lambda: make_shards(root, args.entries, files)}
    results: dict = {"entries": args.entries, "distinct_files": DISTINCT, "machine": platform.node(),
                     "cpus": os.cpu_count(), "forms": {}}
    if args.out.is_file():  # a run that stopped part-way: the forms it finished are kept
        results = json.loads(args.out.read_text())
    for form in args.forms.split(","):
        if "resumed" in results["forms"].get(form, {}):
            continue
        log(f"{form}: writing {args.entries:,} entries")
        start = time.perf_counter()
        path = makers[form]()
        written = round(time.perf_counter() - start, 1)
        cache = root / f"cache-{form}"
        if (cache / "dataset-index").exists():
            import shutil

            shutil.rmtree(cache / "dataset-index")
        log(f"{form}: first index build")
        first = child("first", path, cache, models, REPO)
        log(f"{form}: first build {first['seconds']} s; writing the cache's tensors")
        filled = child("fill", path, cache, models, REPO)
        child("resumed", path, cache, models, REPO)  # the start after the build: the index learns the shards
        log(f"{form}: resumed start")
        resumed = child("resumed", path, cache, models, REPO)
        log(f"{form}: resumed start {resumed['seconds']} s, arrays {resumed['array_bytes_per_entry']} B per entry")
        results["forms"][form] = {"path": path, "written_seconds": written, "first": first, "cache": filled,
                                  "resumed": resumed}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.before is not None and "folder" in results["forms"] and "before" not in results["forms"]["folder"]:
        log("folder: the code before the index")
        before = child("before", results["forms"]["folder"]["path"], root / "cache-before", models, args.before)
        results["forms"]["folder"]["before"] = before
        log(f"before: {before['seconds']} s")
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
