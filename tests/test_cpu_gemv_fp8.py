"""fp8 e4m3 weights with float32 scales per row or per block along K in the C++ products (kernels/cpu_gemv.py's
gemv_quantized): equal to kernels.quantized_matmul's twin, every byte converted exactly, and taken by the Linear
dispatch (issues 52 and 56: FP8 block checkpoints on the fast path)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, cpu_gemv, matmul
from kernels.quantized_matmul import dequantize, linear_reference
from workers.quantization.fp8_blocks import FP8BlockFormat

E4M3_FINITE = [b for b in range(256) if b & 0x7F != 0x7F]  # every byte but the two NaNs


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def fp8_weight(rows: int, columns: int, groups: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 e4m3 weight over its whole range, with float32 scales [rows] (groups 0) or [rows, groups]."""
    weight = (torch.randn(rows, columns, generator=generator) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(rows, *((groups,) if groups else ()), generator=generator) / 64 + 1e-3
    return weight, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1-11 rows: dot products (bf16: the bf16 dot-product instructions where the CPU has them); 12 on: the GEMM tiles.
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 40, 131])
# (N, K, groups): K not a multiple of 32 or 16, groups of 8, 32 and 128 columns, N not a multiple of 4, 6 or 16.
@pytest.mark.parametrize("shape", [(67, 96, 0), (67, 96, 3), (130, 200, 0), (45, 40, 5), (33, 256, 2)])
def test_fp8_weights_match_the_dequantized_twin(dtype, rows, shape):
    out_features, in_features, groups = shape
    generator = torch.Generator().manual_seed(rows * 100 + out_features + groups)
    weight, scale = fp8_weight(out_features, in_features, groups, generator)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for b in (None, bias):
        out = cpu_gemv.gemv_quantized(x, weight, scale, b)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        expected = linear_reference(x, weight, scale, bias=b).to(dtype)
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 12])
@pytest.mark.parametrize("groups", [0, 2])
def test_every_fp8_byte_reads_as_its_value(dtype, rows, groups):
    """Weight row i holds byte i in one column and zeros elsewhere: each output is that byte's value times its
    scale, exactly (subnormals included), on every path."""
    codes = torch.tensor(E4M3_FINITE, dtype=torch.uint8)
    weight = torch.zeros(len(codes), 16, dtype=torch.uint8)
    weight[:, 3] = codes
    weight = weight.view(torch.float8_e4m3fn)
    scale = torch.full((len(codes), *((groups,) if groups else ())), 0.5)
    x = torch.zeros(rows, 16, dtype=dtype)
    x[:, 3] = 1.0
    out = cpu_gemv.gemv_quantized(x, weight, scale)
    assert torch.equal(out, (dequantize(weight, scale)[:, 3].expand(rows, -1)).to(dtype))
    assert out[0].isfinite().all() and out[0].abs().max() == 224.0


def test_bad_scales_and_weights_are_refused_by_name():
    weight = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="scale"):
        cpu_gemv.gemv_quantized(x, weight, torch.ones(8, 3))  # 64 columns do not split into 3 groups
    with pytest.raises(ValueError, match="scale"):
        cpu_gemv.gemv_quantized(x, weight, torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        cpu_gemv.gemv_quantized(x, weight.view(torch.uint8), torch.ones(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [0, 3])
@pytest.mark.parametrize("stored", [torch.int8, torch.float8_e4m3fn])
def test_kernel_dequantizes_as_the_twin_does(dtype, groups, stored):
    """cpu_gemv.dequantize (the tiles of products past the kernel's rows) equals quantized_matmul.dequantize bit for
    bit: each element times its scale in float32, rounded once to the dtype."""
    generator = torch.Generator().manual_seed(groups)
    weight, scale = fp8_weight(37, 120, groups, generator)
    if stored == torch.int8:
        weight = torch.randint(-128, 128, (37, 120), dtype=torch.int8, generator=generator)
    assert torch.equal(cpu_gemv.dequantize(weight, scale, dtype=dtype), dequantize(weight, scale, dtype=dtype))
    with pytest.raises(ValueError, match="zero"):
        cpu_gemv.dequantize(weight, scale, torch.zeros_like(scale), dtype=dtype)


def test_linear_reads_fp8_block_weights_in_the_kernel_up_to_its_rows(monkeypatch):
    """matmul.linear hands fp8 products of few rows with block scales to the kernel, and more rows than
    INT8_MAX_ROWS to torch's GEMM on tiles the kernels dequantize; a block that does not divide K (each column
    naming its group) stays on the tiles dequantized in torch."""
    generator = torch.Generator().manual_seed(4)
    calls, dequantized = [], []
    kernel, dequantizer = cpu_gemv.gemv_quantized, cpu_gemv.dequantize
    monkeypatch.setattr(cpu_gemv, "gemv_quantized", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    monkeypatch.setattr(cpu_gemv, "dequantize", lambda *args: dequantized.append(1) or dequantizer(*args))
    fmt = FP8BlockFormat({"weight_block_size": [16, 32]})
    for columns, rows, served in ((96, 4, True), (96, cpu_gemv.INT8_MAX_ROWS + 1, False), (100, 4, False)):
        stored = (torch.randn(40, columns, generator=generator) * 100).to(torch.float8_e4m3fn)
        blocks = torch.rand(3, -(-columns // 32), generator=generator) + 0.01
        q = fmt.convert("layer", {"weight": stored, "weight_scale_inv": blocks})
        x = torch.randn(rows, columns, generator=generator)
        calls.clear(), dequantized.clear()
        with torch.inference_mode():
            out = matmul.linear(x, q.weight, None, q.scale, q.zero, q.g_idx)
        torch.testing.assert_close(out, linear_reference(x, q.weight, q.scale, None, q.g_idx), rtol=1e-5, atol=1e-4)
        assert calls == ([rows] if served else [])
        assert bool(dequantized) == (q.g_idx is None and not served)
