"""The CPU linear kernels (GEMV at few rows, packed GEMM tiles from 12 rows) against F.linear in float64 (their
twin), and when the linear layers use them."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_gemv
from workers.layers.linear import linear


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64, rounded once to the inputs' dtype."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 12 rows on: the GEMM tiles, with blocks of 16 and 8 rows, partial ones, and a second pass of 128 rows.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 12, 16, 21, 40, 131])
# (48, 200): blocks of 16 weight rows at any rows (short rows), with a partial last 32 columns.
@pytest.mark.parametrize("shape", [(64, 32), (1003, 517), (48, 200), (37, 8), (5, 3)])
def test_matches_float64_twin(dtype, rows, shape):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for b in (None, bias):
        out = cpu_gemv.gemv(x, weight, b)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        expected = twin(x, weight, b)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * in_features**0.5)
        else:  # float32 sums round to bf16 once: at most one bf16 step from the exactly rounded value
            torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-2)


def test_bfloat16_rounds_exact_sums_like_torch():
    """Small integers sum exactly in float32: the bf16 outputs must then equal torch's, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-8, 9, (300, 260), generator=generator).bfloat16()
    x = torch.randint(-8, 9, (3, 260), generator=generator).bfloat16()
    bias = torch.randint(-100, 100, (300,), generator=generator).bfloat16()
    assert torch.equal(cpu_gemv.gemv(x, weight, bias), F.linear(x.float(), weight.float(), bias.float()).bfloat16())


def test_bfloat16_keeps_nan_and_infinity():
    weight = torch.ones(32, 64).bfloat16()
    x = torch.ones(2, 64).bfloat16()
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    out = cpu_gemv.gemv(x, weight)
    assert out[0].isnan().all() and (out[1] == float("inf")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 12, 40, 131])  # the GEMM tiles from 12 rows (per-row scales)
@pytest.mark.parametrize("groups", [0, 4])
def test_int8_weights_match_the_float64_twin_of_the_scaled_weight(dtype, rows, groups):
    generator = torch.Generator().manual_seed(rows + groups)
    weight = torch.randint(-128, 128, (67, 96), dtype=torch.int8, generator=generator)
    scale = torch.rand(67, groups, generator=generator).squeeze(1) / 64 + 1e-3 if groups else \
        torch.rand(67, generator=generator) / 64 + 1e-3
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    bias = torch.randn(67, generator=generator).to(dtype)
    dequantized = weight.double() * (scale.double().repeat_interleave(96 // groups, dim=1) if groups
                                     else scale.double()[:, None])
    out = cpu_gemv.gemv_quantized(x, weight, scale, bias)
    expected = F.linear(x.double(), dequantized, bias.double())
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), **tolerance)


def test_keeps_leading_dimensions():
    weight, x = torch.randn(24, 16), torch.randn(2, 3, 16)
    torch.testing.assert_close(cpu_gemv.gemv(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_use_it_up_to_max_rows_at_inference(monkeypatch, dtype):
    calls = []
    kernel = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *args: calls.append(args[0].shape) or kernel(*args))
    weight, bias = torch.randn(40, 24).to(dtype), torch.randn(40).to(dtype)
    limit = cpu_gemv.max_rows(dtype, weight)
    served = [rows for rows in (1, 12, 300) if rows <= limit] + ([limit] if limit <= 1024 else [])
    declined = [limit + 1] if limit <= 1024 else []
    with torch.inference_mode():
        for rows in served + declined:
            x = torch.randn(rows, 24).to(dtype)
            expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
            torch.testing.assert_close(linear(x, weight, bias), expected, rtol=2**-7, atol=1e-2)
    assert calls == [(rows, 24) for rows in served]


def test_row_limits_follow_the_cpu(monkeypatch):
    """AVX2 only: bf16 weights at any row count, float32 up to FLOAT32_MAX_ROWS; AVX-512 BF16: the bf16 dot
    products up to NATIVE_BF16_MAX_ROWS; AVX-512 without it: few rows, where torch's GEMMs cannot use its width."""
    for flags, bf16, float32 in ((frozenset({"avx2", "fma"}), sys.maxsize, cpu_gemv.FLOAT32_MAX_ROWS),
                                 (frozenset({"avx2", "avx512f"}), 4, 64),
                                 (frozenset({"avx2", "avx512f", "avx512_bf16"}), cpu_gemv.NATIVE_BF16_MAX_ROWS,
                                  cpu_gemv.FLOAT32_MAX_ROWS)):
        monkeypatch.setattr(cpu_gemv, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(cpu_gemv, "cpu_has_native_bf16", lambda flags=flags: "avx512_bf16" in flags)
        assert (cpu_gemv.max_rows(torch.bfloat16), cpu_gemv.max_rows(torch.float32)) == (bf16, float32)
        assert cpu_gemv.max_rows(torch.float32, torch.zeros(8, 8, dtype=torch.int8)) == cpu_gemv.INT8_MAX_ROWS


@pytest.mark.parametrize("case", ["grad", "mixed dtypes", "float16", "strided weight", "too many rows"])
def test_declines_what_it_does_not_compute(case):
    weight, x, bias = torch.randn(16, 8), torch.randn(2, 8), None
    if case == "mixed dtypes":
        x = x.bfloat16()
    elif case == "float16":
        weight, x = weight.half(), x.half()
    elif case == "strided weight":
        weight = torch.randn(8, 16).t()
    elif case == "too many rows":
        x = torch.randn(cpu_gemv.max_rows(torch.float32) + 1, 8)
    with torch.set_grad_enabled(case == "grad"):
        assert not cpu_gemv.serves(x, weight, bias)
    with torch.inference_mode():
        assert cpu_gemv.serves(torch.randn(2, 8), torch.randn(16, 8), torch.randn(16)) is True


native_bf16 = pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="gemv_pairs.h needs AVX-512 BF16")


def test_pair_weight_lays_out_column_pairs_of_32_rows():
    weight = torch.randn(45, 7).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    assert pairs.shape == (2, 4, 32, 2) and pairs.is_contiguous() and cpu_gemv.fits_pairs(weight, pairs)
    for tile, pair, row, half in torch.cartesian_prod(*(torch.arange(n) for n in pairs.shape)).tolist():
        n, k = 32 * tile + row, 2 * pair + half
        assert pairs[tile, pair, row, half] == (weight[n, k] if n < 45 and k < 7 else 0)
    assert not any(cpu_gemv.fits_pairs(w, p) for w, p in ((weight[:32], pairs), (weight[:, :5], pairs),
                                                         (weight, pairs.float())))


@native_bf16
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64])
# Ragged tiles (45, 1003 rows), odd columns (7, 517, 1), one tile exactly (32, 64).
@pytest.mark.parametrize("shape", [(64, 32), (1003, 517), (45, 7), (32, 64), (5, 3), (40, 1)])
def test_pairs_products_match_float64_twin(rows, shape):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    for b in (None, bias):
        out = cpu_gemv.gemv(x, weight, b, pairs)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        torch.testing.assert_close(out.float(), twin(x, weight, b).float(), rtol=2**-7, atol=1e-2)


@native_bf16
def test_pairs_row_results_do_not_depend_on_the_rows_beside_them():
    """Each output sums its column pairs in one order whatever the row count, tiling or threads: a verify step's
    rows equal the same tokens' one-row decode steps bit for bit."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 193, generator=generator).bfloat16()
    x = torch.randn(64, 193, generator=generator).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    whole = cpu_gemv.gemv(x, weight, None, pairs)
    for start, stop in ((0, 1), (1, 6), (6, 14), (14, 23), (23, 64)):
        assert torch.equal(cpu_gemv.gemv(x[start:stop], weight, None, pairs), whole[start:stop])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_gemv.gemv(x, weight, None, pairs), whole)
    finally:
        torch.set_num_threads(threads)


@native_bf16
def test_pairs_round_exact_sums_like_torch_and_keep_nan_and_infinity():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-8, 9, (300, 261), generator=generator).bfloat16()
    x = torch.randint(-8, 9, (3, 261), generator=generator).bfloat16()
    bias = torch.randint(-100, 100, (300,), generator=generator).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    assert torch.equal(cpu_gemv.gemv(x, weight, bias, pairs),
                       F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    x[0, 3], x[1, 260] = float("nan"), float("inf")
    out = cpu_gemv.gemv(x, torch.ones(32, 261).bfloat16(), None, cpu_gemv.pair_weight(torch.ones(32, 261).bfloat16()))
    assert out[0].isnan().all() and (out[1] == float("inf")).all()


@native_bf16
def test_linear_reads_the_pairs_copy_up_to_its_row_limit(monkeypatch):
    calls = []
    kernel = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *args: calls.append(args[0].shape) or kernel(*args))
    weight = torch.randn(2048, 512).bfloat16()  # past gemv_bf16.h's own limit without the copy
    pairs = cpu_gemv.pair_weight(weight)
    assert cpu_gemv.max_rows(torch.bfloat16, weight) < cpu_gemv.PAIRS_MAX_ROWS
    with torch.inference_mode():
        for rows in (1, cpu_gemv.PAIRS_MAX_ROWS, cpu_gemv.PAIRS_MAX_ROWS + 1):
            x = torch.randn(rows, 512).bfloat16()
            expected = twin(x, weight, None)
            torch.testing.assert_close(linear(x, weight, pairs=pairs).float(), expected.float(), rtol=2**-7,
                                       atol=1e-2)
    assert calls == [(1, 512), (cpu_gemv.PAIRS_MAX_ROWS, 512)]
    with pytest.raises(ValueError, match="pair_weight"):
        cpu_gemv.gemv(torch.randn(1, 512).bfloat16(), weight, None, cpu_gemv.pair_weight(weight[:2000]))
