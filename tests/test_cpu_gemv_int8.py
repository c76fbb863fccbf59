"""int8 weights' pair_weight copies (gemv_pairs.h: converted to bf16 in registers, or a tile at a time into a buffer
from two rows on) against F.linear in float64 of the scaled weight, and the model's layers reading them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_gemv
from kernels.matmul import linear
from workers.layers.linear import Linear
from workers.prepacking import prepack_linear_weights
from workers.quantization.online import quantize_model_rows

pytestmark = pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="gemv_pairs.h needs AVX-512 BF16")


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def int8_weight(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every int8 value, -128 included (its own entry of the kernel's table), and a scale per row."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=generator)
    weight.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)[:weight.numel()]
    return weight, torch.rand(rows, generator=generator) / 64 + 1e-3


def twin(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64 of the scaled weight, rounded once to x's dtype."""
    scaled = weight.double() * scale.double()[:, None]
    return F.linear(x.double(), scaled, None if bias is None else bias.double()).to(x.dtype)


def test_int8_pairs_hold_the_bf16_layout_in_the_unpack_order():
    weight, _ = int8_weight(45, 7, seed=0)
    pairs = cpu_gemv.pair_weight(weight)
    assert pairs.dtype == torch.int8 and pairs.shape == (2, 4, 32, 2) and cpu_gemv.fits_pairs(weight, pairs)
    as_bf16 = cpu_gemv.pair_weight(weight.bfloat16()).view(2, 4, 64)
    assert torch.equal(pairs.view(2, 4, 64)[..., cpu_gemv.INT8_PAIR_ORDER.argsort()].bfloat16(), as_bf16)
    assert sorted(cpu_gemv.INT8_PAIR_ORDER.tolist()) == list(range(64))


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 33, 64])
# Ragged tiles (45, 1003 rows), odd columns (7, 517, 1), one tile exactly (32, 64).
@pytest.mark.parametrize("shape", [(64, 32), (1003, 517), (45, 7), (32, 64), (5, 3), (40, 1)])
def test_int8_pairs_products_match_the_float64_twin(rows, shape):
    weight, scale = int8_weight(*shape, seed=rows)
    generator = torch.Generator().manual_seed(rows * 1000 + shape[0])
    x = torch.randn(rows, shape[1], generator=generator).bfloat16()
    bias = torch.randn(shape[0], generator=generator).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    for b in (None, bias):
        out = cpu_gemv.gemv_quantized(x, weight, scale, b, pairs)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
        torch.testing.assert_close(out.float(), twin(x, weight, scale, b).float(), rtol=2**-7, atol=1e-2)


def test_int8_pairs_round_exact_sums_like_torch():
    """Small integers times every int8 value sum exactly in float32: bf16 outputs equal torch's bit for bit."""
    weight, _ = int8_weight(300, 261, seed=1)
    x = torch.randint(-8, 9, (12, 261), generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = torch.full((300,), 0.25)
    pairs = cpu_gemv.pair_weight(weight)
    expected = F.linear(x.float(), weight.float() * 0.25).bfloat16()
    for rows in (1, 12):
        assert torch.equal(cpu_gemv.gemv_quantized(x[:rows], weight, scale, None, pairs), expected[:rows])


def test_int8_pairs_row_results_do_not_depend_on_the_rows_beside_them():
    weight, scale = int8_weight(300, 193, seed=5)
    x = torch.randn(64, 193, generator=torch.Generator().manual_seed(5)).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    whole = cpu_gemv.gemv_quantized(x, weight, scale, None, pairs)
    for start, stop in ((0, 1), (1, 2), (2, 9), (9, 23), (23, 64)):
        assert torch.equal(cpu_gemv.gemv_quantized(x[start:stop], weight, scale, None, pairs), whole[start:stop])


def test_int8_pairs_at_one_row_read_tiles_with_and_without_minus_128_alike():
    """One row reads tiles without -128 by the lookup without the zero mask, and a tile that holds -128 (and the
    thread's later tiles) again with it: every tile's outputs as the buffered path's from 2 rows, zero weights
    included (exact sums of small integers equal torch's bit for bit)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randint(-127, 128, (32 * 9 + 5, 133), dtype=torch.int8, generator=generator)
    weight[::3, ::2] = 0
    x = torch.randint(-8, 9, (2, 133), generator=generator).bfloat16()
    scale = torch.full((weight.shape[0],), 0.25)
    for minus_128_rows in ((), (70,), (3, 200, 290)):
        held = weight.clone()
        for row in minus_128_rows:
            held[row, row % 133] = -128
        pairs = cpu_gemv.pair_weight(held)
        expected = F.linear(x.float(), held.float() * 0.25).bfloat16()
        assert torch.equal(cpu_gemv.gemv_quantized(x[:1], held, scale, None, pairs), expected[:1])
        assert torch.equal(cpu_gemv.gemv_quantized(x, held, scale, None, pairs), expected)


def test_int8_pairs_are_checked():
    weight, scale = int8_weight(64, 32, seed=2)
    x = torch.randn(1, 32).bfloat16()
    for pairs, group_scale in ((cpu_gemv.pair_weight(weight[:32]), scale), (cpu_gemv.pair_weight(weight), None),
                               (cpu_gemv.pair_weight(weight.bfloat16()), scale)):
        with pytest.raises(ValueError, match="pairs"):
            cpu_gemv.gemv_quantized(x, weight, scale if group_scale is not None else scale[:, None].expand(64, 4)
                                    .contiguous(), None, pairs)


def test_linear_layers_get_and_read_int8_pairs(monkeypatch):
    """workers.prepacking gives an int8 layer with row scales in a bf16 model its int8 pairs copy (a float32 model's
    none); linear() reads it up to INT8_MAX_ROWS rows, float32 rows read the weight."""
    layers = {}
    for dtype in (torch.float32, torch.bfloat16):
        layers[dtype] = layer = Linear(96, 67, bias=True).to(dtype)
        torch.nn.init.normal_(layer.weight)
        quantize_model_rows(layer, quantize_lm_head=False)
        prepack_linear_weights(layer, available_bytes=1 << 40)
    assert layers[torch.float32].pairs_weight is None
    assert layer.pairs_weight.dtype == torch.int8 and cpu_gemv.fits_pairs(layer.weight, layer.pairs_weight)
    calls = []
    kernel = cpu_gemv.gemv_quantized
    monkeypatch.setattr(cpu_gemv, "gemv_quantized", lambda *args: calls.append(args[4] is not None) or kernel(*args))
    with torch.inference_mode():
        for rows, dtype in ((1, torch.bfloat16), (cpu_gemv.INT8_MAX_ROWS, torch.bfloat16), (3, torch.float32)):
            x = torch.randn(rows, 96).to(dtype)
            out = linear(x, layer.weight, None, layer.weight_scale, pairs=layer.pairs_weight)
            expected = twin(x, layer.weight, layer.weight_scale, None)
            torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-2)
    assert calls == [True, True, True]
