"""pagedd: an LLM inference daemon built on PagedAttention."""

from __future__ import annotations

__version__ = "0.1.0"

from pydaemon.lora_request import LoRARequest  # noqa: E402
from pydaemon.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pydaemon.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import pydaemon` stays light.
    if name == "LLM":
        from pydaemon.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
