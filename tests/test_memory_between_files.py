"""Issue 55 item 14: memory a test file freed is given back before the next file runs
(tests/conftest.py). glibc kept it: freed heap stays in the process until trimmed."""

from __future__ import annotations

import gc

from memory_utils import give_back_memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_freed_heap_is_given_back():
    chunks = [bytes(60_000) for _ in range(3000)]  # ~180 MB of heap (each under mmap's size)
    pinned = bytes(60_000)  # allocated last: the top of the heap stays in use
    grown = _rss_mib()
    del chunks
    gc.collect()
    assert _rss_mib() > grown - 50  # freed, yet still the process's
    give_back_memory()
    assert _rss_mib() < grown - 100
    del pinned


def test_a_dead_engine_in_a_frozen_cycle_is_collected():
    """An engine's start-up freezes the heap (pydaemon/heap_freeze.py); a dead object in a
    reference cycle frozen then is only collected once unfrozen."""
    import weakref

    class Engine:
        pass

    engine = Engine()
    engine.me = engine  # a cycle: reference counting alone never frees it
    alive = weakref.ref(engine)
    gc.freeze()
    del engine
    gc.collect()
    assert alive() is not None  # frozen: the collector does not look at it
    give_back_memory()
    assert alive() is None
