"""What is special to Qwen-Image 2.1 (zerotrain/families/qwen_image21.py) against diffusers' own
QwenImage21Pipeline: planning an edit (its images' slots in the text), the tiny folder (its processor without
torchvision), the training forward against the pipeline's own transformer call (hooked), the loss on the
sequence's last rows, edits (the caption read with its image, cached and trained as the pipeline feeds it),
validation renders (RGBA) with and without a control, and the ComfyUI LoRA's fused gate_up. The checks every
family shares are test_families.py's.

The tiny VAE downsamples 16x as the published one: 64 px are 4x4 latent tokens, 4 image slots."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from peft import LoraConfig, get_peft_model_state_dict
from PIL import Image

from tests.e2e.test_edit import BF16, SINGLE, edit_data, first_batch, picture, run_for
from tests.unit.test_sampling import make_validator
from tests.unit.tiny_family import gen, spec_of, tiny_fixtures, tiny_pipeline
from zerotrain.config import RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.data.prepare import prepare
from zerotrain.errors import ZerotrainError
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families.qwen_image21 import FAMILY
from zerotrain.families.runtime.qwen_image21 import load_processor, tokens
from zerotrain.models.conditioning import encode_prompts
from zerotrain.objectives import flow_target, make_objective
from zerotrain.planner.measure import measure_model

# The catalog's parameter counts are test_families.py's (FAMILIES).
CAPTIONS = ["a red chair", "An oil painting of mountains at sunset, warm light on the lake!"]
TEXT_TOKENS = 40
SIDE = 64
GRID = SIDE // 16  # 4x4 tokens


root, folder, _, encoders = tiny_fixtures("tiny-qwen-image21", "QwenImage21Pipeline")


@pytest.fixture(scope="module")
def pipeline(folder):
    """QwenImage21Pipeline from the tiny folder, its processor built without torchvision (load_processor)."""
    return tiny_pipeline(folder, "QwenImage21Pipeline", processor=load_processor(folder))


def cached_batch(encoders, n: int = 2) -> dict[str, torch.Tensor]:
    shape = (n, 4, GRID, GRID)
    text = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.zeros(shape),
            **{name: value.repeat(n // 2, *[1] * (value.ndim - 1)) for name, value in text.items()}}


def objective_of(folder, **config):
    return make_objective(spec_of(folder), FAMILY.scheduler_config(folder), ObjectiveConfig(**config), SIDE)


# --- catalog and planning ----------------------------------------------------------------------------

def test_an_edit_plans_with_its_images_slots_in_the_text_and_more_than_three_are_one_line(folder, tmp_path,
                                                                                       monkeypatch, capsys):
    """The planner traces an edit as the pipeline lays it out: the condition image's slots in the text
    encoder's rows, its tokens before the target's (the transformer checks the two agree); a fourth image is
    refused with one line."""
    from zerotrain.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run = RunConfig(model={"name_or_path": str(folder)}, training={"mode": "lora"},
                    data={"resolution": SIDE, "references": 2, "text_tokens": 12})
    facts = measure_model(spec_of(folder), run)
    assert facts.reference_tokens == 2 * GRID * GRID and facts.image_tokens == GRID * GRID
    assert main(["plan", "--model", "qwen-image-2.1", "--references", "4", "--gpus", "1xH100-80GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data.references: 4 reference images, but QwenImage21Pipeline takes at most 3" in err, err


# --- the tiny model and the cache ---------------------------------------------------------------------


def test_tiny_folder_is_a_qwen_image21_pipeline_with_a_qwen3_vl_processor(folder, pipeline):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["processor"] == ["transformers", "Qwen3VLProcessor"]
    assert {p.name for p in (folder / "processor").iterdir()} >= {"tokenizer.json", "preprocessor_config.json"}
    assert pipeline._drop_idx == len(pipeline.processor.tokenizer(
        "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n")["input_ids"])
    assert pipeline.scheduler.config.use_dynamic_shifting


def test_a_caption_longer_than_text_tokens_is_one_line(encoders):
    with pytest.raises(ZerotrainError, match=r"the caption 'An oil painting.*' is \d+ tokens .* above "
                                             r"data.text_tokens=12 \(the pipeline does not truncate\)"):
        encode_prompts(encoders, CAPTIONS, 12)


# --- the objective -----------------------------------------------------------------------------------


def hooked_call(pipeline, **call):
    """The transformer's keyword arguments in the pipeline's first denoising step."""
    seen = []
    handle = pipeline.transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs),
                                                           with_kwargs=True)
    try:
        pipeline(**call, num_inference_steps=1, output_type="latent", use_kv_cache=False)
    finally:
        handle.remove()
    return seen[0]


def test_training_feeds_the_transformer_what_the_pipeline_does_and_scores_the_last_rows(pipeline, folder, encoders):
    """For one caption and the same noisy latents and sigma: the same hidden states, text, timestep, img_shapes
    and img_mask as the pipeline's own call; the output's last rows are the target's."""
    objective = objective_of(folder)
    text = encode_prompts(encoders, CAPTIONS[:1], TEXT_TOKENS)
    x_t = torch.randn(1, 4, GRID, GRID, generator=gen(2))
    n = int(text["prompt_embeds_mask"].sum())
    theirs = hooked_call(pipeline, prompt_embeds=text["prompt_embeds"][:, :n], height=SIDE, width=SIDE,
                         latents=tokens(x_t))
    sigma = theirs["timestep"].float()
    ours, _ = FAMILY.flow_inputs(objective, x_t, flow_target(x_t, x_t), sigma, text)
    torch.testing.assert_close(ours["hidden_states"].float(), theirs["hidden_states"], rtol=1e-2, atol=1e-2)  # bf16
    torch.testing.assert_close(ours["encoder_hidden_states"].float(), theirs["encoder_hidden_states"], rtol=1e-2, atol=1e-2)
    assert ours["timestep"].dtype == objective.model_dtype
    torch.testing.assert_close(ours["timestep"].float(), sigma, rtol=1e-2, atol=1e-3)
    assert ours["img_shapes"] == theirs["img_shapes"] == [[(1, GRID, GRID)]]
    assert torch.equal(ours["img_mask"], theirs["img_mask"]) and ours["encoder_hidden_states_mask"] is None
    prepared = objective.prepare(cached_batch(encoders), gen())
    pred = torch.randn(2, prepared.model_kwargs["img_mask"].shape[1] * 4, 4, generator=gen(3))
    torch.testing.assert_close(objective.loss(pred, prepared),
                               torch.nn.functional.mse_loss(pred[:, -GRID * GRID:], prepared.target))

# --- edits: the caption read with its condition images -------------------------------------------------


def test_an_edit_caption_is_cached_as_encode_prompt_reads_it_with_its_image(pipeline, encoders):
    """The caption's rows as the pipeline's encode_prompt gives them with the image (its vision tokens before the
    caption), the image's own rows left out and their places flagged; another image gives other rows."""
    image = picture((SIDE, SIDE), 5)
    cached = encode_prompts(encoders, CAPTIONS[:1], TEXT_TOKENS, [[image]])
    embeds, _, pads = pipeline.encode_prompt(CAPTIONS[:1], image=[image], device="cpu")
    slots = (SIDE // 32) ** 2  # one vision token per 32x32 px, each the slot of 2x2 latent tokens
    assert int(pads.sum()) == slots
    n = int((~pads).sum())
    flags = cached["image_pad_mask"][0]
    assert flags.shape == (TEXT_TOKENS + slots,) and torch.equal(flags[:n + slots].bool(), pads[0])
    assert not flags[n + slots:].any()
    assert cached["prompt_embeds_mask"][0].tolist() == [1] * n + [0] * (TEXT_TOKENS - n)
    torch.testing.assert_close(cached["prompt_embeds"][0, :n], embeds[0][~pads[0]])
    other = encode_prompts(encoders, CAPTIONS[:1], TEXT_TOKENS, [[picture((SIDE, SIDE), 6)]])
    assert not torch.allclose(other["prompt_embeds"][0, :n], cached["prompt_embeds"][0, :n])


def test_an_edit_trains_on_what_the_pipeline_feeds_its_transformer(folder, tmp_path):
    """One edit sample through the cache (prepare) and the objective, against QwenImage21Pipeline rendering from
    the same noisy latents at the same sigma with the caption and the control: the image's tokens then the
    target's, the caption's rows around the image's slots, img_mask and img_shapes (image first); the
    transformer's output is the same on both (the slots' own rows, which the cache does not keep, are never
    read). References and text come from the bf16 cache: within one bf16 step."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    targets, controls = edit_data(tmp_path, 1)
    run = run_for(folder, targets, controls, tmp_path, f"data.text_tokens={TEXT_TOKENS}")
    prepared, batch = first_batch(run, spec_of(folder))
    planned = prepared.planned[prepared.samples[0]]
    assert [crop.bucket for crop in planned.reference_crops] == [(SIDE, SIDE)] and "image_pad_mask" in batch
    ours = objective_of(folder).prepare(batch, gen(3)).model_kwargs
    target = GRID * GRID
    pipe = QwenImage21Pipeline.from_pretrained(folder, processor=load_processor(folder))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=False,
                                                                 shift=1.0)
    with Image.open(planned.item.controls[0]) as control:
        theirs = hooked_call(pipe, prompt=planned.item.caption, image=[control.convert("RGB")], height=SIDE,
                             width=SIDE, output_resolution=SIDE, sigmas=[float(ours["timestep"][0])],
                             latents=ours["hidden_states"][:, -target:])
    assert ours["img_shapes"] == theirs["img_shapes"] == [[(1, GRID, GRID), (1, GRID, GRID)]]
    assert torch.equal(ours["img_mask"], theirs["img_mask"])
    slots = theirs["img_mask"][0, :theirs["encoder_hidden_states"].shape[1]]
    assert int(slots.sum()) == target // 4
    torch.testing.assert_close(ours["hidden_states"], theirs["hidden_states"], **BF16)
    assert torch.equal(ours["hidden_states"][:, -target:], theirs["hidden_states"][:, -target:])
    text = ours["encoder_hidden_states"]
    torch.testing.assert_close(text[:, ~slots], theirs["encoder_hidden_states"][:, ~slots], **BF16)
    assert not text[:, slots].any()
    assert ours["encoder_hidden_states_mask"] is None and theirs["encoder_hidden_states_mask"] is None
    torch.testing.assert_close(ours["timestep"], theirs["timestep"], rtol=0, atol=1e-6)
    with torch.no_grad():
        run_ours = pipe.transformer(**ours, return_dict=False)[0]
        run_theirs = pipe.transformer(**{**theirs, "return_dict": False})[0]
    torch.testing.assert_close(run_ours[:, -target:], run_theirs[:, -target:], rtol=2e-2, atol=2e-2)


def test_an_edit_caption_is_cached_for_its_control_and_flipped_edits_are_one_line(folder, tmp_path):
    targets, controls = edit_data(tmp_path, 1, pairs=2)
    run = run_for(folder, targets, controls, tmp_path, f"data.text_tokens={TEXT_TOKENS}")
    first = prepare(run, spec_of(folder), SINGLE)
    assert (first.report.texts_encoded, first.report.latents_encoded) == (2, 2)
    picture((SIDE, SIDE), 999).save(controls[0] / "pair1.jpg")  # a new control: its caption is read again
    again = prepare(run, spec_of(folder), SINGLE)
    assert (again.report.texts_encoded, again.report.texts_cached, again.report.latents_encoded) == (1, 1, 1)
    flipped = run_for(folder, targets, controls, tmp_path, f"data.text_tokens={TEXT_TOKENS}", "data.flip=true")
    with pytest.raises(ZerotrainError, match=r"^data.flip: Qwen-Image 2.1's text encoder reads each control image "
                                             r"with the caption.*set data.flip: false for edit training$"):
        prepare(flipped, spec_of(folder), SINGLE)


# --- validation ----------------------------------------------------------------------------------------


def test_validation_renders_what_the_pipeline_renders_from_the_prompt(root, pipeline, tmp_path):
    prompt = CAPTIONS[0]
    _, _, validator = make_validator(root, "tiny-qwen-image21", f"validation.prompts=['{prompt}']", "validation.seeds=[3]")
    assert not validator.cfg and validator.guidance_scale == 1.0
    path = validator.render(pipeline.transformer, 0, tmp_path)[0]
    with Image.open(path) as image:  # the model renders RGBA (its VAE decodes an alpha channel), kept as it is
        assert (image.mode, image.size, image.text["prompt"]) == ("RGBA", (SIDE, SIDE), prompt)
        rendered = np.asarray(image).astype(np.int16)
    assert rendered.std() > 5.0
    direct = pipeline(prompt, height=SIDE, width=SIDE, num_inference_steps=2, generator=gen(3)).images[0]
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= 1


def test_edit_validation_renders_what_the_pipeline_renders_from_the_prompt_and_its_image(root, pipeline, tmp_path):
    """With validation.controls, and guidance with a negative prompt (read with the image too): the validator's
    pipeline renders from the cached text, its image flags and the control as sized for training, what the
    pipeline renders reading the prompt, the negative prompt and that control itself. The size is one the
    pipeline keeps (condition_size), so its text encoder reads the image the cached text was encoded with."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    from zerotrain.families.runtime.qwen_image21 import condition_size

    for area in (SIDE * SIDE, 1024 * 1024, 768 * 768):
        for control in ((1000, 700), (333, 1024), (4000, 2250), (SIDE, SIDE)):
            width, height = condition_size(area, control)
            assert calculate_dimensions(area, width / height)[:2] == (width, height), (area, control)
    path = tmp_path / "control.png"
    picture((96, 64), 4).save(path)
    prompt = "paint it red"
    _, _, validator = make_validator(root, "tiny-qwen-image21", f"validation.prompts=['{prompt}']",
                                     "validation.seeds=[3]", f"validation.controls=[['{path}']]",
                                     "validation.guidance_scale=2.0", "validation.negative_prompt=blurry")
    assert validator.cfg and set(validator.edit_negatives) == {0}
    assert "image_pad_mask" in validator.prompt_embeds[0] and "image_pad_mask" in validator.edit_negatives[0]
    rendered = np.asarray(Image.open(validator.render(pipeline.transformer, 0, tmp_path)[0])).astype(np.int16)
    control = validator.controls[0][0]
    assert control.size == (SIDE, SIDE)
    direct = pipeline(prompt, image=[control], negative_prompt="blurry", true_cfg_scale=2.0, height=SIDE, width=SIDE,
                      output_resolution=SIDE, num_inference_steps=2, generator=gen(3)).images[0]
    assert rendered.std() > 5.0
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= 1


# --- export --------------------------------------------------------------------------------------------


def adapted(folder, targets, rank: int = 4):
    model = QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.add_adapter(LoraConfig(r=rank, lora_alpha=8.0, target_modules=targets, init_lora_weights="gaussian"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(generator=gen(7))
    return model


def test_comfyui_lora_names_the_modules_and_fuses_gate_and_up(folder):
    rank, alpha = 4, 8.0
    model = adapted(folder, [*FAMILY.lora_targets, "gate_layer", "img_mlp.proj"], rank)
    layers = get_peft_model_state_dict(model)
    comfy = comfyui_lora_state_dict(spec_of(folder), model, layers, alpha)
    fused = "diffusion_model.transformer_blocks.1.img_mlp.gate_up"
    assert {"diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight", f"{fused}.lora_B.weight"} <= comfy.keys()
    assert not any("gate_layer" in key or ".img_mlp.proj." in key for key in comfy)
    # ComfyUI's gate_up is gate rows over up rows: the fused adapter's update is the two updates stacked.
    for part in ("gate_layer", "proj"):
        assert f"transformer_blocks.1.img_mlp.{part}.lora_A.weight" in layers
    update = comfy[f"{fused}.lora_B.weight"] @ comfy[f"{fused}.lora_A.weight"] * (float(comfy[f"{fused}.alpha"]) / (2 * rank))
    expected = torch.cat([layers[f"transformer_blocks.1.img_mlp.{part}.lora_B.weight"]
                          @ layers[f"transformer_blocks.1.img_mlp.{part}.lora_A.weight"] for part in ("gate_layer", "proj")]) * (alpha / rank)
    torch.testing.assert_close(update, expected, rtol=1e-5, atol=1e-6)


def test_a_gate_alone_fuses_with_zero_up_rows(folder):
    model = adapted(folder, ["gate_layer"])
    layers = get_peft_model_state_dict(model)
    comfy = comfyui_lora_state_dict(spec_of(folder), model, layers, 8.0)
    fused = "diffusion_model.transformer_blocks.0.img_mlp.gate_up"
    update = comfy[f"{fused}.lora_B.weight"] @ comfy[f"{fused}.lora_A.weight"]
    gate = layers["transformer_blocks.0.img_mlp.gate_layer.lora_B.weight"] @ layers["transformer_blocks.0.img_mlp.gate_layer.lora_A.weight"]
    assert float(comfy[f"{fused}.alpha"]) == 8.0 and update.shape[0] == 2 * gate.shape[0]
    torch.testing.assert_close(update[:gate.shape[0]], gate)
    assert not update[gate.shape[0]:].any()
