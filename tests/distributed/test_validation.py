"""Validation images rendered by a real two-rank DeepSpeed engine (validation_worker.py): before and
after one optimizer step, under ZeRO-2 and ZeRO-3 (whose partitioned parameters DeepSpeed gathers
inside every forward, so a rank that made fewer forwards than the other would hang), full and LoRA.

Three jobs on two ranks: rank 0 renders jobs 0 and 2, rank 1 job 1 and a padding job. The images
must be real PNGs of the configured size with their metadata, and the step-0 images (the weights as
loaded) must be the images a plain single-process render of the same model gives: exactly under
ZeRO-2, within bf16 rounding under ZeRO-3 (DeepSpeed replaces torch.nn.functional.linear with its
own matmul-then-bias there, memory_efficient_linear). Each image is compared with every reference
image, so an image written under another job's name fails too. After the training step the images
must change: the render sees the trained weights, not stale ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.distributed.conftest import CONFIG, TINY_DATA, run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("validation_worker.py")
PROMPT = "a photo of a cat"
SEEDS = [5, 6, 7]
NAMES = [f"{i:02d}-seed{seed}.png" for i, seed in enumerate(SEEDS)]
VALIDATION = [f"validation.prompts=['{PROMPT}']", f"validation.seeds={SEEDS}", "validation.steps=2"]
# Every tiny parameter is below ZeRO-3's default persistence threshold (100,000 elements), and
# persistent parameters are kept whole on every rank: nothing would be gathered in a forward, and
# ranks making different numbers of forwards would go unnoticed. Partition them all.
PARTITION_ALL = "planner.stage3_param_persistence_threshold=0"
SIZE = 64  # examples/tiny-cpu.yaml's data.resolution
# A hang (ranks making different numbers of ZeRO-3 forwards) must fail the test, not stall it:
# a run takes 20-50 s on two busy cores.
TIMEOUT_S = 300
# Mean absolute difference (of 255) allowed between a ZeRO-3 render and the plain one: measured
# 0.33 (tiny-flux) and 0.8 (tiny-sdxl); another seed differs by ~45.
ZERO3_TOLERANCE = 2.0
CASES = [("tiny-flux", 2, "full"), ("tiny-flux", 3, "full"), ("tiny-flux", 3, "lora"),
         ("tiny-sdxl", 3, "full")]


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode == "RGB", path
        return np.asarray(image).astype(np.int16)


@pytest.fixture(scope="module")
def references(shared_cache, tmp_path_factory):
    """name -> the jobs' images as a plain (no DeepSpeed) single-process render gives them."""
    import torch

    from zerotrain.config import load_config
    from zerotrain.distributed import Topology
    from zerotrain.engine import load_denoiser
    from zerotrain.models.catalog import resolve_model
    from zerotrain.sampling import Validator

    rendered: dict[str, list[np.ndarray]] = {}

    def reference(name: str) -> list[np.ndarray]:
        if name not in rendered:
            folder = shared_cache / "models" / name
            dataset = f"data.datasets=[{{path: '{TINY_DATA}'}}]"
            run = load_config(CONFIG, [f"model.name_or_path={name}", dataset, *VALIDATION])
            spec = resolve_model(run.model)
            validator = Validator(spec, folder, run, Topology(0, 1, 0), torch.device("cpu"))
            out = tmp_path_factory.mktemp(f"reference-{name}")
            paths = validator.render(load_denoiser(spec, folder), 0, out)
            rendered[name] = [pixels(path) for path in paths[:len(SEEDS)]]
        return rendered[name]

    return reference


@pytest.mark.parametrize(("name", "stage", "mode"), CASES, ids=[f"{n}-zero{s}-{m}" for n, s, m in CASES])
def test_ranks_render_the_validation_images(shared_cache, references, tmp_path, name, stage, mode):
    out = tmp_path / "run"
    args = [sys.executable, "-u", str(WORKER), str(shared_cache / "models" / name), str(out), str(stage),
            f"model.name_or_path={name}", f"training.mode={mode}", PARTITION_ALL, *VALIDATION]
    returncodes, logs, seconds = run_ranks(args, tmp_path / "logs", "validation", timeout=TIMEOUT_S)
    tails = "\n".join(f"--- rank {rank} ---\n{log.read_text(errors='replace')[-3000:]}"
                      for rank, log in enumerate(logs))
    assert returncodes == [0, 0], \
        f"exit codes {returncodes} after {seconds:.0f} s (a hang is killed at {TIMEOUT_S} s):\n{tails}"
    print(f"{name} ZeRO-{stage} {mode}: {seconds:.1f} s")

    rank0, rank1 = (log.read_text(errors="replace") for log in logs)
    renders = {}
    for step in (0, 1):
        folder = out / "validation" / f"step-{step:08d}"
        assert f"validation: 3 images at step {step} -> {folder}" in rank0, tails
        assert "validation:" not in rank1, "only rank 0 reports and writes"
        assert sorted(p.name for p in folder.iterdir()) == sorted([*NAMES, "grid.png"])
        images = []
        for name_, seed in zip(NAMES, SEEDS, strict=True):
            with Image.open(folder / name_) as image:
                assert image.size == (SIZE, SIZE)
                assert {k: image.text.get(k) for k in ("prompt", "seed", "step", "steps", "model")} == \
                    {"prompt": PROMPT, "seed": str(seed), "step": str(step), "steps": "2", "model": name}
            images.append(pixels(folder / name_))
            assert images[-1].std() > 5.0, f"{folder / name_} is blank"
        grid = pixels(folder / "grid.png")
        assert grid.shape == (2 * SIZE, 2 * SIZE, 3)
        assert np.array_equal(grid[:SIZE, :SIZE], images[0]) and np.array_equal(grid[:SIZE, SIZE:], images[1])
        assert np.array_equal(grid[SIZE:, :SIZE], images[2]) and not grid[SIZE:, SIZE:].any()
        renders[step] = images

    reference = references(name)
    for i, image in enumerate(renders[0]):
        differences = [float(np.abs(image - ref).mean()) for ref in reference]
        if stage < 3:
            assert np.array_equal(image, reference[i]), \
                f"{NAMES[i]}: {differences[i]:.3f} from the plain render"
        else:
            assert differences[i] < ZERO3_TOLERANCE, f"{NAMES[i]}: {differences[i]:.3f} from the plain render"
        others = [d for j, d in enumerate(differences) if j != i]
        assert min(others) > 10 * ZERO3_TOLERANCE, \
            f"{NAMES[i]} is as close to another seed's image: {differences}"
    for i, (before, after) in enumerate(zip(renders[0], renders[1], strict=True)):
        assert not np.array_equal(before, after), f"{NAMES[i]}: the training step did not change the image"
