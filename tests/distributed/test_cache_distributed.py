"""`zerotrain cache` on two processes builds the same cache as on one, each rank encoding its share.

A tiny-flux model folder (build_tiny_pipeline) and 12 real image files (PNG and JPEG, 48 to 160 px,
three aspect ratios, some at least twice their bucket so that load_rgb decodes them reduced, one
smaller than its bucket so that it is upscaled) with sidecar captions, two of them shared by
several images. The cache is built into two folders by `python -m zerotrain.cli cache`:

    cache_1   one process
    cache_2   two processes (RANK 0/1, WORLD_SIZE 2, gloo on 127.0.0.1)

and the two are compared key by key. Equality is up to bf16 rounding: the CPU VAE's fp32 output
depends on the batch size by ~5e-7 (a batch of 3 or 1 against one of 4), and the ranks' batches
differ from the single process's, because each rank takes every other missing item of a bucket.
After rounding to the stored bf16 the tensors are bit-identical or (with batches of 1 or 3)
a few differ in their last bits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT_S = 300
# (width, height, format, caption); the tiny VAE downsamples 2x and Flux packs 2x2, so bucket sides
# are multiples of 16 at resolution 64: 48x80, 64x64 and 80x48.
IMAGES = [
    (64, 64, "PNG", "a photo of a cat sitting on a red chair"),
    (48, 48, "JPEG", "a photo of a cat sitting on a red chair"),  # upscaled to 64x64
    (128, 128, "PNG", "an oil painting of mountains at sunset"),  # decoded at half size
    (160, 160, "JPEG", "a photo of a cat sitting on a red chair"),  # JPEG draft decode at half size
    (96, 64, "JPEG", "close-up portrait of a dog"),
    (160, 96, "PNG", "the city skyline at night"),
    (150, 90, "JPEG", "a small boat on the lake"),
    (120, 72, "PNG", "an oil painting of mountains at sunset"),
    (64, 96, "PNG", "a watercolor sketch"),
    (96, 160, "JPEG", "neon signs and rain"),
    (90, 150, "PNG", "a red chair"),
    (72, 120, "JPEG", "mountains at night"),
]
UNIQUE_CAPTIONS = len({caption for *_, caption in IMAGES})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_images(folder: Path) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, (width, height, fmt, caption) in enumerate(IMAGES):
        # Smooth colour gradients plus noise: compressible like a photo, not constant.
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        stem = folder / f"img{i:02d}"
        Image.fromarray(pixels).save(stem.with_suffix(".png" if fmt == "PNG" else ".jpg"), fmt)
        stem.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")


def write_config(path: Path, model: Path, images: Path, cache_dir: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"datasets": [{"path": str(images)}], "resolution": 64, "bucket_step": 16, "min_image_size": 16,
                 "cache_dir": str(cache_dir), "num_workers": 0},
        "training": {"global_batch_size": 2},
    }))
    return path


def launch(config: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "zerotrain.cli", "cache", "--config", str(config)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=config.parent)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict:
    """Build cache_1 (one process) and cache_2 (two ranks) at the same time."""
    from zerotrain.models.tiny import build_tiny_pipeline

    work = tmp_path_factory.mktemp("cache_distributed")
    model = build_tiny_pipeline("tiny-flux", work / "model")
    write_images(work / "images")
    configs = {n: write_config(work / f"run{n}.yaml", model, work / "images", work / f"cache_{n}") for n in (1, 2)}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        env.pop(name, None)
    ranks_env = {**env, "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    logs = {"single": work / "single.log", **{f"rank{r}": work / f"rank{r}.log" for r in range(WORLD)}}
    procs = {"single": launch(configs[1], logs["single"], env)}
    for rank in range(WORLD):
        procs[f"rank{rank}"] = launch(configs[2], logs[f"rank{rank}"],
                                      {**ranks_env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    deadline = time.monotonic() + TIMEOUT_S
    # A rank that fails leaves the other waiting at the barrier: stop everything then.
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline \
            and not any(p.poll() not in (None, 0) for p in procs.values()):
        time.sleep(0.2)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    tails = "\n".join(f"--- {name} ---\n{log.read_text()[-3000:]}" for name, log in logs.items())
    codes = {name: p.returncode for name, p in procs.items()}
    if any(codes.values()):
        pytest.fail(f"zerotrain cache exited with {codes}:\n{tails}")
    return {"work": work, "config2": configs[2], "one": work / "cache_1", "two": work / "cache_2",
            "logs": {name: log.read_text() for name, log in logs.items()}}


def shard_tensors(root: Path) -> dict[str, dict[str, list[str]]]:
    """kind -> shard file name -> tensor names, from the shards on disk (not index.json)."""
    from safetensors import safe_open

    out: dict[str, dict[str, list[str]]] = {}
    for kind in ("latents", "text"):
        out[kind] = {}
        for shard in sorted((root / kind).glob("*.safetensors")):
            with safe_open(shard, framework="pt") as handle:
                out[kind][shard.name] = list(handle.keys())
    return out


def load_all(root: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for kind in ("latents", "text"):
        for shard in sorted((root / kind).glob("*.safetensors")):
            tensors.update(load_file(shard))
    return tensors


def test_both_builds_report_every_image(caches):
    for name in ("single", "rank0"):
        ready = f"cache ready at {caches[{'single': 'one', 'rank0': 'two'}[name]]}: {len(IMAGES)} images"
        assert ready in caches["logs"][name], caches["logs"][name][-2000:]
    assert "cache ready" not in caches["logs"]["rank1"]  # only rank 0 reports
    assert not any(caches["one"].glob("*/*.tmp")) and not any(caches["two"].glob("*/*.tmp"))


def test_indexes_hold_the_same_keys(caches):
    one = json.loads((caches["one"] / "index.json").read_text())
    two = json.loads((caches["two"] / "index.json").read_text())
    assert len(one["latents"]) == len(IMAGES)
    assert len(one["text"]) == UNIQUE_CAPTIONS
    assert set(two["latents"]) == set(one["latents"])
    assert set(two["text"]) == set(one["text"])


def test_tensors_equal_up_to_bf16_rounding(caches):
    import torch

    one, two = load_all(caches["one"]), load_all(caches["two"])
    assert set(one) == set(two)
    assert len(one) == 2 * len(IMAGES) + 2 * UNIQUE_CAPTIONS  # mean + std; prompt_embeds + pooled
    differ = []
    for name in sorted(one):
        a, b = one[name], two[name]
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, name
        if not torch.equal(a, b):
            differ.append(name)
            # One bf16 step relative (2**-8 of the value, 2**-7 to be safe) or tiny near zero.
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-10, msg=lambda m, n=name: f"{n}: {m}")
    # Batch-size effects flip only the last bit of a few tensors; many differing would mean other inputs.
    assert len(differ) <= len(one) // 4, f"{len(differ)} of {len(one)} tensors differ: {differ}"


def test_two_ranks_each_encoded_their_share_once(caches):
    shards = shard_tensors(caches["two"])
    for kind, expected in (("latents", len(IMAGES)), ("text", UNIQUE_CAPTIONS)):
        ranks = {name.split("-", 1)[0] for name in shards[kind]}
        assert ranks == {"0000", "0001"}, f"{kind} shards {sorted(shards[kind])} are not from both ranks"
        holders: dict[str, set[str]] = {}
        for shard, names in shards[kind].items():
            for name in names:
                holders.setdefault(name.split(".", 1)[0], set()).add(shard)
        twice = {key: sorted(s) for key, s in holders.items() if len(s) > 1}
        assert not twice, f"{kind}: keys encoded by more than one shard: {twice}"
        assert len(holders) == expected
        assert sum(len(names) for names in shards[kind].values()) == 2 * expected
        # Ranks take whole same-bucket batches (of up to 4) in turn: both work, within a batch of each other.
        per_rank = Counter(next(iter(s)).split("-", 1)[0] for s in holders.values())
        assert min(per_rank.values()) > 0 and max(per_rank.values()) - min(per_rank.values()) <= 4, per_rank


def test_two_rank_cache_is_complete_for_one_process(caches):
    """A later single-process prepare() on the two-rank cache finds everything and loads it."""
    from zerotrain.config import load_config
    from zerotrain.data.prepare import make_loader, prepare
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model

    run = load_config(caches["config2"], [])
    topo = Topology(0, 1, 0)
    prepared = prepare(run, resolve_model(run.model), topo, "cpu")
    assert (prepared.report.latents_encoded, prepared.report.texts_encoded) == (0, 0)
    assert len(prepared.planned) == len(IMAGES) and not prepared.rejected
    loader, sampler = make_loader(prepared, run, micro_batch=2, topo=topo)
    batches = list(loader)
    assert len(batches) == len(sampler) > 0
    batch = batches[0]
    assert batch["latent_mean"].shape[0] == 2 and batch["latent_mean"].shape == batch["latent_std"].shape
    assert batch["prompt_embeds"].shape[:2] == (2, 512) and batch["pooled_prompt_embeds"].shape[0] == 2
