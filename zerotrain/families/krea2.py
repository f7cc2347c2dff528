"""Krea 2 (Raw and Turbo): Krea2Transformer2DModel, the Qwen-Image VAE (AutoencoderKLQwenImage) and
twelve hidden states of Qwen3-VL-4B per token, as Krea2Pipeline and diffusers'
train_dreambooth_lora_krea2.py use them.

What sets it apart:
- The text is a stack: encode_prompt takes hidden states (2, 5, ..., 35) of Qwen3-VL for every token
  (text_encoder_select_layers, in model_index.json), so prompt_embeds is (B, T, 12, 2560) and the
  transformer fuses the twelve itself (text_fusion). The prompt sits between a 34-token system prefix,
  which is dropped, and a 5-token suffix that follows the padding, so the pipeline's mask has a hole:
  [prompt | pad | suffix]. Every text token has RoPE position 0 and padded keys are masked, so the
  transformer is blind to where the padding goes: the cache keeps each caption's own rows (prompt, then
  suffix) zero-padded at the end with a prefix mask, and training trims a batch to its longest caption
  (the pipeline's layout and this one agree to 2.4e-7 in float32; tests/unit/test_family_krea2.py).
- Latents are Qwen-Image's: 16 channels normalized per channel, 2x2 patches packed as
  QwenImagePipeline packs them, 64 channels a token. The timestep is sigma (the model scales it by
  1000); the output is the velocity noise - x0. Classifier-free guidance runs for any guidance above
  0 (cond + g (cond - uncond)).
- The scheduler shifts by the image tokens (exponential time shift, mu from 0.5 at 256 tokens to 1.15
  at 6400): the published config must say max_image_seq_len 6400, or FlowMatchEulerDiscreteScheduler's
  4096 applies. Turbo is the same model distilled (model_index.json's is_distilled), sampled in 8 steps
  without guidance at a fixed mu of 1.15.

Fine-tuning: train on Raw, as Krea's model card says ("the checkpoint you should use for fine-tuning,
post-training, and LoRA training"); a LoRA trained on Raw loads into Turbo, which renders it in 8 steps
(tests/distributed/test_train_table.py, row krea2). Turbo itself trains too, as any distilled checkpoint does, at
the cost of its few-step behaviour.

LoRA defaults to the training script's targets (the Krea 2 authors' recommendation): the block
attention with its output gate, the MLP's up and down projections, the text fusion's projector, and the
input, time and final layers. ComfyUI and Krea's reference trainer name the modules as the original
checkpoint does (blocks.N.attn.wq ...): the ComfyUI exports use those names, which diffusers' own
converters (single file and LoRA) read back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import (
    BaseFamily,
    check_tokens,
    compact_rows,
    example_timestep,
    meta_or_random,
    model_index,
    packed_channels,
    trim_rows,
)
from zerotrain.families.parts.latents import QWEN_IMAGE_VAE, QWEN_PATCH, qwen_pack_latents

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

# Krea2Pipeline's suffix after the padding: "<|im_end|>\n<|im_start|>assistant\n".
SUFFIX_TOKENS = 5
# The published scheduler config (krea/Krea-2-Raw scheduler/scheduler_config.json as the pipeline's
# docstring gives it); the tiny model gets the same.
KREA2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
    "time_shift_type": "exponential",
}
# Turbo (is_distilled) samples at this mu at every size (Krea2Pipeline.__call__).
DISTILLED_MU = 1.15
# The tiny Qwen3-VL: three layers, of which the tiny model_index taps the first two, so that no tap is the
# final-normed state, as none of the published taps is.
_TINY_TEXT_LAYERS, _TINY_TAPS = 3, (1, 2)

# diffusers module paths -> the original (Krea, ComfyUI) names, as diffusers' converters map them back
# (loaders/single_file_utils.py convert_krea2_transformer_checkpoint_to_diffusers and
# lora_conversion_utils.py _convert_non_diffusers_krea2_lora_to_diffusers). First match wins.
_NATIVE_PREFIXES = (
    ("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
    ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"),
)
_NATIVE_BLOCK = (
    (".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
    (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
    (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
    (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
    (".scale_shift_table", ".mod.lin"),
)


def native_name(name: str) -> str:
    """A diffusers parameter (or module path + ".") of Krea2Transformer2DModel under its original name."""
    for old, new in _NATIVE_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if not name.startswith("last."):
        for old, new in _NATIVE_BLOCK:
            name = name.replace(old, new)
    return name


def position_ids(text_tokens: int, height: int, width: int, device: Any) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids for (height, width) latents: (text_tokens + tokens, 3), text at 0."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.prepare_position_ids(text_tokens, height // QWEN_PATCH, width // QWEN_PATCH, device)


class Krea2(BaseFamily):
    name = "krea2"
    title = "Krea 2"
    denoiser_classes = ("Krea2Transformer2DModel",)
    codec = QWEN_IMAGE_VAE
    pipeline = "Krea2Pipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # Krea2Pipeline.__call__'s max_sequence_length: the prompt and its 5-token suffix.
    default_text_tokens = 512
    # train_dreambooth_lora_krea2.py's defaults ("the Krea 2 authors' recommended default"); the
    # SwiGLU gate (ff.gate) is left out as there.
    lora_targets = ("img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.up",
                    "ff.down", "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2",
                    "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj")
    # Krea2Pipeline.__call__'s guidance_scale for Raw (Turbo: 0, in 8 steps).
    default_guidance = 4.5
    classifier_free_guidance = True
    default_in_channels = 64
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 6400,
                                                  "base_shift": 0.5, "max_shift": 1.15}

    def latent_channels(self, config: dict[str, Any], where: Any) -> int:
        return packed_channels(int(config.get("in_channels") or self.default_in_channels), where, self.title, "input")

    def patch(self, spec: ModelSpec) -> int:
        return QWEN_PATCH

    def classifier_free(self, guidance_scale: float) -> bool:
        """Krea2Pipeline guides as cond + g * (cond - uncond) for any g above 0."""
        return guidance_scale > 0

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, taps, d): the tapped Qwen3-VL states of each caption's prompt
        tokens (at most text_tokens - 5, as the pipeline truncates) and its 5 suffix tokens, zero-padded
        at the end; prompt_embeds_mask (B, text_tokens), 1 on those rows."""
        check_tokens(text_tokens, SUFFIX_TOKENS + 1, 4096, "Qwen3-VL tokens for Krea 2 (the prompt and its 5-token suffix)")
        embeds, mask = pipeline.encode_prompt(list(captions), device=device, max_sequence_length=text_tokens)
        return compact_rows(embeds, mask, text_tokens)

    # --- training ----------------------------------------------------------------------------------

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text, mask = batch["prompt_embeds"], batch["prompt_embeds_mask"]
        if text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, L, D), got {tuple(text.shape)}")
        text, valid = trim_rows(text, mask)
        dtype = objective.model_dtype
        # Krea2Pipeline passes t / 1000 = sigma in the latents' dtype; no mask where no caption is padded
        # (the same result, and SDPA's unmasked kernels).
        return {
            "hidden_states": qwen_pack_latents(x_t).to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "timestep": sigma.to(dtype),
            "position_ids": position_ids(text.shape[1], h, w, x_t.device),
            "encoder_attention_mask": None if bool(valid.all()) else valid,
        }, self.target_layout(target)

    def target_layout(self, latents: Any) -> Any:
        return qwen_pack_latents(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long (no mask): the longest text a batch can carry."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // QWEN_PATCH) * (lat_w // QWEN_PATCH)
        return {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", self.default_in_channels))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("num_text_layers", 12)),
                                            int(config.get("text_hidden_dim", 2560))),
            "timestep": example_timestep(tensor, batch, device),
            "position_ids": position_ids(text_tokens, lat_h, lat_w, device),
        }

    # --- validation images -------------------------------------------------------------------------

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """The model folder's own text_encoder_select_layers, is_distilled and patch_size (model_index.json),
        which Krea2Pipeline registers: Turbo samples at a fixed shift."""
        index = model_index(folder, self.title)
        return {key: index[key] for key in ("text_encoder_select_layers", "is_distilled", "patch_size") if key in index}

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """Each prompt's own rows with their mask, the prompt and the negative padded to one length
        (Krea2Pipeline builds one set of position ids from the prompt's and uses it for both; padded
        keys are masked, so the transformer sees what the pipeline's own layout gives it)."""
        import torch

        texts = [trim_rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])]
        if negative is not None:
            texts.append(trim_rows(negative["prompt_embeds"], negative["prompt_embeds_mask"]))
        length = max(text.shape[1] for text, _ in texts)
        texts = [(torch.nn.functional.pad(text, (0, 0, 0, 0, 0, length - text.shape[1])),
                  torch.nn.functional.pad(mask, (0, length - mask.shape[1]))) for text, mask in texts]
        kwargs: dict[str, Any] = {"prompt_embeds": texts[0][0], "prompt_embeds_mask": texts[0][1],
                                  "guidance_scale": guidance_scale}
        if negative is not None:
            kwargs.update({"negative_prompt_embeds": texts[1][0], "negative_prompt_embeds_mask": texts[1][1]})
        return kwargs

    # --- export ------------------------------------------------------------------------------------

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the original module name (blocks.N.attn.wq ...), lora_A / lora_B with
        alpha / rank folded into lora_B: the layout of Krea's reference trainer and ComfyUI, which
        diffusers' Krea2 LoRA converter reads (it takes no alpha keys)."""
        out: dict[str, Any] = {}
        for module, (down, up) in pairs.items():
            name = "diffusion_model." + native_name(module + ".")[:-1]
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = (up * (float(alpha) / down.shape[0])).contiguous()
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The original Krea 2 layout (blocks.N.attn.wq ..., the block modulation tables flat), which
        diffusers' from_single_file converts back to the same tensors."""
        out: dict[str, Any] = {}
        for name, tensor in weights.items():
            if name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table"):
                tensor = tensor.reshape(-1)
            out[native_name(name)] = tensor
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Qwen3-VL as wide as text_hidden_dim (its vision tower too, unused for text), three layers with
        two tapped, a Qwen tokenizer that splits the pipeline's prefix into exactly 34 tokens and its
        suffix into 5, and the published scheduler."""
        from transformers import Qwen3VLModel

        from zerotrain.families.parts import tiny

        pipeline_class = tiny.diffusers_class("Krea2Pipeline")
        probe = pipeline_class(None, None, None, None, None)
        tokenizer = tiny.qwen2_tokenizer(probe.prompt_template_encode_prefix + "{}" + probe.prompt_template_encode_suffix)
        tiny.check_room(int(denoiser["num_text_layers"]) == len(_TINY_TAPS), "tiny-krea2", denoiser)
        return pipeline_class, {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(KREA2_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", Qwen3VLModel, tiny.qwen3_vl_config(tokenizer, int(denoiser["text_hidden_dim"]), _TINY_TEXT_LAYERS)),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
            "text_encoder_select_layers": _TINY_TAPS,
            "is_distilled": False,
        }


FAMILY = Krea2()
