"""FLUX.1's torch side (zerotrain.families.flux declares the family): parts.flux1's, and Kontext's reference
latents appended after the noisy tokens."""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.families.flux import Flux
from zerotrain.families.runtime.parts.flux1 import Flux1Runtime, latent_image_ids, pack_latents
from zerotrain.protocols import ModelSpec


class FluxRuntime(Flux, Flux1Runtime):
    """Flux's torch side."""

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """FluxKontextPipeline's: the image latents packed (_pack_latents) after the noisy tokens, their
        ids the target grid's ids (_prepare_latent_image_ids) with channel 0 set to 1; one timestep."""
        hidden, ids = [kwargs["hidden_states"]], [kwargs["img_ids"]]
        for latents in references:
            _, _, h, w = latents.shape
            hidden.append(pack_latents(latents).to(kwargs["hidden_states"].dtype))
            image_ids = latent_image_ids(h, w, latents.device).clone()
            image_ids[..., 0] = 1
            ids.append(image_ids)
        return {**kwargs, "hidden_states": torch.cat(hidden, dim=1), "img_ids": torch.cat(ids, dim=0)}
