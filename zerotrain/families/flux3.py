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

from typing import TYPE_CHECKING

from zerotrain.families.base import BaseFamily, capped_size
from zerotrain.families.parts.latents import FLUX2_VAE

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

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
    runtime_class = "zerotrain.families.runtime.flux3:Flux3Runtime"
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

    # --- validation images -------------------------------------------------------------------------

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        return not spec.config.get("flow_map", DENOISER_DEFAULTS["flow_map"])


FAMILY = Flux3()
