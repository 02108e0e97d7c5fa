"""Which model a name means, and what clients see of it: the directory or .gguf file that
``--model`` names ('demo', the default model, a path), the served model name, the
generation defaults a served model applies, and the model's config without its weights.
Light (no torch): both front ends start here, and the engine core reads the config here
before any rank loads the model."""

from __future__ import annotations

from pathlib import Path

from pydaemon.config.engine import DEFAULT_MODEL
from pydaemon.config.generation import GenerationDefaults
from pydaemon.config.model import ModelConfig
from pydaemon.gguf.config import load_gguf_config
from pydaemon.gguf.reader import GGUFFile, is_gguf_file
from pydaemon.model_loader.default_model import (
    DEFAULT_GENERATION_CONFIG,
    default_model_path,
    is_default_model,
)


def resolve_model_dir(model: str) -> Path:
    """-> the model directory or .gguf file that ``model`` names."""
    if model == "demo":
        from pydaemon.model_loader.demo_model import demo_model_dir

        return demo_model_dir()
    if is_default_model(model):
        return default_model_path()
    path = Path(model).expanduser()
    if not (path.is_dir() or is_gguf_file(path)):
        raise ValueError(
            f"model {model!r} is neither 'demo', {DEFAULT_MODEL!r}, a model directory nor a "
            ".gguf file"
        )
    return path


def served_model_name(model: str, path: Path) -> str:
    """The name clients see: 'demo', the default model's, a directory's or a file's stem."""
    if model == "demo":
        return "demo"
    if is_default_model(model):
        return DEFAULT_MODEL
    return path.stem if is_gguf_file(path) else path.name


def served_generation_defaults(model: str, model_dir: Path) -> GenerationDefaults:
    """The defaults a served model applies: the built-in default model's own (its GGUF file has
    no generation config), else its directory's ``generation_config.json``."""
    if is_default_model(model):
        return GenerationDefaults.from_dict(DEFAULT_GENERATION_CONFIG, DEFAULT_MODEL)
    return GenerationDefaults.from_model_dir(model_dir)


def load_model_config(model: str | Path) -> ModelConfig:
    """-> the config of a model directory (config.json) or of a .gguf file (its metadata)."""
    if is_gguf_file(model):
        return load_gguf_config(GGUFFile(model))
    return ModelConfig.from_model_dir(model)
