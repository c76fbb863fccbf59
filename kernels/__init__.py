"""Kernels and their torch reference twins: paged attention, KV cache write, RMSNorm, rotary embedding, SiLU-gated
activation.

Each op dispatches to its Triton kernel on CUDA (when triton imports) and to torch (or the C++ CPU
kernels) elsewhere.
"""
from kernels.activation import silu_and_mul
from kernels.attention import decode_attention, decode_splits, paged_attention
from kernels.cpu_extension import start_background_build as start_cpu_kernels_build
from kernels.cpu_features import matmul_dtype
from kernels.kv_cache import write_kv_cache
from kernels.norm import rms_norm
from kernels.rotary import rotary_embedding

__all__ = ["decode_attention", "decode_splits", "matmul_dtype", "paged_attention", "rms_norm", "rotary_embedding",
           "silu_and_mul", "start_cpu_kernels_build", "write_kv_cache"]
