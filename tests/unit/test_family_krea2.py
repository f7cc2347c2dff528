"""Krea 2 (zerotrain/families/krea2.py) against diffusers' own Krea2Pipeline, scheduler and converters:
the catalog counts, planning, the tiny model, the cached text against encode_prompt, the transformer's
view of it against the pipeline's padded layout, the objective's timestep, sign and shift, validation
renders, and the ComfyUI exports diffusers reads back.

The tiny VAE downsamples 8x as the published one and the transformer packs 2x2 patches: 64 px images are
8x8 latents and 16 image tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift
from PIL import Image

from tests.unit.tiny_family import gen, spec_of, tiny_fixtures
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.families.krea2 import KREA2_SCHEDULER
from zerotrain.families.runtime.base import compact_rows, trim_rows
from zerotrain.models.conditioning import encode_prompts
from zerotrain.objectives import make_objective

# The catalog's parameter counts are test_families.py's (FAMILIES).
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

# --- the tiny model and the cache ---------------------------------------------------------------------


def test_tiny_folder_is_a_krea2_pipeline_with_its_template_and_taps(folder, pipeline):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Krea2Pipeline" and index["text_encoder_select_layers"] == [1, 2]
    assert pipeline.text_encoder_select_layers == (1, 2) and len(pipeline.text_encoder.language_model.layers) == 3
    tokenizer = pipeline.tokenizer
    assert len(tokenizer(pipeline.prompt_template_encode_prefix).input_ids) == pipeline.prompt_template_encode_start_idx == 34
    assert len(tokenizer(pipeline.prompt_template_encode_suffix).input_ids) == 5
    assert pipeline.scheduler.config.max_image_seq_len == 6400  # not the scheduler class's 4096

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

def test_compacting_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="1..3"):
        compact_rows(torch.zeros(1, 5, 2, 4), torch.ones(1, 5, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="marks no token"):
        trim_rows(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5))


# --- the objective -----------------------------------------------------------------------------------


def test_the_timestep_is_sigma_in_the_schedulers_shift(folder, encoders):
    """The shift itself is the pipeline's in test_families.py."""
    objective = objective_of(folder)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER)
    for tokens in (16, 4096, 9216):
        mu = calculate_shift(tokens, 256, 6400, 0.5, 1.15)  # Krea2Pipeline's mu for a Raw model
        scheduler.set_timesteps(sigmas=[0.5], mu=mu)
        assert float(scheduler.sigmas[0]) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1), rel=1e-6)
    prepared = objective.prepare(cached_batch(encoders), gen(5))
    assert prepared.model_kwargs["timestep"].shape == (2,)
    assert ((prepared.model_kwargs["timestep"] > 0) & (prepared.model_kwargs["timestep"] < 1)).all()

# --- validation ----------------------------------------------------------------------------------------

# --- export --------------------------------------------------------------------------------------------
