"""Qwen-Image-Edit's text encoder reads the references through one of two image processors (issue 39): transformers'
Qwen2VLImageProcessorPil, which zerotrain builds without torchvision (qwen_image_edit.load_processor), or the
pipeline's own Qwen2VLImageProcessor where torchvision is installed. The comparison is benchmarks/qwen_edit_processor.py's
(its table: benchmarks/results/cpu-*-qwen-edit-processor.txt)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from benchmarks import qwen_edit_processor as bench
from zerotrain.families.runtime.parts import qwen_image_edit
from zerotrain.models.tiny import build_tiny_pipeline

# Bounds, from the measurement on tiny-qwen-image-edit-2511 (benchmarks/results/cpu-2026-11-28-qwen-edit-processor.txt)
# at about 2.5-10x the largest measured in each path, under what a wrong resampling kernel gives (the PIL processor
# made bilinear: mean 0.69 / 0.57 levels, embedding 1.8e-2 relative, in both paths):
# - the Plus pipeline's 384^2-area condition images (Edit-2509 / 2511 training): at most 1 uint8 level apart, 0.004
#   levels on average, embeddings 8.7e-4 relative (photo-like; 1.8e-3 for white noise);
# - QwenImageEditPipeline's 1024^2-area reference (1376 x 768 to the processor's 1372 x 756): PIL and torchvision
#   run their two resampling passes in the opposite order there, so textured pixels land up to 10 levels apart
#   (0.16 on average) and the embeddings 7.9e-3 relative.
BOUNDS = {"plus": {"max_levels": 2.0, "mean_levels": 0.05, "rel": 5e-3},
          "edit": {"max_levels": 16.0, "mean_levels": 0.4, "rel": 2e-2}}
CASES = (bench.Case("plus", ("photo-16x9",)), bench.Case("plus", ("noise-16x9",)),
         bench.Case("plus", ("control-05", "photo-16x9")), bench.Case("edit", ("photo-16x9",)))


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory):
    return build_tiny_pipeline(bench.MODEL, tmp_path_factory.mktemp("qwen-edit-processor") / bench.MODEL)


def test_pil_and_torchvision_processors_agree(tiny_edit):
    """Both processors through the pipelines' encode_prompt: the same grid of image rows, pixel values and
    embeddings within BOUNDS."""
    pytest.importorskip("torchvision", reason="torchvision not installed: zerotrain builds the PIL processor then "
                        "(qwen_image_edit.load_processor), and there is no torchvision one to compare it with")
    for row in bench.measure(tiny_edit, CASES):
        bound = BOUNDS[row["case"].pipeline]
        measured = {key: row[key] for key in bound}
        assert all(measured[key] <= most for key, most in bound.items()), (row["case"], measured, bound)


def test_load_processor_without_torchvision_is_the_published_pil_processor(tiny_edit, monkeypatch):
    """Without torchvision, load_processor's processor reads an image as Qwen2VLImageProcessorPil with the published
    min_pixels and max_pixels does (a 1024^2-area reference keeps its size: the class default max_pixels would shrink
    it), and gives it the rows the planner counts (image_rows)."""
    monkeypatch.setattr(qwen_image_edit, "vl_backend", lambda: "pil")
    processor = qwen_image_edit.load_processor(tiny_edit)
    assert type(processor.image_processor) is Qwen2VLImageProcessorPil
    image = bench.photo(1376, 768, 0)
    own = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)(images=[image], return_tensors="pt")
    got = processor(text=["<|vision_start|><|image_pad|><|vision_end|>a red square"], images=[image],
                    return_tensors="pt")
    assert got["image_grid_thw"].tolist() == own["image_grid_thw"].tolist() == [[1, 54, 98]]
    assert torch.equal(got["pixel_values"], own["pixel_values"])
    pads = int((got["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert pads == qwen_image_edit.image_rows("QwenImageEditPipeline", 1376, 768) == 27 * 49
