"""The DeepSpeed JSON for a chosen layout: concrete values only (DeepSpeed silently drops
"auto" in some paths), validated by DeepSpeed's own config class. And the other way round: a
DeepSpeed JSON the user gives (`deepspeed: path` or an inline dict), completed and read back
as the Layout the planner can evaluate."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.optimizers import CLIENT_OPTIMIZERS, client_settings, deepspeed_adamw
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
        if layout.zeropp != "none":
            zero["zero_hpz_partition_size"] = world_size // run.hardware.nodes
        if layout.zeropp == "hpz-qwz-qgz":
            zero.update({"zero_quantized_weights": True, "zero_quantized_gradients": True})
    nvme_path = str(run.hardware.nvme_path) if run.hardware.nvme_path else None
    if nvme_path is None and "nvme" in (layout.offload_optimizer, layout.offload_param):
        raise ZerotrainError(
            f"hardware.nvme_path is unset, but the layout offloads to NVMe ({layout.label()}); set "
            "hardware.nvme_path to a folder on a local NVMe drive, or remove nvme from planner.offload")
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
        "bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                     if layout.bf16_masters else {})},
        "zero_optimization": zero,
        **optimizer_section(layout.optimizer, run),
        "steps_per_print": 10**9,  # zerotrain prints its own progress
        "wall_clock_breakdown": False,
    }
    placeholder = _placeholder(config)
    if placeholder is not None:
        raise ZerotrainError(f"internal: DeepSpeed config key {placeholder} is not a concrete value; "
                             "report this as a zerotrain bug")
    return config


def _placeholder(value: Any, where: str = "") -> str | None:
    """The dotted key of the first value that is DeepSpeed's "auto" placeholder, or None when every
    value is concrete. Values are checked, not the JSON text: a path such as /mnt/auto/nvme is
    concrete."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _placeholder(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _placeholder(item, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    return where if isinstance(value, str) and value.strip().lower() == "auto" else None


def optimizer_section(name: str, run: RunConfig) -> dict[str, Any]:
    """The DeepSpeed JSON's optimizer keys. DeepSpeed builds its own AdamW from an "optimizer"
    section (adamw, adamw-bf16). A client optimizer (adamw-8bit, adafactor) is built by zerotrain
    (zerotrain/optimizers.py) and handed to deepspeed.initialize, which then must find no such
    section and needs zero_allow_untested_optimizer; which one, and its settings, are written under
    "_zerotrain" (DeepSpeed ignores the key), so that the JSON says what trains."""
    opt = run.optimizer
    if name in CLIENT_OPTIMIZERS:
        return {"zero_allow_untested_optimizer": True, "_zerotrain": {"optimizer": client_settings(name, run)}}
    # optimizer.torch_adam: DeepSpeed builds torch's fused AdamW instead of its FusedAdam op.
    torch_adam = {"torch_adam": True, "fused": True} if opt.torch_adam else {}
    return {"optimizer": {
        "type": "AdamW",
        "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
                   **torch_adam},
    }}


def client_optimizer_of(config: dict[str, Any]) -> str | None:
    """The client optimizer a DeepSpeed JSON names (optimizer_section), or None."""
    marker = config.get("_zerotrain")
    name = marker.get("optimizer", {}).get("name") if isinstance(marker, dict) else None
    return name if name in CLIENT_OPTIMIZERS else None


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
        own = data.pop("_zerotrain", {})  # the client optimizer's settings (optimizer_section)
        data = {"_zerotrain": {**header, **own}, **data}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# What zerotrain fills into a given config that lacks it (never overriding what it has).
FILLED_KEYS = ("optimizer", "gradient_clipping", "bf16", "steps_per_print", "wall_clock_breakdown")


def given_config(run: RunConfig) -> tuple[dict[str, Any], str] | None:
    """The DeepSpeed config the run names and where it comes from, or None for deepspeed: auto."""
    if isinstance(run.deepspeed, dict):
        return json.loads(json.dumps(run.deepspeed)), "deepspeed (inline)"
    if run.deepspeed == "auto":
        return None
    path = Path(run.deepspeed)
    source = f"deepspeed={path}"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ZerotrainError(f"{source}: no such file; give the path of a DeepSpeed JSON config, or auto") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ZerotrainError(f"{source}: cannot be read ({err})") from err
    except json.JSONDecodeError as err:
        raise ZerotrainError(f"{source}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from err
    if not isinstance(data, dict):
        raise ZerotrainError(f"{source}: a DeepSpeed config is a JSON object, this file holds a {type(data).__name__}")
    return data, source


def complete_given(given: dict[str, Any], source: str, run: RunConfig, world_size: int,
                   default_micro: int) -> dict[str, Any]:
    """The given config with its batch numbers completed and checked: train_batch_size = micro x
    accumulation x world, and it must equal training.global_batch_size. Missing numbers ("auto"
    counts as missing) come from that equation, zerotrain's global batch, and the planner's
    micro-batch `default_micro` when neither micro nor accumulation is given. FILLED_KEYS the
    config lacks are taken from zerotrain's own config."""
    config = {k: v for k, v in given.items() if not (k in BATCH_KEYS and v == "auto")}
    total, micro, accumulation = (config.get(k) for k in BATCH_KEYS)
    for key, value in zip(BATCH_KEYS, (total, micro, accumulation)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ZerotrainError(f"{source}: {key} must be a positive integer, got {value!r}")
    if total is None and not (micro and accumulation):
        total = run.training.global_batch_size
    if micro is None and accumulation is None:
        micro = default_micro
    if micro is None:
        micro = total // (accumulation * world_size)
    if accumulation is None:
        accumulation = total // (micro * world_size)
    total = total or micro * accumulation * world_size
    if not micro or not accumulation or micro * accumulation * world_size != total:
        raise ZerotrainError(
            f"{source}: train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accumulation} x {world_size} processes; fix the batch numbers")
    if total != run.training.global_batch_size:
        raise ZerotrainError(
            f"{source}: {total} images per step (micro {micro} x accumulation {accumulation} x {world_size} "
            f"processes), but training.global_batch_size is {run.training.global_batch_size}; make them agree")
    config.update(dict(zip(BATCH_KEYS, (total, micro, accumulation))))
    name = run.optimizer.name if run.optimizer.name in CLIENT_OPTIMIZERS else deepspeed_adamw(bf16_masters=False)
    if name in CLIENT_OPTIMIZERS and "optimizer" in config:
        raise ZerotrainError(f"{source} has an optimizer section, and optimizer.name={name} asks for an optimizer "
                             "zerotrain builds: remove the section, or set optimizer.name to adamw")
    own = deepspeed_config(Layout(0, micro_batch=micro, accumulation=accumulation, optimizer=name), run, world_size)
    for key in (*FILLED_KEYS, "zero_allow_untested_optimizer", "_zerotrain"):
        if key in own:
            config.setdefault(key, own[key])
    if isinstance(config.get("bf16"), dict) and _read_as_false(config["bf16"].get("check_grad_overflow", True)):
        raise ZerotrainError(f"{source}: bf16.check_grad_overflow is false, so a NaN or inf gradient would be "
                             "applied to the weights; zerotrain skips such steps through it: remove the setting")
    return config


def _read_as_false(value: Any) -> bool:
    """Whether DeepSpeed reads a boolean setting as false: its config models are pydantic's, which
    also take 0, "false", "no" and "off" for False. A value that is no boolean at all is left to
    DeepSpeed's own validation."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value) is False
    except ValidationError:
        return False


def layout_of(config: dict[str, Any], gradient_checkpointing: bool) -> Layout:
    """The Layout a complete DeepSpeed config describes, for the planner to evaluate."""
    zero = config.get("zero_optimization") or {}

    def device(section: str) -> str:
        return str((zero.get(section) or {}).get("device", "none"))

    bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    optimizer = client_optimizer_of(config) or (
        deepspeed_adamw(bf16_masters=bf16.get("bf16_master_weights_and_grads") is True))
    return Layout(int(zero.get("stage", 0)), device("offload_optimizer"), device("offload_param"),
                  gradient_checkpointing, config["train_micro_batch_size_per_gpu"],
                  config["gradient_accumulation_steps"], optimizer=optimizer)
