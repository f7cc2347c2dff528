"""What a run reads of a pipeline repo (zerotrain.models.hub): every component its index lists, each with the files
from_pretrained loads, and none of the other files real repos carry. The downloads themselves run against a local
hub in tests/e2e/test_hub.py and tests/distributed/test_hub_model.py."""

from __future__ import annotations

import dataclasses

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


def test_every_catalog_models_published_pipeline_lists_what_training_reads():
    """What can be checked of the examples' hub repos without a network: a diffusers pipeline repo's
    model_index.json lists its pipeline class's components (save_pretrained writes one entry per argument of the
    class's __init__), so each catalog model whose hub repo is a diffusers pipeline passes `needed` for training,
    for the cache, and with a fine-tuned denoiser (whose weights are then not read); a modular pipeline (FLUX.3)
    lists its blocks' components in its own index, which tests/e2e/test_hub.py serves."""
    import inspect

    import diffusers

    from zerotrain import families
    from zerotrain.config.sections import ModelConfig
    from zerotrain.models.catalog import catalog_names, resolve_model
    from zerotrain.models.hub import needed

    checked = []
    for name in catalog_names():
        spec = resolve_model(ModelConfig(name_or_path=name))
        family = families.of(spec)
        pipeline = getattr(diffusers, family.pipeline_name(spec), None)
        if spec.pretrained is None or family.plan_only(spec) is not None or pipeline is None \
                or issubclass(pipeline, diffusers.ModularPipeline):
            continue
        index = {key: ["diffusers", "Any"] for key in inspect.signature(pipeline.__init__).parameters if key != "self"}
        index[spec.subfolder or family.denoiser_folder] = ["diffusers", spec.class_name]
        for purpose in ("train", "encode"):
            assert needed(spec, index, "model_index.json", purpose, name)
        tuned = needed(dataclasses.replace(spec, denoiser="file x.safetensors"), index, "model_index.json", "train", name)
        assert [part.name for part in tuned if part.config_only] == [spec.subfolder or family.denoiser_folder]
        checked.append(name)
    assert len(checked) >= 15, checked
