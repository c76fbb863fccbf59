"""The CPU sampling kernel (kernels/csrc/sample.h) against its torch twin, Sampler._inverse_cdf over
softmax(logits / t), and its edges: zero-weight tokens never drawn, rows without any weight refused, block
boundaries."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, cpu_sampling
from workers.layers.sampler import Sampler, SamplingMetadata


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def twin(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's tokens, and whether each draw is clear of a token boundary (rounding apart: the two
    compute the same weights within a few ulps, so a point that close to a boundary may fall either side)."""
    sampler = Sampler(torch.Generator())
    sampler._draw = lambda fill, shape, meta: uniform.reshape(shape).float()
    meta = SamplingMetadata(temperature=temperature, top_k=None, top_p=None, min_p=None, generators={},
                            banned_token_ids={}, num_logprobs={})
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    tokens = sampler._inverse_cdf(probs, meta)
    cdf = probs.double().cumsum(dim=-1)
    point = uniform.reshape(-1, 1).float().double() * cdf[:, -1:]
    distance = (cdf - point).abs().min(dim=-1).values
    return tokens, distance > 1e-6


@pytest.mark.parametrize("vocab", [7, 256, 257, 1000, 8256])
def test_matches_the_torch_twin(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(48, vocab, generator=generator) * 4
    logits[::5, ::3] = float("-inf")  # banned tokens in some rows
    temperature = torch.rand(48, generator=generator) * 1.5 + 0.2
    clear = compared = 0
    for _ in range(20):
        uniform = torch.rand(48, generator=generator)
        expected, away = twin(logits, temperature, uniform)
        tokens = cpu_sampling.sample(logits, temperature, uniform.float().double())
        assert torch.equal(tokens[away], expected[away])
        assert torch.isfinite(logits[torch.arange(48), tokens]).all()
        clear += int(away.sum())
        compared += len(away)
    assert clear > 0.98 * compared


@pytest.mark.parametrize("uniform, expected", [(0.0, 1), (1.0 - 2 ** -24, 299)])
def test_the_extreme_draws_land_on_the_first_and_last_tokens_with_weight(uniform, expected):
    """Tokens 1..299 have weight (the first block, a whole second and part of a third), the rest -inf."""
    logits = torch.full((1, 600), float("-inf"))
    logits[0, 1:300] = torch.linspace(-2.0, 2.0, 299)
    tokens = cpu_sampling.sample(logits, torch.ones(1), torch.tensor([uniform], dtype=torch.float64))
    assert tokens.tolist() == [expected]


def test_each_draw_picks_the_token_whose_share_holds_it():
    """Four equal weights: the draw's quarter is the token (no rounding near 0.1, 0.35, 0.6, 0.85)."""
    logits = torch.zeros(4, 4)
    tokens = cpu_sampling.sample(logits, torch.full((4,), 0.7), torch.tensor([0.1, 0.35, 0.6, 0.85]).double())
    assert tokens.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", ["all -inf", "nan"])
def test_a_row_without_weight_is_refused(bad):
    logits = torch.zeros(3, 10)
    logits[1] = float("-inf")
    if bad == "nan":
        logits[1] = 0.0
        logits[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        cpu_sampling.sample(logits, torch.ones(3), torch.full((3,), 0.5, dtype=torch.float64))
