"""hardware.py without a GPU: a fake NVML module stands in for pynvml."""

from __future__ import annotations

import builtins
import shutil
from types import SimpleNamespace

import pytest

from zerotrain.config.sections import HardwareConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import (
    PROFILES,
    GPUInfo,
    detect_nvml_gpus,
    hardware_facts,
    host_memory_bytes,
    parse_gpu_spec,
    visible_gpu_indices,
)
from zerotrain.units import GiB, MiB, TiB

UUIDS = ["GPU-8f3a0000-1111", "GPU-8f3b0000-2222", "GPU-c0ff0000-3333"]


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The slice of pynvml that hardware.py calls. `devices` is [(name, uuid, total, free), ...]."""

    NVMLError = FakeNVMLError

    def __init__(self, devices, init_error=None, bytes_names=False):
        self.devices, self.init_error, self.bytes_names = devices, init_error, bytes_names
        self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        name = self.devices[handle][0]
        return name.encode() if self.bytes_names else name

    def nvmlDeviceGetUUID(self, handle):
        return self.devices[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=self.devices[handle][2], free=self.devices[handle][3])


def a100_node(n=3):
    return FakeNVML([("NVIDIA A100-SXM4-80GB", UUIDS[i], 81920 * MiB, (70 + i) * GiB) for i in range(n)])


def gpus(n=3):
    return detect_nvml_gpus(a100_node(n))


def test_detects_every_gpu_and_shuts_nvml_down():
    nvml = FakeNVML([("NVIDIA A100-SXM4-80GB", UUIDS[0], 80 * GiB, 70 * GiB),
                     ("NVIDIA A100-SXM4-80GB", UUIDS[1], 80 * GiB, 60 * GiB)], bytes_names=True)
    found = detect_nvml_gpus(nvml)
    assert found == [GPUInfo(0, "NVIDIA A100-SXM4-80GB", UUIDS[0], 80 * GiB, 70 * GiB),
                     GPUInfo(1, "NVIDIA A100-SXM4-80GB", UUIDS[1], 80 * GiB, 60 * GiB)]
    assert nvml.shutdowns == 1


def test_auto_facts_take_the_smallest_visible_gpu_and_the_profile_numbers():
    facts = hardware_facts(HardwareConfig(nodes=2), nvml=a100_node(3), environ={})
    assert (facts.gpus_per_node, facts.nodes, facts.world_size) == (3, 2, 6)
    assert facts.gpu_memory_bytes == 81920 * MiB
    assert facts.gpu_free_bytes == 70 * GiB
    assert facts.peak_bf16_flops == 312e12 and facts.intra_node_bandwidth == 300e9
    assert facts.gpu_name == "NVIDIA A100-SXM4-80GB" and facts.source == "nvml"
    assert facts.host_memory_bytes == host_memory_bytes()
    assert [g.index for g in facts.gpus] == [0, 1, 2]


@pytest.mark.parametrize(("nvml_name", "profile"), [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
    ("NVIDIA H200", "H200-141GB"),
    ("NVIDIA GeForce RTX 4090", "RTX4090-24GB"),
    ("NVIDIA L4", "L4-24GB"),
    ("NVIDIA L40S", "L40S-48GB"),
    ("NVIDIA A10", "A10-24GB"),
])
def test_nvml_names_map_to_profiles(nvml_name, profile):
    nvml = FakeNVML([(nvml_name, UUIDS[0], 20 * GiB, 20 * GiB)])
    facts = hardware_facts(HardwareConfig(), nvml=nvml, environ={})
    assert facts.peak_bf16_flops == PROFILES[profile].peak_bf16_flops
    assert facts.intra_node_bandwidth == PROFILES[profile].intra_node_bandwidth
    assert facts.gpu_memory_bytes == 20 * GiB  # measured, not the profile's


def test_unknown_and_mixed_gpus_get_the_conservative_numbers():
    unknown = FakeNVML([("NVIDIA A10G", UUIDS[0], 22 * GiB, 22 * GiB)])
    assert hardware_facts(HardwareConfig(), nvml=unknown, environ={}).peak_bf16_flops == 100e12
    mixed = FakeNVML([("NVIDIA GeForce RTX 4090", UUIDS[0], 24 * GiB, 24 * GiB),
                      ("NVIDIA GeForce RTX 3090", UUIDS[1], 24 * GiB, 23 * GiB)])
    facts = hardware_facts(HardwareConfig(), nvml=mixed, environ={})
    assert facts.peak_bf16_flops == 71e12
    assert facts.gpu_name == "NVIDIA GeForce RTX 4090 + NVIDIA GeForce RTX 3090"


@pytest.mark.parametrize(("mask", "expected"), [
    (None, [0, 1, 2]),
    ("0,2", [0, 2]),
    ("2,0", [2, 0]),  # CUDA renumbers in the listed order
    (" 1 ", [1]),
    ("1gpu", [1]),  # strtoul semantics
    ("", []),
    ("-1", []),
    ("-1,0", []),
    ("0,7,1", [0]),  # 7 is out of range: it and everything after it are ignored
    ("1,abc,2", [1]),
    ("0,0", []),  # a repeated device empties the list
    (UUIDS[2], [2]),
    (f"{UUIDS[1]},{UUIDS[0]}", [1, 0]),
    ("GPU-c0ff", [2]),  # unique prefix
    ("GPU-8f3,GPU-c0ff", []),  # ambiguous prefix is invalid and ends the list at once
    ("GPU-c0ff,GPU-dead,0", [2]),
])
def test_cuda_visible_devices(mask, expected):
    assert [g.index for g in visible_gpu_indices(mask, gpus())] == expected


def test_mig_uuid_is_refused_clearly():
    with pytest.raises(ZerotrainError, match="MIG"):
        visible_gpu_indices("MIG-GPU-8f3a0000-1111/1/0", gpus())


def test_auto_facts_follow_the_mask():
    facts = hardware_facts(HardwareConfig(), nvml=a100_node(3), environ={"CUDA_VISIBLE_DEVICES": "2,GPU-8f3b"})
    assert facts.gpus_per_node == 2
    assert [g.uuid for g in facts.gpus] == [UUIDS[2], UUIDS[1]]
    assert facts.gpu_free_bytes == 71 * GiB


def test_everything_masked_names_cuda_visible_devices():
    with pytest.raises(ZerotrainError) as err:
        hardware_facts(HardwareConfig(), nvml=a100_node(2), environ={"CUDA_VISIBLE_DEVICES": ""})
    message = str(err.value)
    assert "\n" not in message
    assert "CUDA_VISIBLE_DEVICES=''" in message and "hides all 2 GPUs" in message
    assert "--gpus 8xA100-80GB" in message


def test_missing_pynvml_gives_one_line_with_the_way_out(monkeypatch):
    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    with pytest.raises(ZerotrainError) as err:
        hardware_facts(HardwareConfig(gpus="auto"), environ={})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("hardware.gpus=auto: no GPU could be detected (pynvml")
    assert "--gpus 8xA100-80GB" in message and "--gpus 4 --gpu-memory 48GiB" in message
    assert "H100-80GB" in message


@pytest.mark.parametrize("reason", ["NVML Shared Library Not Found", "Driver Not Loaded"])
def test_nvml_init_failure_gives_one_line_with_the_reason(reason):
    nvml = a100_node()
    nvml.init_error = reason
    with pytest.raises(ZerotrainError) as err:
        hardware_facts(HardwareConfig(), nvml=nvml, environ={})
    assert "\n" not in str(err.value)
    assert f"no GPU could be detected (NVML did not start: {reason})" in str(err.value)
    assert nvml.shutdowns == 0  # nvmlShutdown without a successful nvmlInit is itself an error


def test_nvml_error_while_reading_still_shuts_down():
    nvml = a100_node()

    def lost(handle):
        raise FakeNVMLError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = lost
    with pytest.raises(ZerotrainError, match=r"NVML could not read the GPUs: GPU is lost"):
        hardware_facts(HardwareConfig(), nvml=nvml, environ={})
    assert nvml.shutdowns == 1


def test_real_pynvml_on_this_machine_either_works_or_fails_with_one_line():
    # Runs against the installed nvidia-ml-py: on CI (no driver) this is the real failure path.
    try:
        facts = hardware_facts(HardwareConfig(), environ={})
    except ZerotrainError as err:
        assert "\n" not in str(err) and "no GPU could be detected" in str(err)
    else:
        assert facts.source == "nvml" and facts.gpus_per_node >= 1


def test_profile_spec_with_nodes():
    facts = hardware_facts(HardwareConfig(gpus="8xA100-80GB", nodes=2), environ={})
    assert facts.world_size == 16 and facts.gpus_per_node == 8
    assert facts.gpu_memory_bytes == 80 * GiB and facts.gpu_free_bytes is None
    assert facts.host_memory_bytes == 1 * TiB
    assert facts.source == "profile 8xA100-80GB" and facts.gpus == ()
    assert facts.describe() == "8x A100-80GB (80.0 GiB each), 2 nodes, 1.0 TiB host RAM [profile 8xA100-80GB]"
    assert hardware_facts(HardwareConfig(gpus="8xH200-141GB"), environ={}).host_memory_bytes == 2 * TiB
    assert hardware_facts(HardwareConfig(gpus="1xRTX4090-24GB"), environ={}).host_memory_bytes == 64 * GiB


@pytest.mark.parametrize("spec", ["8xA100-80GB", "8XA100-80gb", " 8 x a100_80GB "])
def test_spec_is_case_and_separator_insensitive(spec):
    count, profile = parse_gpu_spec(spec)
    assert (count, profile) == (8, PROFILES["A100-80GB"])


def test_h100_profile_numbers():
    count, profile = parse_gpu_spec("2xH100-80GB")
    assert count == 2
    assert (profile.peak_bf16_flops, profile.intra_node_bandwidth, profile.host_to_device_bandwidth) == (
        989e12, 450e9, 50e9)


def test_gpu_memory_overrides_profile_and_detection():
    facts = hardware_facts(HardwareConfig(gpus="4xA100-40GB", gpu_memory="38GiB"), environ={})
    assert facts.gpu_memory_bytes == 38 * GiB and facts.peak_bf16_flops == 312e12
    assert "gpu_memory=38GiB" in facts.source
    detected = hardware_facts(HardwareConfig(gpu_memory="40GiB"), nvml=a100_node(), environ={})
    assert detected.gpu_memory_bytes == 40 * GiB
    assert detected.gpu_free_bytes == 40 * GiB  # free can't exceed the memory we are told to use


def test_bare_count_needs_gpu_memory_and_is_generic():
    facts = hardware_facts(HardwareConfig(gpus="4", gpu_memory="48GiB"), environ={})
    assert (facts.gpus_per_node, facts.gpu_memory_bytes) == (4, 48 * GiB)
    assert facts.peak_bf16_flops == 100e12 and facts.intra_node_bandwidth == 25e9
    with pytest.raises(ZerotrainError, match=r"hardware\.gpus: '4' is a bare GPU count.*gpu_memory"):
        hardware_facts(HardwareConfig(gpus="4"), environ={})


@pytest.mark.parametrize("spec", ["9xZ100", "0xA100-80GB", "eightxA100", "64xA100-80GB", "A100-80GB", "8x"])
def test_bad_specs_raise_one_line_naming_the_field(spec):
    with pytest.raises(ZerotrainError) as err:
        parse_gpu_spec(spec)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"hardware.gpus: '{spec}'")
    assert all(name in message for name in PROFILES)
    assert "--gpus 8xA100-80GB" in message and "--gpus 4 --gpu-memory 48GiB" in message


def test_host_memory_override():
    facts = hardware_facts(HardwareConfig(gpus="8xA100-80GB", host_memory="512GiB"), environ={})
    assert facts.host_memory_bytes == 512 * GiB
    detected = hardware_facts(HardwareConfig(host_memory="96GiB"), nvml=a100_node(), environ={})
    assert detected.host_memory_bytes == 96 * GiB


def test_host_memory_is_capped_by_a_cgroup_limit(tmp_path):
    physical = host_memory_bytes(cgroup_root=tmp_path)  # no cgroup files: physical RAM
    assert physical > 0
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory_bytes(cgroup_root=tmp_path) == physical
    (tmp_path / "memory.max").write_text(f"{physical // 2}\n")
    assert host_memory_bytes(cgroup_root=tmp_path) == physical // 2


def test_nvme_free_space(tmp_path):
    assert hardware_facts(HardwareConfig(gpus="1xL4-24GB"), environ={}).nvme_free_bytes is None
    # The offload folder need not exist yet: its drive is measured through the nearest existing parent.
    config = HardwareConfig(gpus="1xL4-24GB", nvme_path=tmp_path / "not" / "yet")
    free = hardware_facts(config, environ={}).nvme_free_bytes
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 256 * MiB
    given = HardwareConfig(gpus="1xL4-24GB", nvme_path=tmp_path, nvme_space="2TB")
    assert hardware_facts(given, environ={}).nvme_free_bytes == 2 * 10**12

