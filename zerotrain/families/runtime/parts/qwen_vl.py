"""The Qwen-VL text parts of the families whose text encoder is a Qwen-VL that reads images (Qwen-Image 2.1,
Qwen-Image-Edit, FLUX.3 [klein]'s processor): the processor built without torchvision, and a caption's rows
laid back around its images' rows."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def text_processor(tokenizer: Any, image_processor: Any = None, base: type | None = None) -> Any:
    """Qwen3-VL's processor (or `base`: Qwen2VLProcessor for Qwen2.5-VL) around a loaded tokenizer (and image
    processor: transformers' PIL one by default), without a video processor: transformers builds the Qwen-VL video
    processors only with torchvision, which zerotrain does not install, and the pipelines read text and images
    only. It saves as that processor without one (the tokenizer, the image processor and the chat template)."""
    class TextVLProcessor(base or Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any:
            kwargs.pop("push_to_hub", None)
            self.tokenizer.save_pretrained(save_directory, **kwargs)
            self.image_processor.save_pretrained(save_directory)
            return [save_directory]

    return TextVLProcessor(image_processor=image_processor or Qwen2VLImageProcessorPil(), tokenizer=tokenizer,
                                video_processor=None, chat_template=tokenizer.chat_template)


def load_text_processor(folder: Any, base: type | None = None) -> Any:
    """A model folder's processor/ (its tokenizer and image processor settings) as text_processor builds it,
    without torchvision: a Qwen3VLProcessor, or `base`."""
    return text_processor(AutoTokenizer.from_pretrained(folder, subfolder="processor"),
                          Qwen2VLImageProcessorPil.from_pretrained(folder, subfolder="processor"), base)


def with_slots(text: torch.Tensor, valid: torch.Tensor, image_pad_mask: torch.Tensor,
               slot_rows: torch.Tensor | None = None) -> tuple[Any, Any, Any]:
    """A batch's caption rows (B, n, D) and mask (B, n) (trim_rows) laid back into the text encoder's sequence
    with the condition images' slots, where the cache keeps only their flags (image_pad_mask (B, T + S), True at
    the S slots): (B, n + S, D) with zero rows at the slots (the transformer puts the images' latents there and
    reads nothing of those rows), or `slot_rows` (B, S, D) there (Qwen-Image-Edit keeps the text encoder's
    rows of the images), the mask (B, n + S) valid at the slots, and the slots' flags (n + S,). The template puts
    the images before the caption, so every caption's slots sit at the same places; a batch whose samples' slots
    differ is an error."""
    flags = image_pad_mask > 0
    count = int(flags[0].sum())
    rows = text.shape[1] + count
    row = flags[0, :rows]
    if int(row.sum()) != count or not torch.equal(flags[:, :rows], row.expand(len(flags), -1)) or flags[:, rows:].any():
        raise ValueError("the samples of a batch must hold their condition images' slots at the same rows of the text")
    full = text.new_zeros(text.shape[0], rows, *text.shape[2:])
    full[:, ~row] = text
    if slot_rows is not None:
        if slot_rows.shape[:2] != (text.shape[0], count):
            raise ValueError(f"{count} image slots in the text, but image rows {tuple(slot_rows.shape)}")
        full[:, row] = slot_rows.to(text.dtype)
    mask = torch.ones(text.shape[0], rows, dtype=torch.bool, device=valid.device)
    mask[:, ~row.to(valid.device)] = valid.bool()
    return full, mask, row
