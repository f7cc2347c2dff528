"""Qwen-Image-Edit (QwenImageEditPipeline, one reference) and Edit-2509 / Edit-2511 (QwenImageEditPlusPipeline,
up to three): the text side of the Qwen-Image family's edits, as the pipelines compute it.

- The text encoder (Qwen2.5-VL) reads each reference with the caption: the Plus pipeline writes
  "Picture N: <|vision_start|><|image_pad|><|vision_end|>" per image before the caption and hands Qwen2.5-VL
  each reference resized to 384 x 384 pixels of area (CONDITION_IMAGE_SIZE, lanczos); QwenImageEditPipeline's
  template holds one such block and reads the very image its VAE encodes. Both drop the template's first 64
  tokens and keep every other row, the images' included (each image one row per 28 x 28 pixels after the
  processor's resize), and cut nothing.
- The cache keeps a caption's own rows as prompt_embeds (data.text_tokens of them, as for text-to-image), the
  images' rows apart (image_rows) and where they sat (image_pad_mask), so that data.text_tokens stays the
  caption's budget and the planner adds the images' rows for the references it plans (reference_text_rows).
  Training and validation lay the rows back in the pipeline's order (parts.qwen_vl.with_slots).
- The processor: the pipeline's own Qwen2VLProcessor where torchvision is installed; without torchvision,
  transformers builds no Qwen2VLProcessor (its video processor needs it), so zerotrain builds it from the
  tokenizer and Qwen2VLImageProcessorPil (parts.qwen_vl.text_processor). At the Plus pipeline's 384^2 images the two
  differ by at most one uint8 level; at QwenImageEditPipeline's 1024^2 reference, where both libraries resize
  in two passes but in opposite orders, by up to 10 levels on a textured image (benchmarks/qwen_edit_processor.py).
  Which one read an image is part of its caption's cache key (text_reference_identity).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import caption_too_long
from zerotrain.families.parts.qwen_image_edit import (
    PLUS,
    VL_FACTOR,
    VL_MAX_PIXELS,
    VL_MIN_PIXELS,
)
from zerotrain.families.runtime.base import compact_rows, trim_rows
from zerotrain.families.runtime.parts.qwen_vl import load_text_processor, with_slots


def published_image_processor() -> Any:
    """Qwen2VLImageProcessorPil with the published min_pixels and max_pixels (the tiny model's)."""
    return Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS)


def vl_backend() -> str:
    """'torchvision' where it is installed (the pipeline's own processor), else 'pil'."""
    return "torchvision" if importlib.util.find_spec("torchvision") is not None else "pil"


def load_processor(folder: Path | str) -> Any:
    """The folder's processor/ as the edit pipelines load it (Qwen2VLProcessor) where torchvision is installed;
    without it, the same tokenizer and image settings around transformers' PIL image processor."""
    if vl_backend() == "torchvision":
        return Qwen2VLProcessor.from_pretrained(folder, subfolder="processor")
    return load_text_processor(folder, Qwen2VLProcessor)


def vl_size(pipeline_name: str, width: int, height: int) -> tuple[int, int]:
    """(width, height) of the image the text encoder is handed for a reference of this size: the Plus
    pipeline's condition image (384 x 384 pixels of area at its aspect, sides rounded to 32), or the
    reference itself (QwenImageEditPipeline)."""
    if pipeline_name != PLUS:
        return width, height
    w, h = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, width / height)
    return int(w), int(h)


def vl_images(pipeline: Any, pictures: list[Any]) -> list[Any]:
    """The references as the pipeline hands them to its text encoder, through its own resize (lanczos)."""
    name = type(pipeline).__name__
    sizes = [vl_size(name, *picture.size) for picture in pictures]
    return [pipeline.image_processor.resize(picture, h, w) for picture, (w, h) in zip(pictures, sizes, strict=True)]


def image_rows(pipeline_name: str, width: int, height: int) -> int:
    """The text rows Qwen2.5-VL gives a reference of this size, by the published processor's resize."""
    w, h = vl_size(pipeline_name, width, height)
    h, w = smart_resize(h, w, VL_FACTOR, VL_MIN_PIXELS, VL_MAX_PIXELS)
    return (h // VL_FACTOR) * (w // VL_FACTOR)


def encode_with_images(pipeline: Any, caption: str, pictures: list[Any], text_tokens: int, device: Any,
                       title: str) -> dict[str, Any]:
    """One caption read with its references by the pipeline's own encode_prompt: prompt_embeds (1, text_tokens,
    D) and prompt_embeds_mask of the caption's rows (the template's, the images' labels and vision markers, the
    caption), image_rows (1, S, D) of the images' S tokens and image_pad_mask (1, text_tokens + S), True where
    each of them sat. Which rows are the images' is read from the token ids the pipeline gave its text encoder
    (a forward pre-hook), past the pipeline's dropped prefix."""
    given = vl_images(pipeline, pictures)
    seen: dict[str, Any] = {}
    hook = pipeline.text_encoder.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs),
                                                           with_kwargs=True)
    try:
        embeds, _ = pipeline.encode_prompt([caption], image=given if type(pipeline).__name__ == PLUS else given[0],
                                           device=device)
    finally:
        hook.remove()
    ids = seen["input_ids"][0][seen["attention_mask"][0].bool()][pipeline.prompt_template_encode_start_idx:]
    pads = (ids == pipeline.text_encoder.config.image_token_id).to(embeds.device)
    if len(pads) != embeds.shape[1]:
        raise AssertionError(f"{title}: {embeds.shape[1]} rows from encode_prompt for {len(pads)} tokens")
    count = int((~pads).sum())
    if count > text_tokens:
        raise caption_too_long(caption, count, text_tokens, f"{title}'s edit template",
                               " (the pipeline does not truncate; the images' rows do not count)")
    if not int(pads.sum()):
        sizes = ", ".join(f"{p.size[0]}x{p.size[1]}" for p in given)
        raise ZerotrainError(f"{title}'s processor read no image tokens from the references ({sizes} px): its "
                             "processor/preprocessor_config.json does not admit that size")
    flags = torch.cat([pads, pads.new_zeros(text_tokens - count)])[None]
    return {**compact_rows(embeds, (~pads).long()[None], text_tokens), "image_pad_mask": flags,
            "image_rows": embeds[:, pads]}


def cached_rows(embeds: dict[str, Any]) -> tuple[Any, Any]:
    """A cached prompt's rows and mask as the pipeline's encode_prompt returns them: cut to its own length,
    an edit's caption rows laid back around its images' rows."""
    text, mask = trim_rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])
    if "image_pad_mask" in embeds:
        text, mask, _ = with_slots(text, mask, embeds["image_pad_mask"], embeds["image_rows"])
    return text, mask.long()


def encoder_pipeline(pipeline_class: Any, folder: Path | str, dtype: Any) -> Any:
    """An edit pipeline around the folder's VAE, Qwen2.5-VL and processor (load_processor), loaded one by one:
    the pipeline's own from_pretrained builds the processor only with torchvision."""
    return pipeline_class(scheduler=None, transformer=None, tokenizer=None, processor=load_processor(folder),
                          vae=AutoencoderKLQwenImage.from_pretrained(folder, subfolder="vae", torch_dtype=dtype),
                          text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(
                              folder, subfolder="text_encoder", dtype=dtype))
