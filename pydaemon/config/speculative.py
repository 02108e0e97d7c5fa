"""SpeculativeConfig: speculative decoding's settings, from vLLM's ``speculative_config`` dict.

Keys (vLLM's names): ``method`` ("ngram" | "draft_model" | "eagle"), ``num_speculative_tokens``
(k, the most drafts verified per sequence and step), ``prompt_lookup_min`` /
``prompt_lookup_max`` (the n-gram sizes the ngram method matches; defaults 1 and 5),
``model`` (draft_model: the draft model's directory; eagle: the EAGLE-1 head's), and
``disable_by_batch_size``
(speculation backs off while more sequences than this are running: at high batch a step is
compute-bound and drafts stop paying; default 32), and pagedd's ``auto_disable`` (default true:
speculation turns itself off at a batch size where it measures slower than plain decoding, and
back on where it pays again: pydaemon/core/sched/spec_governor.py). An unknown key is an error
naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "eagle")
NEEDS_MODEL = ("draft_model", "eagle")  # methods whose ``model`` names a checkpoint


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = 32
    auto_disable: bool = True

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """Validates ``values`` (ValueError naming the key and what is wrong)."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {values!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        method = values.get("method")
        if method is None and values.get("model") is not None:
            method = "draft_model"
        if method == "eagle3":  # what is missing: pydaemon/worker/spec_decode/proposer.py
            raise ValueError("speculative_config.method eagle3 is not supported yet (eagle is)")
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)} "
                f"(got {method!r})"
            )

        def positive(name: str, default: int | None) -> int:
            value = values.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be a positive integer (got {value!r})"
                )
            return value

        k = positive("num_speculative_tokens", None)
        lookup_min = positive("prompt_lookup_min", 1)
        lookup_max = positive("prompt_lookup_max", max(5, lookup_min))
        if lookup_max < lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({lookup_max}) must be >= "
                f"prompt_lookup_min ({lookup_min})"
            )
        model = values.get("model")
        if method in NEEDS_MODEL and not (isinstance(model, str) and model):
            what = "the EAGLE head" if method == "eagle" else "the draft model"
            raise ValueError(f"speculative_config.model must name {what} for {method}")
        if method == "ngram" and model is not None:
            raise ValueError(
                "speculative_config.model is for methods draft_model and eagle, not ngram"
            )
        return cls(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
            model=model,
            disable_by_batch_size=positive("disable_by_batch_size", 32),
            auto_disable=_boolean(values, "auto_disable", True),
        )


def _boolean(values: dict[str, Any], name: str, default: bool) -> bool:
    value = values.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"speculative_config.{name} must be true or false (got {value!r})")
    return value
