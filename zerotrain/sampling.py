"""Validation images: the model being trained renders the configured prompts through its family's
own diffusers pipeline (FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline, ...), so the
images are what a user of the exported weights would get with the same settings.

What stays in memory during training is only what the images need and training does not: the text
embeddings of the prompts (and of the negative prompt when classifier-free guidance runs), computed
once at construction with the pipeline's own encode_prompt (models.conditioning) and kept on the host,
and the scheduler. The text encoders are freed right after encoding, and the VAE is loaded for each
render and freed after it, so training's memory is the same with validation as without.

Every rank renders, and under ZeRO-3 it must: the denoiser's parameters are partitioned, and
DeepSpeed's forward hooks gather each module's parameters from all ranks when it runs. A rank that
made fewer denoiser forwards than the others would leave them waiting in an all-gather (NCCL hangs;
gloo fails on the mismatched collectives). So
the jobs (prompts x seeds, one image each) are dealt round-robin and every rank renders the same
number of images: a rank short of real jobs renders a padding job (job 0) and throws the image
away. One image per pipeline call and one pipeline call per job keep the forwards identical on every
rank, whatever the prompt. The pipeline is built around the model in place and never moved
(`pipeline.to` would move a partitioned model); the prompt embeddings go to the training device
instead. The images travel to rank 0 as PNG bytes, and rank 0 writes them with a grid.

Each image's noise comes from a CPU generator seeded with its seed (the pipelines draw the initial
latents on the CPU and move them), so a seed gives the same image on any rank, world size or device
type, and the global RNG that training draws from is left untouched (nothing else is random in
eval mode).
"""

from __future__ import annotations

import gc
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotrain import families
from zerotrain.config.sections import RunConfig, ValidationConfig
from zerotrain.distributed import Topology, gather_objects
from zerotrain.errors import ZerotrainError
from zerotrain.protocols import ModelSpec


@dataclass(frozen=True)
class Job:
    """One validation image: a prompt rendered from one seed."""

    index: int
    """Position in prompts x seeds (prompt-major); names the file."""
    prompt_index: int
    prompt: str
    seed: int


def make_jobs(prompts: list[str], seeds: list[int]) -> list[Job]:
    """Every prompt with every seed, prompt-major."""
    pairs = [(p, seed) for p in range(len(prompts)) for seed in seeds]
    return [Job(i, p, prompts[p], seed) for i, (p, seed) in enumerate(pairs)]


def assign_jobs(n_jobs: int, world: int) -> list[list[int | None]]:
    """Job indices per rank, round-robin, each list as long as the longest: ceil(n_jobs / world)
    renders for every rank, None marking a padding render (its image is discarded). With no jobs
    nothing renders anywhere."""
    if n_jobs < 0 or world < 1:
        raise ValueError(f"assign_jobs: need n_jobs >= 0 and world >= 1, got {n_jobs}, {world}")
    rounds = math.ceil(n_jobs / world)
    return [[i if i < n_jobs else None for i in range(rank, rounds * world, world)] for rank in range(world)]


def is_due(config: ValidationConfig, step: int, last_step: int, resumed: bool) -> bool:
    """Whether validation images are due after `step` optimizer steps of a run that ends at
    `last_step`: at step 0 of a fresh run (at_start; a run resumed from a checkpoint never starts
    at 0), every `config.every` steps, and at the last step (at_end). Never without prompts.
    The starting step of a resumed run counts like any other step: if it is due, it was due
    for the run that saved the checkpoint too, and rendering it again gives the same images."""
    if not config.prompts or not config.seeds:
        return False
    if step == 0:
        return config.at_start and not resumed
    every = config.every
    return bool(every and step % every == 0) or (config.at_end and step == last_step)


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, columns) of the grid of n images: ceil(sqrt(n)) columns, as many rows as needed."""
    columns = max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / columns), columns


class Validator:
    """Renders run.validation's prompts with the model being trained. Construct it on every rank
    before the denoiser is loaded (the text encoders are loaded, used and freed here, so their
    memory is back before training needs it); call due() at step 0 and after every optimizer step,
    and render() on every rank when it says so."""

    def __init__(self, spec: ModelSpec, folder: Path, run: RunConfig, topo: Topology, device: torch.device):
        """spec: the resolved model; folder: the local diffusers model folder with vae/, the
        tokenizers, the text encoders and scheduler/ (data.cache.model_folder)."""
        from zerotrain.data.cache import encode_dtype

        self.spec, self.folder, self.topo, self.device = spec, Path(folder), topo, torch.device(device)
        self.family = families.of(spec)
        self.config = run.validation
        self.resolution = self.config.resolution or run.data.resolution
        factor = self.family.pixel_factor(spec)
        if self.resolution % factor:
            field = "validation.resolution" if self.config.resolution else "data.resolution"
            raise ZerotrainError(f"{field}={self.resolution}: validation images of {spec.name} need a "
                                 f"multiple of {factor} (VAE x{spec.vae_scale_factor} times the denoiser's "
                                 "patching)")
        guidance = self.config.guidance_scale
        # The default guidance_scale of the family pipeline's __call__.
        self.guidance_scale = self.family.default_guidance if guidance is None else guidance
        self.cfg = self.family.classifier_free(self.guidance_scale) and self.family.takes_negative(spec, self.folder)
        self.jobs = make_jobs(self.config.prompts, self.config.seeds)
        self.area = run.data.control_resolution
        self.controls = [self._references(images, self.area) for images in self.config.controls]
        self.prompt_embeds: list[dict[str, torch.Tensor]] = []
        self.negative_embeds: dict[str, torch.Tensor] = {}
        self.edit_negatives: dict[int, dict[str, torch.Tensor]] = {}
        """Prompt index -> the negative prompt encoded with that prompt's references, where the text encoder
        reads them (Family.text_reads_references)."""
        if self.jobs:
            self._encode(run.data.text_tokens or self.family.default_text_tokens, encode_dtype(self.device))
            self.scheduler = load_scheduler(self.family.scheduler_config(self.folder))

    def _encode(self, text_tokens: int, dtype: torch.dtype) -> None:
        """Text embeddings of every prompt (one at a time, as the pipeline encodes a batch of one)
        and of the negative prompt, on the host; the encoders are freed afterwards. A text encoder that
        reads the references (Family.text_reads_references) reads each prompt's with it, and with the
        negative prompt, which then has one encoding per prompt."""
        from zerotrain.models.conditioning import encode_prompts, free, load_encoders

        def encode(prompt: str, images: list[Any] | None = None) -> dict[str, torch.Tensor]:
            return _to_host(encode_prompts(encoders, [prompt], text_tokens, [images] if images else None))

        negative = self.config.negative_prompt
        read = [images if self.family.text_reads_references else None for images in self.controls] \
            or [None] * len(self.config.prompts)
        encoders = load_encoders(self.spec, self.folder, self.device, dtype)
        try:
            for index, prompt in enumerate(self.config.prompts):
                self.prompt_embeds.append(encode(prompt, read[index]))
                if self.cfg and read[index]:
                    self.edit_negatives[index] = self.family.negative_embeds(self.folder, negative,
                                                                             encode(negative, read[index]))
            if self.cfg:
                self.negative_embeds = self.family.negative_embeds(self.folder, negative, encode(negative))
        finally:
            free(encoders)

    def _references(self, images: list[Path], area: int | None) -> list[Any]:
        """One prompt's control images, each resized and cropped to the size training encodes a
        reference of a square target at the validation resolution (Family.reference_size)."""
        from zerotrain.data.buckets import apply_crop, plan_crop
        from zerotrain.data.images import ImageRejected, load_rgb

        most = self.family.max_references(self.spec)
        if len(images) > most:
            raise ZerotrainError(f"validation.controls: {len(images)} images for one prompt, but "
                                 f"{self.family.pipeline_name(self.spec)} takes {f'at most {most}' if most else 'none'}; "
                                 "give each prompt fewer (none for a text-to-image model)")
        side = (self.resolution, self.resolution)
        out = []
        for path in images:
            try:
                image = load_rgb(path)
            except (ImageRejected, OSError) as err:
                raise ZerotrainError(f"validation.controls: {path}: {getattr(err, 'reason', err)}; "
                                     "use an image zerotrain can read") from None
            size = self.family.reference_size(self.spec, side, image.size, area)
            out.append(apply_crop(image, plan_crop(*image.size, size, "center", None)))
        return out

    def due(self, step: int, last_step: int, resumed: bool) -> bool:
        """Whether to render after `step` optimizer steps of a run that ends at `last_step`
        (see is_due); `resumed`: the run continues from a checkpoint."""
        return is_due(self.config, step, last_step, resumed)

    def render(self, model: torch.nn.Module, step: int, out_dir: Path, writer: Any = None) -> list[Path]:
        """Render every job with `model` (the diffusers denoiser the engine trains). Called by every
        rank with the same arguments; each makes the same denoiser forwards. Rank 0 writes
        out_dir/validation/step-<step>/NN-seedS.png and grid.png, logs them to `writer` (a
        TensorBoard SummaryWriter) when given, and returns the paths; other ranks return []."""
        if not self.jobs:
            return []
        mine = assign_jobs(len(self.jobs), self.topo.world_size)[self.topo.rank]
        rendered: list[tuple[int, bytes]] = []
        was_training = model.training
        pipeline = self._pipeline(model)
        try:
            model.eval()
            with torch.no_grad():
                for index in mine:
                    job = self.jobs[0 if index is None else index]
                    image = self._image(pipeline, job, model.dtype)
                    if index is not None:
                        rendered.append((index, self._png(image, job, step)))
        finally:
            model.train(was_training)
            del pipeline
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        gathered = gather_objects(rendered)
        if not self.topo.is_main:
            return []
        pngs = dict(sorted(item for part in gathered for item in part))
        if sorted(pngs) != list(range(len(self.jobs))):
            raise AssertionError(f"validation: expected images 0..{len(self.jobs) - 1}, got {sorted(pngs)}")
        return self._write(pngs, step, Path(out_dir), writer)

    def _pipeline(self, model: torch.nn.Module) -> Any:
        """The family's pipeline around `model` as it is (not moved), a freshly loaded VAE in the
        model's dtype on the device, the scheduler, and no text encoders or tokenizers
        (Family.validation_pipeline)."""
        import diffusers

        family = self.family
        vae = getattr(diffusers, family.codec.vae_class).from_pretrained(self.folder, subfolder="vae", torch_dtype=model.dtype)
        vae.to(self.device).requires_grad_(False).eval()
        components: dict[str, Any] = {"vae": vae, "scheduler": self.scheduler, family.denoiser_folder: model,
                                      **family.pipeline_kwargs(self.spec, self.folder)}
        for tokenizer, encoder in family.text_parts(family.pipeline_name(self.spec)):
            components[tokenizer] = components[encoder] = None
        pipeline = family.validation_pipeline(self.spec, self.folder, components, self.device)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def _image(self, pipeline: Any, job: Job, dtype: torch.dtype) -> Any:
        """One PIL image of one job. The embeddings are given on the training device: the pipelines
        move neither prompt_embeds (Flux) nor the model."""
        def place(embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {name: value.to(self.device, dtype) for name, value in embeds.items()}

        negative = place(self.edit_negatives.get(job.prompt_index, self.negative_embeds)) if self.cfg else None
        kwargs = self.family.validation_kwargs(place(self.prompt_embeds[job.prompt_index]), negative, self.guidance_scale)
        if self.controls and self.controls[job.prompt_index]:  # an edit: the prompt's reference images
            kwargs.update(self.family.reference_kwargs(self.spec, self.controls[job.prompt_index],
                                                       (self.resolution, self.resolution), self.area))
        out = pipeline(**kwargs, height=self.resolution, width=self.resolution,
                       num_inference_steps=self.config.steps,
                       generator=torch.Generator(device="cpu").manual_seed(job.seed), output_type="pil")
        return out.images[0]

    def _metadata(self, step: int) -> dict[str, str]:
        meta = {"step": str(step), "steps": str(self.config.steps),
                "guidance_scale": str(self.guidance_scale), "model": self.spec.name}
        if self.cfg:
            meta["negative_prompt"] = self.config.negative_prompt
        return meta

    def _png(self, image: Any, job: Job, step: int) -> bytes:
        return _png_bytes(image, {"prompt": job.prompt, "seed": str(job.seed), **self._metadata(step)})

    def _write(self, pngs: dict[int, bytes], step: int, out_dir: Path, writer: Any) -> list[Path]:
        """Rank 0: the images and their grid, written atomically, and logged to TensorBoard."""
        import numpy as np
        from PIL import Image

        folder = out_dir / "validation" / f"step-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths, arrays = [], []
        for job in self.jobs:
            path = folder / f"{job.index:02d}-seed{job.seed}.png"
            _write_atomic(path, pngs[job.index])
            paths.append(path)
            with Image.open(io.BytesIO(pngs[job.index])) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        grid = make_grid(arrays)
        meta = {"prompts": json.dumps(self.config.prompts), "seeds": json.dumps(self.config.seeds),
                **self._metadata(step)}
        paths.append(folder / "grid.png")
        _write_atomic(paths[-1], _png_bytes(Image.fromarray(grid), meta))
        if writer is not None:
            writer.add_image("validation/grid", grid, step, dataformats="HWC")
            for job, array in zip(self.jobs, arrays, strict=True):
                writer.add_image(f"validation/{job.index:02d}", array, step, dataformats="HWC")
        print(f"validation: {len(self.jobs)} images at step {step} -> {folder}", flush=True)
        return paths


def make_grid(images: list[Any]) -> Any:
    """HWC uint8 arrays of one size side by side, row-major, ceil(sqrt(n)) columns; the cells
    after the last image stay black."""
    import numpy as np

    rows, columns = grid_shape(len(images))
    height, width, channels = images[0].shape
    grid = np.zeros((rows * height, columns * width, channels), dtype=np.uint8)
    for i, image in enumerate(images):
        if image.shape != (height, width, channels):
            raise ValueError(f"make_grid: image {i} is {image.shape}, "
                             f"the first is {(height, width, channels)}")
        row, column = divmod(i, columns)
        grid[row * height:(row + 1) * height, column * width:(column + 1) * width] = image
    return grid


def load_scheduler(config: dict[str, Any]) -> Any:
    """The scheduler a config names (FlowMatchEulerDiscreteScheduler for Flux and SD3,
    EulerDiscreteScheduler for SDXL's published repo), from that config (Family.scheduler_config)."""
    import diffusers

    name = config.get("_class_name")
    scheduler = getattr(diffusers, str(name), None)
    if scheduler is None or not hasattr(scheduler, "from_config"):
        raise ZerotrainError(f"validation: the scheduler config names '{name}', which is no diffusers scheduler")
    return scheduler.from_config(config)


def _to_host(embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in embeds.items()}


def _png_bytes(image: Any, text: dict[str, str]) -> bytes:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
