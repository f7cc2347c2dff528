"""`zerotrain doctor` on a machine without GPUs, and its GPU branches with a fake NVML (the one
test_hardware.py uses) and a faked torch.cuda."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tests.unit.test_hardware import UUIDS, FakeNVML
from zerotrain import doctor
from zerotrain.config import load_config
from zerotrain.models.catalog import resolve_model
from zerotrain.planner.measure import measure_model
from zerotrain.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"
NAMES = ["config", "versions", "libraries", "deepspeed ops", "gpus", "nccl p2p", "model", "denoiser", "plan", "gpu memory",
         "host ram", "nvme", "shm", "output"]
Usage = namedtuple("Usage", "total used free")


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    # Model facts are cached where the e2e tests keep theirs, so tiny-flux is measured once per session.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator once per process
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "NCCL_P2P_DISABLE", "CUDA_DEVICE_ORDER",
                 "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as CI sees it, whatever it has: pynvml cannot be imported, torch sees no GPU."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def tiny_run(tmp_path, *overrides, measure=True):
    run = load_config(TINY, [f"output_dir={tmp_path / 'out'}", *overrides])
    if measure:  # with the real torch, before anything is faked
        measure_model(resolve_model(run.model), run)
    return run


def by_name(checks):
    return {c.name: c for c in checks}


class FakeDriverNVML(FakeNVML):
    """test_hardware's fake NVML, plus the driver queries the versions check makes."""

    def __init__(self, devices, driver_cuda=12080):
        super().__init__(devices)
        self.driver_cuda = driver_cuda

    def nvmlSystemGetDriverVersion(self):
        return "570.86.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return self.driver_cuda


def fake_gpus(monkeypatch, count=2, free=None, torch_count=None, peer=lambda i, j: True, cuda="12.8",
              driver_cuda=12080, name="NVIDIA A100-SXM4-80GB", total=80 * GiB):
    """A node of `count` GPUs as NVML and torch.cuda report them; torch sees `torch_count` (default:
    what CUDA_VISIBLE_DEVICES leaves)."""
    free = free or [total - 600 * MiB] * count
    nvml = FakeDriverNVML([(name, UUIDS[i] if i < len(UUIDS) else f"GPU-{i:08d}", total, free[i])
                           for i in range(count)], driver_cuda)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    available = cuda is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: torch_count if torch_count is not None else count)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", peer)
    return nvml


def run_one(function, run):
    finding = function(doctor.Context(run))
    assert finding.detail and (finding.verdict == "ok" or finding.verdict == "skip" or finding.advice), finding
    return finding


# ---- this machine: no GPU, no NVML ----

def test_without_gpus_every_check_answers_sensibly(tmp_path, no_gpu):
    checks = doctor.run_checks(tiny_run(tmp_path), config_path=TINY)
    assert [c.name for c in checks] == NAMES
    found = by_name(checks)
    for c in checks:
        assert c.verdict in ("ok", "warn", "fail", "skip") and c.detail
        assert "the check itself failed" not in c.detail, c
        assert c.verdict in ("ok", "skip") or c.advice, c
    assert found["versions"].verdict == "ok" and "CPU-only here" in found["versions"].detail
    assert found["gpus"].verdict == "skip" and found["gpus"].detail.startswith("no GPU visible (NVML absent")
    assert found["gpu memory"].verdict == "skip" and found["gpu memory"].detail.startswith("no GPU visible (NVML absent")
    assert found["nccl p2p"].verdict == "skip"
    # tiny-cpu.yaml names its GPU (gpus: 1, gpu_memory: 8GiB), so there is a plan to check against.
    assert found["plan"].verdict == "ok" and "ZeRO-" in found["plan"].detail
    assert found["host ram"].verdict == "ok" and "model load" in found["host ram"].detail
    assert found["nvme"].verdict == "skip" and "nvme_path unset" in found["nvme"].detail
    assert found["shm"].verdict == "ok" and found["output"].verdict == "ok"
    assert found["model"].verdict == "ok" and "built locally" in found["model"].detail
    assert "accelerator cpu" in found["deepspeed ops"].detail and "fused_adam" in found["deepspeed ops"].detail
    assert doctor.exit_code(checks) == max(doctor.EXIT_CODES[c.verdict] for c in checks)


def test_gpus_auto_without_gpus_skips_the_plan_and_what_depends_on_it(tmp_path, no_gpu):
    run = tiny_run(tmp_path, "hardware.gpus=auto", "hardware.gpu_memory=null")
    found = by_name(doctor.run_checks(run))
    assert found["plan"].verdict == "skip" and "hardware.gpus=auto" in found["plan"].detail
    assert found["host ram"].verdict == "skip" and "RAM here" in found["host ram"].detail
    assert "no plan here" in found["deepspeed ops"].detail
    assert found["output"].verdict == "ok"  # the checkpoint size needs the model, not the GPUs


@pytest.mark.parametrize(("verdicts", "code"), [([], 0), (["ok", "skip"], 0), (["ok", "warn", "skip"], 1),
                                                (["warn", "fail", "ok"], 2)])
def test_exit_codes(verdicts, code):
    assert doctor.exit_code([doctor.Check(str(i), v, "x") for i, v in enumerate(verdicts)]) == code


def test_a_check_that_raises_becomes_a_warning_and_the_rest_still_run(tmp_path, no_gpu, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "CHECKS", [("broken", broken), *[c for c in doctor.CHECKS if c[0] == "model"]])
    checks = doctor.run_checks(tiny_run(tmp_path))
    assert [(c.name, c.verdict) for c in checks] == [("broken", "warn"), ("model", "ok")]
    assert "RuntimeError: boom" in checks[0].detail and "--debug" in checks[0].advice
    with pytest.raises(RuntimeError, match="boom"):
        doctor.run_checks(tiny_run(tmp_path), debug=True)


def parse(*argv):
    parser = argparse.ArgumentParser()
    doctor.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["doctor", *argv])


def test_json_lists_every_check_with_a_summary(tmp_path, no_gpu, capsys):
    code = doctor.main(parse("--config", str(TINY), "--set", f"output_dir={tmp_path}", "--gpus", "2xH100-80GB",
                             "--json"))
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["checks"]] == NAMES
    assert set(report["checks"][0]) == {"name", "verdict", "detail", "advice"}
    assert report["summary"]["exit_code"] == code
    assert sum(report["summary"][v] for v in ("ok", "warn", "fail", "skip")) == len(NAMES)
    plan = next(c for c in report["checks"] if c["name"] == "plan")
    assert "2x H100-80GB" in plan["detail"]  # the flag reached the config


def test_table_names_each_verdict_and_the_exit_code(tmp_path, no_gpu, capsys):
    code = doctor.main(parse("--config", str(TINY), "--set", f"output_dir={tmp_path}"))
    out = capsys.readouterr().out
    assert "zerotrain doctor" in out and "nccl p2p" in out and "skip" in out
    assert "gpu_memory=8GiB]" in out  # "[profile 1, gpu_memory=8GiB]" printed as text, not taken for markup
    assert out.rstrip().endswith(f"exit {code}")


def test_a_bad_config_is_one_failing_check(capsys):
    code = doctor.main(parse("--config", str(TINY), "--set", "training.global_batch_size=0", "--json"))
    report = json.loads(capsys.readouterr().out)
    assert code == 2 and [c["name"] for c in report["checks"]] == ["config"]
    assert "training.global_batch_size" in report["checks"][0]["detail"]


def test_json_is_the_only_thing_on_stdout_of_a_fresh_process(tmp_path):
    # A fresh process, so that DeepSpeed is imported (and binds its logger) inside the doctor.
    code = ("import argparse, sys, zerotrain.doctor as d; p = argparse.ArgumentParser(); "
            "d.add_parser(p.add_subparsers(dest='command')); sys.exit(d.main(p.parse_args(sys.argv[1:])))")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed then logs its choice
    result = subprocess.run([sys.executable, "-c", code, "doctor", "--config", str(TINY), "--set",
                             f"output_dir={tmp_path}", "--json"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120, check=False)
    report = json.loads(result.stdout)
    assert result.returncode == report["summary"]["exit_code"] in (0, 1, 2), result.stderr


# ---- GPU branches, faked ----

def test_cuda_visible_devices_beyond_the_gpus_fails_with_the_launcher_advice(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path))
    assert finding.verdict == "fail"
    assert "lists 4 GPUs but this node has 2" in finding.detail and "invalid device ordinal" in finding.detail
    assert "deepspeed --include localhost:0,1" in finding.advice


@pytest.mark.parametrize(("mask", "expected"), [("0,0", "twice"), ("", "hides all 2 GPUs")])
def test_a_mask_that_hides_every_gpu_fails(tmp_path, monkeypatch, mask, expected):
    fake_gpus(monkeypatch, count=2, torch_count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path))
    assert finding.verdict == "fail" and expected in finding.detail


def test_torch_seeing_fewer_gpus_than_nvml_fails(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=4, torch_count=2)
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path, "hardware.gpus=auto"))
    assert finding.verdict == "fail" and "torch sees 2 GPU(s) where NVML and CUDA_VISIBLE_DEVICES give 4" in finding.detail


def test_more_launcher_processes_than_gpus_fails(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path, "hardware.gpus=auto"))
    assert finding.verdict == "fail" and "--nproc_per_node 2" in finding.advice


def test_matching_gpus_are_ok_and_a_profile_for_other_gpus_warns(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, torch_count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path, "hardware.gpus=auto"))
    assert finding.verdict == "ok" and "2 visible" in finding.detail and "--include localhost:0,1" in finding.detail
    # tiny-cpu.yaml plans for 1 GPU, but 2 are here.
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path))
    assert finding.verdict == "warn" and "plans for 1 GPU(s) per node" in finding.detail


def test_mixed_gpus_need_pci_bus_order(tmp_path, monkeypatch):
    nvml = fake_gpus(monkeypatch, count=2)
    nvml.devices[1] = ("NVIDIA GeForce RTX 3090", nvml.devices[1][1], 24 * GiB, 23 * GiB)
    run = tiny_run(tmp_path, "hardware.gpus=auto")
    finding = run_one(doctor.check_gpus, run)
    assert finding.verdict == "warn" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in finding.advice
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert run_one(doctor.check_gpus, run).verdict == "ok"


def test_missing_peer_access_warns_with_the_nccl_variables(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, peer=lambda i, j: False)
    run = tiny_run(tmp_path)
    finding = run_one(doctor.check_p2p, run)
    assert finding.verdict == "warn" and "2 of 2 GPU pairs" in finding.detail
    assert "NCCL_P2P_DISABLE=1" in finding.advice and "NCCL_P2P_LEVEL" in finding.advice
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert run_one(doctor.check_p2p, run).verdict == "ok"


def test_peer_access_everywhere_is_ok_and_one_gpu_is_skipped(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=4)
    run = tiny_run(tmp_path)
    finding = run_one(doctor.check_p2p, run)
    assert finding.verdict == "ok" and "all 12 GPU pairs" in finding.detail
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert run_one(doctor.check_p2p, run).verdict == "warn"
    fake_gpus(monkeypatch, count=1)
    assert run_one(doctor.check_p2p, run).verdict == "skip"


def test_memory_held_by_another_process_fails_naming_both_numbers(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, total=8 * GiB, free=[8 * GiB - 500 * MiB, 512 * MiB])
    run = tiny_run(tmp_path, "hardware.gpus=auto", "hardware.gpu_memory=null")
    need = doctor.Context(run).idle_plan.chosen.memory.device_total
    finding = run_one(doctor.check_gpu_memory, run)
    assert finding.verdict == "fail"
    assert "GPU 1" in finding.detail and "512.0 MiB free of 8.0 GiB" in finding.detail
    assert f"needs {doctor.base._size(need)} per GPU" in finding.detail
    assert "nvidia-smi" in finding.advice


def test_memory_enough_for_a_slower_plan_only_warns(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=1, total=8 * GiB)
    run = tiny_run(tmp_path, "hardware.gpus=auto", "hardware.gpu_memory=null")
    idle = doctor.Context(run).idle_plan
    smallest = min(c.memory.device_total for c in idle.candidates)
    assert smallest < idle.chosen.memory.device_total  # checkpointing needs less: a slower plan exists
    between = (smallest + idle.chosen.memory.device_total) // 2
    fake_gpus(monkeypatch, count=1, total=8 * GiB, free=[int(between / (1 - run.planner.headroom))])
    finding = run_one(doctor.check_gpu_memory, run)
    assert finding.verdict == "warn" and "falls back to" in finding.detail


def test_idle_gpus_are_ok(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, total=8 * GiB)
    finding = run_one(doctor.check_gpu_memory, tiny_run(tmp_path))
    assert finding.verdict == "ok" and "GPU 1: 7.4 GiB free of 8.0 GiB" in finding.detail


def test_cpu_only_torch_on_a_gpu_node_fails_with_the_pip_command(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, cuda=None, driver_cuda=12040)
    finding = run_one(doctor.check_versions, tiny_run(tmp_path))
    assert finding.verdict == "fail" and "CPU build but NVML sees 2 NVIDIA GPU(s)" in finding.detail
    assert "--index-url https://download.pytorch.org/whl/cu124" in finding.advice


@pytest.mark.parametrize(("cuda", "driver_cuda", "verdict"), [("12.8", 12080, "ok"), ("12.8", 12040, "warn"),
                                                              ("13.0", 12080, "fail")])
def test_torch_cuda_against_the_driver(tmp_path, monkeypatch, cuda, driver_cuda, verdict):
    fake_gpus(monkeypatch, count=1, cuda=cuda, driver_cuda=driver_cuda)
    finding = run_one(doctor.check_versions, tiny_run(tmp_path))
    assert finding.verdict == verdict and "driver 570.86.15" in finding.detail


def test_every_check_answers_on_a_faked_gpu_node(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, count=2, total=8 * GiB)
    checks = doctor.run_checks(tiny_run(tmp_path, "hardware.gpus=auto", "hardware.gpu_memory=null"))
    assert [c.name for c in checks] == NAMES
    assert all("the check itself failed" not in c.detail for c in checks), checks
    found = by_name(checks)
    assert (found["gpus"].verdict, found["nccl p2p"].verdict, found["gpu memory"].verdict) == ("ok", "ok", "ok")
    assert "2x NVIDIA A100-SXM4-80GB" in found["plan"].detail
    assert found["deepspeed ops"].verdict == "warn" and "DS_ACCELERATOR" in found["deepspeed ops"].advice


# ---- host and disks ----

def test_small_shm_warns_with_the_docker_flags(tmp_path, no_gpu, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: Usage(64 * MiB, 0, 64 * MiB) if str(p) == "/dev/shm" else real(p))
    finding = run_one(doctor.check_shm, tiny_run(tmp_path, "data.num_workers=4"))
    assert finding.verdict == "warn" and "64.0 MiB free" in finding.detail and "4.0 GiB" in finding.detail
    assert "--ipc=host" in finding.advice and "--shm-size=16g" in finding.advice
    assert run_one(doctor.check_shm, tiny_run(tmp_path, "data.num_workers=0")).verdict == "ok"


def test_output_under_a_file_or_on_a_file_fails(tmp_path, no_gpu):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    finding = run_one(doctor.check_output, tiny_run(tmp_path, f"output_dir={blocker / 'run'}"))
    assert finding.verdict == "fail" and "is a file" in finding.detail
    assert run_one(doctor.check_output, tiny_run(tmp_path, f"output_dir={blocker}")).verdict == "fail"
    finding = run_one(doctor.check_output, tiny_run(tmp_path, f"output_dir={tmp_path / 'new' / 'run'}"))
    assert finding.verdict == "ok" and "to be created in" in finding.detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_output_in_a_read_only_folder_fails(tmp_path, no_gpu):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    finding = run_one(doctor.check_output, tiny_run(tmp_path, f"output_dir={locked / 'run'}"))
    assert finding.verdict == "fail" and "cannot write" in finding.detail


def test_output_disk_space_against_the_checkpoints(tmp_path, no_gpu, monkeypatch):
    run = tiny_run(tmp_path)
    from zerotrain import optimizers

    ctx = doctor.Context(run)
    # the plan's optimizer's bytes per trainable parameter (fp32 AdamW here: weights 2, master 4, moments 8)
    assert optimizers.get(ctx.plan.chosen.layout.optimizer).checkpoint_bytes_per_param() == 14
    checkpoint = 14 * ctx.facts.trainable_params
    real = shutil.disk_usage
    for free, verdict in ((checkpoint // 2, "fail"), (2 * checkpoint, "warn"), (100 * checkpoint, "ok")):
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: Usage(10**12, 0, free)
                            if str(p).startswith(str(tmp_path)) else real(p))
        assert run_one(doctor.check_output, run).verdict == verdict


def test_host_ram_against_the_plan(tmp_path, no_gpu, monkeypatch):
    run = tiny_run(tmp_path)
    need = doctor.Context(run).plan.chosen.memory.host_per_node
    monkeypatch.setattr(doctor.host, "host_memory_bytes", lambda: need // 2)
    assert run_one(doctor.check_host_ram, run).verdict == "fail"
    monkeypatch.setattr(doctor.host, "host_memory_bytes", lambda: need * 4)
    monkeypatch.setattr(doctor.host, "available_host_memory", lambda: need // 2)
    assert run_one(doctor.check_host_ram, run).verdict == "warn"
    monkeypatch.setattr(doctor.host, "available_host_memory", lambda: need * 2)
    assert run_one(doctor.check_host_ram, run).verdict == "ok"


def test_nvme_space_against_the_plan(tmp_path, no_gpu, monkeypatch):
    nvme = tmp_path / "nvme"
    finding = run_one(doctor.check_nvme, tiny_run(tmp_path, f"hardware.nvme_path={nvme}"))
    assert finding.verdict == "ok" and "does not offload to NVMe" in finding.detail
    # The planner is told 1TB (nvme_space) and must use NVMe; the drive has far less.
    run = tiny_run(tmp_path, f"hardware.nvme_path={nvme}", "hardware.nvme_space=1TB", "planner.stages=[3]",
                   "planner.offload=[nvme]")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 0, 1024) if str(p).startswith(str(tmp_path))
                        else real(p))
    finding = run_one(doctor.check_nvme, run)
    assert finding.verdict == "fail" and "hardware.nvme_space=1TB" in finding.detail


# ---- the model ----

def test_tiny_models_are_built_locally(tmp_path, no_gpu):
    assert run_one(doctor.check_model, tiny_run(tmp_path)).verdict == "ok"


def test_a_missing_local_folder_fails(tmp_path, no_gpu):
    finding = run_one(doctor.check_model, tiny_run(tmp_path, f"model.name_or_path={tmp_path / 'no-such-model'}",
                                                           measure=False))
    assert finding.verdict == "fail" and "no such folder" in finding.detail


def test_a_local_folder_is_checked_for_every_file_training_reads(tmp_path, tmp_path_factory, no_gpu):
    """A folder missing its scheduler, or its denoiser's weights, fails doctor as it would fail the run (before
    the cache build), naming what is missing."""
    from tests.unit.tiny_family import tiny_root
    from zerotrain.models.tiny import ensure_tiny_pipeline

    folder = shutil.copytree(ensure_tiny_pipeline("tiny-flux", tiny_root(tmp_path_factory)), tmp_path / "model")
    run = tiny_run(tmp_path, f"model.name_or_path={folder}")
    assert run_one(doctor.check_model, run).verdict == "ok"
    shutil.rmtree(folder / "scheduler")
    finding = run_one(doctor.check_model, run)
    assert finding.verdict == "fail" and "lacks scheduler/" in finding.detail, finding
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text("{}")
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    finding = run_one(doctor.check_model, run)
    assert finding.verdict == "fail" and "lacks transformer/ weights" in finding.detail, finding


FLUX_COMPONENTS = {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
                   "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                   "tokenizer_2": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "FluxTransformer2DModel"],
                   "vae": ["diffusers", "AutoencoderKL"], "image_encoder": [None, None]}
FLUX_FILES = ["scheduler/scheduler_config.json", "text_encoder/config.json", "text_encoder/model.safetensors",
              "text_encoder_2/config.json", "text_encoder_2/model.safetensors", "tokenizer/vocab.json",
              "tokenizer_2/spiece.model", "transformer/config.json", "vae/config.json",
              "vae/diffusion_pytorch_model.safetensors"]


def fill_hub_cache(hub: Path, repo: str, files: list[str]) -> None:
    """The hub cache's layout as a hand-made download leaves it: refs/main names a snapshot holding the files
    (a pipeline index of FLUX.1's components), and no tree listing (huggingface_hub's trees/)."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    for name in ["model_index.json", *files]:
        path = root / "snapshots" / ("0" * 40) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"_class_name": "FluxPipeline", **FLUX_COMPONENTS}) if name == "model_index.json"
                        else "{}")


def test_a_catalog_model_in_the_hub_cache_is_checked_offline(tmp_path, no_gpu, monkeypatch):
    """Offline, doctor reads the hub cache the run would read: the denoiser's weights or the scheduler missing
    is a fail naming them (the run would stop before its cache build); every file there is ok."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = resolve_model(load_config(None, ["model.name_or_path=flux-dev"]).model).pretrained
    run = load_config(None, ["model.name_or_path=flux-dev"])
    fill_hub_cache(tmp_path / "hf" / "hub", repo, [f for f in FLUX_FILES if not f.startswith("scheduler/")])
    finding = run_one(doctor.check_model, run)
    assert finding.verdict == "fail" and "transformer/ weights" in finding.detail and "scheduler/" in finding.detail
    assert "HF_HUB_OFFLINE" in finding.detail and str(tmp_path / "hf" / "hub") in finding.detail
    shutil.rmtree(tmp_path / "hf")
    fill_hub_cache(tmp_path / "hf" / "hub", repo, [*FLUX_FILES, "transformer/diffusion_pytorch_model.safetensors"])
    finding = run_one(doctor.check_model, run)
    assert finding.verdict == "ok" and repo in finding.detail, finding


def test_libraries_are_reported_against_the_tested_versions(tmp_path, monkeypatch):
    """deepspeed, diffusers, peft, optimum-quanto and torch with the versions zerotrain was tested with;
    an untested DeepSpeed warns that the buffer sharing is off, with the version to install."""
    from zerotrain import versions

    run = tiny_run(tmp_path, measure=False)
    finding = doctor.check_libraries(doctor.Context(run, environ={}))
    assert finding.verdict == "ok", finding
    for name in ("torch", "deepspeed", "diffusers", "peft", "optimum-quanto"):
        assert f"{name} {versions.installed(name)} (tested)" in finding.detail
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "0.20.0" if name == "deepspeed" else real(name))
    finding = doctor.check_libraries(doctor.Context(run, environ={}))
    assert finding.verdict == "warn"
    assert "deepspeed 0.20.0 (untested; tested: 0.19.8)" in finding.detail and "buffer sharing is off" in finding.detail
    assert "'deepspeed==0.19.8'" in finding.advice
    monkeypatch.setattr(versions, "installed", real)
    finding = doctor.check_libraries(doctor.Context(run, environ={"DS_PIN_MEMORY_BACKEND": "native"}))
    assert finding.verdict == "warn" and finding.advice == "unset DS_PIN_MEMORY_BACKEND"


def test_the_denoiser_check_says_where_a_fine_tune_is_and_what_the_run_does_with_it(tmp_path, tmp_path_factory,
                                                                                   no_gpu):
    """No model.denoiser: skip. A local file: its size, and that each node checks and links or converts it into
    data.cache_dir/models before the cache build. A diffusers folder: its architecture, linked. A LoRA: fail."""
    from safetensors.torch import save_file

    from tests.unit.tiny_family import tiny_root
    from zerotrain.models.tiny import ensure_tiny_pipeline

    assert run_one(doctor.check_denoiser, tiny_run(tmp_path)).verdict == "skip"
    folder = ensure_tiny_pipeline("tiny-flux", tiny_root(tmp_path_factory))
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    run = tiny_run(tmp_path, f"model.denoiser={file}")
    finding = run_one(doctor.check_denoiser, run)
    assert finding.verdict == "ok" and f"{file} (" in finding.detail, finding
    assert str(run.data.cache_dir / "models") in finding.detail, finding
    finding = run_one(doctor.check_denoiser, tiny_run(tmp_path, f"model.denoiser={folder / 'transformer'}"))
    assert finding.verdict == "ok" and "diffusers folder" in finding.detail, finding
    save_file({"x_embedder.lora_A.weight": torch.zeros(1, 1)}, tmp_path / "lora.safetensors")
    finding = run_one(doctor.check_denoiser, tiny_run(tmp_path, f"model.denoiser={tmp_path / 'lora.safetensors'}",
                                                      measure=False))
    assert finding.verdict == "fail" and "is an adapter" in finding.detail, finding


@pytest.mark.parametrize(("local_rank", "mask", "verdict"), [("3", "3", "ok"), ("3", "2,3", "fail"), ("1", "0,1", "ok")])
def test_doctor_checks_the_local_rank_against_the_gpus_this_task_sees(tmp_path, monkeypatch, local_rank, mask, verdict):
    """Issue 48 §5: with one GPU per task (srun --gpus-per-task=1: LOCAL_RANK 3 sees one GPU) the task's GPU is its
    own; seeing 2 with LOCAL_RANK 3 is 'invalid device ordinal', named with both numbers."""
    fake_gpus(monkeypatch, count=4, torch_count=len(mask.split(",")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    finding = run_one(doctor.check_gpus, tiny_run(tmp_path, f"hardware.gpus={len(mask.split(','))}",
                                                  "hardware.gpu_memory=80GiB"))
    assert finding.verdict == verdict, finding
    if verdict == "fail":
        assert "LOCAL_RANK=3, but this process sees 2 GPUs (CUDA_VISIBLE_DEVICES=2,3)" in finding.detail, finding
