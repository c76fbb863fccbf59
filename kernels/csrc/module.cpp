// The pagedserve CPU kernels as one Python extension.
//
// Raw pointers instead of torch::Tensor: binding tensors needs torch/extension.h, which alone takes ~30 s to
// compile; pybind11 alone keeps the first build short. The Python wrappers validate shapes and dtypes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "decode_attention.h"
#include "decoder_layer.h"
#include "gemv.h"
#include "gemv_pairs.h"
#include "greedy_decode.h"
#include "sample.h"
#include "threads.h"

namespace {

template <typename T>
const T* in(uintptr_t p) { return reinterpret_cast<const T*>(p); }
template <typename T>
T* out(uintptr_t p) { return reinterpret_cast<T*>(p); }

template <typename T>
void decode_attention(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t bt, uintptr_t lens, uintptr_t o,
                      int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t bs, int64_t dim,
                      int64_t max_blocks, float scale, float soft_cap, int64_t window) {
  pagedserve::decode_any(in<T>(q), in<T>(k), in<T>(v), in<int64_t>(bt), in<int64_t>(lens), out<T>(o), num_seqs,
                         heads, kv_heads, bs, dim, max_blocks, scale, soft_cap, window);
}

template <typename T>
void gemv(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k) {
  pagedserve::gemv(in<T>(x), in<T>(w), in<T>(bias), out<T>(y), m, n, k);
}

template <typename T>
void gemv_int8(uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y, int64_t m, int64_t n,
               int64_t k) {
  pagedserve::gemv(in<T>(x), in<int8_t>(w), in<T>(bias), out<T>(y), m, n, k, in<float>(scale));
}

template <typename T>
void gemv_int8_grouped(uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y, int64_t m, int64_t n,
                       int64_t k, int64_t group) {
  pagedserve::gemv_grouped(in<T>(x), in<int8_t>(w), in<float>(scale), in<T>(bias), out<T>(y), m, n, k, group);
}

// weights: input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, cos, sin, then the scales of qkv, o,
// gate_up and down (0 for an absent bias, and for a weight of the model dtype; else it is int8), then their
// gemv_pairs.h copies (0: none), then the q and k head norms (0: none);
// dims: hidden, heads, kv_heads, head_dim, intermediate, sliding window (0: none), then the scale group sizes of
// qkv, o, gate_up and down (0: a scale per row, or no scale).
template <typename T>
pagedserve::DecoderLayer<T> layer_of(const std::vector<uintptr_t>& w, const std::vector<int64_t>& dims, float eps,
                                     float scale) {
  if (w.size() != 20 || dims.size() != 10) throw std::invalid_argument("a layer takes 20 pointers and 10 dims");
  auto projection = [&](int weight, int scale) {
    return pagedserve::Projection{reinterpret_cast<const void*>(w[weight]), in<float>(w[scale]), dims[scale - 4],
                                  in<uint16_t>(w[scale + 4])};
  };
  return {in<T>(w[0]), in<T>(w[2]), in<T>(w[4]), in<T>(w[5]), projection(1, 10), projection(3, 11), projection(6, 12),
          projection(7, 13), in<float>(w[8]), in<float>(w[9]), eps, scale, dims[0], dims[1], dims[2], dims[3],
          dims[4], dims[5], in<T>(w[18]), in<T>(w[19])};
}

template <typename T>
std::vector<pagedserve::DecoderLayer<T>> layers_of(const std::vector<std::vector<uintptr_t>>& weights,
                                                   const std::vector<std::vector<int64_t>>& dims,
                                                   const std::vector<double>& eps, const std::vector<double>& scales) {
  std::vector<pagedserve::DecoderLayer<T>> layers;
  for (size_t i = 0; i < weights.size(); ++i)
    layers.push_back(layer_of<T>(weights[i], dims[i], float(eps[i]), float(scales[i])));
  return layers;
}

template <typename T>
std::vector<T*> caches_of(const std::vector<uintptr_t>& pointers) {
  std::vector<T*> caches;
  for (uintptr_t p : pointers) caches.push_back(out<T>(p));
  return caches;
}

// pagedserve::stage_layers(): one entry per layer in weights, dims, eps, scales and the caches.
template <typename T>
void decoder_layers(const std::vector<std::vector<uintptr_t>>& weights, const std::vector<std::vector<int64_t>>& dims,
                    const std::vector<double>& eps, const std::vector<double>& scales,
                    const std::vector<uintptr_t>& k_caches, const std::vector<uintptr_t>& v_caches,
                    uintptr_t final_norm, double final_eps, uintptr_t x, uintptr_t residual, uintptr_t o,
                    uintptr_t residual_out, uintptr_t positions, uintptr_t slots, int64_t block_size,
                    uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens, int64_t m) {
  pagedserve::stage_layers(layers_of<T>(weights, dims, eps, scales), caches_of<T>(k_caches), caches_of<T>(v_caches),
                           in<T>(final_norm), float(final_eps), in<T>(x), in<T>(residual), out<T>(o),
                           out<T>(residual_out), in<int64_t>(positions), in<int64_t>(slots), block_size,
                           in<int64_t>(tables), max_blocks, in<int64_t>(seq_lens), m);
}

// A draft model for greedy_decode(): its layers as decoder_layers() takes them (weights, dims, eps, scales, key and
// value caches), then its final norm, final eps, embedding, LM head, head rows, vocabulary size and the head's
// gemv_pairs.h copy (0: none), and where its drafts after the last step go with the rows' capacities
// (pagedserve::DraftModel; 0: none).
using DraftArgs =
    std::tuple<std::vector<std::vector<uintptr_t>>, std::vector<std::vector<int64_t>>, std::vector<double>,
               std::vector<double>, std::vector<uintptr_t>, std::vector<uintptr_t>, uintptr_t, double, uintptr_t,
               uintptr_t, int64_t, int64_t, uintptr_t, uintptr_t, uintptr_t>;

// Greedy steps of the whole model (greedy_decode.h): the layers as decoder_layers() takes them, then the final norm,
// the embedding table and the LM head [head_rows, hidden] of the model dtype (and its pairs copy, or 0); drafts from
// `draft` if given (its K/V known per row at draft_known, int64 [m], updated), else by prompt lookup.
template <typename T>
void greedy_decode(const std::vector<std::vector<uintptr_t>>& weights, const std::vector<std::vector<int64_t>>& dims,
                   const std::vector<double>& eps, const std::vector<double>& scales,
                   const std::vector<uintptr_t>& k_caches, const std::vector<uintptr_t>& v_caches,
                   uintptr_t final_norm, double final_eps, uintptr_t embedding, uintptr_t head, int64_t head_rows,
                   int64_t vocab, uintptr_t head_pairs, uintptr_t tokens, uintptr_t positions, uintptr_t tables,
                   int64_t max_blocks, int64_t block_size, uintptr_t limits, uintptr_t stop_ids, uintptr_t stop_starts,
                   const std::vector<int64_t>& lookup, uintptr_t history, uintptr_t history_starts,
                   uintptr_t verified, const std::vector<uintptr_t>& sampled, const std::optional<DraftArgs>& draft,
                   uintptr_t draft_known, int64_t max_rows, uintptr_t tokens_out, int64_t out_cols, int64_t m,
                   int64_t steps) {
  const pagedserve::GreedyModel<T> model{layers_of<T>(weights, dims, eps, scales), caches_of<T>(k_caches),
                                         caches_of<T>(v_caches), in<T>(final_norm), float(final_eps),
                                         in<T>(embedding), in<T>(head), head_rows, vocab,
                                         in<uint16_t>(head_pairs)};
  std::optional<pagedserve::GreedyModel<T>> draft_model;
  pagedserve::DraftModel<T> drafter{nullptr, out<int64_t>(draft_known)};
  if (draft) {
    const auto& [d_weights, d_dims, d_eps, d_scales, d_k, d_v, d_norm, d_norm_eps, d_embedding, d_head, d_head_rows,
                 d_vocab, d_head_pairs, d_capacity, d_next] = *draft;
    draft_model = pagedserve::GreedyModel<T>{layers_of<T>(d_weights, d_dims, d_eps, d_scales), caches_of<T>(d_k),
                                             caches_of<T>(d_v), in<T>(d_norm), float(d_norm_eps), in<T>(d_embedding),
                                             in<T>(d_head), d_head_rows, d_vocab, in<uint16_t>(d_head_pairs)};
    drafter = {&*draft_model, out<int64_t>(draft_known), in<int64_t>(d_capacity), out<int64_t>(d_next)};
  }
  const pagedserve::PromptLookup drafts{lookup.at(0), lookup.at(1), lookup.at(2), in<int64_t>(history),
                                        in<int64_t>(history_starts), out<int64_t>(verified)};
  // sampled: temperature, top_k, top_p, min_p, uniform (empty: every row argmax)
  const pagedserve::RowSampling sampling = sampled.empty() ? pagedserve::RowSampling{} : pagedserve::RowSampling{
      in<float>(sampled.at(0)), in<int64_t>(sampled.at(1)), in<float>(sampled.at(2)), in<float>(sampled.at(3)),
      in<double>(sampled.at(4))};
  pagedserve::greedy_decode(model, in<int64_t>(tokens), in<int64_t>(positions), in<int64_t>(tables), max_blocks,
                            block_size, in<int64_t>(limits), in<int64_t>(stop_ids), in<int64_t>(stop_starts), drafts,
                            drafter, sampling, max_rows, out<int64_t>(tokens_out), out_cols, m, steps);
}

template <typename T>
void attend(const std::vector<uintptr_t>& weights, const std::vector<int64_t>& dims, float eps, float scale,
            uintptr_t qkv, uintptr_t positions, uintptr_t slots, uintptr_t k_cache, uintptr_t v_cache,
            int64_t block_size, uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens, uintptr_t attn, int64_t m) {
  pagedserve::attend(layer_of<T>(weights, dims, eps, scale), out<T>(qkv), in<int64_t>(positions), in<int64_t>(slots),
                     out<T>(k_cache), out<T>(v_cache), block_size, in<int64_t>(tables), max_blocks,
                     in<int64_t>(seq_lens), out<T>(attn), m);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_threads", &pagedserve::bind_threads, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_attention", [](bool bf16, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t bt, uintptr_t lens,
                               uintptr_t o, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t bs,
                               int64_t dim, int64_t max_blocks, double scale, double soft_cap, int64_t window) {
    (bf16 ? decode_attention<uint16_t> : decode_attention<float>)(q, k, v, bt, lens, o, num_seqs, heads, kv_heads,
                                                                  bs, dim, max_blocks, float(scale), float(soft_cap),
                                                                  window);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemv", [](bool bf16, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n,
                   int64_t k) {
    (bf16 ? gemv<uint16_t> : gemv<float>)(x, w, bias, y, m, n, k);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  // bf16 only, where the CPU has AVX-512 BF16 (the Python side checks): pairs is the weight's pair_weight layout.
  m.def("gemv_pairs", [](uintptr_t x, uintptr_t pairs, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    pagedserve::gemv_pairs_bf16(in<uint16_t>(x), in<uint16_t>(pairs), in<uint16_t>(bias), out<uint16_t>(y), m, n, k);
#else
    throw std::runtime_error("gemv_pairs needs AVX-512 BF16");
#endif
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemv_int8", [](bool bf16, uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y,
                        int64_t m, int64_t n, int64_t k) {
    (bf16 ? gemv_int8<uint16_t> : gemv_int8<float>)(x, w, scale, bias, y, m, n, k);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemv_int8_grouped", [](bool bf16, uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y,
                                int64_t m, int64_t n, int64_t k, int64_t group) {
    (bf16 ? gemv_int8_grouped<uint16_t> : gemv_int8_grouped<float>)(x, w, scale, bias, y, m, n, k, group);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  // The pieces of a layer between its products, for steps whose products run elsewhere (torch's GEMMs).
  m.def("add_and_norm", [](bool bf16, uintptr_t x, uintptr_t residual, uintptr_t weight, double eps,
                           uintptr_t residual_out, uintptr_t o, int64_t m, int64_t h) {
    if (bf16)
      pagedserve::add_and_norm_rows(in<uint16_t>(x), in<uint16_t>(residual), in<uint16_t>(weight), float(eps),
                                    out<uint16_t>(residual_out), out<uint16_t>(o), m, h);
    else
      pagedserve::add_and_norm_rows(in<float>(x), in<float>(residual), in<float>(weight), float(eps),
                                    out<float>(residual_out), out<float>(o), m, h);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attend", [](bool bf16, const std::vector<uintptr_t>& weights, const std::vector<int64_t>& dims, double eps,
                     double scale, uintptr_t qkv, uintptr_t positions, uintptr_t slots, uintptr_t k_cache,
                     uintptr_t v_cache, int64_t block_size, uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens,
                     uintptr_t attn, int64_t m) {
    (bf16 ? attend<uint16_t> : attend<float>)(weights, dims, float(eps), float(scale), qkv, positions, slots, k_cache,
                                              v_cache, block_size, tables, max_blocks, seq_lens, attn, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul", [](bool bf16, uintptr_t gate_up, uintptr_t act, int64_t m, int64_t i) {
    if (bf16)
      pagedserve::silu_and_mul_rows(in<uint16_t>(gate_up), out<uint16_t>(act), m, i);
    else
      pagedserve::silu_and_mul_rows(in<float>(gate_up), out<float>(act), m, i);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decoder_layers", [](bool bf16, const std::vector<std::vector<uintptr_t>>& weights,
                             const std::vector<std::vector<int64_t>>& dims, const std::vector<double>& eps,
                             const std::vector<double>& scales, const std::vector<uintptr_t>& k_caches,
                             const std::vector<uintptr_t>& v_caches, uintptr_t final_norm, double final_eps,
                             uintptr_t x, uintptr_t residual, uintptr_t o, uintptr_t residual_out,
                             uintptr_t positions, uintptr_t slots, int64_t block_size, uintptr_t tables,
                             int64_t max_blocks, uintptr_t seq_lens, int64_t m) {
    (bf16 ? decoder_layers<uint16_t> : decoder_layers<float>)(weights, dims, eps, scales, k_caches, v_caches,
                                                              final_norm, final_eps, x, residual, o, residual_out,
                                                              positions, slots, block_size, tables, max_blocks,
                                                              seq_lens, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sample", [](uintptr_t logits, int64_t rows, int64_t vocab, uintptr_t temperature, uintptr_t top_k,
                     uintptr_t top_p, uintptr_t min_p, uintptr_t uniform, uintptr_t tokens) {
    pagedserve::sample_rows(in<float>(logits), rows, vocab, in<float>(temperature), in<int64_t>(top_k),
                            in<float>(top_p), in<float>(min_p), in<double>(uniform), out<int64_t>(tokens));
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("greedy_decode", [](bool bf16, const std::vector<std::vector<uintptr_t>>& weights,
                            const std::vector<std::vector<int64_t>>& dims, const std::vector<double>& eps,
                            const std::vector<double>& scales, const std::vector<uintptr_t>& k_caches,
                            const std::vector<uintptr_t>& v_caches, uintptr_t final_norm, double final_eps,
                            uintptr_t embedding, uintptr_t head, int64_t head_rows, int64_t vocab,
                            uintptr_t head_pairs, uintptr_t tokens, uintptr_t positions, uintptr_t tables,
                            int64_t max_blocks, int64_t block_size, uintptr_t limits, uintptr_t stop_ids,
                            uintptr_t stop_starts,
                            const std::vector<int64_t>& lookup, uintptr_t history, uintptr_t history_starts,
                            uintptr_t verified, const std::vector<uintptr_t>& sampled,
                            const std::optional<DraftArgs>& draft, uintptr_t draft_known, int64_t max_rows,
                            uintptr_t tokens_out, int64_t out_cols, int64_t m, int64_t steps) {
    (bf16 ? greedy_decode<uint16_t> : greedy_decode<float>)(weights, dims, eps, scales, k_caches, v_caches, final_norm,
                                                            final_eps, embedding, head, head_rows, vocab, head_pairs,
                                                            tokens,
                                                            positions, tables, max_blocks, block_size, limits,
                                                            stop_ids, stop_starts, lookup, history, history_starts,
                                                            verified, sampled, draft, draft_known, max_rows,
                                                            tokens_out, out_cols, m, steps);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
}
