"""The torch side of the latent codecs (zerotrain.families.parts.latents): how an image becomes a posterior and how
latents are normalized into the denoiser's space, and the latent helpers the families' torch sides share."""

from __future__ import annotations

from typing import Any

import diffusers
import torch
from diffusers import Flux2Pipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from zerotrain.families.parts.latents import (
    AutoencoderKLCodec,
    Flux2Codec,
    QwenImageCodec,
)


def scale_latents(latents: torch.Tensor, scaling_factor: float, shift_factor: float | None) -> torch.Tensor:
    """VAE latents (B, C, h, w) into the denoiser's space: (z - shift) * scaling (Flux, SD3) or
    z * scaling (SDXL, shift None). The pipelines undo it before decoding: z / scaling + shift."""
    if latents.ndim != 4:
        raise ValueError(f"scale_latents: expected latents (B, C, h, w), got shape {tuple(latents.shape)}")
    if shift_factor is not None:
        latents = latents - shift_factor
    return latents * scaling_factor


def channel_view(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-channel constants (C,) as (1, C, 1, 1) against latents (B, C, h, w)."""
    if like.ndim != 4 or like.shape[1] != len(values):
        raise ValueError(f"expected latents (B, {len(values)}, h, w), got {tuple(like.shape)}")
    return torch.tensor(values, device=like.device, dtype=like.dtype).view(1, -1, 1, 1)


def point_mass(mode: torch.Tensor) -> Any:
    """A posterior that always draws `mode` (std 0): the FLUX.2-VAE families encode with latent_dist.mode()."""
    return DiagonalGaussianDistribution(torch.cat([mode, torch.zeros_like(mode)], dim=1), deterministic=True)


def one_frame(parameters: torch.Tensor, vae_class: str) -> Any:
    """The posterior of a video VAE's one-frame moments (B, 2C, 1, h, w), the frame axis dropped: the same
    distribution and the same draws, over (B, C, h, w)."""
    if parameters.ndim != 5 or parameters.shape[2] != 1:
        raise AssertionError(f"{vae_class}: expected (B, 2C, 1, h, w) moments, got {tuple(parameters.shape)}")
    return DiagonalGaussianDistribution(parameters.squeeze(2))


def pack_2x2(latents: torch.Tensor, pipeline: str) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C) by the diffusers `pipeline`'s _pack_latents (FluxPipeline's,
    QwenImagePipeline's): each 2x2 patch of latents one image token."""
    if latents.ndim != 4 or latents.shape[0] < 1:
        raise ValueError(f"latents must be (B, C, h, w), got {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"pack_latents: latent height and width must be even, got {h}x{w}")
    return getattr(diffusers, pipeline)._pack_latents(latents, b, c, h, w)


def qwen_pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """The image tokens of the Qwen-Image and Krea 2 transformers: QwenImagePipeline._pack_latents."""
    return pack_2x2(latents, "QwenImagePipeline")


def bn_moments(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm running mean and std (1, C, 1, 1) on like's device and dtype, as Flux2Pipeline
    normalizes patchified latents with them: std = sqrt(running_var + batch_norm_eps)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


class AutoencoderKLCodecRuntime(AutoencoderKLCodec):
    """AutoencoderKL's posterior and normalization."""

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        return vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        return scale_latents(latents, vae.config.scaling_factor, getattr(vae.config, "shift_factor", None))

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        return std * vae.config.scaling_factor


class Flux2CodecRuntime(Flux2Codec):
    """AutoencoderKLFlux2's posterior and normalization."""

    def fold(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) as (B, 4C, h/2, w/2): Flux2Pipeline._patchify_latents."""
        return Flux2Pipeline._patchify_latents(latents)

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The folded posterior mode as a point mass (std 0)."""
        return point_mass(self.fold(vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()))

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """(z - running_mean) / sqrt(running_var + eps) per channel of patchified latents (B, 4C, h, w)."""
        if latents.ndim != 4 or latents.shape[1] != vae.bn.num_features:
            raise ValueError(f"normalize_latents: expected (B, {vae.bn.num_features}, h, w) latents, got {tuple(latents.shape)}")
        mean, std = bn_moments(vae, latents)
        return (latents - mean) / std

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        return std / bn_moments(vae, std)[1]


class QwenImageCodecRuntime(QwenImageCodec):
    """AutoencoderKLQwenImage's posterior and normalization."""

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The posterior of one-frame videos (B, 3, 1, H, W), as the training script encodes images."""
        moments = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)).latent_dist.parameters
        return one_frame(moments, self.vae_class)

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """(z - latents_mean) * (1 / latents_std) per channel, as the training script writes it; the
        pipeline decodes latents * latents_std + latents_mean."""
        mean = channel_view(vae.config.latents_mean, latents)
        inverse_std = 1.0 / channel_view(vae.config.latents_std, latents)
        return (latents - mean) * inverse_std

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        return std * (1.0 / channel_view(vae.config.latents_std, std))
