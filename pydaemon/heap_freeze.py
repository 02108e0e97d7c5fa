"""Keeping Python's cycle collector off the step loop's critical path.

CPython runs a full (generation 2) collection whenever enough objects have survived the young
generations, and a full collection walks every tracked container alive: after torch,
transformers and the model are imported and built, several hundred thousand of them (modules'
functions, dicts, tuples, parameters). On the H200, W1 (512 requests, dummy Llama-3-8B, async
scheduling) ran 9 full collections taking 2.0 s of its 14.6 s, the longest 251 ms, each one a
pause in which no step was launched: the GPU profile of the same run showed 24 gaps over 10 ms
(2.44 s idle in all, the longest ~260 ms, about one every 0.9 s of decoding). On this
machine's CPU a W1-sized run showed the same pattern: 4 full collections of ~200-260 ms over
~370k tracked objects.

The fix is vLLM's: once the engine is built (weights, KV cache, CUDA graphs), collect, then
``gc.freeze()``: what is alive then moves to the permanent generation, which collections
never walk, so a later full collection only walks what the serving created (requests,
outputs). Reference counting still frees frozen objects; only cyclic garbage among them would
wait for ``thaw``. An engine thaws at shutdown, and each new engine thaws, collects and
freezes again, so dead engines in one process (tests, notebooks) are still collected.

The daemon's front process (gRPC, HTTP, tokenizer) freezes its heap the same way when it
becomes ready, so that a full collection there does not stall token streams for a quarter of a
second (pydaemon/entrypoints/daemon/app.py; thawed when it drains).

``PAGEDD_GC_FREEZE=0`` turns it off (for A/B runs).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os

logger = logging.getLogger(__name__)


_thaw_registered = False


def enabled() -> bool:
    return os.environ.get("PAGEDD_GC_FREEZE", "1") != "0"


def freeze_startup_heap() -> int:
    """Thaw, collect, freeze: -> the number of objects now frozen (0 when turned off)."""
    if not enabled():
        return 0
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    global _thaw_registered
    if not _thaw_registered:  # cycles left frozen at exit would never be collected (and
        atexit.register(thaw)  # nanobind reports its objects among them as leaks)
        _thaw_registered = True
    count = gc.get_freeze_count()
    logger.debug("froze %d objects out of the cycle collector's full passes", count)
    return count


def thaw() -> None:
    """Frozen objects back under the collector (an engine's shutdown, interpreter exit)."""
    if enabled():
        gc.unfreeze()
