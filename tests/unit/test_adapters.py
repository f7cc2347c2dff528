"""Issue 25: LoKr, LoHa and DoRA through peft, as the planner counts them and as training builds them; the
LoKr export diffusers loads for Z-Image; continuing from a LoRA file (training.lora.init_from)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from zerotrain.adapters import apply_lora, measured, read_lora, resolve
from zerotrain.config import load_config
from zerotrain.config.sections import LoraConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import resolve_model
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.planner.measure import measure_model

KINDS = {"lora": [], "lokr": ["training.lora.type=lokr"], "loha": ["training.lora.type=loha"],
         "dora": ["training.lora.use_dora=true"]}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return build_tiny_pipeline("tiny-flux", tmp_path_factory.mktemp("adapters") / "tiny-flux")


def run_of(folder, *extra):
    return load_config(None, [f"model.name_or_path={folder}", "training.mode=lora", "training.lora.rank=4",
                              "data.resolution=64", "data.text_tokens=8", *extra])


def trained_lora(folder, *settings):
    """A tiny model with a LoRA whose B is random (as if trained), and its layers in peft's names."""
    from peft import get_peft_model_state_dict

    run = load_config(None, [f"model.name_or_path={folder}", "training.mode=lora", *settings])
    spec = resolve_model(run.model)
    model = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)
    apply_lora(model, spec, run)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()
    return spec, model, get_peft_model_state_dict(model, adapter_name="default")


def test_options_of_one_adapter_are_refused_on_another():
    with pytest.raises(ValidationError, match="use_dora applies to type lora"):
        LoraConfig(type="lokr", use_dora=True)
    with pytest.raises(ValidationError, match="factor applies to type lokr"):
        LoraConfig(factor=4)
    # Plain LoRA's measurement key is what it was before the adapter types, so its shipped facts hold.
    assert measured(LoraConfig(rank=8)) == {"rank": 8, "alpha": None, "target_modules": None, "dropout": 0.0}
    assert measured(LoraConfig(type="lokr", factor=4))["factor"] == 4


def test_the_planner_counts_each_adapters_parameters_and_activations(flux, tmp_path, monkeypatch):
    """The meta-device trace injects the same peft adapters training does: its trainable count is the
    real model's; peft's own LoKr and LoHa forward builds each layer's full delta, which its activations
    hold, and zerotrain's factored forward (issue 41) keeps none."""
    facts = {}
    for kind, extra in KINDS.items():
        run = run_of(flux, *extra, f"planner.cache_dir={tmp_path}")
        spec = resolve_model(run.model)
        model = spec.denoiser_class().from_pretrained(flux, subfolder=spec.subfolder)
        apply_lora(model, spec, run)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        facts[kind] = measure_model(spec, run, cache=False)
        assert facts[kind].trainable_params == trainable, kind
    assert len({f.trainable_params for f in facts.values()}) == len(KINDS)
    from zerotrain import adapter_forward

    # LoHa's factors U (out x r^2) and V (r^2 x in) are kept for backward: less than the delta where
    # r^2 (in + out) < in x out (r 16 at 3072 wide), so at rank 2 on tiny-flux's 32-wide layers.
    loha = run_of(flux, *KINDS["loha"], "training.lora.rank=2", f"planner.cache_dir={tmp_path}")
    factored = {"lokr": facts["lokr"], "loha": measure_model(spec, loha, cache=False)}
    monkeypatch.setattr(adapter_forward, "install", lambda model, version=None: 0)
    peft_forward = {"lokr": measure_model(spec, run_of(flux, *KINDS["lokr"], f"planner.cache_dir={tmp_path}"),
                                          cache=False),
                    "loha": measure_model(spec, loha, cache=False)}
    for kind, facts_of in factored.items():
        assert peft_forward[kind].no_checkpointing.saved_bytes > facts_of.no_checkpointing.saved_bytes, kind


def test_init_from_takes_the_files_rank_and_alpha_and_refuses_a_conflict(flux, tmp_path):
    from diffusers import FluxPipeline
    from peft import get_peft_model_state_dict

    from zerotrain.export import lora_metadata

    spec, model, layers = trained_lora(flux, "training.lora.rank=4", "training.lora.alpha=2")
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata=lora_metadata(model.peft_config["default"]))
    path = tmp_path / "pytorch_lora_weights.safetensors"
    continued = resolve(load_config(None, [f"model.name_or_path={flux}", "training.mode=lora",
                                           f"training.lora.init_from={path}"]), spec)
    assert (continued.training.lora.rank, continued.training.lora.alpha) == (4, 2.0)
    assert continued.training.lora.target_modules is not None
    fresh = spec.denoiser_class().from_pretrained(flux, subfolder=spec.subfolder)
    apply_lora(fresh, spec, continued)
    again = get_peft_model_state_dict(fresh, adapter_name="default")
    assert again.keys() == layers.keys() and all(torch.equal(again[k], layers[k]) for k in layers)
    assert read_lora(path, spec).rank == 4
    with pytest.raises(ZerotrainError, match=r"training.lora.rank=8: init_from .* has rank 4"):
        resolve(load_config(None, [f"model.name_or_path={flux}", "training.mode=lora", "training.lora.rank=8",
                                   f"training.lora.init_from={path}"]), spec)
    with pytest.raises(ZerotrainError, match="continues a LoRA; type lokr starts fresh"):
        resolve(load_config(None, [f"model.name_or_path={flux}", "training.mode=lora", "training.lora.type=lokr",
                                   f"training.lora.init_from={path}"]), spec)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ZerotrainError, match="is not a LoRA the FluxTransformer2DModel loader reads"):
        read_lora(tmp_path / "junk.safetensors", spec)


@pytest.mark.parametrize("name", ["tiny-z-image", "tiny-flux2"])
def test_a_lokr_export_loads_in_diffusers_as_trained_where_diffusers_reads_lokr(name, tmp_path):
    """diffusers reads a LoKr for Z-Image and FLUX.2: the export's file, alpha baked into w1, gives the
    transformer the output of the peft model it came from."""
    import diffusers

    from zerotrain import families
    from zerotrain.export import _write_lora
    from zerotrain.models.meta import build_meta_model

    folder = build_tiny_pipeline(name, tmp_path / name)
    run = load_config(None, [f"model.name_or_path={folder}", "training.mode=lora", "training.lora.type=lokr",
                             "training.lora.rank=2", "training.lora.alpha=6"])
    spec = resolve_model(run.model)
    model = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)
    apply_lora(model, spec, run)
    torch.manual_seed(0)
    weights = {}
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            param.data.normal_(std=0.2)
            weights[param_name] = param.detach().to(torch.bfloat16)
            param.data.copy_(weights[param_name].float())  # what the bf16 export holds
    meta = build_meta_model(spec)
    apply_lora(meta, spec, run)
    files, info = _write_lora(tmp_path / "out", spec, meta, weights, comfyui=True, name="z")
    assert info["type"] == "lokr" and "conversion" not in info
    pipeline = getattr(diffusers, families.of(spec).pipeline_name(spec)).from_pretrained(folder)
    pipeline.load_lora_weights(tmp_path / "out" / "lora")
    from zerotrain.families import example_inputs

    inputs = example_inputs(spec, 1, 32, 32, 8, "cpu", torch.float32)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
        got = pipeline.transformer(**inputs, return_dict=False)[0]
        base = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)(**inputs, return_dict=False)[0]
    for e, g, b in zip(expected, got, base, strict=True):
        # Baking alpha / rank = 3 into a bf16 w1 rounds it once more: within 1% of what the LoKr changes.
        assert (g - e).norm() < 0.01 * (e - b).norm(), ((g - e).norm(), (e - b).norm())
    comfy = files[1]
    from safetensors.torch import load_file

    keys = load_file(comfy)
    prefix = "diffusion_model." if name == "tiny-z-image" else "transformer."
    assert all(k.startswith(prefix) and ".lokr_" in k for k in keys)


def comfyui_flux_diffusers_modules(double: int, single: int) -> set[str]:
    """The diffusers module names ComfyUI's comfy/utils.py flux_to_diffusers maps for FLUX.1 (written out
    from it), which its LoRA loader accepts as "transformer.<name>" (q, k and v onto slices of qkv)."""
    names = {"proj_out", "x_embedder", "context_embedder", "norm_out.linear", "controlnet_x_embedder"}
    names |= {f"time_text_embed.{e}_embedder.linear_{i}" for e in ("timestep", "text", "guidance") for i in (1, 2)}
    for i in range(double):
        names |= {f"transformer_blocks.{i}.{m}" for m in (
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
            "attn.to_out.0", "norm1.linear", "norm1_context.linear", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
            "ff_context.net.0.proj", "ff_context.net.2", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
            "ff_context.linear_out")}
    for i in range(single):
        names |= {f"single_transformer_blocks.{i}.{m}" for m in (
            "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "norm.linear", "proj_out", "attn.to_qkv_mlp_proj",
            "attn.to_out")}
    return names


@pytest.mark.parametrize("model", ["flux-dev", "chroma", "flux2-dev"])
def test_flux_like_adapters_take_names_comfyui_maps(model):
    """On the published FLUX.1 [dev], Chroma and FLUX.2 [dev] built on meta: every layer a LoKr (or LoHa,
    or DoRA: the same layers) adapts by default is exported as "transformer.<diffusers path>", a name
    ComfyUI maps onto its own layers (its Chroma and Flux2 models subclass its Flux)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from zerotrain import families
    from zerotrain.models.meta import build_meta_model

    run = load_config(None, [f"model.name_or_path={model}", "training.mode=lora", *KINDS["lokr"]])
    spec = resolve_model(run.model)
    model = build_meta_model(spec)
    apply_lora(model, spec, run)
    family = families.of(spec)
    names = {family.comfyui_adapter_name(n) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    known = comfyui_flux_diffusers_modules(spec.config["num_layers"], spec.config["num_single_layers"])
    assert len(names) > 50 and all(n.startswith("transformer.") for n in names)
    assert {n.removeprefix("transformer.") for n in names} <= known


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-z-image"])
def test_init_from_reads_the_comfyui_export_of_other_families(name, tmp_path):
    """kohya's lora_unet_ names (SDXL) and ComfyUI's diffusion_model. names with lora_down / lora_up
    (Z-Image), read through the family pipeline's own converter: every layer's B A x scale is the
    file's. (SD3's OneTrainer names, which ComfyUI reads, diffusers does not: not tried here.)"""
    from safetensors.torch import save_file

    from zerotrain.export import comfyui_lora_state_dict

    spec, model, layers = trained_lora(build_tiny_pipeline(name, tmp_path / name), "training.lora.rank=2",
                                       "training.lora.alpha=6")
    comfy = comfyui_lora_state_dict(spec, model, layers, 6.0)
    save_file({k: v.contiguous() for k, v in comfy.items()}, str(tmp_path / "comfy.safetensors"))
    found = read_lora(tmp_path / "comfy.safetensors", spec)
    assert found.rank == 2 and set(found.layers) == {k.removesuffix(".lora_A.weight") for k in layers if "lora_A" in k}
    for module, (down, up) in found.layers.items():
        expected = layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * 3.0
        torch.testing.assert_close(up @ down * (found.alpha / found.rank), expected, rtol=1e-4, atol=1e-5)


def comfyui_dora_merge(w0: torch.Tensor, down: torch.Tensor, up: torch.Tensor, alpha: torch.Tensor,
                       dora_scale: torch.Tensor) -> torch.Tensor:
    """ComfyUI's merge of one DoRA layer (comfy/lora.py's LoRA patch through weight_adapter/base.py
    weight_decompose), in its float32 intermediate dtype: lora_diff = up @ down times alpha / rank, added to
    the base weight, then scaled per output row by dora_scale / (||W0|| + eps), the norm of the base weight."""
    weight = w0.float()
    lora_diff = up.float() @ down.float()
    lora_diff *= alpha.float() / down.shape[0]
    weight_calc = weight + lora_diff.type(weight.dtype)
    weight_norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(weight.dtype).eps
    return weight_calc * (dora_scale.float() / weight_norm).type(weight.dtype)


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
def test_comfyuis_merge_of_a_dora_export_is_the_trained_doras_merge(name, tmp_path):
    """The --comfyui DoRA (lora_down/up, alpha, dora_scale) merged as ComfyUI merges it equals peft's DoRA of
    the exported weights, m (W0 + s B A) / ||W0 + s B A|| per output row, and peft's own merge of the trained
    layer, to float32 rounding (far below the 2^-8 that a bf16 dora_scale alone moves it)."""
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    from zerotrain import families
    from zerotrain.export import _write_lora
    from zerotrain.models.meta import build_meta_model

    folder = build_tiny_pipeline(name, tmp_path / name)
    run = load_config(None, [f"model.name_or_path={folder}", "training.mode=lora", "training.lora.use_dora=true",
                             "training.lora.rank=4", "training.lora.alpha=8"])
    spec = resolve_model(run.model)
    model = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)  # W0 as the folder holds it
    apply_lora(model, spec, run)
    torch.manual_seed(0)
    weights = {}
    for param_name, param in model.named_parameters():
        if param.requires_grad:  # trained: B away from zero, the magnitudes away from ||W0||
            param.data.add_(torch.randn_like(param) * (0.2 if "lora_B" in param_name else 0.05))
            weights[param_name] = param.detach().to(torch.bfloat16)  # what the bf16 checkpoint holds
            param.data.copy_(weights[param_name].float())
    meta = build_meta_model(spec)
    apply_lora(meta, spec, run)
    _write_lora(tmp_path / "out", spec, meta, weights, comfyui=True, name="d")
    comfy = load_file(str(tmp_path / "out" / "comfyui" / "d.safetensors"))
    family = families.of(spec)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert layers
    for module, layer in layers.items():
        target = family.comfyui_adapter_name(module.removeprefix("base_model.model."))
        w0 = layer.base_layer.weight.detach().float()
        down, up = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
        magnitude = layer.lora_magnitude_vector["default"].weight.float()
        adapted = w0 + layer.scaling["default"] * (up @ down)
        peft = magnitude[:, None] * adapted / adapted.norm(dim=1, keepdim=True)
        assert comfy[f"{target}.dora_scale"].dtype == torch.float32
        merged = comfyui_dora_merge(w0, comfy[f"{target}.lora_down.weight"], comfy[f"{target}.lora_up.weight"],
                                    comfy[f"{target}.alpha"], comfy[f"{target}.dora_scale"])
        torch.testing.assert_close(merged, peft, rtol=1e-5, atol=1e-6, msg=lambda m, module=module: f"{module}: {m}")
        layer.merge()  # peft's own merge of the trained layer
        torch.testing.assert_close(layer.base_layer.weight, merged, rtol=1e-5, atol=1e-6, msg=lambda m, module=module: f"{module}: {m}")
