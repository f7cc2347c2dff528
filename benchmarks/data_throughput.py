"""Data-side throughput with the tiny models on this machine: building the cache (images/s and
captions/s, one process) and reading it back through make_loader's DataLoader (samples/s, with 0
and 2 workers). Prints a summary and writes benchmarks/results/data_throughput.json.

    python benchmarks/data_throughput.py [--images 200] [--size 256] [--resolution 128] [--model tiny-flux]

Images are generated: smooth gradients plus noise, the long side --size px, five aspect ratios
(1:1, 4:3, 3:4, 16:9, 9:16), alternately PNG and JPEG, with sidecar captions (one in four repeats an
earlier caption). The cache is built with prepare() as `zerotrain cache` builds it, in four passes:

    full       empty cache: every caption and image encoded
    images     latents/ removed: only the images encoded again
    captions   text/ removed: only the captions encoded again
    cached     nothing missing: discovery, planning and the cache check only

Each pass includes what every run of `zerotrain cache` pays (discovering and probing the files,
planning buckets and keys, and, when anything is missing, loading the encoders), so images/s and
captions/s are end to end; the *_encode_only rates subtract the cached pass and the encoder load.

The tiny models stand in for real ones, so the figures are not those of a real VAE or T5; even so,
the tiny VAE's mid-block attention over the whole latent (64x64 tokens at 128 px) takes about 80% of
the images pass on the 2-core CPU machine, and decoding and resizing about 6% (cProfile)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

ASPECTS = [(1, 1), (4, 3), (3, 4), (16, 9), (9, 16)]
WORDS = ["cat", "dog", "boat", "mountain", "city", "chair", "lake", "portrait", "sunset", "rain", "neon", "forest"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_images(folder: Path, count: int, size: int) -> int:
    """Write the images and captions; returns the number of distinct captions."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    captions: list[str] = []
    for i in range(count):
        aw, ah = ASPECTS[i % len(ASPECTS)]
        width, height = (size, size * ah // aw) if aw >= ah else (size * aw // ah, size)
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / width, y * 255 / height, np.full_like(x, (i * 37) % 256)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        stem = folder / f"img{i:04d}"
        if i % 2:
            Image.fromarray(pixels).save(stem.with_suffix(".jpg"), "JPEG", quality=90)
        else:
            Image.fromarray(pixels).save(stem.with_suffix(".png"), "PNG")
        if i % 4 == 3:
            caption = captions[int(rng.integers(len(captions)))]
        else:
            picked = rng.choice(WORDS, size=3, replace=False)
            caption = f"a photo of a {picked[0]} near a {picked[1]} with a {picked[2]}, number {i}"
        captions.append(caption)
        stem.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return len(set(captions))


def timed_prepare(run, spec, topo):
    from zerotrain.data.prepare import prepare

    start = time.perf_counter()
    prepared = prepare(run, spec, topo, "cpu")
    return prepared, time.perf_counter() - start


def loader_epochs(prepared, run, topo, workers: int, micro_batch: int, warm_epochs: int = 5) -> dict:
    """samples/s of the first epoch (which starts the workers) and of the next warm_epochs together."""
    from zerotrain.data.prepare import make_loader

    run = run.model_copy(deep=True)
    run.data.num_workers = workers
    loader, sampler = make_loader(prepared, run, micro_batch, topo)
    out = {}
    for label, epochs in (("first_epoch", [0]), ("warm_epochs", list(range(1, 1 + warm_epochs)))):
        samples = 0
        start = time.perf_counter()
        for epoch in epochs:
            sampler.set_epoch(epoch)
            for batch in loader:
                samples += batch["latent_mean"].shape[0]
        seconds = time.perf_counter() - start
        out[label] = {"epochs": len(epochs), "samples": samples, "seconds": round(seconds, 3),
                      "samples_per_s": round(samples / seconds, 1)}
    del loader  # stops persistent workers
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--size", type=int, default=256, help="long side of the generated images, px")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--model", default="tiny-flux", choices=["tiny-flux", "tiny-sd3", "tiny-sdxl"])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--note", default="", help="free text stored in the results (e.g. local patches)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_throughput.json")
    args = parser.parse_args()

    import torch

    from zerotrain.config import load_config
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.models.conditioning import load_encoders
    from zerotrain.models.tiny import build_tiny_pipeline

    topo = Topology(0, 1, 0)
    with tempfile.TemporaryDirectory(prefix="zt-data-bench-") as tmp:
        work = Path(tmp)
        model = build_tiny_pipeline(args.model, work / "model")
        unique_captions = make_images(work / "images", args.images, args.size)
        cache = work / "cache"
        run = load_config(None, [
            f"model.name_or_path={model}", f"data.datasets=[{{path: {work / 'images'}}}]",
            f"data.resolution={args.resolution}", f"data.cache_dir={cache}", "data.num_workers=0",
            f"training.global_batch_size={args.micro_batch}"])
        spec = resolve_model(run.model)

        start = time.perf_counter()
        load_encoders(spec, model)
        encoder_load_s = time.perf_counter() - start

        passes = {}
        prepared, passes["full"] = timed_prepare(run, spec, topo)
        report = prepared.report
        assert report.latents_encoded == args.images and report.texts_encoded == unique_captions, report
        for name, folder in (("images", "latents"), ("captions", "text")):
            shutil.rmtree(cache / folder)
            (cache / "index.json").unlink()
            _, passes[name] = timed_prepare(run, spec, topo)
        prepared, passes["cached"] = timed_prepare(run, spec, topo)
        assert (prepared.report.latents_encoded, prepared.report.texts_encoded) == (0, 0)
        cache_bytes = sum(p.stat().st_size for p in cache.rglob("*.safetensors"))

        overhead = passes["cached"] + encoder_load_s
        build = {
            "images": args.images, "unique_captions": unique_captions,
            "seconds": {k: round(v, 2) for k, v in passes.items()}, "encoder_load_s": round(encoder_load_s, 2),
            "images_per_s": round(args.images / passes["images"], 1),
            "captions_per_s": round(unique_captions / passes["captions"], 1),
            "images_per_s_encode_only": round(args.images / max(passes["images"] - overhead, 1e-9), 1),
            "captions_per_s_encode_only": round(unique_captions / max(passes["captions"] - overhead, 1e-9), 1),
            "full_build_items_per_s": round(args.images / passes["full"], 1),
            "cache_mib": round(cache_bytes / 2**20, 2),
        }
        loader = {"micro_batch": args.micro_batch, "samples_per_epoch": len(prepared.samples),
                  "workers": {str(w): loader_epochs(prepared, run, topo, w, args.micro_batch) for w in (0, 2)}}

    result = {
        "device": f"CPU only: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads",
        "model": args.model, "resolution": args.resolution, "image_long_side": args.size,
        "cache_build": build, "loader": loader,
        "note": "cache_build rates are end to end per pass (discovery, planning, encoder load included); "
                "*_encode_only subtract the cached pass and the encoder load. The loader's first epoch "
                "includes starting the workers." + (f" {args.note}" if args.note else ""),
    }
    print(f"device: {result['device']}")
    print(f"cache build ({args.model}, {args.images} images of {args.size} px at resolution {args.resolution}, "
          f"{unique_captions} captions): full {passes['full']:.1f} s; images {build['images_per_s']} /s "
          f"({build['images_per_s_encode_only']} /s encode only); captions {build['captions_per_s']} /s "
          f"({build['captions_per_s_encode_only']} /s encode only); cache {build['cache_mib']} MiB")
    for workers, rows in loader["workers"].items():
        print(f"loader, {workers} workers, batch {args.micro_batch}: first epoch "
              f"{rows['first_epoch']['samples_per_s']} samples/s, then {rows['warm_epochs']['samples_per_s']} "
              f"samples/s over {rows['warm_epochs']['epochs']} epochs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
