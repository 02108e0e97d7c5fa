"""Matching a checkpoint's list of modules left unquantized against module names, shared by
every quantized format (checkpoint_format.py, weight_only_format.py)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any


def ct_matches(entry: str, module_name: str) -> bool:
    """A compressed-tensors ``ignore`` / ``targets`` entry (or a GPTQ ``-:`` rule, written
    ``re:``) against a module name: exact, or ``re:<regex>`` matched from the start."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module_name) is not None
    return entry == module_name


def component_match(entry: str, module_name: str) -> bool:
    """An entry naming whole dotted components of the module name: the name itself, a prefix
    (``model.layers.0``) or a suffix (``lm_head``, ``mlp.gate``); ``*`` in an entry matches
    one component (gpt-oss writes ``model.layers.*.self_attn``). transformers matches
    substrings; whole components keep ``model.layers.1`` from also naming layer 10."""
    if "*" not in entry:
        return f".{entry}." in f".{module_name}."
    parts, want = module_name.split("."), entry.split(".")
    return any(
        all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts[i : i + len(want)], want, strict=True))
        for i in range(len(parts) - len(want) + 1)
    )


def layer_skipped(fmt: Any, layer_name: str, parts: Sequence[str] | None = None) -> bool:
    """True when the model's layer ``layer_name`` stays unquantized in checkpoint format
    ``fmt`` (by its ``is_ignored``). ``parts``: the checkpoint modules fused into it (e.g.
    ``...q_proj``, ``...k_proj``, ``...v_proj``), None when it is one checkpoint module.
    ValueError when only some parts are ignored."""
    names = list(parts) if parts else [layer_name]
    ignored = [name for name in names if fmt.is_ignored(name)]
    if ignored and len(ignored) != len(names):
        kept = [name for name in names if name not in ignored]
        raise ValueError(
            f"config.json quantization_config.{fmt.skip_source} leaves "
            f"{', '.join(ignored)} unquantized but not {', '.join(kept)}: this engine fuses "
            f"them into one layer ({layer_name}), whose parts must all be quantized or all "
            "be left unquantized"
        )
    return bool(ignored)
