"""What the planner needs to know about the GPUs: measured through NVML, or taken from an offline
profile so that a plan can be made on a machine without the GPUs (a laptop, CI, a login node).

This is the only module that imports pynvml; it does so lazily, so that a CPU-only install works.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zerotrain.config.sections import HardwareConfig, parse_bytes
from zerotrain.errors import ZerotrainError
from zerotrain.units import GiB, MiB, gib

# PCIe 4.0 x16 is 32 GB/s per direction on paper; pinned-memory copies reach about 25 GB/s
# (NVIDIA bandwidthTest on A100 and RTX 4090 hosts). Cards without NVLink also run their collectives
# over it, so it is both their host link and their intra-node link.
PCIE4 = 25e9
# PCIe 5.0 x16 is 64 GB/s per direction on paper; about 50 GB/s measured host<->H100 (bandwidthTest).
PCIE5 = 50e9
# One HDR InfiniBand / 200 GbE port per node = 200 Gb/s = 25 GB/s. Real clusters often have one port per
# GPU (8x this); the low end keeps a multi-node plan from counting on a fabric it may not have.
INTER_NODE = 25e9
# Dense bf16 tensor FLOP/s assumed for a GPU we have no profile for; below every data-center card in
# the table so that a time estimate errs long rather than short.
GENERIC_PEAK = 100e12
# GPU memory bandwidth assumed for a GPU without a profile: below every card in the table but the L4.
GENERIC_MEMORY_BANDWIDTH = 500e9
# Host RAM per GPU for cards sold in workstations and PCIe servers: a single-card workstation commonly
# has 64 GiB; AWS g6/g6e 8-GPU nodes have 96-192 GiB per GPU. We take the low end.
PCIE_HOST_PER_GPU = 64 * GiB
# At most this many GPUs in one node (DGX-2/HGX-2 had 16); more is almost always a total across nodes.
MAX_GPUS_PER_NODE = 16


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message is the reason (hardware_facts turns it into a ZerotrainError)."""


@dataclass(frozen=True)
class GPUProfile:
    name: str
    memory_bytes: int  # total as NVML / nvidia-smi report it (after ECC and driver reservations)
    peak_bf16_flops: float  # dense (no 2:4 sparsity) bf16 tensor FLOP/s, FP32 accumulate
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    host_to_device_bandwidth: float  # bytes/s, one direction
    host_memory_per_gpu: int  # typical node RAM divided by its GPU count; a node gets count x this
    nvml_pattern: str  # regex on the NVML device name; the patterns of the table are mutually exclusive
    memory_bandwidth: float = GENERIC_MEMORY_BANDWIDTH  # bytes/s of the GPU's own memory (datasheet)


# Memory: nvidia-smi "MiB" totals seen on real cards. FLOP/s: NVIDIA datasheets (Ampere GA102 and Ada
# whitepapers for the GeForce cards), dense figures. NVLink: A100 NVLink3 600 GB/s and H100/H200 NVLink4
# 900 GB/s total, halved for one direction. Host RAM: DGX A100 ships 1 TB for 8 GPUs, DGX H200 2 TB;
# DGX H100 ships 2 TB but cloud 8xH100 nodes vary, so H100 takes the DGX A100 figure.
# Memory bandwidth: the same datasheets (HBM2e/HBM3/HBM3e, GDDR6/6X).
PROFILES: dict[str, GPUProfile] = {p.name: p for p in (
    GPUProfile("A100-40GB", 40960 * MiB, 312e12, 300e9, PCIE4, 128 * GiB, r"A100(?!.*80GB)", 1555e9),
    GPUProfile("A100-80GB", 81920 * MiB, 312e12, 300e9, PCIE4, 128 * GiB, r"A100.*80GB", 2039e9),
    GPUProfile("H100-80GB", 81559 * MiB, 989e12, 450e9, PCIE5, 128 * GiB, r"H100(?!.*PCIe)", 3350e9),
    # H100 PCIe datasheet: 756 TFLOP/s bf16 dense; no NVLink unless bridged in pairs.
    GPUProfile("H100-PCIe-80GB", 81559 * MiB, 756e12, PCIE5, PCIE5, 128 * GiB, r"H100.*PCIe", 2000e9),
    GPUProfile("H200-141GB", 143771 * MiB, 989e12, 450e9, PCIE5, 256 * GiB, r"H200", 4800e9),
    GPUProfile("RTX4090-24GB", 24564 * MiB, 165.2e12, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"RTX 4090", 1008e9),
    GPUProfile("RTX3090-24GB", 24576 * MiB, 71e12, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"RTX 3090", 936e9),
    GPUProfile("L40S-48GB", 46068 * MiB, 362e12, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"L40S", 864e9),
    GPUProfile("L4-24GB", 23034 * MiB, 121e12, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"\bL4\b", 300e9),
    GPUProfile("A10-24GB", 23028 * MiB, 125e12, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"\bA10\b", 600e9),
)}

_SPEC_RE = re.compile(r"^\s*(\d+)\s*x\s*(\S.*?)\s*$", re.IGNORECASE)


def _how_to_name() -> str:
    return f"--gpus 8xA100-80GB (profiles: {', '.join(PROFILES)}) or --gpus 4 --gpu-memory 48GiB"


def _key(name: str) -> str:
    # "a100 80gb", "A100_80GB" and "A100-80GB" all name the same profile.
    return re.sub(r"[-_\s]", "", name).upper()


@dataclass(frozen=True)
class GPUInfo:
    index: int  # NVML index
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class HardwareFacts:
    gpu_name: str
    gpus_per_node: int
    nodes: int
    gpu_memory_bytes: int
    gpu_free_bytes: int | None
    host_memory_bytes: int
    nvme_free_bytes: int | None
    peak_bf16_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    host_to_device_bandwidth: float
    source: str
    gpus: tuple[GPUInfo, ...] = ()
    memory_bandwidth: float = GENERIC_MEMORY_BANDWIDTH

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        nodes = f"{self.nodes} node" + ("s" if self.nodes > 1 else "")
        gpu, host = (gib(n, units=("TiB", "GiB")) for n in (self.gpu_memory_bytes, self.host_memory_bytes))
        return f"{self.gpus_per_node}x {self.gpu_name} ({gpu} each), {nodes}, {host} host RAM [{self.source}]"


def _generic(name: str) -> GPUProfile:
    return GPUProfile(name, 0, GENERIC_PEAK, PCIE4, PCIE4, PCIE_HOST_PER_GPU, r"(?!)")


def parse_gpu_spec(spec: str, gpu_memory: str | None = None) -> tuple[int, GPUProfile]:
    """'8xA100-80GB' -> (8, A100-80GB profile). A bare count ('4') needs gpu_memory and gives a generic
    GPU of that size. Raises ZerotrainError naming hardware.gpus."""
    def bad(why: str) -> ZerotrainError:
        return ZerotrainError(f"hardware.gpus: '{spec}' {why}; write {_how_to_name()}")

    if spec.strip().isdigit():
        count, profile = int(spec), None
        if gpu_memory is None:
            raise bad("is a bare GPU count, which needs the memory of one GPU (hardware.gpu_memory)")
    elif match := _SPEC_RE.match(spec):
        count = int(match.group(1))
        profile = next((p for p in PROFILES.values() if _key(p.name) == _key(match.group(2))), None)
        if profile is None:
            raise bad(f"names no known GPU profile '{match.group(2)}'")
    else:
        raise bad("is not a GPU spec (COUNTxPROFILE, a count, or auto)")
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise bad(f"asks for {count} GPUs per node; 1 to {MAX_GPUS_PER_NODE} fit in a node, "
                  "spread more with hardware.nodes")
    if profile is None:
        profile = replace(_generic("generic GPU"), memory_bytes=parse_bytes(gpu_memory))
    return count, profile


def visible_gpu_indices(cuda_visible_devices: str | None, all_gpus: list[GPUInfo]) -> list[GPUInfo]:
    """The GPUs a CUDA process would see, in CUDA's order, following CUDA's own parsing (as PyTorch's
    _parse_visible_devices mirrors it): unset means all; "" means none; entries are indices or unique
    UUID prefixes; the first invalid entry ends the list ("-1" hides everything); a repeated entry
    makes the whole list empty. Indices are NVML's (PCI bus) order, which is CUDA's order for
    identical GPUs or with CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if cuda_visible_devices is None:
        return list(all_gpus)
    chosen: list[GPUInfo] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.upper().startswith("MIG-"):
            raise ZerotrainError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices} names a MIG instance ({entry}); MIG slices "
                "cannot be measured here: name their size with --gpus N --gpu-memory SIZE"
            )
        if entry.upper().startswith("GPU-"):
            matches = [g for g in all_gpus if g.uuid.upper().startswith(entry.upper())]
            gpu = matches[0] if len(matches) == 1 else None
        else:
            # CUDA reads an index like strtoul: "1gpu" is 1, anything without leading digits is invalid.
            digits = re.match(r"\d+", entry)
            index = int(digits.group()) if digits else -1
            gpu = all_gpus[index] if 0 <= index < len(all_gpus) else None
        if gpu is None:
            break
        if gpu in chosen:
            return []
        chosen.append(gpu)
    return chosen


@contextlib.contextmanager
def _nvml_session(nvml: Any, reading: str) -> Iterator[Any]:
    """pynvml (or `nvml`, its stand-in in tests) initialised for the block and shut down after;
    every NVML failure becomes NvmlUnavailable (`reading` names what was being read)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            raise NvmlUnavailable(f"pynvml (nvidia-ml-py) cannot be imported: {exc}") from exc
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML did not start: {exc}") from exc
    try:
        yield nvml
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML could not read {reading}: {exc}") from exc
    finally:
        nvml.nvmlShutdown()


def detect_nvml_gpus(nvml: Any = None) -> list[GPUInfo]:
    """Every GPU NVML enumerates (CUDA_VISIBLE_DEVICES is not applied). Raises NvmlUnavailable."""
    with _nvml_session(nvml, "the GPUs") as lib:
        gpus = []
        for index in range(lib.nvmlDeviceGetCount()):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            memory = lib.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GPUInfo(index, _text(lib.nvmlDeviceGetName(handle)),
                                _text(lib.nvmlDeviceGetUUID(handle)), int(memory.total), int(memory.free)))
        return gpus


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


def host_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Local RAM this process may use: physical RAM, capped by a container's cgroup memory limit,
    because offloading past that limit gets the process OOM-killed rather than swapped."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        text = Path("/proc/meminfo").read_text()
        physical = int(re.search(r"MemTotal:\s*(\d+)\s*kB", text).group(1)) * 1024
    limits = [physical]
    for name in ("memory.max", "memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            limit = (cgroup_root / name).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # v2 writes "max" when unlimited; v1 a huge number, which min() ignores
            limits.append(int(limit))
    return min(limits)


def _profile_for(nvml_name: str) -> GPUProfile:
    return next((p for p in PROFILES.values() if re.search(p.nvml_pattern, nvml_name, re.IGNORECASE)),
                _generic(nvml_name))


def _nvme_free(config: HardwareConfig) -> int | None:
    if config.nvme_space is not None:
        return parse_bytes(config.nvme_space)
    if config.nvme_path is None:
        return None
    # The folder is usually created by the run itself; the drive it will land on is its nearest
    # existing ancestor.
    path = config.nvme_path.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def hardware_facts(config: HardwareConfig, nvml: Any = None,
                   environ: Mapping[str, str] | None = None) -> HardwareFacts:
    """Facts for the plan: detected through NVML for gpus=auto, else from the named profile. Other
    nodes are assumed identical to this one."""
    environ = os.environ if environ is None else environ
    override = parse_bytes(config.gpu_memory) if config.gpu_memory is not None else None
    if config.gpus.strip().lower() != "auto":
        count, profile = parse_gpu_spec(config.gpus, config.gpu_memory)
        gpu_name, source, gpus = profile.name, f"profile {config.gpus.strip()}", ()
        total, free = profile.memory_bytes, None
        host = profile.host_memory_per_gpu * count
    else:
        try:
            detected = detect_nvml_gpus(nvml)
        except NvmlUnavailable as exc:
            raise ZerotrainError(
                f"hardware.gpus=auto: no GPU could be detected ({exc}); to plan for GPUs this machine "
                f"lacks, name them: {_how_to_name()}"
            ) from exc
        mask = environ.get("CUDA_VISIBLE_DEVICES")
        gpus = tuple(visible_gpu_indices(mask, detected))
        if not gpus:
            why = "NVML reports 0 GPUs" if mask is None else \
                f"CUDA_VISIBLE_DEVICES={mask!r} hides all {len(detected)} GPUs"
            raise ZerotrainError(
                f"hardware.gpus=auto: no GPU could be detected ({why}); check CUDA_VISIBLE_DEVICES, "
                f"or to plan without GPUs name them: {_how_to_name()}"
            )
        names = list(dict.fromkeys(g.name for g in gpus))
        # Data-parallel training runs at the pace of its slowest GPU, so mixed GPUs count as the worst.
        profile = min((_profile_for(n) for n in names), key=lambda p: p.peak_bf16_flops)
        count, gpu_name, source = len(gpus), " + ".join(names), "nvml"
        total, free = min(g.total_bytes for g in gpus), min(g.free_bytes for g in gpus)
        host = host_memory_bytes()
    if override is not None:
        total, free = override, None if free is None else min(free, override)
        source += f", gpu_memory={config.gpu_memory}"
    if config.host_memory is not None:
        host = parse_bytes(config.host_memory)
        source += f", host_memory={config.host_memory}"
    return HardwareFacts(
        gpu_name=gpu_name, gpus_per_node=count, nodes=config.nodes, gpu_memory_bytes=total,
        gpu_free_bytes=free, host_memory_bytes=host, nvme_free_bytes=_nvme_free(config),
        peak_bf16_flops=profile.peak_bf16_flops, intra_node_bandwidth=profile.intra_node_bandwidth,
        inter_node_bandwidth=INTER_NODE, host_to_device_bandwidth=profile.host_to_device_bandwidth,
        source=source, gpus=gpus, memory_bandwidth=profile.memory_bandwidth,
    )


@dataclass(frozen=True)
class Driver:
    version: str
    cuda: tuple[int, int]  # the newest CUDA the driver supports


def nvml_driver(nvml: Any = None) -> Driver:
    """The NVIDIA driver's version and the newest CUDA it supports. Raises NvmlUnavailable.
    `nvml` replaces the pynvml module in tests."""
    with _nvml_session(nvml, "the driver version") as lib:
        cuda = int(lib.nvmlSystemGetCudaDriverVersion())  # 12040 for CUDA 12.4
        return Driver(_text(lib.nvmlSystemGetDriverVersion()), (cuda // 1000, cuda % 1000 // 10))
