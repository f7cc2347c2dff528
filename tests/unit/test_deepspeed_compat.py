"""zerotrain.deepspeed_compat: the tested-version gate, the one flag the planner and the engine read,
and the rule that no other module reaches into DeepSpeed's private state."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from zerotrain import deepspeed_compat, versions
from zerotrain.planner import memory
from zerotrain.planner.memory import Buffers, Layout, Sizes

REPO = Path(__file__).resolve().parents[2]
TESTED_DS = versions.TESTED["deepspeed"][0]


def test_the_gate_allows_sharing_only_on_a_tested_version_without_native_pinning():
    assert deepspeed_compat.buffer_sharing(TESTED_DS, environ={}).enabled
    newer = deepspeed_compat.buffer_sharing("0.19.9", environ={})
    assert not newer.enabled and "0.19.9" in newer.why and TESTED_DS in newer.why
    native = deepspeed_compat.buffer_sharing(TESTED_DS, environ={"DS_PIN_MEMORY_BACKEND": "native"})
    assert not native.enabled and "DS_PIN_MEMORY_BACKEND=native" in native.why
    assert deepspeed_compat.buffer_sharing(TESTED_DS, environ={"DS_PIN_MEMORY_BACKEND": "torch"}).enabled


def test_an_untested_deepspeed_switches_sharing_off_once_and_the_planner_counts_the_copies(monkeypatch, capsys):
    """The planner's Buffers take the same flag the engine's initialize reads (sharing_in_force)."""
    from zerotrain.config import RunConfig
    from zerotrain.planner.search import buffers_from

    run = RunConfig.model_validate({"model": {"name_or_path": "tiny-flux"}})
    deepspeed_compat.sharing_in_force.cache_clear()
    monkeypatch.setattr(versions, "installed", lambda name: "0.20.1" if name == "deepspeed" else None)
    try:
        assert buffers_from(run).shares_copies is False
        assert buffers_from(run).shares_copies is False
        warnings = [line for line in capsys.readouterr().err.splitlines() if "buffer sharing off" in line]
        assert len(warnings) == 1 and "DeepSpeed 0.20.1" in warnings[0]
    finally:
        deepspeed_compat.sharing_in_force.cache_clear()
    monkeypatch.undo()
    assert buffers_from(run).shares_copies is True


SIZES = Sizes(trainable_params=10**9, frozen_bytes=0, frozen_shardable=True, largest_layer_params=10**7,
              buffer_bytes=0, world_size=2, gpus_per_node=2, largest_trainable_param=10**7)


@pytest.mark.parametrize(("layout", "term", "more"), [
    # ZeRO-3 on the GPU: the bf16 master is a second copy of the partition (2 B per parameter / world)
    (Layout(3, optimizer="adamw-bf16"), "gpu", 10**9),
    # ZeRO 1/2 offloaded: DeepSpeed's pinned bf16 upload copy beside the bf16 master
    (Layout(2, offload_optimizer="cpu", optimizer="adamw-bf16"), "host", 10**9),
    # ZeRO-3 with the parameters offloaded: the master clone and its gradient buffer
    (Layout(3, offload_optimizer="cpu", offload_param="cpu", optimizer="adamw-bf16"), "host", 2 * 10**9),
])
def test_unshared_buffers_cost_what_deepspeed_keeps(layout, term, more):
    def cost(b: Buffers) -> int:
        if term == "gpu":
            return memory.master_weights(layout, SIZES, b)
        return sum(sum(x.sizes) for x in memory.offload_buffers(layout, SIZES, b))

    assert cost(Buffers(shares_copies=False)) - cost(Buffers()) == more


def test_fp32_adamw_is_unchanged_by_the_flag():
    layout = Layout(3, offload_optimizer="cpu", offload_param="cpu")
    assert memory.offload_buffers(layout, SIZES, Buffers()) == memory.offload_buffers(
        layout, SIZES, Buffers(shares_copies=False))


# DeepSpeed's private names and modules: only deepspeed_compat may use them. deepspeed.runtime.config
# (DeepSpeedConfig, DeepSpeed's own validation of a config) is the one deepspeed.runtime import
# allowed elsewhere.
PRIVATE = re.compile(r"_hp_mapping|checkpoint_engine|ds_opt_adam|multi_tensor_adam|_create_fp32_partitions|"
                     r"set_grad_positions|fp32_partitioned_groups_flat|single_partition_of_fp32_groups|"
                     r"param_buffer_of_bit16|grad_partitions_flat_buffer|_partition_all_parameters|"
                     r"git_version_info|(?<![a-z_])op_builder|ds_to_universal\.main|_host_emptyCache")
ALLOWED_RUNTIME = {"deepspeed.runtime.config"}


def private_reaches(root: Path) -> list[str]:
    """Every private DeepSpeed name or deepspeed.runtime import outside the deepspeed_compat package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "deepspeed_compat" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = None
            if isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.ImportFrom):
                text = node.module or ""
                if text.startswith("deepspeed.runtime") and text not in ALLOWED_RUNTIME:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {text}")
            if text and PRIVATE.search(text):
                found.append(f"{path.relative_to(root)}:{node.lineno} {text}")
    return found


def test_no_other_module_reaches_into_deepspeed_internals():
    offenders = private_reaches(REPO / "zerotrain")
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_a_private_reach(tmp_path):
    (tmp_path / "ema.py").write_text("def f(p):\n    return p._hp_mapping\n")
    (tmp_path / "save.py").write_text("from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3\n")
    (tmp_path / "deepspeed_compat").mkdir()
    (tmp_path / "deepspeed_compat" / "checkpoints.py").write_text("def f(e):\n    return e.checkpoint_engine\n")
    assert private_reaches(tmp_path) == ["ema.py:2 _hp_mapping",
                                         "save.py:1 imports deepspeed.runtime.zero.stage3"]


def test_build_ops_compiles_what_training_loads_into_torchs_extension_cache():
    """`zerotrain build-ops` on this machine's CPU accelerator: every op training loads is compiled (or
    skipped with DeepSpeed's reason: async_io without libaio) into the extension cache a run loads from.
    Where .ci/run built them already, this finds them built and takes seconds."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "zerotrain.cli", "build-ops"], capture_output=True, text=True, env=env,
                          timeout=1200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if not line.startswith("building "))
    assert set(lines) == {"cpu_adam", "fused_adam", "async_io", "deepspeed_shm_comm", "pin_memory"}, done.stdout
    for name, line in lines.items():
        if name == "async_io":  # NVMe offload's alone: left to its first run, or built with --all / by name
            assert line.startswith("not built (only NVMe offload loads it"), line
            continue
        assert line.startswith("built ("), line
        assert list(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so")), name


def test_build_ops_says_what_it_compiles_as_it_starts(tmp_path):
    """Into an empty extension cache, `zerotrain build-ops pin_memory` prints that it is building it (once per machine,
    how long) before the compile, and what it built after; an op named alone leaves nothing else to report."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "zerotrain.cli", "build-ops", "pin_memory"], capture_output=True,
                          text=True, env=env, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "building pin_memory: once per machine, about 30 s on 2 CPU cores ...", done.stdout
    assert lines[1].startswith("pin_memory: built (") and len(lines) == 2, done.stdout


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_young_one_is_waited_for(tmp_path, monkeypatch, capsys):
    """torch's FileBaton waits forever on a lock a killed build left: build_ops waits on a young one, naming it,
    until it goes (a running build finishing) or is old enough that no build holds it, then removes it."""
    import os
    import threading

    from zerotrain.ops import STALE_BUILD_LOCK_S, clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert clear_stale_build_lock("cpu_adam") is None  # no lock: nothing to say
    assert capsys.readouterr().err == ""
    lock = tmp_path / "cpu_adam" / "lock"
    lock.touch()
    finisher = threading.Timer(0.3, lock.unlink)  # the build that holds it finishes
    finisher.start()
    assert clear_stale_build_lock("cpu_adam", poll_s=0.05) is None and not lock.exists()
    finisher.join()
    assert f"waiting for {lock}, another build of cpu_adam" in capsys.readouterr().err
    lock.touch()
    os.utime(lock, (lock.stat().st_atime, lock.stat().st_mtime - STALE_BUILD_LOCK_S - 60))
    assert clear_stale_build_lock("cpu_adam") == lock and not lock.exists()
    assert f"removed {lock}, left 31 min ago by a build of cpu_adam that did not finish" in capsys.readouterr().err


# ---- the line a run prints before DeepSpeed compiles an op just in time (issue 38, section 7) ----

def failing_compiler(folder: Path) -> tuple[Path, Path]:
    """A C++ compiler that answers torch's version and ABI questions as the machine's c++ does and fails
    every compile and link at once, writing down that it was asked: the build starts for real and ends in
    milliseconds instead of minutes. Returns the compiler and the file its compile calls go to."""
    calls = folder / "compile-calls"
    cxx = folder / "c++"
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -v|--version|-dumpversion|-dumpfullversion) '
                   'exec c++ "$@";; esac; done\necho "$@" >> ' + str(calls) + "\nexit 1\n")
    cxx.chmod(0o755)
    return cxx, calls


def test_a_run_says_which_op_it_compiles_before_the_build_starts(tmp_path, monkeypatch):
    """engine.cpu_adam_unavailable (calibrate's offload layouts; deepspeed_compat.initialize and
    init_distributed call the same say_jit_builds) on an empty extension cache: the line is on stderr
    before the compiler is first called, and then the build runs (and fails here, at its first compile)."""
    import io
    import sys

    from zerotrain.engine import cpu_adam_unavailable

    cxx, calls = failing_compiler(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    class Witness(io.StringIO):
        """stderr, noting for each write whether the compiler had been called yet."""

        def __init__(self) -> None:
            super().__init__()
            self.writes: list[tuple[str, bool]] = []

        def write(self, text: str) -> int:
            self.writes.append((text, calls.exists()))
            return super().write(text)

    witness = Witness()
    monkeypatch.setattr(sys, "stderr", witness)
    error = cpu_adam_unavailable()
    monkeypatch.undo()
    said = [(text, compiled) for text, compiled in witness.writes if "compiling DeepSpeed's" in text]
    assert len(said) == 1, witness.getvalue()[-2000:]
    text, compiled_before = said[0]
    assert not compiled_before, "the line came after the build had started"
    assert (f"zerotrain: compiling DeepSpeed's cpu_adam op before the run goes on, once per machine (and Python and "
            f"torch build), 1 to 5 minutes on 2 CPU cores, into {tmp_path / 'extensions' / 'cpu_adam'}; "
            "`zerotrain build-ops` compiles the ops ahead") in text
    assert calls.exists() and "cpu_adam" in calls.read_text(), "the build never reached the compiler"
    assert error is not None and "DeepSpeedCPUAdam's op does not build here" in error


def test_nothing_is_said_for_an_op_built_in_the_cache_and_one_line_once_it_would_rebuild(tmp_path, monkeypatch,
                                                                                          capsys):
    """The check is torch's and ninja's own: pin_memory as `zerotrain build-ops` left it (copied into an
    extension cache of its own) is built; without its .so, or with its build command changed (ninja would
    compile again), it is not; on a DeepSpeed not tested nothing is claimed."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory("pin_memory", False))
    if not (built / "pin_memory.so").exists():
        pytest.skip(f"pin_memory is not built in {built}: run `zerotrain build-ops` (as .ci/run does)")
    cache = tmp_path / "extensions"
    shutil.copytree(built, cache / "pin_memory", ignore=shutil.ignore_patterns("lock"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert deepspeed_compat.say_jit_builds(["pin_memory"]) == []
    assert "compiling" not in capsys.readouterr().err
    ninja = cache / "pin_memory" / "build.ninja"
    ninja.write_text(ninja.read_text().replace("cflags = ", "cflags = -DZEROTRAIN_CHANGED ", 1))
    assert deepspeed_compat.say_jit_builds(["pin_memory"]) == ["pin_memory"]
    ninja.write_text(ninja.read_text().replace("cflags = -DZEROTRAIN_CHANGED ", "cflags = ", 1))
    assert deepspeed_compat.say_jit_builds(["pin_memory"]) == []
    (cache / "pin_memory" / "pin_memory.so").unlink()
    assert deepspeed_compat.say_jit_builds(["pin_memory"]) == ["pin_memory"]
    line = (f"zerotrain: compiling DeepSpeed's pin_memory op before the run goes on, once per machine (and Python and "
            f"torch build), about 30 s on 2 CPU cores, into {cache / 'pin_memory'}; `zerotrain build-ops` compiles the "
            "ops ahead")
    assert [said for said in capsys.readouterr().err.splitlines() if "compiling" in said] == [line, line]
    monkeypatch.setenv("LOCAL_RANK", "1")  # the machine's first process says it, the others not
    assert deepspeed_compat.say_jit_builds(["pin_memory"]) == []
    monkeypatch.setattr(versions, "installed", lambda name: "0.20.1" if name == "deepspeed" else None)
    assert deepspeed_compat.jit_builds(["pin_memory"]) is None


@pytest.mark.parametrize(("config", "client", "ops"), [
    ({"optimizer": {"type": "AdamW", "params": {}}, "zero_optimization": {"stage": 2}}, False, ["fused_adam"]),
    ({"optimizer": {"type": "AdamW", "params": {}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, False, ["cpu_adam"]),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True}},
      "zero_optimization": {"stage": 1}}, False, []),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}},
     True, ["async_io"]),
    ({"optimizer": {"type": "AdamW", "params": {}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}},
     False, ["cpu_adam", "async_io"]),
])
def test_initialize_names_the_ops_deepspeed_loads_for_a_config(config, client, ops):
    assert deepspeed_compat.initialize_ops(config, object() if client else None) == ops


def test_doctor_says_whether_the_plans_op_is_built_on_this_machine(tmp_path, tmp_path_factory, monkeypatch):
    """`zerotrain doctor` asks the same check: tiny-cpu.yaml's plan steps DeepSpeed's AdamW (fused_adam) on
    the accelerator, built in the cache `zerotrain build-ops` filled, and not in an empty one."""
    from torch.utils.cpp_extension import _get_build_directory

    from zerotrain import doctor
    from zerotrain.config import load_config

    # tiny-flux's facts where test_doctor and the e2e tests keep them: measured once per session.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    run = load_config(REPO / "examples" / "tiny-cpu.yaml", [f"output_dir={tmp_path / 'out'}"])
    if (Path(_get_build_directory("fused_adam", False)) / "fused_adam.so").exists():
        ops = doctor.check_deepspeed(doctor.Context(run))
        assert "the plan's fused_adam (AdamW on the accelerator) is built in torch's extension cache" in ops.detail
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    ops = doctor.check_deepspeed(doctor.Context(run))
    assert ("the plan's fused_adam (AdamW on the accelerator) is not built on this machine: the first run compiles "
            "it (about a minute, once; `zerotrain build-ops` compiles it now)") in ops.detail
