// How the extension's Python arguments (tuples of pointers, dims and floats) become the kernels' structs: a layer,
// a stage of layers, a whole model and a draft model.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "decoder_layer.h"
#include "greedy_decode.h"

namespace pagedserve::binding {

template <typename T>
const T* in(uintptr_t p) { return reinterpret_cast<const T*>(p); }
template <typename T>
T* out(uintptr_t p) { return reinterpret_cast<T*>(p); }

// A layer: its pointers, dims and floats.
// pointers: input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, cos, sin, then the scales of qkv, o,
// gate_up and down (0 for a model-dtype weight; else int8 or fp8 e4m3), then their gemv_pairs.h copies (0: none),
// then the q and k head norms, input_norm's and post_norm's biases, attn_out_norm, mlp_out_norm, gate_up's and down's
// biases (0: none, and for every absent bias), then the experts' router, gate_up and down and the shared expert's
// gate (0: a dense MLP; pagedserve::Experts), then the adapter slots' a, bt and used of qkv, o, gate_up and down (0:
// none; pagedserve::LoraSlots), then MLA's q_a and kv_a weights, q_a and kv_a norms, W_UK^T and W_UV (0: none;
// pagedserve::Mla), then DeepSeek's float32 router and correction bias (0: none; pagedserve::GroupedRouting), then
// the experts' gate_up and down gemv_pairs.h copies (0: none), then MLA's q_a and kv_a gemv_pairs.h copies and its
// W_UK^T and W_UV ones, each head's in turn (0: none), then the adapter slots' part offsets of qkv, o, gate_up and
// down (int64 [parts + 1]; 0: one part), then the zero points of qkv, o, gate_up and down (4-bit weights; 0: none);
// dims: hidden, heads, kv_heads, head_dim, intermediate, sliding window (0: none), then the scale group sizes of
// qkv, o, gate_up and down (0: a scale per row, or no scale), then rotary_dim, the norm kind, the activation,
// parallel_residual, qkv_per_head and scale_q_first (layer_ops.h, pagedserve::DecoderLayer), then the experts' count,
// top_k, intermediate size and renormalize, then the adapter slots' widths of qkv, o, gate_up and down and whether
// they are bf16, then whether the scaled weights of qkv, o, gate_up and down are fp8 e4m3 (else int8), then
// MLA's kv_lora_rank (0: no MLA), q_lora_rank, nope, rope and v head dims, then the experts'
// groups, the groups that compete and whether scores are sigmoid, then the adapter slots' part counts of qkv, o,
// gate_up and down, then whether the scaled weights of qkv, o, gate_up and down are 4-bit (int4.h);
// floats: the norms' eps, the attention's scale and soft cap, the experts' weights' scaling, MLA's norms' eps.
using LayerArgs = std::tuple<std::vector<uintptr_t>, std::vector<int64_t>, std::vector<double>>;

template <typename T>
pagedserve::DecoderLayer<T> layer_of(const LayerArgs& args) {
  const auto& [w, dims, floats] = args;
  if (w.size() != 64 || dims.size() != 45 || floats.size() != 5)
    throw std::invalid_argument("a layer takes 64 pointers, 45 dims and 5 floats");
  auto projection = [&](int weight, int scale) {
    const int i = scale - 10;  // the projection's index: qkv, o, gate_up, down
    const pagedserve::LoraSlots lora{reinterpret_cast<const void*>(w[30 + 3 * i]),
                                     reinterpret_cast<const void*>(w[31 + 3 * i]), in<uint8_t>(w[32 + 3 * i]),
                                     dims[20 + i], dims[24] != 0, in<int64_t>(w[56 + i]),
                                     std::max<int64_t>(1, dims[37 + i])};
    return pagedserve::Projection{reinterpret_cast<const void*>(w[weight]), in<float>(w[scale]), dims[scale - 4],
                                  in<uint16_t>(w[scale + 4]), lora, dims[25 + i] != 0, in<float>(w[60 + i]),
                                  dims[41 + i] != 0};
  };
  const float eps = float(floats[0]);
  auto norm = [&](int weight, int bias) {
    return pagedserve::Norm<T>{dims[11], in<T>(w[weight]), bias < 0 ? nullptr : in<T>(w[bias]), eps};
  };
  pagedserve::DecoderLayer<T> L;
  L.input_norm = norm(0, 20), L.post_norm = norm(5, 21), L.attn_out_norm = norm(22, -1);
  L.mlp_out_norm = norm(23, -1);
  L.qkv_bias = in<T>(w[2]), L.o_bias = in<T>(w[4]), L.gate_up_bias = in<T>(w[24]), L.down_bias = in<T>(w[25]);
  L.qkv = projection(1, 10), L.o = projection(3, 11), L.gate_up = projection(6, 12), L.down = projection(7, 13);
  L.cos = in<float>(w[8]), L.sin = in<float>(w[9]);
  L.scale = float(floats[1]), L.soft_cap = float(floats[2]);
  L.hidden = dims[0], L.heads = dims[1], L.kv_heads = dims[2], L.head_dim = dims[3], L.intermediate = dims[4];
  L.window = dims[5], L.rotary_dim = dims[10], L.activation = dims[12];
  L.parallel_residual = dims[13], L.qkv_per_head = dims[14], L.scale_q_first = dims[15];
  L.q_norm = in<T>(w[18]), L.k_norm = in<T>(w[19]);
  L.experts = {dims[16], dims[17], dims[18], in<T>(w[26]), in<T>(w[27]), in<T>(w[28]), in<T>(w[29]), dims[19] != 0,
               float(floats[3])};
  L.mla = {in<T>(w[44]), in<T>(w[45]), in<T>(w[46]), in<T>(w[47]), dims[29], dims[30], dims[31], dims[32], dims[33],
           float(floats[4])};
  L.mla.w_uk_pairs = in<uint16_t>(w[54]), L.mla.w_uv_pairs = in<uint16_t>(w[55]);
  L.mla_q_a = {reinterpret_cast<const void*>(w[42]), nullptr, 0, in<uint16_t>(w[52])};
  L.mla_kv_a = {reinterpret_cast<const void*>(w[43]), nullptr, 0, in<uint16_t>(w[53])};
  L.experts.grouped = {in<float>(w[48]), in<float>(w[49]), dims[34], dims[35], dims[36] != 0};
  L.experts.gate_up_pairs = in<uint16_t>(w[50]), L.experts.down_pairs = in<uint16_t>(w[51]);
  return L;
}

// A layer's cache: its key and value caches, their kind (pagedserve::KvCache: 0 the model dtype, 1 fp8 e4m3, 2 fp8
// e5m2) and an fp8 cache's k and v scales.
inline pagedserve::KvCache cache_of(uintptr_t k, uintptr_t v, int64_t kind, double k_scale, double v_scale) {
  if (kind < pagedserve::kCacheModelDtype || kind > pagedserve::kCacheE5m2)
    throw std::invalid_argument("a KV cache kind is 0 (the model dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
  return {reinterpret_cast<void*>(k), reinterpret_cast<void*>(v), kind, float(k_scale), float(v_scale)};
}

// A stage: its layers' pointers, dims and floats (as LayerArgs, one entry each), key and value caches, the caches'
// kind and each layer's k and v scales (2 per layer), then the final norm's weight (0: none), bias (0: none) and
// eps.
using StageArgs = std::tuple<std::vector<std::vector<uintptr_t>>, std::vector<std::vector<int64_t>>,
                             std::vector<std::vector<double>>, std::vector<uintptr_t>, std::vector<uintptr_t>,
                             int64_t, std::vector<double>, uintptr_t, uintptr_t, double>;

template <typename T>
struct Stage {
  std::vector<pagedserve::DecoderLayer<T>> layers;
  std::vector<pagedserve::KvCache> caches;
  pagedserve::Norm<T> final_norm;
};

template <typename T>
Stage<T> stage_of(const StageArgs& args) {
  const auto& [weights, dims, floats, k_caches, v_caches, cache_kind, scales, norm, norm_bias, norm_eps] = args;
  if (k_caches.size() != weights.size() || v_caches.size() != weights.size() || scales.size() != 2 * weights.size())
    throw std::invalid_argument("a stage takes a key and value cache and two scales per layer");
  Stage<T> stage;
  for (size_t i = 0; i < weights.size(); ++i) stage.layers.push_back(layer_of<T>({weights[i], dims[i], floats[i]}));
  for (size_t i = 0; i < weights.size(); ++i)
    stage.caches.push_back(cache_of(k_caches[i], v_caches[i], cache_kind, scales[2 * i], scales[2 * i + 1]));
  const int64_t kind = stage.layers.empty() ? 0 : stage.layers.front().input_norm.kind;
  stage.final_norm = {kind, in<T>(norm), in<T>(norm_bias), float(norm_eps)};
  return stage;
}

// A tensor-parallel group's shared memory (pagedserve::ShmGroup): its slots, a slot's bytes, the round counters,
// this rank's round count, the FIFOs, this rank, the group's size and how long a waiter polls (ns).
using GroupArgs = std::tuple<uintptr_t, int64_t, uintptr_t, uintptr_t, std::vector<int64_t>, int64_t, int64_t, int64_t>;

inline pagedserve::ShmGroup group_of(const GroupArgs& args) {
  const auto& [slots, slot_bytes, counters, round, fifos, rank, size, spin_ns] = args;
  if (size < 2 || rank < 0 || rank >= size || int64_t(fifos.size()) != size || slot_bytes <= 0 || !slots ||
      !counters || !round)
    throw std::invalid_argument("a tensor-parallel group: 2 or more ranks, a FIFO each, its slots and counters");
  return {reinterpret_cast<uint8_t*>(slots), slot_bytes, reinterpret_cast<int64_t*>(counters),
          reinterpret_cast<int64_t*>(round), fifos, rank, size, spin_ns};
}

// A pipeline stage's place (pagedserve::PipelinePlace): the group of every rank, this stage, the stages, the TP size.
using PipelineArgs = std::tuple<GroupArgs, int64_t, int64_t, int64_t>;

// A whole model for greedy_decode(): its stage (with the final norm), then its embedding table and LM head
// [head_rows, hidden] of the model dtype, the vocabulary size, the head's gemv_pairs.h copy (0: none), the
// embedding scale and the logits' soft cap (0: none), the learned position table (0: none) and its row offset, the
// rows of the vocabulary this rank's embedding and head hold and the first one, its TP group, and over pipeline
// stages its place (the embedding 0 off the first stage, the head 0 off the last) (pagedserve::GreedyModel).
using ModelArgs = std::tuple<StageArgs, uintptr_t, uintptr_t, int64_t, int64_t, uintptr_t, double, double, uintptr_t,
                             int64_t, int64_t, int64_t, std::optional<GroupArgs>, std::optional<PipelineArgs>>;

template <typename T>
pagedserve::GreedyModel<T> model_of(const ModelArgs& args) {
  const auto& [stage_args, embedding, head, head_rows, vocab, head_pairs, embed_scale, logit_cap, positions,
               position_offset, table_rows, vocab_start, group, pipeline] = args;
  if (group && head && head_rows != table_rows)
    throw std::invalid_argument("under tensor parallelism the embedding and the head hold the same vocabulary rows");
  std::optional<pagedserve::PipelinePlace> place;
  if (pipeline) {
    const auto& [world, stage, stages, tp_size] = *pipeline;
    place = pagedserve::PipelinePlace{group_of(world), stage, stages, tp_size};
    if (stages < 2 || stage < 0 || stage >= stages || place->world.size != stages * tp_size ||
        !embedding != (stage > 0) || !head != (stage < stages - 1))
      throw std::invalid_argument("pipeline stages: 2 or more over every rank, the embedding on the first and the "
                                  "head on the last");
  } else if (!embedding || !head) {
    throw std::invalid_argument("a model in one stage has its embedding and head");
  }
  Stage<T> stage = stage_of<T>(stage_args);
  const int64_t ranks = group ? std::get<6>(*group) : 1;
  return {std::move(stage.layers), std::move(stage.caches), stage.final_norm,
          in<T>(embedding), in<T>(head), head_rows * ranks, vocab, in<uint16_t>(head_pairs), float(embed_scale),
          float(logit_cap), in<T>(positions), position_offset, table_rows, vocab_start,
          group ? std::optional(group_of(*group)) : std::nullopt, place};
}

// DeepSeek-V3's MTP layer's input (pagedserve::MtpInputs): the embedding, enorm's and hnorm's weights and eps,
// eh_proj, its gemv_pairs.h copy (0: none), the hidden size.
using MtpInputsArgs = std::tuple<uintptr_t, uintptr_t, uintptr_t, double, uintptr_t, uintptr_t, int64_t>;

template <typename T>
pagedserve::MtpInputs<T> mtp_inputs_of(const MtpInputsArgs& args) {
  const auto& [embedding, enorm, hnorm, eps, eh_proj, eh_pairs, hidden] = args;
  return {in<T>(embedding), {pagedserve::kRmsNorm, in<T>(enorm), nullptr, float(eps)},
          {pagedserve::kRmsNorm, in<T>(hnorm), nullptr, float(eps)}, in<T>(eh_proj), in<uint16_t>(eh_pairs), hidden};
}

// The MTP layer as greedy_decode()'s drafter: its input, the rows' seeds, whether each has one, and whether it
// drafts (pagedserve::MtpLayer).
using MtpArgs = std::tuple<MtpInputsArgs, uintptr_t, uintptr_t, bool>;

// A draft model for greedy_decode(): the model, then where its drafts after the last step go with the rows'
// capacities (pagedserve::DraftModel), and the MTP layer's parts where the model is one.
using DraftArgs = std::tuple<ModelArgs, uintptr_t, uintptr_t, uintptr_t, std::optional<MtpArgs>>;

}  // namespace pagedserve::binding
