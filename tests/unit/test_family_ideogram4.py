"""Ideogram 4 (zerotrain/families/ideogram4.py) against diffusers' own Ideogram4Pipeline, its scheduler and
LoRA converter: the catalog counts, planning, the tiny model with its two transformers, the cached text
against encode_prompt, the transformer's view of training's [image | text | padding] layout against the
pipeline's [padding | text | image], the latents' fold against the pipeline's unfold, the objective's
timestep, sign, shift and logit-normal std, validation renders, and the ComfyUI LoRA diffusers reads back.

The tiny VAE downsamples 2x and folds 2x2 cells: 64 px images are 16x16 tokens of 16 channels."""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu
from peft import LoraConfig, get_peft_model_state_dict

from tests.unit.test_sampling import check_image, make_validator
from tests.unit.tiny_family import bare_config, gen, plan_json, spec_of, tiny_fixtures
from zerotrain.config import RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families import example_inputs
from zerotrain.families.ideogram4 import FAMILY, IDEOGRAM4_SCHEDULER
from zerotrain.families.parts.tiny import QWEN3_VL_TEXT_TEMPLATE

fold = FAMILY.codec.fold
from zerotrain.families.parts.tiny import QWEN3_PROMPT
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts
from zerotrain.objectives import flow_interpolate, flow_target, make_objective
from zerotrain.planner.measure import measure_model

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


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_catalog_entry_builds_on_meta_with_the_published_count(name):
    spec = spec_of(name)
    assert (spec.family, spec.class_name) == ("ideogram4", "Ideogram4Transformer2DModel")
    with torch.device("meta"):
        model = Ideogram4Transformer2DModel.from_config(spec.config)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    side = 16 if name == "ideogram-4" else 4  # 8x VAE and 2x2 fold; the tiny VAE is 2x
    assert (spec.vae_scale_factor, spec.vae_scaling_factor, FAMILY.pixel_factor(spec)) == (side, None, side)


def test_the_published_config_is_the_class_defaults():
    defaults = {k: list(p.default) if isinstance(p.default, tuple) else p.default
                for k, p in inspect.signature(Ideogram4Transformer2DModel.__init__).parameters.items() if k != "self"}
    assert {k: v for k, v in spec_of("ideogram-4").config.items() if not k.startswith("_")} == defaults


def test_plans_a_lora_at_1024_on_a_24gb_card_with_the_shipped_facts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_json(capsys, "ideogram-4", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora")["chosen"]["fits"] is True
    run = RunConfig(model={"name_or_path": "ideogram-4"}, training={"mode": "lora"}, data={"resolution": 1024})
    facts = measure_model(spec_of("ideogram-4"), run)
    assert facts.cached, "the plan's: shipped with zerotrain"
    assert (facts.image_tokens, facts.text_tokens) == (4096, 512)  # (1024 / 16)^2
    # One transformer and its adapters: the unconditional one is not loaded for training.
    assert PARAMETERS["ideogram-4"] < facts.total_params < 1.1 * PARAMETERS["ideogram-4"]


def test_a_bare_published_config_json_plans_at_1024_and_lora_counts_the_scripts_targets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = bare_config(tmp_path, spec_of("ideogram-4").config)
    assert plan_json(capsys, path, "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora")["chosen"]["fits"] is True
    run = RunConfig(model={"name_or_path": str(path)}, training={"mode": "lora", "lora": {"rank": 4}},
                    data={"resolution": 1024})
    facts = measure_model(spec_of(path), run)
    assert not facts.cached and facts.image_tokens == 4096
    # Per block q, k, v, out (4608 -> 4608), w1 and w3 (4608 -> 12288), w2 (12288 -> 4608); 34 blocks.
    per_block = 4 * 4 * (4608 + 4608) + 3 * 4 * (4608 + 12288)
    assert facts.trainable_params == 34 * per_block
    assert facts.total_params == PARAMETERS["ideogram-4"] + 34 * per_block


def test_validation_counts_the_unconditional_transformer_each_rank_loads_into_host_memory(tmp_path, monkeypatch, capsys):
    """Training loads one transformer; a run with validation prompts also loads the unconditional one on
    every rank while it renders (host memory; group-offloaded to the GPU a block at a time): the plan's
    host RAM per node has a validation phase of the offload's buffers plus 8 bf16 copies of it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def chosen(*extra: str) -> dict:
        return plan_json(capsys, "ideogram-4", "--resolution", "1024", "--gpus", "8xH100-80GB", "--mode", "lora",
                         *extra)["chosen"]["memory"]

    plain = chosen()
    validating = chosen("--set", "validation.prompts=['a cat']")
    assert "validation" not in plain["host_terms"]
    terms = validating["host_terms"]
    assert terms["validation"] == terms["offload"] + 8 * 2 * PARAMETERS["ideogram-4"]
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


def test_cached_captions_are_the_pipelines_text_rows_without_the_padding(pipeline, encoders):
    cached = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    features, _, _, indicator = pipeline.encode_prompt(CAPTIONS, 1, 1, TEXT_TOKENS, "cpu")
    assert cached["prompt_embeds"].shape == (2, TEXT_TOKENS, 208)
    for i in range(2):
        text = indicator[i, :TEXT_TOKENS] == 3  # the pipeline pads on the left
        n = int(text.sum())
        assert 8 < n < TEXT_TOKENS and not text[0]
        assert cached["prompt_embeds_mask"][i].tolist() == [1] * n + [0] * (TEXT_TOKENS - n)
        assert torch.equal(cached["prompt_embeds"][i, :n], features[i, :TEXT_TOKENS][text])
        assert not cached["prompt_embeds"][i, n:].any()


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
    objective = objective_of(folder)
    for side, tokens in ((SIDE, GRID * GRID), (1024, 64 * 64 * 16)):  # the tiny 4 px a token; 1024 px
        mu = _resolution_aware_mu(side, side, 0.0)
        assert objective.shift(tokens) == pytest.approx(math.exp(mu))
    assert objective.shift(64 * 64) == pytest.approx(0.5)  # 256 px on the tiny model: sqrt(256 * 256) / 512
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


def test_one_scheduler_step_on_the_negated_output_lands_on_the_flow(folder, encoders):
    """Ideogram4Pipeline passes t = 1 - sigma and steps the scheduler with the negated output: with the
    output equal to flow_inputs' target (x0 - noise), each Euler step lands on the next point of the flow."""
    objective = objective_of(folder)
    batch = cached_batch(encoders)
    x0, noise = torch.randn(2, 16, GRID, GRID, generator=gen(2)), torch.randn(2, 16, GRID, GRID, generator=gen(3))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(IDEOGRAM4_SCHEDULER)
    scheduler.set_timesteps(sigmas=_logit_normal_sigmas(4, 0.3, std=1.5).tolist())
    scheduler.set_begin_index(0)
    for i, timestep in enumerate(scheduler.timesteps):
        sigma = scheduler.sigmas[i].expand(2)
        x_t = flow_interpolate(x0, noise, sigma)
        kwargs, target = FAMILY.flow_inputs(objective, x_t, flow_target(x0, noise), sigma, batch)
        torch.testing.assert_close(kwargs["timestep"], 1 - timestep.expand(2) / 1000)
        torch.testing.assert_close(target, FAMILY.target_layout(x0 - noise))
        stepped = scheduler.step(-target, timestep, FAMILY.target_layout(x_t), return_dict=False)[0]
        torch.testing.assert_close(stepped, FAMILY.target_layout(flow_interpolate(x0, noise, scheduler.sigmas[i + 1].expand(2))))


def test_the_planners_inputs_run_the_model(folder):
    model = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    with torch.no_grad():
        out = model(**example_inputs(spec_of(folder), 2, SIDE, SIDE, 12, "cpu", torch.float32), return_dict=False)[0]
    assert out.shape == (2, GRID * GRID + 12, 16)


def test_prepare_backpropagates_into_every_parameter(folder, encoders):
    model = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.train()
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders), gen())
    objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


# --- validation ----------------------------------------------------------------------------------------


def test_validation_renders_what_the_pipeline_renders_from_the_prompt(root, pipeline, tmp_path):
    """Both transformers, guidance 7 at every step, from the cached rows: the pipeline's own image from
    the prompt (which it pads to 2048 tokens)."""
    prompt = CAPTIONS[0]
    _, _, validator = make_validator(root, "tiny-ideogram4", f"validation.prompts=['{prompt}']", "validation.seeds=[3]")
    assert not validator.cfg and validator.guidance_scale == 7.0
    path = validator.render(pipeline.transformer, 0, tmp_path)[0]
    rendered = check_image(path, SIDE, {"prompt": prompt, "guidance_scale": "7.0"})
    direct = pipeline(prompt, height=SIDE, width=SIDE, num_inference_steps=2, guidance_scale=7.0, guidance_schedule=None,
                      generator=gen(3)).images[0]
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= 1


# --- export --------------------------------------------------------------------------------------------


def test_comfyui_lora_is_the_fused_community_layout_that_diffusers_loads_as_the_same_adapter(folder):
    model = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    rank, alpha = 4, 8.0
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=[*FAMILY.lora_targets, "layers.0.adaln_modulation", "layers.1.adaln_modulation"],
                                 init_lora_weights="gaussian"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(generator=gen(7))
    layers = get_peft_model_state_dict(model)
    comfy = comfyui_lora_state_dict(spec_of(folder), model, layers, alpha)
    assert {"diffusion_model.layers.0.attention.qkv.lora_down.weight", "diffusion_model.layers.1.attention.o.alpha",
            "diffusion_model.layers.1.feed_forward.w2.lora_up.weight",
            "diffusion_model.layers.0.adaln_modulation.lora_down.weight"} <= comfy.keys()
    assert comfy["diffusion_model.layers.0.attention.qkv.lora_down.weight"].shape[0] == 3 * rank
    state = Ideogram4Pipeline.lora_state_dict(dict(comfy))  # diffusers' reader of the community layout
    state = state[0] if isinstance(state, tuple) else state
    modules = {k.removesuffix(".lora_A.weight") for k in layers if k.endswith(".lora_A.weight")}
    assert {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in state} == modules
    for module in modules:
        expected = layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * (alpha / rank)
        got = state[f"transformer.{module}.lora_B.weight"] @ state[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    Ideogram4Pipeline.from_pretrained(folder).load_lora_weights(dict(comfy))


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
