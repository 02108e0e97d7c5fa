"""A model's ``generation_config.json``: the sampling defaults it ships, and its EOS ids.

As vLLM does, ``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty`` written there
become the defaults of requests that leave those fields unset (``do_sample`` is not consulted:
a model that ships a temperature means it). Beam search requests take none of them, since
beam search is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydaemon.config.json_files import read_json
from pydaemon.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults; None where the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        return cls.from_dict(read_json(path), str(path))

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], source: str = GENERATION_CONFIG_FILE
    ) -> GenerationDefaults:
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name)
            if value is None:
                continue
            kind = int if f.name == "top_k" else float
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{source}: {f.name} must be a number, got {value!r}")
            values[f.name] = kind(value)
        defaults = cls(**values)
        # Validated once here, so a bad file fails at load and not on every request.
        try:
            defaults.sampling_params()
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        return defaults

    def as_dict(self) -> dict[str, float | int]:
        """The defaults the model sets, by SamplingParams field name."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with these defaults under ``overrides`` (the request's own fields)."""
        if overrides.get("beam_width", 1) > 1:
            return SamplingParams(**overrides)
        return SamplingParams(**{**self.as_dict(), **overrides})
