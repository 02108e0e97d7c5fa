"""Engine errors as a daemon user reads them: the flags they set, not EngineConfig's fields.

EngineConfig and the engine name their settings by field (``EngineConfig.swap_space must be >=
0``), which is what an offline ``LLM(...)`` caller wrote; ``pagedd serve`` was given
``--swap-space``. Field and flag are the same name (settings.py), so the daemon rewrites the
message: ``EngineConfig.swap_space`` and ``swap_space`` become ``--swap-space``, and a message
that says both (``swap_space (--swap-space)``, or the flag again in parentheses) keeps the
flag once.
"""

from __future__ import annotations

import re
from dataclasses import fields

from pydaemon.config.engine import EngineConfig

_KEYS = sorted((f.name for f in fields(EngineConfig)), key=len, reverse=True)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def with_flag_names(message: str) -> str:
    for key in _KEYS:
        flag = _flag(key)
        message = message.replace(f"{key} ({flag})", flag)
        # One-word fields (model, device, seed) only where the message names the field itself:
        # elsewhere they are plain words.
        prefix = r"(?:EngineConfig\.)" + ("?" if "_" in key else "")
        message = re.sub(rf"(?<![\w.-]){prefix}{key}(?![\w-])", flag, message)
        if message.count(flag) > 1:  # "--x must be ... (--x; more)": the flag said once
            message = message.replace(f" ({flag})", "").replace(f"({flag}; ", "(")
    return message
