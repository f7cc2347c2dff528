"""Latent codecs: the VAE part of a family (`zerotrain.protocols.LatentCodec`). A codec says which diffusers VAE
class a family uses, what its config means (scale factor, channels), how an image becomes a posterior, and how
latents are normalized into the denoiser's space. Families share them: FLUX.2, FLUX.3 and Ideogram 4 use
FLUX.2's VAE (FLUX2_VAE, Ideogram 4 folding its cells its own way), Qwen-Image and Krea 2 Qwen-Image's
(QWEN_IMAGE_VAE); Flux, SD3, SDXL, Chroma and Z-Image an AutoencoderKL (AUTOENCODER_KL).

These are the codecs' declarations, which import neither torch nor diffusers, so a plan that reads a codec's facts
imports neither; their torch side is zerotrain.families.runtime.parts.latents."""

from __future__ import annotations

from typing import Any

from zerotrain.errors import ZerotrainError
from zerotrain.families.parts.declared import Declared
from zerotrain.protocols import LatentCodec, VaeFacts

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


class AutoencoderKLCodec(Declared):
    """diffusers' AutoencoderKL (Flux, SD3, SDXL, Chroma, Z-Image): 2^(levels-1) down, latents scaled (and
    shifted) by the config's scaling_factor (and shift_factor)."""

    vae_class = "AutoencoderKL"
    runtime_class = "zerotrain.families.runtime.parts.latents:AutoencoderKLCodecRuntime"
    runtime_protocol = LatentCodec

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


class Flux2Codec(Declared):
    """AutoencoderKLFlux2 (FLUX.2, FLUX.3, Ideogram 4): 8x down, each 2x2 cell folded into channels
    (Flux2Pipeline._patchify_latents), normalized per channel by the VAE's batch-norm running statistics; the
    posterior is its mode as a point mass (std 0), as the training scripts encode with latent_dist.mode()."""

    vae_class = "AutoencoderKLFlux2"
    runtime_class = "zerotrain.families.runtime.parts.latents:Flux2CodecRuntime"
    runtime_protocol = LatentCodec

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


class QwenImageCodec(Declared):
    """AutoencoderKLQwenImage (Qwen-Image, Qwen-Image-Edit, Krea 2): a video VAE that encodes an image as a
    one-frame video, 8x down, z_dim channels, normalized per channel by the config's latents_mean and
    latents_std."""

    vae_class = "AutoencoderKLQwenImage"
    runtime_class = "zerotrain.families.runtime.parts.latents:QwenImageCodecRuntime"
    runtime_protocol = LatentCodec

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


AUTOENCODER_KL = AutoencoderKLCodec()
FLUX2_VAE = Flux2Codec()
QWEN_IMAGE_VAE = QwenImageCodec()
