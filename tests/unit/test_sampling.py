"""Validation images (zerotrain/sampling.py): the job split that keeps every rank's denoiser forwards
identical, when images are due, the grid, and single-process renders of the tiny Flux, SD3 and SDXL
models through their diffusers pipelines (files, sizes, metadata, determinism per seed); each family's render
against its own pipeline is test_families.py's table."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zerotrain.config.sections import ValidationConfig
from zerotrain.sampling import assign_jobs, grid_shape, is_due, make_grid, make_jobs

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "tiny-cpu.yaml"
TINY_DATA = REPO / "examples" / "tiny-data"
PROMPTS = ["a photo of a cat", "a boat on the lake"]


# --- jobs, due, grid ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_jobs", "world", "expected"), [
    (3, 2, [[0, 2], [1, None]]),
    (4, 2, [[0, 2], [1, 3]]),
    (1, 3, [[0], [None], [None]]),
    (5, 1, [[0, 1, 2, 3, 4]]),
    (0, 2, [[], []]),
    (7, 3, [[0, 3, 6], [1, 4, None], [2, 5, None]]),
])
def test_assign_jobs_examples(n_jobs, world, expected):
    assert assign_jobs(n_jobs, world) == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n_jobs", range(12))
def test_assign_jobs_renders_every_job_once_and_the_same_count_everywhere(n_jobs, world):
    ranks = assign_jobs(n_jobs, world)
    assert len(ranks) == world
    assert {len(jobs) for jobs in ranks} == {math.ceil(n_jobs / world)}
    real = [index for jobs in ranks for index in jobs if index is not None]
    assert sorted(real) == list(range(n_jobs))
    for rank, jobs in enumerate(ranks):
        assert all(index % world == rank for index in jobs if index is not None)
        # padding only after a rank's real jobs
        assert jobs == sorted(jobs, key=lambda index: index is None)


def test_assign_jobs_rejects_nonsense():
    with pytest.raises(ValueError):
        assign_jobs(3, 0)
    with pytest.raises(ValueError):
        assign_jobs(-1, 2)


def test_jobs_are_prompt_major():
    jobs = make_jobs(["a", "b"], [3, 7, 9])
    assert [(j.index, j.prompt_index, j.prompt, j.seed) for j in jobs] == [
        (0, 0, "a", 3), (1, 0, "a", 7), (2, 0, "a", 9), (3, 1, "b", 3), (4, 1, "b", 7), (5, 1, "b", 9)]
    assert make_jobs([], [0]) == [] and make_jobs(["a"], []) == []


def test_due():
    config = ValidationConfig(prompts=["a"], every=5)
    assert is_due(config, 0, 20, resumed=False)
    assert not is_due(config, 0, 20, resumed=True)
    assert [s for s in range(1, 21) if is_due(config, s, 20, resumed=False)] == [5, 10, 15, 20]
    assert [s for s in range(1, 23) if is_due(config, s, 22, resumed=True)] == [5, 10, 15, 20, 22]

    ends_only = ValidationConfig(prompts=["a"])
    assert [s for s in range(11) if is_due(ends_only, s, 10, resumed=False)] == [0, 10]
    quiet = ValidationConfig(prompts=["a"], every=3, at_start=False, at_end=False)
    assert [s for s in range(11) if is_due(quiet, s, 10, resumed=False)] == [3, 6, 9]
    for nothing in (ValidationConfig(every=1), ValidationConfig(prompts=["a"], seeds=[], every=1)):
        assert not any(is_due(nothing, s, 10, resumed=False) for s in range(11))


@pytest.mark.parametrize(("n", "shape"), [(1, (1, 1)), (2, (1, 2)), (3, (2, 2)), (4, (2, 2)), (5, (2, 3)),
                                          (9, (3, 3)), (10, (3, 4))])
def test_grid_shape(n, shape):
    assert grid_shape(n) == shape


def test_make_grid_places_images_row_major():
    images = [np.full((4, 6, 3), 10 * (i + 1), dtype=np.uint8) for i in range(3)]
    grid = make_grid(images)
    assert grid.shape == (8, 12, 3) and grid.dtype == np.uint8
    assert (grid[:4, :6] == 10).all() and (grid[:4, 6:] == 20).all() and (grid[4:, :6] == 30).all()
    assert (grid[4:, 6:] == 0).all()
    with pytest.raises(ValueError, match="image 1"):
        make_grid([images[0], np.zeros((5, 6, 3), dtype=np.uint8)])


# --- renders of the tiny models ----------------------------------------------------------------------


class RecordingWriter:
    """Stands in for a TensorBoard SummaryWriter: records add_image calls."""

    def __init__(self):
        self.images = []

    def add_image(self, tag, image, step, dataformats):
        self.images.append((tag, np.asarray(image).copy(), step, dataformats))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def make_validator(models: Path, name: str, *overrides: str):
    from zerotrain.config import load_config
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.models.tiny import ensure_tiny_pipeline
    from zerotrain.sampling import Validator

    folder = ensure_tiny_pipeline(name, models)
    run = load_config(CONFIG, [f"model.name_or_path={name}", f"data.datasets=[{{path: '{TINY_DATA}'}}]",
                               "validation.steps=2", *overrides])
    spec = resolve_model(run.model)
    return spec, folder, Validator(spec, folder, run, Topology(0, 1, 0), torch.device("cpu"))


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image).astype(np.int16)


def check_image(path: Path, size: int | tuple[int, int], text: dict[str, str]) -> np.ndarray:
    """A non-blank RGB PNG of `size` (side, or width and height) carrying `text`; its pixels."""
    size = (size, size) if isinstance(size, int) else size
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode == "RGB" and image.size == size, path
        assert {key: image.text.get(key) for key in text} == text, path
    array = pixels(path)
    assert array.std() > 5.0, f"{path} is blank (std {array.std():.2f})"
    return array


def test_flux_render(models, tmp_path, capsys):
    from zerotrain.engine import load_denoiser

    spec, folder, validator = make_validator(models, "tiny-flux", f"validation.prompts={PROMPTS}",
                                             "validation.seeds=[0, 1]", "validation.every=3")
    assert validator.resolution == 64 and validator.guidance_scale == 3.5 and not validator.cfg
    assert validator.due(0, 9, resumed=False) and validator.due(3, 9, resumed=False)
    assert not validator.due(0, 9, resumed=True) and not validator.due(4, 9, resumed=False)
    model = load_denoiser(spec, folder)
    model.train()
    rng = torch.get_rng_state()
    writer = RecordingWriter()

    paths = validator.render(model, 3, tmp_path, writer)

    step_dir = tmp_path / "validation" / "step-00000003"
    names = ["00-seed0.png", "01-seed1.png", "02-seed0.png", "03-seed1.png", "grid.png"]
    assert paths == [step_dir / name for name in names]
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(names), "stray (temporary?) files"
    common = {"step": "3", "steps": "2", "guidance_scale": "3.5", "model": "tiny-flux"}
    images = [check_image(path, 64, {"prompt": PROMPTS[i // 2], "seed": str(i % 2), **common})
              for i, path in enumerate(paths[:4])]
    grid = check_image(paths[4], 128, common)
    rows = [np.concatenate(images[:2], axis=1), np.concatenate(images[2:], axis=1)]
    assert np.array_equal(grid, np.concatenate(rows, axis=0)), "grid.png is not the 2x2 grid of the images"
    assert f"validation: 4 images at step 3 -> {step_dir}" in capsys.readouterr().out

    # Seeds and prompts both change the image; the model is left as it was, without gradients.
    assert np.abs(images[0] - images[1]).mean() > 10, "another seed should give another image"
    assert not np.array_equal(images[0], images[2]), "another prompt should give another image"
    assert model.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng), "rendering moved the global RNG training draws from"

    tags = [(tag, step, formats, image.shape) for tag, image, step, formats in writer.images]
    assert tags == [("validation/grid", 3, "HWC", (128, 128, 3))] + [
        (f"validation/{i:02d}", 3, "HWC", (64, 64, 3)) for i in range(4)]
    for (_, logged, _, _), image in zip(writer.images[1:], images, strict=True):
        assert np.array_equal(logged, image)

    # The same seed gives the same image again, and an eval-mode model stays in eval mode.
    model.eval()
    again = validator.render(model, 4, tmp_path)
    assert not model.training
    for first, second in zip(paths, again, strict=True):
        assert np.array_equal(pixels(first), pixels(second)), second


def test_sdxl_negative_prompt(models, tmp_path):
    """StableDiffusionXLPipeline without a negative prompt uses zero embeddings
    (force_zeros_for_empty_prompt); a negative prompt is encoded and changes the image."""
    from zerotrain.engine import load_denoiser

    prompt = "validation.prompts=['a photo of a cat']"
    spec, folder, plain = make_validator(models, "tiny-sdxl", prompt)
    _, _, negative = make_validator(models, "tiny-sdxl", prompt, "validation.negative_prompt='blurry, dark'")
    assert all(not value.any() for value in plain.negative_embeds.values())
    assert all(value.abs().sum() > 0 for value in negative.negative_embeds.values())
    model = load_denoiser(spec, folder)
    a, b = plain.render(model, 0, tmp_path / "a")[0], negative.render(model, 0, tmp_path / "b")[0]
    assert not np.array_equal(pixels(a), pixels(b))
    with Image.open(b) as image:
        assert image.text["negative_prompt"] == "blurry, dark"


def test_sd3_without_guidance_runs_no_cfg(models, tmp_path):
    from zerotrain.engine import load_denoiser

    spec, folder, validator = make_validator(models, "tiny-sd3", "validation.prompts=['a photo of a cat']",
                                             "validation.guidance_scale=1.0")
    assert not validator.cfg and validator.negative_embeds == {}
    paths = validator.render(load_denoiser(spec, folder), 2, tmp_path)
    image = check_image(paths[0], 64, {"guidance_scale": "1.0"})
    with Image.open(paths[0]) as png:
        assert "negative_prompt" not in png.text
    assert image.shape == (64, 64, 3)


def test_resolution_must_suit_the_model(models):
    from zerotrain.errors import ZerotrainError

    with pytest.raises(ZerotrainError, match=r"validation.resolution=66: .* multiple of 4"):
        make_validator(models, "tiny-flux", "validation.prompts=['a']", "validation.resolution=66")


def test_no_prompts_renders_nothing(models, tmp_path):
    _, _, validator = make_validator(models, "tiny-flux")
    assert not validator.due(0, 10, resumed=False) and not validator.due(10, 10, resumed=False)
    assert validator.render(torch.nn.Linear(1, 1), 10, tmp_path) == []
    assert not (tmp_path / "validation").exists()
