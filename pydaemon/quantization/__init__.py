"""Weight quantization: the engine's choice and the checkpoint's (config.py); FP8 linear
layers (fp8.py) and the FP8 KV cache (kv_cache_fp8.py); 4-bit weights: the engine's int4
layout (int4.py), the checkpoint formats read into it (awq.py, gptq.py,
compressed_tensors_int4.py), MXFP4 (mxfp4.py), int4 linear layers (int4_linear.py) and the
W4A16 Triton kernels with their launchers (w4a16_kernels.py, w4a16.py)."""
