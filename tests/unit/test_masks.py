"""Issue 25, masked loss: mask files and alpha masks are found, read and checked; the objective lays a
mask out as the target and weights the squared error by it, so a masked-out region gets no gradient."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from zerotrain.config.sections import DataConfig, ModelConfig, ObjectiveConfig
from zerotrain.data.buckets import plan_crop
from zerotrain.data.cache import latent_mask
from zerotrain.data.dataset import discover
from zerotrain.data.images import load_mask
from zerotrain.models.catalog import resolve_model
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.objectives import choose_flip, make_objective, mse_loss

LATENT = 8  # tiny VAEs downsample 2x: 16x16-pixel images, 8x8 latents, 16 Flux tokens


def data(path, **fields) -> DataConfig:
    return DataConfig(datasets=[{"path": path}], min_image_size=8, **fields)


# ------------------------------------------------------------------------------- reading masks


def test_a_mask_file_gives_its_gray_level_and_an_alpha_mask_its_alpha(tmp_path):
    gray = np.arange(48, dtype=np.uint8).reshape(6, 8) * 5
    Image.fromarray(gray).save(tmp_path / "gray.png")
    assert np.array_equal(np.asarray(load_mask(tmp_path / "gray.png")), gray)
    colour = Image.new("RGB", (8, 6), (255, 0, 0))
    colour.save(tmp_path / "red.png")
    assert np.asarray(load_mask(tmp_path / "red.png")).max() == colour.convert("L").getpixel((0, 0)) == 76
    rgba = Image.new("RGBA", (8, 6), (255, 255, 255, 255))
    rgba.putalpha(Image.fromarray(gray))
    rgba.save(tmp_path / "cut.png")
    assert np.array_equal(np.asarray(load_mask(tmp_path / "cut.png", alpha=True)), gray)
    # A transparent pixel of a mask file is black: it is not trained.
    assert np.array_equal(np.asarray(load_mask(tmp_path / "cut.png")), gray)  # white over black, by alpha
    assert load_mask(tmp_path / "red.png", alpha=True) is None  # opaque: no mask


def test_masks_are_found_beside_their_images_and_checked(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name, size in (("a", (16, 16)), ("b", (16, 16)), ("c", (24, 16))):
        Image.new("RGB", size, (90, 90, 90)).save(folder / f"{name}.jpg")
    Image.new("L", (16, 16), 255).save(folder / "a.mask.png")
    Image.new("L", (16, 16), 255).save(folder / "c.mask.png")  # the wrong size for c.jpg
    Image.new("L", (16, 16), 255).save(folder / "gone.mask.png")  # no gone.jpg
    found = discover(data(folder, bad_files="skip", max_rejected_fraction=0.5))
    assert {item.image.name: item.mask and item.mask.name for item in found.items} == {"a.jpg": "a.mask.png",
                                                                                      "b.jpg": None}
    assert [(v.path.name, v.reason, v.rejected) for v in found.verdicts if "caption" not in v.reason] == [
        ("gone.mask.png", "mask without image", False),
        ("c.jpg", "mask c.mask.png is 16x16, its image 24x16", True),
    ]
    # data.mask=none trains unmasked, and a mask file is still no image of its own.
    plain = discover(data(folder, mask="none", bad_files="skip", max_rejected_fraction=0.5))
    assert sorted(item.image.name for item in plain.items) == ["a.jpg", "b.jpg", "c.jpg"]
    assert all(item.mask is None for item in plain.items)
    alpha = discover(data(folder, mask="alpha", bad_files="skip", max_rejected_fraction=0.5))
    assert all(item.mask == item.image and item.mask_alpha for item in alpha.items)


def test_a_manifest_line_names_its_mask(tmp_path):
    Image.new("RGB", (16, 16)).save(tmp_path / "x.png")
    Image.new("L", (16, 16), 128).save(tmp_path / "x-mask.png")
    manifest = tmp_path / "set.jsonl"
    manifest.write_text(json.dumps({"image": "x.png", "caption": "c", "mask": "x-mask.png"}) + "\n"
                        + json.dumps({"image": "x.png", "caption": "c", "mask": "absent.png"}) + "\n")
    found = discover(data(manifest, bad_files="skip", max_rejected_fraction=0.5))
    assert [item.mask.name for item in found.items] == ["x-mask.png"]
    assert [v.reason for v in found.verdicts if "caption" not in v.reason] == [f"mask {tmp_path / 'absent.png'} is missing"]


def test_the_latent_mask_is_cropped_as_its_image_and_averaged_over_each_latent_pixel():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(40, 60), dtype=np.uint8)
    mask = Image.fromarray(pixels)
    crop = plan_crop(60, 40, (32, 32), "random", __import__("random").Random(3))
    assert crop.resized_size == (48, 32) and crop.crop_left > 0  # cut from the wider side
    grid = latent_mask(mask, crop, (16, 16)).float()
    # By hand: the LANCZOS resize and crop of the image pipeline, then 2x2 means.
    resized = np.asarray(mask.resize(crop.resized_size, Image.Resampling.LANCZOS), dtype=np.float64) / 255
    cut = resized[crop.crop_top:crop.crop_top + 32, crop.crop_left:crop.crop_left + 32]
    expected = cut.reshape(16, 2, 16, 2).mean(axis=(1, 3))
    assert np.allclose(grid.numpy(), expected, atol=4e-3)  # stored in bf16
    assert torch.equal(latent_mask(None, crop, (16, 16)), torch.ones(16, 16, dtype=grid.dtype).bfloat16())


# ------------------------------------------------------------------------------- the loss


def test_the_mask_flips_with_its_sample():
    mean = torch.randn(16, 4, 4, 6)
    mask = torch.rand(16, 4, 6)
    batch = {"latent_mean": mean, "latent_std": torch.ones_like(mean), "latent_flip_mean": mean.flip(-1),
             "latent_flip_std": torch.ones_like(mean), "loss_mask": mask}
    chosen, _, laid, _ = choose_flip(batch, torch.Generator().manual_seed(0))
    flipped = [torch.equal(chosen[i], mean[i].flip(-1)) for i in range(16)]
    assert 0 < sum(flipped) < 16
    for i in range(16):
        assert torch.equal(laid[i, 0], mask[i].flip(-1) if flipped[i] else mask[i])


def test_mse_loss_weights_each_element_by_the_mask():
    pred, target = torch.zeros(2, 2, 2), torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [1.0, 1.0]]])
    mask = torch.tensor([[[1.0, 0.0], [0.5, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    # Sample 0: (1 + 0 + 0.5 * 9 + 0) / 4; sample 1: 0; averaged over the batch.
    assert mse_loss(pred, target, None, mask).item() == pytest.approx((5.5 / 4 + 0) / 2)
    assert mse_loss(pred, target, torch.tensor([2.0, 1.0]), mask).item() == pytest.approx(5.5 / 4)


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    folder = build_tiny_pipeline("tiny-flux", tmp_path_factory.mktemp("masks") / "tiny-flux")
    spec = resolve_model(ModelConfig(name_or_path=str(folder)))
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    model = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)
    return spec, scheduler, model


def flux_batch(spec, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b, shape = mask.shape[0], (mask.shape[0], spec.latent_channels, LATENT, LATENT)
    config = spec.config
    return {"latent_mean": torch.randn(shape, generator=g), "latent_std": torch.full(shape, 0.5),
            "prompt_embeds": torch.randn(b, 8, config["joint_attention_dim"], generator=g),
            "pooled_prompt_embeds": torch.randn(b, config["pooled_projection_dim"], generator=g), "loss_mask": mask}


def test_the_masked_loss_of_a_tiny_flux_step_equals_a_hand_computation(tiny_flux):
    """Flux packs 2x2 latent pixels into a token (channel c * 4 + 2 * dy + dx); the mask must weigh each
    packed element by the latent pixel it came from. The hand computation unpacks by index."""
    spec, scheduler, model = tiny_flux
    mask = torch.rand(2, LATENT, LATENT, generator=torch.Generator().manual_seed(2))
    mask[:, :, : LATENT // 2] = 0.0  # the left half of each image is masked out
    objective = make_objective(spec, scheduler, ObjectiveConfig(), 16)
    prepared = objective.prepare(flux_batch(spec, mask), torch.Generator().manual_seed(0))
    pred = model(**prepared.model_kwargs, return_dict=False)[0].detach().requires_grad_(True)
    loss = objective.loss(pred, prepared)
    error = (pred.detach() - prepared.target) ** 2  # (B, tokens, 4C)
    channels, side = spec.latent_channels, LATENT // 2
    total = torch.zeros(2, dtype=torch.float64)
    for b in range(2):
        for token in range(side * side):
            row, col = divmod(token, side)
            for c in range(channels):
                for dy in range(2):
                    for dx in range(2):
                        weight = mask[b, 2 * row + dy, 2 * col + dx]
                        total[b] += weight * error[b, token, c * 4 + 2 * dy + dx]
    expected = (total / error[0].numel()).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    # Tokens of the left half (col < side / 2) get no gradient; the others do.
    grad = pred.grad.view(2, side, side, -1)
    assert torch.count_nonzero(grad[:, :, : side // 2]) == 0
    assert torch.count_nonzero(grad[:, :, side // 2:]) == grad[:, :, side // 2:].numel()


def test_a_sample_masked_out_entirely_adds_nothing_to_the_weights_gradient(tiny_flux):
    spec, scheduler, model = tiny_flux
    objective = make_objective(spec, scheduler, ObjectiveConfig(), 16)
    mask = torch.ones(2, LATENT, LATENT)
    mask[1] = 0.0
    prepared = objective.prepare(flux_batch(spec, mask), torch.Generator().manual_seed(0))
    model.zero_grad()
    objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared).backward()
    both = [p.grad.clone() for p in model.parameters()]
    # The same step on sample 0 alone (its loss halved: the batch mean counts sample 1's zero).
    alone = {k: v[:1] if torch.is_tensor(v) and v.shape[:1] == (2,) else v for k, v in prepared.model_kwargs.items()}
    model.zero_grad()
    pred = model(**alone, return_dict=False)[0]
    (0.5 * mse_loss(pred, prepared.target[:1], None)).backward()
    for full, single in zip(both, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(full, single, atol=1e-6, rtol=1e-4)
    # Without the mask the second sample does move the weights.
    prepared.mask = None
    model.zero_grad()
    objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared).backward()
    assert any(not torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), both, strict=True))
