"""FLUX Lite, a family made for tests/e2e/test_adding_a_family.py: FLUX.1's parts (parts.flux1.Flux1) under a
name of its own, with FLUX.1 [schnell]'s pipeline defaults. It trains FluxTransformer2DModel, whose default
family is FLUX.1's, so its catalog configs name it ("_zerotrain_family": "flux_lite"). Its torch side is
zerotrain.families.runtime.flux_lite."""

from __future__ import annotations

from zerotrain.families.parts.flux1 import Flux1


class FluxLite(Flux1):
    runtime_class = "zerotrain.families.runtime.flux_lite:FluxLiteRuntime"
    name = "flux_lite"
    title = "FLUX Lite"
    denoiser_classes = ("FluxTransformer2DModel",)
    # FLUX.1's family trains this class by default; a config names this one.
    default_for_class = False
    pipeline = "FluxPipeline"
    # FluxPipeline's max_sequence_length for FLUX.1 [schnell] (its model card): 256 T5 tokens.
    default_text_tokens = 256
    # FluxPipeline.__call__'s guidance_scale (distilled guidance, one prediction a step).
    default_guidance = 3.5


FAMILY = FluxLite()
