"""Every family trains on two CPU ranks (gloo), through zerotrain/train.py as a user runs it, on the 8 bundled
images (global batch 2, micro 1 per rank, 64 px buckets, constant LR), one row of FAMILIES each: chroma, flux
(FLUX.1), flux2, flux3, ideogram4, krea2, qwen-image, qwen-image21, sd3, sdxl and z-image. Per row:

    full    full fine-tune, ZeRO-2: it prints only zerotrain's lines (quiet_output.py), leaves what
            family_runs.check_run_folder checks (config, plan, DeepSpeed JSON, every step's metrics, the last
            step's checkpoint, the export's manifest), the loss goes down by the row's margin, and the exported
            denoiser (RUN/export/<the row's folder>: transformer, or SDXL's unet) loads with diffusers alone
            (from_pretrained into the row's pipeline) and changes its render; where the row names its ComfyUI
            file's keys, the file holds them and gives back the exported weights exactly: through diffusers'
            single-file converter, or as they are where the family keeps diffusers' names (FLUX.1, SD3, SDXL,
            which ComfyUI converts itself)
    sigterm the same run stopped by SIGTERM after the row's stop_after steps and run again with the same
            command: it resumes from that step's checkpoint and its per-step losses equal the full run's bit
            for bit (the full run is one module-scoped run per row, shared by these two tests)
    lora    each of the row's LoRA cases (rank 4, its ZeRO stage and optimizer): the run folder as above, the
            loss goes down by its margin, and, unless the case says validate=False, it renders validation images
            (3 prompts on 2 ranks, at step 0, every 6 steps and at the last; with the row's references each
            prompt has its control images). Without a quantized base the exported LoRA loads with
            load_lora_weights into the row's pipeline (alpha = rank on the row's layer) and changes its image
            (its edit, for an edit row), and the ComfyUI LoRA, where the row checks it, loads as the same
            adapter; over a quantized base (optimum-quanto) the base's Linear weights are of that quanto type
            and shrink by its ratio, DeepSpeed held (and saved) the adapters only, and every exported lora_B
            (zero at the start) has moved

The modes of training ride on the rows, each once: SDXL's full run checkpoints 2 of its UNet blocks (partial
checkpointing, planned and logged); FLUX.1's LoRA runs without ZeRO (DeepSpeed's bf16 optimizer); SD3's LoRA
steps bitsandbytes' adamw-8bit at ZeRO-2; SDXL's runs step transformers' Adafactor, the full run at ZeRO-2 (its
SIGTERM rerun resuming the fp32 second moment as saved) and the LoRA at ZeRO-3; Qwen-Image's LoRAs
train over a qint8 base at ZeRO-3 (rendering validation images through it) and qint4 and qfloat8 bases at
ZeRO-2. The full fine-tune at ZeRO-3 with the optimizer and the parameters offloaded is test_train_modes.py's.

Adding a family is a row: its tiny catalog model, the full run's lr, steps and margin, its LoRA cases, its
diffusers pipeline and render call, and hooks for what only it has (Chroma's mod_proj buffer and distilled
guidance layer; Ideogram 4's unconditional transformer left alone; Krea 2's LoRA loaded into Turbo).

Measured margins (pytest -s prints every run's losses; the same to the digit run after run): full fine-tune,
8 steps unless said, chroma -22%, flux -19%, flux2 -13% (lr 1e-3), flux3 -28%, ideogram4 -18%, krea2 -14% in
10 (at 1e-3 only -6%, too close to the margin, hence 3e-3), qwen-image -13%, qwen-image21 -20%, sd3 -8.6% in 10
(margin 3%: its loss, ~4.1 at the start with 16-channel latents and timesteps shifted by 3 towards noise, falls
slowly), sdxl -53% (Adafactor), z-image -14%; LoRA chroma -15.5% in 10, flux -10% in 10, flux2 -18% in 8 at 5e-2 (at 1e-2
its few default targets, 5,888 parameters, drop ~4%), flux3 -19% in 8, ideogram4 -15% in 6, krea2 -12% in 6,
qwen-image -12% in 12 at 5e-2 (at 1e-2 nothing; -8% in 10), its quantized bases -11.5 to -12%, qwen-image21
-16% in 12 (-6.5% in 10), sd3 -7.4% in 10 (margin 3%), sdxl -8.4% in 10, z-image -8% in 10 at 3e-2.

Z-Image at 64 px sees 256 image tokens, a multiple of 32, so x_pad_token is never used: it still gets a (zero)
gradient, so no parameter of its full fine-tune ever lacks one (tests/unit/test_family_z_image.py).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

from tests.distributed.conftest import Trainer
from tests.distributed.family_runs import (
    CONTROLS,
    EDITS,
    Case,
    assert_loss_drops,
    check_run_folder,
    check_sigterm_rerun,
    check_validation_images,
    dataset,
    validation,
)
from tests.distributed.quiet_output import assert_quiet

pytestmark = pytest.mark.distributed


# --- how a row's pipeline is built ------------------------------------------------------------------------------

def diffusers_pipeline(name: str) -> Callable:
    """(folder, **components) -> diffusers.<name>.from_pretrained(folder, **components), without progress bars."""
    def load(folder, **components):
        import diffusers

        pipeline = getattr(diffusers, name).from_pretrained(folder, **components)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline
    return load


def flux3_blocks(folder, transformer=None):
    """diffusers' FLUX.3 pipeline from the tiny folder (the prompt upsampler popped, as its docs say, to encode
    the prompt as given), its Qwen3-VL processor built without torchvision."""
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks
    from transformers import AutoTokenizer

    from zerotrain.families.runtime.parts.qwen_vl import text_processor

    auto = Flux3AutoBlocks()
    auto.sub_blocks.pop("prompt_upsampler")
    pipeline = auto.init_pipeline(str(folder))
    pipeline.load_components(names=["vae", "transformer", "text_encoder"], pretrained_model_name_or_path=str(folder))
    pipeline.update_components(tokenizer=text_processor(AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")))
    if transformer is not None:
        pipeline.update_components(transformer=transformer)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def qwen_image21_pipeline(folder, **components):
    from diffusers import QwenImage21Pipeline

    from zerotrain.families.runtime.qwen_image21 import load_processor

    pipeline = QwenImage21Pipeline.from_pretrained(folder, processor=load_processor(folder), **components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# --- the table --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComfyFull:
    """A full fine-tune's ComfyUI file: it holds `keys` and diffusers' single_file_utils.<converter> gives back
    the exported denoiser's weights exactly (reshaped, where the family's layout flattens some); without a
    converter the file is those weights under diffusers' own names, which ComfyUI converts itself."""
    converter: str | None
    keys: tuple[str, ...]
    reshape: bool = False


@dataclass(frozen=True)
class Family:
    id: str
    model: str
    """The tiny catalog model every run of the row trains (the shared cache's models/<model>)."""
    full_lr: float
    full_steps: int
    stop_after: int
    """The SIGTERM comes once metrics.jsonl holds this many steps."""
    loras: tuple[Case, ...]
    """The LoRA runs: Case's type, rank 4, ZeRO stage, lr, steps, optimizer, quantized base, margin (min_drop) and
    whether it renders validation images."""
    pipeline: Callable
    """(folder, **components) -> the diffusers pipeline an export loads into."""
    denoiser: str
    """The diffusers class of RUN/export/<folder>."""
    prompt: str
    full_min_drop: float = 0.05
    full_checkpoint_blocks: int | None = None
    """training.checkpoint_blocks of the full run: partial checkpointing of that many blocks."""
    full_optimizer: str = "adamw"
    """optimizer.name of the full run (and so of its SIGTERM rerun)."""
    folder: str = "transformer"
    """The denoiser's folder in the export and its pipeline's component (SDXL's UNet: unet)."""
    extra: tuple[str, ...] = ()
    """Overrides of every run of the row (text tokens, gradient checkpointing)."""
    references: tuple[str, ...] = ()
    """An edit row: the control folders of examples/tiny-edit-data its LoRA trains, validates and edits with."""
    side: int = 64
    channels: int = 3
    call: dict = field(default_factory=dict)
    """The pipeline call's own arguments (guidance, sequence length) beside prompt, size, 2 steps and seed 0."""
    edit_call: dict = field(default_factory=dict)
    export_float32: bool = False
    """Load the exported transformer with torch_dtype=float32."""
    comfy_full: ComfyFull | None = None
    lora_layer: Callable | None = None
    """transformer -> a layer the LoRA adapts: its scaling is 1 (alpha defaults to the rank), its lora_B moved."""
    comfy_lora_tol: tuple[float, float] | None = None
    """(rtol, atol) of the ComfyUI LoRA's edit or render against the diffusers LoRA's; None: not checked."""
    full_hook: Callable | None = None
    """(full run, tiny folder, pipeline with the exported transformer) -> what only this family checks."""
    lora_hook: Callable | None = None
    """(family, LoRA run, tiny folder, pipeline with the LoRA, tmp_path) -> what only this family checks."""

    @property
    def full(self) -> Case:
        """The full fine-tune, ZeRO-2, as a Case."""
        return Case(f"{self.id}-full-zero2", self.model, "full", 2, self.full_lr, self.full_steps,
                    min_drop=self.full_min_drop, checkpoint_blocks=self.full_checkpoint_blocks, validate=False,
                    optimizer=self.full_optimizer)

    def full_overrides(self) -> tuple[str, ...]:
        return (*self.full.overrides(), "training.resume=auto", "training.checkpoint_every=1000", *self.extra)

    def lora_overrides(self, case: Case) -> list[str]:
        overrides = [*case.overrides(), *self.extra]
        if self.references:
            overrides += [dataset(*self.references),
                          validation(*[[EDITS / ref / c.name for ref in self.references] for c in CONTROLS])]
        return overrides


def render(family: Family, pipeline, images=None, **call) -> torch.Tensor:
    """The row's pipeline call: 2 steps from seed 0 at the row's size (with images: the edit of them)."""
    edit = {"image": images, **family.edit_call} if images else {}
    call = {"num_inference_steps": 2, **family.call, **edit, **call}
    out = pipeline(prompt=family.prompt, height=family.side, width=family.side, output_type="pt",
                   generator=torch.Generator().manual_seed(0), **call)
    image = out if isinstance(out, torch.Tensor) else out.images  # FLUX.3's modular blocks give the tensor
    assert image.shape == (1, family.channels, family.side, family.side) and torch.isfinite(image).all(), image.shape
    return image


def edit(family: Family, pipeline) -> torch.Tensor:
    """The first sample's edit, with the row's references of it."""
    return render(family, pipeline, [Image.open(EDITS / ref / CONTROLS[0].name).convert("RGB")
                                     for ref in family.references])


# --- what only one family has -----------------------------------------------------------------------------------

def chroma_full(run, folder, trained) -> None:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel

    assert "gradient checkpointing" in run.log, run.tails()  # Chroma's own, which keeps the text mask
    # Diffusers alone: the export was built on the meta device and filled with load_state_dict(assign=True),
    # which leaves the non-persistent mod_proj buffer out of the files; from_pretrained computes it.
    transformer = trained.transformer
    fresh = ChromaTransformer2DModel.from_config(transformer.config)
    assert torch.equal(transformer.time_text_embed.mod_proj, fresh.time_text_embed.mod_proj)
    base = ChromaPipeline.from_pretrained(folder)
    changed = [n for n, p in transformer.named_parameters() if not torch.equal(p, base.transformer.get_parameter(n))]
    assert len(changed) > len(list(transformer.parameters())) // 2
    assert any(n.startswith("distilled_guidance_layer.") for n in changed)  # full mode trains it too


def ideogram4_full(run, folder, trained) -> None:
    from diffusers import Ideogram4Transformer2DModel

    assert torch.equal(trained.unconditional_transformer.input_proj.weight,
                       Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="unconditional_transformer")
                       .input_proj.weight)  # untouched: only the conditional transformer trains


def ideogram4_lora(family, result, folder, pipeline, tmp_path) -> None:
    assert not hasattr(pipeline.unconditional_transformer.layers[0].attention.to_q, "scaling")  # not adapted


def krea2_lora(family, result, folder, pipeline, tmp_path) -> None:
    """Trained on Raw (docs/families.md recommends it), the LoRA loads into Turbo too: Raw's architecture,
    distilled; a folder whose model_index.json says so samples at its fixed shift, 8 steps, guidance-free."""
    turbo_folder = tmp_path / "tiny-krea2-turbo"
    shutil.copytree(folder, turbo_folder)
    index = json.loads((turbo_folder / "model_index.json").read_text())
    (turbo_folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    turbo = family.pipeline(turbo_folder)
    assert turbo.config.is_distilled
    before = render(family, turbo, num_inference_steps=8, guidance_scale=0.0)
    turbo.load_lora_weights(result.output_dir / "export" / "lora")
    assert not torch.allclose(before, render(family, turbo, num_inference_steps=8, guidance_scale=0.0))


FAMILIES = [
    Family("chroma", "tiny-chroma", 1e-3, 8, 3, (Case("chroma-lora-zero3", "tiny-chroma", "lora", 3, 1e-2, 10),),
           diffusers_pipeline("ChromaPipeline"), "ChromaTransformer2DModel", "a red square", side=32,
           call={"max_sequence_length": 16}, extra=("training.gradient_checkpointing=true",),
           lora_layer=lambda t: t.transformer_blocks[0].attn.to_q, full_hook=chroma_full),
    # FLUX.1's LoRA is also the test of no ZeRO (DeepSpeed's bf16 optimizer). Its ComfyUI LoRA (Black Forest Labs'
    # names) diffusers cannot read at this width.
    Family("flux", "tiny-flux", 1e-3, 8, 3, (Case("flux-lora-zero0", "tiny-flux", "lora", 0, 1e-2, 10),),
           diffusers_pipeline("FluxPipeline"), "FluxTransformer2DModel", "a red square",
           comfy_full=ComfyFull(None, ("transformer_blocks.0.attn.to_q.weight",
                                       "single_transformer_blocks.0.proj_out.weight")),
           lora_layer=lambda t: t.transformer_blocks[0].attn.to_q),
    Family("flux2", "tiny-flux2", 1e-3, 8, 3, (Case("flux2-lora-zero3", "tiny-flux2", "lora", 3, 5e-2, 8),),
           diffusers_pipeline("Flux2Pipeline"), "Flux2Transformer2DModel", "a red square on a white background",
           call={"max_sequence_length": 64}, extra=("data.text_tokens=64",), export_float32=True,
           comfy_full=ComfyFull("convert_flux2_transformer_checkpoint_to_diffusers",
                                ("double_blocks.0.img_attn.qkv.weight", "guidance_in.in_layer.weight")),
           lora_layer=lambda t: t.single_transformer_blocks[1].attn.to_out, comfy_lora_tol=(0, 2e-3)),
    Family("flux3", "tiny-flux3", 3e-3, 8, 3, (Case("flux3-edit-lora-zero3", "tiny-flux3", "lora", 3, 5e-2, 8),),
           flux3_blocks, "Flux3Transformer2DModel", "paint the shape red", call={"output": "images"},
           extra=("data.text_tokens=80",), references=("control", "swatch"),
           lora_layer=lambda t: t.mode_blocks["image_cond"][0].attn.to_q, comfy_lora_tol=(1e-4, 1e-4)),
    Family("ideogram4", "tiny-ideogram4", 3e-3, 8, 3,
           (Case("ideogram4-lora-zero3", "tiny-ideogram4", "lora", 3, 3e-2, 6),),
           diffusers_pipeline("Ideogram4Pipeline"), "Ideogram4Transformer2DModel", "a red square",
           call={"guidance_scale": 7.0, "guidance_schedule": None, "max_sequence_length": 64},
           lora_layer=lambda t: t.layers[0].attention.to_q, comfy_lora_tol=(1e-4, 1e-4),
           full_hook=ideogram4_full, lora_hook=ideogram4_lora),
    Family("krea2", "tiny-krea2", 3e-3, 10, 4, (Case("krea2-lora-zero3", "tiny-krea2", "lora", 3, 3e-2, 6),),
           diffusers_pipeline("Krea2Pipeline"), "Krea2Transformer2DModel", "a red square",
           call={"guidance_scale": 4.5},
           comfy_full=ComfyFull("convert_krea2_transformer_checkpoint_to_diffusers",
                                ("blocks.0.attn.wq.weight", "txtfusion.projector.weight"), reshape=True),
           lora_layer=lambda t: t.transformer_blocks[0].attn.to_q, comfy_lora_tol=(1e-4, 1e-4), lora_hook=krea2_lora),
    # docs/planning.md's Qwen-Image preset quantizes to qint4. The quantized cases are also the tests of a quantized
    # base at ZeRO-3 (qint8) and at ZeRO-2.
    Family("qwen-image", "tiny-qwen-image", 3e-3, 8, 3,
           (Case("qwen-lora-zero3", "tiny-qwen-image", "lora", 3, 5e-2, 12),
            Case("qwen-lora-qint8-zero3", "tiny-qwen-image", "lora", 3, 5e-2, 12, quantize="qint8"),
            *(Case(f"qwen-lora-{q}-zero2", "tiny-qwen-image", "lora", 2, 5e-2, 12, quantize=q, validate=False)
              for q in ("qint4", "qfloat8"))),
           diffusers_pipeline("QwenImagePipeline"), "QwenImageTransformer2DModel", "a red square on a white background",
           call={"true_cfg_scale": 1.0}, export_float32=True, lora_layer=lambda t: t.transformer_blocks[0].attn.to_q),
    # Two condition images a target, each caption cached as the text encoder reads it with the two; RGBA out.
    Family("qwen-image21", "tiny-qwen-image21", 3e-3, 8, 3,
           (Case("qwen-image21-edit-lora-zero3", "tiny-qwen-image21", "lora", 3, 3e-2, 12),),
           qwen_image21_pipeline, "QwenImage21Transformer2DModel", "paint the shape red", channels=4,
           edit_call={"output_resolution": 64}, extra=("data.text_tokens=64",), references=("control", "swatch"),
           comfy_lora_tol=(1e-4, 1e-4)),
    # SD3's LoRA is also the test of bitsandbytes' adamw-8bit; its ComfyUI LoRA (OneTrainer's names) diffusers does
    # not read. Its slowly falling loss has a 3% margin.
    Family("sd3", "tiny-sd3", 3e-3, 10, 4,
           (Case("sd3-lora-zero2-adamw-8bit", "tiny-sd3", "lora", 2, 5e-2, 10, min_drop=0.03,
                 optimizer="adamw-8bit"),),
           diffusers_pipeline("StableDiffusion3Pipeline"), "SD3Transformer2DModel", "a red square",
           full_min_drop=0.03,
           comfy_full=ComfyFull(None, ("transformer_blocks.0.attn.to_q.weight", "pos_embed.proj.weight")),
           lora_layer=lambda t: t.transformer_blocks[0].attn.to_q),
    # SDXL's runs are also the tests of Adafactor: the full run, with partial checkpointing (2 of its UNet blocks),
    # and its SIGTERM rerun (the fp32 second moment resumed as saved, over bf16 masters), and a LoRA at ZeRO-3.
    Family("sdxl", "tiny-sdxl", 1e-3, 8, 3,
           (Case("sdxl-lora-zero3-adafactor", "tiny-sdxl", "lora", 3, 5e-2, 10, optimizer="adafactor"),),
           diffusers_pipeline("StableDiffusionXLPipeline"), "UNet2DConditionModel", "a red square",
           full_checkpoint_blocks=2, full_optimizer="adafactor", folder="unet",
           comfy_full=ComfyFull(None, ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",)),
           lora_layer=lambda u: u.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q,
           comfy_lora_tol=(1e-4, 1e-4)),
    Family("z-image", "tiny-z-image", 1e-3, 8, 3, (Case("z-image-lora-zero3", "tiny-z-image", "lora", 3, 3e-2, 10),),
           diffusers_pipeline("ZImagePipeline"), "ZImageTransformer2DModel", "a red square",
           comfy_full=ComfyFull("convert_z_image_transformer_checkpoint_to_diffusers",
                                ("layers.0.attention.qkv.weight",)),
           lora_layer=lambda t: t.layers[0].attention.to_q),
]
LORAS = [(family, case) for family in FAMILIES for case in family.loras]


# --- one full run per row, shared by its full-fine-tune test and its SIGTERM test -------------------------------

@pytest.fixture(scope="module", params=FAMILIES, ids=[f.id for f in FAMILIES])
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def trainer(family, shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp(family.id))


@pytest.fixture(scope="module")
def full_run(family, trainer):
    return trainer("full-zero2", *family.full_overrides()).check()


def test_full_finetune_zero2_learns_and_its_export_loads_with_diffusers_alone(family, full_run, shared_cache,
                                                                              tmp_path):
    from safetensors.torch import load_file

    from zerotrain.export import export

    case = family.full
    assert_quiet(full_run)
    check_run_folder(full_run, case)
    assert_loss_drops(case.id, full_run.losses(), full_run.seconds, case.min_drop, case.steps)

    import diffusers

    folder = shared_cache / "models" / family.model
    exported = full_run.output_dir / "export" / family.folder
    denoiser = getattr(diffusers, family.denoiser).from_pretrained(
        exported, **({"torch_dtype": torch.float32} if family.export_float32 else {}))
    trained = family.pipeline(folder, **{family.folder: denoiser})
    before, after = render(family, family.pipeline(folder)), render(family, trained)
    assert after.std() > 0 and not torch.allclose(before, after), "the exported denoiser renders the untrained image"
    if family.full_hook:
        family.full_hook(full_run, folder, trained)

    if family.comfy_full:
        from diffusers.loaders import single_file_utils

        (comfy,) = (export(full_run.output_dir, out=tmp_path / "comfy", comfyui=True) / "comfyui").iterdir()
        bfl = load_file(comfy)
        missing = [key for key in family.comfy_full.keys if key not in bfl]
        assert not missing, f"the ComfyUI file lacks {missing}: {sorted(bfl)[:8]}"
        weights = {k: v for path in sorted(exported.glob("*.safetensors")) for k, v in load_file(path).items()}
        converter = family.comfy_full.converter
        back = getattr(single_file_utils, converter)(bfl) if converter else bfl
        assert back.keys() == weights.keys()
        if not family.comfy_full.reshape:
            assert all(back[k].shape == v.shape for k, v in weights.items())
        assert all(torch.equal(back[k].reshape(v.shape), v) for k, v in weights.items())


def test_a_sigterm_and_a_rerun_give_the_uninterrupted_losses_bit_for_bit(family, trainer, full_run):
    check_sigterm_rerun(trainer, "preempted", family.full_overrides(), full_run, family.stop_after, family.full_steps)


# --- the LoRA runs ----------------------------------------------------------------------------------------------

QUANTIZED_LINE = re.compile(r"quantized the frozen base to (\w+) with optimum-quanto: (\d+) layers, "
                            r"([\d.]+) (KiB|MiB|GiB) -> ([\d.]+) (KiB|MiB|GiB)")
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# What quantizing shrinks the tiny bf16 base to (data plus scales, and the layers quanto leaves
# alone): 8-bit types about half, qint4 (packed, with group scales and shifts) well below that.
SHRINK = {"qint8": (0.45, 0.7), "qfloat8": (0.45, 0.7), "qint4": (0.2, 0.45)}


def quantized_weights(train: Trainer, folder, overrides: list[str]) -> dict[str, int]:
    """What engine.apply_mode (as train.py calls it for this run's config) leaves in the tiny model's
    frozen base: how many quanto-quantized weights of each type (qfloat8 is quanto's qfloat8_e4m3fn)."""
    from collections import Counter

    from optimum import quanto

    from zerotrain.engine import apply_mode, load_denoiser
    from zerotrain.models.catalog import resolve_model

    run = train.run_config(*overrides)
    spec = resolve_model(run.model)
    model = load_denoiser(spec, folder)
    apply_mode(model, spec, run, False)
    names = {qtype.name: name for name, qtype in quanto.qtypes.items()}  # qfloat8 last: it wins its alias
    return dict(Counter(names[m.weight.qtype.name] for m in model.modules()
                        if isinstance(m, quanto.QModuleMixin) and isinstance(m.weight, quanto.QTensor)))


def check_quantized(train: Trainer, folder, case: Case, overrides: list[str], result) -> None:
    from safetensors.torch import load_file

    line = QUANTIZED_LINE.search(result.log)
    assert line and line[1] == case.quantize and int(line[2]) > 0, result.tails()
    before, after = float(line[3]) * UNITS[line[4]], float(line[5]) * UNITS[line[6]]
    low, high = SHRINK[case.quantize]
    assert low < after / before < high, f"{case.quantize}: {line[0]}"
    assert quantized_weights(train, folder, overrides) == {case.quantize: int(line[2])}
    # DeepSpeed managed (and saved) the adapters only: the engine is given a TrainableView, never the quantized
    # weights.
    states = next((result.output_dir / "checkpoints" / f"step-{case.steps:08d}").glob("*mp_rank_00_model_states.pt"))
    names = list(torch.load(states, map_location="cpu", weights_only=False)["module"])
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:5]
    exported = load_file(result.output_dir / "export" / "lora" / "pytorch_lora_weights.safetensors")
    lora_b = {k: v for k, v in exported.items() if ".lora_B." in k}
    assert lora_b and all(v.abs().max() > 0 for v in lora_b.values()), \
        f"lora_B still zero: {[k for k, v in lora_b.items() if not v.abs().max() > 0]}"


def check_lora_export(family: Family, result, folder, tmp_path) -> None:
    from zerotrain.export import export

    look = (lambda p: edit(family, p)) if family.references else (lambda p: render(family, p))
    pipeline = family.pipeline(folder)
    before = look(pipeline)
    pipeline.load_lora_weights(result.output_dir / "export" / "lora", adapter_name="trained")
    if family.lora_layer:
        layer = family.lora_layer(getattr(pipeline, family.folder))
        assert layer.scaling["trained"] == 1.0  # alpha defaults to the rank
        assert layer.lora_B["trained"].weight.abs().max() > 0, "training left B at zero"
    trained = look(pipeline)
    assert not torch.allclose(before, trained), "the exported LoRA does not change the image"
    if family.lora_hook:
        family.lora_hook(family, result, folder, pipeline, tmp_path)
    if family.comfy_lora_tol:
        (comfy,) = (export(result.output_dir, out=tmp_path / "comfy", comfyui=True) / "comfyui").iterdir()
        fresh = family.pipeline(folder)
        fresh.load_lora_weights(str(comfy))
        rtol, atol = family.comfy_lora_tol
        torch.testing.assert_close(look(fresh), trained, rtol=rtol, atol=atol)  # the same adapter


@pytest.mark.parametrize("row, case", LORAS, ids=[case.id for _, case in LORAS])
def test_a_lora_learns_validates_and_its_export_loads(row, case, train, shared_cache, tmp_path):
    overrides = row.lora_overrides(case)
    result = train(case.id, *overrides).check()
    assert_quiet(result)
    check_run_folder(result, case)
    assert_loss_drops(case.id, result.losses(), result.seconds, case.min_drop, case.steps)
    if case.validate:
        check_validation_images(result.output_dir, case)
    folder = shared_cache / "models" / row.model
    if case.quantize != "none":
        check_quantized(train, folder, case, overrides, result)
    else:
        check_lora_export(row, result, folder, tmp_path)
