"""Triton kernels for the engine (run under TRITON_INTERPRET=1 on machines without CUDA)."""
