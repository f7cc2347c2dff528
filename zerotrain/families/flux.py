"""FLUX.1 (dev, schnell and fine-tunes): FluxTransformer2DModel, FLUX.1's AutoencoderKL, CLIP-L's pooled
output and T5's sequence, as FluxPipeline and diffusers' train_dreambooth_flux.py use them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.families.base import area_size, check_tokens, example_timestep, meta_or_random, text_and_pooled
from zerotrain.families.parts.flux1 import (
    FLUX_SCHEDULER,
    MAX_T5_TOKENS,
    Flux1Transformer,
    bfl_lora,
    flux_top_module,
    latent_image_ids,
    pack_latents,
)

if TYPE_CHECKING:
    from zerotrain.protocols import FlowObjective, ModelSpec

# FLUX.1 Kontext: FluxTransformer2DModel rendered by this pipeline, which appends one image's latents.
KONTEXT_PIPELINE = "FluxKontextPipeline"


class Flux(Flux1Transformer):
    name = "flux"
    title = "FLUX.1"
    denoiser_classes = ("FluxTransformer2DModel",)
    pipeline = "FluxPipeline"
    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    # FluxPipeline's max_sequence_length=512 T5 tokens.
    default_text_tokens = 512
    # FluxPipeline.__call__'s guidance_scale (distilled guidance, one prediction per step).
    default_guidance = 3.5
    classifier_free_guidance = False

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, T, d_T5): T5's sequence of max_sequence_length = text_tokens tokens;
        pooled_prompt_embeds (B, d_CLIP), CLIP-L's pooled output. The text ids are zeros and not kept."""
        check_tokens(text_tokens, 1, MAX_T5_TOKENS, "T5 tokens for Flux")
        prompt_embeds, pooled, _ = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        import torch

        b, _, h, w = x_t.shape
        text, pooled = text_and_pooled(batch, b)
        dtype = objective.model_dtype
        # FluxPipeline passes timestep / 1000 = sigma; the transformer scales it (and guidance) by 1000.
        kwargs = {
            "hidden_states": pack_latents(x_t).to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "pooled_projections": pooled.to(dtype),
            "timestep": sigma,
            "img_ids": latent_image_ids(h, w, x_t.device),
            "txt_ids": torch.zeros(text.shape[1], 3, device=x_t.device),
        }
        if objective.spec.config.get("guidance_embeds", False):
            kwargs["guidance"] = torch.full((b,), objective.config.guidance, device=x_t.device)
        return kwargs, self.target_layout(target)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        t = example_timestep(tensor, batch, device)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // 2) * (lat_w // 2)
        inputs = {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", 64))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 768))),
            "timestep": t,
            "img_ids": tensor(tokens, 3),
            "txt_ids": tensor(text_tokens, 3),
        }
        if config.get("guidance_embeds", False):
            inputs["guidance"] = t
        return inputs

    # --- references: FLUX.1 Kontext --------------------------------------------------------------

    def pipeline_name(self, spec: ModelSpec) -> str:
        """FluxKontextPipeline for a Kontext model (its model_index.json or catalog entry says so: its
        transformer's config is FLUX.1 [dev]'s), the family's pipeline otherwise."""
        return KONTEXT_PIPELINE if spec.pipeline_class == KONTEXT_PIPELINE else self.pipeline

    def max_references(self, spec: ModelSpec) -> int:
        """FluxKontextPipeline takes one image."""
        return 1 if self.pipeline_name(spec) == KONTEXT_PIPELINE else 0

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """The target's size, as Kontext edits are trained and rendered (the pipeline's output takes its
        input image's size); with `area`, the control's own aspect at that area."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return target if area is None else area_size(control, area, self.pixel_factor(spec))

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """FluxKontextPipeline's: the image latents packed (_pack_latents) after the noisy tokens, their
        ids the target grid's ids (_prepare_latent_image_ids) with channel 0 set to 1; one timestep."""
        import torch

        hidden, ids = [kwargs["hidden_states"]], [kwargs["img_ids"]]
        for latents in references:
            _, _, h, w = latents.shape
            hidden.append(pack_latents(latents).to(kwargs["hidden_states"].dtype))
            image_ids = latent_image_ids(h, w, latents.device).clone()
            image_ids[..., 0] = 1
            ids.append(image_ids)
        return {**kwargs, "hidden_states": torch.cat(hidden, dim=1), "img_ids": torch.cat(ids, dim=0)}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        """The image as given: no snapping to Kontext's preferred resolutions (_auto_resize), since
        training encoded it at reference_size; max_area the size's, since FluxKontextPipeline scales
        its output to max_area (1024 x 1024 by default) whatever height and width say."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return {"image": images[0], "_auto_resize": False, "max_area": size[0] * size[1]}

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """Kohya's Black Forest Labs names (bfl_lora), FLUX.1's modules outside the blocks included."""
        return bfl_lora(model, pairs, alpha, flux_top_module, "Flux")

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """CLIP-L gives only its pooled output (pooled_projection_dim wide); T5 gives the sequence
        (joint_attention_dim wide)."""
        from transformers import CLIPTextModel, T5EncoderModel

        from zerotrain.families.parts import tiny

        clip, t5 = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.t5_tokenizer()
        width = denoiser["pooled_projection_dim"]
        return tiny.diffusers_class("FluxPipeline"), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(FLUX_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModel, tiny.clip_config(clip, width, width)),
            "tokenizer": clip,
            "text_encoder_2": tiny.seeded("text_encoder_2", T5EncoderModel,
                                          tiny.t5_config(t5, denoiser["joint_attention_dim"])),
            "tokenizer_2": t5,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }


FAMILY = Flux()
