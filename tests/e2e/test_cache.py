"""The cache end to end on a tiny Flux model folder saved with save_pretrained: cached tensors
equal a direct encode, a changed image or caption re-encodes only itself, a build killed halfway
resumes, and the loader reads batches from the cache with the global-epoch sampler."""

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import zerotrain.data.cache as cache_module
from zerotrain.cli import main
from zerotrain.config import load_config
from zerotrain.data.buckets import apply_crop
from zerotrain.data.cache import CachedDataset, read_index, shard_index
from zerotrain.data.images import load_rgb
from zerotrain.data.prepare import make_loader, prepare
from zerotrain.distributed import Topology
from zerotrain.models.catalog import resolve_model
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts, load_encoders

SINGLE = Topology(0, 1, 0)
SIZES = [(96, 64), (64, 96), (80, 80), (128, 64), (64, 64), (100, 75)]


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for n, size in enumerate(SIZES):
        gradient = Image.linear_gradient("L").resize(size).convert("RGB")
        gradient.putpixel((n, n), (255, 0, 0))
        gradient.save(folder / f"img{n}.png")
        (folder / f"img{n}.txt").write_text(f"caption number {n % 4}")
    return folder


def run_config(model_dir, images, tmp_path, *extra):
    return load_config(None, [
        f"model.name_or_path={model_dir}", f"data.datasets=[{{path: {images}}}]", "data.resolution=64",
        "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_workers=0", "training.global_batch_size=2", *extra])


def test_cached_tensors_equal_a_direct_encode(model_dir, images, tmp_path):
    run = run_config(model_dir, images, tmp_path)
    spec = resolve_model(run.model)
    prepared = prepare(run, spec, SINGLE)
    assert prepared.report.latents_encoded == len(SIZES) and prepared.report.texts_encoded == 4
    dataset = CachedDataset(prepared.planned, run.data.cache_dir)
    encoders = load_encoders(spec, model_dir)
    for i, planned in enumerate(prepared.planned):
        sample = dataset[i]
        cropped = apply_crop(load_rgb(planned.item.image), planned.crop)
        pixels = torch.from_numpy(np.asarray(cropped, dtype=np.float32))
        mean, std = encode_latent_moments(encoders, pixels.permute(2, 0, 1)[None] / 127.5 - 1)
        # The cache encodes in batches and stores bf16 (3 significant digits); a lone encode
        # differs from a batched one in the last float32 bits.
        assert torch.allclose(sample["latent_mean"].float(), mean[0], rtol=1e-2, atol=1e-3)
        assert torch.allclose(sample["latent_std"].float(), std[0], rtol=1e-2, atol=1e-3)
        direct = encode_prompts(encoders, [planned.item.caption], 512)
        for name in ("prompt_embeds", "pooled_prompt_embeds"):
            assert torch.allclose(sample[name].float(), direct[name][0], rtol=1e-2, atol=1e-3), name
        assert tuple(sample["target_size"].tolist()) == planned.crop.bucket[::-1]
        assert tuple(sample["original_size"].tolist()) == planned.crop.original_size[::-1]


def test_a_changed_image_or_caption_reencodes_only_itself(model_dir, images, tmp_path):
    run = run_config(model_dir, images, tmp_path)
    spec = resolve_model(run.model)
    prepare(run, spec, SINGLE)
    again = prepare(run, spec, SINGLE)
    assert (again.report.latents_encoded, again.report.texts_encoded) == (0, 0)
    (images / "img1.txt").write_text("a brand new caption")
    Image.new("RGB", SIZES[2], (9, 99, 199)).save(images / "img2.png")
    changed = prepare(run, spec, SINGLE)
    assert (changed.report.latents_encoded, changed.report.texts_encoded) == (1, 1)
    index = read_index(run.data.cache_dir)
    assert all(p.latent_key in index["latents"] and p.text_key in index["text"] for p in changed.planned)


def test_a_killed_build_resumes_and_never_trusts_a_partial_shard(model_dir, images, tmp_path, monkeypatch):
    run = run_config(model_dir, images, tmp_path)
    spec = resolve_model(run.model)
    monkeypatch.setattr(cache_module, "SHARD_ITEMS", 2)
    real_write = cache_module.write_shard
    written = []

    def dying_write(folder, rank, tensors, **kwargs):
        if folder.name == "latents" and len(written) == 1:
            # The process dies while writing: a partial temporary is left behind.
            (folder / "0000-dead.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        path = real_write(folder, rank, tensors, **kwargs)
        if folder.name == "latents":
            written.append(path)
        return path

    monkeypatch.setattr(cache_module, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        prepare(run, spec, SINGLE)
    survived = len(shard_index(run.data.cache_dir / "latents"))
    assert 0 < survived < len(SIZES)
    monkeypatch.setattr(cache_module, "write_shard", real_write)
    resumed = prepare(run, spec, SINGLE)
    assert resumed.report.latents_cached == survived  # the complete shard was kept
    assert resumed.report.latents_encoded == len(SIZES) - survived
    assert not list((run.data.cache_dir / "latents").glob("*.tmp"))


def test_large_images_decode_reduced_and_still_cache(model_dir, tmp_path):
    """A photo many times its bucket is decoded in draft mode / reduced; the crop still fits."""
    folder = tmp_path / "big"
    folder.mkdir()
    Image.linear_gradient("L").resize((400, 300)).convert("RGB").save(folder / "big.jpg", quality=95)
    Image.linear_gradient("L").resize((300, 400)).convert("RGB").save(folder / "big.png")
    run = run_config(model_dir, folder, tmp_path)
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    assert prepared.report.latents_encoded == 2 and not prepared.rejected
    dataset = CachedDataset(prepared.planned, run.data.cache_dir)
    for i, planned in enumerate(prepared.planned):
        assert tuple(dataset[i]["target_size"].tolist()) == planned.crop.bucket[::-1]


def test_flipped_latents_are_cached_mirrored(model_dir, images, tmp_path):
    run = run_config(model_dir, images, tmp_path, "data.flip=true")
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    sample = CachedDataset(prepared.planned, run.data.cache_dir, flip=True)[0]
    assert sample["latent_flip_mean"].shape == sample["latent_mean"].shape
    # A VAE is close to equivariant under a horizontal flip.
    mirrored = torch.flip(sample["latent_mean"].float(), dims=[-1])
    assert torch.corrcoef(torch.stack([mirrored.flatten(), sample["latent_flip_mean"].float().flatten()]))[0, 1] > 0.5


def test_loader_reads_one_bucket_per_batch_from_the_cache(model_dir, images, tmp_path):
    run = run_config(model_dir, images, tmp_path, "data.datasets=[{path: " + str(images) + ", repeats: 2}]")
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    assert len(prepared.samples) == 2 * len(SIZES)
    loader, sampler = make_loader(prepared, run, micro_batch=1, topo=SINGLE)
    sampler.set_epoch(0)
    batches = list(loader)
    assert len(batches) == sampler.plan().steps * 2 and batches
    assert prepared.epoch(2).steps == sampler.plan().steps
    for batch in batches:
        assert batch["latent_mean"].shape[0] == 1 and batch["prompt_embeds"].dtype == torch.bfloat16
        height, width = batch["target_size"][0].tolist()
        assert batch["latent_mean"].shape[-2:] == (height // 2, width // 2)  # tiny VAE: factor 2


def cache_command(model_dir, images, tmp_path, capsys, extra: str = "") -> str:
    """zerotrain cache --config run.yaml over the folder `images` (`extra`: more of the data section, then more
    YAML); its output."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {model_dir}}}\n"
                      f"data: {{datasets: [{{path: {images}}}], resolution: 64, bucket_step: 16, min_image_size: 16, "
                      f"cache_dir: {tmp_path / 'cache'}{extra}}}\n")
    assert main(["cache", "--config", str(config)]) == 0
    return capsys.readouterr().out


def test_cache_command_prints_summary_and_histogram(model_dir, images, tmp_path, capsys):
    (images / "broken.png").write_bytes(b"")
    out = cache_command(model_dir, images, tmp_path, capsys, ", max_rejected_fraction: 0.5")
    assert "rejected: empty file: 1" in out
    assert "x" in out and "%" in out  # the bucket histogram
    assert "cache ready" in out
    # Six images in several buckets cannot fill a global batch of 8 from one bucket.
    assert "warning: training.global_batch_size=8: no bucket holds a whole global batch" in out
    shutil.rmtree(tmp_path / "cache")


def test_caption_variants_and_the_empty_caption_are_cached_and_read_as_the_sampler_chooses(model_dir, images,
                                                                                          tmp_path):
    """Issue 25: each image's tag orders are encoded once each, the empty caption once for all, and
    a (sample, choice) pair reads the chosen text's embedding; the loader's batches follow the
    sampler's choices."""
    for n in range(len(SIZES)):
        (images / f"img{n}.txt").write_text(f"tag{n}, red, box, gradient")
    run = run_config(model_dir, images, tmp_path, "data.caption_dropout=0.3",
                     f"data.datasets=[{{path: {images}, shuffle_tags: 3, keep_tags: 1}}]")
    spec = resolve_model(run.model)
    prepared = prepare(run, spec, SINGLE)
    variants = sum(len(p.text_keys) for p in prepared.planned)
    assert variants > len(SIZES) and prepared.report.texts_encoded == variants + 1  # + the empty caption
    assert len({p.empty_key for p in prepared.planned}) == 1
    dataset = CachedDataset(prepared.planned, run.data.cache_dir)
    encoders = load_encoders(spec, model_dir)
    planned = prepared.planned[0]
    for choice, text in [(-1, ""), *enumerate(planned.item.texts)]:
        direct = encode_prompts(encoders, [text], 512)
        sample = dataset[(0, choice)]
        assert torch.allclose(sample["prompt_embeds"].float(), direct["prompt_embeds"][0], rtol=1e-2, atol=1e-3)
    loader, sampler = make_loader(prepared, run, 1, SINGLE)
    choices = sampler.text_choices()
    assert choices is not None and set(choices.tolist()) <= {-1, *range(max(len(p.text_keys) for p in prepared.planned))}
    first = next(iter(loader))
    [(index, choice)] = next(iter(sampler))
    expected = dataset[(index, choice)]
    assert torch.equal(first["prompt_embeds"][0], expected["prompt_embeds"])


def test_a_datasets_loss_weight_reaches_the_batches(model_dir, images, tmp_path):
    run = run_config(model_dir, images, tmp_path, f"data.datasets=[{{path: {images}, loss_weight: 0.5}}]")
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    loader, _ = make_loader(prepared, run, 1, SINGLE)
    assert [batch["loss_weight"].tolist() for batch in loader] == [[0.5]] * len(loader)
    plain = run_config(model_dir, images, tmp_path)
    loader, _ = make_loader(prepare(plain, resolve_model(plain.model), SINGLE), plain, 1, SINGLE)
    assert "loss_weight" not in next(iter(loader))


def test_masks_are_cached_on_the_latent_grid_and_reach_the_batches(model_dir, images, tmp_path):
    """Issue 25: img0.mask.png weights img0's loss; it is cropped with its image, averaged onto the latent
    grid and cached with the latents; an unmasked image of the same run gets ones; unmasked_weight lifts
    the black."""
    pixels = np.zeros((64, 96), dtype=np.uint8)
    pixels[:, 60:] = 255
    pixels[10:20, :] = 128
    Image.fromarray(pixels).save(images / "img0.mask.png")
    run = run_config(model_dir, images, tmp_path, "data.unmasked_weight=0.25")
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    assert len(prepared.planned) == len(SIZES)  # the mask is no image of its own
    dataset = CachedDataset(prepared.planned, run.data.cache_dir, masks=True, unmasked_weight=0.25)
    by_name = {p.item.image.name: i for i, p in enumerate(prepared.planned)}
    masked, plain = dataset[by_name["img0.png"]], dataset[by_name["img1.png"]]
    planned = prepared.planned[by_name["img0.png"]]
    cut = np.asarray(apply_crop(Image.fromarray(pixels), planned.crop), dtype=np.float64) / 255
    h, w = masked["latent_mean"].shape[-2:]
    expected = 0.25 + 0.75 * cut.reshape(h, cut.shape[0] // h, w, cut.shape[1] // w).mean(axis=(1, 3))
    assert np.allclose(masked["loss_mask"].numpy(), expected, atol=4e-3)
    assert masked["loss_mask"].min() == pytest.approx(0.25) and masked["loss_mask"].max() == pytest.approx(1.0)
    assert torch.equal(plain["loss_mask"], torch.ones(plain["latent_mean"].shape[-2:]))
    loader, _ = make_loader(prepared, run, 1, SINGLE)
    assert all(batch["loss_mask"].shape == batch["latent_mean"][:, 0].shape for batch in loader)
    # A changed mask is a new latent key (the latents are encoded again with it); no mask, no key change.
    Image.fromarray(255 - pixels).save(images / "img0.mask.png")
    again = prepare(run, resolve_model(run.model), SINGLE)
    assert again.report.latents_encoded == 1


def test_an_alpha_channel_is_the_mask_with_data_mask_alpha(model_dir, tmp_path):
    folder = tmp_path / "cutouts"
    folder.mkdir()
    alpha = np.zeros((64, 64), dtype=np.uint8)
    alpha[16:48, 16:48] = 255
    image = Image.new("RGBA", (64, 64), (200, 30, 30, 255))
    image.putalpha(Image.fromarray(alpha))
    image.save(folder / "cut.png")
    Image.new("RGB", (64, 64), (0, 90, 0)).save(folder / "opaque.png")
    run = run_config(model_dir, folder, tmp_path, "data.mask=alpha")
    prepared = prepare(run, resolve_model(run.model), SINGLE)
    dataset = CachedDataset(prepared.planned, run.data.cache_dir, masks=True)
    samples = {p.item.image.name: dataset[i] for i, p in enumerate(prepared.planned)}
    expected = alpha.reshape(32, 2, 32, 2).mean(axis=(1, 3)) / 255
    assert np.allclose(samples["cut.png"]["loss_mask"].numpy(), expected)
    assert torch.equal(samples["opaque.png"]["loss_mask"], torch.ones(32, 32))


def test_the_cache_command_reads_kohya_repeat_folders_and_says_so(model_dir, images, tmp_path, capsys):
    """Issue 49: a kohya train_data_dir (10_subject/, 1_class/) through zerotrain cache: each folder's images
    count N times in the epoch, and the summary names the folders. Every image is encoded once."""
    root = tmp_path / "train_data_dir"
    for folder, names in (("10_ohwx", ["img0", "img1"]), ("1_class", ["img2", "img3", "img4"])):
        (root / folder).mkdir(parents=True)
        for name in names:
            for suffix in (".png", ".txt"):
                shutil.copy(images / f"{name}{suffix}", root / folder / f"{name}{suffix}")
    out = cache_command(model_dir, root, tmp_path, capsys, "}\ntraining: {global_batch_size: 1")
    assert "5 images, 23 samples per epoch with repeats" in out, out
    assert ("data.datasets[0]: kohya repeat folders, each image counted N times: 10_ohwx x10, 1_class x1 "
            "(data.datasets[0].folder_repeats: false reads them as plain folders)") in out, out
    assert "cache ready at" in out and ": 5 images, 23 samples per epoch" in out, out
