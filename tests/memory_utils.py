"""Giving a test file's memory back to the system (tests/conftest.py runs it before each file).

glibc keeps freed heap in its arenas, and an engine's start-up freezes the heap out of the
cycle collector (pydaemon/heap_freeze.py): unfreeze, collect, then ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def give_back_memory() -> None:
    gc.unfreeze()
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
