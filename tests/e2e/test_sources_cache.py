"""Issue 49 §1 end to end: `zerotrain cache` over each form a dataset is shared in (a save_to_disk folder, parquet
shards, a hub dataset id through the Hugging Face cache, WebDataset shards local and over HTTP, CSV/TSV/parquet
manifests of paths and of URLs over HTTP) on a tiny Flux model folder. Each cache holds examples/tiny-data's 8
images, their latents those of the same images read from the folder; a changed shard re-encodes only its own
images."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.data_sources import (
    TINY_DATA,
    FileServer,
    tiny_rows,
    write_every_form,
    write_parquet,
    write_parquet_file,
    write_shard,
    write_shards,
)
from zerotrain.cli import main
from zerotrain.config import load_config
from zerotrain.data.cache import CachedDataset
from zerotrain.data.prepare import prepare
from zerotrain.distributed import Topology
from zerotrain.models.catalog import resolve_model

SINGLE = Topology(0, 1, 0)
ROWS = tiny_rows()
SOURCES = ["save_to_disk", "parquet shards", "hub id", "webdataset", "webdataset over http", "csv of urls over http",
           "tsv of paths", "parquet manifest"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every form, written once; the HTTP forms served from 127.0.0.1."""
    root = tmp_path_factory.mktemp("sources")
    with FileServer(root) as server:
        yield root, write_every_form(root, server)


def overrides(model_dir, path, cache) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"data.datasets=[{{path: '{path}'}}]", "data.resolution=64",
            "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={cache}", "data.num_workers=0",
            "training.global_batch_size=2"]


def cache_command(args: list[str], capsys) -> str:
    assert main(["cache", *(a for item in args for a in ("--set", item))]) == 0
    return capsys.readouterr().out


def by_caption(run) -> dict[str, torch.Tensor]:
    """Each cached image's latent mean, by its caption (read back through prepare: nothing is encoded again)."""
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    assert prepared.report.latents_encoded == 0 and prepared.report.texts_encoded == 0
    dataset = CachedDataset(prepared.planned, run.data.cache_dir)
    return {p.item.caption: dataset[i]["latent_mean"] for i, p in enumerate(prepared.planned)}


@pytest.fixture(scope="module")
def from_folder(model_dir, tmp_path_factory):
    run = load_config(None, overrides(model_dir, TINY_DATA, tmp_path_factory.mktemp("folder_cache")))
    prepare(run, resolve_model(run.model), SINGLE)
    return by_caption(run)


@pytest.mark.parametrize("source", SOURCES)
def test_each_source_through_zerotrain_cache(model_dir, served, from_folder, source, tmp_path, capsys, monkeypatch):
    root, paths = served
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))  # HF_HUB_CACHE, HF_HUB_OFFLINE=1
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    args = overrides(model_dir, paths[source], tmp_path / "cache")
    out = cache_command(args, capsys)
    assert "8 images, 8 samples per epoch" in out and "rejected" not in out, out
    assert "cache: 8 images and 4 captions encoded on this rank" in out, out
    cached = by_caption(load_config(None, args))
    assert cached.keys() == from_folder.keys()
    for caption, latent in cached.items():
        torch.testing.assert_close(latent, from_folder[caption], atol=2e-2, rtol=0)


@pytest.mark.parametrize("form", ["webdataset", "parquet shards"])
def test_a_changed_shard_re_encodes_only_its_own_images(model_dir, form, tmp_path, capsys):
    """Items of a packed source are keyed by shard, key and the shard's identity: a rewritten shard re-encodes
    its 4 images, the other shard's 4 come from the cache."""
    if form == "webdataset":
        path = tmp_path / "wds" / write_shards(tmp_path / "wds", ROWS)
        changed, rewrite = tmp_path / "wds" / "shards-0001.tar", write_shard
    else:
        path = write_parquet(tmp_path / "pq", ROWS)
        changed, rewrite = tmp_path / "pq" / "data" / "train-00001-of-00002.parquet", write_parquet_file
    args = overrides(model_dir, path, tmp_path / "cache")
    assert "cache: 8 images and 4 captions encoded" in cache_command(args, capsys)
    before = changed.stat().st_mtime_ns
    rewrite(changed, [*ROWS[5:], ROWS[4]])  # the second shard's images in another order
    assert changed.stat().st_mtime_ns != before
    out = cache_command(args, capsys)
    assert "cache: 4 images and 0 captions encoded on this rank, 4 images and 4 captions already cached" in out, out
    shutil.rmtree(tmp_path / "cache")
