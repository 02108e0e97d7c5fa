"""Executors: how the engine core's steps reach the ranks that run the model (abstract.py)."""
