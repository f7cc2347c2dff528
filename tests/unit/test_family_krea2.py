"""Krea 2 (zerotrain/families/krea2.py) against diffusers' own Krea2Pipeline, scheduler and converters:
the catalog counts, planning, the tiny model, the cached text against encode_prompt, the transformer's
view of it against the pipeline's padded layout, the objective's timestep, sign and shift, validation
renders, and the ComfyUI exports diffusers reads back.

The tiny VAE downsamples 8x as the published one and the transformer packs 2x2 patches: 64 px images are
8x8 latents and 16 image tokens."""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift
from peft import LoraConfig, get_peft_model_state_dict
from PIL import Image

from tests.unit.test_sampling import check_image, make_validator
from tests.unit.tiny_family import bare_config, gen, plan_json, spec_of, tiny_fixtures
from zerotrain.config import RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families import example_inputs
from zerotrain.families.base import compact_rows, trim_rows
from zerotrain.families.krea2 import FAMILY, KREA2_SCHEDULER
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts
from zerotrain.objectives import flow_interpolate, flow_target, make_objective
from zerotrain.planner.measure import measure_model

# sum(p.numel() for p in model.parameters()) on the meta device (diffusers 0.42.1); Turbo is Raw distilled.
PARAMETERS = {"krea-2-raw": 12_820_073_036, "krea-2-turbo": 12_820_073_036, "tiny-krea2": 41_138}
CAPTIONS = ["a red chair", "An oil painting of Mountains at sunset, warm light on the lake!"]
TEXT_TOKENS = 40
SIDE = 64


root, folder, pipeline, encoders = tiny_fixtures("tiny-krea2", "Krea2Pipeline")


def cached_batch(encoders, side: int = SIDE // 8) -> dict[str, torch.Tensor]:
    shape = (len(CAPTIONS), 16, side, side)
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.full(shape, 0.5),
            **encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)}


def objective_of(folder, model_dtype: torch.dtype = torch.float32):
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return make_objective(spec_of(folder), scheduler, ObjectiveConfig(), SIDE, model_dtype=model_dtype)


# --- catalog and planning ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_catalog_entry_builds_on_meta_with_the_published_count(name):
    spec = spec_of(name)
    assert (spec.family, spec.class_name) == ("krea2", "Krea2Transformer2DModel")
    with torch.device("meta"):
        model = Krea2Transformer2DModel.from_config(spec.config)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    assert (spec.vae_scale_factor, spec.latent_channels, spec.vae_scaling_factor) == (8, 16, None)
    assert FAMILY.pixel_factor(spec) == 16


def test_published_configs_are_the_class_defaults():
    defaults = {k: list(p.default) if isinstance(p.default, tuple) else p.default
                for k, p in inspect.signature(Krea2Transformer2DModel.__init__).parameters.items() if k != "self"}
    for name in ("krea-2-raw", "krea-2-turbo"):
        assert {k: v for k, v in spec_of(name).config.items() if not k.startswith("_")} == defaults


def test_plans_a_lora_at_1024_on_a_24gb_card_with_the_shipped_facts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_json(capsys, "krea-2-raw", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora")["chosen"]["fits"] is True
    run = RunConfig(model={"name_or_path": "krea-2-raw"}, training={"mode": "lora"}, data={"resolution": 1024})
    facts = measure_model(spec_of("krea-2-raw"), run)
    assert facts.cached, "the plan's: shipped with zerotrain"
    assert (facts.image_tokens, facts.text_tokens) == (4096, 512)  # (1024 / 16)^2; Krea2Pipeline's 512
    assert facts.total_params > PARAMETERS["krea-2-raw"]  # the base and its adapters


def test_a_bare_config_json_plans_and_lora_counts_the_scripts_targets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = bare_config(tmp_path, spec_of("tiny-krea2").config)
    assert plan_json(capsys, path, "--resolution", "256", "--gpus", "1xRTX4090-24GB", "--mode", "lora")["chosen"]["fits"] is True
    run = RunConfig(model={"name_or_path": str(path)}, training={"mode": "lora", "lora": {"rank": 4}},
                    data={"resolution": 256})
    facts = measure_model(spec_of(path), run)
    model = Krea2Transformer2DModel.from_config(spec_of(path).config)
    targets = FAMILY.lora_targets
    adapted = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and any(n == t or n.endswith("." + t) for t in targets)]
    # Per block q, k, v, out, gate, up and down (7; not ff.gate), in the 2 image blocks and the text
    # fusion's 2; the fusion's projector, txt_in's two, img_in, final, time's two and time_mod_proj.
    assert len(adapted) == 2 * 7 + 2 * 7 + 1 + 2 + 1 + 1 + 2 + 1
    assert facts.trainable_params == sum(4 * (m.in_features + m.out_features) for m in adapted)


# --- the tiny model and the cache ---------------------------------------------------------------------


def test_tiny_folder_is_a_krea2_pipeline_with_its_template_and_taps(folder, pipeline):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Krea2Pipeline" and index["text_encoder_select_layers"] == [1, 2]
    assert pipeline.text_encoder_select_layers == (1, 2) and len(pipeline.text_encoder.language_model.layers) == 3
    tokenizer = pipeline.tokenizer
    assert len(tokenizer(pipeline.prompt_template_encode_prefix).input_ids) == pipeline.prompt_template_encode_start_idx == 34
    assert len(tokenizer(pipeline.prompt_template_encode_suffix).input_ids) == 5
    assert pipeline.scheduler.config.max_image_seq_len == 6400  # not the scheduler class's 4096


def test_cached_captions_are_the_pipelines_rows_without_the_padding(pipeline, encoders):
    cached = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    embeds, mask = pipeline.encode_prompt(CAPTIONS, max_sequence_length=TEXT_TOKENS)
    assert cached["prompt_embeds"].shape == (2, TEXT_TOKENS, 2, 16) and cached["prompt_embeds_mask"].dtype == torch.int64
    # The pipeline's mask: the prompt, padding, then the 5 suffix tokens (a hole); the cache's a prefix.
    assert mask[0, -5:].all() and not mask[0, -6] and not mask.all()
    for i in range(2):
        n = int(mask[i].sum())
        assert cached["prompt_embeds_mask"][i].tolist() == [1] * n + [0] * (TEXT_TOKENS - n)
        assert torch.equal(cached["prompt_embeds"][i, :n], embeds[i][mask[i]])
        assert not cached["prompt_embeds"][i, n:].any()


def test_the_transformer_sees_the_pipelines_layout_through_the_trimmed_cache(folder, pipeline, encoders):
    """The premise of the compact cache: every text token has RoPE position 0 and padded keys are
    masked, so the pipeline's [prompt | pad | suffix] at max_sequence_length and the cache's rows,
    trimmed to the batch's longest caption, give the same prediction."""
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders), gen())
    kwargs = prepared.model_kwargs
    longest = int(encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)["prompt_embeds_mask"].sum(1).max())
    assert kwargs["encoder_hidden_states"].shape == (2, longest, 2, 16)
    embeds, mask = pipeline.encode_prompt(CAPTIONS, max_sequence_length=TEXT_TOKENS)
    positions = Krea2Pipeline.prepare_position_ids(TEXT_TOKENS, 4, 4, "cpu")
    with torch.no_grad():
        ours = pipeline.transformer(**kwargs, return_dict=False)[0]
        theirs = pipeline.transformer(kwargs["hidden_states"], embeds, kwargs["timestep"], positions,
                                      encoder_attention_mask=mask, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.shape == prepared.target.shape == (2, 16, 64)


def test_the_cache_stores_each_caption_without_its_padding_and_reads_it_back_whole(folder, encoders, tmp_path):
    """At the pipeline's 512 tokens a caption's (12, 2560) stacks are 31 MB padded: the shard keeps its
    own rows, and the dataset gives back exactly what encode_prompts gave, padding included."""
    from safetensors import safe_open

    from zerotrain.config import load_config
    from zerotrain.data.cache import CachedDataset
    from zerotrain.data.prepare import prepare
    from zerotrain.distributed import Topology

    images = tmp_path / "images"
    images.mkdir()
    for n, caption in enumerate(CAPTIONS):
        Image.new("RGB", (SIDE, SIDE), (40 * n, 90, 200)).save(images / f"{n}.png")
        (images / f"{n}.txt").write_text(caption)
    run = load_config(None, [f"model.name_or_path={folder}", f"data.datasets=[{{path: {images}}}]",
                             f"data.resolution={SIDE}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0",
                             "training.global_batch_size=2"])
    prepared = prepare(run, spec_of(folder), Topology(0, 1, 0))
    dataset = CachedDataset(prepared.planned, run.data.cache_dir)
    shard = next((run.data.cache_dir / "text").glob("*.safetensors"))
    with safe_open(shard, framework="pt") as handle:
        stored = {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    own = sorted(int(encode_prompts(encoders, [c], 512)["prompt_embeds_mask"].sum()) for c in CAPTIONS)
    assert sorted(shape[0] for name, shape in stored.items() if name.endswith(".prompt_embeds")) == own
    assert own[-1] < 40 and sorted(shape[0] for name, shape in stored.items() if name.endswith("_mask")) == own
    for i, planned in enumerate(prepared.planned):
        direct = encode_prompts(encoders, [planned.item.caption], 512)
        sample = dataset[i]
        assert sample["prompt_embeds"].shape == (512, 2, 16)
        assert torch.equal(sample["prompt_embeds_mask"], direct["prompt_embeds_mask"][0])
        torch.testing.assert_close(sample["prompt_embeds"].float(), direct["prompt_embeds"][0], rtol=1e-2, atol=1e-2)


def test_cached_latents_are_the_vaes_normalized_per_channel(pipeline, encoders):
    pixels = torch.rand(1, 3, SIDE, SIDE, generator=gen(4)) * 2 - 1
    moments = encode_latent_moments(encoders, pixels)
    mean = pipeline.vae.encode(pixels.unsqueeze(2)).latent_dist.mean[:, :, 0]
    config = pipeline.vae.config
    expected = (mean - torch.tensor(config.latents_mean).view(1, -1, 1, 1)) / torch.tensor(config.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(moments.mean, expected)


def test_compacting_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="1..3"):
        compact_rows(torch.zeros(1, 5, 2, 4), torch.ones(1, 5, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="marks no token"):
        trim_rows(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5))


# --- the objective -----------------------------------------------------------------------------------


def test_the_timestep_is_sigma_and_the_shift_is_the_pipelines(folder, encoders):
    objective = objective_of(folder)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER)
    for tokens in (16, 4096, 9216):
        mu = calculate_shift(tokens, 256, 6400, 0.5, 1.15)  # Krea2Pipeline's mu for a Raw model
        assert objective.shift(tokens) == pytest.approx(math.exp(mu))
        scheduler.set_timesteps(sigmas=[0.5], mu=mu)
        assert float(scheduler.sigmas[0]) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1), rel=1e-6)
    prepared = objective.prepare(cached_batch(encoders), gen(5))
    assert prepared.model_kwargs["timestep"].shape == (2,)
    assert ((prepared.model_kwargs["timestep"] > 0) & (prepared.model_kwargs["timestep"] < 1)).all()


def test_one_scheduler_step_on_the_target_lands_on_the_flow(folder, encoders):
    """Krea2Pipeline steps the scheduler with the output as it is (noise - x0): with the output equal to
    flow_inputs' target, each Euler step lands on the next point of the flow, and the timestep the
    transformer gets is the scheduler's t / 1000."""
    objective = objective_of(folder)
    batch = cached_batch(encoders)
    x0, noise = torch.randn(2, 16, 8, 8, generator=gen(2)), torch.randn(2, 16, 8, 8, generator=gen(3))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4).tolist(), mu=0.8)
    scheduler.set_begin_index(0)
    for i, timestep in enumerate(scheduler.timesteps):
        sigma = scheduler.sigmas[i].expand(2)
        x_t = flow_interpolate(x0, noise, sigma)
        kwargs, target = FAMILY.flow_inputs(objective, x_t, flow_target(x0, noise), sigma, batch)
        torch.testing.assert_close(kwargs["timestep"], timestep.expand(2) / 1000)
        stepped = scheduler.step(FAMILY.target_layout(noise - x0), timestep, FAMILY.target_layout(x_t),
                                 return_dict=False)[0]
        torch.testing.assert_close(stepped, FAMILY.target_layout(flow_interpolate(x0, noise, scheduler.sigmas[i + 1].expand(2))))
        torch.testing.assert_close(target, FAMILY.target_layout(noise - x0))


def test_the_planners_inputs_run_the_model(folder):
    spec = spec_of(folder)
    model = Krea2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    with torch.no_grad():
        out = model(**example_inputs(spec, 2, SIDE, SIDE, 12, "cpu", torch.float32), return_dict=False)[0]
    assert out.shape == (2, 16, 64)


def test_prepare_backpropagates_into_every_parameter(folder, encoders):
    model = Krea2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.train()
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders), gen())
    loss = objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared)
    loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


# --- validation ----------------------------------------------------------------------------------------


def test_validation_renders_what_the_pipeline_renders_from_the_prompt(root, pipeline, tmp_path):
    """The default guidance 4.5 guides with the encoded "" as Krea2Pipeline does: rendering from the
    cached rows gives the pipeline's own image, pixel for pixel."""
    prompt = CAPTIONS[0]
    _, _, validator = make_validator(root, "tiny-krea2", f"validation.prompts=['{prompt}']", "validation.seeds=[3]")
    assert validator.cfg and validator.guidance_scale == 4.5
    path = validator.render(pipeline.transformer, 0, tmp_path)[0]
    rendered = check_image(path, SIDE, {"prompt": prompt, "guidance_scale": "4.5", "negative_prompt": ""})
    direct = pipeline(prompt, height=SIDE, width=SIDE, num_inference_steps=2, guidance_scale=4.5,
                      generator=gen(3)).images[0]
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= 1


# --- export --------------------------------------------------------------------------------------------


def test_comfyui_lora_is_the_original_names_that_diffusers_loads_as_the_same_adapter(folder):
    model = Krea2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    rank, alpha = 4, 8.0
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(FAMILY.lora_targets),
                                 init_lora_weights="gaussian"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(generator=gen(7))
    layers = get_peft_model_state_dict(model)
    comfy = comfyui_lora_state_dict(spec_of(folder), model, layers, alpha)
    assert {"diffusion_model.blocks.0.attn.wq.lora_A.weight", "diffusion_model.blocks.1.mlp.down.lora_B.weight",
            "diffusion_model.txtfusion.projector.lora_A.weight", "diffusion_model.first.lora_A.weight",
            "diffusion_model.tproj.1.lora_B.weight", "diffusion_model.last.linear.lora_A.weight"} <= comfy.keys()
    assert not [k for k in comfy if "alpha" in k or "transformer_blocks" in k]
    state = Krea2Pipeline.lora_state_dict(dict(comfy))  # diffusers' reader of Krea's and ComfyUI's names
    state = state[0] if isinstance(state, tuple) else state
    modules = {k.removesuffix(".lora_A.weight") for k in layers if k.endswith(".lora_A.weight")}
    assert {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in state} == modules
    for module in modules:
        expected = layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * (alpha / rank)
        got = state[f"transformer.{module}.lora_B.weight"] @ state[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # And the pipeline loads the file (a pipeline of its own: the adapter stays in its transformer).
    Krea2Pipeline.from_pretrained(folder).load_lora_weights(dict(comfy))


def test_comfyui_model_is_the_original_layout_and_converts_back_exactly(folder):
    weights = Krea2Transformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    comfy = FAMILY.comfyui_model(dict(weights))
    assert {"blocks.0.attn.wq.weight", "blocks.0.mod.lin", "txtfusion.projector.weight", "first.weight",
            "last.modulation.lin", "tmlp.0.weight"} <= comfy.keys()
    assert comfy["blocks.0.mod.lin"].ndim == 1  # the original stores the six modulation vectors flat
    back = convert_krea2_transformer_checkpoint_to_diffusers(dict(comfy))
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k].reshape(weights[k].shape), weights[k]) for k in weights)
