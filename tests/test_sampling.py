"""Sampling: seeds, top-k/top-p/min-p, min_tokens, logprobs; the sampler's draws follow the distribution."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from workers.layers.logprobs import gather_logprobs, rows_logprobs
from workers.layers.sampler import Penalties, Sampler, SamplingMetadata, _apply_penalties

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts([5, 40, 90], vocab=1000, seed=1)]


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32")
    yield llm
    llm.shutdown()


def texts(llm, params):
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outputs]


def test_same_seed_same_text_different_seed_different_text(llm):
    params = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    first = texts(llm, SamplingParams(seed=7, **params))
    assert texts(llm, SamplingParams(seed=7, **params)) == first
    assert texts(llm, SamplingParams(seed=8, **params)) != first


def test_seeded_request_is_independent_of_its_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=24, seed=3, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(PROMPTS, [seeded, noisy, noisy], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_top_k_one_equals_greedy(llm):
    greedy = texts(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert texts(llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True)) == greedy


def _draw(params: dict, logits: list[float], draws: int = 20000) -> torch.Tensor:
    rows = torch.tensor([logits] * draws)
    n = rows.shape[0]

    def column(name, default):
        return torch.full((n,), params.get(name, default)) if name in params else None

    meta = SamplingMetadata(temperature=torch.full((n,), params.get("temperature", 1.0)),
                            top_k=column("top_k", 0), top_p=column("top_p", 1.0), min_p=column("min_p", 0.0),
                            generators={}, banned_token_ids=params.get("banned", {}), num_logprobs={})
    tokens = Sampler(torch.Generator().manual_seed(0))(rows, meta).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)) / n


PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log().tolist()


@pytest.mark.parametrize("params, expected", [
    ({}, PROBS),
    ({"top_k": 2}, [0.625, 0.375, 0, 0]),
    ({"top_p": 0.7}, [0.625, 0.375, 0, 0]),
    ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"min_p": 0.5}, [0.625, 0.375, 0, 0]),
    ({"banned": {i: [0] for i in range(20000)}}, [0, 0.6, 0.3, 0.1]),
])
def test_sampler_draws_follow_the_filtered_distribution(params, expected):
    frequencies = _draw(params, LOGITS)
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.015, rtol=0)


def test_temperature_sharpens():
    cold = _draw({"temperature": 0.5}, LOGITS)
    expected = torch.tensor(PROBS) ** 2 / (torch.tensor(PROBS) ** 2).sum()
    torch.testing.assert_close(cold, expected, atol=0.015, rtol=0)


def test_logprobs_match_hf_log_softmax(llm, llama_model):
    from hf_reference import _hf_model

    prompt = PROMPTS[1]["prompt_token_ids"]
    [output] = llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True),
                            use_tqdm=False)
    completion = output.outputs[0]
    with torch.inference_mode():
        logits = _hf_model(llama_model)(torch.tensor([prompt + completion.token_ids])).logits[0].float()
    reference = logits.log_softmax(-1)[len(prompt) - 1:len(prompt) - 1 + 3]
    assert len(completion.logprobs) == 3
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert len(entry) == 2 + (token not in reference[step].topk(2).indices.tolist())
        assert entry[token].rank == 1  # greedy picks the most likely token
        torch.testing.assert_close(entry[token].logprob, reference[step, token].item(), atol=1e-4, rtol=0)
    expected_cumulative = sum(reference[s, t].item() for s, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected_cumulative, abs=1e-3)


def test_top_logprobs_take_ties_in_id_order():
    """bf16 logits tie often; the top-k logprobs are taken by value, then by the lower id (torch.topk's order of ties
    is open), and the rank counts only the logprobs strictly above the token's."""
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randint(0, 5, (6, 40), generator=generator).float()
    tokens = torch.randint(0, 40, (6,), generator=generator)
    ids, values, ranks = gather_logprobs(logprobs, tokens, 7)
    for row in range(6):
        best = sorted(range(40), key=lambda v: (-logprobs[row, v].item(), v))[:7]
        assert ids[row] == [tokens[row].item(), *best]
        assert values[row] == [logprobs[row, v].item() for v in ids[row]]
        assert ranks[row] == 1 + int((logprobs[row] > logprobs[row, tokens[row]]).sum())


def test_a_steps_rows_logprobs_are_each_rows_alone():
    """The sampler gathers the rows asking for the same number of top logprobs together; each row's result is what
    it would be alone (ties included), whatever the rows beside it ask for."""
    generator = torch.Generator().manual_seed(1)
    logprobs = torch.randint(0, 5, (7, 40), generator=generator).float()
    tokens = torch.randint(0, 40, (7,), generator=generator)
    asks = {0: 3, 2: 0, 3: 3, 5: 7, 6: 3}
    out = rows_logprobs(logprobs, tokens, asks)
    assert sorted(out) == sorted(asks)
    for row, n in asks.items():
        ids, values, ranks = gather_logprobs(logprobs[row:row + 1], tokens[row:row + 1], n)
        assert out[row] == (ids[0], values[0], ranks[0])
        assert len(out[row][0]) == 1 + n


def test_min_tokens_holds_back_eos(llama_model):
    from core import EngineCore
    from ipc import EngineConfig, EngineCoreRequest

    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32"))
    prompt = PROMPTS[0]["prompt_token_ids"]

    def run(**params):
        engine.add_request(EngineCoreRequest(request_id=str(params), prompt_token_ids=prompt, eos_token_id=eos,
                                             sampling_params=SamplingParams(temperature=0.0, max_tokens=8, **params)))
        tokens, reason = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
        return tokens, reason.value

    eos = None
    greedy, _ = run()
    eos = greedy[0]  # pretend the first greedy token is EOS
    assert run() == ([eos], "stop")
    held, _ = run(min_tokens=3)
    assert len(held) >= 3 and eos not in held[:3]
    assert run(ignore_eos=True) == (greedy, "length")


def test_repetition_penalty_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator)
    seen = [[1, 2, 2, 7], [0, 49], [3]]  # prompt + generated ids per row
    expected = torch.cat([RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits[i:i + 1].clone())
                          for i, ids in enumerate(seen)])
    penalized = logits.clone()
    _apply_penalties(penalized, Penalties(rows=[0, 1, 2], presence=torch.zeros(3), frequency=torch.zeros(3),
                                          repetition=torch.full((3,), 1.3), output_token_ids=[[], [], []],
                                          seen_token_ids=seen))
    torch.testing.assert_close(penalized, expected)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(2, 10)
    _apply_penalties(logits, Penalties(rows=[1], presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]),
                                       repetition=torch.tensor([1.0]), output_token_ids=[[4, 4, 4, 9]],
                                       seen_token_ids=[[0, 4, 4, 4, 9]]))
    expected = torch.zeros(2, 10)
    expected[1, 4] = -(0.5 + 3 * 0.25)
    expected[1, 9] = -(0.5 + 0.25)
    assert torch.equal(logits, expected)  # row 0 untouched; the prompt token 0 is not counted


def test_greedy_with_repetition_penalty_equals_hf(llm, llama_model):
    prompt = PROMPTS[0]["prompt_token_ids"]
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                                      repetition_penalty=1.5), use_tqdm=False)
    theirs = hf_greedy(llama_model, prompt, 32, repetition_penalty=1.5)
    assert ours[0].outputs[0].token_ids == theirs
    assert theirs != hf_greedy(llama_model, prompt, 32)  # the penalty did change the output


def test_frequency_penalty_discourages_repeats(llm):
    plain = texts(llm, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    penalized = texts(llm, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0))
    repeats = [len(ids) - len(set(ids)) for ids in plain]
    assert sum(len(ids) - len(set(ids)) for ids in penalized) < sum(repeats)


LARGEST_DRAW = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # uniform_ draws from [0, 1)


@pytest.mark.parametrize("draw, expected", [(0.0, 1), (LARGEST_DRAW, 3)])
def test_inverse_cdf_draws_only_tokens_with_weight(monkeypatch, draw, expected):
    """The smallest and the largest uniform draws land on the first and the last token with weight, never on the
    zero-weight tokens around them (a banned or grammar-masked token); an all-zero row stays in range."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    monkeypatch.setattr(sampler, "_draw", lambda fill, shape, meta: torch.full(shape, draw))
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.1, 0.0, 0.0], [0.0] * 6])
    meta = SamplingMetadata(temperature=torch.ones(2), top_k=None, top_p=None, min_p=None, generators={},
                            banned_token_ids={}, num_logprobs={})
    tokens = sampler._inverse_cdf(weights, meta).tolist()
    assert tokens[0] == expected and 0 <= tokens[1] < 6
