"""EncoderRunner: the model runner of encoder-only models (BERT). Each step's requests arrive whole (the scheduler
never splits them), run as one packed batch attending within each sequence, and leave as pooled results; no KV
cache, no sampling."""
from __future__ import annotations

import numpy as np
import torch
from transformers import PretrainedConfig

from ipc import EngineConfig, ModelRunnerOutput, PoolingInfo, SchedulerOutput
from workers.model_loader import load_model
from workers.pooling.pooler import finish_embedding, pool_sequences, to_bytes
from workers.step_sampling import fails_alone


class EncoderRunner:
    draft_model = None  # the Worker's KV accounting asks; an encoder has no cache to share with one
    decodes_ahead = False  # no decode steps
    multi_steps = 1

    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                 pooling: PoolingInfo) -> None:
        self.config, self.device, self.pooling = config, device, pooling
        self.model = load_model(config.model, hf_config, dtype, device, config.quantization, config.quantize_lm_head,
                                config.load_format)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate: attention sees only the step's own tokens."""

    def profile_run(self) -> None:
        """The largest step, for the memory profile: max_num_batched_tokens tokens in sequences of max_model_len."""
        config = self.config
        lengths = [config.max_model_len] * (config.max_num_batched_tokens // config.max_model_len) \
            or [config.max_num_batched_tokens]
        self._forward(lengths, np.zeros(sum(lengths), dtype=np.int64), np.zeros(sum(lengths), dtype=np.int64))

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammars: None = None) -> ModelRunnerOutput:
        """A step of whole prompts (grammars: none; an encoder's calls are one step)."""
        if not so.scheduled_new_reqs:
            return ModelRunnerOutput(sampled_token_ids={})
        requests = so.scheduled_new_reqs
        lengths = [len(r.prompt_token_ids) for r in requests]
        input_ids = np.fromiter((t for r in requests for t in r.prompt_token_ids), dtype=np.int64, count=sum(lengths))
        token_types = np.fromiter((t for r in requests for t in (r.token_type_ids or [0] * len(r.prompt_token_ids))),
                                  dtype=np.int64, count=sum(lengths))
        pooled = self._pool(self._forward(lengths, input_ids, token_types), lengths)
        results, failed = {}, {}
        for request, vector in zip(requests, pooled):
            with fails_alone(request.req_id, failed):
                results[request.req_id] = to_bytes(vector) if request.pooling_params.task == "classify" \
                    else finish_embedding(vector, request.pooling_params, self.pooling)
        return ModelRunnerOutput(sampled_token_ids={}, pooled=results, failed=failed)

    def _forward(self, lengths: list[int], input_ids: np.ndarray, token_types: np.ndarray) -> torch.Tensor:
        positions = np.concatenate([np.arange(n) for n in lengths])
        ids, types, positions = (torch.from_numpy(a).to(self.device) for a in (input_ids, token_types, positions))
        return self.model(ids, positions, types, lengths)

    def _pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        pooled = pool_sequences(hidden, lengths, self.pooling.pooling_type)
        return self.model.classify(pooled) if self.pooling.num_labels else pooled
