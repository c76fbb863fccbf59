"""A mixture's expert products (experts.h's expert_products; AMX tile products where the process may use them)
against F.linear in float64, row by row the same in any step, and on AMX CPUs actually on the tiles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: CPUs with AVX-512 BF16")


def expert_product(x: torch.Tensor, pairs: torch.Tensor, out_features: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    cpu_extension.required().expert_product(x.data_ptr(), pairs.data_ptr(), y.data_ptr(), x.shape[0], out_features,
                                            x.shape[1])
    return y


def gemv_pairs(x: torch.Tensor, pairs: torch.Tensor, out_features: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    cpu_extension.required().gemv_pairs(x.data_ptr(), pairs.data_ptr(), 0, y.data_ptr(), x.shape[0], out_features,
                                        x.shape[1])
    return y


# K: whole 32-column chunks, a partial last chunk, an odd count; N: whole tiles and a partial last one.
@pytest.mark.parametrize("out_features, in_features", [(64, 512), (74, 37), (33, 72), (512, 352)])
@pytest.mark.parametrize("rows", [1, 7, 16, 37])
def test_matches_float64_twin_and_each_row_alone(rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    out = expert_product(x, pairs, out_features)
    expected = F.linear(x.double(), weight.double())
    # float32 sums in another order than float64's, then one rounding: within a bf16 step of each output and a
    # float32-sized error of the sum's terms.
    bound = expected.abs() * 2 ** -8 + 1e-5 * (x.double().abs() @ weight.double().abs().T)
    assert ((out.double() - expected).abs() <= bound).all()
    for row in {0, rows // 2, rows - 1}:  # a row's output does not depend on the rows beside it, bit for bit
        assert torch.equal(expert_product(x[row:row + 1].clone(), pairs, out_features), out[row:row + 1])


def test_on_amx_cpus_the_products_are_tile_products():
    """Where the CPU and kernel give AMX, the experts take it; elsewhere they are gemv_pairs' products exactly. The
    weights' rows are made nearly orthogonal to x's first row: its sums cancel to a few bf16 steps of their terms,
    so the float32 sums' other order (tile products against vdpbf16ps's) shows after the rounding."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, 512, generator=generator).bfloat16()
    first, v = x[0].float(), torch.randn(256, 512, generator=generator)
    weight = (v - (v @ first / (first @ first))[:, None] * first).bfloat16()
    pairs = cpu_gemv.pair_weight(weight)
    same = torch.equal(expert_product(x, pairs, 256), gemv_pairs(x, pairs, 256))
    assert same != cpu_extension.required().amx_usable()
