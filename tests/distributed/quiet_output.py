"""What a training run may print (zerotrain/quiet.py): zerotrain's own lines and rank 0's
progress, none of the library output known to be harmless, and on the other ranks nothing but
warnings and errors. The distributed tests check it on the runs they make anyway (every family,
ZeRO stage, offload, LoRA, a quantized base, validation, export, a universal checkpoint), rather than
paying for runs of their own; tests/unit/test_quiet.py checks that logging.verbose brings it back."""

from __future__ import annotations

import re

# Library output a run used to print, by a piece of its text, as listed in zerotrain/quiet.py.
NOISE = (
    "requires torchvision",  # transformers without torchvision, on every rank
    "all_gather_into_tensor",  # torch's FutureWarning for DeepSpeed's collectives, on every rank
    "reduce_scatter_tensor",
    "Writing model shards",  # transformers' save_pretrained bar, as the tiny models are built
    "built successfully",  # DeepSpeed's shared-memory op, at init_distributed, on every rank
    "Processing zero checkpoint",  # zero_to_fp32, as rank 0 exports
    "Parsing checkpoint created by",
    "Loading checkpoint shards",
    "Gathering sharded weights",
    "Detected checkpoint of type",
    "fp32 state dict with",
    "Convert DeepSpeed Checkpoint to Universal",  # ds_to_universal, as rank 0 converts
    "Extracting ZeRO fragments",
    "Merging slices",
    "No AutoEP layers found",
    "MPU is not provided",  # DeepSpeed, loading a universal checkpoint, on every rank
    "[INFO]",  # DeepSpeed's info lines
)
# A warning or an error, in any library's format: the only lines the other ranks may print.
WARNING_OR_ERROR = re.compile(r"warn|error|exception|traceback", re.IGNORECASE)


def assert_quiet(result) -> None:
    """`result` (a conftest.TrainResult of a run that succeeded) printed zerotrain's lines and
    rank 0's progress, none of NOISE on any rank, and on the other ranks only warnings and errors."""
    logs = [log.read_text(errors="replace") for log in result.logs]
    noise = [f"rank {rank}: {line}" for rank, text in enumerate(logs) for line in text.splitlines()
             if any(piece in line for piece in NOISE)]
    assert not noise, "library noise in the run's output:\n" + "\n".join(noise[:20])
    chatter = [f"rank {rank}: {line}" for rank, text in enumerate(logs[1:], 1) for line in text.splitlines()
               if line.strip() and not WARNING_OR_ERROR.search(line)]
    assert not chatter, "other ranks printed more than warnings and errors:\n" + "\n".join(chatter[:20])
    assert re.search(r"^step \d+/\d+\b", logs[0], re.MULTILINE), result.tails()
    assert "exported to " in logs[0], result.tails()
