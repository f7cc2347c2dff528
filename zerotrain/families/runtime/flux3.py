"""FLUX.3 [klein]'s torch side (zerotrain.families.flux3 declares the family): the modular blocks
(Flux3AutoBlocks) that load, encode and render, the Qwen3-VL text padded as they pad it, tokens and ids,
references, Black Forest Labs keys and the tiny model."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import AutoencoderKLFlux2, ClassifierFreeGuidance
from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks, Flux3DistilledAutoBlocks
from diffusers.modular_pipelines.flux3.before_denoise import (
    Flux3PrepareLatentsStep,
    Flux3SetTimestepsStep,
    Flux3TextRoPEInputsStep,
    _prepare_image_ids,
)
from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import caption_too_long, check_tokens
from zerotrain.families.flux3 import (
    _BLOCK_LISTS,
    _LORA_IN_BLOCK,
    _SWAPPED,
    DENOISER_DEFAULTS,
    Flux3,
    bfl_name,
)
from zerotrain.families.runtime.base import BaseRuntime, example_timestep, meta_or_random
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.keymaps import swap_halves
from zerotrain.families.runtime.parts.qwen_vl import text_processor
from zerotrain.protocols import FlowObjective, ModelSpec
from zerotrain.quiet import hidden_warnings


@cache
def settings() -> dict[str, Any]:
    """What the modular blocks fix: the text's pad multiple, token limit and tapped layers, the image rope
    scale, the sampling shift and the default guidance, read from the blocks themselves."""
    text = Flux3TextEncoderStep()
    inputs = {param.name: param.default for param in text.inputs}
    return {"pad_multiple": text.pad_multiple, "max_tokens": int(inputs["max_sequence_length"]),
            "out_layers": tuple(inputs["text_encoder_out_layers"]), "rope_scale": Flux3PrepareLatentsStep().image_rope_scale,
            "scheduler": Flux3SetTimestepsStep().expected_components[0], "guidance": Flux3LoopDenoiser().guidance_scale}


def tokens(grid: torch.Tensor) -> torch.Tensor:
    """A latent grid (B, C, h, w) as tokens (B, h * w, C), rows first, as the blocks pack latents."""
    return grid.flatten(2).transpose(1, 2)


def image_ids(height: int, width: int, device: Any, reference: int = 0) -> torch.Tensor:
    """Position ids (height * width, 4) of a token grid, as Flux3PrepareLatentsStep (reference 0) and
    Flux3PrepareImageCondLatentsStep (reference i: l = -i) make them."""
    return _prepare_image_ids(height, width, settings()["rope_scale"], l_coord=-reference).to(device)


def text_ids(text: torch.Tensor) -> torch.Tensor:
    """Position ids (T, 4) of text rows (B, T, D), as Flux3TextRoPEInputsStep makes them."""
    return Flux3TextRoPEInputsStep._prepare_text_ids(text).to(text.device)


def padded_text(text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cached text rows (B, T, D) and their mask (B, T) laid out to the batch's longest caption L: each caption's
    own rows, then its padded row (row L_i, kept by the cache) repeated to L."""
    if text.ndim != 3 or tuple(mask.shape) != tuple(text.shape[:2]):
        raise ValueError(f"prompt_embeds (B, T, D) and prompt_embeds_mask (B, T) do not match: "
                         f"{tuple(text.shape)} and {tuple(mask.shape)}")
    lengths = (mask > 0).sum(dim=1)
    longest = int(lengths.max())
    if int(lengths.min()) < 1:
        raise ValueError("prompt_embeds_mask marks no row of a caption")
    rows = torch.minimum(torch.arange(longest, device=text.device)[None], lengths[:, None])
    return text.gather(1, rows.unsqueeze(-1).expand(-1, -1, text.shape[2]))


def component_source(folder: Path | str, name: str) -> tuple[str, str]:
    """Where component `name` of a model folder loads from, as (pretrained_model_name_or_path, subfolder): the
    folder's own subfolder when it holds one, else the loading spec of its modular_model_index.json (a modular
    repo may name another repo's component), else the folder's subfolder all the same."""
    folder = Path(folder)
    if (folder / name).is_dir():
        return str(folder), name
    index = folder / "modular_model_index.json"
    entry = json.loads(index.read_text(encoding="utf-8")).get(name) if index.is_file() else None
    if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) \
            and entry[2].get("pretrained_model_name_or_path"):
        return str(entry[2]["pretrained_model_name_or_path"]), entry[2].get("subfolder") or ""
    return str(folder), name


def modular(distilled: bool, *, text: bool, **components: Any) -> Any:
    """Flux3ModularPipeline (Flux3DistilledModularPipeline for a flow map) from the blocks, without the prompt
    upsampler, and without the text encoder step unless `text`; `components` set on it."""
    blocks = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)()
    blocks.sub_blocks.pop("prompt_upsampler", None)
    if not text:
        blocks.sub_blocks.pop("text_encoder")
    with hidden_warnings():
        pipeline = blocks.init_pipeline()
        pipeline.update_components(**{name: value for name, value in components.items() if value is not None})
    return pipeline


class ModularRender:
    """A modular pipeline called as zerotrain calls a DiffusionPipeline for validation images:
    __call__(prompt_embeds=..., guidance_scale=..., output_type=...) returns an object with .images."""

    def __init__(self, pipeline: Any, guided: bool) -> None:
        self.pipeline, self.guided = pipeline, guided

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self.pipeline.set_progress_bar_config(**kwargs)

    def __call__(self, guidance_scale: float, **kwargs: Any) -> Any:
        if self.guided:
            with hidden_warnings():
                guider = ClassifierFreeGuidance(guidance_scale=guidance_scale,
                                                enabled=kwargs.get("negative_prompt_embeds") is not None)
            self.pipeline.update_components(guider=guider)
        return SimpleNamespace(images=self.pipeline(**kwargs, output="images"))


class TinySave:
    """A modular pipeline whose save_pretrained writes a self-contained folder: the components, and a
    modular_model_index.json that names no folder for them (the blocks' save points them at the folder being
    written, which ensure_tiny_pipeline then renames). Load it with
    load_components(pretrained_model_name_or_path=folder)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def save_pretrained(self, folder: Any, **kwargs: Any) -> None:
        with hidden_warnings():
            self.pipeline.save_pretrained(str(folder), overwrite_modular_index=True, **kwargs)
        path = Path(folder) / "modular_model_index.json"
        index = json.loads(path.read_text(encoding="utf-8"))
        for entry in index.values():
            if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) \
                    and entry[2].get("pretrained_model_name_or_path") == str(folder):
                entry[2]["pretrained_model_name_or_path"] = None
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class Flux3Runtime(Flux3, BaseRuntime):
    """Flux3's torch side."""

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: Any, skipped: dict[str, None]) -> Any:
        """The blocks with the folder's VAE, Qwen3-VL text encoder and tokenizer (read by AutoTokenizer and
        wrapped in text_processor), each from where the modular pipeline loads it (component_source)."""
        repo, sub = component_source(folder, "vae")
        vae = AutoencoderKLFlux2.from_pretrained(repo, subfolder=sub, torch_dtype=dtype)
        repo, sub = component_source(folder, "text_encoder")
        text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(repo, subfolder=sub, dtype=dtype)
        repo, sub = component_source(folder, "tokenizer")
        tokenizer = text_processor(AutoTokenizer.from_pretrained(repo, subfolder=sub))
        return modular(pipeline_class.__name__ != self.pipeline, text=True, vae=vae, text_encoder=text_encoder,
                       tokenizer=tokenizer)

    def text_pipeline(self, pipeline_class: Any, components: dict[str, Any]) -> Any:
        return modular(pipeline_class.__name__ != self.pipeline, text=True, tokenizer=components["tokenizer"],
                       text_encoder=components["text_encoder"])

    def scheduler_config(self, folder: Path) -> dict[str, Any]:
        """The blocks' own scheduler (FlowMatchEulerDiscreteScheduler, shift 6.93): the modular pipeline creates
        it from its config and never reads the folder's."""
        scheduler = settings()["scheduler"].create()
        return {"_class_name": type(scheduler).__name__, **dict(scheduler.config)}

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, 8 x hidden) through Flux3TextEncoderStep's own encoding, each caption's
        rows to the pipeline's padded length L_i (a multiple of 80, at most text_tokens) and one padded row after
        it, zeros beyond; prompt_embeds_mask (B, text_tokens), 1 on the first L_i rows."""
        fixed = settings()
        check_tokens(text_tokens, 1, fixed["max_tokens"], f"the FLUX.3 blocks' max_sequence_length for {self.title}")
        processor = pipeline.tokenizer
        embeds, masks = [], []
        for caption in captions:
            templated = processor.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                                      add_generation_prompt=True)
            count = len(processor.tokenizer(templated)["input_ids"])
            if count > text_tokens:
                raise caption_too_long(caption, count, text_tokens, f"{self.title}'s chat template",
                                       most=fixed["max_tokens"])
            # Padded to text_tokens: the caption's rows are the pipeline's, every padded row is its padded row.
            rows = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
                pipeline.text_encoder, processor, caption, device=device, max_sequence_length=text_tokens,
                pad_multiple=text_tokens, hidden_states_layers=fixed["out_layers"])
            length = min(math.ceil(count / fixed["pad_multiple"]) * fixed["pad_multiple"], text_tokens)
            rows[:, length + 1:] = 0
            mask = torch.zeros(1, text_tokens, dtype=torch.int64, device=rows.device)
            mask[:, :length] = 1
            embeds.append(rows)
            masks.append(mask)
        return {"prompt_embeds": torch.cat(embeds), "prompt_embeds_mask": torch.cat(masks)}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text = batch["prompt_embeds"]
        if text.ndim != 3 or text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
        text = padded_text(text, batch["prompt_embeds_mask"])
        dtype = objective.model_dtype
        # The blocks pass timestep / 1000 = sigma in the transformer's dtype; it scales it by 1000 itself.
        kwargs = {"hidden_states": tokens(x_t).to(dtype).contiguous(), "encoder_hidden_states": text.to(dtype),
                  "timestep": sigma.to(dtype), "img_ids": image_ids(h, w, x_t.device), "txt_ids": text_ids(text)}
        return kwargs, tokens(target)

    def target_layout(self, latents: Any) -> Any:
        return tokens(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = {**DENOISER_DEFAULTS, **spec.config}
        tensor = meta_or_random(device, dtype)
        t = example_timestep(tensor, batch, device)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        text = tensor(batch, text_tokens, int(config["joint_attention_dim"]))
        inputs = {"hidden_states": tensor(batch, lat_h * lat_w, int(config["in_channels"])),
                  "encoder_hidden_states": text, "timestep": t, "img_ids": image_ids(lat_h, lat_w, device),
                  "txt_ids": text_ids(text)}
        if config["flow_map"]:
            inputs["target_timestep"] = t
        return inputs

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """Flux3PrepareImageCondLatentsStep's: the references' tokens as one image_cond sequence, in order, with
        their ids (l = -1, -2, ...); the transformer modulates them at t = 0 and returns the image tokens only."""
        hidden = kwargs["hidden_states"]
        cond = torch.cat([tokens(latents).to(hidden.dtype) for latents in references], dim=1).contiguous()
        ids = torch.cat([image_ids(*latents.shape[-2:], hidden.device, reference=i + 1)
                         for i, latents in enumerate(references)])
        return {**kwargs, "image_cond_hidden_states": cond, "image_cond_ids": ids}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        return {"image": list(images)}

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: Any) -> Any:
        """The blocks without the text encoder step around the trained transformer, the VAE and the scheduler,
        with an image processor at the VAE's token size, guided classifier-free (Base) as validation asks."""
        vae = components["vae"]
        processor = Flux3ImageProcessor(vae_scale_factor=self.codec.vae_downsampling(vae),
                                        vae_latent_channels=int(vae.config.latent_channels))
        distilled = not self.takes_negative(spec, folder)
        pipeline = modular(distilled, text=False, vae=vae, transformer=components[self.denoiser_folder],
                           scheduler=components["scheduler"], image_processor=processor)
        return ModularRender(pipeline, guided=not distilled)

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """Each prompt's rows to its own padded length, as the text encoder step gives them."""
        kwargs = {"prompt_embeds": padded_text(embeds["prompt_embeds"], embeds["prompt_embeds_mask"]),
                  "guidance_scale": guidance_scale}
        if negative is not None:
            kwargs["negative_prompt_embeds"] = padded_text(negative["prompt_embeds"], negative["prompt_embeds_mask"])
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the Black Forest Labs module path, lora_A / lora_B with alpha / r folded into B
        and no alpha key: what diffusers' Flux3 LoRA loader converts (_convert_non_diffusers_flux3_lora_to_diffusers
        renames the blocks' modules only, so only they export)."""
        out: dict[str, Any] = {}
        for module, (down, up) in pairs.items():
            name = bfl_name(module)
            if not module.startswith(_BLOCK_LISTS) or not module.endswith(_LORA_IN_BLOCK) or name is None:
                raise ZerotrainError(f"{self.title} module {module} has no name in the Black Forest Labs LoRA layout "
                                     "diffusers reads (blocks' attention and feed-forward only); export without --comfyui, "
                                     "or train only those modules (training.lora.target_modules)")
            out[f"diffusion_model.{name}.lora_A.weight"] = down.contiguous()
            out[f"diffusion_model.{name}.lora_B.weight"] = (up.float() * (alpha / down.shape[0])).to(up.dtype).contiguous()
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The transformer in Black Forest Labs' layout, which Flux3Transformer2DModel.from_single_file (and BFL's
        own code) reads: module names mapped back, q/k norm weights named scale, the final modulation's halves
        swapped back to (shift, scale)."""
        out: dict[str, Any] = {}
        for key, tensor in weights.items():
            module, param = key.rsplit(".", 1)
            name = bfl_name(module)
            if name is None:
                raise ZerotrainError(f"{self.title} weight {key} has no Black Forest Labs name")
            if name.endswith(("query_norm", "key_norm")):
                param = "scale"
            out[f"{name}.{param}"] = swap_halves(tensor) if name == _SWAPPED else tensor
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The transformer, a Qwen3-VL (ForConditionalGeneration, as the blocks load it) as deep as the blocks'
        taps reach and joint_attention_dim / 8 wide, and a Qwen tokenizer with Qwen3-VL's text chat template;
        built into the modular pipeline, whose save_pretrained writes the folder (modular_model_index.json)."""
        layers = settings()["out_layers"]
        width = int(denoiser["joint_attention_dim"]) // len(layers)
        tiny.check_room(width * len(layers) == int(denoiser["joint_attention_dim"]), "tiny-flux3", denoiser)
        tokenizer = tiny.qwen2_tokenizer(tiny.QWEN3_PROMPT, tiny.QWEN_SPECIALS, tiny.QWEN3_VL_TEXT_TEMPLATE)
        distilled = bool(denoiser.get("flow_map", False))

        def build(**components: Any) -> Any:
            return TinySave(modular(distilled, text=True, **components))

        return build, {
            "text_encoder": tiny.seeded("text_encoder", Qwen3VLForConditionalGeneration,
                                        tiny.qwen3_vl_config(tokenizer, width, max(layers))),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
        }
