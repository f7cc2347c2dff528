"""FLUX.3 [klein] Base trains on two CPU ranks (gloo), through zerotrain/train.py as a user runs it, in three runs:

    a   text-to-image full fine-tune, ZeRO-2, on the 8 bundled images (global batch 2, 64 px): the loss goes
        down, and the exported transformer loads into diffusers' FLUX.3 blocks with from_pretrained alone and
        changes their render
    b   the same run stopped by SIGTERM after a few steps and run again: the resumed run's per-step losses
        equal run a's bit for bit
    c   edit LoRA (rank 4), ZeRO-3, on examples/tiny-edit-data with two references a target (the gray shape
        and the swatch), validation images through the blocks with both: the loss goes down, the exported LoRA
        loads with load_lora_weights and changes the edit, and the ComfyUI (BFL layout) LoRA loads as the
        same adapter

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
FULL = ("model.name_or_path=tiny-flux3", "training.mode=full", f"training.max_steps={STEPS}", "planner.stages=[2]",
        "planner.offload=[none]", "optimizer.lr=3e-3", "training.resume=auto", "training.checkpoint_every=1000",
        "data.text_tokens=80")
EDIT_LORA = Case("flux3-edit-lora-zero3", "tiny-flux3", "lora", 3, 5e-2, 12)


@pytest.fixture(scope="module")
def flux3(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("flux3"))


@pytest.fixture(scope="module")
def full_run(flux3):
    return flux3("full-zero2", *FULL).check()


def blocks(folder, transformer=None):
    """diffusers' FLUX.3 pipeline from the tiny folder (the prompt upsampler popped, as its docs say, to encode
    the prompt as given), its Qwen3-VL processor built without torchvision."""
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks
    from transformers import AutoTokenizer

    from zerotrain.families.flux3 import text_processor

    auto = Flux3AutoBlocks()
    auto.sub_blocks.pop("prompt_upsampler")
    pipeline = auto.init_pipeline(str(folder))
    pipeline.load_components(names=["vae", "transformer", "text_encoder"], pretrained_model_name_or_path=str(folder))
    pipeline.update_components(tokenizer=text_processor(AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")))
    if transformer is not None:
        pipeline.update_components(transformer=transformer)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def render(pipeline, images=None) -> torch.Tensor:
    extra = {"image": images} if images else {}
    out = pipeline(prompt="paint the shape red", height=64, width=64, num_inference_steps=2, output_type="pt",
                   generator=torch.Generator().manual_seed(0), output="images", **extra)
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()
    return out


def edit(pipeline) -> torch.Tensor:
    return render(pipeline, [Image.open(path).convert("RGB") for path in (CONTROLS[0], SWATCHES[0])])


def test_full_finetune_zero2_learns_and_its_export_loads_with_diffusers_alone(flux3, full_run):
    from diffusers import Flux3Transformer2DModel

    assert_quiet(full_run)
    assert [r["step"] for r in full_run.metrics()] == list(range(1, STEPS + 1))
    assert_loss_drops("flux3-full-zero2", full_run.losses(), full_run.seconds)
    folder = flux3.run_config().data.cache_dir / "models" / "tiny-flux3"
    transformer = Flux3Transformer2DModel.from_pretrained(full_run.output_dir / "export" / "transformer")
    assert not torch.allclose(render(blocks(folder)), render(blocks(folder, transformer)))


def test_a_sigterm_and_a_rerun_give_the_uninterrupted_losses_bit_for_bit(flux3, full_run):
    stopped, _ = interrupted(flux3, "preempted", *FULL, after_steps=4,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert 4 <= done < STEPS, done
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = flux3("preempted", *FULL).check()
    assert f"at step {done}" in resumed.log and "resumed from" in resumed.log, resumed.tails()
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    assert resumed.losses() == full_run.losses()


def test_an_edit_lora_with_two_references_validates_and_loads_with_diffusers(flux3, tmp_path):
    from zerotrain.export import export

    result = flux3(EDIT_LORA.id, *EDIT_LORA.overrides(), "data.text_tokens=80", dataset("control", "swatch"),
                   validation(*[[c, s] for c, s in zip(CONTROLS, SWATCHES, strict=True)])).check()
    assert_quiet(result)
    check_validation_images(result.output_dir, EDIT_LORA)
    assert_loss_drops(EDIT_LORA.id, result.losses(), result.seconds)

    folder = flux3.run_config().data.cache_dir / "models" / "tiny-flux3"
    pipeline = blocks(folder)
    before = edit(pipeline)
    pipeline.load_lora_weights(result.output_dir / "export" / "lora", adapter_name="trained")
    assert pipeline.transformer.mode_blocks["image_cond"][0].attn.to_q.scaling["trained"] == 1.0  # alpha = rank
    trained = edit(pipeline)
    assert not torch.allclose(before, trained), "the exported LoRA does not change the edit"

    out = export(result.output_dir, out=tmp_path / "comfy", comfyui=True)
    fresh = blocks(folder)
    fresh.load_lora_weights(str(next((out / "comfyui").glob("*.safetensors"))))
    torch.testing.assert_close(edit(fresh), trained, rtol=1e-4, atol=1e-4)  # the same adapter
