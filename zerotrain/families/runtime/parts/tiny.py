"""Pieces the families' tiny model builders share (Family.tiny_components): tokenizers learned from a few
captions with no download, narrow text-encoder configs, and components seeded one by one, so the
same tiny model is written every time."""

from __future__ import annotations

import itertools
import math
import string
from collections import Counter
from typing import Any

import diffusers
import torch
from tokenizers import AddedToken
from transformers import CLIPTextConfig, CLIPTokenizer, Qwen2Tokenizer, Qwen3VLConfig, T5Config, T5Tokenizer

# Captions the tiny tokenizers learn their merges / pieces from.
_CORPUS = (
    "a photo of a cat sitting on a red chair",
    "an oil painting of mountains at sunset, warm light",
    "a watercolor sketch of a small boat on the lake",
    "close-up portrait of a dog, studio lighting, 85mm",
    "the city skyline at night with neon signs and rain",
)
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's context length: model_max_length of every SD/SDXL/SD3/Flux CLIP tokenizer.
_CLIP_MAX_LENGTH = 77
# tokenizer_2 (Flux) / tokenizer_3 (SD3) model_max_length in the published repos.
_T5_MAX_LENGTH = 512
# SDXL's and SD3's second CLIP (OpenCLIP bigG) pads with "!" where CLIP-L pads with <|endoftext|>.
OPENCLIP_PAD = "!"
# Layers per tiny text encoder: two, so the penultimate hidden state SDXL/SD3 use differs from the last.
_TEXT_LAYERS = 2
_TEXT_HEADS = 2
# Fixed seeds, one per component, so a component's weights do not depend on the others' sizes; the
# denoiser (transformer or unet) and any component not listed take seed 0.
_SEEDS = {"vae": 1, "text_encoder": 2, "text_encoder_2": 3, "text_encoder_3": 4, "unconditional_transformer": 5}

def check_room(ok: bool, name: str, denoiser: dict[str, Any]) -> None:
    if not ok:
        raise ValueError(f"{name}: the catalog denoiser config leaves no room for text encoders: {denoiser}")


def seeded(component: str, build: Any, config: Any) -> Any:
    """build(config) with its weights drawn from the component's own seed."""
    torch.manual_seed(_SEEDS.get(component, 0))
    return build(config).eval()


def diffusers_class(class_name: str) -> Any:
    return getattr(diffusers, class_name)


def clip_config(tokenizer: Any, hidden: int, projection: int) -> Any:
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


def t5_config(tokenizer: Any, d_model: int) -> Any:
    """T5 v1.1 as FLUX.1 and SD3 use it (gated GELU, untied embeddings), at width d_model."""
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


def clip_tokenizer(pad_token: str) -> Any:
    """A byte-level BPE CLIP tokenizer laid out as OpenAI's: the 256 byte symbols, the same with the
    end-of-word mark </w>, one token per merge (learned from _CORPUS until each word is one token), then the two specials."""
    template = CLIPTokenizer().backend_tokenizer  # CLIP's normalizer and pre-tokenizer
    words = Counter(
        piece
        for caption in _CORPUS
        for piece, _ in template.pre_tokenizer.pre_tokenize_str(template.normalizer.normalize_str(caption))
    )
    merges = _bpe_merges({(*word[:-1], word[-1] + "</w>"): count for word, count in words.items()})
    symbols = _byte_symbols()
    tokens = (
        symbols + [s + "</w>" for s in symbols] + ["".join(pair) for pair in merges] + [CLIP_BOS, CLIP_EOS]
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


def t5_tokenizer() -> Any:
    """A Unigram T5 tokenizer (<pad>=0, </s>=1, <unk>=2, as T5's) whose pieces are the corpus words
    and every printable ASCII character, scored by log frequency (characters add-one smoothed)."""
    words = Counter("▁" + word for caption in _CORPUS for word in caption.split())
    chars = Counter("".join(_CORPUS).replace(" ", "")) + Counter(string.printable.strip())
    counts = {"▁": len(_CORPUS), **chars, **words}
    total = sum(counts.values())
    pieces = sorted(
        ((piece, math.log(count / total)) for piece, count in counts.items()), key=lambda p: (-p[1], p[0])
    )
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


# What Qwen3's chat template makes of one user message with add_generation_prompt=True (ZImagePipeline's
# encode_prompt; Flux2KleinPipeline's adds the empty think block of enable_thinking=False).
QWEN3_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# Qwen3's chat template, cut to plain user/assistant turns: it renders the pipeline's messages as the
# published tokenizer_config.json does (including the empty think block of enable_thinking=False).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
QWEN3_THINK_TOKENS = ("<think>", "</think>")
# Qwen2/Qwen3's special tokens around chat turns, after <|endoftext|> (ids 151643..151645 in the real vocab).
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen2_tokenizer(template: str = "", specials: tuple[str, ...] = QWEN_SPECIALS, chat_template: str | None = None) -> Any:
    """A byte-level BPE Qwen2Tokenizer laid out as Qwen's: the 256 byte symbols, one token per merge
    (learned from _CORPUS and `template`, the text a pipeline wraps captions in, until each
    pre-token is one token, so a template prefix takes as many tokens as with the real vocabulary),
    then `specials`; eos, pad and unk are specials[0], as in Qwen's own files."""
    backend = Qwen2Tokenizer()._tokenizer  # Qwen2's normalizer and regex / byte-level pre-tokenizer
    text = template.replace("{}", " ".join(_CORPUS)) if "{}" in template else f"{template} {' '.join(_CORPUS)}"
    for special in specials:
        text = text.replace(special, "\x00")
    words = Counter(
        piece
        for segment in text.split("\x00")
        for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(segment))
    )
    merges = _bpe_merges({tuple(word): count for word, count in words.items()})
    tokens = _byte_symbols() + ["".join(pair) for pair in merges] + list(specials)
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072, eos_token=specials[0],
                               pad_token=specials[0], unk_token=specials[0])
    tokenizer.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials[1:]], special_tokens=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# Qwen3-VL's chat template cut to text turns, for the tiny Qwen3-VL tokenizers (Krea 2, Ideogram 4, FLUX.3, Qwen-Image
# 2.1): a message's content is a string or a list of parts, whose text parts it renders (Ideogram4Pipeline sends a
# list); no default system prompt, as Qwen3-VL's.
QWEN3_VL_TEXT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_vl_config(tokenizer: Any, width: int, layers: int) -> Any:
    """A narrow Qwen3-VL of `layers` text layers (2 heads, 1 key/value head): its interleaved multimodal RoPE
    sections split the head's rotary half 2:1:1 as the published [24, 20, 20] of 64 roughly does."""
    head = width // 2
    rotary = head // 2
    check_room(width % 4 == 0 and rotary >= 4, "a tiny Qwen3-VL", {"width": width})
    temporal = rotary // 2
    height = (rotary - temporal) // 2
    return Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": 2 * width,
            "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [temporal, height, rotary - temporal - height], "mrope_interleaved": True},
            "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": width,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": []},
        tie_word_embeddings=True,
    )
