"""Qwen-Image 2.1 trains on two CPU ranks (gloo) on the 8 bundled images (global batch 2, 64 px: 4x4 latent tokens
through the 16x VAE), through zerotrain/train.py as a user runs it, in three runs:

    a   full fine-tune, ZeRO-2: the loss goes down, and the exported transformer loads into QwenImage21Pipeline
        with from_pretrained alone and changes its render
    b   the same run stopped by SIGTERM after a few steps and run again: the resumed run's per-step losses
        equal run a's bit for bit
    c   edit LoRA (rank 4), ZeRO-3, on examples/tiny-edit-data with two condition images a target (the gray
        shape and the swatch of its colour), each caption cached as the text encoder reads it with the two, and
        validation images of three edits through QwenImage21Pipeline: the loss goes down, the exported LoRA
        loads with load_lora_weights and changes the edit, and the ComfyUI LoRA (diffusers' names under
        diffusion_model.) loads as the same adapter

"The loss goes down" is the mean of the last 3 step losses at least 5% below the mean of the first 3
(test_train_families' rule).
"""

from __future__ import annotations

import signal

import pytest
import torch
from PIL import Image

from tests.distributed.conftest import WORLD, Trainer, interrupted, logged_steps
from tests.distributed.quiet_output import assert_quiet
from tests.distributed.test_train_edit import CONTROLS, SWATCHES, dataset, validation
from tests.distributed.test_train_families import Case, check_validation_images
from tests.distributed.test_train_z_image import assert_loss_drops

pytestmark = pytest.mark.distributed

STEPS = 10
FULL = ("model.name_or_path=tiny-qwen-image21", "training.mode=full", f"training.max_steps={STEPS}",
        "planner.stages=[2]", "planner.offload=[none]", "optimizer.lr=3e-3", "training.resume=auto",
        "training.checkpoint_every=1000", "data.text_tokens=64")
EDIT_LORA = Case("qwen-image21-edit-lora-zero3", "tiny-qwen-image21", "lora", 3, 3e-2, 12)


@pytest.fixture(scope="module")
def qwen21(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("qwen21"))


@pytest.fixture(scope="module")
def full_run(qwen21):
    return qwen21("full-zero2", *FULL).check()


def pipeline_of(folder, **components):
    from diffusers import QwenImage21Pipeline

    from zerotrain.families.qwen_image21 import load_processor

    pipeline = QwenImage21Pipeline.from_pretrained(folder, processor=load_processor(folder), **components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def render(pipeline, images=None) -> torch.Tensor:
    extra = {"image": images, "output_resolution": 64} if images else {}
    image = pipeline("paint the shape red", height=64, width=64, num_inference_steps=2, output_type="pt",
                     generator=torch.Generator().manual_seed(0), **extra).images
    assert image.shape == (1, 4, 64, 64) and torch.isfinite(image).all()  # RGBA
    return image


def edit(pipeline) -> torch.Tensor:
    return render(pipeline, [Image.open(path).convert("RGB") for path in (CONTROLS[0], SWATCHES[0])])


def test_full_finetune_zero2_learns_and_its_export_loads_with_diffusers_alone(qwen21, full_run):
    from diffusers import QwenImage21Transformer2DModel

    assert_quiet(full_run)
    assert [r["step"] for r in full_run.metrics()] == list(range(1, STEPS + 1))
    assert_loss_drops("qwen-image21-full-zero2", full_run.losses(), full_run.seconds)
    folder = qwen21.run_config().data.cache_dir / "models" / "tiny-qwen-image21"
    transformer = QwenImage21Transformer2DModel.from_pretrained(full_run.output_dir / "export" / "transformer")
    assert not torch.allclose(render(pipeline_of(folder)), render(pipeline_of(folder, transformer=transformer)))


def test_a_sigterm_and_a_rerun_give_the_uninterrupted_losses_bit_for_bit(qwen21, full_run):
    stopped, _ = interrupted(qwen21, "preempted", *FULL, after_steps=4,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert 4 <= done < STEPS, done
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = qwen21("preempted", *FULL).check()
    assert f"at step {done}" in resumed.log and "resumed from" in resumed.log, resumed.tails()
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    assert resumed.losses() == full_run.losses()


def test_an_edit_lora_with_two_condition_images_validates_and_loads_with_diffusers(qwen21, tmp_path):
    from zerotrain.export import export

    result = qwen21(EDIT_LORA.id, *EDIT_LORA.overrides(), "data.text_tokens=64", dataset("control", "swatch"),
                    validation(*[[c, s] for c, s in zip(CONTROLS, SWATCHES, strict=True)])).check()
    assert_quiet(result)
    check_validation_images(result.output_dir, EDIT_LORA)
    assert_loss_drops(EDIT_LORA.id, result.losses(), result.seconds)

    folder = qwen21.run_config().data.cache_dir / "models" / "tiny-qwen-image21"
    pipeline = pipeline_of(folder)
    before = edit(pipeline)
    pipeline.load_lora_weights(result.output_dir / "export" / "lora", adapter_name="trained")
    trained = edit(pipeline)
    assert not torch.allclose(before, trained), "the exported LoRA does not change the edit"

    out = export(result.output_dir, out=tmp_path / "comfy", comfyui=True)
    fresh = pipeline_of(folder)
    fresh.load_lora_weights(str(next((out / "comfyui").glob("*.safetensors"))))
    torch.testing.assert_close(edit(fresh), trained, rtol=1e-4, atol=1e-4)  # the same adapter
