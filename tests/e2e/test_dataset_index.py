"""Issue 49 §2: the dataset index (data.index). The first start writes it beside the cache; a later start reads
it instead of an image's header, and a dataset that changed is read again only where it changed: a folder by its
files' sizes and mtimes, a shard by its identity, a manifest by the files it names. Images the build rejected are
remembered, not tried again. The loader's workers map the index's rows instead of copying them. On a tiny Flux
model folder (the session's model_dir) and examples/tiny-data's 8 images."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest
import torch

import zerotrain.data.dataset as dataset_module
from tests.data_sources import TINY_DATA, tiny_rows, write_shard, write_shards
from zerotrain.config import load_config
from zerotrain.data import index as data_index
from zerotrain.data.prepare import make_loader, prepare
from zerotrain.distributed import Topology
from zerotrain.models.catalog import resolve_model

SINGLE = Topology(0, 1, 0)


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """Every header that discovery reads (data.dataset.probe), by path."""
    seen: list[str] = []
    real = dataset_module.probe

    def counting(path, *args):
        seen.append(str(path))
        return real(path, *args)

    monkeypatch.setattr(dataset_module, "probe", counting)
    return seen


def start(model_dir, path, tmp_path, *extra):
    run = load_config(None, [
        f"model.name_or_path={model_dir}", f"data.datasets=[{{path: '{path}'}}]", "data.resolution=64",
        "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0",
        "training.global_batch_size=2", *extra])
    return run, prepare(run, resolve_model(run.model), SINGLE)


def test_a_second_start_reads_the_index_and_no_image(model_dir, tmp_path, probes):
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    run, first = start(model_dir, images, tmp_path)
    assert len(probes) == 8 and first.report.latents_encoded == 8
    assert (tmp_path / "cache" / data_index.INDEX_DIR / "meta.json").is_file()
    probes.clear()
    run, second = start(model_dir, images, tmp_path)
    assert probes == [] and second.report.latents_encoded == second.report.texts_encoded == 0
    assert (second.report.latents_cached, second.report.texts_cached) == (8, 4)
    # No Python object per image: the rows are mapped from the index, the plans never read.
    assert isinstance(second.index.rows, np.memmap) and second._planned is None
    assert np.array_equal(second.samples, first.samples) and second.summary() == [
        line.replace("8 images and 4 captions encoded on this rank, 0 images and 0 captions",
                     "0 images and 0 captions encoded on this rank, 8 images and 4 captions") for line in first.summary()]
    loader, _ = make_loader(second, run, 1, SINGLE)
    batch = next(iter(loader))
    assert batch["latent_mean"].shape[0] == 1 and batch["prompt_embeds"].dtype == torch.bfloat16


@pytest.mark.parametrize("check", ["files", "folders"])
def test_a_changed_folder_is_read_again_only_where_it_changed(model_dir, tmp_path, probes, check):
    """A new image and a caption edited in place: only the new image's header is read, and only it and the two
    captions are encoded. data.index_check folders sees the new file in its folder's listing; a file rewritten
    in place alone it does not see (as documented), files does."""
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    start(model_dir, images, tmp_path, f"data.index_check={check}")
    probes.clear()
    (images / "01-green-circle.txt").write_text("an edited caption")
    _, edited = start(model_dir, images, tmp_path, f"data.index_check={check}")
    assert probes == [] and edited.report.texts_encoded == (1 if check == "files" else 0)
    shutil.copy(images / "00-red-square.png", images / "zz-new.png")
    (images / "zz-new.txt").write_text("a new caption")
    (images / "02-blue-square.txt").write_text("another edited caption")
    _, changed = start(model_dir, images, tmp_path, f"data.index_check={check}")
    assert probes == [str(images / "zz-new.png")]
    assert (changed.report.latents_encoded, changed.report.texts_encoded) == (1, 2 if check == "files" else 3)
    assert {p.item.caption for p in changed.planned} >= {"a new caption", "an edited caption", "another edited caption"}
    assert len(changed.index) == 9


def test_a_changed_shard_is_read_again_alone(model_dir, tmp_path, probes):
    rows = tiny_rows()
    pattern = write_shards(tmp_path / "wds", rows)
    start(model_dir, tmp_path / "wds" / pattern, tmp_path)
    probes.clear()
    write_shard(tmp_path / "wds" / "shards-0001.tar", [*rows[5:], rows[4]])
    _, changed = start(model_dir, tmp_path / "wds" / pattern, tmp_path)
    assert sorted(p.rsplit(":", 1)[1] for p in probes) == sorted(f"{stem}.png" for stem, *_ in rows[4:])
    assert changed.report.latents_encoded == 4


def test_a_manifest_is_checked_by_the_files_it_names(model_dir, tmp_path, probes):
    """The manifest is unchanged, an image it names is rewritten: that image alone is read and encoded again."""
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    manifest = tmp_path / "list.csv"
    manifest.write_text("image,caption\n" + "".join(f"images/{p.name},{p.with_suffix('.txt').read_text().strip()}\n"
                                                    for p in sorted(images.glob("*.png"))))
    start(model_dir, manifest, tmp_path)
    probes.clear()
    _, same = start(model_dir, manifest, tmp_path)
    assert probes == [] and same.report.latents_encoded == 0
    shutil.copy(images / "02-blue-square.png", images / "03-yellow-circle.png")
    _, changed = start(model_dir, manifest, tmp_path)
    assert probes == [str(images / "03-yellow-circle.png")] and changed.report.latents_encoded == 1


def test_images_the_build_rejected_are_remembered(model_dir, tmp_path, probes):
    """A PNG cut in its pixel data reads its header and fails to decode: the build rejects it; the next start
    reports it again without reading or encoding anything."""
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    whole = (images / "05-green-circle.png").read_bytes()
    (images / "05-green-circle.png").write_bytes(whole[:len(whole) // 2])
    _, first = start(model_dir, images, tmp_path, "data.max_rejected_fraction=0.5")
    assert [v.reason for v in first.rejected] == ["truncated"] and len(first.index) == 7
    probes.clear()
    _, second = start(model_dir, images, tmp_path, "data.max_rejected_fraction=0.5")
    assert probes == [] and second.report.latents_encoded == 0 and len(second.index) == 7
    assert f"rejected: truncated: 1: {images / '05-green-circle.png'}" in second.summary()


def test_a_planning_change_plans_every_image_again(model_dir, tmp_path, probes):
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    start(model_dir, images, tmp_path)
    probes.clear()
    start(model_dir, images, tmp_path, "data.num_workers=2", "data.max_rejected_fraction=0.2")
    assert probes == []  # fields that do not change the plan keep the index
    start(model_dir, images, tmp_path, "data.resolution=96")
    assert len(probes) == 8


def test_the_loader_s_workers_map_the_index_rather_than_copy_it(model_dir, tmp_path):
    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    start(model_dir, images, tmp_path)
    run, prepared = start(model_dir, images, tmp_path, "data.num_workers=2")
    loader, _ = make_loader(prepared, run, 1, SINGLE)
    sent = pickle.dumps(loader.dataset)  # what a spawned worker receives: where the index is, not its rows
    assert bytes(prepared.index.rows["latent"][0]) not in sent and len(sent) < 2_000, len(sent)
    copy = pickle.loads(sent)
    assert isinstance(copy.index.rows, np.memmap)
    torch.testing.assert_close(copy[3]["latent_mean"], loader.dataset[3]["latent_mean"])
    assert sum(batch["latent_mean"].shape[0] for batch in loader) == 8


def test_the_cache_size_is_stated_before_encoding_and_is_the_cache_s(model_dir, tmp_path, capsys):
    """Issue 49 §2: zerotrain cache states the cache's size on disk before it encodes anything; the figure is
    within 1% of the shards the build writes; the next start has nothing left to encode."""
    from zerotrain.cli import main
    from zerotrain.data.cost import cache_cost

    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    args = [f"model.name_or_path={model_dir}", f"data.datasets=[{{path: '{images}'}}]", "data.resolution=64",
            "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={tmp_path / 'cache'}", "data.flip=true"]
    assert main(["cache", *(a for item in args for a in ("--set", item))]) == 0
    out = capsys.readouterr().out
    statement = next(line for line in out.splitlines() if line.startswith("cache size on disk: "))
    assert out.index("cache size on disk") < out.index("encoding images"), out
    assert "for 8 images" in statement and "and 4 captions" in statement and "free at" in statement, statement
    run = load_config(None, args)
    spec = resolve_model(run.model)
    cost = cache_cost(spec, data_index.load(run.data.cache_dir), 512, True)
    written = sum(f.stat().st_size for kind in ("latents", "text") for f in (tmp_path / "cache" / kind).iterdir())
    assert abs(cost.total - written) <= 0.01 * written, (cost, written)
    assert cost.missing_bytes == 0 and not cost.at_most  # Flux's T5 embeddings are stored at full length
    assert main(["cache", *(a for item in args for a in ("--set", item))]) == 0
    assert "0 B of it still to encode" in capsys.readouterr().out


def test_a_cache_the_disk_cannot_hold_is_refused_before_encoding(model_dir, tmp_path, monkeypatch):
    import zerotrain.data.prepare as prepare_module
    from zerotrain.errors import ZerotrainError

    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    monkeypatch.setattr(prepare_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(ZerotrainError, match=r"^data.cache_dir: .*cache has 4.0 KiB free, and the cache needs .* more "
                                             r"for this dataset \(8 images, 4 captions;"):
        start(model_dir, images, tmp_path)
    assert not (tmp_path / "cache" / "latents").exists() or not any((tmp_path / "cache" / "latents").iterdir())


def test_zerotrain_plan_states_the_cache_size_from_the_index(model_dir, tmp_path, capsys):
    from zerotrain.cli import main

    images = shutil.copytree(TINY_DATA, tmp_path / "images")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {model_dir}}}\ndata: {{datasets: [{{path: '{images}'}}], resolution: 64, "
                      f"bucket_step: 16, min_image_size: 16, cache_dir: {tmp_path / 'cache'}}}\n"
                      f"planner: {{cache_dir: {tmp_path / 'facts'}}}\nhardware: {{gpus: 1, gpu_memory: 8GiB}}\n")
    main(["plan", "--config", str(config)])
    before = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cache size on disk: "))
    assert "for 8 images" in before and "and 4 captions" in before and "estimated from the datasets' listings" \
        in before, before
    assert main(["cache", "--config", str(config)]) == 0
    stated = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cache size on disk: "))
    main(["plan", "--config", str(config)])
    after = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cache size on disk: "))
    assert after.startswith(stated.split("; ")[0]) and "(the dataset index at" in after, (stated, after)
    # Before the build, each image at 64 px square: the tiny data's buckets (64x64, 48x80, 80x48) are about as large.
    from zerotrain.data.cost import cache_cost, estimate

    run = load_config(config, [])
    spec = resolve_model(run.model)
    guessed, built = estimate(run, spec), cache_cost(spec, data_index.load(run.data.cache_dir), 512, False)
    assert (guessed.images, guessed.captions) == (built.images, built.captions) == (8, 4)
    assert built.total <= guessed.total <= 1.05 * built.total, (guessed, built)
