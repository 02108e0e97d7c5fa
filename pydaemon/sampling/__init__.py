"""Token sampling: per-step metadata, penalties, and the Sampler."""

from pydaemon.sampling.sampler import Sampler, SamplerOutput
from pydaemon.sampling.sampling_metadata import SamplingMetadata, make_generator

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "make_generator"]
