"""Fields of a request body that pagedd does not know are ignored with a warning, as vLLM
does ("The following fields were present in the request but ignored"): a client that sends a
field newer than this server still gets its answer. Each field name is logged at warning level
once (a client cannot fill the log by sending many names), then at debug level."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_REMEMBERED_NAMES = 256  # names already warned about; past this every name logs at debug
_warned: set[str] = set()


def warn_ignored_fields(model: type, data: Any, where: str) -> Any:
    """A pydantic ``mode="before"`` validator's body: logs the keys of ``data`` (a dict)
    that ``model`` does not declare; returns ``data`` unchanged (extra="ignore" drops them)."""
    if not isinstance(data, dict):
        return data
    unknown = sorted(str(k)[:64] for k in data.keys() - model.model_fields.keys())
    if unknown:
        fresh = [name for name in unknown if name not in _warned]
        level = logging.WARNING if fresh and len(_warned) < MAX_REMEMBERED_NAMES else logging.DEBUG
        if level == logging.WARNING:
            _warned.update(fresh[: MAX_REMEMBERED_NAMES - len(_warned)])
        logger.log(level, "%s: the following fields were present in the request but ignored: %s",
                   where, unknown)  # fmt: skip
    return data
