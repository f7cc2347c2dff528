"""One pydantic model per run.yaml section. Every field has a docstring; cross-field rules are
model validators so that an error names the field it is about."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zerotrain.optimizers import CLIENT_OPTIMIZERS, OPTIMIZERS

# planner.loader_worker_bytes: one DataLoader worker's host RAM. benchmarks/loader_workers_ram.py measured 20 MiB of
# a node's PSS per worker (a forked worker shares nearly all of its rank's pages); the rest is room for the batches
# it prefetches (data prefetch 2, each up to 4 samples of a 1024-px latent and a 512-token T5 embedding: 36 MiB).
LOADER_WORKER_BYTES = 64 * 2**20
# planner.dataset_entry_bytes: what a rank process holds per dataset entry (the dataset index's rows it maps, the
# epoch's samples and the sampler's arrays). benchmarks/dataset_index.py measured 193.5 bytes of RSS per entry over a
# million entries (146 of them arrays).
DATASET_ENTRY_BYTES = 200
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(text: str | float) -> int:
    """'48GiB' -> 51539607552, '80GB' -> 80e9, 1024 -> 1024. Raises ValueError with the input."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text}")
        return int(text)
    match = _BYTES_RE.match(str(text))
    if not match:
        raise ValueError(f"'{text}' is not a size; write it like 48GiB, 80GB or 512MiB")
    value = float(match.group(1)) * _BYTE_UNITS[(match.group(2) or "B").lower()]
    if value <= 0:
        raise ValueError(f"a size must be positive, got '{text}'")
    return int(value)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class Mode(str, Enum):
    full = "full"
    lora = "lora"


class Quantization(str, Enum):
    none = "none"
    qint8 = "qint8"
    qfloat8 = "qfloat8"
    qint4 = "qint4"


class Loading(str, Enum):
    auto = "auto"
    whole = "whole"


class ModelConfig(_Section):
    name_or_path: str = "flux-dev"
    """A catalog name (flux-dev, sdxl-base, tiny-flux, ...), a diffusers model config.json (plans only), a
    local diffusers pipeline folder, or a Hugging Face hub id. A hub id (or a catalog name's) is downloaded
    once per node into the Hugging Face cache (HF_HOME / HF_HUB_CACHE) before the data is encoded: every
    component of the pipeline, each with the files from_pretrained loads; HF_TOKEN for gated repos."""
    subfolder: str | None = None
    """Subfolder of a model folder or hub repo that holds the denoiser; found from model_index.json
    when not given."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids: the one planned and downloaded."""
    denoiser: str | None = None
    """A fine-tuned denoiser to train in place of the pipeline's own, over name_or_path's VAE, text
    encoders and scheduler: a single .safetensors file (diffusers' names, or the Black Forest Labs,
    ComfyUI and original layouts diffusers' from_single_file reads; zerotrain's own --comfyui export),
    a diffusers model folder (config.json and weights, such as a run's export/transformer, or a
    pipeline folder, whose denoiser is taken), or a hub id: owner/name for a pipeline repo,
    owner/name/<folder> for a folder in it, owner/name/<file>.safetensors for a file in it. It must be
    the architecture name_or_path's pipeline trains; a single file is planned as the base's."""
    denoiser_revision: str | None = None
    """Hub revision of model.denoiser, where it is a hub id."""
    load: Loading = Loading.auto
    """How the ranks of a node load the denoiser. auto: about one model copy of host RAM per node
    (ZeRO-3: rank 0 reads each weight from the memory-mapped safetensors and DeepSpeed keeps each
    rank's partition; ZeRO 0-2 and a quantized base on GPUs: the ranks of a node load in turn, each
    moving its copy to its GPU before the next starts). whole: every rank loads the whole model on
    the host at once (one copy per rank)."""

    @model_validator(mode="after")
    def _denoiser_revision(self) -> ModelConfig:
        if self.denoiser_revision is not None and self.denoiser is None:
            raise ValueError("denoiser_revision applies to model.denoiser, which is not set; remove it or set denoiser")
        return self


class LoraConfig(_Section):
    rank: int = Field(16, ge=1, le=1024)
    """LoRA rank r (the inner dimension of the A/B pair)."""
    alpha: float | None = Field(None, gt=0)
    """LoRA alpha; the update is scaled by alpha / rank. Defaults to the rank."""
    target_modules: list[str] | None = None
    """Module names (peft semantics) to adapt; the family's default when not given."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input (LoKr and LoHa: peft's module dropout, the share of steps a layer's
    adapter is left out)."""
    type: Literal["lora", "lokr", "loha"] = "lora"
    """The adapter, through peft. lora: B A (rank r). lokr: a Kronecker product w1 (x) w2 (LyCORIS's
    LoKr): w1 whole, w2 split into two rank-r matrices where r is under half its size; peft builds
    each layer's full delta at every forward. loha: the Hadamard product of two rank-r LoRAs. The
    scale is alpha / rank for all three."""
    use_dora: bool = False
    """lora only: DoRA, a trained magnitude per output row beside the LoRA direction (peft's
    use_dora); slower per step than plain LoRA."""
    factor: int = Field(-1, ge=-1)
    """lokr only: w1's size along each dimension (LyCORIS's factor; peft's decompose_factor); -1 splits
    each dimension into its two most balanced factors."""
    init_from: Path | None = None
    """Start from this LoRA instead of a fresh one: a LoRA zerotrain exported, or one in the diffusers,
    kohya or ComfyUI key formats (.safetensors). Its rank, alpha and targets are used; setting
    different ones here is an error."""
    export_rank: int = Field(64, ge=1, le=4096)
    """lokr and loha: where the family's diffusers loader cannot read the adapter (LoHa everywhere,
    LoKr but for Z-Image and FLUX.2), the export writes a LoRA of this rank converted from it (peft's
    convert_to_lora, an SVD of each layer's delta; at most the narrowest layer's side) and records
    how close it is."""

    @model_validator(mode="after")
    def _type_options(self) -> LoraConfig:
        if self.use_dora and self.type != "lora":
            raise ValueError(f"use_dora applies to type lora, not {self.type}; remove it or set type: lora")
        if self.factor != -1 and self.type != "lokr":
            raise ValueError(f"factor applies to type lokr, not {self.type}; remove it or set type: lokr")
        if self.factor == 0:
            raise ValueError("factor must be -1 (balanced) or a positive size")
        return self


class TrainingConfig(_Section):
    mode: Mode = Mode.full
    """full: every denoiser weight trains. lora: only LoRA adapters train; the base is frozen."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA settings, used when mode is lora."""
    quantize_base: Quantization = Quantization.none
    """Quantize the frozen base with optimum-quanto (LoRA only): qint8, qfloat8 or qint4."""
    global_batch_size: int = Field(8, ge=1)
    """Images per optimizer step across all GPUs: micro-batch x accumulation x world size."""
    micro_batch_size: int | Literal["auto"] = "auto"
    """Images per GPU per forward pass; auto lets the planner choose."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward; auto lets the planner choose none, some blocks or all."""
    checkpoint_blocks: int | None = Field(None, ge=1)
    """Checkpoint exactly this many blocks, those that free the most activation memory per
    recomputed FLOP (partial checkpointing); unset: as gradient_checkpointing says."""
    compile: bool | Literal["auto"] = "auto"
    """Regional compilation: torch.compile of each repeated transformer block (diffusers'
    compile_repeated_blocks), at ZeRO 0-2 (ZeRO-3's parameter hooks split a compiled block into
    pieces). Not yet verified on GPUs: on the first GPU run compiled blocks crashed at the first change
    of batch shape, so auto runs them eagerly everywhere until a bucketed GPU run survives three
    shapes; true compiles (on a GPU, the CPU or over a quantized base), with a warning that it is
    unverified; true at ZeRO-3 is an error."""
    activation_offload: bool | Literal["auto"] = "auto"
    """With every block checkpointed, keep the checkpointed blocks' inputs in pinned host memory
    until backward (activation offload: host RAM and PCIe time for GPU memory); auto lets the planner
    choose it where planner.offload allows cpu. true needs gradient checkpointing of every block."""
    seed: int = 0
    """Seed for the sampling order, crops, noise and initialisation."""
    max_steps: int = Field(1000, ge=1)
    """Optimizer steps to train for."""
    checkpoint_every: int = Field(500, ge=1)
    """Write a checkpoint every this many optimizer steps (and at the end)."""
    keep_checkpoints: int = Field(3, ge=1)
    """How many of the newest checkpoints to keep."""
    resume: Literal["auto", "none"] | Path = "auto"
    """auto: continue from the run folder's latest checkpoint if there is one; none: start fresh;
    or the path of a checkpoint (or of a run folder) to continue from."""

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or auto")
        return value

    @model_validator(mode="after")
    def _lora_options_need_lora(self) -> TrainingConfig:
        # Compared with the defaults, not with "was it set", so that a dumped config loads back.
        if self.mode is Mode.full and self.lora != LoraConfig():
            raise ValueError("lora options are set but mode=full trains every weight; set mode: lora, "
                             "or remove the lora section")
        return self

    @model_validator(mode="after")
    def _quantize_needs_lora(self) -> TrainingConfig:
        if self.quantize_base is not Quantization.none and self.mode is not Mode.lora:
            raise ValueError(
                f"quantize_base={self.quantize_base.value} needs mode=lora: a quantized base is frozen, "
                "so only LoRA adapters can train over it"
            )
        return self


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BRACES = re.compile(r"\{[^{}]*\}")


def is_remote(location: str) -> bool:
    """A URL (s3://, gs://, https://, hf://), read through fsspec, rather than a local path."""
    return bool(_URL.match(location))


def has_pattern(location: str) -> bool:
    """A WebDataset brace pattern (shards-{0000..0099}.tar)."""
    return bool(_BRACES.search(location))


class DatasetConfig(_Section):
    path: Path | str | list[str]
    """Where the images are (format tells how they are laid out): a folder of images (searched recursively;
    captions in sidecar files of the same stem); a JSONL manifest of {"image": path, "caption": text} lines; a
    Hugging Face dataset (a save_to_disk folder, a folder of parquet shards, or a hub dataset as
    hf://datasets/owner/name[@revision], through the Hugging Face cache); WebDataset tar shards
    (shards-{0000..0099}.tar, or a list of shards); a CSV, TSV or parquet manifest of image paths or URLs with captions. Shards,
    tables and manifests may be remote: s3://, gs://, https:// (fsspec, credentials from the environment).
    Relative paths are from the working directory; paths in a manifest are relative to the manifest."""
    format: Literal["auto", "folder", "jsonl", "table", "webdataset"] = "auto"
    """How the path is laid out. auto: from its form (a folder with state.json or parquet files: table; .tar:
    webdataset; .csv, .tsv, .parquet, .arrow, hf://datasets/: table; .jsonl: jsonl; another folder: folder).
    table: a Hugging Face dataset or a CSV/TSV/parquet manifest, a row per image."""
    image_column: str | None = None
    """Tables: the column that holds each image (its bytes, as a datasets Image feature or binary, or a path or
    URL); the first of image, jpg, png, webp, file_name, path, url when not given."""
    caption_column: str | None = None
    """Tables: the caption column (a text or a list of texts); WebDataset: the caption field of key.json. The
    first of text, caption, prompt when not given (key.txt first for WebDataset)."""
    mask_column: str | None = None
    """Tables: a column of loss masks (bytes, path or URL), for data.mask: file. WebDataset reads key.mask.png."""
    split: str = "train"
    """Hugging Face datasets with several splits: the files whose names say this split (train-00000-of-00004.parquet,
    data/train/...); every file where no name says one."""
    timeout_seconds: float = Field(60.0, gt=0.0)
    """Remote sources: how long one read (a shard's bytes, a URL's image) may take before it is a verdict."""
    repeats: int = Field(1, ge=1, le=10_000)
    """How many times each image of this dataset counts per epoch."""
    folder_repeats: bool = True
    """kohya's repeat folders: an image under a first-level folder of the dataset named <N>_<name>
    (10_ohwx person) counts N times per epoch (times repeats), as kohya reads it; a 0_ folder is left
    out. The cache's summary lists them. false: they are plain folders."""
    caption_extension: str = ".txt"
    """Extension of sidecar caption files (folders only)."""
    caption_prefix: str = ""
    """Put before every caption of this dataset, e.g. a trigger word: "ohwx person, "."""
    caption_per_line: bool = False
    """Each non-empty line of a caption file is a caption of its own, and each sample draws one of
    them (a manifest's "caption" may be a list of captions either way)."""
    shuffle_tags: int = Field(0, ge=0, le=64)
    """K > 0: each caption's comma-separated tags are shuffled into K orders (the first keep_tags
    stay in place), each order encoded and cached, and each sample draws one (kohya's
    shuffle_caption). The cache holds K text embeddings per caption. 0: captions as written."""
    keep_tags: int = Field(0, ge=0)
    """With shuffle_tags: how many leading tags keep their place (kohya's keep_tokens)."""
    caption_dropout: float | None = Field(None, ge=0.0, lt=1.0)
    """This dataset's share of samples trained with the empty caption; data.caption_dropout when not
    given."""
    share: float | None = Field(None, gt=0.0, le=1.0)
    """This dataset's share of each epoch's samples, whatever its size (a DreamBooth regularisation
    set at 0.5, say), instead of repeats: its images repeat, or a seeded subset of them is left
    out, to make up the share. The datasets without a share fill the rest by their repeats."""
    loss_weight: float = Field(1.0, gt=0.0)
    """Weight of this dataset's samples in the loss (prior preservation's weight, for example)."""
    controls: list[Path] = Field(default_factory=list, max_length=16)
    """Edit training (a folder dataset): folders of control (reference) images, one per reference, each
    matched to a target image by file stem (src/cat.png for cat.jpg, any image extension). The caption
    is the edit instruction. A manifest names its controls per line instead ("control": a path or a
    list, or musubi-tuner's "control_path_0".."control_path_N")."""

    @field_validator("path", mode="before")
    @classmethod
    def _exists(cls, value: Any) -> Path | str | list[str]:
        """URLs and brace patterns stay text (their files are checked when the data is read); a local path
        must exist. A list (of shards or tables) is checked item by item and stays a list of text."""
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("an empty list names no shards or tables")
            return [str(cls._exists(item)) for item in value]
        text = str(value)
        if is_remote(text) or has_pattern(text):
            return text
        path = Path(text)
        if not path.exists():
            hub = (f"; a hub dataset is written hf://datasets/{text}"
                   if re.fullmatch(r"[\w.-]+/[\w.-]+", text) else "")
            raise ValueError(f"{value} does not exist (relative paths are from the working directory{hub})")
        return path

    @field_validator("controls")
    @classmethod
    def _folders(cls, value: list[Path]) -> list[Path]:
        for folder in value:
            if not folder.is_dir():
                raise ValueError(f"control folder {folder} does not exist or is not a folder (relative paths are "
                                 "from the working directory)")
        return value


class DataConfig(_Section):
    resolution: int = Field(1024, ge=64, le=8192)
    """Target training resolution R in pixels; buckets have about R x R pixels."""
    text_tokens: int | None = Field(None, ge=1)
    """Text sequence length fed to the denoiser; the family's default when not given
    (512 for the DiT families, SD3 77 CLIP + 256 T5, SDXL/SD1.5 77). Families with variable-length
    text (Qwen-Image, Z-Image, Chroma, Krea 2, Ideogram 4, FLUX.3 [klein]) cache up to this many tokens
    and train on each batch's longest caption; Ideogram 4 and FLUX.3 [klein] stop on a longer caption
    (their pipelines would not cut it). Where the text encoder reads an edit's reference images
    (Qwen-Image-Edit, Qwen-Image 2.1), this counts the caption's rows; the images' rows come on top."""
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Image folders or manifests to train on, each with its repeat count."""
    bucket_step: int = Field(64, ge=8, le=512)
    """Bucket sides are multiples of this many pixels (raised to the model's pixel factor)."""
    max_aspect_ratio: float = Field(2.0, ge=1.0, le=8.0)
    """Widest (or tallest) bucket, as long side / short side."""
    crop: Literal["center", "random"] = "center"
    """Where to crop an image that was resized to cover its bucket."""
    upscale: Literal["allow", "skip"] = "allow"
    """Images smaller than their bucket: upscale them, or skip them (reported)."""
    min_image_size: int = Field(64, ge=1)
    """Images whose shorter side is below this many pixels are rejected as too small."""
    max_image_pixels: int = Field(178_956_970, ge=1, le=178_956_970)
    """Images with more pixels are rejected as possible decompression bombs (at most Pillow's own
    hard limit, twice Image.MAX_IMAGE_PIXELS; a 12000 x 8000 photo is 96 million)."""
    background: tuple[int, int, int] = (255, 255, 255)
    """RGB colour that transparent pixels are composited onto."""
    bad_files: Literal["skip", "strict"] = "skip"
    """skip: drop unreadable or unusable files and report them; strict: stop at the first one."""
    max_rejected_fraction: float = Field(0.10, ge=0.0, le=1.0)
    """Abort when more than this fraction of the images is rejected."""
    missing_caption: Literal["empty", "filename", "skip"] = "empty"
    """An image without a caption trains with an empty caption, its file name, or is skipped."""
    caption_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of samples trained with the empty caption (its embedding is cached once), so that the
    model keeps the unconditional branch classifier-free guidance uses; SimpleTuner's default is
    0.05. Drawn per sample from the seed and the epoch, so a resume draws the same."""
    flip: bool = False
    """Also cache horizontally flipped latents and use them for half of the samples (a sample's
    references flip with it; refused for edits of a model whose text encoder reads the references:
    Qwen-Image 2.1)."""
    control_resolution: int | None = Field(None, ge=64, le=4096)
    """Edit training: encode each reference at about this many pixels squared, at its own aspect; the
    family pipeline's size when not given (Kontext: the target's size; FLUX.2: the control's own,
    at most 1024 x 1024 pixels; Qwen-Image 2.1: the target's area)."""
    references: int | None = Field(None, ge=0, le=16)
    """Edit training: reference images per sample, for `zerotrain plan` before any data is read
    (--references on the command line). The planner plans for the datasets' controls where they are
    more; unset, for at least the one an edit pipeline always takes (FLUX.1 Kontext, Qwen-Image-Edit;
    0 plans such a model for text to image)."""
    mask: Literal["file", "alpha", "none"] = "file"
    """Masked loss. file: an image with a mask beside it (photo.mask.png for photo.jpg, or a manifest
    line's "mask") weights its loss per latent pixel by the mask's gray level (white 1, black 0);
    images without one train unmasked. alpha: each image's alpha channel is its mask (an opaque image
    trains unmasked). none: masks are ignored. The mask is cropped and flipped with its image,
    averaged onto the latent grid and cached with the latents."""
    unmasked_weight: float = Field(0.0, ge=0.0, lt=1.0)
    """The loss weight where a mask is black (OneTrainer's unmasked weight): a pixel weighs
    unmasked_weight + (1 - unmasked_weight) x mask. 0 gives masked-out pixels no gradient at all."""
    cache_dir: Path = Path("cache")
    """Where latents and text embeddings are cached (safetensors shards with an index)."""
    num_workers: int = Field(2, ge=0, le=64)
    """DataLoader worker processes per rank."""
    index_check: Literal["files", "folders"] = "files"
    """How a start tells whether a folder dataset (or the local files a manifest names) changed since the dataset
    index was built. files: every file's size and mtime, which sees a file rewritten in place (a stat per file: a
    resumed start over a million images and their captions took 8.9 s on a 2-core VM's disk, more on NFS).
    folders: each folder's mtime and listing (2.2 s); it sees files added, removed or renamed (how most tools
    replace a file), not one rewritten in place under its name: touch its folder, or use files. Switching reads
    every caption again. Shards and tables are checked by their own size and mtime (or ETag) either way."""

    @model_validator(mode="after")
    def _shares(self) -> DataConfig:
        shares = [d.share for d in self.datasets if d.share is not None]
        total = sum(shares)
        if shares and len(shares) == len(self.datasets) and abs(total - 1.0) > 1e-6:
            raise ValueError(f"data.datasets: every dataset sets a share, and they add up to {total:g}, not 1")
        if shares and len(shares) < len(self.datasets) and total >= 1.0:
            raise ValueError(f"data.datasets: the shares add up to {total:g}, leaving nothing for the datasets "
                             "without one; lower them below 1 in all")
        return self

    @field_validator("background")
    @classmethod
    def _rgb(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(not 0 <= c <= 255 for c in value):
            raise ValueError("each channel must be 0-255")
        return value


class ObjectiveConfig(_Section):
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = "logit_normal"
    """Flow matching: how training timesteps are drawn (SD3 paper, section 3.1)."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep distribution."""
    logit_std: Literal["auto"] | Annotated[float, Field(gt=0)] = "auto"
    """Standard deviation of the logit-normal timestep distribution: auto uses the family training
    script's (1.5 for Ideogram 4, 1.0 for the others)."""
    mode_scale: float = Field(1.29, ge=0)
    """Scale of the mode timestep distribution."""
    shift: Literal["auto"] | float = "auto"
    """Flow matching timestep shift: auto uses the scheduler's (resolution-dependent for Flux,
    Chroma, FLUX.2 and Qwen-Image, 3.0 for SD3, 6.0 for Z-Image); a number fixes it."""
    guidance: float = Field(1.0, ge=0)
    """Guidance value fed to a guidance-distilled model (flux-dev, FLUX.2 [dev]) during training."""
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = "auto"
    """DDPM models (SDXL): auto uses the scheduler's prediction type."""
    min_snr_gamma: float | None = Field(None, gt=0)
    """DDPM models: min-SNR loss weighting with this gamma (5.0 is the paper's); off when unset."""


class OptimizerConfig(_Section):
    name: Literal[(*OPTIMIZERS, "auto")] = "adamw"  # type: ignore[valid-type]
    """adamw: DeepSpeed's AdamW with fp32 master weights and moments (16 bytes per trainable
    parameter with the bf16 weights and gradients). The others keep DeepSpeed's bf16 master weights
    and gradients (bf16.bf16_master_weights_and_grads, bf16_optimizer_states; ZeRO 1-3 only) with
    no stochastic rounding, so an update below a weight's bf16 resolution (about 1/256 of it) is
    lost:
    - adamw-bf16: DeepSpeed's AdamW with bf16 moments (10 bytes);
    - adamw-8bit: bitsandbytes' AdamW8bit, blockwise 8-bit moments (about 8 bytes; optimizer on the
      GPU only);
    - adafactor: transformers' Adafactor without first moment, its second moment fp32 and
      unfactored, since DeepSpeed hands it flat partitions (10 bytes; optimizer on the GPU only;
      optimizer.lr is its fixed learning rate, betas and eps do not apply).
    adamw-8bit and adafactor checkpoints resume on the same number of GPUs only. auto: the planner
    chooses among planner.optimizers (the first listed wins a tie). DeepSpeed's CPU Adam steps an
    offloaded optimizer."""
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup: constant keeps the peak; linear and cosine decay from the
    peak towards 0 over the remaining steps without reaching it (linear's last step uses lr /
    (max_steps - warmup_steps)). A step skipped for a non-finite loss or gradient does not advance
    the schedule."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup over this many optimizer steps: step k (counted from 1) uses lr x k /
    warmup_steps, so the first step trains at lr / warmup_steps and step warmup_steps at the peak."""
    torch_adam: bool = False
    """adamw and adamw-bf16 step with torch's fused AdamW (DeepSpeed's own switch, "torch_adam": true
    with "fused": true in the optimizer's params) instead of DeepSpeed's FusedAdam, whose CUDA op nvcc
    compiles once per machine (about a minute; `zerotrain build-ops` does it ahead). The update is
    AdamW's either way. For a GPU node with no time for the build, and to tell the two apart when
    hunting a crash (benchmarks/gpu_check.py runs both). With an offloaded optimizer, torch's AdamW
    also steps on the CPU in place of DeepSpeed's CPU Adam (slower). Keep it for a run's lifetime: a
    resume across a change of it is not checked."""

    @model_validator(mode="after")
    def _torch_adam_is_deepspeeds(self) -> OptimizerConfig:
        if self.torch_adam and self.name in CLIENT_OPTIMIZERS:
            raise ValueError(f"torch_adam replaces DeepSpeed's AdamW, and optimizer.name={self.name} is built by "
                             "zerotrain: set torch_adam: false, or optimizer.name: adamw")
        return self


class HardwareConfig(_Section):
    gpus: str = "auto"
    """auto (detect through NVML), a profile like 8xA100-80GB, 2xH100-80GB, 1xRTX4090-24GB, or a
    bare count like 4 together with gpu_memory."""
    nodes: int = Field(1, ge=1, le=4096)
    """Number of nodes, each with the GPUs above."""
    gpu_memory: str | None = None
    """Memory of one GPU (48GiB, 80GB); overrides the detected or profiled size."""
    host_memory: str | None = None
    """Host RAM per node for CPU offload; detected locally, or the profile's typical size."""
    nvme_path: Path | None = None
    """Folder on a local NVMe drive for NVMe offload; offload to NVMe is considered only when set."""
    nvme_space: str | None = None
    """Free space at nvme_path on the training nodes; measured at nvme_path when not given."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _count_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("gpu_memory", "host_memory", "nvme_space")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_bytes(value)
        return value


class PlannerConfig(_Section):
    headroom: float = Field(0.08, ge=0.0, lt=0.9)
    """Fraction of each GPU's memory the plan keeps free as a safety margin."""
    activation_margin: float = Field(0.43, ge=0.0, le=4.0)
    """Until `zerotrain calibrate` has measured it on this GPU profile in the plan's lane (family,
    mode, checkpointing, resolution band), a layout that keeps blocks uncheckpointed must also leave
    this share of their traced activations free: without checkpointing, published peaks of other
    trainers measured up to 1/0.70 of the traced estimate (docs/planning.md, "Honest margins until
    calibrated"). A calibration of the plan's lane replaces it with the measured value; 0 trusts
    the trace."""
    stages: list[Literal[0, 1, 2, 3]] = [0, 1, 2, 3]
    """ZeRO stages the search may choose from."""
    zeropp: list[Literal["none", "hpz", "hpz-qwz-qgz"]] = ["none", "hpz"]
    """ZeRO++ options the search may choose on several nodes (ZeRO-3 only): hpz keeps a secondary
    bf16 partition within each node so that backward gathers stay on the node
    (zero_hpz_partition_size; exact); hpz-qwz-qgz also all-gathers int8 weights and reduces int4
    gradients across nodes (zero_quantized_weights, zero_quantized_gradients; CUDA kernels only),
    which changes numerics, so it is chosen only when listed here."""
    optimizers: list[Literal[tuple(OPTIMIZERS)]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(OPTIMIZERS))
    """What optimizer.name auto may choose, in order of preference: the planner takes a later one
    only where no earlier one fits within 5% of the fastest candidate's speed (the others change
    numerics)."""
    offload: list[Literal["none", "cpu", "nvme"]] = ["none", "cpu", "nvme"]
    """Offload targets the search may choose from (nvme needs hardware.nvme_path)."""
    max_micro_batch: int = Field(32, ge=1)
    """Largest micro-batch the search tries."""
    assumed_mfu: float = Field(0.26, gt=0.0, le=1.0)
    """Model FLOPs utilisation assumed for the compute part of the step-time estimate. 0.26: the
    median of the step-time MFU of the layouts at ZeRO 0-2 without checkpointing on the first GPU
    (one H200, 2-block Flux-dev LoRA at 1024 px, eager: 19-31%, median 25.8%;
    benchmarks/results/h200-2026-11-28-flux-dev-2b-lora.calibration.json). calibrate fits it per
    family."""
    cuda_context_bytes: int = Field(600 * 2**20, ge=0)
    """Per-process CUDA context outside the allocator; 0.3-0.7 GB per process is typical;
    calibrate on the GPU."""
    nccl_workspace_bytes: int = Field(1098 * 2**20, ge=0)
    """NCCL communicator buffers plus the cuBLAS workspace per process: what the process group and
    the first steps added outside the allocator. 1098 MiB (1.07 GiB): the first GPU's measurement
    (one H200, one rank, torch 2.11.0+cu130;
    benchmarks/results/h200-2026-11-28-flux-dev-2b-lora.calibration.json). calibrate measures it."""
    loader_worker_bytes: int = Field(LOADER_WORKER_BYTES, ge=0)
    """Host RAM of one DataLoader worker (data.num_workers per rank): the pages of the rank's Python heap it
    copies after the fork, its allocator's arenas and prefetched batches; not the model's weights, which it
    never touches. Measured by benchmarks/loader_workers_ram.py (benchmarks/results/loader_workers_ram.json)."""
    dataset_entry_bytes: int = Field(DATASET_ENTRY_BYTES, ge=0)
    """Host RAM per dataset entry of each rank process: the dataset index's rows (data.index), the epoch's samples
    and the sampler's arrays. The DataLoader workers map the rank's index file rather than copy it, so they add
    none. Counted for the entries of the index at data.cache_dir (none before the first build). Measured by
    benchmarks/dataset_index.py (benchmarks/results/dataset_index.json)."""
    fragmentation: float = Field(0.10, ge=0.0, le=1.0)
    """Allocator overhead as a fraction of allocated bytes (reserved/allocated - 1): 10-50% with
    changing shapes, low with expandable_segments."""
    pinned_exact_above_mib: int | None = Field(64, ge=0)
    """Pinned host buffers above this many MiB are pinned at their exact size: training sets torch's
    PYTORCH_CUDA_ALLOC_CONF pinned_max_round_threshold_mb to it (torch >= 2.13). Smaller ones round
    up to a power of two, as torch's caching host allocator does for every pinned buffer by
    default (null: plan for that default, and leave the allocator setting alone)."""
    reduce_bucket_size: int = Field(200_000_000, ge=1)
    """DeepSpeed reduce_bucket_size in elements (ZeRO 1-3; without ZeRO the engine's own 5e8-element
    buckets); written into the config."""
    allgather_bucket_size: int = Field(200_000_000, ge=1)
    """DeepSpeed allgather_bucket_size in elements (ZeRO 1/2); written into the config. DeepSpeed 0.19
    gathers the updated partitions into the flat parameters in place (all_gather_into_tensor) and
    reads it only where that collective is missing, so the planner counts no bucket for it."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward (ZeRO 1/2: doubles the reduce bucket)."""
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    """ZeRO-3 parameter prefetch, in elements; written into the config."""
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=1)
    """ZeRO-3 cap on prefetching, in elements; written into the config as stage3_max_live_parameters
    and stage3_max_reuse_distance, so parameters reused within this many elements stay gathered."""
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    """ZeRO-3 keeps parameters smaller than this (elements) gathered on every GPU."""
    stage3_fetch_latency: float = Field(2.26e-3, ge=0.0)
    """Seconds ZeRO-3 adds per call of each module whose parameters it gathers and releases
    (ModelFacts.fetched_modules), in forward, backward and recomputation: DeepSpeed's hooks, the
    wait for the gather (a stream synchronization on one GPU) and the release, whose fixed cost
    dominates where a module computes little (LoRA, few tokens, small blocks). 2.26e-3: the
    ZeRO-3 layout's forward and backward on the first GPU less the same layout's at ZeRO-0, over
    its fetches ((0.1743 - 0.0207) s / (34 modules x 2 passes); one H200, 2-block Flux-dev LoRA at
    1024 px, benchmarks/results/h200-2026-11-28-flux-dev-2b-lora.calibration.json). calibrate fits
    it from its ZeRO-3 layouts."""
    sub_group_size: int = Field(1_000_000_000, ge=1)
    """ZeRO-3 optimizer sub-group, in elements: bounds the fp32 gradient copy at the step."""
    cpu_adam_params_per_second: float = Field(2.0e9, gt=0)
    """Parameters DeepSpeedCPUAdam updates per second per node, shared by the node's ranks. An
    order-of-magnitude figure for a modern 2-socket server (DeepSpeedCPUAdam is 5-7x as fast as
    torch's Adam on the CPU); calibrate on your nodes."""
    nvme_bandwidth: float = Field(3.0e9, gt=0)
    """Bytes/s one node reads or writes its NVMe offload folder (a PCIe 4 NVMe drive)."""
    cache_dir: Path | None = None
    """Where measured model facts are cached; ~/.cache/zerotrain/facts when not given."""
    host_offload_factor: float = Field(1.0, gt=0.0, le=4.0)
    """Measured over predicted host RAM of the offload buffers (zerotrain calibrate fits it on a GPU
    node; 1.0 trusts the buffer model)."""
    calibration: Path | None = None
    """calibration.json written by `zerotrain calibrate`: its fitted constants replace the defaults
    of the fields above that the config does not set. Those of the GPU and its host (CUDA context,
    NCCL, CPU Adam, host offload, ZeRO-3 fetch latency, host-to-device bandwidth) apply to every plan;
    activation_margin, fragmentation and assumed_mfu only to a plan of the lane it measured (the
    same family, mode, checkpointing and resolution band). When not given, the calibration of the
    planned GPU profile in ~/.cache/zerotrain/calibration/ is used if there is one."""


class ValidationConfig(_Section):
    prompts: list[str] = []
    """Prompts rendered with the model being trained; none: no validation images."""
    seeds: list[int] = [0]
    """Each prompt is rendered once per seed (the initial noise's seed)."""
    every: int | None = Field(None, ge=1)
    """Render every this many optimizer steps; none: only at the start and the end."""
    at_start: bool = True
    """Render before the first step (of a fresh run, not after a resume)."""
    at_end: bool = True
    """Render after the last step."""
    resolution: int | None = Field(None, ge=64, le=4096)
    """Square image side in pixels; data.resolution when not given."""
    steps: int = Field(28, ge=1, le=1000)
    """Denoising steps per image."""
    guidance_scale: float | None = Field(None, ge=0.0)
    """Guidance: distilled guidance for Flux and FLUX.2 [dev], classifier-free guidance for the
    others; the family pipeline's usual value when not given (Flux 3.5, FLUX.2 4.0, SD3 7.0, SDXL 5.0,
    Chroma 5.0, Z-Image 5.0 (use 0 for Z-Image-Turbo), Qwen-Image 4.0 as true_cfg_scale)."""
    negative_prompt: str = ""
    """Negative prompt for classifier-free guidance (every family but Flux and FLUX.2 [dev])."""
    use_ema: bool = False
    """Render with the EMA weights (needs ema.enabled)."""
    controls: list[list[Path]] = []
    """Edit models: each prompt's reference images (a list per prompt, in prompt order), sized as
    training sizes them and given to the family's edit pipeline."""

    @model_validator(mode="after")
    def _controls(self) -> ValidationConfig:
        if self.controls and len(self.controls) != len(self.prompts):
            raise ValueError(f"validation.controls: {len(self.controls)} lists for {len(self.prompts)} prompts; "
                             "give one list of control images per prompt")
        for i, images in enumerate(self.controls):
            for image in images:
                if not image.is_file():
                    raise ValueError(f"validation.controls[{i}]: {image} does not exist (relative paths are from "
                                     "the working directory)")
        return self


class EmaConfig(_Section):
    enabled: bool = False
    """Keep an exponential moving average of the trainable weights (on the host, sharded like
    the optimizer state, saved with each checkpoint)."""
    decay: float = Field(0.999, gt=0.0, lt=1.0)
    """Weight of the old average at each optimizer step."""
    start_step: int = Field(0, ge=0)
    """Until this step the average is a copy of the weights."""
    export: bool = False
    """Export the EMA weights (instead of the trained weights) at the end of training."""


class KillPoint(_Section):
    step: int = Field(ge=1)
    """The step whose checkpoint write is killed."""
    point: Literal["before_model", "optimizer", "before_latest"]
    """before_model: before DeepSpeed writes any file; optimizer: half-way through writing the
    first optimizer-state file (the file is left truncated); before_latest: after every file is
    written, just before `latest` moves."""


class FaultsConfig(_Section):
    grace_seconds: float = Field(120.0, gt=0)
    """After SIGTERM or SIGUSR1, how long zerotrain may take to finish the step in progress, write a
    checkpoint and exit."""
    max_bad_steps: int = Field(3, ge=1)
    """Consecutive steps with a NaN or inf loss or gradient norm after which the run stops (with a
    checkpoint); fewer are skipped and counted."""
    oom_recovery_steps: int = Field(10, ge=0)
    """An out-of-memory error in the forward or backward of the first this many steps of a run (or
    of a resume) is recovered: every rank drops the step (no update, nothing counted), and the step
    runs again with more blocks checkpointed, then with activation offload where host RAM allows
    (where training.gradient_checkpointing and activation_offload leave it to the planner). The
    adjusted layout goes to plan.json, and a resume keeps it. 0: stop with the one-line error."""
    max_oom_retries: int = Field(3, ge=1)
    """Out-of-memory recoveries a run makes at most; the next one stops it with one line (the last
    checkpoint is kept)."""
    collective_timeout_seconds: float = Field(1800.0, gt=0)
    """How long a phase of the training loop (a step's data, forward, backward, optimizer step,
    agreement; a checkpoint; validation) may last before its rank stops with one line saying where
    every rank is: a collective that a live rank never joins, on any group, DeepSpeed's included,
    on any backend. Every process group's own timeout is 60 s longer (the backstop; NCCL's
    watchdog abort). It must exceed the longest phase (a checkpoint write, validation); waits for
    one rank's long work (a download, the cache build, a universal conversion) are not limited. A
    rank whose process dies is noticed sooner, by heartbeats (lost_rank_seconds)."""
    lost_rank_seconds: float = Field(30.0, gt=0)
    """A rank whose heartbeat (a counter every rank's background thread advances each second in the
    rendezvous store) has not moved for this long is lost: every other rank names it and stops,
    also when it is blocked in a collective that would otherwise wait for the timeout. Also how
    long a rank that ran out of memory waits for the others to run out in the same step (then
    every rank drops it) before it stops them all."""


class FaultInjection(_Section):
    """Faults zerotrain's own tests make (the `testing:` section, left out of the configuration reference)."""

    nan_at: list[int] = []
    """Optimizer steps whose loss is made NaN on rank 0 (exercises the bad-step path)."""
    save_failure_at: list[int] = []
    """Steps whose checkpoint fails to write on rank 0, as with a full disk."""
    oom_at: list[int] = []
    """Optimizer steps whose last micro-batch raises torch.OutOfMemoryError, once each, as CUDA does when an
    allocation fails (after the earlier micro-batches' backward; trainer.InjectedOom): exercises the
    recovery, the one-rank stop and the out-of-memory line."""
    oom_rank: int | None = Field(None, ge=0)
    """The one rank that runs out of memory at oom_at (fragmentation, another process on its GPU); every
    rank when unset."""
    oom_phase: Literal["forward", "backward", "optimizer step"] = "forward"
    """Where in the step it does: half-way through the forward or the backward, or in the optimizer's step."""
    kill: KillPoint | None = None
    """SIGKILL every rank at a point of one checkpoint write, e.g. `{step: 4, point: optimizer}` (points:
    before_model, optimizer, before_latest)."""


class WandbConfig(_Section):
    project: str
    """The W&B project to log to."""
    entity: str | None = None
    """The W&B team or user; your default entity when not given."""
    name: str | None = None
    """The run's display name; the output folder's name when not given."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class LoggingConfig(_Section):
    every: int = Field(1, ge=1)
    """Print a progress line, and write metrics, every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to <output_dir>/tensorboard."""
    progress_bar: Literal["auto", "always", "never"] = "auto"
    """A rich progress bar on rank 0: auto shows it when stdout is a terminal, plain lines otherwise."""
    memory_check_step: int = Field(3, ge=1)
    """After this step, one line compares the planner's predicted peak memory with the measured one."""
    wandb: WandbConfig | None = None
    """Also log to Weights & Biases, from rank 0: the same scalars as TensorBoard, the validation
    images, the plan's summary and the resolved config; a resumed run continues the same W&B run
    (its id is kept in <output_dir>/wandb_id). Needs the optional extra: pip install
    'zerotrain[wandb]'. WANDB_MODE=offline logs to <output_dir>/wandb without a network."""
    verbose: bool = False
    """Show all library output: the known-harmless warnings, DeepSpeed's info lines, library progress
    bars and the other ranks' library info that a run hides by default (zerotrain/quiet.py lists
    them). train.py's --debug does the same."""


class RunConfig(_Section):
    """The whole run: one object, validated once, that drives plan, cache and train."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The denoiser to train."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Training mode and batch."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Resolution and conditioning lengths."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and clipping."""
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    """GPUs and nodes to plan for."""
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    """Search space and calibration constants of the memory planner."""
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """Training objective: flow matching (every DiT family) or DDPM (SDXL)."""
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    """Validation images rendered during training."""
    ema: EmaConfig = Field(default_factory=EmaConfig)
    """Exponential moving average of the trainable weights."""
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    """Preemption signals and bad steps."""
    testing: FaultInjection = Field(default_factory=FaultInjection, json_schema_extra={"reference": False})
    """Faults zerotrain's tests inject (NaN steps, failed and killed checkpoint writes, out-of-memory errors): no
    setting of a run, and left out of docs/configuration.md."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Progress, metrics and TensorBoard."""
    deepspeed: Literal["auto"] | Path | dict = "auto"
    """auto: the planner chooses and writes the DeepSpeed config. A path to a DeepSpeed JSON, or an
    inline mapping, is used as given (after a warning if the planner predicts it will not fit)."""
    output_dir: Path = Path("runs/zerotrain")
    """Run folder: resolved config, plan, DeepSpeed JSON, checkpoints, metrics, exported weights."""

    @model_validator(mode="after")
    def _ema_for_validation(self) -> RunConfig:
        if self.validation.use_ema and not self.ema.enabled:
            raise ValueError("validation.use_ema needs ema.enabled: true")
        if self.ema.export and not self.ema.enabled:
            raise ValueError("ema.export needs ema.enabled: true")
        return self

    @model_validator(mode="after")
    def _batch_fits_world(self) -> RunConfig:
        if isinstance(self.training.micro_batch_size, int) and self.training.micro_batch_size > self.training.global_batch_size:
            raise ValueError(
                f"training.micro_batch_size={self.training.micro_batch_size} exceeds "
                f"training.global_batch_size={self.training.global_batch_size}"
            )
        return self
