"""zerotrain/quiet.py: the library output a run hides, sent the way the libraries send it (a Python
warning from torch's module, records on transformers' and DeepSpeed's loggers, print() and tqdm),
next to output that must still come through; logging.verbose (or --debug) changes nothing; and
closing what quiet_libraries returns undoes it. The output of real runs is checked by
tests/distributed/quiet_output.py."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings

import pytest
from tqdm import tqdm

from zerotrain.config import load_config
from zerotrain.quiet import LineFilter, quiet_libraries

TORCH_MODULE = "torch.distributed.c10d_logger"
ALL_GATHER = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
              "`torch.distributed.all_gather_single` instead.")
REDUCE_SCATTER = ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                  "`torch.distributed.reduce_scatter_single` instead.")
TORCHVISION = ("`CLIPImageProcessor` requires torchvision (not installed); falling back to "
               "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to use the default "
               "backend, or import `CLIPImageProcessorPil` directly to silence this warning.")
NOISE_LINES = [
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "Processing zero checkpoint '/runs/x/checkpoints/step-00000003'",
    "Parsing checkpoint created by deepspeed==0.19.8",
    "Detected checkpoint of type zero stage ZeroStageEnum.weights, world_size: 2",
    "Reconstructed Trainable fp32 state dict with 66 params 78544 elements",
]
# What a quiet run hides, as emit_everything sends it (a warning as "Category message").
HIDDEN = [f"FutureWarning {ALL_GATHER}", f"FutureWarning {REDUCE_SCATTER}", TORCHVISION, "DeepSpeed info",
          "MPU is not provided", "Loading checkpoint shards", *NOISE_LINES]
KEPT_LINES = [
    "step 3/3  epoch 0  loss 1.40439 (avg 1.4368)  lr 1.00e-03  25.28 img/s  eta 0:00:00",
    "exported to /runs/x/export",
    "zerotrain: warning: ds.json is predicted not to fit",
    "Processing the data took 3 s",  # near a hidden line, but not it
]


class Emitted:
    """What reached the user of each kind, after quiet_libraries."""

    def __init__(self, warned: list[str], records: list[str], out: str, err: str):
        self.warned, self.records, self.out, self.err = warned, records, out, err

    def shown(self, text: str) -> bool:
        return any(text in item for item in (*self.warned, *self.records, self.out, self.err))


def emit_everything(capsys) -> Emitted:
    """Send the hidden output and its look-alikes the way the libraries do."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(f"{record.levelname} {record.getMessage()}")
    loggers = [logging.getLogger("transformers.utils.import_utils"), logging.getLogger("DeepSpeed")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # as older DeepSpeed releases set theirs
    try:
        with warnings.catch_warnings(record=True) as caught:
            for message in (ALL_GATHER, REDUCE_SCATTER, "`torch.distributed.new_collective` is deprecated"):
                warnings.warn_explicit(message, FutureWarning, "c10d_logger.py", 83, module=TORCH_MODULE)
            warnings.warn_explicit(ALL_GATHER, UserWarning, "other.py", 1, module="zerotrain.other")
        loggers[0].warning(TORCHVISION)
        loggers[0].warning("`Foo` requires protobuf")
        loggers[1].info("DeepSpeed info: version=0.19.8")
        loggers[1].warning("MPU is not provided, setting tp size to 1 in checkpoint loading.")
        loggers[1].warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were "
                           "unable to detect it.")
        for line in NOISE_LINES + KEPT_LINES:
            print(line)
        for _ in tqdm(range(3), desc="Loading checkpoint shards"):
            pass
        for _ in tqdm(range(3)):  # a bar without a label
            pass
        for _ in tqdm(range(3), desc="Downloading weights", file=sys.stdout):
            pass
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    out, err = capsys.readouterr()
    return Emitted([f"{w.category.__name__} {w.message}" for w in caught], records, out, err)


def test_a_quiet_run_hides_the_listed_output_and_nothing_else(capsys):
    with quiet_libraries(verbose=False, rank=0):
        emitted = emit_everything(capsys)
    assert [text for text in HIDDEN if emitted.shown(text)] == []
    assert "%|" not in emitted.err, emitted.err  # the unlabeled bar too
    kept = ["new_collective", f"UserWarning {ALL_GATHER}", "requires protobuf", "Setting accelerator to CPU",
            "Downloading weights", *KEPT_LINES]
    assert [text for text in kept if not emitted.shown(text)] == []
    assert emitted.out.splitlines()[:len(KEPT_LINES)] == KEPT_LINES  # whole lines, in order


@pytest.mark.parametrize("verbose", [True, False], ids=["verbose", "closed"])
def test_verbose_or_closed_shows_everything(capsys, verbose):
    stdout, filters = sys.stdout, warnings.filters[:]
    quieted = quiet_libraries(verbose=verbose, rank=0)
    if not verbose:
        quieted.close()
    with quieted:
        assert sys.stdout is stdout and warnings.filters == filters
        emitted = emit_everything(capsys)
    assert [text for text in HIDDEN + KEPT_LINES if not emitted.shown(text)] == []
    assert "  0%|" in emitted.err  # the unlabeled bar


def test_library_progress_bars_and_other_ranks_info():
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    libraries = (transformers_logging, diffusers_logging)
    levels = [library.get_verbosity() for library in libraries]
    bars = [library.is_progress_bar_enabled() for library in libraries]
    for library in libraries:
        library.set_verbosity_info()  # as TRANSFORMERS_VERBOSITY=info would
        library.enable_progress_bar()  # their default (conditioning.py turns them off for good)
    try:
        with quiet_libraries(verbose=False, rank=0):
            assert [(lib.is_progress_bar_enabled(), lib.get_verbosity()) for lib in libraries] == \
                [(False, logging.INFO)] * 2
        with quiet_libraries(verbose=False, rank=1):
            assert [(lib.is_progress_bar_enabled(), lib.get_verbosity()) for lib in libraries] == \
                [(False, logging.WARNING)] * 2
        assert [(lib.is_progress_bar_enabled(), lib.get_verbosity()) for lib in libraries] == \
            [(True, logging.INFO)] * 2
    finally:
        for library, level, bar in zip(libraries, levels, bars):
            library.set_verbosity(level)
            (library.enable_progress_bar if bar else library.disable_progress_bar)()


def test_line_filter_judges_whole_lines_as_they_are_written():
    out = io.StringIO()
    stream = LineFilter(out, re.compile(r"noise"))
    stream.write("kept ")
    stream.write("line\nnoise line\nanother")
    assert out.getvalue() == "kept line\n"  # "another" is not judged until it ends or is flushed
    stream.flush()
    stream.write(" half\n\rnoise 0%|")  # a bar: judged when flushed, its redraws follow the verdict
    stream.flush()
    stream.write("\rnoise 100%|\n")
    stream.writelines(["last\n"])
    assert out.getvalue() == "kept line\nanother half\nlast\n"
    assert stream.getvalue() == out.getvalue()  # anything else is the stream's own


def test_logging_verbose_is_a_config_field(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("logging: {verbose: true}\n")
    assert load_config(config, []).logging.verbose is True
    assert load_config(config, ["logging.verbose=false"]).logging.verbose is False
