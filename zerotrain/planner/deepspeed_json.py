"""The DeepSpeed JSON for a chosen layout: concrete values only (DeepSpeed silently drops
"auto" in some paths), validated by DeepSpeed's own config class."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.planner.memory import Layout


def deepspeed_config(layout: Layout, run: RunConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed config dict for this layout. The batch numbers satisfy
    train_batch_size = micro x accumulation x world (checked by search.check_batch)."""
    p, opt = run.planner, run.optimizer
    train_batch = layout.micro_batch * layout.accumulation * world_size
    if train_batch != run.training.global_batch_size:
        raise ZerotrainError(
            f"internal: layout gives {train_batch} images per step, config asks "
            f"{run.training.global_batch_size}"
        )
    zero: dict[str, Any] = {
        "stage": layout.stage,
        "overlap_comm": p.overlap_comm,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": p.reduce_bucket_size,
    }
    if layout.stage in (1, 2):
        zero["allgather_bucket_size"] = p.allgather_bucket_size
    if layout.stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": p.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": p.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": p.stage3_max_live_parameters,
            "stage3_max_reuse_distance": p.stage3_max_live_parameters,
            "sub_group_size": p.sub_group_size,
            # Save a loadable 16-bit model, not size-0 tensors (kohya#1782).
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    nvme_path = str(run.hardware.nvme_path) if run.hardware.nvme_path else None
    if layout.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": layout.offload_optimizer, "pin_memory": True}
        if layout.offload_optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path
    if layout.offload_param != "none":
        zero["offload_param"] = {"device": layout.offload_param, "pin_memory": True}
        if layout.offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    config = {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.accumulation,
        "gradient_clipping": opt.grad_clip,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay},
        },
        "steps_per_print": 10**9,  # zerotrain prints its own progress
        "wall_clock_breakdown": False,
    }
    assert "auto" not in json.dumps(config), "DeepSpeed config must hold concrete values only"
    return config


def validate(config: dict[str, Any]) -> None:
    """Let DeepSpeed's own config class check the dict. Inside a process group it checks the
    real world size; offline it sees a world of 1, so the batch numbers are checked on a world-1
    copy (train_batch = micro x accumulation), and search.check_batch checks the real world."""
    # DeepSpeed's logger writes to the stdout it finds at import; bind it to stderr so that
    # `zerotrain plan --json` prints only JSON.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.config import DeepSpeedConfig

    import torch

    copy = json.loads(json.dumps(config))
    if not torch.distributed.is_initialized():  # offline DeepSpeed assumes a world of 1
        copy["train_batch_size"] = copy["train_micro_batch_size_per_gpu"] * copy["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(copy)
    except Exception as err:  # DeepSpeed raises assorted types for a bad config
        raise ZerotrainError(f"DeepSpeed rejects the generated config: {' '.join(str(err).split())}") from err


def write_config(config: dict[str, Any], path: Path, header: dict[str, Any] | None = None) -> None:
    """Write atomically; `header` fields (e.g. the command that produced it) go under
    "_zerotrain", which DeepSpeed ignores."""
    data = dict(config)
    if header:
        data = {"_zerotrain": header, **data}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
