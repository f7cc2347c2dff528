"""Issue 49 §1: one 2-rank training run (train.py on examples/tiny-cpu.yaml, ZeRO-3) whose datasets are every form
zerotrain reads besides a folder, each holding examples/tiny-data's 8 images: a save_to_disk folder, a hub dataset id
through the Hugging Face cache (HF_HUB_OFFLINE=1), WebDataset shards over HTTP, a CSV of image URLs over HTTP, a TSV
of paths and a parquet manifest. Both ranks read every source (the URLs from a server on 127.0.0.1, as an object
store answers), the cache holds the 48 images, and the run trains its steps with the default 2 DataLoader workers
per rank, which map the dataset index."""

from __future__ import annotations

import pytest

from tests.data_sources import FileServer, write_every_form

pytestmark = pytest.mark.distributed


def test_every_source_trains_on_two_ranks(train, tmp_path, monkeypatch):
    root = tmp_path / "sources"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))  # the ranks' environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with FileServer(root) as server:
        forms = write_every_form(root, server)
        datasets = [forms[name] for name in ("save_to_disk", "hub id", "webdataset over http", "csv of urls over http",
                                             "tsv of paths", "parquet manifest")]
        result = train("sources", "training.max_steps=2", "training.checkpoint_every=1000", "data.num_workers=2",
                       "data.datasets=[" + ", ".join(f"{{path: '{d}'}}" for d in datasets) + "]").check()
        fetched = {path for _, path, _ in server.requests}
    assert "48 images, 48 samples per epoch with repeats" in result.log, result.tails()
    assert "rejected" not in result.log, result.tails()
    assert [record["step"] for record in result.metrics()] == [1, 2]
    assert {f"/files/{p.name}" for p in (root / "files").iterdir()} <= fetched and "/wds/shards-0001.tar" in fetched
