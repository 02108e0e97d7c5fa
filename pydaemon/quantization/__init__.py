"""Weight quantization: FP8 linear layers (fp8.py), checkpoint formats and the engine's
choice (config.py), loading into FP8 layers (fp8_loading.py)."""
