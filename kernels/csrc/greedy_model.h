// A whole model as the C++ steps run it (greedy_decode.h): its layers, embedding (scaled, or with learned positions
// added), final norm and LM head, and how a row of its logits becomes a token by the argmax.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "decoder_layer.h"
#include "driver_steps.h"

namespace pagedserve {

// A pipeline stage's place among the ranks for the C++ steps: the group of every rank (rank = stage * tp_size + TP
// rank), this stage and how many there are. The first stage embeds, the last one norms and computes the logits, and
// the driver (the last stage's first rank) shares its tokens.
struct PipelinePlace {
  ShmGroup world;
  int64_t stage = 0, stages = 1, tp_size = 1;

  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
  int64_t driver() const { return (stages - 1) * tp_size; }
};

template <typename T>
struct GreedyModel {
  std::vector<DecoderLayer<T>> layers;
  std::vector<KvCache> caches;  // one per layer
  Norm<T> final_norm;
  const T* embedding;  // [vocab rows, hidden]
  const T* head;  // [head_rows, hidden]: logits for the first `vocab` rows are compared
  int64_t head_rows, vocab;
  const uint16_t* head_pairs = nullptr;  // the head's gemv_pairs.h copy, or null
  float embed_scale = 0.f;  // > 0: each embedding row times this (rounded to T first: Gemma's sqrt(hidden))
  float logit_cap = 0.f;  // > 0: logits become cap * tanh(logit / cap), in float32 (Gemma 2)
  const T* position_table = nullptr;  // learned positions (OPT): row position + position_offset is added; or null
  int64_t position_offset = 0;
  // The embedding's rows: under tensor parallelism (a group) the embedding and head hold rows [vocab_start,
  // vocab_start + table_rows) of the vocabulary, and head_rows = size * table_rows logits are gathered from the ranks.
  int64_t table_rows = 0, vocab_start = 0;
  std::optional<ShmGroup> group;
  std::optional<PipelinePlace> pipeline;  // over pipeline stages: this one (its embedding or head null where absent)

  const ShmGroup* tp() const { return group ? &*group : nullptr; }
  bool has_head() const { return !pipeline || pipeline->last(); }
  // The ranks that follow the driver's drafts and tokens (driver_steps.h): every pipeline rank, or a TP group's
  // ranks with drafts; none where each rank chooses alike.
  StepFollowers followers(bool drafts) const {
    if (pipeline) return {&pipeline->world, pipeline->driver()};
    return drafts && group ? StepFollowers{&*group, 0} : StepFollowers{};
  }
};

// The embeddings of R tokens into x [R, H], each at its position: the table's rows (under tensor parallelism this
// rank's, zeros for the others' tokens, summed over the ranks), then scaled or their positions' rows added, as the
// model does.
template <typename T>
void embed(const GreedyModel<T>& model, const int64_t* tokens, const int64_t* positions, int64_t R, int64_t H, T* x) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = tokens[r] - model.vocab_start;
    if (row >= 0 && row < model.table_rows)
      std::memcpy(x + r * H, model.embedding + row * H, H * sizeof(T));
    else
      std::fill(x + r * H, x + (r + 1) * H, T(0));
  }
  if (model.group) all_reduce(*model.group, x, R * H);
  for (int64_t r = 0; r < R; ++r) {
    T* row = x + r * H;
    if (model.position_table) {
      const T* learned = model.position_table + (positions[r] + model.position_offset) * H;
      for (int64_t d = 0; d < H; ++d) store(widen(row[d]) + widen(learned[d]), row + d);
    } else if (model.embed_scale > 0.f) {
      for (int64_t d = 0; d < H; ++d) store(widen(row[d]) * model.embed_scale, row + d);
    }
  }
}

// One step's forward pass of R token rows (fed, at positions) into hidden [R, H]: `layers(x, residual)` runs this
// stage's layers into hidden (the final norm's output on the last stage) and residual. Over pipeline stages every
// rank takes part in each stage's hand-off, in stage order: stage s's first rank publishes [hidden | residual] and
// stage s + 1 runs its layers from them, in x.
template <typename T, typename Layers>
void forward_rows(const GreedyModel<T>& model, const int64_t* fed, const int64_t* positions, int64_t R, int64_t H,
                  std::vector<T>& x, T* hidden, T* residual, const Layers& layers) {
  x.resize((model.pipeline ? 2 : 1) * R * H);
  if (!model.pipeline || model.pipeline->first()) {
    embed(model, fed, positions, R, H, x.data());
    layers(x.data(), static_cast<const T*>(nullptr));
  }
  if (!model.pipeline) return;
  const PipelinePlace& place = *model.pipeline;
  for (int64_t s = 0; s + 1 < place.stages; ++s) {
    if (place.stage == s) {
      std::copy(hidden, hidden + R * H, x.data());
      std::copy(residual, residual + R * H, x.data() + R * H);
    }
    broadcast(place.world, x.data(), 2 * R * H, s * place.tp_size);
    if (place.stage == s + 1) layers(x.data(), x.data() + R * H);
  }
}

// The LM head's logits [R, head_rows] of hidden [R, H]: under tensor parallelism this rank's rows into `local`,
// gathered from every rank.
template <typename T>
void head_logits(const GreedyModel<T>& model, const T* hidden, int64_t R, int64_t H, T* logits,
                 std::vector<T>& local) {
  if (!model.group) {
    products(hidden, model.head, model.head_pairs, static_cast<const T*>(nullptr), logits, R, model.head_rows, H);
    return;
  }
  local.resize(R * model.table_rows);
  products(hidden, model.head, model.head_pairs, static_cast<const T*>(nullptr), local.data(), R, model.table_rows, H);
  all_gather_columns(*model.group, local.data(), R, model.table_rows, logits);
}

// One row of logits as the sampler and the argmax read them: widened to float32 into scores, soft-capped where the
// model caps them.
template <typename T>
void score_row(const GreedyModel<T>& model, const T* logits, float* scores) {
  for (int64_t v = 0; v < model.vocab; ++v) scores[v] = widen(logits[v]);
  if (model.logit_cap > 0.f) soft_cap_scores(scores, model.vocab, model.logit_cap);
}

// The first index of the largest value, NaN above every number: torch.argmax's choice. Without a NaN, the largest
// value 8 lanes at a time, then the first index holding it: a scalar running max waits on each comparison in turn
// (~3 us per 4,096 logits, a row of every step).
template <typename T>
int64_t argmax_row(const T* v, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  if (n >= 8) {
    __m256 top8 = load8(v), nan8 = _mm256_cmp_ps(top8, top8, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 x = load8(v + i);
      top8 = _mm256_max_ps(top8, x);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = *std::max_element(lanes, lanes + 8);
    bool nan = _mm256_movemask_ps(nan8) != 0;
    for (int64_t j = i; j < n; ++j) nan = nan || std::isnan(widen(v[j])), top = std::max(top, widen(v[j]));
    if (!nan) {
      const __m256 wanted = _mm256_set1_ps(top);
      for (i = 0; i + 8 <= n; i += 8)
        if (const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load8(v + i), wanted, _CMP_EQ_OQ)))
          return i + __builtin_ctz(unsigned(hits));
      for (; widen(v[i]) != top; ++i) {}
      return i;
    }
    i = 0;
  }
#endif
  int64_t best = i;
  float top = widen(v[i]);
  for (++i; i < n && !std::isnan(top); ++i) {
    const float x = widen(v[i]);
    if (x > top || std::isnan(x)) top = x, best = i;
  }
  return best;
}

// The argmax of one row of logits as the model computes them (soft-capped where it caps them; scores: scratch).
template <typename T>
int64_t best_token(const GreedyModel<T>& model, const T* logits, std::vector<float>& scores) {
  if (model.logit_cap <= 0.f) return argmax_row(logits, model.vocab);
  score_row(model, logits, scores.data());
  return argmax_row(scores.data(), model.vocab);
}

}  // namespace pagedserve
