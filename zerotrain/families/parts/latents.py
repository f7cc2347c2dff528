"""Latent codecs: the VAE part of a family (`zerotrain.protocols.LatentCodec`). A codec says which diffusers VAE
class a family uses, what its config means (scale factor, channels), how an image becomes a posterior, and how
latents are normalized into the denoiser's space. Families share them: FLUX.2, FLUX.3 and Ideogram 4 use
FLUX.2's VAE (FLUX2_VAE, Ideogram 4 folding its cells its own way), Qwen-Image and Krea 2 Qwen-Image's
(QWEN_IMAGE_VAE); Flux, SD3, SDXL, Chroma and Z-Image an AutoencoderKL (AUTOENCODER_KL).

Torch and diffusers are imported inside the methods, so a plan that reads a codec's facts imports neither."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZerotrainError
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    import torch

# AutoencoderKL's defaults, used when a vae/config.json leaves a field out.
AUTOENCODER_DEFAULTS = {"block_out_channels": [64], "latent_channels": 4, "scaling_factor": 0.18215}
# Every published VAE of the supported families downsamples 8x (FLUX.1, SD3, SDXL, SD1.x, Qwen-Image); assumed
# when only a denoiser config is given.
PUBLISHED_VAE_SCALE_FACTOR = 8
# Flux2Pipeline._patchify_latents folds 2x2 VAE cells into channels (AutoencoderKLFlux2's patch_size).
FLUX2_VAE_PATCH = 2
# AutoencoderKLFlux2.__init__'s defaults (FLUX.2's published VAE), for a vae/config.json that omits them.
FLUX2_VAE_DEFAULTS = {"block_out_channels": [128, 256, 512, 512], "latent_channels": 32, "patch_size": [2, 2]}
# QwenImagePipeline packs each 2x2 patch of latents into one token (_pack_latents): in_channels is 4 x the VAE's
# latent channels (the transformers of Qwen-Image and Krea 2).
QWEN_PATCH = 2
# AutoencoderKLQwenImage's defaults (Qwen/Qwen-Image's vae), for a vae/config.json that omits them.
QWEN_IMAGE_VAE_DEFAULTS = {"z_dim": 16, "temperal_downsample": [False, True, True]}


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
    import torch

    if like.ndim != 4 or like.shape[1] != len(values):
        raise ValueError(f"expected latents (B, {len(values)}, h, w), got {tuple(like.shape)}")
    return torch.tensor(values, device=like.device, dtype=like.dtype).view(1, -1, 1, 1)


def point_mass(mode: torch.Tensor) -> Any:
    """A posterior that always draws `mode` (std 0): the FLUX.2-VAE families encode with latent_dist.mode()."""
    import torch
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(torch.cat([mode, torch.zeros_like(mode)], dim=1), deterministic=True)


def one_frame(parameters: torch.Tensor, vae_class: str) -> Any:
    """The posterior of a video VAE's one-frame moments (B, 2C, 1, h, w), the frame axis dropped: the same
    distribution and the same draws, over (B, C, h, w)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    if parameters.ndim != 5 or parameters.shape[2] != 1:
        raise AssertionError(f"{vae_class}: expected (B, 2C, 1, h, w) moments, got {tuple(parameters.shape)}")
    return DiagonalGaussianDistribution(parameters.squeeze(2))


def pack_2x2(latents: torch.Tensor, pipeline: str) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C) by the diffusers `pipeline`'s _pack_latents (FluxPipeline's,
    QwenImagePipeline's): each 2x2 patch of latents one image token."""
    import diffusers

    if latents.ndim != 4 or latents.shape[0] < 1:
        raise ValueError(f"latents must be (B, C, h, w), got {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"pack_latents: latent height and width must be even, got {h}x{w}")
    return getattr(diffusers, pipeline)._pack_latents(latents, b, c, h, w)


def qwen_pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """The image tokens of the Qwen-Image and Krea 2 transformers: QwenImagePipeline._pack_latents."""
    return pack_2x2(latents, "QwenImagePipeline")


class AutoencoderKLCodec:
    """diffusers' AutoencoderKL (Flux, SD3, SDXL, Chroma, Z-Image): 2^(levels-1) down, latents scaled (and
    shifted) by the config's scaling_factor (and shift_factor)."""

    vae_class = "AutoencoderKL"

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        vae = {**AUTOENCODER_DEFAULTS, **vae_config}
        return VaeFacts(
            scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
            latent_channels=int(vae["latent_channels"]),
            scaling_factor=vae["scaling_factor"],
            shift_factor=vae.get("shift_factor"),
        )

    def published(self, latent_channels: int) -> VaeFacts:
        raise ZerotrainError(f"{self.vae_class}: no one published VAE; the family names its own")

    def vae_downsampling(self, vae: Any) -> int:
        return 2 ** (len(vae.config.block_out_channels) - 1)

    def vae_latent_channels(self, vae: Any) -> int:
        return int(vae.config.latent_channels)

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        return vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        return scale_latents(latents, vae.config.scaling_factor, getattr(vae.config, "shift_factor", None))

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        return std * vae.config.scaling_factor


class Flux2Codec:
    """AutoencoderKLFlux2 (FLUX.2, FLUX.3, Ideogram 4): 8x down, each 2x2 cell folded into channels
    (Flux2Pipeline._patchify_latents), normalized per channel by the VAE's batch-norm running statistics; the
    posterior is its mode as a point mass (std 0), as the training scripts encode with latent_dist.mode()."""

    vae_class = "AutoencoderKLFlux2"

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        """The patchified latent space of an AutoencoderKLFlux2 config: 2x2 cells folded into channels."""
        vae = {**FLUX2_VAE_DEFAULTS, **vae_config}
        patch = vae["patch_size"]
        if list(patch) != [FLUX2_VAE_PATCH, FLUX2_VAE_PATCH]:
            raise ZerotrainError(f"vae/config.json: patch_size {patch}; FLUX.2's pipelines patchify 2x2")
        return VaeFacts(
            scale_factor=2 ** (len(vae["block_out_channels"]) - 1) * FLUX2_VAE_PATCH,
            latent_channels=int(vae["latent_channels"]) * FLUX2_VAE_PATCH * FLUX2_VAE_PATCH,
            scaling_factor=None,
            shift_factor=None,
        )

    def published(self, latent_channels: int) -> VaeFacts:
        """Every FLUX.2-VAE repo's vae/: 8x down, 2x2 patchified, batch-norm normalized."""
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR * FLUX2_VAE_PATCH, latent_channels, None, None)

    def vae_downsampling(self, vae: Any) -> int:
        return 2 ** (len(vae.config.block_out_channels) - 1) * FLUX2_VAE_PATCH

    def vae_latent_channels(self, vae: Any) -> int:
        return int(vae.config.latent_channels) * FLUX2_VAE_PATCH * FLUX2_VAE_PATCH

    def fold(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) as (B, 4C, h/2, w/2): Flux2Pipeline._patchify_latents."""
        from diffusers import Flux2Pipeline

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


def bn_moments(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm running mean and std (1, C, 1, 1) on like's device and dtype, as Flux2Pipeline
    normalizes patchified latents with them: std = sqrt(running_var + batch_norm_eps)."""
    import torch

    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


class QwenImageCodec:
    """AutoencoderKLQwenImage (Qwen-Image, Qwen-Image-Edit, Krea 2): a video VAE that encodes an image as a
    one-frame video, 8x down, z_dim channels, normalized per channel by the config's latents_mean and
    latents_std."""

    vae_class = "AutoencoderKLQwenImage"

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        """An AutoencoderKLQwenImage config: z_dim channels; the pipeline's scale factor
        2 ** len(temperal_downsample)."""
        vae = {**QWEN_IMAGE_VAE_DEFAULTS, **vae_config}
        return VaeFacts(2 ** len(vae["temperal_downsample"]), int(vae["z_dim"]), None, None)

    def published(self, latent_channels: int) -> VaeFacts:
        """Qwen/Qwen-Image's vae (and krea/Krea-2-Raw's): 8x, 16 channels, normalized per channel."""
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, latent_channels, None, None)

    def vae_downsampling(self, vae: Any) -> int:
        return 2 ** len(vae.config.temperal_downsample)

    def vae_latent_channels(self, vae: Any) -> int:
        return int(vae.config.z_dim)

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


AUTOENCODER_KL = AutoencoderKLCodec()
FLUX2_VAE = Flux2Codec()
QWEN_IMAGE_VAE = QwenImageCodec()
