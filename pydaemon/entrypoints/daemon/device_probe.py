"""Whether this host can run a CUDA device, known without importing torch (the front end
never loads it): an NVIDIA kernel driver is loaded. Used to refuse, at once, settings that
need a GPU when ``--device auto`` can only mean the CPU (the engine core would find out only
after seconds of start-up)."""

from __future__ import annotations

from pathlib import Path

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present while the driver is loaded


def has_nvidia_driver() -> bool:
    return NVIDIA_DRIVER.exists()
