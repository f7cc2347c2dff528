"""Krea 2 trains on two CPU ranks (gloo) on the 8 bundled images (global batch 2, 64 px buckets), through
zerotrain/train.py as a user runs it, in three runs:

    a   full fine-tune, ZeRO-2: the loss goes down, and the exported transformer loads into
        Krea2Pipeline with from_pretrained alone and renders (its ComfyUI file converts back to it)
    b   the same run stopped by SIGTERM after a few steps and run again: the resumed run's per-step
        losses equal run a's bit for bit
    c   LoRA (rank 4), ZeRO-3, on Raw, as docs/families.md recommends, validation images rendered through
        Krea2Pipeline (classifier-free guidance at 4.5): the loss goes down, and the exported LoRA
        loads into Raw and into Turbo (the same folder with model_index.json's is_distilled), whose
        8-step, guidance-free image it changes; the ComfyUI LoRA loads into Krea2Pipeline as well

"The loss goes down" is the mean of the last 3 step losses at least 5% below the mean of the first 3
(test_train_families' rule). Measured: full fine-tune at 3e-3 -14% in 10 steps (at 1e-3 only -6%, too
close to the margin); LoRA at 3e-2 -22% in 12.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch

from tests.distributed.conftest import WORLD, Trainer, interrupted, logged_steps
from tests.distributed.quiet_output import assert_quiet
from tests.distributed.test_train_families import Case, check_validation_images
from tests.distributed.test_train_z_image import assert_loss_drops

pytestmark = pytest.mark.distributed

STEPS = 10
FULL = ("model.name_or_path=tiny-krea2", "training.mode=full", f"training.max_steps={STEPS}", "planner.stages=[2]",
        "planner.offload=[none]", "optimizer.lr=3e-3", "training.resume=auto", "training.checkpoint_every=1000")
LORA = Case("krea2-lora-zero3", "tiny-krea2", "lora", 3, 3e-2, 12)


@pytest.fixture(scope="module")
def krea2(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("krea2"))


@pytest.fixture(scope="module")
def full_run(krea2):
    return krea2("full-zero2", *FULL).check()


@pytest.fixture(scope="module")
def tiny_folder(shared_cache):
    return shared_cache / "models" / "tiny-krea2"


def render(pipeline, steps: int = 2, guidance: float = 4.5) -> torch.Tensor:
    image = pipeline("a red square", height=64, width=64, num_inference_steps=steps, guidance_scale=guidance,
                     output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    return image


def test_full_finetune_zero2_learns_and_its_export_loads_with_diffusers_alone(full_run, tiny_folder, tmp_path):
    from diffusers import Krea2Pipeline, Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from zerotrain.export import export

    assert_quiet(full_run)
    assert [r["step"] for r in full_run.metrics()] == list(range(1, STEPS + 1))
    assert_loss_drops("krea2-full-zero2", full_run.losses(), full_run.seconds)

    exported = full_run.output_dir / "export" / "transformer"
    transformer = Krea2Transformer2DModel.from_pretrained(exported)
    pipeline = Krea2Pipeline.from_pretrained(tiny_folder)
    pipeline.set_progress_bar_config(disable=True)
    before = render(pipeline)
    trained = render(Krea2Pipeline.from_pretrained(tiny_folder, transformer=transformer))
    assert not torch.allclose(before, trained)

    out = export(full_run.output_dir, out=tmp_path / "comfy", comfyui=True)
    comfy = load_file(next((out / "comfyui").glob("*.safetensors")))
    assert "blocks.0.attn.wq.weight" in comfy and "txtfusion.projector.weight" in comfy
    weights = {k: v for path in sorted(exported.glob("*.safetensors")) for k, v in load_file(path).items()}
    back = convert_krea2_transformer_checkpoint_to_diffusers(comfy)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k].reshape(v.shape), v) for k, v in weights.items())


def test_a_sigterm_and_a_rerun_give_the_uninterrupted_losses_bit_for_bit(krea2, full_run):
    stopped, _ = interrupted(krea2, "preempted", *FULL, after_steps=4,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert 4 <= done < STEPS, done
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = krea2("preempted", *FULL).check()
    assert f"at step {done}" in resumed.log and "resumed from" in resumed.log, resumed.tails()
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    assert resumed.losses() == full_run.losses()


def test_a_lora_trained_on_raw_validates_and_loads_into_raw_and_turbo(train, tiny_folder, tmp_path):
    from diffusers import Krea2Pipeline

    from zerotrain.export import export

    result = train(LORA.id, *LORA.overrides()).check()
    assert_quiet(result)
    check_validation_images(result.output_dir, LORA)
    assert_loss_drops(LORA.id, result.losses(), result.seconds)
    lora = result.output_dir / "export" / "lora"

    raw = Krea2Pipeline.from_pretrained(tiny_folder)
    raw.set_progress_bar_config(disable=True)
    before = render(raw)
    raw.load_lora_weights(lora, adapter_name="trained")
    assert raw.transformer.transformer_blocks[0].attn.to_q.scaling["trained"] == 1.0  # alpha defaults to the rank
    assert not torch.allclose(before, render(raw))

    # Turbo: Raw's architecture, distilled; a folder whose model_index.json says so samples at its fixed shift.
    turbo_folder = tmp_path / "tiny-krea2-turbo"
    shutil.copytree(tiny_folder, turbo_folder)
    index = json.loads((turbo_folder / "model_index.json").read_text())
    (turbo_folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    turbo = Krea2Pipeline.from_pretrained(turbo_folder)
    turbo.set_progress_bar_config(disable=True)
    assert turbo.config.is_distilled
    before = render(turbo, steps=8, guidance=0.0)
    turbo.load_lora_weights(lora)
    assert not torch.allclose(before, render(turbo, steps=8, guidance=0.0))

    out = export(result.output_dir, out=tmp_path / "comfy", comfyui=True)
    comfy = next((out / "comfyui").glob("*.safetensors"))
    fresh = Krea2Pipeline.from_pretrained(tiny_folder)
    fresh.set_progress_bar_config(disable=True)
    fresh.load_lora_weights(comfy)
    torch.testing.assert_close(render(fresh), render(raw), rtol=1e-4, atol=1e-4)  # the same adapter
