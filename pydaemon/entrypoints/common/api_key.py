"""What an API key may be: visible ASCII, no spaces (a key of whitespace, or one that holds
spaces, makes ``Bearer`` headers with extra spaces match, and cannot travel in HTTP/2 metadata
unchanged). One rule for the gRPC, HTTP and metrics ports, checked where the key is read."""

from __future__ import annotations

import re

_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space
MIN_API_KEY_LEN = 1


def check_api_key(key: str, where: str = "the API key") -> str:
    """-> ``key``; ValueError (never echoing the key) unless it is usable."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(
            f"{where} must be printable ASCII without spaces or control characters "
            "(a key of whitespace, or with spaces in it, is refused)"
        )
    return key
