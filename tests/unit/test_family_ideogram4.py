"""Ideogram 4 (zerotrain/families/ideogram4.py) against diffusers' own Ideogram4Pipeline, its scheduler and
LoRA converter: the catalog counts, planning, the tiny model with its two transformers, the cached text
against encode_prompt, the transformer's view of training's [image | text | padding] layout against the
pipeline's [padding | text | image], the latents' fold against the pipeline's unfold, the objective's
timestep, sign, shift and logit-normal std, validation renders, and the ComfyUI LoRA diffusers reads back.

The tiny VAE downsamples 2x and folds 2x2 cells: 64 px images are 16x16 tokens of 16 channels."""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import Ideogram4Transformer2DModel
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu
from peft import LoraConfig, get_peft_model_state_dict

from tests.unit.tiny_family import gen, plan_json, spec_of, tiny_fixtures
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families.ideogram4 import FAMILY, IDEOGRAM4_SCHEDULER
from zerotrain.families.runtime.parts.tiny import QWEN3_VL_TEXT_TEMPLATE

fold = FAMILY.codec.fold
from zerotrain.families.runtime.parts.tiny import QWEN3_PROMPT
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts
from zerotrain.objectives import make_objective

# sum(p.numel() for p in model.parameters()) on the meta device (diffusers 0.42.1), one transformer.
PARAMETERS = {"ideogram-4": 9_279_288_448, "tiny-ideogram4": 36_368}
CAPTIONS = ["a red chair", "An oil painting of Mountains at sunset, warm light on the lake!"]
TEXT_TOKENS = 40
SIDE = 64
GRID = SIDE // 4  # 16x16 tokens


root, folder, pipeline, encoders = tiny_fixtures("tiny-ideogram4", "Ideogram4Pipeline")


def cached_batch(encoders, n: int = 2) -> dict[str, torch.Tensor]:
    shape = (n, 16, GRID, GRID)
    text = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.zeros(shape),
            **{name: value.repeat(n // 2, *[1] * (value.ndim - 1)) for name, value in text.items()}}


def objective_of(folder, **config):
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return make_objective(spec_of(folder), scheduler, ObjectiveConfig(**config), SIDE)


# --- catalog and planning ----------------------------------------------------------------------------

def test_validation_counts_the_unconditional_transformer_each_rank_loads_into_host_memory(tmp_path, monkeypatch, capsys):
    """Training loads one transformer; a run with validation prompts also loads the unconditional one on
    every rank while it renders (host memory; group-offloaded to the GPU a block at a time): the plan's
    host RAM per node has a validation phase of training's (the offload's buffers, the DataLoader workers) plus
    8 bf16 copies of it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def chosen(*extra: str) -> dict:
        return plan_json(capsys, "ideogram-4", "--resolution", "1024", "--gpus", "8xH100-80GB", "--mode", "lora",
                         *extra)["chosen"]["memory"]

    plain = chosen()
    validating = chosen("--set", "validation.prompts=['a cat']")
    assert "validation" not in plain["host_terms"]
    terms = validating["host_terms"]
    assert terms["validation"] == terms["training"] + 8 * 2 * PARAMETERS["ideogram-4"]
    assert validating["host_per_node"] == terms["validation"] > plain["host_per_node"]


# --- the tiny model and the cache ---------------------------------------------------------------------


def test_tiny_folder_is_an_ideogram4_pipeline_with_both_transformers(folder, pipeline):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Ideogram4Pipeline" and index["prompt_enhancer_head"] == [None, None]
    assert (folder / "unconditional_transformer" / "config.json").is_file()
    # Another seed, so the two branches differ as two trained networks do.
    assert not torch.equal(pipeline.transformer.input_proj.weight, pipeline.unconditional_transformer.input_proj.weight)
    assert len(pipeline.text_encoder.language_model.layers) == 36  # the pipeline taps layer 35 by index
    messages = [{"role": "user", "content": [{"type": "text", "text": "a cat"}]}]
    assert pipeline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) \
        == QWEN3_PROMPT.format("a cat")
    assert pipeline.tokenizer.chat_template == QWEN3_VL_TEXT_TEMPLATE
    assert not pipeline.scheduler.config.use_dynamic_shifting and pipeline.scheduler.config.shift == 1.0

def test_a_caption_longer_than_text_tokens_is_one_line_that_names_it(encoders):
    with pytest.raises(ZerotrainError, match=r"the caption 'An oil painting.*' is \d+ tokens .* above "
                                             r"data.text_tokens=12 .* raise data.text_tokens \(up to 2048\)"):
        encode_prompts(encoders, CAPTIONS, 12)


def test_the_transformer_sees_the_pipelines_layout_in_trainings(pipeline, folder, encoders):
    """Training's [image | text | padding] against the pipeline's [padding | text | image] at
    max_sequence_length: the same image prediction, and the prediction's first rows are the image's."""
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders), gen())
    kwargs = prepared.model_kwargs
    longest = int(encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)["prompt_embeds_mask"].sum(1).max())
    assert kwargs["hidden_states"].shape == (2, GRID * GRID + longest, 16)
    features, positions, segments, indicator = pipeline.encode_prompt(CAPTIONS, GRID, GRID, TEXT_TOKENS, "cpu")
    image = kwargs["hidden_states"][:, :GRID * GRID]
    with torch.no_grad():
        ours = pipeline.transformer(**kwargs, return_dict=False)[0]
        theirs = pipeline.transformer(torch.cat([torch.zeros(2, TEXT_TOKENS, 16), image], dim=1), kwargs["timestep"],
                                      features, positions, segments, indicator, return_dict=False)[0]
    torch.testing.assert_close(ours[:, :GRID * GRID], theirs[:, TEXT_TOKENS:], rtol=1e-5, atol=1e-5)
    assert prepared.target.shape == (2, GRID * GRID, 16)
    loss = objective.loss(ours, prepared)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(ours[:, :GRID * GRID], prepared.target))


def test_cached_latents_are_folded_as_the_pipeline_unfolds_them(pipeline, encoders):
    """The cache's (B, 128, h, w) grid, read as the pipeline reads its tokens before decoding (times the
    batch-norm std, plus its mean, unfolded), is the VAE's posterior mode: with batch-norm statistics that
    differ per channel, a fold in FLUX.2's channel-first order would not be."""
    vae = encoders.vae
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-1, 1, 16))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2, 16))
    pixels = torch.rand(1, 3, SIDE, SIDE, generator=gen(4)) * 2 - 1
    moments = encode_latent_moments(encoders, pixels)
    assert moments.mean.shape == (1, 16, GRID, GRID) and not moments.std.any()
    z = FAMILY.target_layout(moments.mean)
    z = z * torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps) + vae.bn.running_mean  # as __call__ decodes
    z = z.view(1, GRID, GRID, 2, 2, 4).permute(0, 5, 1, 3, 2, 4).reshape(1, 4, 2 * GRID, 2 * GRID)
    with torch.no_grad():
        mode = vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(z, mode, rtol=1e-5, atol=1e-5)
    assert torch.equal(fold(mode).flatten(2).transpose(1, 2), FAMILY.target_layout(fold(mode)))


# --- the objective -----------------------------------------------------------------------------------


def test_the_shift_and_the_logit_normal_are_the_pipelines_sigmas(folder, encoders):
    """The pipeline's sigmas are quantiles of sigmoid(mu + 1.5 z), mu = 0.5 ln(H W / 512^2): training draws
    sigma so, which is a logit-normal(0, 1.5) draw shifted by e^mu."""
    for side, tokens in ((SIDE, GRID * GRID), (1024, 64 * 64 * 16)):  # the table's shifts are the pipeline's mu
        assert math.exp(_resolution_aware_mu(side, side, 0.0)) == pytest.approx(math.exp(0.5 * math.log(side * side / 512**2)))
    quantiles = _logit_normal_sigmas(8, math.log(0.5), std=1.5)
    z = torch.special.ndtri(torch.linspace(0, 1, 9, dtype=torch.float64))[1:-1]  # the finite quantiles
    shifted = 0.5 * torch.sigmoid(1.5 * z) / (1 + (0.5 - 1) * torch.sigmoid(1.5 * z))
    torch.testing.assert_close(quantiles[1:].double(), shifted.flip(0), rtol=1e-5, atol=1e-6)
    # What prepare draws: logit-normal with the family's std 1.5 unless objective.logit_std says otherwise.
    for config, std in (({}, 1.5), ({"logit_std": 1.0}, 1.0)):
        prepared = make_objective(spec_of(folder), IDEOGRAM4_SCHEDULER, ObjectiveConfig(**config), SIDE) \
            .prepare(cached_batch(encoders, 512), gen(6))
        sigma = 1 - prepared.model_kwargs["timestep"].double()
        unshifted = sigma / (0.125 - (0.125 - 1) * sigma)  # the tiny model's e^mu at 64 px
        assert torch.logit(unshifted).std().item() == pytest.approx(std, rel=0.1)

# --- validation ----------------------------------------------------------------------------------------

# --- export --------------------------------------------------------------------------------------------

def test_modules_outside_the_blocks_have_no_comfyui_lora_layout(folder):
    model = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.add_adapter(LoraConfig(r=2, target_modules=["input_proj", "to_q"]))
    with pytest.raises(ZerotrainError, match="input_proj has no name in the community LoRA layout"):
        comfyui_lora_state_dict(spec_of(folder), model, get_peft_model_state_dict(model), 2.0)


def test_the_full_comfyui_export_is_the_original_layout_and_reads_back_exactly(folder, tmp_path):
    """ComfyUI's Ideogram 4 layout (its model detection, the original checkpoint's names): per block
    attention.qkv (q, k, v rows), attention.o, norm_q / norm_k, the sandwich norms, feed_forward w1-w3 and
    adaln_modulation; the rest as diffusers names it. Written by the export, read back by the inverse
    conversion, every tensor is diffusers' own, and the transformer loads it strictly."""
    from safetensors.torch import load_file

    from zerotrain.export import COMFYUI_DIR, _write_full
    from zerotrain.families.ideogram4 import comfyui_model_to_diffusers

    model = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _write_full(tmp_path / "out", spec_of(folder), weights, True, "full")
    comfy = load_file(str(tmp_path / "out" / COMFYUI_DIR / "full.safetensors"))
    layers = int(model.config.num_layers)
    per_block = {"attention.qkv.weight", "attention.o.weight", "attention.norm_q.weight", "attention.norm_k.weight",
                 "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                 "attention_norm1.weight", "attention_norm2.weight", "ffn_norm1.weight", "ffn_norm2.weight",
                 "adaln_modulation.weight", "adaln_modulation.bias"}
    assert {k for k in comfy if k.startswith("layers.")} == {f"layers.{i}.{name}" for i in range(layers)
                                                              for name in per_block}
    q, k, v = (weights[f"layers.0.attention.{n}.weight"] for n in ("to_q", "to_k", "to_v"))
    assert torch.equal(comfy["layers.0.attention.qkv.weight"], torch.cat([q, k, v]))
    back = comfyui_model_to_diffusers(comfy)
    assert back.keys() == weights.keys() and all(torch.equal(back[key], weights[key]) for key in weights)
    Ideogram4Transformer2DModel.from_config(model.config).load_state_dict(back, strict=True)
