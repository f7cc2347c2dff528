"""The process around an engine: the process group (init_distributed), ZeRO-3 partitions made one parameter
at a time before initialize (Partitioner), a step dropped after it ran out of memory (abandon_step), and
what ZeRO-3 leaves in a process after engine.destroy() (release_process_state)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from zerotrain import versions

if TYPE_CHECKING:  # torch is imported where it is used: the planner reads the gate without it
    import torch
from zerotrain.deepspeed_compat.fragments import _require
from zerotrain.deepspeed_compat.jit import say_jit_builds

# ---- dropping a step that ran out of memory ----

def abandon_step(engine: Any, micro_steps: int) -> None:
    """Put the engine back where it stood before a step whose forward or backward raised (an
    out-of-memory error), so that the same micro-batches can run again with nothing of the failed
    attempt left: no gathered ZeRO-3 parameters, no half-filled reduction buckets, no gradients
    accumulated by its earlier micro-batches. `micro_steps` is engine.micro_steps at the step's
    start. The optimizer has not stepped (that happens after the last backward), so its state and
    the weights are untouched.

    DeepSpeed has no call for this; it mirrors what the optimizers' own step() and zero_grad()
    reset after a step (runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step, zero_grad,
    reset_partition_gradient_structures; runtime/zero/stage3.py zero_grad and the parameter
    coordinator's release_and_reset_all; runtime/base_optimizer.py's backward hook state), read in
    the tested versions. tests/distributed/test_oom_recovery.py checks, for ZeRO 0-3, with and
    without offload and gradient accumulation, that training after it equals training that never
    failed."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()  # reductions in flight on a side stream land before their buffers are reset
    engine.micro_steps = micro_steps
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None:  # ZeRO-3: parameters gathered for the failed forward or backward go back
        coordinator = offload.get_param_coordinator()
        coordinator.release_and_reset_all(engine.module)
        _require(coordinator, ("is_invalid_trace", "_invalidate_trace"), "ZeRO-3's parameter coordinator")
        if not coordinator.is_invalid_trace():  # the recorded order ended in the middle: record anew
            coordinator._invalidate_trace()
    getattr(optimizer, "extra_large_param_to_reduce", {}).clear()
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        bucket.params.clear()
        bucket.elements = 0
        if hasattr(bucket, "grads"):  # ZeRO 1/2
            bucket.grads.clear()
            bucket.index = 0
    reduced = getattr(optimizer, "params_already_reduced", None)
    for key in (range(len(reduced)) if isinstance(reduced, list) else list(reduced or ())):
        reduced[key] = False
    previous = getattr(optimizer, "previous_reduced_grads", None)
    if isinstance(previous, dict):
        for grads in previous.values():
            grads.clear()
    if hasattr(optimizer, "averaged_gradients"):
        for key in list(optimizer.averaged_gradients):
            optimizer.averaged_gradients[key] = None if offload is None else optimizer.averaged_gradients[key]
    for key in list(getattr(optimizer, "all_grad_tensors", {})):
        optimizer.all_grad_tensors[key] = None
    if hasattr(optimizer, "reset_partition_gradient_structures") and getattr(optimizer, "partition_gradients", False):
        optimizer.reset_partition_gradient_structures()
    if hasattr(optimizer, "_release_ipg_buffers"):  # ZeRO 1/2, as the end of every backward does
        optimizer._release_ipg_buffers()
    if hasattr(optimizer, "_offload_accumulated_param_ids"):
        optimizer._offload_accumulated_param_ids = set()
    if offload is None and hasattr(optimizer, "micro_step_id"):
        optimizer.micro_step_id = -1  # stage_1_and_2.INITIAL_MICRO_STEP_ID, as its step() sets it
    elif offload is not None:  # as stage3's zero_grad (whose record_stream fails on the CPU accelerator)
        optimizer.micro_step_id = 0
        optimizer._epilogue_ran_this_backward = False
    for param in engine.module.parameters():
        param.grad = None
        if hasattr(param, "grad_accum"):
            param.grad_accum = None
    state = getattr(optimizer, "_backward_hook_state", None)
    if state is not None:
        state.backward_active_depth = 0
        optimizer.clear_backward_seen_flag()


# ---- ZeRO-3 partitions made one parameter at a time, before initialize ----

LOAD_WHOLE = "set model.load: whole"


class Partitioner:
    """Converts parameters to ZeRO-3 partitioned ones before deepspeed.initialize, exactly as
    initialize converts a whole model (runtime/zero/parameter_offload.py
    DeepSpeedZeRoOffload._convert_to_zero_parameters): the first call through
    deepspeed.zero.Init(module=...) with the arguments initialize passes it (dtype, the config, the
    parameter offload device and pinning, ZeRO++'s quantized weights), every later one through that
    Init's convert_to_zero_parameters, which DeepSpeed itself calls for parameters added to a
    converted model; each parameter is broadcast from rank 0 and partitioned. initialize then finds
    them converted and converts only what was added since (LoRA adapters). finish() keeps the
    buffers the model names for fp32 in fp32, as Init(module=model) does at initialize. The Init is
    never entered as a context: modules are not built under it (SimpleTuner#1239)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.init: Any = None
        self.first: Any = None

    def __call__(self, params: list[torch.nn.Parameter]) -> None:
        import deepspeed
        import torch

        if self.first is None:
            zero = self.config.get("zero_optimization") or {}
            offload = zero.get("offload_param") or {}
            device = offload.get("device", "none")
            holder = torch.nn.Module()
            for index, param in enumerate(params):
                holder.register_parameter(f"p{index}", param)
            self.init = deepspeed.zero.Init(
                module=holder, dtype=params[0].dtype, config_dict_or_path=self.config,
                remote_device=None if device == "none" else device,
                pin_memory=bool(offload.get("pin_memory", False)) if device != "none" else False,
                zero_quantized_weights=bool(zero.get("zero_quantized_weights", False)),
                zero_quantized_nontrainable_weights=bool(zero.get("zero_quantized_nontrainable_weights", False)))
            _require(params[0], ("ds_id", "convert_to_zero_parameters"), "a ZeRO-3 parameter", LOAD_WHOLE)
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)

    def finish(self, model: torch.nn.Module) -> None:
        if self.init is not None:
            _require(self.init, ("_keep_in_fp32",), "zero.Init", LOAD_WHOLE)
            self.init._keep_in_fp32(model)


def init_distributed(backend: str, timeout: Any = None) -> None:
    """deepspeed.init_distributed; on the CPU accelerator with no C++ compiler (CXX, or c++), first marks
    its shared-memory collective op incompatible, so that DeepSpeed keeps gloo's collectives instead of
    failing to build the op (see the module docstring); with one, says so first where the op is not
    built yet (say_jit_builds)."""
    import shutil

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and shutil.which(os.environ.get("CXX", "c++")) is None:
        builder = accelerator.create_op_builder("ShareMemCommBuilder")
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if builder is not None and isinstance(compatible, dict):
            compatible[builder.NAME] = False
    elif accelerator.device_name() == "cpu":
        say_jit_builds(["deepspeed_shm_comm"])  # comm/torch.py build_shm_op, as the process group starts
    deepspeed.init_distributed(dist_backend=backend, **({"timeout": timeout} if timeout is not None else {}))
    if timeout is not None:
        group_timeouts(timeout)


def group_timeouts(timeout: Any) -> None:
    """Give the groups DeepSpeed makes the world group's timeout. deepspeed.comm's TorchBackend.new_group(ranks)
    (comm/torch.py) calls torch.distributed.new_group without one, which then takes torch's default (10 minutes
    on NCCL, 30 on gloo), not the world's: its data-parallel clone of the world (utils/groups.py
    _clone_world_group, where ZeRO's reductions and gathers run), ZeRO++'s and the sequence-parallel groups.
    The backend's new_group is wrapped to pass `timeout`. Guard: on a tested version, with the backend's
    new_group present; elsewhere one warning, and DeepSpeed's groups keep torch's default."""
    import sys

    import torch
    from deepspeed import comm

    backend = getattr(comm.comm, "cdb", None)
    if not versions.check("deepspeed").is_tested or not callable(getattr(backend, "new_group", None)):
        print(f"zerotrain: warning: DeepSpeed {versions.installed('deepspeed')} is not a tested version: its own "
              "process groups keep torch's default timeout (faults.collective_timeout_seconds covers the world "
              "group's)", file=sys.stderr, flush=True)
        return

    def new_group(ranks: Any) -> Any:
        return torch.distributed.new_group(ranks, timeout=timeout)

    backend.new_group = new_group


def release_process_state(module: torch.nn.Module | None = None) -> list[str]:
    """Undo the process-wide state a ZeRO-3 engine leaves behind after its destroy() (the module
    docstring), and dynamo's caches of compiled blocks, so that a later engine in the same process
    runs torch's own F.linear and finds no earlier module on DeepSpeed's stack. `module`: the model
    the engine trained, whose parameters lose their `_z3_optimizer`. Returns what was released.
    It does not make the process as good as new: on the CPU, tiny-flux's ZeRO-3 partitions
    (1.26 MB, the next ZeRO-0 layout's init bytes 2.36 MB instead of 1.10 MB) stay reachable after it,
    held from outside Python's objects. Measurements run one engine per process (calibrate_layout).
    Nothing on a DeepSpeed version not tested."""
    import torch

    released: list[str] = []
    if not versions.check("deepspeed").is_tested:  # other versions may keep this state elsewhere
        return released
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list) and stack:
        stack.clear()
        released.append("FWD_MODULE_STACK")
    original = getattr(partition_parameters.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is partition_parameters.zero3_linear_wrap:
        torch.nn.functional.linear = original
        released.append("F.linear")
    if module is not None:
        held = [p for p in module.parameters() if hasattr(p, "_z3_optimizer")]
        for param in held:
            del param._z3_optimizer
        if held:
            released.append("_z3_optimizer")
    torch._dynamo.reset()  # compiled blocks' graphs and guards, and the recompile counters
    return released
