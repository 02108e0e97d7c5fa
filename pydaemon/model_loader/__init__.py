"""Model loading: from a Hugging Face directory or a GGUF file (loader.py), where each checkpoint
tensor goes (weight_targets.py), FP8 checkpoints and ignored layers, the demo and default models, and
model paths and served names (model_paths.py)."""
