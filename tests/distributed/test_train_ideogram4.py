"""Ideogram 4 trains on two CPU ranks (gloo) on the 8 bundled images (global batch 2, 64 px buckets), through
zerotrain/train.py as a user runs it, in three runs:

    a   full fine-tune of the conditional transformer, ZeRO-2: the loss goes down, and the exported
        transformer loads into Ideogram4Pipeline with from_pretrained alone, beside the folder's own
        unconditional transformer, and changes its render
    b   the same run stopped by SIGTERM after a few steps and run again: the resumed run's per-step
        losses equal run a's bit for bit
    c   LoRA (rank 4), ZeRO-3, validation images rendered through Ideogram4Pipeline with both
        transformers (guidance 7): the loss goes down, the exported LoRA loads with load_lora_weights
        and changes the render, and the ComfyUI (community) LoRA loads as the same adapter

"The loss goes down" is the mean of the last 3 step losses at least 5% below the mean of the first 3
(test_train_families' rule).
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.distributed.conftest import WORLD, Trainer, interrupted, logged_steps
from tests.distributed.quiet_output import assert_quiet
from tests.distributed.test_train_families import Case, check_validation_images
from tests.distributed.test_train_z_image import assert_loss_drops

pytestmark = pytest.mark.distributed

STEPS = 10
FULL = ("model.name_or_path=tiny-ideogram4", "training.mode=full", f"training.max_steps={STEPS}", "planner.stages=[2]",
        "planner.offload=[none]", "optimizer.lr=3e-3", "training.resume=auto", "training.checkpoint_every=1000")
LORA = Case("ideogram4-lora-zero3", "tiny-ideogram4", "lora", 3, 3e-2, 12)


@pytest.fixture(scope="module")
def ideogram4(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("ideogram4"))


@pytest.fixture(scope="module")
def full_run(ideogram4):
    return ideogram4("full-zero2", *FULL).check()


@pytest.fixture(scope="module")
def tiny_folder(shared_cache):
    return shared_cache / "models" / "tiny-ideogram4"


def render(pipeline) -> torch.Tensor:
    image = pipeline("a red square", height=64, width=64, num_inference_steps=2, guidance_scale=7.0,
                     guidance_schedule=None, max_sequence_length=64, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    return image


def pipeline_of(folder, **components):
    from diffusers import Ideogram4Pipeline

    pipeline = Ideogram4Pipeline.from_pretrained(folder, **components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def test_full_finetune_zero2_learns_and_its_export_loads_with_diffusers_alone(full_run, tiny_folder):
    from diffusers import Ideogram4Transformer2DModel

    assert_quiet(full_run)
    assert [r["step"] for r in full_run.metrics()] == list(range(1, STEPS + 1))
    assert_loss_drops("ideogram4-full-zero2", full_run.losses(), full_run.seconds)

    transformer = Ideogram4Transformer2DModel.from_pretrained(full_run.output_dir / "export" / "transformer")
    before = render(pipeline_of(tiny_folder))
    trained = pipeline_of(tiny_folder, transformer=transformer)
    assert torch.equal(trained.unconditional_transformer.input_proj.weight,
                       Ideogram4Transformer2DModel.from_pretrained(tiny_folder, subfolder="unconditional_transformer")
                       .input_proj.weight)  # untouched: only the conditional transformer trains
    assert not torch.allclose(before, render(trained))


def test_a_sigterm_and_a_rerun_give_the_uninterrupted_losses_bit_for_bit(ideogram4, full_run):
    stopped, _ = interrupted(ideogram4, "preempted", *FULL, after_steps=4,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert 4 <= done < STEPS, done
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = ideogram4("preempted", *FULL).check()
    assert f"at step {done}" in resumed.log and "resumed from" in resumed.log, resumed.tails()
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    assert resumed.losses() == full_run.losses()


def test_a_lora_validates_with_both_transformers_and_loads_with_diffusers(train, tiny_folder, tmp_path):
    from zerotrain.export import export

    result = train(LORA.id, *LORA.overrides()).check()
    assert_quiet(result)
    check_validation_images(result.output_dir, LORA)
    assert_loss_drops(LORA.id, result.losses(), result.seconds)

    pipeline = pipeline_of(tiny_folder)
    before = render(pipeline)
    pipeline.load_lora_weights(result.output_dir / "export" / "lora", adapter_name="trained")
    assert pipeline.transformer.layers[0].attention.to_q.scaling["trained"] == 1.0  # alpha defaults to the rank
    assert not hasattr(pipeline.unconditional_transformer.layers[0].attention.to_q, "scaling")  # not adapted
    assert not torch.allclose(before, render(pipeline))

    out = export(result.output_dir, out=tmp_path / "comfy", comfyui=True)
    fresh = pipeline_of(tiny_folder)
    fresh.load_lora_weights(next((out / "comfyui").glob("*.safetensors")))
    torch.testing.assert_close(render(fresh), render(pipeline), rtol=1e-4, atol=1e-4)  # the same adapter
