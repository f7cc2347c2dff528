"""Qwen-Image-Edit's two image processors side by side (issue 39, "The processor difference"): transformers'
Qwen2VLImageProcessorPil, which zerotrain builds without torchvision (qwen_image_edit.load_processor), against
the pipeline's own Qwen2VLImageProcessor (torchvision backend), which load_processor returns where torchvision
is installed. Both resize to the processor's multiple of 28 px with bicubic resampling, PIL's against
torchvision's antialiased one, then rescale and normalize alike.

For each image, at the size the pipeline hands its text encoder (QwenImageEditPlusPipeline: 384 x 384 px of
area, qwen_image_edit.vl_images; QwenImageEditPipeline: the reference at 1024 x 1024 px of area, as its
__call__ resizes it), on the tiny model folder (tiny-qwen-image-edit-2511, the published processor settings):
  - pixel_values: max and mean absolute difference, normalized and in uint8 levels, and the share of values
    that differ;
  - the text embedding from the pipeline's encode_prompt with the images (float32), one pipeline per processor
    around the same text encoder: ||a - b|| / ||b|| (b: torchvision's) over all rows and over the images' rows,
    and the largest absolute difference.

    python benchmarks/qwen_edit_processor.py   # needs torchvision; exits 2 without it

Measured (results file): the Plus pipeline's condition images land at most 1 uint8 level apart; at
QwenImageEditPipeline's 1024^2 area, textured images land up to 10 levels apart (white noise 22), because for
1376 x 768 -> 1372 x 756 PIL runs its vertical pass first and torchvision its horizontal one, each rounding to
uint8 in between (each library's one-shot resize equals its two passes done one by one in that order, bit
for bit; done in the other order, each lands within 2 levels of the other library's).

Takes about half a minute on the 2-core CPU machine. Results: benchmarks/results/cpu-*-qwen-edit-processor.txt."""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

ROOT = Path(__file__).resolve().parents[1]
CONTROLS = ROOT / "examples" / "tiny-edit-data" / "control"
MODEL = "tiny-qwen-image-edit-2511"
PROMPT = "turn the shape into a glass sculpture on a wooden table"


@dataclass(frozen=True)
class Case:
    """One encode: the pipeline ('plus': QwenImageEditPlusPipeline, 'edit': QwenImageEditPipeline) and the
    names of its reference images."""

    pipeline: str
    images: tuple[str, ...]


CASES = (Case("plus", ("control-00",)), Case("plus", ("control-05",)), Case("plus", ("gradient-4x3",)),
         Case("plus", ("photo-16x9",)), Case("plus", ("noise-3x4",)), Case("plus", ("noise-16x9",)),
         Case("plus", ("control-05", "photo-16x9")), Case("edit", ("gradient-4x3",)), Case("edit", ("noise-3x4",)),
         Case("edit", ("photo-16x9",)), Case("edit", ("noise-16x9",)))


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like test image: a smooth random field, hard-edged shapes, fine texture and sensor noise."""
    rng = np.random.default_rng(seed)
    low = Image.fromarray(rng.integers(0, 256, (height // 40, width // 40, 3), dtype=np.uint8))
    image = low.resize((width, height), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(height // 20, height // 5))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=fill)
    yy, xx = np.mgrid[0:height, 0:width]
    texture = 12 * np.sin(xx / 3.1 + yy / 5.3)[..., None] + rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float64) + texture, 0, 255).astype(np.uint8))


def test_images() -> dict[str, Image.Image]:
    """Two of examples/tiny-edit-data's controls (64 x 64: flat shapes; 05 has 60 colors) and generated images
    of a few aspect ratios: a smooth gradient (4:3), a photo-like image (16:9) and white noise (3:4 and 16:9, the
    worst case for resampling)."""
    yy, xx = np.mgrid[0:480, 0:640]
    gradient = np.stack([xx * 255 / 639, yy * 255 / 479, (xx + yy) * 255 / 1118], -1).astype(np.uint8)
    noise = np.random.default_rng(1).integers(0, 256, (1280, 1280, 3), dtype=np.uint8)
    return {"control-00": Image.open(CONTROLS / "00-red-square.png").convert("RGB"),
            "control-05": Image.open(CONTROLS / "05-green-circle.png").convert("RGB"),
            "gradient-4x3": Image.fromarray(gradient), "photo-16x9": photo(1280, 720, 0),
            "noise-3x4": Image.fromarray(noise[:640, :480]), "noise-16x9": Image.fromarray(noise[:720])}


def processors(folder: Path) -> dict[str, Any]:
    """zerotrain's processors for the folder: {'pil': built without torchvision, 'torchvision': the pipeline's
    own}, both from qwen_image_edit.load_processor (the first with vl_backend answering 'pil')."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from zerotrain.families.runtime.parts import qwen_image_edit

    with mock.patch.object(qwen_image_edit, "vl_backend", return_value="pil"):
        pil = qwen_image_edit.load_processor(folder)
    fast = qwen_image_edit.load_processor(folder)
    assert type(pil.image_processor) is Qwen2VLImageProcessorPil, type(pil.image_processor)
    assert type(fast.image_processor) is Qwen2VLImageProcessor, type(fast.image_processor)
    return {"pil": pil, "torchvision": fast}


def pipelines(folder: Path, given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{'plus' | 'edit': {backend: pipeline}}: QwenImageEditPlusPipeline and QwenImageEditPipeline around the
    folder's text encoder (float32) and VAE, one per processor."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, subfolder="text_encoder", dtype=torch.float32)
    vae = AutoencoderKLQwenImage.from_pretrained(folder, subfolder="vae")
    return {name: {backend: cls(scheduler=None, transformer=None, tokenizer=None, processor=processor, vae=vae,
                                text_encoder=encoder.eval()) for backend, processor in given.items()}
            for name, cls in (("plus", QwenImageEditPlusPipeline), ("edit", QwenImageEditPipeline))}


def encoder_images(name: str, pipeline: Any, pictures: list[Image.Image]) -> list[Image.Image]:
    """The references as the pipeline hands them to its text encoder: the Plus pipeline's condition images
    (zerotrain's vl_images), QwenImageEditPipeline's reference at 1024 x 1024 px of area (its __call__)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from zerotrain.families.runtime.parts.qwen_image_edit import vl_images

    if name == "plus":
        return vl_images(pipeline, pictures)
    sizes = [calculate_dimensions(1024 * 1024, p.size[0] / p.size[1])[:2] for p in pictures]
    return [pipeline.image_processor.resize(p, h, w) for p, (w, h) in zip(pictures, sizes, strict=True)]


def pixel_difference(given: dict[str, Any], images: list[Image.Image]) -> dict[str, Any]:
    """pixel_values of the two image processors for the images: absolute differences, normalized and in uint8
    levels (the normalization undone per channel), and the grid each gives."""
    out = {b: p.image_processor(images=images, return_tensors="pt") for b, p in given.items()}
    grids = {b: o["image_grid_thw"].tolist() for b, o in out.items()}
    assert grids["pil"] == grids["torchvision"], grids
    a, b = out["pil"]["pixel_values"].double(), out["torchvision"]["pixel_values"].double()
    std = torch.tensor(given["pil"].image_processor.image_std, dtype=torch.float64)
    levels = ((a - b).abs().reshape(len(a), 3, -1) * std[None, :, None] * 255).reshape(len(a), -1)
    return {"grid": grids["pil"], "max": float((a - b).abs().max()), "mean": float((a - b).abs().mean()),
            "max_levels": float(levels.max()), "mean_levels": float(levels.mean()),
            "differ": float((levels > 0.5).double().mean())}


def embedding_difference(pair: dict[str, Any], images: list[Image.Image]) -> dict[str, float]:
    """The pipeline's encode_prompt with the images through each processor: relative error (torchvision's as
    the reference) over all rows and over the images' rows, and the largest absolute difference."""
    seen: dict[str, Any] = {}
    embeds = {}
    for backend, pipeline in pair.items():
        hook = pipeline.text_encoder.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
        try:
            with torch.no_grad():
                image = images if type(pipeline).__name__ == "QwenImageEditPlusPipeline" else images[0]
                embeds[backend], _ = pipeline.encode_prompt([PROMPT], image=image, device=torch.device("cpu"))
        finally:
            hook.remove()
    pipeline = pair["pil"]
    ids = seen["input_ids"][0][seen["attention_mask"][0].bool()][pipeline.prompt_template_encode_start_idx:]
    rows = ids == pipeline.text_encoder.config.image_token_id
    a, b = embeds["pil"][0].double(), embeds["torchvision"][0].double()
    assert a.shape == b.shape and len(rows) == len(a), (a.shape, b.shape, len(rows))
    return {"rows": len(a), "image_rows": int(rows.sum()), "rel": float((a - b).norm() / b.norm()),
            "rel_image": float((a[rows] - b[rows]).norm() / b[rows].norm()), "max_abs": float((a - b).abs().max())}


def measure(folder: Path, cases: tuple[Case, ...] = CASES) -> list[dict[str, Any]]:
    """One row per case: the images' sizes as handed to the text encoder, the pixel and embedding differences."""
    given = processors(folder)
    pipes = pipelines(folder, given)
    pictures = test_images()
    rows = []
    for case in cases:
        images = encoder_images(case.pipeline, pipes[case.pipeline]["pil"], [pictures[n] for n in case.images])
        rows.append({"case": case, "sizes": [f"{i.size[0]}x{i.size[1]}" for i in images],
                     **pixel_difference(given, images), **embedding_difference(pipes[case.pipeline], images)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table."""
    head = ("pipeline", "images (as handed over)", "VL grid", "px max", "px mean", "lvl max", "lvl mean",
            "differ", "emb rel", "img-row rel", "emb max abs")
    lines = [head]
    for r in rows:
        names = "+".join(f"{n} {s}" for n, s in zip(r["case"].images, r["sizes"], strict=True))
        grid = "+".join(f"{w * 14}x{h * 14}" for _, h, w in r["grid"])
        lines.append((r["case"].pipeline, names, grid, f"{r['max']:.4f}", f"{r['mean']:.5f}",
                      f"{r['max_levels']:.1f}", f"{r['mean_levels']:.3f}", f"{100 * r['differ']:.1f}%",
                      f"{r['rel']:.2e}", f"{r['rel_image']:.2e}", f"{r['max_abs']:.2e}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    if importlib.util.find_spec("torchvision") is None:
        print("qwen_edit_processor: needs torchvision (the pipeline's own processor); it is not installed here")
        return 2
    import torchvision
    import transformers

    from zerotrain.models.tiny import build_tiny_pipeline

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(build_tiny_pipeline(MODEL, Path(tmp) / MODEL))
    print(f"machine: CPU, {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}, transformers {transformers.__version__}")
    print(f"model: {MODEL} (float32); plus = QwenImageEditPlusPipeline, edit = QwenImageEditPipeline; "
          "a = Qwen2VLImageProcessorPil (zerotrain without torchvision), b = Qwen2VLImageProcessor (torchvision)")
    print("px: |a - b| of pixel_values (normalized); lvl: the same in uint8 levels; differ: share of values more "
          "than half a level apart; emb rel: ||a - b|| / ||b|| of encode_prompt's rows (img-row: the images' rows)\n")
    print(table(rows))
    worst = max(rows, key=lambda r: r["rel"])
    print(f"\nworst embedding relative error {worst['rel']:.2e} ({'+'.join(worst['case'].images)}, "
          f"{worst['case'].pipeline}); {time.perf_counter() - start:.0f} s")
    return 0 if all(math.isfinite(r["rel"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
