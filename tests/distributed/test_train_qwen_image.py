"""Qwen-Image trains on two CPU ranks (gloo) on the 8 bundled images (global batch 2, micro 1 per rank,
64 px: 4x4 image tokens of the tiny 8x VAE; captions of different lengths, padded in the cache and
masked in attention):

    a  full fine-tune, ZeRO-2, 12 steps: the loss goes down, and the exported transformer loads into
       QwenImagePipeline with from_pretrained and renders (diffusers only, no zerotrain code);
    b  the same run stopped by SIGTERM after step 5 and run again with the same command: it resumes
       and its per-step losses equal run a's bit for bit;
    c  LoRA (rank 4), ZeRO-3, validation images of 3 prompts on 2 ranks through QwenImagePipeline
       with true classifier-free guidance (the family's default, true_cfg_scale 4): the loss goes down,
       and the exported LoRA loads with load_lora_weights and changes the image;
    d  LoRA (rank 4) over a qint8-, qint4- (docs/planning.md's Qwen-Image preset) and qfloat8-quantized base
       (optimum-quanto), ZeRO-2: the base's Linear weights are of that quanto type and shrink by its
       ratio, the loss goes down, and every exported lora_B (zero at the start) has moved.

"The loss goes down" is test_train_families' rule: the mean of the last 3 step losses is below the
mean of the first 3 by 5%. Measured over 12 steps (pytest -s prints them): a -20% at lr 3e-3 (-6.5% at
1e-3); c and d -12% at lr 5e-2 (at 1e-2 the LoRA on the image attention of the 2 tiny blocks does not
move the loss). Each run takes 20-50 s on two cores.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from tests.distributed.conftest import WORLD, Trainer, interrupted, logged_steps
from tests.distributed.quiet_output import assert_quiet
from tests.distributed.test_train_families import WINDOW, Case, check_validation_images

pytestmark = pytest.mark.distributed

MODEL = "tiny-qwen-image"
STEPS = 12
STOP_AFTER = 5
FULL = (f"model.name_or_path={MODEL}", "training.mode=full", "planner.stages=[2]", "planner.offload=[none]",
        f"training.max_steps={STEPS}", "optimizer.lr=3e-3", "training.resume=auto",
        "training.checkpoint_every=1000")
LORA = Case("qwen-lora-zero3", MODEL, "lora", 3, 5e-2, STEPS)
QUANTIZED = [Case(f"qwen-lora-{q}-zero2", MODEL, "lora", 2, 5e-2, STEPS, quantize=q)
             for q in ("qint8", "qint4", "qfloat8")]


@pytest.fixture(scope="module")
def qwen(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def full_run(qwen):
    """Run a, shared by the tests that compare with it."""
    return qwen("full", *FULL).check()


def assert_loss_goes_down(name: str, losses: list[float], min_drop: float, seconds: float) -> None:
    first, last = sum(losses[:WINDOW]) / WINDOW, sum(losses[-WINDOW:]) / WINDOW
    print(f"{name}: first {first:.4f} last {last:.4f} drop {1 - last / first:.1%} in {seconds:.0f} s; "
          f"losses {[round(x, 4) for x in losses]}")
    assert len(losses) == STEPS
    assert last < (1 - min_drop) * first, f"{name}: the loss did not go down by {min_drop:.0%}: {losses}"


def pipeline_folder(qwen: Trainer):
    """The tiny model folder the runs trained from (built once per session by conftest)."""
    return qwen.run_config().data.cache_dir / "models" / MODEL


def render(pipeline) -> torch.Tensor:
    image = pipeline("a red square on a white background", num_inference_steps=2, height=64, width=64,
                     true_cfg_scale=1.0, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert torch.isfinite(image).all()
    return image


def test_full_fine_tune_zero2_exports_a_transformer_diffusers_loads(qwen, full_run):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    assert_loss_goes_down("a full zero2", full_run.losses(), 0.05, full_run.seconds)
    folder = pipeline_folder(qwen)
    original = QwenImagePipeline.from_pretrained(folder)
    exported = QwenImageTransformer2DModel.from_pretrained(full_run.output_dir / "export" / "transformer",
                                                           torch_dtype=torch.float32)
    trained = QwenImagePipeline.from_pretrained(folder, transformer=exported)
    before, after = render(original), render(trained)
    assert after.shape == (1, 3, 64, 64) and after.std() > 0
    assert not torch.allclose(before, after), "the exported transformer renders what the untrained one did"


def test_sigterm_and_rerun_give_run_as_losses_bit_for_bit(qwen, full_run):
    stopped, _ = interrupted(qwen, "stopped", *FULL, after_steps=STOP_AFTER,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert STOP_AFTER <= done < STEPS, f"stopped after {done} steps"
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = qwen("stopped", *FULL).check()
    assert f"at step {done}" in resumed.log and "resumed from" in resumed.log, resumed.tails()
    assert resumed.losses() == full_run.losses(), (
        f"resumed {resumed.losses()}\nstraight {full_run.losses()}")


def test_lora_zero3_with_validation_exports_a_lora_that_changes_the_image(qwen):
    from diffusers import QwenImagePipeline

    result = qwen(LORA.id, *LORA.overrides()).check()
    assert_quiet(result)
    assert_loss_goes_down(LORA.id, result.losses(), LORA.min_drop, result.seconds)
    check_validation_images(result.output_dir, LORA)
    pipeline = QwenImagePipeline.from_pretrained(pipeline_folder(qwen))
    before = render(pipeline)
    pipeline.load_lora_weights(result.output_dir / "export" / "lora", adapter_name="trained")
    layer = pipeline.transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling["trained"] == 1.0  # alpha defaults to the rank
    assert not torch.allclose(before, render(pipeline)), "the exported LoRA does not change the image"


QUANTIZED_LINE = re.compile(r"quantized the frozen base to (\w+) with optimum-quanto: (\d+) layers, "
                            r"([\d.]+) (KiB|MiB|GiB) -> ([\d.]+) (KiB|MiB|GiB)")
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# What quantizing shrinks the tiny bf16 base to (data plus scales, and the layers quanto leaves
# alone): 8-bit types about half, qint4 (packed, with group scales and shifts) well below that.
SHRINK = {"qint8": (0.45, 0.7), "qfloat8": (0.45, 0.7), "qint4": (0.2, 0.45)}


def quantized_weights(qwen: Trainer, overrides: list[str]) -> dict[str, int]:
    """What engine.apply_mode (as train.py calls it for this run's config) leaves in the tiny model's
    frozen base: how many quanto-quantized weights of each type (qfloat8 is quanto's qfloat8_e4m3fn)."""
    from collections import Counter

    from optimum import quanto

    from zerotrain.engine import apply_mode, load_denoiser
    from zerotrain.models.catalog import resolve_model

    run = qwen.run_config(*overrides)
    spec = resolve_model(run.model)
    model = load_denoiser(spec, pipeline_folder(qwen))
    apply_mode(model, spec, run, False)
    names = {qtype.name: name for name, qtype in quanto.qtypes.items()}  # qfloat8 last: it wins its alias
    return dict(Counter(names[m.weight.qtype.name] for m in model.modules()
                        if isinstance(m, quanto.QModuleMixin) and isinstance(m.weight, quanto.QTensor)))


@pytest.mark.parametrize("case", QUANTIZED, ids=[c.quantize for c in QUANTIZED])
def test_lora_over_a_quantized_base_zero2_learns(qwen, case):
    from safetensors.torch import load_file

    overrides = [o for o in case.overrides() if not o.startswith("validation.")]
    result = qwen(case.id, *overrides).check()
    line = QUANTIZED_LINE.search(result.log)
    assert line and line[1] == case.quantize and int(line[2]) > 0, result.tails()
    before, after = float(line[3]) * UNITS[line[4]], float(line[5]) * UNITS[line[6]]
    low, high = SHRINK[case.quantize]
    assert low < after / before < high, f"{case.quantize}: {line[0]}"
    assert quantized_weights(qwen, overrides) == {case.quantize: int(line[2])}
    assert_loss_goes_down(case.id, result.losses(), case.min_drop, result.seconds)
    exported = load_file(result.output_dir / "export" / "lora" / "pytorch_lora_weights.safetensors")
    lora_b = {k: v for k, v in exported.items() if ".lora_B." in k}
    assert lora_b and all(v.abs().max() > 0 for v in lora_b.values()), \
        f"lora_B still zero: {[k for k, v in lora_b.items() if not v.abs().max() > 0]}"
