"""NVMe offload (ZeRO-Infinity) as zerotrain configures it: two CPU ranks (gloo) build engines with
zerotrain.engine.initialize from deepspeed_config for the two NVMe layouts the planner considers
(ZeRO-3 with offload_optimizer nvme, and with offload_param nvme too; hardware.nvme_path a tmp
folder) and train two steps each of a model of two 1024 x 1024 layers (DeepSpeed swaps only
tensors of 1 MiB or more, so no tiny diffusers model would swap anything). DeepSpeed's swappers
write the optimizer state (and the parameter partitions) as files under the NVMe path, and the
weights and the loss move.

The swappers need DeepSpeed's async I/O op, which JIT-compiles against libaio (libaio-dev; .ci/run
installs it, and `zerotrain build-ops` in .ci/run, or tests/conftest.py in the background, builds the op: ~14 CPU
minutes). Where it cannot build, the test skips with the compiler's reason.

Run by the test as `python -m tests.distributed.test_nvme_offload NVME_DIR OUT_DIR` on each rank."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

from tests.distributed.conftest import run_ranks

pytestmark = pytest.mark.distributed

CASES = {"optimizer": ("nvme", "none"), "optimizer-and-params": ("nvme", "nvme")}
STEPS = 2
# DeepSpeed's swappers keep tensors under 1 MiB in memory (swap_tensor/utils.py MIN_AIO_BYTES): each
# weight's half on a rank is 1 MiB in bf16, and a rank's fp32 master partition 4 MiB.
WIDTH, LAYERS = 1024, 2


def aio_unavailable() -> str | None:
    """Why DeepSpeed's async I/O op cannot build here, or None once it is built."""
    import subprocess

    from tests.distributed.conftest import process_env

    code = ("from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().create_op_builder('AsyncIOBuilder').load()\n")
    done = subprocess.run([sys.executable, "-c", code], env=process_env(), capture_output=True, text=True,
                          timeout=1800, check=False)
    return None if done.returncode == 0 else " ".join((done.stdout + done.stderr).split())[-600:]


def train_case(name: str, nvme: Path) -> dict:
    """One engine of this case on this rank: STEPS steps; what it swapped and whether it learned."""
    import deepspeed
    import torch

    from zerotrain.config import load_config
    from zerotrain.engine import initialize
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    world = torch.distributed.get_world_size()
    folder = nvme / name
    run = load_config(None, [f"training.global_batch_size={world}", f"hardware.nvme_path={folder}", "optimizer.lr=1e-3",
                             "planner.stage3_param_persistence_threshold=0"])
    optimizer, param = CASES[name]
    config = deepspeed_config(Layout(3, offload_optimizer=optimizer, offload_param=param, micro_batch=1,
                                     accumulation=1), run, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))).to(torch.bfloat16)
    engine, *_ = initialize(model, list(model.parameters()), config)

    def weights() -> list[torch.Tensor]:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().clone() for p in params]

    before = weights()
    x, target = torch.randn(2, WIDTH, dtype=torch.bfloat16), torch.randn(2, WIDTH)
    losses = []
    for _ in range(STEPS):
        loss = (engine(x).float() - target).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = weights()
    files = {str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*") if path.is_file()}
    zero = config["zero_optimization"]
    return {"losses": losses, "files": files, "changed": sum(not torch.equal(a, b) for a, b in zip(before, after)),
            "params": len(before), "swaps_optimizer": bool(engine.optimizer.swap_optimizer),
            "param_device": zero.get("offload_param", {}).get("device", "none"),
            "optimizer_device": zero["offload_optimizer"]["device"]}


def worker(nvme: Path, out: Path) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for name in CASES:
        try:
            results[name] = train_case(name, nvme)
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_nvme_offload_swaps_to_the_nvme_path_and_trains(tmp_path):
    why = aio_unavailable()
    if why is not None:
        pytest.skip(f"DeepSpeed's async I/O op does not build here (NVMe offload needs it): {why}")
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    returncodes, logs, seconds = run_ranks([sys.executable, "-u", "-m", "tests.distributed.test_nvme_offload",
                                            str(nvme), str(out)], tmp_path / "logs", "nvme")
    tails = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    assert returncodes == [0, 0], f"workers exited with {returncodes} after {seconds:.0f} s:\n{tails}"
    for rank in range(2):
        results = json.loads((out / f"rank{rank}.json").read_text())
        for name, (optimizer, param) in CASES.items():
            result = results[name]
            assert "error" not in result, f"rank {rank}, {name}:\n{result.get('error')}"
            assert (result["optimizer_device"], result["param_device"]) == (optimizer, param), result
            assert result["swaps_optimizer"], result
            files = result["files"]
            # The fp32 master partition and both Adam moments of this rank (4 MiB each) ...
            state = {path.rsplit("/", 1)[-1].split("-")[0] for path, size in files.items()
                     if path.startswith(f"zero_stage_3/optimizer/rank{rank}/") and "gradient" not in path
                     and size >= 4 * 2**20}
            assert {"exp_avg", "exp_avg_sq"} < state and len(state) == 3, f"rank {rank}, {name}: {files}"
            # ... and with offload_param nvme, this rank's half of each weight (bf16, 1 MiB; biases stay in memory)
            params = [size for path, size in files.items() if path.startswith(f"zero_stage_3/bfloat16params/rank{rank}/")]
            assert params == ([2**20] * LAYERS if param == "nvme" else []), f"rank {rank}, {name}: {files}"
            assert result["changed"] == result["params"] > 0, result
            first, last = result["losses"]
            assert last < first, result["losses"]
    print(f"nvme offload: {seconds:.0f} s for both cases on 2 ranks; files of rank 0: {sorted(files)[:6]}")


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(0)
