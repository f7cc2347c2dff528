"""FLUX.3 [klein]: Flux3Transformer2DModel, FLUX.2's VAE (AutoencoderKLFlux2) and eight stacked hidden states
of Qwen3-VL per token, as diffusers' modular Flux3ModularPipeline (Flux3AutoBlocks) uses them. diffusers
0.42 has no DiffusionPipeline for FLUX.3: zerotrain runs the modular blocks themselves, without the prompt
upsampler (a Qwen3.5 model that rewrites the prompt first; popped, as the blocks' docs say, so that captions
are encoded as written).

What sets it apart:
- Three token modes. The noisy image, the reference images (image_cond_hidden_states) and the text each
  pass their own per-mode blocks (mode_blocks.image, mode_blocks.image_cond, txt_mode_blocks), then joint
  single blocks over [text | image | references]; only the image tokens come out. The references and the
  text are modulated at t = 0, so an edit is text-to-image plus clean reference tokens (add_references),
  one reference mode for up to 10 images told apart on the l position axis (-1, -2, ...). In text-to-image
  training the reference pathway (mode_blocks.image_cond, x_embedders.image_cond and its modulations)
  takes no part: it gets no gradient, and only weight decay moves it in a full fine-tune.
- Text: the chat-templated caption through Qwen3-VL, layers 4, 8, ..., 32 stacked per token (20,480
  features for the published 2,560-wide encoder), right-padded to a multiple of 80 tokens; the
  transformer attends every row, padding included (it takes no mask). A padded row is the same at any
  padded length (the pad token at position 1, seeing every caption token), so the cache keeps each
  caption's rows up to the pipeline's padded length plus one padded row, with a prefix mask of that
  length. A batch is laid out to its longest caption, the shorter ones continued with their padded row,
  which is the pipeline's own encoding at a longer pad multiple; a batch of one is the pipeline's exactly.
  The pipeline truncates only above 8192 tokens; a caption above data.text_tokens is an error that names it.
- Latents are FLUX.2's: the VAE mode patchified 2x2 channel-first and normalized by the VAE's batch-norm
  statistics (Flux3VaeEncoderStep). Image ids are (t, h, w, l) with h and w scaled by 0.5, shared by the
  batch. The timestep is sigma and the output the velocity noise - x0; the pipeline samples with a static
  shift of 6.93 (its scheduler is created from the blocks' own config, whatever the folder holds).
- Checkpoints: the Base model (flow_map false) trains; the step-distilled [klein] is a flow map that
  also takes the timestep each step jumps to, which flow matching does not define, so it is plan-only.
  A LoRA trained on Base loads into [klein] (the same module names).

ComfyUI: the full model exports in Black Forest Labs' single-file layout, the exact inverse of diffusers'
convert_flux3_transformer_checkpoint_to_diffusers (Flux3Transformer2DModel.from_single_file reads it); a
LoRA of the blocks exports in the layout diffusers' Flux3 LoRA loader converts ("diffusion_model." + BFL
names, lora_A / lora_B). Whether ComfyUI itself loads FLUX.3 could not be checked here.
"""

from __future__ import annotations

import math
from functools import cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import (
    BaseFamily,
    capped_size,
    caption_too_long,
    check_tokens,
    example_timestep,
    meta_or_random,
)
from zerotrain.families.parts.keymaps import swap_halves
from zerotrain.families.parts.latents import FLUX2_VAE
from zerotrain.families.parts.qwen_vl import text_processor

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

# Black Forest Labs' FLUX.3 model card and the prompt upsampler: at most 10 reference images.
MAX_REFERENCES = 10
# Flux3ImageProcessor scales a reference of a multi-reference edit above this area (1024 x 1024 pixels) down to it.
REFERENCE_AREA = 1024
# Flux3Transformer2DModel.__init__'s defaults (the published Base config), for configs that omit them.
DENOISER_DEFAULTS = {"in_channels": 128, "joint_attention_dim": 20480, "flow_map": False}
# Diffusers module -> Black Forest Labs module, inverting convert_flux3_transformer_checkpoint_to_diffusers.
_PREFIXES = {"x_embedders.": "emb_in.", "context_embedder.": "txt_in.", "mode_blocks.": "content_mode_blocks.",
             "single_transformer_blocks.": "single_blocks."}
_IN_BLOCK = {"attn.to_q": "q_proj", "attn.to_k": "k_proj", "attn.to_v": "v_proj", "attn.to_out.0": "attn_out",
             "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm", "ff.linear_in": "mlp_in",
             "ff.linear_out": "mlp_out"}
_TOP = {"timestep_embedder.linear_1": "time_in.in_layer", "timestep_embedder.linear_2": "time_in.out_layer",
        "target_timestep_embedder.linear_1": "ref_time_in.in_layer",
        "target_timestep_embedder.linear_2": "ref_time_in.out_layer",
        "proj_out": "final_layer.image.linear", "norm_out.linear": "final_layer.image.adaLN_modulation.1"}
_SWAPPED = "final_layer.image.adaLN_modulation.1"  # BFL's (shift, scale) rows are diffusers' (scale, shift)
_BLOCK_LISTS = ("mode_blocks.", "txt_mode_blocks.", "single_transformer_blocks.")
# The blocks' modules the Flux3 LoRA converter renames (q, k, v, out, feed-forward in and out).
_LORA_IN_BLOCK = tuple(f".{module}" for module in _IN_BLOCK if ".norm_" not in module)


@cache
def settings() -> dict[str, Any]:
    """What the modular blocks fix: the text's pad multiple, token limit and tapped layers, the image rope
    scale, the sampling shift and the default guidance, read from the blocks themselves."""
    from diffusers.modular_pipelines.flux3.before_denoise import (
        Flux3PrepareLatentsStep,
        Flux3SetTimestepsStep,
    )
    from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

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
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    return _prepare_image_ids(height, width, settings()["rope_scale"], l_coord=-reference).to(device)


def text_ids(text: torch.Tensor) -> torch.Tensor:
    """Position ids (T, 4) of text rows (B, T, D), as Flux3TextRoPEInputsStep makes them."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

    return Flux3TextRoPEInputsStep._prepare_text_ids(text).to(text.device)


def padded_text(text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cached text rows (B, T, D) and their mask (B, T) laid out to the batch's longest caption L: each caption's
    own rows, then its padded row (row L_i, kept by the cache) repeated to L."""
    import torch

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
    import json
    from pathlib import Path

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
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    from zerotrain.quiet import hidden_warnings

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
            from diffusers import ClassifierFreeGuidance

            from zerotrain.quiet import hidden_warnings

            with hidden_warnings():
                guider = ClassifierFreeGuidance(guidance_scale=guidance_scale,
                                                enabled=kwargs.get("negative_prompt_embeds") is not None)
            self.pipeline.update_components(guider=guider)
        return SimpleNamespace(images=self.pipeline(**kwargs, output="images"))


def bfl_name(module: str) -> str | None:
    """The Black Forest Labs name of a Flux3Transformer2DModel module (the inverse of diffusers'
    convert_flux3_transformer_checkpoint_to_diffusers); None when it has none."""
    if module in _TOP:
        return _TOP[module]
    for old, new in _PREFIXES.items():
        if f"{module}.".startswith(old):
            module = (new + module[len(old):] if len(module) >= len(old) else new).rstrip(".")
            break
    for old, new in _IN_BLOCK.items():
        if module.endswith("." + old):
            return module[: -len(old)] + new
    if module.endswith(".linear") and "_modulations." in module:
        return module[: -len("linear")] + "lin"
    return module


class Flux3(BaseFamily):
    name = "flux3"
    title = "FLUX.3 [klein]"
    denoiser_classes = ("Flux3Transformer2DModel",)
    codec = FLUX2_VAE
    pipeline = "Flux3ModularPipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # Captions up to 512 tokens (the pipeline pads to multiples of 80 and takes up to 8192).
    default_text_tokens = 512
    # Every block's attention projections and feed-forward (no diffusers training script for FLUX.3 exists):
    # the per-mode and the joint blocks, the modules the Flux3 LoRA converter names.
    depth_keys = ("num_layers", "num_single_layers")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")
    # Flux3LoopDenoiser's guidance_scale: classifier-free guidance with a negative prompt ("" by default).
    default_guidance = 3.5
    classifier_free_guidance = True
    default_in_channels = DENOISER_DEFAULTS["in_channels"]

    def plan_only(self, spec: ModelSpec) -> str | None:
        if spec.config.get("flow_map", DENOISER_DEFAULTS["flow_map"]):
            return ("step-distilled FLUX.3 [klein] flow maps (they also take the timestep each step jumps to, which "
                    "flow matching does not define; fine-tune FLUX.3 [klein] Base, flux3-klein-base, whose LoRA "
                    "loads into [klein])")
        return None

    def pipeline_name(self, spec: ModelSpec) -> str:
        flow_map = spec.config.get("flow_map", DENOISER_DEFAULTS["flow_map"])
        return "Flux3DistilledModularPipeline" if flow_map else self.pipeline

    # --- loading: the modular blocks ---------------------------------------------------------------

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: Any, skipped: dict[str, None]) -> Any:
        """The blocks with the folder's VAE, Qwen3-VL text encoder and tokenizer (read by AutoTokenizer and
        wrapped in text_processor), each from where the modular pipeline loads it (component_source)."""
        from diffusers import AutoencoderKLFlux2
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

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

    # --- conditioning ------------------------------------------------------------------------------

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, 8 x hidden) through Flux3TextEncoderStep's own encoding, each caption's
        rows to the pipeline's padded length L_i (a multiple of 80, at most text_tokens) and one padded row after
        it, zeros beyond; prompt_embeds_mask (B, text_tokens), 1 on the first L_i rows."""
        import torch
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

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

    # --- training ----------------------------------------------------------------------------------

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

    # --- references ------------------------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return MAX_REFERENCES

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As Flux3ImageProcessor sizes the references of a multi-reference edit: its own size, scaled down to
        1024 x 1024 pixels of area at its aspect when above that, each side floored to the 16-pixel token; with
        `area`, scaled to that area instead. (A single reference the blocks keep whole up to 4 megapixels,
        reflect-padded to the token grid; training crops it to the grid and sizes it as one of several.)"""
        return capped_size(control, area, self.pixel_factor(spec), REFERENCE_AREA)

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """Flux3PrepareImageCondLatentsStep's: the references' tokens as one image_cond sequence, in order, with
        their ids (l = -1, -2, ...); the transformer modulates them at t = 0 and returns the image tokens only."""
        import torch

        hidden = kwargs["hidden_states"]
        cond = torch.cat([tokens(latents).to(hidden.dtype) for latents in references], dim=1).contiguous()
        ids = torch.cat([image_ids(*latents.shape[-2:], hidden.device, reference=i + 1)
                         for i, latents in enumerate(references)])
        return {**kwargs, "image_cond_hidden_states": cond, "image_cond_ids": ids}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        return {"image": list(images)}

    # --- validation images -------------------------------------------------------------------------

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        return not spec.config.get("flow_map", DENOISER_DEFAULTS["flow_map"])

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: Any) -> Any:
        """The blocks without the text encoder step around the trained transformer, the VAE and the scheduler,
        with an image processor at the VAE's token size, guided classifier-free (Base) as validation asks."""
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

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

    # --- export ------------------------------------------------------------------------------------

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

    # --- the tiny model ----------------------------------------------------------------------------

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The transformer, a Qwen3-VL (ForConditionalGeneration, as the blocks load it) as deep as the blocks'
        taps reach and joint_attention_dim / 8 wide, and a Qwen tokenizer with Qwen3-VL's text chat template;
        built into the modular pipeline, whose save_pretrained writes the folder (modular_model_index.json)."""
        from transformers import Qwen3VLForConditionalGeneration

        from zerotrain.families.parts import tiny

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


class TinySave:
    """A modular pipeline whose save_pretrained writes a self-contained folder: the components, and a
    modular_model_index.json that names no folder for them (the blocks' save points them at the folder being
    written, which ensure_tiny_pipeline then renames). Load it with
    load_components(pretrained_model_name_or_path=folder)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def save_pretrained(self, folder: Any, **kwargs: Any) -> None:
        import json
        from pathlib import Path

        from zerotrain.quiet import hidden_warnings

        with hidden_warnings():
            self.pipeline.save_pretrained(str(folder), overwrite_modular_index=True, **kwargs)
        path = Path(folder) / "modular_model_index.json"
        index = json.loads(path.read_text(encoding="utf-8"))
        for entry in index.values():
            if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) \
                    and entry[2].get("pretrained_model_name_or_path") == str(folder):
                entry[2]["pretrained_model_name_or_path"] = None
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


FAMILY = Flux3()
