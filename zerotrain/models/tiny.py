"""Complete, tiny diffusers model folders for the catalog's tiny-* entries, built offline in about a
second: tests and CPU demos load them with `from_pretrained` exactly as they would a hub repo.

Each folder is what the family's pipeline `save_pretrained` writes, laid out as the published repos
(black-forest-labs/FLUX.1-dev, stabilityai/stable-diffusion-3.5-*, stabilityai/stable-diffusion-xl-
base-1.0): model_index.json, the denoiser from the catalog's tiny config, the VAE from its tiny
vae_config, the published scheduler config, and the family's text encoders and tokenizers, shrunk to
the widths the tiny denoiser expects. Tokenizers are learned here from a few captions (no download);
weights are random from fixed seeds, so the same name always writes the same folder.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import string
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from zerotrain.models.catalog import _catalog_entry
from zerotrain.models.families import SDXL_TIME_IDS

# Captions the tiny tokenizers learn their merges / pieces from.
_CORPUS = (
    "a photo of a cat sitting on a red chair",
    "an oil painting of mountains at sunset, warm light",
    "a watercolor sketch of a small boat on the lake",
    "close-up portrait of a dog, studio lighting, 85mm",
    "the city skyline at night with neon signs and rain",
)
_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's context length: model_max_length of every SD/SDXL/SD3/Flux CLIP tokenizer.
_CLIP_MAX_LENGTH = 77
# tokenizer_2 (Flux) / tokenizer_3 (SD3) model_max_length in the published repos.
_T5_MAX_LENGTH = 512
# SDXL's and SD3's second CLIP (OpenCLIP bigG) pads with "!" where CLIP-L pads with <|endoftext|>.
_OPENCLIP_PAD = "!"
# Layers per tiny text encoder: two, so the penultimate hidden state SDXL/SD3 use differs from the last.
_TEXT_LAYERS = 2
_TEXT_HEADS = 2
# Fixed seeds, one per component, so a component's weights do not depend on the others' sizes.
_SEEDS = {"transformer": 0, "unet": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3, "text_encoder_3": 4}

# Published scheduler configs (scheduler/scheduler_config.json of each repo).
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_SDXL_SCHEDULER = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "use_karras_sigmas": False,
}
TINY_NAMES = ("tiny-flux", "tiny-sd3", "tiny-sdxl")


def build_tiny_pipeline(name: str, folder: Path) -> Path:
    """Write the complete diffusers model folder of catalog entry `name` (tiny-flux, tiny-sd3 or
    tiny-sdxl) into `folder` and return it. The folder loads with DiffusionPipeline.from_pretrained."""
    if name not in TINY_NAMES:
        raise ValueError(f"build_tiny_pipeline: '{name}' is not one of {', '.join(TINY_NAMES)}")
    entry = _catalog_entry(name)
    builders = {"tiny-flux": _flux_components, "tiny-sd3": _sd3_components, "tiny-sdxl": _sdxl_components}
    with torch.random.fork_rng(devices=[]):
        pipeline_class, components = builders[name](entry["denoiser"])
        components["vae"] = _seeded("vae", _diffusers("AutoencoderKL").from_config, entry["vae_config"])
    pipeline = pipeline_class(**components)
    folder = Path(folder)
    pipeline.save_pretrained(folder, safe_serialization=True)
    return folder


def _flux_components(denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """FLUX.1: CLIP-L gives only its pooled output (pooled_projection_dim wide); T5 gives the sequence
    (joint_attention_dim wide)."""
    from transformers import CLIPTextModel, T5EncoderModel

    clip, t5 = _clip_tokenizer(_CLIP_EOS), _t5_tokenizer()
    width = denoiser["pooled_projection_dim"]
    return _diffusers("FluxPipeline"), {
        "scheduler": _diffusers("FlowMatchEulerDiscreteScheduler").from_config(FLUX_SCHEDULER),
        "text_encoder": _seeded("text_encoder", CLIPTextModel, _clip_config(clip, width, width)),
        "tokenizer": clip,
        "text_encoder_2": _seeded(
            "text_encoder_2", T5EncoderModel, _t5_config(t5, denoiser["joint_attention_dim"])
        ),
        "tokenizer_2": t5,
        "transformer": _seeded("transformer", _diffusers(denoiser["_class_name"]).from_config, denoiser),
    }


def _sd3_components(denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """SD3: the two CLIPs' penultimate states are concatenated and zero-padded to T5's width
    (joint_attention_dim), so their widths must sum to at most it; their projections concatenate to
    pooled_projection_dim. Published: 768 + 1280 = 2048 padded to 4096; projections 768 + 1280."""
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    joint, pooled = denoiser["joint_attention_dim"], denoiser["pooled_projection_dim"]
    # Three quarters of T5's width, split 1:2 (published 768:1280), so the zero padding runs as in SD3.
    hidden_l, hidden_g = joint // 4, joint // 2
    proj_l = pooled // 2
    proj_g = pooled - proj_l
    _check(min(hidden_l, proj_l) > 0 and hidden_l + hidden_g <= joint, "tiny-sd3", denoiser)
    clip_l, clip_g, t5 = _clip_tokenizer(_CLIP_EOS), _clip_tokenizer(_OPENCLIP_PAD), _t5_tokenizer()
    return _diffusers("StableDiffusion3Pipeline"), {
        "transformer": _seeded("transformer", _diffusers(denoiser["_class_name"]).from_config, denoiser),
        "scheduler": _diffusers("FlowMatchEulerDiscreteScheduler").from_config(SD3_SCHEDULER),
        "text_encoder": _seeded(
            "text_encoder", CLIPTextModelWithProjection, _clip_config(clip_l, hidden_l, proj_l)
        ),
        "tokenizer": clip_l,
        "text_encoder_2": _seeded(
            "text_encoder_2", CLIPTextModelWithProjection, _clip_config(clip_g, hidden_g, proj_g)
        ),
        "tokenizer_2": clip_g,
        "text_encoder_3": _seeded("text_encoder_3", T5EncoderModel, _t5_config(t5, joint)),
        "tokenizer_3": t5,
    }


def _sdxl_components(denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """SDXL: the two CLIPs' penultimate states concatenate to cross_attention_dim (published 768 + 1280 =
    2048); the second's projection is the pooled `text_embeds`, which the UNet's add_embedding takes
    with 6 time ids of addition_time_embed_dim each."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cross = denoiser["cross_attention_dim"]
    hidden_l = cross // 4
    hidden_g = cross - hidden_l
    time_ids = SDXL_TIME_IDS * denoiser["addition_time_embed_dim"]
    projection = denoiser["projection_class_embeddings_input_dim"] - time_ids
    _check(hidden_l > 0 and projection > 0, "tiny-sdxl", denoiser)
    clip_l, clip_g = _clip_tokenizer(_CLIP_EOS), _clip_tokenizer(_OPENCLIP_PAD)
    return _diffusers("StableDiffusionXLPipeline"), {
        "text_encoder": _seeded("text_encoder", CLIPTextModel, _clip_config(clip_l, hidden_l, hidden_l)),
        "text_encoder_2": _seeded(
            "text_encoder_2", CLIPTextModelWithProjection, _clip_config(clip_g, hidden_g, projection)
        ),
        "tokenizer": clip_l,
        "tokenizer_2": clip_g,
        "unet": _seeded("unet", _diffusers(denoiser["_class_name"]).from_config, denoiser),
        "scheduler": _diffusers("EulerDiscreteScheduler").from_config(_SDXL_SCHEDULER),
        # invisible-watermark is not a dependency; the published pipeline adds it only when installed.
        "add_watermarker": False,
    }


def _check(ok: bool, name: str, denoiser: dict[str, Any]) -> None:
    if not ok:
        raise ValueError(f"{name}: the catalog denoiser config leaves no room for text encoders: {denoiser}")


def _seeded(component: str, build: Any, config: Any) -> Any:
    """build(config) with its weights drawn from the component's own seed."""
    torch.manual_seed(_SEEDS[component])
    return build(config).eval()


def _diffusers(class_name: str) -> Any:
    import diffusers

    return getattr(diffusers, class_name)


def _clip_config(tokenizer: Any, hidden: int, projection: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        projection_dim=projection,
        num_hidden_layers=_TEXT_LAYERS,
        num_attention_heads=_TEXT_HEADS,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_config(tokenizer: Any, d_model: int) -> Any:
    """T5 v1.1 as FLUX.1 and SD3 use it (gated GELU, untied embeddings), at width d_model."""
    from transformers import T5Config

    return T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // _TEXT_HEADS,
        d_ff=d_model * 2,
        num_layers=_TEXT_LAYERS,
        num_heads=_TEXT_HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _clip_tokenizer(pad_token: str) -> Any:
    """A byte-level BPE CLIP tokenizer laid out as OpenAI's: the 256 byte symbols, the same with the
    end-of-word mark </w>, one token per merge (learned from _CORPUS until each word is one token), then the two specials."""
    from transformers import CLIPTokenizer

    template = CLIPTokenizer().backend_tokenizer  # CLIP's normalizer and pre-tokenizer
    words = Counter(
        piece
        for caption in _CORPUS
        for piece, _ in template.pre_tokenizer.pre_tokenize_str(template.normalizer.normalize_str(caption))
    )
    merges = _bpe_merges({(*word[:-1], word[-1] + "</w>"): count for word, count in words.items()})
    symbols = _byte_symbols()
    tokens = (
        symbols + [s + "</w>" for s in symbols] + ["".join(pair) for pair in merges] + [_CLIP_BOS, _CLIP_EOS]
    )
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=_CLIP_MAX_LENGTH)


def _bpe_merges(words: dict[tuple[str, ...], int]) -> list[tuple[str, str]]:
    """Byte-pair merges, most frequent pair first, ties by the pair itself. The tokenizers library's
    BpeTrainer breaks ties differently from run to run, which would make the folder nondeterministic."""
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            return merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = {_merge(word, best): count for word, count in words.items()}


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _byte_symbols() -> list[str]:
    """GPT-2/CLIP's printable stand-in for each byte, in their vocabulary order ("!" first)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def _t5_tokenizer() -> Any:
    """A Unigram T5 tokenizer (<pad>=0, </s>=1, <unk>=2, as T5's) whose pieces are the corpus words
    and every printable ASCII character, scored by log frequency (characters add-one smoothed)."""
    from transformers import T5Tokenizer

    words = Counter("▁" + word for caption in _CORPUS for word in caption.split())
    chars = Counter("".join(_CORPUS).replace(" ", "")) + Counter(string.printable.strip())
    counts = {"▁": len(_CORPUS), **chars, **words}
    total = sum(counts.values())
    pieces = sorted(
        ((piece, math.log(count / total)) for piece, count in counts.items()), key=lambda p: (-p[1], p[0])
    )
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


def ensure_tiny_pipeline(name: str, root: Path) -> Path:
    """The tiny model folder under `root`, built once (atomically) and reused: what a catalog
    tiny-* name trains from, since no weights exist for it anywhere else."""
    folder = Path(root) / name
    if (folder / "model_index.json").is_file():
        return folder
    tmp = Path(root) / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_pipeline(name, tmp)
    empty = [p.name for p in tmp.iterdir() if p.is_dir() and not any(p.iterdir())]
    if empty:  # e.g. built on a rank that transformers does not let save
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"building {name} left empty component folders {empty}; build it on rank 0 first")
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
