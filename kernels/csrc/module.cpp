// The pagedserve CPU kernels as one Python extension.
//
// Raw pointers instead of torch::Tensor: binding tensors needs torch/extension.h, which alone takes ~30 s to
// compile; pybind11 alone keeps the first build short. The Python wrappers validate shapes and dtypes.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "decode_attention.h"
#include "decoder_layer.h"
#include "gemv.h"
#include "fp8_pairs.h"
#include "gemv_pairs.h"
#include "int8_pairs.h"
#include "greedy_decode_args.h"
#include "model_args.h"
#include "sample.h"
#include "threads.h"

namespace {

using namespace pagedserve::binding;

template <typename T>
void decode_attention(uintptr_t q, const pagedserve::KvCache& cache, uintptr_t bt, uintptr_t lens, uintptr_t o,
                      int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t bs, int64_t dim,
                      int64_t max_blocks, float scale, float soft_cap, int64_t window) {
  pagedserve::decode_any(in<T>(q), cache, in<int64_t>(bt), in<int64_t>(lens), out<T>(o), num_seqs, heads, kv_heads,
                         bs, dim, max_blocks, scale, soft_cap, window);
}

template <typename T>
void gemv(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k) {
  pagedserve::gemv(in<T>(x), in<T>(w), in<T>(bias), out<T>(y), m, n, k);
}

// An int8 or fp8 e4m3 weight with its scales per row (group 0) or per group of columns.
template <typename T>
void gemv_scaled(bool fp8, uintptr_t x, uintptr_t w, uintptr_t scale, int64_t group, uintptr_t bias, uintptr_t y,
                 int64_t m, int64_t n, int64_t k) {
  if (fp8)
    pagedserve::gemv_scaled(in<T>(x), in<pagedserve::Fp8E4m3>(w), in<float>(scale), group, in<T>(bias), out<T>(y), m,
                            n, k);
  else
    pagedserve::gemv_scaled(in<T>(x), in<int8_t>(w), in<float>(scale), group, in<T>(bias), out<T>(y), m, n, k);
}

template <typename T>
void dequantize_scaled(bool fp8, uintptr_t w, uintptr_t scale, int64_t group, uintptr_t o, int64_t n, int64_t k) {
  if (fp8)
    pagedserve::dequantize_scaled(in<pagedserve::Fp8E4m3>(w), in<float>(scale), group, out<T>(o), n, k);
  else
    pagedserve::dequantize_scaled(in<int8_t>(w), in<float>(scale), group, out<T>(o), n, k);
}

// pagedserve::stage_layers() over the stage.
template <typename T>
void decoder_layers(const StageArgs& args, uintptr_t x, uintptr_t residual, uintptr_t o, uintptr_t residual_out,
                    uintptr_t positions, uintptr_t slots, int64_t block_size, uintptr_t tables, int64_t max_blocks,
                    uintptr_t seq_lens, int64_t m, uintptr_t lora_slots, const std::optional<GroupArgs>& group) {
  const Stage<T> stage = stage_of<T>(args);
  const std::optional<pagedserve::ShmGroup> tp = group ? std::optional(group_of(*group)) : std::nullopt;
  pagedserve::stage_layers(stage.layers, stage.caches, stage.final_norm, in<T>(x), in<T>(residual),
                           out<T>(o), out<T>(residual_out), in<int64_t>(positions), in<int64_t>(slots), block_size,
                           in<int64_t>(tables), max_blocks, in<int64_t>(seq_lens), m, in<int64_t>(lora_slots),
                           tp ? &*tp : nullptr);
}

// DeepSeek-V3's MTP layer's input rows (mtp_drafts.h), as its steps in Python compute them.
template <typename T>
void mtp_inputs(const MtpInputsArgs& args, uintptr_t tokens, uintptr_t hidden, int64_t rows, uintptr_t x) {
  std::vector<T> joined;
  pagedserve::mtp_inputs(mtp_inputs_of<T>(args), in<int64_t>(tokens), in<T>(hidden), rows, out<T>(x), joined);
}

// The phases of a layer between its products, for steps whose products run elsewhere (torch's GEMMs): each over
// m rows, as decoder_layer() calls them.
template <typename T>
void before_attention(const LayerArgs& layer, uintptr_t x, uintptr_t residual, uintptr_t residual_out,
                      uintptr_t normed, int64_t m) {
  pagedserve::before_attention(layer_of<T>(layer), in<T>(x), in<T>(residual), out<T>(residual_out), out<T>(normed),
                               m);
}

template <typename T>
void after_attention(const LayerArgs& layer, uintptr_t o, uintptr_t residual_out, uintptr_t normed, int64_t m) {
  pagedserve::after_attention(layer_of<T>(layer), out<T>(o), out<T>(residual_out), out<T>(normed), m);
}

template <typename T>
void activate(const LayerArgs& layer, uintptr_t h, uintptr_t act, int64_t m) {
  pagedserve::activate_rows(layer_of<T>(layer), in<T>(h), out<T>(act), m);
}

template <typename T>
void after_mlp(const LayerArgs& layer, uintptr_t o_mlp, uintptr_t o, int64_t m) {
  pagedserve::after_mlp(layer_of<T>(layer), out<T>(o_mlp), in<T>(o), m);
}

// The final norm of a stage whose layers ran phase by phase: residual_out = x + residual, out = its norm.
template <typename T>
void final_norm(const StageArgs& args, uintptr_t x, uintptr_t residual, uintptr_t residual_out, uintptr_t o,
                int64_t m) {
  const Stage<T> stage = stage_of<T>(args);
  pagedserve::add_and_norm_rows(in<T>(x), in<T>(residual), stage.final_norm, out<T>(residual_out), out<T>(o), m,
                                stage.layers.front().hidden);
}

template <typename T>
void attend(const LayerArgs& layer, uintptr_t qkv, uintptr_t positions, uintptr_t slots,
            const pagedserve::KvCache& cache, int64_t block_size, uintptr_t tables, int64_t max_blocks,
            uintptr_t seq_lens, uintptr_t attn, int64_t m) {
  pagedserve::attend(layer_of<T>(layer), out<T>(qkv), in<int64_t>(positions), in<int64_t>(slots), cache, block_size,
                     in<int64_t>(tables), max_blocks, in<int64_t>(seq_lens), out<T>(attn), m);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_threads", &pagedserve::bind_threads, pybind11::call_guard<pybind11::gil_scoped_release>());
  // cache: k, v, its kind and an fp8 cache's k and v scales (cache_of)
  m.def("decode_attention", [](bool bf16, uintptr_t q, uintptr_t k, uintptr_t v, int64_t kind, double k_scale,
                               double v_scale, uintptr_t bt, uintptr_t lens, uintptr_t o, int64_t num_seqs,
                               int64_t heads, int64_t kv_heads, int64_t bs, int64_t dim, int64_t max_blocks,
                               double scale, double soft_cap, int64_t window) {
    (bf16 ? decode_attention<uint16_t> : decode_attention<float>)(q, cache_of(k, v, kind, k_scale, v_scale), bt,
                                                                  lens, o, num_seqs, heads, kv_heads, bs, dim,
                                                                  max_blocks, float(scale), float(soft_cap), window);
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
  // One expert's product as a mixture's experts take theirs (on AMX where the process may use it), bf16 only.
  m.def("expert_product", [](uintptr_t x, uintptr_t pairs, uintptr_t y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    pagedserve::expert_products({{in<uint16_t>(pairs), in<uint16_t>(x), out<uint16_t>(y), m, n, k}});
#else
    throw std::runtime_error("expert_product needs AVX-512 BF16");
#endif
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("amx_usable", &pagedserve::amx_usable);
  // ... of an int8 weight with a float32 scale per row [n] (pairs: its pair_weight layout, int8), bf16 rows.
  m.def("gemv_pairs_int8", [](uintptr_t x, uintptr_t pairs, uintptr_t scale, uintptr_t bias, uintptr_t y, int64_t m,
                              int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    pagedserve::gemv_pairs_int8(in<uint16_t>(x), in<int8_t>(pairs), in<float>(scale), in<uint16_t>(bias),
                                out<uint16_t>(y), m, n, k);
#else
    throw std::runtime_error("gemv_pairs_int8 needs AVX-512 BF16");
#endif
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  // ... of an fp8 e4m3 weight with its scales per group of `group` columns (pairs: its pair_fp8 layout), bf16 rows.
  m.def("gemv_pairs_fp8", [](uintptr_t x, uintptr_t pairs, int64_t group, uintptr_t bias, uintptr_t y, int64_t m,
                             int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
    pagedserve::gemv_pairs_fp8(in<uint16_t>(x), in<uint8_t>(pairs), group, in<uint16_t>(bias), out<uint16_t>(y), m,
                               n, k);
#else
    throw std::runtime_error("gemv_pairs_fp8 needs AVX-512 BF16 and VBMI");
#endif
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemv_scaled", [](bool bf16, bool fp8, uintptr_t x, uintptr_t w, uintptr_t scale, int64_t group,
                          uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k) {
    (bf16 ? gemv_scaled<uint16_t> : gemv_scaled<float>)(fp8, x, w, scale, group, bias, y, m, n, k);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  // A 4-bit weight (int4.h) with its scales and zero points (0: 8) per row (group 0) or group, and its pairs copy (0:
  // none).
  m.def("gemv_int4", [](bool bf16, uintptr_t x, uintptr_t w, uintptr_t pairs, uintptr_t scale, uintptr_t zero,
                        int64_t group, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k) {
    if (bf16)
      pagedserve::int4_products(in<uint16_t>(x), in<uint8_t>(w), in<uint8_t>(pairs), in<float>(scale), in<float>(zero),
                                group, in<uint16_t>(bias), out<uint16_t>(y), m, n, k);
    else
      pagedserve::int4_products(in<float>(x), in<uint8_t>(w), in<uint8_t>(pairs), in<float>(scale), in<float>(zero),
                                group, in<float>(bias), out<float>(y), m, n, k);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_scaled", [](bool bf16, bool fp8, uintptr_t w, uintptr_t scale, int64_t group, uintptr_t o,
                                int64_t n, int64_t k) {
    (bf16 ? dequantize_scaled<uint16_t> : dequantize_scaled<float>)(fp8, w, scale, group, o, n, k);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  // The phases of a layer between its products (torch's GEMMs run those), and a stage's final norm after them.
  m.def("before_attention", [](bool bf16, const LayerArgs& layer, uintptr_t x, uintptr_t residual,
                               uintptr_t residual_out, uintptr_t normed, int64_t m) {
    (bf16 ? before_attention<uint16_t> : before_attention<float>)(layer, x, residual, residual_out, normed, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attend", [](bool bf16, const LayerArgs& layer, uintptr_t qkv, uintptr_t positions, uintptr_t slots,
                     uintptr_t k_cache, uintptr_t v_cache, int64_t kind, double k_scale, double v_scale,
                     int64_t block_size, uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens, uintptr_t attn,
                     int64_t m) {
    const pagedserve::KvCache cache = cache_of(k_cache, v_cache, kind, k_scale, v_scale);
    (bf16 ? attend<uint16_t> : attend<float>)(layer, qkv, positions, slots, cache, block_size, tables, max_blocks,
                                              seq_lens, attn, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("after_attention", [](bool bf16, const LayerArgs& layer, uintptr_t o, uintptr_t residual_out,
                              uintptr_t normed, int64_t m) {
    (bf16 ? after_attention<uint16_t> : after_attention<float>)(layer, o, residual_out, normed, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("activate", [](bool bf16, const LayerArgs& layer, uintptr_t h, uintptr_t act, int64_t m) {
    (bf16 ? activate<uint16_t> : activate<float>)(layer, h, act, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("after_mlp", [](bool bf16, const LayerArgs& layer, uintptr_t o_mlp, uintptr_t o, int64_t m) {
    (bf16 ? after_mlp<uint16_t> : after_mlp<float>)(layer, o_mlp, o, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("final_norm", [](bool bf16, const StageArgs& stage, uintptr_t x, uintptr_t residual, uintptr_t residual_out,
                         uintptr_t o, int64_t m) {
    (bf16 ? final_norm<uint16_t> : final_norm<float>)(stage, x, residual, residual_out, o, m);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decoder_layers", [](bool bf16, const StageArgs& stage, uintptr_t x, uintptr_t residual, uintptr_t o,
                             uintptr_t residual_out, uintptr_t positions, uintptr_t slots, int64_t block_size,
                             uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens, int64_t m,
                             uintptr_t lora_slots, const std::optional<GroupArgs>& group) {
    (bf16 ? decoder_layers<uint16_t> : decoder_layers<float>)(stage, x, residual, o, residual_out, positions, slots,
                                                              block_size, tables, max_blocks, seq_lens, m,
                                                              lora_slots, group);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sample", [](uintptr_t logits, int64_t rows, int64_t vocab, uintptr_t temperature, uintptr_t top_k,
                     uintptr_t top_p, uintptr_t min_p, uintptr_t uniform, uintptr_t drafts, uintptr_t accept,
                     uintptr_t draft_probs, uintptr_t tokens) {
    pagedserve::sample_rows(in<float>(logits), rows, vocab, in<float>(temperature), in<int64_t>(top_k),
                            in<float>(top_p), in<float>(min_p), in<double>(uniform), in<int64_t>(drafts),
                            in<double>(accept), in<float>(draft_probs), out<int64_t>(tokens));
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("draft", [](uintptr_t logits, int64_t rows, int64_t vocab, uintptr_t temperature, uintptr_t top_k,
                    uintptr_t top_p, uintptr_t min_p, uintptr_t uniform, uintptr_t q, uintptr_t tokens) {
    pagedserve::draft_rows(in<float>(logits), rows, vocab, in<float>(temperature), in<int64_t>(top_k),
                           in<float>(top_p), in<float>(min_p), in<double>(uniform), out<float>(q),
                           out<int64_t>(tokens));
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mtp_inputs", [](bool bf16, const MtpInputsArgs& args, uintptr_t tokens, uintptr_t hidden, int64_t rows,
                         uintptr_t x) {
    (bf16 ? mtp_inputs<uint16_t> : mtp_inputs<float>)(args, tokens, hidden, rows, x);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("log_softmax", [](uintptr_t scores, uintptr_t logprobs, int64_t rows, int64_t vocab) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r)
      pagedserve::log_softmax_row(in<float>(scores) + r * vocab, vocab, out<float>(logprobs) + r * vocab);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("greedy_decode", [](bool bf16, const ModelArgs& model, uintptr_t tokens, uintptr_t positions,
                            uintptr_t tables, int64_t max_blocks, int64_t block_size, uintptr_t limits,
                            uintptr_t stop_ids, uintptr_t stop_starts, const std::vector<int64_t>& lookup,
                            uintptr_t history, uintptr_t history_starts, uintptr_t verified,
                            const std::vector<uintptr_t>& sampled, const std::vector<uintptr_t>& penalized,
                            const std::vector<uintptr_t>& masks, int64_t mask_words,
                            const std::function<void()>& before_step,
                            const std::vector<uintptr_t>& logprobs, int64_t logprob_width, uintptr_t adapters,
                            const std::optional<DraftArgs>& draft, uintptr_t draft_known, int64_t max_rows,
                            uintptr_t tokens_out, int64_t out_cols, int64_t m, int64_t steps) {
    (bf16 ? greedy_decode<uint16_t> : greedy_decode<float>)(model, tokens, positions, tables, max_blocks, block_size,
                                                            limits, stop_ids, stop_starts, lookup, history,
                                                            history_starts, verified, sampled, penalized, masks,
                                                            mask_words, before_step, logprobs, logprob_width,
                                                            adapters, draft, draft_known, max_rows, tokens_out,
                                                            out_cols, m, steps);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
}
