"""Suite-wide hygiene: what one test file allocated is given back before the next one runs.

The README's test command runs every test in one pytest process. A file's engines and models
go with its module-scoped fixtures, but the process kept much of their memory (issue 55:
~10 GB near the end of the suite). Besides the allocations the files themselves made too
large (the CPU swap pool of every engine, zero-filled; a 2.9 GB KV cache), two things held it:
glibc keeps freed heap in its arenas (RSS 1.5 GB after tests/test_smollm2.py, 0.6 GB once
trimmed), and an engine's start-up freezes the heap out of the cycle collector
(pydaemon/heap_freeze.py), so a dead engine in a reference cycle waits for the next engine's
start. Before each file: unfreeze, collect, trim (tests/memory_utils.py).
"""

from __future__ import annotations

import pytest
from memory_utils import give_back_memory


@pytest.fixture(scope="module", autouse=True)
def _give_back_the_last_files_memory():
    # At the start of each file: by then pytest has dropped the last file's fixture values
    # (a test item holds its fixtures until its teardown is over).
    give_back_memory()
    yield


def pytest_configure(config):
    # Under pytest-xdist (scripts/run_tests.sh) each worker gets one of the box's cores:
    # torch's own threads would otherwise double up on them.
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
