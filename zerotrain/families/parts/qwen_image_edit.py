"""Qwen-Image-Edit (QwenImageEditPipeline, one reference) and Edit-2509 / Edit-2511 (QwenImageEditPlusPipeline, up
to three): the edit pipelines and the published image processor's sizes, as the planner reads them. How the text
encoder reads the references is the torch side's, zerotrain.families.runtime.parts.qwen_image_edit."""

from __future__ import annotations

# The edit pipelines, and how many reference images each takes: QwenImageEditPipeline one; the Plus
# pipeline (Edit-2509, Edit-2511) a list, 1 to 3 as Qwen's model card recommends.
EDIT_PIPELINES = {"QwenImageEditPipeline": 1, "QwenImageEditPlusPipeline": 3}
PLUS = "QwenImageEditPlusPipeline"
# Qwen2.5-VL's published image processor (Qwen/Qwen-Image-Edit processor/preprocessor_config.json): 14 px
# patches merged 2 x 2, one text row per 28 x 28 pixels, between 3,136 and 12,845,056 pixels (min_pixels and
# max_pixels there; the class defaults' 1,003,520 would shrink QwenImageEditPipeline's 1024 x 1024 reference).
VL_FACTOR = 28
VL_MIN_PIXELS = 56 * 56
VL_MAX_PIXELS = 28 * 28 * 16384


