"""Shared test setup. Tiny CPU models run far faster single-threaded on the 2-core CI machine
(a tiny-sdxl forward: ~20 ms with 1 thread vs ~1.5 s with 2, measured)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
