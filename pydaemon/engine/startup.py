"""The one start-up path of every front end (``LLMEngine`` in-process, ``MPEngineClient`` for
the daemon): which model ``--model`` names, what clients see of it, and its tokenizer.

Light on purpose (no torch): the daemon's front-end process runs it before it spawns the
engine core, which loads the weights from ``core_config.model``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pydaemon.config.engine import EngineConfig
from pydaemon.config.generation import GenerationDefaults
from pydaemon.engine.prompt_input import eos_token_ids
from pydaemon.model_loader.model_paths import (
    resolve_model_dir,
    served_generation_defaults,
    served_model_name,
)
from pydaemon.tokenizer.loader import AnyTokenizer, load_tokenizer


@dataclass(frozen=True)
class FrontEndModel:
    """What a front end knows of its model before the engine core has loaded it."""

    model_dir: Path  # the directory or .gguf file
    model_name: str  # the name clients see
    generation_defaults: GenerationDefaults
    tokenizer: AnyTokenizer | None
    # generation_config.json's, config.json's and the tokenizer's EOS ids; the engine core adds
    # its model config's (a GGUF file's metadata, say): EngineCore.resolve_eos_token_ids.
    eos_token_ids: list[int]
    core_config: EngineConfig  # ``config`` with ``model`` resolved to ``model_dir``


def prepare_front_end(config: EngineConfig) -> FrontEndModel:
    """Resolves ``config.model`` and loads its tokenizer; ValueError naming a bad model."""
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_tokenizer(model_dir)
    return FrontEndModel(
        model_dir=model_dir,
        model_name=served_model_name(config.model, model_dir),
        generation_defaults=served_generation_defaults(config.model, model_dir),
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, None, model_dir),
        core_config=replace(config, model=str(model_dir)),
    )
