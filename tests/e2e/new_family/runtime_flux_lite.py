"""FLUX Lite's torch side (zerotrain.families.flux_lite declares it): FLUX.1's, unchanged."""

from __future__ import annotations

from zerotrain.families.flux_lite import FluxLite
from zerotrain.families.runtime.parts.flux1 import Flux1Runtime


class FluxLiteRuntime(FluxLite, Flux1Runtime):
    """FLUX.1's conditioning, forward arguments, key maps and tiny model under FLUX Lite's declarations."""
