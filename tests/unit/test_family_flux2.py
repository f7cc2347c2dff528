"""What is special to FLUX.2 ([dev] and [klein], zerotrain/families/flux2.py) against diffusers itself: the
catalog's pipelines and bare VAE facts, the class defaults the family assumes, [klein]'s LoRA plan, the meta
trace's inputs, the tiny folders through Flux2Pipeline / Flux2KleinPipeline, [klein]'s cached text against
Flux2KleinPipeline.encode_prompt, the linear shift and a set shift, the model inputs (ids, guidance for [dev]
alone), validation for klein-base and distilled klein, and [klein]'s ComfyUI exports against diffusers' own
converters. [dev]'s tiny model is test_families.py's row, with the checks every family shares."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict

from tests.unit.tiny_family import tiny_encoders, tiny_pipeline, tiny_root
from zerotrain.config import ModelConfig, RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.export import lora_metadata
from zerotrain.families import example_inputs, of
from zerotrain.families.flux2 import (
    DENOISER_DEFAULTS,
    FLUX2_SCHEDULER,
    PIPELINE_STEPS,
)
from zerotrain.families.parts.latents import FLUX2_VAE_DEFAULTS as VAE_DEFAULTS
from zerotrain.models.catalog import resolve_model
from zerotrain.models.conditioning import encode_prompts
from zerotrain.models.tiny import build_tiny_pipeline, ensure_tiny_pipeline
from zerotrain.objectives import make_objective, sample_flow_timesteps, shift_sigmas
from zerotrain.planner.measure import measure_model
from zerotrain.protocols import ModelSpec

# sum(p.numel()) of Flux2Transformer2DModel built on meta from each catalog config (diffusers 0.42).
PARAMETERS = {
    "flux2-dev": 32_223_281_152,
    "flux2-klein-4b": 3_875_544_576,
    "flux2-klein-9b": 9_078_581_248,
    "tiny-flux2": 104_128,
    "tiny-flux2-klein": 102_080,
}
PIPELINES = {"tiny-flux2": "Flux2Pipeline", "tiny-flux2-klein": "Flux2KleinPipeline"}
CAPTIONS = ["a photo of a cat sitting on a red chair", "An oil painting of Mountains at sunset, unseen words!"]
# The tiny [dev] template (Mistral's system prompt first) takes ~40 tokens before the caption.
TEXT_TOKENS = 64
# The tiny VAEs downsample 2x and patchify 2x2: 32 px are 8x8 latent cells, 64 image tokens.
SIDE = 32


def spec_of(name: str | Path) -> ModelSpec:
    return resolve_model(ModelConfig(name_or_path=str(name)))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pixels(batch: int = 2, side: int = SIDE) -> torch.Tensor:
    return torch.rand(batch, 3, side, side, generator=gen()) * 2 - 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {name: ensure_tiny_pipeline(name, tiny_root(tmp_path_factory)) for name in PIPELINES}


@pytest.fixture(scope="module", params=list(PIPELINES))
def tiny(request, folders) -> tuple[str, Path, object]:
    """A tiny folder, and its pipeline loaded offline through the class pipeline_name says."""
    name = request.param
    return name, folders[name], tiny_pipeline(folders[name], PIPELINES[name])


# --- 1. catalog ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_catalog_entries_title_pipeline_and_bare_vae(name, tmp_path):
    """The counts and VAE facts on meta are test_families.py's."""
    spec = spec_of(name)
    assert of(spec).title == "FLUX.2"
    assert spec.latent_channels == spec.config["in_channels"]
    klein = not spec.config["guidance_embeds"]
    assert of(spec).pipeline_name(spec) == ("Flux2KleinPipeline" if klein else "Flux2Pipeline")
    bare = tmp_path / "config.json"  # a bare config.json assumes the published VAE
    bare.write_text(json.dumps(spec.config))
    derived = spec_of(bare)
    assert (derived.latent_channels, derived.vae_scale_factor, derived.vae_scaling_factor) == (spec.config["in_channels"], 16, None)


def test_defaults_are_the_diffusers_classes_own():
    """The defaults the family assumes for omitted config fields are the classes' own (FLUX.2 [dev]'s published
    config against Flux2Transformer2DModel's defaults is test_families.py's)."""
    def defaults(cls):
        return {key: list(p.default) if isinstance(p.default, tuple) else p.default
                for key, p in inspect.signature(cls.__init__).parameters.items()}

    transformer, vae = defaults(Flux2Transformer2DModel), defaults(diffusers.AutoencoderKLFlux2)
    assert {key: transformer[key] for key in DENOISER_DEFAULTS} == DENOISER_DEFAULTS
    assert {key: vae[key] for key in VAE_DEFAULTS} == VAE_DEFAULTS


def test_folder_vae_facts_come_from_autoencoder_kl_flux2(folders):
    spec = spec_of(folders["tiny-flux2"])
    assert (spec.vae_scale_factor, spec.latent_channels) == (4, 16)
    vae = diffusers.AutoencoderKLFlux2.from_pretrained(folders["tiny-flux2"], subfolder="vae")
    assert of(spec).codec.vae_downsampling(vae) == 4 and of(spec).codec.vae_latent_channels(vae) == 16
    with pytest.raises(ZerotrainError, match="patch_size"):
        of(spec).codec.vae_facts({"patch_size": [1, 1]})


# --- 2. planning ---------------------------------------------------------------------------------------

def test_klein_lora_plan_counts_the_default_targets(tmp_path):
    """The default targets wrap both kinds of block (a double block's to_out is a ModuleList, so the
    single blocks' are named by index), as many parameters as peft's own count on the meta model."""
    spec = spec_of("flux2-klein-4b")
    run = RunConfig(model={"name_or_path": "flux2-klein-4b"}, training={"mode": "lora", "lora": {"rank": 4}},
                    data={"resolution": 512, "text_tokens": 64}, planner={"cache_dir": tmp_path})
    facts = measure_model(spec, run)
    with torch.device("meta"):
        model = spec.denoiser_class().from_config(spec.config)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=of(spec).default_lora_targets(spec)), model)
    wrapped = {name.rsplit(".lora_", 1)[0] for name, _ in model.named_parameters() if "lora_" in name}
    assert len(wrapped) == 4 * 5 + 2 * 20  # q, k, v, out of 5 double blocks; in and out of 20 single
    assert facts.trainable_params == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert facts.image_tokens == 32 * 32 and facts.total_params == PARAMETERS["flux2-klein-4b"] + facts.trainable_params

def test_example_inputs_run_the_real_denoiser_on_meta():
    """The trace's inputs (pipeline-shaped, ids built without .item()) run forward and backward on meta."""
    spec = spec_of("tiny-flux2")
    inputs = example_inputs(spec, 2, 64, 48, 8, "meta", torch.bfloat16)
    assert inputs["hidden_states"].shape == (2, 16 * 12, 16) and inputs["img_ids"].shape == (2, 16 * 12, 4)
    assert inputs["txt_ids"].shape == (2, 8, 4) and inputs["guidance"].shape == (2,)
    with torch.device("meta"):
        model = spec.denoiser_class().from_config(spec.config).to(torch.bfloat16)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == inputs["hidden_states"].shape
    out.float().mean().backward()
    assert "guidance" not in example_inputs(spec_of("flux2-klein-4b"), 1, 64, 64, 8, "meta", torch.bfloat16)


# --- 3 + 4. tiny folders and the cache -----------------------------------------------------------------


def test_tiny_folder_renders_offline_through_its_pipeline(tiny, monkeypatch):
    name, folder, pipeline = tiny
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = diffusers.DiffusionPipeline.from_pretrained(folder)
    assert type(again).__name__ == type(pipeline).__name__ == PIPELINES[name]
    image = pipeline(prompt=CAPTIONS[0], height=SIDE, width=SIDE, num_inference_steps=2, output_type="pt",
                     max_sequence_length=TEXT_TOKENS, generator=gen()).images
    assert image.shape == (1, 3, SIDE, SIDE) and torch.isfinite(image).all()


def test_tiny_build_is_deterministic_and_keeps_the_global_rng(folders, tmp_path):
    import hashlib

    def digest(folder: Path) -> dict[str, str]:
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    state = torch.get_rng_state()
    again = build_tiny_pipeline("tiny-flux2", tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), state)
    assert digest(again) == digest(folders["tiny-flux2"])


def test_klein_encode_prompts_equals_the_pipelines_encode_prompt(folders):
    """[klein]'s Qwen3 (test_families.py checks [dev]'s Mistral)."""
    folder = folders["tiny-flux2-klein"]
    encoders = tiny_encoders(folder)
    got = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    with torch.no_grad():
        embeds, _ = tiny_pipeline(folder, PIPELINES["tiny-flux2-klein"]).encode_prompt(
            CAPTIONS, device="cpu", max_sequence_length=TEXT_TOKENS)
    assert list(got) == ["prompt_embeds"] and got["prompt_embeds"].shape == (2, TEXT_TOKENS, 48)
    assert torch.equal(got["prompt_embeds"], embeds)
    assert not torch.allclose(got["prompt_embeds"][0], got["prompt_embeds"][1])
    with pytest.raises(ZerotrainError, match="text_tokens=0"):
        encode_prompts(encoders, CAPTIONS, 0)


# --- 5. objective --------------------------------------------------------------------------------------


def test_pipeline_steps_is_both_pipelines_default():
    for cls in (Flux2Pipeline, Flux2KleinPipeline):
        assert inspect.signature(cls.__call__).parameters["num_inference_steps"].default == PIPELINE_STEPS


def test_a_linear_time_shift_is_mu_and_a_set_shift_is_kept():
    """(The exponential shift, the pipeline's, is test_families.py's.)"""
    spec = spec_of("tiny-flux2")
    objective = make_objective(spec, FLUX2_SCHEDULER, ObjectiveConfig(), SIDE)
    for tokens in (256, 4096):
        linear = dataclasses.replace(objective, scheduler_config={**FLUX2_SCHEDULER, "time_shift_type": "linear"})
        assert linear.shift(tokens) == compute_empirical_mu(tokens, PIPELINE_STEPS)
        assert make_objective(spec, FLUX2_SCHEDULER, ObjectiveConfig(shift=1.0), SIDE).shift(tokens) == 1.0


def make_batch(spec: ModelSpec, side: int, batch: int = 2) -> dict[str, torch.Tensor]:
    """A batch as the cache collates it: bf16 latent mode with std 0, bf16 prompt embeddings."""
    shape = (batch, spec.latent_channels, side, side)
    mean = torch.randn(shape, generator=gen(1)).bfloat16()
    return {"latent_mean": mean, "latent_std": torch.zeros_like(mean),
            "prompt_embeds": torch.randn(batch, 8, spec.config["joint_attention_dim"], generator=gen(2)).bfloat16()}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_prepare_feeds_the_denoiser_as_the_pipeline_does(name, folders):
    spec = spec_of(folders[name])
    config = ObjectiveConfig(guidance=2.5)
    objective = make_objective(spec, FLUX2_SCHEDULER, config, SIDE)
    batch = make_batch(spec, 6)
    prepared = objective.prepare(batch, gen(5))
    kwargs = prepared.model_kwargs
    t = sample_flow_timesteps(config, 2, _after_flip(gen(5)))
    sigma = shift_sigmas(t, objective.shift(36))
    torch.testing.assert_close(kwargs["timestep"], sigma)  # sigma itself: the model scales by 1000
    torch.testing.assert_close(kwargs["img_ids"], Flux2Pipeline._prepare_latent_ids(batch["latent_mean"]))
    assert torch.equal(kwargs["txt_ids"], Flux2Pipeline._prepare_text_ids(batch["prompt_embeds"]))
    assert ("guidance" in kwargs) == (name == "tiny-flux2")
    if name == "tiny-flux2":
        assert torch.equal(kwargs["guidance"], torch.full((2,), 2.5))
    # The target is noise - x0 in token order, x0 the cached mode exactly (std 0 draws nothing).
    tokens = Flux2Pipeline._unpack_latents_with_ids(prepared.target, kwargs["img_ids"])
    noisy = Flux2Pipeline._unpack_latents_with_ids(kwargs["hidden_states"].float(), kwargs["img_ids"])
    x0 = batch["latent_mean"].float()
    s = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, (1 - s) * x0 + s * (tokens + x0), atol=1e-5, rtol=1e-5)

    with torch.no_grad():  # backprop into every parameter is test_families.py's
        pred = tiny_pipeline(folders[name], PIPELINES[name]).transformer(**kwargs, return_dict=False)[0]
    assert pred.shape == prepared.target.shape == (2, 36, 16) and torch.isfinite(objective.loss(pred, prepared))


def _after_flip(generator: torch.Generator) -> torch.Generator:
    """The generator as prepare() leaves it after drawing the posterior noise (no flip in the batch)."""
    torch.randn((2, 16, 6, 6), generator=generator)
    return generator


# --- 6. validation images ------------------------------------------------------------------------------


def make_validator(folder: Path, name: str, *overrides: str):
    from zerotrain.config import load_config
    from zerotrain.distributed import Topology
    from zerotrain.sampling import Validator

    repo = Path(__file__).resolve().parents[2]
    run = load_config(repo / "examples" / "tiny-cpu.yaml", [
        f"model.name_or_path={folder}", f"data.datasets=[{{path: '{repo / 'examples' / 'tiny-data'}'}}]",
        f"data.text_tokens={TEXT_TOKENS}", "validation.steps=2", "validation.prompts=['a photo of a cat']",
        "validation.seeds=[0]", *overrides])
    spec = resolve_model(run.model)
    return spec, Validator(spec, folder, run, Topology(0, 1, 0), torch.device("cpu"))


@pytest.mark.parametrize(("name", "distilled", "cfg"), [("tiny-flux2-klein", False, True), ("tiny-flux2-klein", True, False)])
def test_validation_renders_through_the_pipeline(folders, tmp_path, name, distilled, cfg):
    """klein-base guides classifier-free with the negative prompt's embeddings; a distilled klein
    (is_distilled in model_index.json) runs no guidance ([dev]'s render is test_families.py's)."""
    from PIL import Image

    from zerotrain.engine import load_denoiser

    folder = folders[name]
    if distilled:
        folder = tmp_path / "distilled"
        diffusers.DiffusionPipeline.from_pretrained(folders[name], is_distilled=True).save_pretrained(folder)
        assert json.loads((folder / "model_index.json").read_text())["is_distilled"] is True
    spec, validator = make_validator(folder, name)
    assert validator.guidance_scale == 4.0 and validator.cfg == cfg
    assert validator.negative_embeds.keys() == ({"prompt_embeds"} if cfg else set())
    assert of(spec).pipeline_kwargs(spec, folder) == ({} if name == "tiny-flux2" else {"is_distilled": distilled})
    model = load_denoiser(spec, folder)
    paths = validator.render(model, 1, tmp_path / "out")
    with Image.open(paths[0]) as image:
        assert image.size == (64, 64) and image.text["prompt"] == "a photo of a cat"
        assert ("negative_prompt" in image.text) == cfg
        assert np.asarray(image).std() > 2


# --- 8. export -----------------------------------------------------------------------------------------


def lora_model(spec: ModelSpec, targets: list[str], folder: Path | None = None) -> torch.nn.Module:
    """The tiny denoiser (from `folder`, or random) with a LoRA whose B is not zero."""
    torch.manual_seed(0)
    cls = spec.denoiser_class()
    model = cls.from_pretrained(folder, subfolder="transformer") if folder else cls.from_config(spec.config)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets))
    generator = gen(7)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 0.05, generator=generator)
    return model


def forward(model: torch.nn.Module, spec: ModelSpec) -> torch.Tensor:
    torch.manual_seed(3)
    inputs = example_inputs(spec, 1, 32, 32, 8, "cpu", torch.float32)
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_klein_comfyui_lora_is_the_same_update_under_bfl_names(folders, tmp_path):
    """[klein]'s ([dev]'s is test_families.py's): the default targets plus the double blocks' text q/v (k left out: zero rows in the fused qkv) and
    feed-forwards, exported for ComfyUI (diffusion_model.<BFL>.lora_A/B, alpha baked into B), load through
    diffusers' own BFL converter to the output of the diffusers-format LoRA (save_lora_weights with
    lora_adapter_metadata), which differs from the base model's."""
    name = "tiny-flux2-klein"
    spec = spec_of(folders[name])
    family = of(spec)
    targets = [*family.default_lora_targets(spec), "add_q_proj", "add_v_proj", "ff.linear_in", "ff_context.linear_out",
               "x_embedder", "double_stream_modulation_img.linear"]
    model = lora_model(spec, targets, folders[name])
    layers = get_peft_model_state_dict(model)
    pairs = {k[:-len(".lora_A.weight")]: (v, layers[k.replace(".lora_A.", ".lora_B.")])
             for k, v in layers.items() if k.endswith(".lora_A.weight")}
    comfy = family.comfyui_lora(model, pairs, 8.0)
    assert not any(key.endswith(".alpha") for key in comfy) and all(key.startswith("diffusion_model.") for key in comfy)
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape == (12, 32)
    assert comfy["diffusion_model.double_blocks.0.txt_attn.qkv.lora_B.weight"].shape == (96, 8)
    assert {"diffusion_model.single_blocks.1.linear1.lora_A.weight", "diffusion_model.single_blocks.1.linear2.lora_B.weight",
            "diffusion_model.img_in.lora_A.weight", "diffusion_model.double_stream_modulation_img.lin.lora_B.weight"} <= set(comfy)

    pipeline_class = getattr(diffusers, family.pipeline_name(spec))
    pipeline_class.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                     transformer_lora_adapter_metadata=lora_metadata(model.peft_config["default"]))
    expected = forward(model, spec)
    base = pipeline_class.from_pretrained(folders[name])
    plain = forward(base.transformer, spec)
    base.load_lora_weights(tmp_path)
    torch.testing.assert_close(forward(base.transformer, spec), expected)
    via_comfy = pipeline_class.from_pretrained(folders[name])
    via_comfy.load_lora_weights(dict(comfy))
    torch.testing.assert_close(forward(via_comfy.transformer, spec), expected)
    assert not torch.allclose(plain, expected)


def test_comfyui_lora_swaps_the_final_modulation_and_refuses_unknown_modules():
    spec = spec_of("tiny-flux2")
    model = lora_model(spec, ["norm_out.linear"])
    layers = get_peft_model_state_dict(model)
    a, b = layers["norm_out.linear.lora_A.weight"], layers["norm_out.linear.lora_B.weight"]
    comfy = of(spec).comfyui_lora(model, {"norm_out.linear": (a, b)}, 4.0)
    shift, scale = b.chunk(2)
    assert torch.equal(comfy["diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight"], torch.cat([scale, shift]))
    with pytest.raises(ZerotrainError, match="no ComfyUI"):
        of(spec).comfyui_lora(model, {"pos_embed": (a, b)}, 4.0)


def test_klein_comfyui_model_is_bfl_layout_and_converts_back_exactly():
    """[klein]'s, without the guidance embedder ([dev]'s is test_families.py's)."""
    name = "tiny-flux2-klein"
    spec = spec_of(name)
    torch.manual_seed(0)
    weights = {k: v.clone() for k, v in spec.denoiser_class().from_config(spec.config).state_dict().items()}
    bfl = of(spec).comfyui_model(weights)
    assert "double_stream_modulation_img.lin.weight" in bfl  # what ComfyUI detects FLUX.2 by
    assert "guidance_in.in_layer.weight" not in bfl
    assert {"double_blocks.1.img_attn.qkv.weight", "double_blocks.0.txt_attn.norm.key_norm.scale",
            "single_blocks.1.linear1.weight", "single_blocks.0.norm.query_norm.scale",
            "final_layer.adaLN_modulation.1.weight", "img_in.weight", "txt_in.weight"} <= set(bfl)
    assert sum(t.numel() for t in bfl.values()) == PARAMETERS[name]
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[key], weights[key]) for key in weights)
