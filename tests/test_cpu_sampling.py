"""The CPU sampling kernel (kernels/csrc/sample.h) against its torch twin, Sampler._inverse_cdf over
softmax(logits / t), and its edges: zero-weight tokens never drawn, rows without any weight refused, block
boundaries."""
from __future__ import annotations

import pytest
import torch

from conftest import pairwise
from kernels import cpu_extension, cpu_sampling
from workers.layers.sampler import Sampler, SamplingMetadata, _distribution


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def twin(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, filters: dict
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's tokens, and whether each draw is clear of a token boundary (rounding apart: the two
    compute the same weights within a few ulps, so a point that close to a boundary may fall either side)."""
    sampler = Sampler(torch.Generator())
    sampler._draw = lambda fill, shape, meta: uniform.reshape(shape).float()
    meta = SamplingMetadata(temperature=temperature, top_k=filters.get("top_k"), top_p=filters.get("top_p"),
                            min_p=filters.get("min_p"), generators={}, banned_token_ids={}, num_logprobs={})
    probs = _distribution(logits, meta)
    tokens = sampler._inverse_cdf(probs, meta)
    cdf = probs.double().cumsum(dim=-1)
    point = uniform.reshape(-1, 1).float().double() * cdf[:, -1:]
    distance = (cdf - point).abs().min(dim=-1).values
    return tokens, distance > 1e-6


def _filters(kind: str, rows: int, generator: torch.Generator) -> dict:
    """Per-row top-k, top-p and min-p, some rows without (0, 1, 0)."""
    top_k = torch.randint(1, 60, (rows,), generator=generator) * (torch.arange(rows) % 3 != 0)
    top_p = torch.where(torch.arange(rows) % 4 != 1, torch.rand(rows, generator=generator) * 0.9 + 0.05, 1.0)
    min_p = torch.where(torch.arange(rows) % 5 != 2, torch.rand(rows, generator=generator) * 0.2, 0.0)
    every = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    return every if kind == "all" else {kind: every[kind]} if kind != "none" else {}


# Peaked first: most of the largest vocabulary's default cases are then the cheaper, peaked ones.
@pytest.mark.parametrize("filters, vocab, scale", pairwise(["none", "top_k", "top_p", "min_p", "all"], [7, 257, 8256],
                                                         [6.0, 1.0]))
def test_matches_the_torch_twin(vocab, filters, scale):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(48, vocab, generator=generator) * scale
    logits[::5, ::3] = float("-inf")  # banned tokens in some rows
    temperature = torch.rand(48, generator=generator) * 1.5 + 0.2
    chosen = _filters(filters, 48, generator)
    clear = compared = 0
    for _ in range(10):
        uniform = torch.rand(48, generator=generator)
        expected, away = twin(logits, temperature, uniform, chosen)
        tokens = cpu_sampling.sample(logits, temperature, uniform.float().double(), **chosen)
        assert torch.equal(tokens[away], expected[away])
        assert torch.isfinite(logits[torch.arange(48), tokens]).all()
        clear += int(away.sum())
        compared += len(away)
    assert clear > 0.98 * compared


@pytest.mark.parametrize("filters, vocab, drawn_from", pairwise(["none", "top_p", "all"], [7, 257, 8256],
                                                                ["one-hot", "q"]))
def test_draft_verification_matches_the_torch_twin(vocab, filters, drawn_from):
    """Drafts (each row's likeliest token, a random one, none), one-hot guesses or drawn from a draft model's q,
    verified by the kernel as the torch path verifies them (Sampler._verify_drafts, then _inverse_cdf over the
    residual): the same tokens at the same accept and uniform draws, but where a draw is within rounding of the
    acceptance threshold or of a token boundary."""
    generator = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(48, vocab, generator=generator) * 3.0
    temperature = torch.rand(48, generator=generator) * 1.5 + 0.2
    chosen = _filters(filters, 48, generator)
    rows = torch.arange(48)
    drafts = torch.where(rows % 3 == 0, logits.argmax(dim=-1), torch.randint(0, vocab, (48,), generator=generator))
    drafts[rows % 3 == 2] = -1
    q = torch.softmax(torch.randn(48, vocab, generator=generator) * 2.0, dim=-1) if drawn_from == "q" else None
    meta = SamplingMetadata(temperature=temperature, top_k=chosen.get("top_k"), top_p=chosen.get("top_p"),
                            min_p=chosen.get("min_p"), generators={}, banned_token_ids={}, num_logprobs={},
                            draft_token_ids=drafts, draft_probs=q)
    probs = _distribution(logits.clone(), meta)
    index = drafts.clamp(min=0).unsqueeze(1)
    threshold = probs.gather(1, index).squeeze(1).double() / (1.0 if q is None else q.gather(1, index).squeeze(1))
    clear = compared = kept = 0
    for _ in range(10):
        accept, uniform = torch.rand(48, generator=generator), torch.rand(48, generator=generator)
        sampler, draws = Sampler(torch.Generator()), iter([accept, uniform])
        sampler._draw = lambda fill, shape, meta: next(draws).reshape(shape).float()
        accepted, residual = sampler._verify_drafts(probs, meta)
        expected = torch.where(accepted, drafts, sampler._inverse_cdf(residual, meta))
        tokens = cpu_sampling.sample(logits, temperature, uniform.double(), **chosen, drafts=drafts,
                                     accept=accept.double(), draft_probs=q)
        cdf = residual.double().cumsum(dim=-1)
        point = uniform.double().unsqueeze(1) * cdf[:, -1:]
        clear_of_draft = ((accept.double() - threshold).abs() > 1e-5) | (drafts < 0)
        away = clear_of_draft & (accepted | ((cdf - point).abs().min(dim=-1).values > 1e-6))
        assert torch.equal(tokens[away], expected[away])
        clear += int(away.sum())
        compared += len(away)
        kept += int(((tokens == drafts) & (drafts >= 0)).sum())
    assert clear > 0.95 * compared and 0 < kept < 320  # some drafts kept, some rejected


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


@pytest.mark.parametrize("filters, kept", [({"top_k": torch.tensor([2])}, [0, 1]),
                                           ({"top_p": torch.tensor([0.7])}, [0, 1]),
                                           ({"min_p": torch.tensor([0.5])}, [0, 1]),
                                           ({"top_p": torch.tensor([0.95]), "top_k": torch.tensor([3])}, [0, 1, 2]),
                                           ({"top_p": torch.tensor([0.35]), "equal": 10}, [0, 3]),
                                           ({"top_p": torch.tensor([0.35]), "equal": 1000}, [0, 349])])
def test_filters_keep_the_tokens_their_rules_name(filters, kept):
    """Probabilities 0.5, 0.3, 0.15, 0.05: top-k 2, top-p 0.7 (0.5 < 0.7, then 0.8) and min-p 0.5 (>= 0.25) keep the
    first two; top-p 0.95 after top-k 3 keeps all three (0.8 < 0.95 of their 0.95). Equal probabilities: top-p keeps
    the fewest that reach it, the first in token order. The smallest and largest draws land on the first and the
    last token kept."""
    filters = dict(filters)
    equal = filters.pop("equal", None)
    logits = torch.zeros(1, equal) if equal else torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    ends = [cpu_sampling.sample(logits, torch.ones(1), torch.tensor([u], dtype=torch.float64), **filters).item()
            for u in (0.0, 1.0 - 2 ** -24)]
    assert ends == [kept[0], kept[-1]]


@pytest.mark.parametrize("vocab", [7, 1000, 32064])
def test_log_softmax_matches_torch(vocab):
    """The sampler's logprobs on the CPU (the kernel the C++ multi-step calls report theirs with) against torch's
    log_softmax, masked (-inf) logits included."""
    cpu_extension.load()
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 6
    logits[0, :vocab // 2] = float("-inf")
    got, expected = cpu_sampling.log_softmax(logits), torch.log_softmax(logits, dim=-1)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    # within two float32 ulps of torch's: at logprobs near -33 one ulp is 3.8e-6 (AVX-512 sums in another order)
    assert torch.allclose(got[finite], expected[finite], atol=2e-6, rtol=2.4e-7)
