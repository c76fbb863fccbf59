"""A fault while preparing or sampling one request ends that request with an error; the batch and engine go on."""
from __future__ import annotations

import pytest

from conftest import random_prompts
from core import EngineCore
from ipc import EngineConfig, EngineCoreOutputs, EngineCoreRequest, FinishReason, SamplingParams
from ipc.bounds import INT32_MAX
from workers.layers.sampler import Sampler
from workers.fast_path.later_step_calls import LaterStepCalls
from workers.request_state import CachedRequestState

MARKER = 3  # the faulty request's prompt starts with this token; the others never do


@pytest.fixture(scope="module")
def engine(llama_model):
    engine = EngineCore(EngineConfig(model=llama_model, dtype="float32", max_model_len=128, num_kv_blocks=64,
                                     block_size=8))
    yield engine
    engine.shutdown()


def _requests(vocab: int, with_faulty: bool) -> list[EngineCoreRequest]:
    prompts = [[t for t in p if t != MARKER] or [1] for p in random_prompts([20, 9, 31, 14], vocab, seed=5)]
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.9, seed=11, logit_bias={5: 4.0}, top_k=7),
              SamplingParams(max_tokens=12, temperature=0.8, seed=12, repetition_penalty=1.3, min_tokens=3,
                             stop_token_ids=[9]),
              SamplingParams(max_tokens=12, temperature=0.7, seed=13, top_p=0.9, logprobs=2)]
    requests = [EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=sp)
                for i, (p, sp) in enumerate(zip(prompts, params))]
    if with_faulty:
        requests.insert(2, EngineCoreRequest(request_id="faulty", prompt_token_ids=[MARKER, 4, 5, 6, 7],
                                             sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                                            top_k=5, bad_words_token_ids=[[8]])))
    return requests


def _run(engine: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict[str, list[int]], list]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors = []
    for request in requests:
        engine.validate_request(request)
        engine.add_request(request)
    while engine.has_unfinished_requests():
        outputs = EngineCoreOutputs.of_step(engine.step())
        errors += outputs.errors
        for output in outputs.outputs:
            assert output.finish_reason != FinishReason.ERROR
            tokens[output.request_id] += output.new_token_ids
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    return tokens, errors


@pytest.mark.parametrize("fault", ["preparing", "sampling"])
def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch, fault):
    expected, errors = _run(engine, _requests(engine.vocab_size, with_faulty=False))
    assert errors == [] and all(len(t) > 0 for t in expected.values())
    if fault == "preparing":
        banned = CachedRequestState.banned_token_ids

        def faulty_bans(state: CachedRequestState, drafts: list[int] = ()) -> list[int]:
            if state.token_ids[0] == MARKER:
                raise IndexError("injected fault")
            return banned(state, drafts)
        monkeypatch.setattr(CachedRequestState, "banned_token_ids", faulty_bans)
    else:
        random_sample = Sampler._random_sample

        def faulty_sample(sampler: Sampler, logits, meta, greedy_tokens):
            # After the batch's biases, penalties and random draws: a retry must start from the state before them.
            tokens = random_sample(sampler, logits, meta, greedy_tokens)
            if meta.top_k is not None and (meta.top_k == 5).any():
                raise RuntimeError("injected fault")
            return tokens
        monkeypatch.setattr(Sampler, "_random_sample", faulty_sample)
    tokens, errors = _run(engine, _requests(engine.vocab_size, with_faulty=True))
    assert [(e.request_id, e.kind) for e in errors] == [("faulty", "failed")]
    assert "injected fault" in errors[0].message
    assert tokens.pop("faulty") == []
    assert tokens == expected  # greedy and seeded requests alike, logit bias and penalties applied once


def test_top_k_beyond_the_vocabulary_samples_from_all_of_it(engine):
    def sample(top_k: int) -> dict[str, list[int]]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=21, top_k=top_k)
        tokens, errors = _run(engine, [EngineCoreRequest(request_id="k", prompt_token_ids=[1, 2, 3],
                                                         sampling_params=params)])
        assert errors == []
        return tokens
    assert sample(INT32_MAX) == sample(engine.vocab_size + 1) == sample(0)


def test_a_fault_in_a_later_step_of_a_call_fails_that_request_alone(engine, monkeypatch):
    """Without logprobs in the batch its decode steps run several per worker call: the fault comes in a step after
    a call's first (a ban over the call's tokens so far, in the Python steps: the C++ call's steps do no host work
    per request); the others run on with the tokens they had without it."""
    def requests(with_faulty: bool) -> list[EngineCoreRequest]:
        return [r for r in _requests(engine.vocab_size, with_faulty) if r.sampling_params.logprobs is None]
    expected, errors = _run(engine, requests(with_faulty=False))
    assert errors == []
    banned = CachedRequestState.banned_token_ids

    def faulty_bans(state: CachedRequestState, after: list[int] = ()) -> list[int]:
        if state.token_ids[0] == MARKER and after:
            raise IndexError("injected fault")
        return banned(state, after)
    monkeypatch.setattr(CachedRequestState, "banned_token_ids", faulty_bans)
    monkeypatch.setattr(LaterStepCalls, "_in_one_call", lambda self, steps, count, output, grammars: False)
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    tokens, errors = _run(engine, requests(with_faulty=True))
    assert [(e.request_id, e.kind) for e in errors] == [("faulty", "failed")]
    assert len(tokens.pop("faulty")) < 12
    assert tokens == expected
    assert len(steps) < 12  # several decode steps per call
