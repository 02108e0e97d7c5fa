"""The GPU (or CPU) side of a step: the model runner and its input batch, the step sampler, CUDA
graphs and their static inputs, the KV cache tensors and FP8 scale calibration, and the tensor-parallel
executor (rank 0) and workers (ranks 1..N-1)."""
