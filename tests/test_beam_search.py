"""LLM.beam_search equals transformers' beam search (float32), width 1 equals greedy, and leaves no block used."""
from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams
from hf_reference import hf_beam_search

WIDTH = 4
MAX_TOKENS = 10
PROMPTS = random_prompts([2, 4, 7, 12], vocab=1000, seed=0)
# (length_penalty, early_stopping): positive, negative and strong penalties under each stop rule.
CASES = [(1.0, True), (1.0, False), (1.0, "never"), (-0.5, True), (2.0, False)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request) -> Iterator[tuple[str, LLM]]:
    model_dir = tiny_model(request.param)
    llm = LLM(model_dir, dtype="float32", in_process=True)
    yield model_dir, llm
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def eos_engine(request, tmp_path_factory) -> Iterator[tuple[str, LLM]]:
    model_dir = with_likely_eos(tiny_model(request.param), tmp_path_factory.mktemp(f"{request.param}-eos"))
    llm = LLM(model_dir, dtype="float32", in_process=True)
    yield model_dir, llm
    assert_all_blocks_free(llm)
    llm.shutdown()


@torch.inference_mode()
def with_likely_eos(model_dir: str, out_dir: Path, strength: float = 4.0) -> str:
    """A copy of the model whose EOS is among the top four tokens at about half the positions (a random model
    almost never emits it): EOS's output row points along the mean final hidden state."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden = model.model(torch.tensor(random_prompts([40] * 8, vocab=1000, seed=5))).last_hidden_state
    direction = hidden.flatten(0, 1).mean(dim=0)
    model.lm_head.weight[model.config.eos_token_id] = strength * direction / direction.norm() ** 2
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out_dir / name)
    return str(out_dir)


def search(llm: LLM, prompts: list[list[int]], **params) -> list[BeamSearchOutput]:
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(**params))
    assert_all_blocks_free(llm)
    return outputs


def hypotheses(output: BeamSearchOutput, prompt: list[int]) -> list[tuple[list[int], float]]:
    assert all(s.tokens[:len(prompt)] == prompt for s in output.sequences)
    return [(s.tokens[len(prompt):], s.score) for s in output.sequences]


def assert_equal_to_hf(ours: list[tuple[list[int], float]], theirs: list[tuple[list[int], float]],
                       case: object = None) -> None:
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs], case
    assert [score for _, score in ours] == pytest.approx([score for _, score in theirs], rel=1e-4, abs=1e-5), case


def test_width_one_equals_greedy(engine):
    _, llm = engine
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    outputs = search(llm, PROMPTS, beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.sequences[0].tokens for o in outputs] == [p + g.outputs[0].token_ids for p, g in zip(PROMPTS, greedy)]
    eos = greedy[0].outputs[0].token_ids[3]  # greedy reaches it at the 4th token (or earlier)
    stopped = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[eos]), use_tqdm=False)
    outputs = search(llm, PROMPTS, beam_width=1, max_tokens=MAX_TOKENS, eos_token_id=eos)
    assert outputs[0].sequences[0].finish_reason == "stop"
    for prompt, output, greedy_output in zip(PROMPTS, outputs, stopped):
        assert output.sequences[0].tokens == prompt + greedy_output.outputs[0].token_ids


def test_free_running_equals_hf(engine):
    """Without EOS, all prompts in one batch: all four hypotheses and their scores equal transformers'."""
    model_dir, llm = engine
    outputs = search(llm, PROMPTS, beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, output in zip(PROMPTS, outputs):
        assert_equal_to_hf(hypotheses(output, prompt), hf_beam_search(model_dir, prompt, MAX_TOKENS, WIDTH, None))


@pytest.mark.parametrize("length_penalty, early_stopping", CASES)
def test_equals_hf_with_eos(eos_engine, length_penalty, early_stopping):
    """The tokenizer's EOS ends many beams early, so finished hypotheses compete and every stop rule acts."""
    model_dir, llm = eos_engine
    eos = llm.tokenizer.eos_token_id
    outputs = search(llm, PROMPTS, beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                     early_stopping=early_stopping)
    for prompt, output in zip(PROMPTS, outputs):
        theirs = hf_beam_search(model_dir, prompt, MAX_TOKENS, WIDTH, eos, length_penalty=length_penalty,
                                early_stopping=early_stopping)
        assert_equal_to_hf(hypotheses(output, prompt), theirs, len(prompt))
    assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)


def test_sequences_best_first_with_consistent_scores(engine):
    _, llm = engine
    for params in ({"length_penalty": 1.0}, {"length_penalty": 0.0}):
        [output] = search(llm, [PROMPTS[1]], beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
        scores = [s.score for s in output.sequences]
        assert len(scores) == WIDTH and scores == sorted(scores, reverse=True)
        for s in output.sequences:
            generated = len(s.tokens) - len(PROMPTS[1])
            assert s.score == pytest.approx(s.cum_logprob / generated ** params["length_penalty"])
            assert s.text == llm.tokenizer.decode(s.tokens[len(PROMPTS[1]):], skip_special_tokens=True)


@pytest.mark.parametrize("params, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
    ({"beam_width": "4", "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": True}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": "1"}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": "always"}, "early_stopping"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": 1}, "early_stopping"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": "yes"}, "ignore_eos"),
    ({"beam_width": 2, "max_tokens": 4, "eos_token_id": -1}, "eos_token_id"),
])
def test_bad_params(params, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field} "):
        BeamSearchParams(**params)


def test_requests_the_engine_refuses(engine):
    _, llm = engine
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="must be BeamSearchParams"):
        llm.beam_search("hello", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search({"prompt_token_ids": [1] * (llm.info.max_model_len - 3)}, params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=4, eos_token_id=llm.info.vocab_size))
    assert_all_blocks_free(llm)
