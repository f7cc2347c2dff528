"""Z-Image (Tongyi-MAI Z-Image and Z-Image-Turbo): ZImageTransformer2DModel, FLUX.1's AutoencoderKL and
Qwen3's second-to-last hidden states, as ZImagePipeline and diffusers' train_dreambooth_lora_z_image.py
use them.

The denoiser takes lists: one (C, 1, h, w) latent and one (L_i, D) caption per sample, each caption as
long as its own tokens. It pads each caption itself to a multiple of 32 with a learned token that every
image token attends, so padding a caption any further changes the result: the cache stores the
captions zero-padded to data.text_tokens with a mask (they must stack), and flow_inputs cuts each back
to its true length. Its time runs the other way (t = 1 - sigma: 0 is noise) and its output is the
negated velocity, x0 - noise; ZImagePipeline negates it before the scheduler's Euler step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import BaseFamily
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec

# ZImageTransformer2DModel.forward's default patch_size, which ZImagePipeline never overrides.
Z_IMAGE_PATCH = 2
# The denoiser pads every caption and image to a multiple of this many tokens (SEQ_MULTI_OF in
# diffusers' transformer_z_image.py).
SEQ_MULTI_OF = 32
# ZImageTransformer2DModel's default axes_lens (its RoPE table sizes), when a config leaves it out.
DEFAULT_AXES_LENS = (1024, 512, 512)
# The published scheduler config of the base model (Tongyi-MAI/Z-Image scheduler/scheduler_config.json;
# Z-Image-Turbo's differs only in shift 3.0). The tiny model gets the base model's.
Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 6.0}
# The tiny Qwen3: two layers, so the second-to-last hidden state the pipeline takes is not the embedding
# output; grouped-query attention (2 heads, 1 key/value head) as Qwen3's 32 / 8.
_TINY_QWEN3_LAYERS, _TINY_QWEN3_HEADS, _TINY_QWEN3_KV_HEADS = 2, 2, 1

# ZImageTransformer2DModel names -> the original (Tongyi) names ComfyUI's NextDiT loads, as diffusers'
# convert_z_image_transformer_checkpoint_to_diffusers maps them back; q, k and v are one fused qkv there.
_NATIVE_PREFIXES = {"all_x_embedder.2-1.": "x_embedder.", "all_final_layer.2-1.": "final_layer."}
_NATIVE_ATTENTION = {"to_out.0": "out", "norm_q": "q_norm", "norm_k": "k_norm"}
_QKV = ("to_q", "to_k", "to_v")


def axes_lens(config: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(int(n) for n in config.get("axes_lens", DEFAULT_AXES_LENS))


def max_text_tokens(config: dict[str, Any]) -> int:
    """The longest caption the denoiser's RoPE table (axes_lens[0] positions) holds: padded to P, a
    multiple of 32, it takes positions 1..P and the image its frame position P + 1."""
    return (axes_lens(config)[0] - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF


def check_rope_room(spec: ModelSpec, text_tokens: int, height: int, width: int) -> None:
    """One line when captions of text_tokens or (height, width)-pixel images need more RoPE positions
    than the denoiser's axes_lens give (the model itself would fail with an index error mid-run)."""
    most = max_text_tokens(spec.config)
    if not 1 <= text_tokens <= most:
        raise ZerotrainError(f"text_tokens={text_tokens}: must be 1..{most} for {spec.name} (its axes_lens "
                             f"{list(axes_lens(spec.config))} hold captions of at most {most} tokens)")
    pixels = spec.vae_scale_factor * Z_IMAGE_PATCH
    rows, columns = axes_lens(spec.config)[1:]
    if height // pixels > rows or width // pixels > columns:
        raise ZerotrainError(f"data.resolution: {height}x{width} px is more than the {rows}x{columns} image "
                             f"tokens {spec.name}'s axes_lens give ({pixels} px each)")


class ZImage(BaseFamily):
    runtime_class = "zerotrain.families.runtime.z_image:ZImageRuntime"
    name = "z_image"
    title = "Z-Image"
    diffusers_lokr = True
    denoiser_classes = ("ZImageTransformer2DModel",)
    pipeline = "ZImagePipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # ZImagePipeline's max_sequence_length=512 Qwen3 tokens, its chat template included.
    default_text_tokens = 512
    # As diffusers' train_dreambooth_lora_z_image.py chooses them: the attention projections of every
    # block, the noise and context refiners' included. The SwiGLU feed-forward (feed_forward.w1/w2/w3,
    # 10240 wide) is left out as there: it would add 2.7x the adapter parameters; name them in
    # training.lora.target_modules to train them too.
    depth_keys = ("n_layers",)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # ZImagePipeline.__call__'s guidance_scale, for the base model (Turbo is distilled: set
    # validation.guidance_scale to 0, as its model card does).
    default_guidance = 5.0
    classifier_free_guidance = True
    default_in_channels = 16

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        # FLUX.1's ae (Tongyi-MAI/Z-Image vae/config.json): 16 channels, scaling 0.3611, shift 0.1159.
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, self.latent_channels(config, "config"), 0.3611, 0.1159)

    def patch(self, spec: ModelSpec) -> int:
        return Z_IMAGE_PATCH

    def classifier_free(self, guidance_scale: float) -> bool:
        """ZImagePipeline guides as pos + g * (pos - neg), so any g above 0 runs a second, negative
        prediction (g = 0 is the plain conditional one)."""
        return guidance_scale > 0

    def comfyui_adapter_name(self, module: str) -> str:
        return f"diffusion_model.{module}"


FAMILY = ZImage()
