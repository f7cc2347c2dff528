"""What is special to Chroma (zerotrain/families/chroma.py) against diffusers' own ChromaPipeline,
ChromaTransformer2DModel and single-file converter: FLUX.1's LoRA targets without the approximator, the
tiny model folder, the objective's inputs (no pooled text, no guidance, the bool text mask and the exact
text trim), gradient checkpointing that keeps the mask, validation with real classifier-free guidance and
bool masks, the diffusers-format LoRA loading back with its scale, and the full-size ComfyUI model that
diffusers' converter reads back. The checks every family shares are test_families.py's."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel, DiffusionPipeline
from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from tests.unit.test_sampling import check_image, make_validator
from tests.unit.tiny_family import gen, spec_of, tiny_fixtures
from zerotrain.config import ModelConfig, RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.engine import load_denoiser
from zerotrain.export import lora_metadata
from zerotrain.families import of
from zerotrain.families.chroma import FAMILY
from zerotrain.families.parts.flux1 import FLUX_SCHEDULER
from zerotrain.families.runtime.chroma import used_text_tokens
from zerotrain.families.runtime.parts.flux1 import pack_latents
from zerotrain.models.catalog import resolve_model
from zerotrain.models.conditioning import encode_prompts
from zerotrain.objectives import make_objective
from zerotrain.planner.trace import apply_lora
from zerotrain.protocols import ModelSpec

# Different lengths, so the shorter caption has padding that the mask must hide.
CAPTIONS = ["a photo of a cat sitting on a red chair", "a dog"]
TEXT_TOKENS = 24
# The tiny VAE downsamples 2x: 32 px images are 16x16 latents, 64 packed image tokens.
SIDE, LATENT, IMAGE_TOKENS = 32, 16, 64
RANK, ALPHA = 4, 8.0

root, folder, pipeline, encoders = tiny_fixtures("tiny-chroma", "ChromaPipeline")


@pytest.fixture(scope="module")
def spec(folder) -> ModelSpec:
    return spec_of(folder)


@pytest.fixture(scope="module")
def encoded(encoders) -> dict[str, torch.Tensor]:
    """The captions as the cache stores them (bf16), through zerotrain's encode_prompts."""
    return {name: value.bfloat16() for name, value in encode_prompts(encoders, CAPTIONS, TEXT_TOKENS).items()}


@pytest.fixture(scope="module")
def meta_chroma() -> torch.nn.Module:
    with torch.device("meta"):
        return ChromaTransformer2DModel.from_config(resolve_model(ModelConfig(name_or_path="chroma")).config)


def tiny_transformer(folder: Path) -> torch.nn.Module:
    return ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer")


def make_batch(encoded: dict[str, torch.Tensor], std: float = 0.0) -> dict[str, torch.Tensor]:
    """A batch of two as CachedDataset's items collate: bf16 latent moments and the cached text."""
    shape = (2, 4, LATENT, LATENT)
    return {"latent_mean": torch.randn(shape, generator=gen(1)).bfloat16(),
            "latent_std": torch.full(shape, std).bfloat16(), **encoded}


def prepare(spec: ModelSpec, encoded: dict[str, torch.Tensor], seed: int = 5):
    objective = make_objective(spec, FLUX_SCHEDULER, ObjectiveConfig(), SIDE)
    return objective.prepare(make_batch(encoded), gen(seed))


# --- catalog and planning ------------------------------------------------------------------------

def test_lora_targets_are_fluxs_and_none_of_the_approximator(spec):
    """FLUX.1's LoRA targets name the same Linears in Chroma's blocks, and none of the approximator (a bare
    config.json's plan and its LoRA count are test_families.py's)."""
    targets = [f"attn.{name}" for name in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                           "add_v_proj", "to_add_out")]
    targets += ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
    assert sorted(FAMILY.lora_targets) == sorted(targets)
    model = ChromaTransformer2DModel.from_config(spec.config)
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
               and any(name.endswith(f".{target}") for target in targets)}
    assert len(adapted) == 12 + 3  # every Linear of the double block; q, k, v of the single block
    assert not any(name.startswith("distilled_guidance_layer") for name in adapted)


# --- the tiny model and the cached conditioning --------------------------------------------------


def test_tiny_folder_loads_offline_and_renders_with_cfg(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "ChromaTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "T5EncoderModel"] and "text_encoder_2" not in index
    loaded = DiffusionPipeline.from_pretrained(folder)
    assert type(loaded) is ChromaPipeline
    tokenizer = loaded.tokenizer
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id not in tokenizer("A photo of a Cat, 85mm!").input_ids
    images = loaded(CAPTIONS[0], num_inference_steps=2, height=SIDE, width=SIDE, max_sequence_length=TEXT_TOKENS,
                    output_type="pt", generator=gen(0)).images  # guidance_scale 5.0: two predictions per step
    assert images.shape == (1, 3, SIDE, SIDE) and torch.isfinite(images).all()


# --- the objective -------------------------------------------------------------------------------


def test_the_model_inputs_are_the_pipelines_with_the_text_trimmed_and_a_bool_mask(spec, encoded):
    """No pooled text, no guidance; the noisy latents packed; the text cut to the batch's used tokens, its
    ids and the pipeline's image ids, and the joint mask as bools (the shift, timestep and target, and
    backprop into every parameter, are test_families.py's)."""
    prepared = prepare(spec, encoded)
    kwargs = prepared.model_kwargs
    assert set(kwargs) == {"hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                           "attention_mask"}
    x0 = pack_latents(make_batch(encoded)["latent_mean"].float())
    sigma = kwargs["timestep"].view(-1, 1, 1)
    torch.testing.assert_close(kwargs["hidden_states"], (1 - sigma) * x0 + sigma * (prepared.target + x0))
    used = int(encoded["prompt_attention_mask"].sum(dim=1).max())
    assert kwargs["encoder_hidden_states"].shape == (2, used, 32) and used < TEXT_TOKENS
    assert torch.equal(kwargs["txt_ids"], torch.zeros(used, 3))
    assert torch.equal(kwargs["img_ids"], ChromaPipeline._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32))
    mask = kwargs["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, used + IMAGE_TOKENS)
    assert torch.equal(mask[:, :used], encoded["prompt_attention_mask"][:, :used] > 0) and mask[:, used:].all()


def test_the_trimmed_text_is_exactly_the_pipelines_full_length_input(spec, folder, encoded):
    """Training cuts the text to the batch's used tokens and masks with bools; the pipeline feeds all
    TEXT_TOKENS. Same output. Padding tokens then change nothing, as inference with a bool mask, whereas
    the pipeline's own float mask is an additive bias that hides nothing (diffusers#12116)."""
    model = tiny_transformer(folder).eval()
    kwargs = prepare(spec, encoded).model_kwargs
    text, mask = encoded["prompt_embeds"].float(), encoded["prompt_attention_mask"]
    full = {**kwargs, "encoder_hidden_states": text, "txt_ids": torch.zeros(TEXT_TOKENS, 3),
            "attention_mask": ChromaPipeline._prepare_attention_mask(None, 2, IMAGE_TOKENS, torch.bool, mask > 0)}
    padding = torch.where((mask > 0)[..., None], text, torch.randn(text.shape, generator=gen(2)))
    float_mask = ChromaPipeline._prepare_attention_mask(None, 2, IMAGE_TOKENS, torch.float32, mask.float())
    with torch.no_grad():
        trimmed = model(**kwargs, return_dict=False)[0]
        reference = model(**full, return_dict=False)[0]
        repadded = model(**{**full, "encoder_hidden_states": padding}, return_dict=False)[0]
        float_masked = model(**{**full, "attention_mask": float_mask}, return_dict=False)[0]
        float_repadded = model(**{**full, "attention_mask": float_mask, "encoder_hidden_states": padding},
                               return_dict=False)[0]
    torch.testing.assert_close(trimmed, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(repadded, reference, rtol=1e-5, atol=1e-5)
    assert (float_repadded - float_masked).abs().max() > 1e-3


def test_used_text_tokens_and_bad_masks():
    keep = torch.tensor([[True, False, True, False], [True, True, False, False]])
    assert used_text_tokens(keep) == 3
    with pytest.raises(ValueError, match="keep a token"):
        used_text_tokens(torch.tensor([[True, False], [False, False]]))
    spec = resolve_model(ModelConfig(name_or_path="tiny-chroma"))
    text = {"prompt_embeds": torch.zeros(2, 8, 32), "prompt_attention_mask": torch.ones(2, 7)}
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        make_objective(spec, FLUX_SCHEDULER, ObjectiveConfig(), SIDE).prepare(make_batch(text), gen(0))


def test_checkpointing_keeps_the_mask_and_equals_plain_training(spec, folder, encoded, monkeypatch):
    kwargs = prepare(spec, encoded).model_kwargs  # the second caption's padding is masked

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = model(**kwargs, return_dict=False)[0]
        out.square().mean().backward()
        return out.detach(), {name: p.grad for name, p in model.named_parameters()}

    plain_out, plain_grads = step(tiny_transformer(folder).train())
    model = tiny_transformer(folder).train()
    of(spec).enable_checkpointing(model)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(k) or real(*a, **k))
    out, grads = step(model)
    assert len(calls) == 2 and all(k["use_reentrant"] is False for k in calls)  # one double, one single block
    assert torch.equal(out, plain_out)
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
    with torch.no_grad():
        assert torch.equal(model(**kwargs, return_dict=False)[0], plain_out)
    assert len(calls) == 2, "no checkpointing without autograd (validation)"
    # diffusers' own checkpointing (0.42) runs the single-stream blocks without the mask. When this
    # fails, diffusers has fixed it and Chroma.enable_checkpointing can go.
    upstream = tiny_transformer(folder).train()
    upstream.enable_gradient_checkpointing()
    assert not torch.allclose(step(upstream)[0], plain_out, atol=1e-3)


# --- validation ----------------------------------------------------------------------------------


def test_validation_renders_with_real_cfg_and_bool_masks(tmp_path):
    spec, folder, validator = make_validator(tmp_path / "models", "tiny-chroma",
                                             "validation.prompts=['a photo of a cat']", "validation.seeds=[0]")
    assert validator.cfg and validator.guidance_scale == 5.0
    assert validator.negative_embeds.keys() == {"prompt_embeds", "prompt_attention_mask"}
    model = load_denoiser(spec, folder)
    masks = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: masks.append(kwargs["attention_mask"]),
                                           with_kwargs=True)
    try:
        paths = validator.render(model, 0, tmp_path / "out")
    finally:
        hook.remove()
    assert len(masks) == 2 * 2, "validation.steps=2, a prompt and a negative prediction each"
    assert all(mask.dtype == torch.bool for mask in masks)
    text = 512  # the default text_tokens
    assert masks[1][0, :text].sum() == 2, "the empty negative prompt: </s> and one pad"
    check_image(paths[0], 64, {"prompt": "a photo of a cat", "guidance_scale": "5.0", "negative_prompt": ""})


# --- export --------------------------------------------------------------------------------------


def test_lora_saves_and_loads_back_with_its_scale(spec, folder, pipeline, encoded, tmp_path):
    """zerotrain's LoRA on the default targets plus the approximator's first Linears: saved as the export
    saves it (save_lora_weights with lora_adapter_metadata), it loads back with its scale and gives
    the trained output (the ComfyUI file is test_families.py's)."""
    run = RunConfig(model={"name_or_path": str(folder)},
                    training={"mode": "lora", "lora": {"rank": RANK, "alpha": ALPHA,
                                                       "target_modules": [*FAMILY.lora_targets, "linear_1"]}})
    model = tiny_transformer(folder).eval()
    apply_lora(model, spec, run)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen(len(name))) * 0.1)
    layers = get_peft_model_state_dict(model, adapter_name="default")
    ChromaPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                     transformer_lora_adapter_metadata=lora_metadata(model.peft_config["default"]))
    saved = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    assert saved.keys() == {f"transformer.{key}" for key in layers}
    kwargs = prepare(spec, encoded).model_kwargs
    with torch.no_grad():
        trained = model(**kwargs, return_dict=False)[0]
        before = pipeline.transformer(**kwargs, return_dict=False)[0]
    pipeline.load_lora_weights(tmp_path, adapter_name="trained")
    try:
        assert pipeline.transformer.transformer_blocks[0].attn.to_q.scaling["trained"] == ALPHA / RANK
        with torch.no_grad():
            loaded = pipeline.transformer(**kwargs, return_dict=False)[0]
    finally:
        pipeline.unload_lora_weights()
    torch.testing.assert_close(loaded, trained)
    assert not torch.allclose(loaded, before)


def test_comfyui_model_is_what_diffusers_single_file_converter_reads_back(meta_chroma):
    """The full-size published architecture (19 + 38 blocks, 5 approximator layers; diffusers' converter
    assumes its 3072 width, so not the tiny model's as test_families.py would): every tensor is
    stood in for by its rows, each row a distinct integer (the mapping only renames, concatenates
    and splits rows), so the round trip through diffusers' converter is checked exactly and cheaply."""
    weights = {name: torch.arange(tensor.shape[0]) + index * 2**20
               for index, (name, tensor) in enumerate(meta_chroma.state_dict().items())}
    comfy = FAMILY.comfyui_model(weights)
    assert "distilled_guidance_layer.norms.0.scale" in comfy  # what ComfyUI detects Chroma by
    assert comfy["single_blocks.37.linear1.weight"].shape == (3 * 3072 + 4 * 3072,)
    assert comfy["double_blocks.18.img_attn.qkv.bias"].shape == (3 * 3072,)
    assert {key.split(".")[0] for key in comfy} == {"img_in", "txt_in", "distilled_guidance_layer", "double_blocks",
                                                    "single_blocks", "final_layer"}
    unread = dict(comfy)
    back = convert_chroma_transformer_checkpoint_to_diffusers(unread)
    assert unread == {}, f"keys diffusers' converter does not read: {sorted(unread)[:5]}"
    assert back.keys() == weights.keys()
    differ = [name for name, tensor in weights.items() if not torch.equal(back[name], tensor)]
    assert not differ, differ[:5]
