"""What a run reads of a pipeline repo (zerotrain.models.hub): every component its index lists, each with the files
from_pretrained loads, and none of the other files real repos carry. The downloads themselves run against a local
hub in tests/e2e/test_hub.py and tests/distributed/test_hub_model.py."""

from __future__ import annotations

from zerotrain.models.hub import Component, components, incomplete, select

INDEX = {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1", "image_encoder": [None, None],
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "T5EncoderModel"],
         "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "FluxTransformer2DModel"],
         "vae": ["diffusers", "AutoencoderKL"], "text_encoder_select_layers": [9, 18]}
REPO = [
    "model_index.json", "README.md", "flux1-dev.safetensors", "ae.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", "text_encoder/model-00001-of-00002.safetensors",
    "text_encoder/model-00002-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
    "text_encoder/model.fp16-00001-of-00001.safetensors", "text_encoder/model.safetensors.index.fp16.json",
    "tokenizer/spiece.model", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
    "transformer/diffusion_pytorch_model.fp16.safetensors", "transformer/diffusion_pytorch_model.bin",
    "transformer/diffusion_pytorch_model.bin.index.json", "transformer/flax_model.msgpack",
    "vae/config.json", "vae/diffusion_pytorch_model.bin", "vae/onnx/model.onnx",
]


def test_components_are_the_index_entries_with_a_class():
    found = {c.name: c for c in components(INDEX)}
    assert set(found) == {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"}  # no setting, no unset one
    assert [c.is_model for c in found.values()] == [False, True, False, True, True]
    modular = {"transformer": ["diffusers", "Flux3Transformer2DModel", {"subfolder": "dit", "pretrained_model_name_or_path": None}],
               "vae": ["diffusers", "AutoencoderKLFlux2", {"subfolder": "vae", "pretrained_model_name_or_path": "other/repo"}]}
    assert components(modular) == [Component("transformer", "dit", "Flux3Transformer2DModel")]  # vae: another repo's


def test_select_keeps_what_from_pretrained_loads():
    chosen = select(REPO, components(INDEX), "model_index.json")
    assert sorted(chosen) == sorted([
        "model_index.json", "scheduler/scheduler_config.json",
        "text_encoder/config.json", "text_encoder/model-00001-of-00002.safetensors",
        "text_encoder/model-00002-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
        "tokenizer/spiece.model", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
        "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.bin"])  # pickled only where there are no safetensors
    assert incomplete(chosen, components(INDEX)) == []


def test_incomplete_names_what_a_component_lacks():
    parts = components(INDEX)
    files = [p for p in select(REPO, parts, "model_index.json")
             if not p.startswith(("scheduler/", "transformer/diffusion"))]
    assert incomplete(files, parts) == ["scheduler/", "transformer/ weights (*.safetensors)"]
    assert incomplete([p for p in files if p != "vae/config.json"], parts)[-1] == "vae/config.json"
