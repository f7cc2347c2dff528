"""Loading the denoiser with about one model copy of host RAM per node, not one per rank (issue 24).

Every rank used to load the whole bf16 denoiser on the host before DeepSpeed took it: eight copies
on an 8-GPU node (FLUX.2 [dev]: 8 x 60 GiB), where many nodes have 512 GB. model.load: auto picks
one of three ways; the planner counts the same (planner.memory.host_bytes, "model load"):

- partitioned (ZeRO-3, the base not quantized, parameters not offloaded to NVMe). Every rank builds
  the model on the meta device as diffusers builds it (buffers real, in bf16), then, parameter by
  parameter, global rank 0 reads the tensor from the memory-mapped safetensors while the others
  allocate an empty one on their device, and DeepSpeed's own conversion (zero.Init(module=...), as
  deepspeed.initialize runs it: deepspeed_compat.Partitioner) broadcasts it from rank 0 and keeps
  each rank's partition. The values are those every rank would have loaded, and the partitions
  the same bits: training after it equals training after a whole load. Host RAM: one parameter in
  flight per rank, the partitions where parameters are offloaded to the host (counted as offload),
  and the file's pages in the page cache (shared by the node, given back under pressure). zero.Init
  never runs as a construction context, so Flux's embedding is built whole (SimpleTuner#1239).
  Chosen over "load on local rank 0 and broadcast", which holds a whole copy per node besides the
  partitions, and over torch.distributed.broadcast of whole modules, which is what zero.Init's
  conversion already does one parameter at a time.
- staggered (ZeRO 0-2, or a quantized base, on GPUs). Every GPU holds the whole model (or its whole
  quantized base), so each rank needs its copy once; the ranks of a node load in turn, each
  quantizing its base where asked, moving the model to its GPU and freeing the host copy before
  the next starts: one copy at a time. The base is quantized by every rank, not once per node:
  optimum-quanto's weights are tensor subclasses torch.distributed does not send, and quantizing
  is deterministic, so each rank's base is the same; it costs start-up time, not memory.
- whole: every rank loads the whole model at once (model.load: whole; ZeRO 0-2 on the CPU
  accelerator, where host and device are one memory; NVMe parameter offload; weights that are not
  safetensors with the model's own names, as the run's log says)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotrain import families
from zerotrain.config.sections import Loading, Quantization, RunConfig
from zerotrain.distributed import Topology, barrier, from_rank0, gather_objects
from zerotrain.errors import ZerotrainError
from zerotrain.models.hub import WEIGHTS
from zerotrain.protocols import ModelSpec


@dataclass(frozen=True)
class Choice:
    how: str  # partitioned | staggered | whole
    why: str


def partitionable(run: RunConfig, stage: int, ds_config: dict[str, Any]) -> bool:
    """Whether the run may load partitioned, weights permitting (planner.memory.partitioned_load
    counts the same): model.load auto, ZeRO-3, the base not quantized, no NVMe parameter offload, no
    DoRA (its magnitudes start from the norms of the whole weights)."""
    offload_param = ((ds_config.get("zero_optimization") or {}).get("offload_param") or {}).get("device", "none")
    return (run.model.load is Loading.auto and stage == 3 and run.training.quantize_base is Quantization.none
            and offload_param != "nvme" and not run.training.lora.use_dora)


def choose(run: RunConfig, stage: int, ds_config: dict[str, Any], device: torch.device,
           weights: dict[str, Path] | str) -> Choice:
    """How this run loads its denoiser (see the module's docstring), and why, for the log.
    `weights`: the safetensors file of each weight (weight_files), or why there is none."""
    quantized = run.training.quantize_base is not Quantization.none
    if run.model.load is Loading.whole:
        return Choice("whole", "every rank loads the whole model on the host (model.load=whole)")
    if stage == 3 and run.training.lora.use_dora:
        return Choice("whole", "every rank loads the whole model on the host (DoRA's magnitudes start from the "
                               "norms of the whole weights)")
    if partitionable(run, stage, ds_config):
        if isinstance(weights, str):
            return Choice("whole", f"every rank loads the whole model on the host: {weights}")
        return Choice("partitioned", "rank 0 reads each weight from the safetensors and every rank keeps its "
                                     "ZeRO-3 partition (about one model copy of host RAM per node)")
    if device.type == "cpu":
        return Choice("whole", "every rank loads the whole model on the host (the CPU accelerator: the host is "
                               "the device)")
    if stage == 3 and not quantized:
        return Choice("whole", "every rank loads the whole model on the host (ZeRO-3 with parameters offloaded "
                               "to NVMe converts a whole model)")
    return Choice("staggered", "the ranks of a node load in turn, each moving its copy to its GPU before the "
                               "next starts (one model copy of host RAM at a time)")


def weight_files(spec: ModelSpec, folder: Path) -> dict[str, Path] | str:
    """The safetensors file holding each weight of the denoiser's folder (diffusers' single file
    or its sharded index), or why they cannot be read one by one."""
    from safetensors import safe_open

    where = folder / (spec.subfolder or families.of(spec).denoiser_folder)
    index = where / f"{WEIGHTS}.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: where / file for name, file in weight_map.items()}
        if (where / WEIGHTS).is_file():
            with safe_open(where / WEIGHTS, framework="pt") as f:
                names = f.keys()  # a safe_open is not iterable
            return dict.fromkeys(names, where / WEIGHTS)
    except (OSError, ValueError, KeyError) as err:
        return f"{where} cannot be read weight by weight ({' '.join(str(err).split())[:200]})"
    return f"{where} holds no {WEIGHTS}"


def load(spec: ModelSpec, folder: Path, run: RunConfig, topo: Topology, device: torch.device,
         ds_config: dict[str, Any]) -> tuple[torch.nn.Module, list[str]]:
    """The denoiser as the engine takes it, loaded as choose() says (quantized already where the
    base is quantized), and the lines for the log. Every rank calls it."""
    from zerotrain.engine import load_denoiser

    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    weights: dict[str, Path] | str = "not read (no partitioned load)"
    model = None
    if partitionable(run, stage, ds_config):
        weights = weight_files(spec, folder)
        if not isinstance(weights, str):
            model = skeleton(spec, folder)
            weights = mismatch(model, weights, folder) or weights
    choice = from_rank0(choose, topo, run, stage, ds_config, device, weights)
    done = [f"loading: {choice.why}"]
    if choice.how == "partitioned":
        if isinstance(weights, str):
            raise ZerotrainError(f"rank {topo.rank}: rank 0 loads the model partitioned, but here {weights}: every "
                                 "node needs the same model files (or set model.load: whole)")
        fill_partitioned(model, weights, ds_config, topo, device)
        return model, done
    del model
    if choice.how == "whole":
        return load_denoiser(spec, folder), done
    model, quantizing = in_turns(spec, folder, run, topo, device)
    return model, done + quantizing


def in_turns(spec: ModelSpec, folder: Path, run: RunConfig, topo: Topology,
             device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The staggered load: the ranks of a node (one local rank of every node at a time) load the
    whole model on the host, quantize its base where asked, and move it to `device`, in turn, a
    barrier between turns. Returns the model and the quantization's line."""
    from zerotrain.engine import load_denoiser, quantize_base

    turns = max(int(local) for local in gather_objects(topo.local_rank)) + 1
    model, done = None, []
    for turn in range(turns):
        if turn == topo.local_rank:
            model = load_denoiser(spec, folder)
            if run.training.quantize_base is not Quantization.none:
                done.append(quantize_base(model, run.training.quantize_base))
            model.to(device)
        barrier()
    return model, done


def skeleton(spec: ModelSpec, folder: Path) -> torch.nn.Module:
    """The denoiser built as diffusers' from_pretrained builds it before it reads the weights
    (modeling_utils: the default dtype bf16, no_init_weights, accelerate's init_empty_weights):
    parameters on the meta device, buffers real and in bf16."""
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    cls = spec.denoiser_class()
    config = cls.load_config(folder, subfolder=spec.subfolder or families.of(spec).denoiser_folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with no_init_weights(), accelerate.init_empty_weights():
            model = cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()  # as from_pretrained leaves it
    return model


def persistent_buffers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    out = {}
    for path, module in model.named_modules():
        for name in module._buffers:
            if module._buffers[name] is not None and name not in module._non_persistent_buffers_set:
                out[f"{path}.{name}" if path else name] = (module, name)
    return out


def mismatch(model: torch.nn.Module, weights: dict[str, Path], folder: Path) -> str | None:
    """Why the files' weights are not exactly the model's (names and shapes), or None."""
    from safetensors import safe_open

    wanted = {name: tuple(p.shape) for name, p in model.named_parameters()}
    wanted.update({name: tuple(module._buffers[attr].shape) for name, (module, attr) in persistent_buffers(model).items()})
    missing, unexpected = sorted(set(wanted) - set(weights)), sorted(set(weights) - set(wanted))
    if missing or unexpected:
        return (f"the weights' names differ from the model's ({len(missing)} missing, e.g. {missing[:2]}; "
                f"{len(unexpected)} unexpected, e.g. {unexpected[:2]})")
    by_file: dict[Path, list[str]] = {}
    for name, file in weights.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != wanted[name]:
                    return f"{file.relative_to(folder)}: {name} has shape {list(shape)}, the model {list(wanted[name])}"
    return None


def fill_partitioned(model: torch.nn.Module, weights: dict[str, Path], ds_config: dict[str, Any],
                     topo: Topology, device: torch.device) -> None:
    """Every meta parameter of `model` materialised and converted to its ZeRO-3 partition, one at a
    time; rank 0's values from the files, the persistent buffers read by every rank (they are not
    partitioned). Parameters registered twice (tied) are converted once."""
    from safetensors import safe_open

    from zerotrain.deepspeed_compat import Partitioner

    config = {k: v for k, v in ds_config.items() if k != "_zerotrain"}
    partitioner = Partitioner(config)
    opened: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        file = weights[name]
        if file not in opened:
            opened[file] = safe_open(file, framework="pt")
        tensor = opened[file].get_tensor(name)
        return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor

    for name, (module, attr) in persistent_buffers(model).items():
        module._buffers[attr] = read(name).to(module._buffers[attr].device)
    done: dict[int, torch.nn.Parameter] = {}
    for path, module in model.named_modules():
        for attr, meta in list(module._parameters.items()):
            if meta is not None and id(meta) not in done:
                name = f"{path}.{attr}" if path else attr
                dtype = torch.bfloat16 if meta.is_floating_point() else meta.dtype
                data = read(name) if topo.is_main else torch.empty(meta.shape, dtype=dtype, device=device)
                done[id(meta)] = torch.nn.Parameter(data, requires_grad=meta.requires_grad)
                partitioner([done[id(meta)]])
            if meta is not None:
                module._parameters[attr] = done[id(meta)]
    opened.clear()
    partitioner.finish(model)
