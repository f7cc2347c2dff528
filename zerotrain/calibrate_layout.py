"""One layout of `zerotrain calibrate`, measured in a process of its own (each rank of it):

    python -m zerotrain.calibrate_layout JOB.json     # what calibrate.measure_apart starts, under torchrun for several ranks

The measurement is calibrate.worker's; this module is only its entry point, so that the worker runs
as zerotrain.calibrate itself (not as a __main__ copy of it)."""

import sys
from pathlib import Path

from zerotrain.calibrate import worker

if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1])))
