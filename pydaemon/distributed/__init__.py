"""Tensor parallelism over torch.distributed: process group state, the worker loop and the
executor that starts the workers and hands them every step (see executor.py)."""
