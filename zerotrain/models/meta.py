"""The denoiser on the meta device: its real diffusers class, no weights, no GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerotrain.quiet import hidden_warnings

if TYPE_CHECKING:
    import torch

    from zerotrain.protocols import ModelSpec


def build_meta_model(spec: ModelSpec) -> torch.nn.Module:
    """The real diffusers class, built from its config on the meta device, in bf16."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # the "kept in float32" notice is about from_pretrained
    try:
        with torch.device("meta"), hidden_warnings():
            model = spec.denoiser_class().from_config(spec.config)
        return model.to(torch.bfloat16)
    finally:
        diffusers_logging.set_verbosity(verbosity)
