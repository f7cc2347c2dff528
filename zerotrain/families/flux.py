"""FLUX.1 (dev, schnell and fine-tunes) and FLUX.1 Kontext: FLUX.1's parts (parts.flux1.Flux1: FluxTransformer2DModel,
FLUX.1's AutoencoderKL, CLIP-L's pooled output and T5's sequence, as FluxPipeline and diffusers'
train_dreambooth_flux.py use them), FluxPipeline's defaults, and Kontext's reference image."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.families.base import area_size
from zerotrain.families.parts.flux1 import Flux1

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec

# FLUX.1 Kontext: FluxTransformer2DModel rendered by this pipeline, which appends one image's latents.
KONTEXT_PIPELINE = "FluxKontextPipeline"


class Flux(Flux1):
    runtime_class = "zerotrain.families.runtime.flux:FluxRuntime"
    name = "flux"
    title = "FLUX.1"
    denoiser_classes = ("FluxTransformer2DModel",)
    pipeline = "FluxPipeline"
    # FluxPipeline's max_sequence_length=512 T5 tokens.
    default_text_tokens = 512
    # FluxPipeline.__call__'s guidance_scale (distilled guidance, one prediction per step).
    default_guidance = 3.5

    # --- references: FLUX.1 Kontext --------------------------------------------------------------

    def pipeline_name(self, spec: ModelSpec) -> str:
        """FluxKontextPipeline for a Kontext model (its model_index.json or catalog entry says so: its
        transformer's config is FLUX.1 [dev]'s), the family's pipeline otherwise."""
        return KONTEXT_PIPELINE if spec.pipeline_class == KONTEXT_PIPELINE else self.pipeline

    def max_references(self, spec: ModelSpec) -> int:
        """FluxKontextPipeline takes one image."""
        return 1 if self.pipeline_name(spec) == KONTEXT_PIPELINE else 0

    def min_references(self, spec: ModelSpec) -> int:
        """Kontext is an edit model: trained and used with its one image."""
        return self.max_references(spec)

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """The target's size, as Kontext edits are trained and rendered (the pipeline's output takes its
        input image's size); with `area`, the control's own aspect at that area."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return target if area is None else area_size(control, area, self.pixel_factor(spec))

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        """The image as given: no snapping to Kontext's preferred resolutions (_auto_resize), since
        training encoded it at reference_size; max_area the size's, since FluxKontextPipeline scales
        its output to max_area (1024 x 1024 by default) whatever height and width say."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return {"image": images[0], "_auto_resize": False, "max_area": size[0] * size[1]}


FAMILY = Flux()
