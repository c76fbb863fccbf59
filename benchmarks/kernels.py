"""Each Triton kernel against its torch twin on the same inputs: time ratio on a GPU, plus decode attention's K/V
bandwidth as a fraction of a measured device-to-device copy; on CPU (the Triton interpreter) correctness only.
--kv-cache-dtype fp8_e4m3 / fp8_e5m2: the KV write and the attention cases over fp8 caches (the bytes read halve; the
fraction of the copy's bandwidth is the figure to compare with the model dtype's)."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, so before kernels/*_triton
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton.testing  # noqa: E402

from kernels import (  # noqa: E402
    attention_ref,
    attention_triton,
    decode_split_k_triton,
    kv_cache_ref,
    kv_cache_triton,
    kv_quant,
    norm_ref,
    norm_triton,
    rotary_ref,
    rotary_triton,
)


@dataclass
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    decode_lens: list[int]  # many requests: the mixed-batch kernel
    long_decode_lens: list[int]  # few long requests: split-K
    prefill_chunks: list[tuple[int, int]]  # (context_len, new_tokens)
    hidden: int


GPU = Shapes(32, 8, 128, 16, [2048] * 64, [32768] * 2, [(4096, 2048), (1024, 1024)], 4096)
CPU = Shapes(4, 2, 32, 16, [40, 17, 64], [300], [(24, 24), (50, 9)], 64)
KV_SCALE = 0.05  # an fp8 cache's K and V scale: randn / 0.05 stays inside e4m3's range


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class Case:
    name: str
    torch_twin: Callable[[], Outputs]
    triton: Callable[[], Outputs]
    kv_bytes: int = 0  # K/V bytes a decode attention reads, for its bandwidth


def paged_cache(shapes: Shapes, seq_lens: list[int], dtype: torch.dtype, device: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches of `dtype` (fp8: quantized with KV_SCALE) holding seq_lens contexts in shuffled blocks, and
    their block_tables."""
    max_blocks = -(-max(seq_lens) // shapes.block_size)
    num_blocks = len(seq_lens) * max_blocks
    k_cache, v_cache = (_stored(torch.randn(num_blocks, shapes.kv_heads, shapes.block_size, shapes.head_dim,
                                            device=device), dtype) for _ in range(2))
    block_tables = torch.randperm(num_blocks, device=device).view(len(seq_lens), max_blocks)
    return k_cache, v_cache, block_tables


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return kv_quant.quantize(x, KV_SCALE, dtype) if kv_quant.is_fp8(dtype) else x.to(dtype)


def attention_cases(shapes: Shapes, dtype: torch.dtype, cache_dtype: torch.dtype, device: str, num_sms: int
                    ) -> list[Case]:
    """The mixed-batch kernel on a mixed and on a decode-only batch, split-K on a few long decodes."""
    scale = shapes.head_dim**-0.5
    decodes = [(n, 1) for n in shapes.decode_lens]
    cases = []
    for name, seqs in (("paged attention, mixed batch", decodes + shapes.prefill_chunks),
                       ("decode attention, many requests", decodes)):
        cases.append(_mixed_case(name, shapes, seqs, dtype, cache_dtype, device, scale))
    lens = shapes.long_decode_lens
    k_cache, v_cache, tables = paged_cache(shapes, lens, cache_dtype, device)
    query = torch.randn(len(lens), shapes.heads, shapes.head_dim, dtype=dtype, device=device)
    splits = max(2, decode_split_k_triton.num_splits(lens, shapes.kv_heads, num_sms))
    device_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    cases.append(Case(f"split-K decode attention ({len(lens)} long, {splits} splits)",
                      lambda: attention_ref.decode_attention(query, k_cache, v_cache, tables, lens, scale, None,
                                                             k_scale=KV_SCALE, v_scale=KV_SCALE),
                      lambda: decode_split_k_triton.decode_attention(query, k_cache, v_cache, tables, device_lens,
                                                                     scale, None, splits, out, k_scale=KV_SCALE,
                                                                     v_scale=KV_SCALE),
                      _kv_bytes(k_cache, lens)))
    return cases


def _mixed_case(name: str, shapes: Shapes, seqs: list[tuple[int, int]], dtype: torch.dtype, cache_dtype: torch.dtype,
                device: str, scale: float) -> Case:
    seq_lens = [ctx for ctx, _ in seqs]
    k_cache, v_cache, tables = paged_cache(shapes, seq_lens, cache_dtype, device)
    query_start_loc = [0]
    for _, new in seqs:
        query_start_loc.append(query_start_loc[-1] + new)
    query = torch.randn(query_start_loc[-1], shapes.heads, shapes.head_dim, dtype=dtype, device=device)
    num_decodes = sum(new == 1 for _, new in seqs)
    out = torch.empty_like(query)
    decode_only = num_decodes == len(seqs)
    device_starts, device_lens = (torch.tensor(values, dtype=torch.int32, device=device)
                                  for values in (query_start_loc, seq_lens))
    return Case(name,
                lambda: attention_ref.paged_attention(query, k_cache, v_cache, tables, query_start_loc, seq_lens,
                                                      num_decodes, scale, k_scale=KV_SCALE, v_scale=KV_SCALE),
                lambda: attention_triton.paged_attention(query, k_cache, v_cache, tables, device_starts, device_lens,
                                                         scale, None, out, k_scale=KV_SCALE, v_scale=KV_SCALE),
                _kv_bytes(k_cache, seq_lens) if decode_only else 0)


def _kv_bytes(cache: torch.Tensor, seq_lens: list[int]) -> int:
    return 2 * sum(seq_lens) * cache.shape[1] * cache.shape[3] * cache.element_size()


def layer_cases(shapes: Shapes, dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> list[Case]:
    """KV write, RMSNorm with residual, rotary: one step's worth of tokens."""
    tokens = len(shapes.decode_lens) + sum(new for _, new in shapes.prefill_chunks)
    key, value = (torch.randn(tokens, shapes.kv_heads, shapes.head_dim, dtype=dtype, device=device) for _ in range(2))
    slots = torch.randperm(tokens * 2, device=device)[:tokens]
    caches = [torch.zeros(tokens * 2 // shapes.block_size + 1, shapes.kv_heads, shapes.block_size, shapes.head_dim,
                          dtype=cache_dtype, device=device) for _ in range(4)]
    x, residual = (torch.randn(tokens, shapes.hidden, dtype=dtype, device=device) for _ in range(2))
    weight = torch.randn(shapes.hidden, dtype=dtype, device=device)
    query = torch.randn(tokens, shapes.heads, shapes.head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    angles = torch.arange(4096, device=device)[:, None] * torch.rand(shapes.head_dim // 2, device=device)
    cos, sin = (f(torch.cat([angles, angles], dim=1)) for f in (torch.cos, torch.sin))
    rotated = (query.clone(), key.clone())  # the Triton kernel rotates in place: it gets its own copies
    return [
        Case("KV cache write", lambda: _written(kv_cache_ref.write_kv_cache, key, value, caches[:2], slots),
             lambda: _written(kv_cache_triton.write_kv_cache, key, value, caches[2:], slots)),
        Case("RMSNorm + residual", lambda: norm_ref.rms_norm(x, weight, 1e-6, residual),
             lambda: norm_triton.rms_norm(x, weight, 1e-6, residual)),
        Case("rotary embedding", lambda: rotary_ref.rotary_embedding(positions, query, key, cos, sin),
             lambda: _rotate_fresh(rotated, query, key, positions, cos, sin)),
    ]


def _written(write: Callable[..., None], key: torch.Tensor, value: torch.Tensor, caches: list[torch.Tensor],
             slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    write(key, value, *caches, slots, k_scale=KV_SCALE, v_scale=KV_SCALE)
    return tuple(caches)


def _rotate_fresh(rotated: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the copies from the original inputs again, so repeated runs give the twin's result."""
    rotated[0].copy_(query)
    rotated[1].copy_(key)
    return rotary_triton.rotary_embedding(positions, *rotated, cos, sin)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write) of 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_milliseconds(lambda: dst.copy_(src)) / 1e3)


def _milliseconds(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn)


def max_diff(expected: Outputs, got: Outputs) -> float:
    pairs = zip(expected, got) if isinstance(expected, tuple) else [(expected, got)]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def report(case: Case, on_gpu: bool, copy_bw: float) -> str:
    diff = max_diff(case.torch_twin(), case.triton())
    line = f"{case.name:58s} max |diff| {diff:.2e}"
    if not on_gpu:
        return line
    twin_ms, triton_ms = _milliseconds(case.torch_twin), _milliseconds(case.triton)
    line += f"   torch {twin_ms:8.3f} ms  triton {triton_ms:8.3f} ms  torch/triton {twin_ms / triton_ms:6.2f}x"
    if case.kv_bytes:
        achieved = case.kv_bytes / (triton_ms / 1e3)
        line += f"   K/V {achieved / 1e9:7.1f} GB/s = {achieved / copy_bw:.0%} of copy"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bfloat16 on a GPU, float32 on CPU (the interpreter's bfloat16 tl.dot is wrong)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2"], default="auto",
                        help="the KV caches' dtype: auto is --dtype's")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device, shapes = ("cuda", GPU) if on_gpu else ("cpu", CPU)
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    cache_dtype = kv_quant.cache_dtype(args.kv_cache_dtype, dtype)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 4
    torch.manual_seed(0)
    if on_gpu:
        copy_bw = copy_bandwidth(device)
        print(f"{torch.cuda.get_device_name()}, {dtype}, KV cache {cache_dtype}: device-to-device copy "
              f"{copy_bw / 1e9:.0f} GB/s")
    else:
        copy_bw = 0.0
        print(f"CPU, {dtype}, KV cache {cache_dtype}, Triton interpreter: correctness only; speed under the "
              "interpreter is not meaningful")
    for case in (attention_cases(shapes, dtype, cache_dtype, device, num_sms)
                 + layer_cases(shapes, dtype, cache_dtype, device)):
        print(report(case, on_gpu, copy_bw))


if __name__ == "__main__":
    main()
