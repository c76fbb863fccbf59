"""The pooling routes' handlers: inputs tokenized off the event loop in one batched call, sent as pooling requests,
their vectors turned into OpenAI's and vLLM's response bodies."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Sequence

import msgspec
from fastapi.responses import Response

from frontend.api.errors import APIError, raise_api_error
from frontend.api.lora_adapters import LoRAAdapters
from frontend.api.pooling_protocol import ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from frontend.async_llm import AsyncLLM
from frontend.pooling_inputs import PoolingInput, as_inputs, input_token_ids, pooling_request, score_pairs
from frontend.pooling_results import cosine, probabilities, vector
from ipc import PoolingParams


class PoolingServing:
    def __init__(self, engine: AsyncLLM, model_name: str, adapters: LoRAAdapters, max_inputs: int) -> None:
        self.engine, self.model_name, self.adapters, self.max_inputs = engine, model_name, adapters, max_inputs

    async def embeddings(self, body: EmbeddingRequest) -> Response:
        self._check_model(body.model)
        inputs = as_inputs(body.input)
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        ids, pooled = await self._run(inputs, params, body.truncate_prompt_tokens)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(p).decode() if body.encoding_format == "base64" else vector(p).tolist()}
                for i, p in enumerate(pooled)]
        return _json({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": self.model_name, "data": data, "usage": _usage(ids)})

    async def score(self, body: ScoreRequest) -> Response:
        self._check_model(body.model)
        ids, scores = await self._scores(body.text_1, body.text_2, body.truncate_prompt_tokens)
        return _json({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": self.model_name, "data": [{"index": i, "object": "score", "score": s}
                                                         for i, s in enumerate(scores)], "usage": _usage(ids)})

    async def rerank(self, body: RerankRequest) -> Response:
        self._check_model(body.model)
        if not body.documents:
            raise APIError(400, "documents is empty", "documents")
        ids, scores = await self._scores(body.query, body.documents, body.truncate_prompt_tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name,
                      "usage": {"total_tokens": sum(map(len, ids))}, "results": results})

    async def classify(self, body: ClassificationRequest) -> Response:
        self._check_model(body.model)
        inputs = as_inputs(body.input)
        ids, pooled = await self._run(inputs, PoolingParams(task="classify"), body.truncate_prompt_tokens)
        labels = self.engine.info.pooling.labels
        data = []
        for i, logits in enumerate(pooled):
            probs = probabilities(logits)
            data.append({"index": i, "label": labels[max(range(len(probs)), key=probs.__getitem__)],
                         "probs": probs, "num_classes": len(probs)})
        return _json({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": self.model_name, "data": data, "usage": _usage(ids)})

    async def _scores(self, text_1: str | list[str], text_2: str | list[str], truncation: int | None
                      ) -> tuple[list[list[int]], list[float]]:
        """Cross-encoder logits (sigmoid) or the cosine of bi-encoder embeddings, pair by pair."""
        try:
            firsts, seconds = score_pairs(text_1, text_2)
        except ValueError as error:
            raise APIError(400, str(error), "text_2") from None
        pooling = self.engine.info.pooling
        if pooling is not None and pooling.num_labels:
            if pooling.num_labels != 1:
                raise APIError(400, f"scoring needs a cross-encoder with one label; this classifier has "
                                    f"{pooling.num_labels}: use /classify", "model")
            ids, pooled = await self._run(firsts, PoolingParams(task="classify"), truncation, seconds)
            return ids, [probabilities(logit)[0] for logit in pooled]
        texts = list(dict.fromkeys([*firsts, *seconds]))
        ids, pooled = await self._run(texts, PoolingParams(), truncation)
        embedding = dict(zip(texts, pooled))
        return ids, [cosine(embedding[a], embedding[b]) for a, b in zip(firsts, seconds)]

    async def _run(self, inputs: Sequence[PoolingInput], params: PoolingParams, truncation: int | None,
                   pairs: Sequence[str] | None = None) -> tuple[list[list[int]], list[bytes]]:
        """Tokenize (a worker thread: a large batch must not hold up the other requests), validate every input,
        then run them; a bad input is a 400 naming it before anything runs."""
        if not inputs:
            raise APIError(400, "input is empty", "input")
        if len(inputs) > self.max_inputs:
            raise APIError(400, f"{len(inputs)} inputs is over this server's limit of {self.max_inputs} per request "
                                "(--max-choices-per-request); split the request", "input")
        engine = self.engine
        try:
            ids, types = await asyncio.to_thread(input_token_ids, engine.tokenizer, engine.info, inputs, truncation,
                                                 pairs)
            request_id = uuid.uuid4().hex
            requests = [pooling_request(engine.info, f"{request_id}-{i}", token_ids, params,
                                        types[i] if types else None) for i, token_ids in enumerate(ids)]
            return ids, await engine.encode(requests)
        except Exception as error:  # a bad input (400), an overloaded or dead engine; anything else is a bug (500)
            raise_api_error(error)

    def _check_model(self, model: str | None) -> None:
        if self.adapters.resolve(model) is not None:
            raise APIError(400, "LoRA adapters serve generation requests only; name the base model", "model")


def _json(body: dict) -> Response:
    """Encoded by msgspec: FastAPI's own encoder walks an embedding's floats one by one in Python."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def _usage(ids: list[list[int]]) -> dict:
    tokens = sum(map(len, ids))
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
