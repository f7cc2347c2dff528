"""The command-line flags of every command that plans (`zerotrain plan`, `zerotrain doctor`): --config,
--set and the shorthands for config fields, and the RunConfig they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.config.loader import load_config
from zerotrain.config.sections import RunConfig

# Flags that are shorthands for config fields: flag -> dotted field.
PLAN_FLAGS = {
    "model": "model.name_or_path",
    "denoiser": "model.denoiser",
    "resolution": "data.resolution",
    "references": "data.references",
    "control_resolution": "data.control_resolution",
    "gpus": "hardware.gpus",
    "nodes": "hardware.nodes",
    "gpu_memory": "hardware.gpu_memory",
    "host_memory": "hardware.host_memory",
    "nvme_path": "hardware.nvme_path",
    "mode": "training.mode",
    "lora_rank": "training.lora.rank",
    "quantize": "training.quantize_base",
    "global_batch": "training.global_batch_size",
    "micro_batch": "training.micro_batch_size",
}


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """--config, --set and the shorthand flags of `plan` (PLAN_FLAGS maps them to config fields),
    shared by every command that plans (plan, doctor)."""
    p.add_argument("--config", type=Path, help="run config (YAML, JSON or TOML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set training.lora.rank=32 (repeatable)")
    p.add_argument("--model", help="catalog name, diffusers config.json, model folder or hub id")
    p.add_argument("--denoiser", help="a fine-tuned denoiser over --model's pipeline: .safetensors file, diffusers "
                                      "folder or hub id (model.denoiser)")
    p.add_argument("--resolution", type=int, help="training resolution in pixels (default 1024)")
    p.add_argument("--references", type=int, metavar="N",
                   help="edit models: reference images per sample (default: the datasets' controls, else none)")
    p.add_argument("--control-resolution", type=int, metavar="PX",
                   help="edit models: encode references at about PX x PX pixels (default: the pipeline's size)")
    p.add_argument("--gpus", help="auto, a profile like 8xA100-80GB, or a count with --gpu-memory")
    p.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 48GiB")
    p.add_argument("--host-memory", help="host RAM per node, e.g. 512GiB")
    p.add_argument("--nvme-path", help="NVMe folder for ZeRO-Infinity offload")
    p.add_argument("--mode", choices=["full", "lora"], help="full fine-tune or LoRA")
    p.add_argument("--lora-rank", type=int, help="LoRA rank")
    p.add_argument("--quantize", choices=["none", "qint8", "qfloat8", "qint4"], help="quantize the frozen base")
    p.add_argument("--global-batch", type=int, help="images per optimizer step across all GPUs")
    p.add_argument("--micro-batch", help="images per GPU per forward, or auto")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of --config, the shorthand flags and --set (the later wins)."""
    overrides = [f"{field}={getattr(args, flag)}" for flag, field in PLAN_FLAGS.items()
                 if getattr(args, flag, None) is not None]
    return load_config(args.config, [*overrides, *args.overrides])
