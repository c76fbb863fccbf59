"""logit_bias, bad_words, min_tokens and prompt logprobs: equal to transformers' processors and logits."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts
from frontend import LLM, SamplingParams
from hf_reference import _hf_model, hf_greedy

PROMPT = random_prompts([30], vocab=1000, seed=11)[0]
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32", in_process=True)
    yield llm
    llm.shutdown()


def _tokens(llm, **params) -> list[int]:
    [output] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**{**GREEDY, **params}), use_tqdm=False)
    assert_all_blocks_free(llm)
    return output.outputs[0].token_ids


def test_logit_bias_equals_transformers_sequence_bias(llm, llama_model):
    plain = _tokens(llm)
    bias = {plain[3]: -100.0, 17: 4.0}  # ban one token greedy picks, favour another
    biased = _tokens(llm, logit_bias=bias)
    assert biased == hf_greedy(llama_model, PROMPT, 16, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert biased != plain and plain[3] not in biased


def test_bad_words_equal_transformers_no_bad_words(llm, llama_model):
    plain = _tokens(llm)
    # A one-token word that greedy would emit, and a two-token word: its second token is banned only after its first.
    words = [[plain[2]], [plain[5], plain[6]]]
    params = SamplingParams(**GREEDY, bad_words=["unused"], bad_words_token_ids=words)
    ours = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf_greedy(llama_model, PROMPT, 16, bad_words_ids=words)
    assert ours != plain and plain[2] not in ours


def test_bad_words_are_tokenized_by_the_front_end(llm):
    # two tokens greedy writes that decode to whole characters (a byte fragment's U+FFFD is no word to ban)
    tokens = _tokens(llm)
    word = next(text for i in range(len(tokens) - 1)
                if (text := llm.tokenizer.decode(tokens[i:i + 2])).strip() and "\ufffd" not in text)
    banned = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**GREEDY, bad_words=[word]), use_tqdm=False)
    assert word not in banned[0].outputs[0].text
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_min_tokens_equals_transformers_min_new_tokens(llm, llama_model):
    stop = _tokens(llm)[1]  # a token greedy emits early: with min_tokens it may not end the request yet
    ours = _tokens(llm, ignore_eos=False, stop_token_ids=[stop], min_tokens=6)
    hf = hf_greedy(llama_model, PROMPT, 16, eos_token_id=stop, min_new_tokens=6)
    assert ours == hf[:len(ours)] and len(ours) >= 7 and (ours[-1] == stop or len(ours) == 16)


def test_logit_bias_token_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias token id 99999 is outside the vocabulary"):
        _tokens(llm, logit_bias={99999: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias is invalid: Expected `float` <= 100.0"):
        SamplingParams(logit_bias={1: 101.0})


@pytest.mark.parametrize("chunk", [8, 2048])
def test_prompt_logprobs_equal_hf_log_softmax(llama_model, chunk):
    llm = LLM(llama_model, dtype="float32", in_process=True, max_num_batched_tokens=chunk, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    # Twice: the second run must not skip the prompt through the prefix cache (every position is needed).
    for _ in range(2):
        [output] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        with torch.inference_mode():
            reference = _hf_model(llama_model)(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
        entries = output.prompt_logprobs
        assert len(entries) == len(PROMPT) and entries[0] is None
        for position, entry in enumerate(entries[1:]):
            token, row = PROMPT[position + 1], reference[position]
            torch.testing.assert_close(entry[token].logprob, row[token].item(), atol=1e-4, rtol=0)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(3)
            assert set(entry) == {token, *top.indices.tolist()}
            for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                torch.testing.assert_close(entry[tid].logprob, value, atol=1e-4, rtol=0)
                assert tid == token or entry[tid].rank == rank  # top-k come sorted, ranked 1..k
    assert_all_blocks_free(llm)
    llm.shutdown()
