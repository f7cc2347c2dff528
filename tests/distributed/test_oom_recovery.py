"""Out-of-memory recovery (faults.OomRecovery, deepspeed_compat.abandon_step), on 2 CPU ranks.

1. The engine (abandon_worker.py): for ZeRO 0-3, with the optimizer offloaded (ZeRO-2) and with
   the optimizer and parameters offloaded (ZeRO-3), a step whose second micro-batch runs out of
   memory half-way through its backward (the first micro-batch's gradients accumulated, the later
   blocks' gradients partly reduced across the ranks) is dropped and run again: every step's loss
   then equals the run that never failed, bit for bit. Without abandon_step the retried step
   accumulates the failed attempt's gradients (or DeepSpeed stops on a parameter "already
   reduced"), and the losses differ.
2. train.py: an out-of-memory error injected in step 2 (testing.oom_at; before the forward
   of the step's second micro-batch, every rank) is recovered: the run goes on with more blocks
   checkpointed on every rank, says so in one line, writes the move to plan.json and memory.json,
   and its per-step losses equal those of a run started with that many blocks (the dropped step
   runs again on the same micro-batches and noise, so it matches too). A resume keeps the adjusted
   layout and continues the same losses.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("abandon_worker.py")
CASES = ["0", "1", "2", "3", "2:cpu", "3:cpu+param"]


@pytest.fixture(scope="module")
def engine_runs(shared_cache, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("abandon")
    out = tmp / "runs.json"
    codes, logs, _ = run_ranks([sys.executable, "-u", str(WORKER), str(shared_cache / "models" / "tiny-flux"),
                                str(out), *CASES], tmp, "abandon")
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_a_dropped_step_leaves_nothing_in_the_engine(engine_runs, case):
    plain, failed = engine_runs[f"{case}:plain"], engine_runs[f"{case}:failed"]
    assert plain["events"] == [] and len(failed["events"]) == 1 and "half-way through backward" in failed["events"][0]
    assert failed["losses"] == plain["losses"], f"ZeRO {case}: {failed['losses']} != {plain['losses']}"
    assert plain["losses"][-1] < plain["losses"][0], "the runs must train for the comparison to mean something"


def test_training_recovers_from_running_out_of_memory_and_resumes_with_the_new_layout(train):
    common = ("planner.stages=[2]", "planner.offload=[none]", "training.mode=full", "training.micro_batch_size=1",
              "training.global_batch_size=4", "training.checkpoint_every=1", "training.resume=auto",
              "logging.memory_check_step=1")
    recovered = train("recovered", *common, "training.max_steps=3", "testing.oom_at=[2]").check()
    plan = json.loads((recovered.output_dir / "plan.json").read_text())
    assert plan["chosen"]["layout"]["gradient_checkpointing"] is False, "the test needs a plan without checkpointing"
    [move] = plan["adjusted"]
    blocks = move["training"]["checkpoint_blocks"]
    assert move["step"] == 2 and 0 < blocks, move
    assert plan["trained"]["layout"]["checkpointed_blocks"] == blocks
    some = f"{blocks} block{'' if blocks == 1 else 's'}"
    lines = [line for line in recovered.log.splitlines() if "ran out of memory" in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"zerotrain: warning: step 2 ran out of memory with ZeRO-2, no checkpointing, micro-batch 1 x accumulation 2 "
        rf"\(predicted .*; no GPU to measure\): dropped on every rank, and run again with ZeRO-2, checkpointing "
        rf"{some}, micro-batch 1 x accumulation 2 \(predicted .*\) on each of 2 ranks; a resume keeps it; "
        rf"to start with it: --set training.checkpoint_blocks={blocks}", lines[0]), lines
    assert "Traceback" not in recovered.log
    assert [r["step"] for r in recovered.metrics()] == [1, 2, 3]
    memory = json.loads((recovered.output_dir / "memory.json").read_text())
    # measured once the retried step is done (logging.memory_check_step=1), against the new layout
    assert memory["adjusted"] == plan["adjusted"] and memory["step"] == 2, memory
    assert memory["layout"] == move["to"] and memory["predicted"]["device_total"] == move["predicted_after"]

    started = train("started", *common, "training.max_steps=4", f"training.checkpoint_blocks={blocks}").check()
    assert recovered.losses() == started.losses()[:3]

    resumed = train("recovered", *common, "training.max_steps=4").check()
    assert (f"keeping the layout the run moved to after running out of memory at step 2 (ZeRO-2, checkpointing "
            f"{some}, micro-batch 1 x accumulation 2; plan.json): --set training.checkpoint_blocks={blocks}"
            ) in resumed.log, resumed.tails()
    assert json.loads((resumed.output_dir / "plan.json").read_text())["adjusted"] == plan["adjusted"]
    assert resumed.losses() == started.losses()
