"""FLUX.3 [klein] (zerotrain/families/flux3.py) against diffusers' own modular FLUX.3 blocks, their scheduler and
LoRA and single-file converters: the catalog counts, planning (per-mode blocks as checkpoint units), the
flow-map model being plan-only, the tiny modular folder, the cached text against the text encoder step (and
a batch's layout against the step's own longer padding), the latents and references against the VAE encoder
and reference steps, the model inputs against the blocks' steps, an edit training the reference pathway,
validation renders, a LoRA from Base in the flow map, and what has no ComfyUI layout. The checks every family
shares are test_families.py's.

The tiny VAE downsamples 2x and patchifies 2x2: 64 px images are 16x16 tokens of 16 channels."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux3ModularPipeline, Flux3Transformer2DModel
from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks
from diffusers.modular_pipelines.flux3.before_denoise import (
    Flux3PrepareImageCondLatentsStep,
    Flux3PrepareLatentsStep,
    Flux3TextRoPEInputsStep,
)
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep
from peft import LoraConfig, get_peft_model_state_dict
from transformers import AutoTokenizer

from tests.unit.test_sampling import check_image, make_validator
from tests.unit.tiny_family import gen, spec_of, tiny_fixtures
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families import example_inputs
from zerotrain.families.flux3 import FAMILY
from zerotrain.families.runtime.flux3 import padded_text, settings
from zerotrain.families.runtime.parts.qwen_vl import text_processor
from zerotrain.models.catalog import check_trainable
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts, load_encoders
from zerotrain.objectives import flow_interpolate, flow_target, make_objective

# The catalog's parameter counts are test_families.py's (FAMILIES).
SHORT = "a red chair"
# The tiny tokenizer's merges are few: digits make one token each, so this caption runs past 80 tokens.
LONG = "an oil painting, " + " ".join(str(i % 10) for i in range(40))  # 93 tokens
TEXT_TOKENS = 200
SIDE = 64
GRID = SIDE // 4  # 16x16 tokens

root, folder, _, encoders = tiny_fixtures("tiny-flux3", "Flux3ModularPipeline")


@pytest.fixture(scope="module")
def blocks(folder):
    """diffusers' FLUX.3 pipeline loaded from the tiny folder with no zerotrain code but the tokenizer's
    wrapper: the blocks (without the prompt upsampler) and every component."""
    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")  # as its docs say, to encode the prompt as given
    pipeline = blocks.init_pipeline(str(folder))
    pipeline.load_components(names=["vae", "transformer", "text_encoder"], pretrained_model_name_or_path=str(folder))
    pipeline.update_components(tokenizer=text_processor(AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def step_embeds(blocks, caption: str, **step) -> torch.Tensor:
    """The text encoder step's own prompt_embeds for a caption (its max_sequence_length and pad multiple)."""
    return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(blocks.text_encoder, blocks.tokenizer, caption, **step)


def cached_batch(encoders, n: int = 2) -> dict[str, torch.Tensor]:
    shape = (n, 16, GRID, GRID)
    text = encode_prompts(encoders, [SHORT, LONG], TEXT_TOKENS)
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.zeros(shape),
            **{name: value.repeat(n // 2, *[1] * (value.ndim - 1)) for name, value in text.items()}}


def objective_of(folder, **config):
    return make_objective(spec_of(folder), FAMILY.scheduler_config(folder), ObjectiveConfig(**config), SIDE)


# --- catalog and planning ----------------------------------------------------------------------------

def test_klein_is_the_base_configs_flow_map():
    assert spec_of("flux3-klein").config == {**spec_of("flux3-klein-base").config, "flow_map": True}


def test_the_flow_map_plans_but_neither_caches_nor_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = spec_of("flux3-klein")
    assert FAMILY.pipeline_name(spec) == "Flux3DistilledModularPipeline"
    assert "target_timestep" in example_inputs(spec, 1, 64, 64, 8, "meta", torch.bfloat16)
    with pytest.raises(ZerotrainError, match=r"plan-only: .*flow maps .* fine-tune FLUX.3 \[klein\] Base, flux3-klein-base"):
        check_trainable(spec)
    check_trainable(spec_of("flux3-klein-base"))

# --- the tiny model and the cache ---------------------------------------------------------------------


def test_tiny_folder_is_a_modular_flux3_pipeline_diffusers_loads(folder, blocks):
    assert not (folder / "model_index.json").exists() and (folder / "modular_model_index.json").is_file()
    assert type(blocks) is Flux3ModularPipeline
    assert len(blocks.text_encoder.model.language_model.layers) == max(settings()["out_layers"]) == 32
    assert blocks.scheduler.config.shift == 6.93 and not blocks.scheduler.config.use_dynamic_shifting
    assert FAMILY.scheduler_config(folder)["shift"] == 6.93


def test_a_folder_whose_modular_index_names_another_folders_encoders_loads_them(folder, encoders, tmp_path):
    """A fine-tune saved as a modular pipeline keeps its transformer and names the base's other components in
    modular_model_index.json: the cache loads them from there, as the blocks' load_components does."""
    tuned = tmp_path / "tuned"
    shutil.copytree(folder / "transformer", tuned / "transformer")
    index = json.loads((folder / "modular_model_index.json").read_text())
    for name in ("vae", "text_encoder", "tokenizer"):
        index[name][2]["pretrained_model_name_or_path"] = str(folder)
    (tuned / "modular_model_index.json").write_text(json.dumps(index))
    loaded = load_encoders(spec_of(tuned), tuned)
    assert torch.equal(encode_prompts(loaded, [SHORT], 80)["prompt_embeds"],
                       encode_prompts(encoders, [SHORT], 80)["prompt_embeds"])


def test_cached_captions_are_the_text_encoder_steps_rows_and_one_padded_row(blocks, encoders):
    cached = encode_prompts(encoders, [SHORT, LONG], TEXT_TOKENS)
    assert cached["prompt_embeds"].shape == (2, TEXT_TOKENS, 128)
    for i, (caption, length) in enumerate(((SHORT, 80), (LONG, 160))):  # right-padded to multiples of 80
        theirs = step_embeds(blocks, caption)  # the step's defaults: up to 8192 tokens, multiples of 80
        assert theirs.shape == (1, length, 128)
        assert cached["prompt_embeds_mask"][i].tolist() == [1] * length + [0] * (TEXT_TOKENS - length)
        torch.testing.assert_close(cached["prompt_embeds"][i, :length], theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cached["prompt_embeds"][i, length], theirs[0, -1], rtol=1e-5, atol=1e-5)
        assert not cached["prompt_embeds"][i, length + 1:].any()
    # A batch is laid out to its longest caption: the short one is the step's own encoding at that padding.
    laid = padded_text(cached["prompt_embeds"], cached["prompt_embeds_mask"])
    assert laid.shape == (2, 160, 128)
    torch.testing.assert_close(laid[0], step_embeds(blocks, SHORT, pad_multiple=160)[0], rtol=1e-5, atol=1e-5)


def test_a_caption_longer_than_text_tokens_is_one_line_that_names_it(encoders):
    with pytest.raises(ZerotrainError, match=r"the caption 'an oil painting.*' is \d+ tokens .* above "
                                             r"data.text_tokens=90; raise data.text_tokens \(up to 8192\)"):
        encode_prompts(encoders, [SHORT, LONG], 90)


def test_cached_latents_and_references_are_the_vae_encoder_and_reference_steps(blocks, encoders):
    """The cache's grid is Flux3VaeEncoderStep's normalized, patchified mode (with batch-norm statistics that
    differ per channel), and training's reference tokens and ids are Flux3PrepareImageCondLatentsStep's."""
    vae = encoders.vae
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-1, 1, 16))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2, 16))
    pixels = torch.rand(2, 3, SIDE, SIDE, generator=gen(4)) * 2 - 1
    moments = encode_latent_moments(encoders, pixels)
    assert moments.mean.shape == (2, 16, GRID, GRID) and not moments.std.any()
    with torch.no_grad():
        patched = Flux3VaeEncoderStep._patchify_latents(vae.encode(pixels).latent_dist.mode())
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    torch.testing.assert_close(moments.mean, (patched - vae.bn.running_mean.view(1, -1, 1, 1)) / std, rtol=1e-5, atol=1e-5)

    references = [moments.mean[:1], moments.mean[1:, :, :8]]  # two references, the second 8x16 tokens
    kwargs = FAMILY.add_references(spec_of("tiny-flux3"), {"hidden_states": torch.zeros(1, 4, 16)}, references)
    theirs = run_step(Flux3PrepareImageCondLatentsStep(), image_cond_latents=references, dtype=torch.float32)
    assert torch.equal(kwargs["image_cond_hidden_states"], theirs.image_cond_hidden_states)
    assert torch.equal(kwargs["image_cond_ids"], theirs.image_cond_ids)
    assert kwargs["image_cond_ids"][:, 3].unique().tolist() == [-2.0, -1.0]


def run_step(step, **values):
    """One of the blocks' steps run on `values` (its block state) with the CPU as the execution device; the
    state it leaves."""
    state = SimpleNamespace(**values)
    step.get_block_state = lambda _: state
    step.set_block_state = lambda *_: None
    step(SimpleNamespace(_execution_device=torch.device("cpu"), vae_scale_factor=2, num_channels_latents=16), None)
    return state


# --- the objective -----------------------------------------------------------------------------------


def test_the_model_inputs_are_the_blocks_at_the_model_dtype(folder, encoders):
    """The timestep at the model's dtype, and the ids the blocks give the image and the text (the timestep's
    value, the target and the shift against the blocks' scheduler are test_families.py's)."""
    objective = objective_of(folder)
    batch = cached_batch(encoders)
    x0, noise = torch.randn(2, 16, GRID, GRID, generator=gen(2)), torch.randn(2, 16, GRID, GRID, generator=gen(3))
    sigma = torch.full((2,), 0.7)
    x_t = flow_interpolate(x0, noise, sigma)
    kwargs, _ = FAMILY.flow_inputs(objective, x_t, flow_target(x0, noise), sigma, batch)
    assert kwargs["timestep"].dtype == objective.model_dtype
    latents = run_step(Flux3PrepareLatentsStep(), height=SIDE, width=SIDE, latents=x_t, num_images_per_prompt=1,
                       generator=None, batch_size=2, dtype=torch.float32)
    assert torch.equal(kwargs["img_ids"], latents.img_ids)
    torch.testing.assert_close(kwargs["hidden_states"], latents.latents.to(objective.model_dtype))
    text = run_step(Flux3TextRoPEInputsStep(), prompt_embeds=kwargs["encoder_hidden_states"], negative_prompt_embeds=None)
    assert torch.equal(kwargs["txt_ids"], text.txt_ids)


def test_an_edit_trains_the_reference_pathway_too(folder, encoders):
    """(Text to image leaves it idle: test_families.py's.)"""
    model = Flux3Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.train()
    objective = objective_of(folder)
    batch = cached_batch(encoders)
    edit = objective.prepare({**batch, "reference_0": torch.randn(2, 16, GRID, GRID, generator=gen(5))}, gen())
    assert edit.references == 1 and edit.model_kwargs["image_cond_hidden_states"].shape == (2, GRID * GRID, 16)
    pred = model(**edit.model_kwargs, return_dict=False)[0]
    assert pred.shape == edit.target.shape == (2, GRID * GRID, 16)  # the references produce no output
    objective.loss(pred, edit).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


# --- validation ----------------------------------------------------------------------------------------


def test_validation_renders_what_the_blocks_render_from_the_prompt(root, blocks, tmp_path):
    """Guidance 3.5 with the empty negative prompt, from the cached rows: the blocks' own image from the
    prompt, text encoder step included."""
    prompt = SHORT
    _, _, validator = make_validator(root, "tiny-flux3", f"validation.prompts=['{prompt}']", "validation.seeds=[3]")
    assert validator.cfg and validator.guidance_scale == 3.5
    path = validator.render(blocks.transformer, 0, tmp_path)[0]
    rendered = check_image(path, SIDE, {"prompt": prompt, "guidance_scale": "3.5"})
    direct = blocks(prompt=prompt, negative_prompt="", height=SIDE, width=SIDE, num_inference_steps=2,
                    generator=gen(3), output="images")[0]
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= 1


# --- export --------------------------------------------------------------------------------------------


def adapted(folder, targets, rank: int = 4):
    model = Flux3Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.add_adapter(LoraConfig(r=rank, lora_alpha=8.0, target_modules=targets, init_lora_weights="gaussian"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(generator=gen(7))
    return model

def test_a_lora_trained_on_base_loads_into_the_step_distilled_flow_map(blocks, folder, tmp_path):
    """[klein] is Base distilled into a flow map: the same modules plus a target-timestep embedder. A LoRA saved
    from Base loads into the distilled blocks (Flux3DistilledAutoBlocks, 16 steps without guidance) and changes
    their render."""
    from diffusers.modular_pipelines.flux3 import Flux3DistilledAutoBlocks

    model = adapted(folder, list(FAMILY.lora_targets))
    Flux3ModularPipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(model))
    torch.manual_seed(0)
    flow_map = Flux3Transformer2DModel.from_config({**spec_of(folder).config, "flow_map": True})
    auto = Flux3DistilledAutoBlocks()
    auto.sub_blocks.pop("prompt_upsampler", None)
    distilled = auto.init_pipeline()
    distilled.update_components(transformer=flow_map, vae=blocks.vae, text_encoder=blocks.text_encoder,
                                tokenizer=blocks.tokenizer)
    distilled.set_progress_bar_config(disable=True)

    def render():
        return distilled(prompt=SHORT, height=SIDE, width=SIDE, num_inference_steps=2, generator=gen(0),
                         output_type="pt", output="images")

    before = render()
    distilled.load_lora_weights(tmp_path, adapter_name="base")
    assert "base" in flow_map.single_transformer_blocks[0].attn.to_q.scaling
    assert "base" in flow_map.mode_blocks["image"][0].ff.linear_out.scaling
    assert not torch.allclose(before, render())


def test_a_lora_outside_the_blocks_has_no_comfyui_layout(folder):
    model = adapted(folder, ["context_embedder", "to_q"])
    with pytest.raises(ZerotrainError, match="context_embedder has no name in the Black Forest Labs LoRA layout"):
        comfyui_lora_state_dict(spec_of(folder), model, get_peft_model_state_dict(model), 2.0)
