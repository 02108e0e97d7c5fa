"""Configuration, as plain data: the engine's (``EngineConfig``, engine.py), the workers'
(``RunnerConfig``, runner.py; their KV tiers' plan in kv_offloading.py), a model's
``config.json`` (model.py), its ``generation_config.json`` (generation.py), the quantization format
a checkpoint declares (checkpoint_format.py) and the JSON reading they share (json_files.py).
No torch, no model code: the daemon's front end reads these too."""

from pydaemon.config.engine import EngineConfig

__all__ = ["EngineConfig"]
