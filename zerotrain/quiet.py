"""What a run prints: zerotrain's own lines and rank 0's progress, and from the libraries only what
someone has to act on. A failure hidden among a hundred library lines gets missed.

`quiet_libraries(verbose, rank)` is called first thing in train(), before DeepSpeed is imported.
It hides the library output listed below, each item by its exact text and origin (never whole
categories of warnings), and lets ranks other than 0 show only library warnings and errors.
With verbose (`logging.verbose: true`, or train.py's --debug) it changes nothing. Every entry
says what it hides and why that is harmless; a line that is not listed here passes.

It returns an ExitStack that undoes everything (train() keeps the process quiet until it exits;
tests close it)."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import warnings
from typing import TextIO

# Python warnings: (message regex, category, module regex), for warnings.filterwarnings.
HIDDEN_WARNINGS: list[tuple[str, type[Warning], str]] = [
    # torch (2.13) deprecates these names for *_single; DeepSpeed's ZeRO still calls them, and
    # they run the very same collective. A FutureWarning for DeepSpeed to act on, on every rank.
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger$"),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger$"),
    # diffusers 0.42's ChromaTransformer2DModel builds its rotary embedding through the deprecated
    # alias diffusers.models.embeddings.FluxPosEmbed, which returns the very class it names. For
    # diffusers to act on, on every rank, whenever a Chroma model is built.
    (r"`FluxPosEmbed` is deprecated and will be removed in version [\d.]+\. Importing and using `FluxPosEmbed` from `diffusers\.models\.embeddings`",
     FutureWarning, r"diffusers\.models\.embeddings$"),
    # diffusers 0.42's Krea2RMSNorm normalizes in float32 with its (1 + weight) scale, which the
    # model keeps in float32 (_keep_in_fp32_modules); DeepSpeed's bf16 engine casts every parameter
    # to bf16, so torch falls back from its fused kernel to the same arithmetic, on every rank and step.
    (r"Mismatch dtype between input and weight: input dtype = float, weight dtype = c10::BFloat16", UserWarning,
     r"torch\.nn\.functional$"),
    # diffusers 0.42's Ideogram4Pipeline.encode_prompt runs Qwen3-VL's decoder layers itself, passing
    # past_key_values=None, which transformers 5.24 deprecates (for `cache`); once per caption batch, for
    # diffusers to act on before transformers 5.40.
    (r"`past_key_values` is deprecated and will be removed in version [\d.]+ for `(create_causal_mask|Qwen3VLTextDecoderLayer\.forward)`",
     FutureWarning, r"(diffusers\.pipelines\.ideogram4\.pipeline_ideogram4|transformers\.modeling_layers)$"),
]

# Logging records: (logger name, message regex). A filter on the logger the record is made on.
HIDDEN_RECORDS: list[tuple[str, str]] = [
    # transformers 5 without torchvision, as diffusers' pipeline and IP-adapter modules import
    # CLIPImageProcessor and SiglipImageProcessor: it falls back to the PIL classes, which do the
    # same. zerotrain uses neither (no IP-adapter, no feature extractor), and the families'
    # pipelines load without them.
    ("transformers.utils.import_utils",
     r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil`"),
    # Loading a universal checkpoint (another world size or stage): zerotrain uses no tensor
    # parallelism, so a tensor-parallel size of 1 is what it has.
    ("DeepSpeed", r"MPU is not provided, setting tp size to 1 in checkpoint loading"),
    # bitsandbytes 0.50 on a CPU with AVX512-BF16, whenever it is imported (transformers imports it
    # when installed): its optional 4-bit matmul kernel from the `kernels` package is missing.
    # zerotrain uses only its 8-bit optimizer (adamw-8bit), never 4-bit matmuls.
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
]

# Lines that libraries print() or draw with tqdm, which no logger or warning filter reaches,
# matched at the start of a line (after tqdm's carriage returns) on stdout and stderr.
HIDDEN_LINES: list[str] = [
    # deepspeed.init_distributed on the CPU accelerator: its shared-memory collective op loaded.
    r"DeepSpeed deepspeed\.ops\.comm\.\w+ built successfully$",
    # zero_to_fp32, when export() merges the final ZeRO checkpoint on rank 0: its steps and bars.
    # zerotrain prints "exported to ..." when it is done, and a failure raises.
    r"Processing zero checkpoint '",
    r"Parsing checkpoint created by deepspeed==",
    r"Detected checkpoint of type zero stage ",
    r"(Loading checkpoint shards|Gathering sharded weights): +\d+%\|",
    r"Reconstructed (Trainable |Frozen )?fp32 state dict with \d+ params \d+ elements$",
    # A tqdm bar without a label (a bare "N%|...| i/n [time]" line): it says neither what it counts
    # nor on which rank.
    r" *\d+%\|[^|]*\| *\d+/\d+ \[",
]


class LineFilter:
    """A text stream that passes everything on to `stream` except whole lines that `hidden` matches.

    A line is judged when it ends, or when it is flushed before it ends (tqdm draws a bar, then
    redraws it after a carriage return, and writes the newline when it closes): the rest of that
    line then follows the same verdict, so a bar stays visible or hidden as a whole."""

    def __init__(self, stream: TextIO, hidden: re.Pattern[str]):
        self.stream, self.hidden = stream, hidden
        self._pending = ""  # the start of a line not judged yet
        self._verdict: bool | None = None  # whether the current line is hidden, once judged
        # rich's refresh thread and the main thread both write; reentrant, since a signal handler
        # (faults.py) may print while the main thread is inside write().
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            for piece in re.split(r"(?<=\n)", text):
                if piece:
                    self._write(piece, ended=piece.endswith("\n"))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._judge()
            self.stream.flush()

    def _write(self, piece: str, ended: bool) -> None:
        if self._verdict is None:
            self._pending += piece
            if not ended:
                return
            self._judge()
        elif not self._verdict:
            self.stream.write(piece)
        if ended:
            self._verdict = None

    def _judge(self) -> None:
        self._verdict = bool(self.hidden.match(self._pending.lstrip("\r")))
        if not self._verdict:
            self.stream.write(self._pending)
        self._pending = ""

    def __getattr__(self, name: str):  # isatty, fileno, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


class _AtLeast(logging.Filter):
    """Lets through the records of at least `level`."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


class _Matching(logging.Filter):
    """Drops the records whose message `pattern` matches."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextlib.contextmanager
def hidden_warnings():
    """Only the HIDDEN_WARNINGS filters, for a block outside train() (building a model to plan or
    export it prints the same library warnings); the filters are restored after it."""
    with warnings.catch_warnings():
        for message, category, module in HIDDEN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield


def quiet_libraries(verbose: bool, rank: int) -> contextlib.ExitStack:
    """Hide the library output listed in this module (see its docstring); nothing when verbose.
    Returns what undoes it."""
    undo = contextlib.ExitStack()
    if verbose:
        return undo
    saved_filters = warnings.filters[:]
    undo.callback(lambda: warnings.filters.__setitem__(slice(None), saved_filters))
    for message, category, module in HIDDEN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)

    logger_filters = [(name, _Matching(pattern)) for name, pattern in HIDDEN_RECORDS]
    # DeepSpeed's info lines (its config dump, the accelerator it chose; shown by default in older
    # releases) say what RUN/deepspeed.json and zerotrain's progress say, on every rank. A filter
    # (unlike a level, which DeepSpeed sets as it makes its logger) works from before the import.
    logger_filters.append(("DeepSpeed", _AtLeast(logging.WARNING)))
    for name, log_filter in logger_filters:
        logging.getLogger(name).addFilter(log_filter)
        undo.callback(logging.getLogger(name).removeFilter, log_filter)

    hidden = re.compile("|".join(f"(?:{line})" for line in HIDDEN_LINES))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # pythonw
            continue
        setattr(sys, name, LineFilter(stream, hidden))
        undo.callback(setattr, sys, name, stream)

    # transformers' and diffusers' tqdm bars ("Writing model shards" when the tiny models are built,
    # "Loading checkpoint shards" on every rank as a model loads) say nothing zerotrain's lines do not.
    # Their loggers have handlers of their own and print whatever their level lets through: on
    # ranks other than 0, warnings and errors only (their default, unless TRANSFORMERS_VERBOSITY or
    # DIFFUSERS_VERBOSITY asked for more).
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (transformers_logging, diffusers_logging):
        if library.is_progress_bar_enabled():
            library.disable_progress_bar()
            undo.callback(library.enable_progress_bar)
        if rank != 0 and library.get_verbosity() < logging.WARNING:
            undo.callback(library.set_verbosity, library.get_verbosity())
            library.set_verbosity_warning()
    return undo
