"""A fault injected into chosen layouts of `zerotrain calibrate`, in every process that imports
zerotrain.calibrate (this folder on PYTHONPATH: Python imports sitecustomize at start-up).

ZEROTRAIN_TEST_CALIBRATE_FAULTS="1:abort,4:hang" makes the measurement of the grid's layout 1 print a
line and die of SIGABRT (as a CUDA illegal memory access ends a process) and layout 4 hang, once
its process has joined its group. Layouts count from 0 in calibrate's order, the repeats of --repeat included."""

import os
import sys
import time

FAULTS = dict(item.split(":") for item in os.environ.get("ZEROTRAIN_TEST_CALIBRATE_FAULTS", "").split(",") if item)

if FAULTS:
    from zerotrain import calibrate

    measure = calibrate.run_layout
    layout_index = []

    def faulty_worker(job_file, original=calibrate.worker):
        layout_index.append(job_file.parent.name.rsplit("-", 1)[1])
        return original(job_file)

    def faulty_run_layout(*args, **kwargs):
        fault = FAULTS.get(layout_index[-1] if layout_index else "")
        if fault == "abort":  # what the process printed as it died, then the abort
            print("injected fault: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os.abort()
        if fault == "hang":
            time.sleep(3600)
        return measure(*args, **kwargs)

    calibrate.worker, calibrate.run_layout = faulty_worker, faulty_run_layout
