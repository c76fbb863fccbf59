"""The model runner's KV cache and decode graphs: the cache bound to every attention layer (and the proposer's own),
the CUDA graphs captured over it, and the batch size a decode step replays at."""
from __future__ import annotations

from kernels import kv_quant
from workers.cuda_graphs import DecodeGraphs, capture_sizes, padded_batch_size
from workers.gemv_tuning import choose_gemvs
from workers.layers.fused_moe import FusedMoE


class RunnerCaches:
    """Mixed into workers.model_runner.ModelRunner, whose model, attention layers, config and proposer it reads."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode graphs, which write into it. Before a graph of one row
        is captured, its products are chosen (timed on the GPU while it is otherwise idle); only then, as the
        Triton GEMV's launches cost more host time than cuBLAS's: the graph's replay makes its layers' launches
        free, and the LM head's, outside it, is one launch a step."""
        self.bind_kv_cache(num_blocks)
        sizes = capture_sizes(self.config)
        if sizes and self._captures_cuda_graphs():
            if sizes[0] == 1:
                self.gemv_choices = choose_gemvs(self.model, self.dtype)
            self.decode_graphs = DecodeGraphs(self.model, sizes, self.config.max_model_len, self.block_size,
                                              self.attention_layers[0].num_kv_heads, self.device)
            self.decode_graphs.capture()

    def _captures_cuda_graphs(self) -> bool:
        """On CUDA unless enforce_eager; single rank only, as the TP/PP collectives (and the token exchange of
        experts spread over data-parallel engines) are not known to be capture-safe. Mixtures of experts and LoRA
        adapters are: their kernels sort rows on the device over grids sized from the shapes (kernels.row_blocks)."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.parallel.tp_size * self.parallel.pp_size == 1
                and not any(isinstance(m, FusedMoE) and m.spans_ranks for m in self.model.modules()))

    def bind_kv_cache(self, num_blocks: int) -> None:
        """One cache tensor per attention layer (Attention.bind_kv_cache), of kv_cache_dtype's storage."""
        dtype = kv_quant.cache_dtype(self.config.kv_cache_dtype, self.dtype)
        for layer in self.attention_layers:
            self.kv_caches.append(layer.bind_kv_cache(num_blocks, self.block_size, dtype, self.device))
        if self.draft_model is not None:
            self.draft_model.bind_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        if self.draft_model is not None:
            self.draft_model.bind_kv_cache(None)

    def _graph_size(self, num_seqs: int) -> int | None:
        """The captured size a decode-only batch of num_seqs replays at; None: run it eagerly."""
        return None if self.decode_graphs is None else padded_batch_size(num_seqs, self.decode_graphs.sizes)
