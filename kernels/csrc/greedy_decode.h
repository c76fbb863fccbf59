// Decode steps of a whole llama-style model in one call: embedding, layers, final norm, LM head and the argmax (or a
// sampled token) for every step of a multi-step call after its first, what the Python loop computes step by step
// (the same kernels in the same order, so the same tokens) without its per-step Python and tensor dispatch.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "decoder_layer.h"
#include "penalties.h"
#include "prompt_lookup.h"
#include "sample.h"

namespace pagedserve {

template <typename T>
struct GreedyModel {
  std::vector<DecoderLayer<T>> layers;
  std::vector<T*> k_caches, v_caches;
  Norm<T> final_norm;
  const T* embedding;  // [vocab rows, hidden]
  const T* head;  // [head_rows, hidden]: logits for the first `vocab` rows are compared
  int64_t head_rows, vocab;
  const uint16_t* head_pairs = nullptr;  // the head's gemv_pairs.h copy, or null
  float embed_scale = 0.f;  // > 0: each embedding row times this (rounded to T first: Gemma's sqrt(hidden))
  float logit_cap = 0.f;  // > 0: logits become cap * tanh(logit / cap), in float32 (Gemma 2)
  const T* position_table = nullptr;  // learned positions (OPT): row position + position_offset is added; or null
  int64_t position_offset = 0;
};

// Row `token` of the model's embedding into x for a token at `position`: scaled, or its position's row added, as
// the model does.
template <typename T>
void embed(const GreedyModel<T>& model, int64_t token, int64_t position, int64_t H, T* x) {
  const T* row = model.embedding + token * H;
  if (model.position_table) {
    const T* learned = model.position_table + (position + model.position_offset) * H;
    for (int64_t d = 0; d < H; ++d) store(widen(row[d]) + widen(learned[d]), x + d);
  } else if (model.embed_scale > 0.f) {
    for (int64_t d = 0; d < H; ++d) store(widen(row[d]) * model.embed_scale, x + d);
  } else {
    std::memcpy(x, row, H * sizeof(T));
  }
}

// One row of logits as the sampler and the argmax read them: widened to float32 into scores, soft-capped where the
// model caps them.
template <typename T>
void score_row(const GreedyModel<T>& model, const T* logits, float* scores) {
  for (int64_t v = 0; v < model.vocab; ++v) scores[v] = widen(logits[v]);
  if (model.logit_cap > 0.f)
    for (int64_t v = 0; v < model.vocab; ++v) scores[v] = model.logit_cap * std::tanh(scores[v] / model.logit_cap);
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

// Drafts from a smaller model with the same vocabulary instead of prompt lookup (null model: lookup). known[m]: how
// many positions of row m its K/V caches were fed, updated in place; those below the row's last token's position
// hold its tokens (drafts fed past its last accepted one are fed again from its last token on). With next [M, k]:
// after the last step, the k drafts of each row that goes on and has k slots from its last token on (capacity[m]:
// the positions its blocks and the model length give), the others' -1: what the next call's first step verifies.
template <typename T>
struct DraftModel {
  const GreedyModel<T>* model = nullptr;
  int64_t* known = nullptr;
  const int64_t* capacity = nullptr;
  int64_t* next = nullptr;
};

// A draft round of at most this many token rows runs on one thread: a draft model's products are too small to pay
// for waking the others (the demo's draft at batch 1, 2-core EPYC: 0.5x -> 0.66x of plain decoding's speed).
constexpr int64_t kDraftOneThreadRows = 8;

// want[a] drafts for each row a of seqs, into drafts[a * k ..]: the draft model first takes the tokens its K/V lacks
// (history[m] from known[m] on, the last one's included: its logits give the first draft), then its own argmax, one
// token at a time, every row of a round in one pass. known[m] then counts every position fed (the last draft is not).
template <typename T>
void model_drafts(const DraftModel<T>& draft, const std::vector<std::vector<int64_t>>& history,
                  const std::vector<int64_t>& seqs, const std::vector<int64_t>& want, int64_t k,
                  const int64_t* tables, int64_t max_blocks, int64_t block_size, int64_t* drafts) {
  const GreedyModel<T>& d = *draft.model;
  const int64_t H = d.layers.front().hidden, A = int64_t(seqs.size());
  std::vector<int64_t> pos, slots, lens, table, owners;
  std::vector<T> x, hidden, residual, last, logits;
  std::vector<float> scores(d.logit_cap > 0.f ? d.vocab : 0);
  for (int64_t a = 0; a < A; ++a)  // at least the last token is fed: its logits give the first draft
    draft.known[seqs[a]] = std::min(draft.known[seqs[a]], int64_t(history[seqs[a]].size()) - 1);
  for (int64_t j = 0;; ++j) {
    pos.clear(), slots.clear(), lens.clear(), table.clear(), owners.clear(), x.clear(), last.clear();
    for (int64_t a = 0; a < A; ++a) {
      if (want[a] <= j) continue;
      const int64_t m = seqs[a], L = int64_t(history[m].size());
      const int64_t* row_table = tables + m * max_blocks;
      for (int64_t p = j ? L - 1 + j : draft.known[m]; p <= L - 1 + j; ++p) {
        const int64_t token = p < L ? history[m][p] : drafts[a * k + p - L];
        x.resize(x.size() + H);
        embed(d, token, p, H, x.data() + x.size() - H);
        table.insert(table.end(), row_table, row_table + max_blocks);
        pos.push_back(p), lens.push_back(p + 1);
        slots.push_back(row_table[p / block_size] * block_size + p % block_size);
      }
      owners.push_back(a);
    }
    const int64_t R = int64_t(pos.size()), n = int64_t(owners.size());
    if (n == 0) break;
    hidden.resize(R * H), residual.resize(R * H), last.resize(n * H), logits.resize(n * d.head_rows);
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    if (R <= kDraftOneThreadRows) omp_set_num_threads(1);
#endif
    stage_layers(d.layers, d.k_caches, d.v_caches, d.final_norm, x.data(), static_cast<const T*>(nullptr),
                 hidden.data(), residual.data(), pos.data(), slots.data(), block_size, table.data(), max_blocks,
                 lens.data(), R);
    for (int64_t i = 0, r = 0; i < n; ++i) {  // each row's last fed token: the row ends where the next one starts
      const int64_t a = owners[i], m = seqs[a];
      r += j ? 1 : int64_t(history[m].size()) - draft.known[m];
      std::copy(hidden.data() + (r - 1) * H, hidden.data() + r * H, last.data() + i * H);
    }
    products(last.data(), d.head, d.head_pairs, static_cast<const T*>(nullptr), logits.data(), n, d.head_rows, H);
    for (int64_t i = 0; i < n; ++i) drafts[owners[i] * k + j] = best_token(d, logits.data() + i * d.head_rows, scores);
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
  }
  for (int64_t a = 0; a < A; ++a)
    if (want[a] > 0) draft.known[seqs[a]] = int64_t(history[seqs[a]].size()) + want[a] - 1;
}

// Sampled rows instead of the argmax (null temperature: none): a row with temperature[m] > 0 draws its token by
// sample.h's rule with its top_k, top_p and min_p at uniform[m * steps + i] for its i-th token of the call.
struct RowSampling {
  const float* temperature = nullptr;
  const int64_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* min_p = nullptr;
  const double* uniform = nullptr;
};

// Rows with penalties or a logit bias (penalties.h) take the argmax or draw from their processed scores.
// M rows: tokens[m], the row's last token, at positions[m]; tables [M, max_blocks]; the row takes up to limits[m]
// tokens and none after a step that gave it a token of its stop set stop_ids[stop_starts[m], stop_starts[m + 1]).
// With prompt lookup (or a draft model) a step feeds each row its last token and its drafts (what its limit leaves
// room for, and at most max_rows token rows in all) and keeps the drafts up to the first the argmax disagrees with, then the argmax
// there: the tokens plain steps give (no drafts with sampled rows). out [M, out_cols]: the row's tokens in order,
// -1 after its last; -2 where a sampled row had no token to draw (a NaN, or no finite logit), which ends it. A
// step's rows are those still going, in row order.
template <typename T>
void greedy_decode(const GreedyModel<T>& model, const int64_t* tokens, const int64_t* positions,
                   const int64_t* tables, int64_t max_blocks, int64_t block_size, const int64_t* limits,
                   const int64_t* stop_ids, const int64_t* stop_starts, const PromptLookup& lookup,
                   const DraftModel<T>& draft, const RowSampling& sampling, const RowPenalties& penalties,
                   int64_t max_rows, int64_t* out, int64_t out_cols, int64_t M, int64_t steps) {
  const int64_t H = model.layers.front().hidden, k = lookup.k;
  std::fill(out, out + M * out_cols, int64_t(-1));
  if (lookup.verified) std::fill(lookup.verified, lookup.verified + M * steps * 2, int64_t(-1));
  std::vector<std::vector<int64_t>> history(k > 0 ? M : 0);
  for (int64_t m = 0; m < int64_t(history.size()); ++m)
    history[m].assign(lookup.history + lookup.history_starts[m], lookup.history + lookup.history_starts[m + 1]);
  std::vector<int64_t> last(tokens, tokens + M), taken(M, 0), seqs, feeds, drafts, pos, slots, table, lens;
  std::vector<char> stopped(M, 0);
  std::vector<T> x, hidden, residual, logits;
  std::vector<PenaltyCounts> counts = penalty_counts(penalties, M, model.vocab);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
#else
  const int threads = 1;
#endif
  // Each thread's scores (a row's logits as the sampler reads them) and sampling scratch.
  std::vector<std::vector<float>> scores(threads, std::vector<float>(model.vocab));
  std::vector<SampleScratch> scratch(threads, SampleScratch(sampling.temperature ? model.vocab : 0));
  std::vector<int64_t> chosen(M);
  // Row m's next token from a row of its logits: drawn (sampled rows), else the argmax, of its scores processed
  // where it has penalties or a bias; -2 where a sampled row has none to draw.
  auto choose = [&](int64_t m, const T* row, std::vector<float>& row_scores, SampleScratch& row_scratch) {
    const bool sampled = sampling.temperature && sampling.temperature[m] > 0.f;
    if (!sampled && !processes(penalties, m)) return best_token(model, row, row_scores);
    score_row(model, row, row_scores.data());
    if (processes(penalties, m)) penalize(penalties, m, counts[m], row_scores.data(), model.vocab);
    if (!sampled) return argmax_row(row_scores.data(), model.vocab);
    const int64_t token = sample_row(row_scores.data(), model.vocab, sampling.temperature[m], sampling.top_k[m],
                                     sampling.top_p[m], sampling.min_p[m], sampling.uniform[m * steps + taken[m]],
                                     row_scratch);
    return token < 0 ? int64_t(-2) : token;
  };
  for (int64_t s = 0; s < steps; ++s) {
    seqs.clear();
    for (int64_t m = 0; m < M; ++m)
      if (!stopped[m] && taken[m] < limits[m]) seqs.push_back(m);
    const int64_t A = int64_t(seqs.size());
    if (A == 0) break;
    feeds.assign(A, 0), drafts.resize(A * std::max<int64_t>(k, 1));
    int64_t R = A;
    for (int64_t a = 0; a < A && k > 0; ++a) {
      const int64_t m = seqs[a], room = std::min(limits[m] - taken[m] - 1, max_rows - R);
      if (room > 0)
        R += feeds[a] = draft.model ? std::min(k, room)
                                    : lookup_drafts(history[m], std::min(k, room), lookup.min_n, lookup.max_n,
                                                    drafts.data() + a * k);
    }
    if (draft.model) model_drafts(draft, history, seqs, feeds, k, tables, max_blocks, block_size, drafts.data());
    pos.resize(R), slots.resize(R), lens.resize(R), table.resize(R * max_blocks);
    x.resize(R * H), hidden.resize(R * H), residual.resize(R * H), logits.resize(R * model.head_rows);
    for (int64_t a = 0, r = 0; a < A; ++a) {
      const int64_t m = seqs[a];
      const int64_t* row_table = tables + m * max_blocks;
      for (int64_t j = 0; j <= feeds[a]; ++j, ++r) {
        const int64_t p = positions[m] + taken[m] + j, token = j ? drafts[a * k + j - 1] : last[m];
        embed(model, token, p, H, x.data() + r * H);
        std::copy(row_table, row_table + max_blocks, table.data() + r * max_blocks);
        pos[r] = p, lens[r] = p + 1, slots[r] = row_table[p / block_size] * block_size + p % block_size;
      }
    }
    stage_layers(model.layers, model.k_caches, model.v_caches, model.final_norm, x.data(),
                 static_cast<const T*>(nullptr), hidden.data(), residual.data(), pos.data(), slots.data(), block_size,
                 table.data(), max_blocks, lens.data(), R);
    products(hidden.data(), model.head, model.head_pairs, static_cast<const T*>(nullptr), logits.data(), R,
             model.head_rows, H);
    // Without drafts each row has one row of logits: every row's token is chosen over the threads (processing and
    // sampling a vocabulary is serial work per row), then taken in order below.
    if (k == 0) {
#pragma omp parallel if (A > 1)
      {
#ifdef _OPENMP
        const int thread = omp_get_thread_num();
#else
        const int thread = 0;
#endif
#pragma omp for schedule(dynamic)
        for (int64_t a = 0; a < A; ++a)
          chosen[a] = choose(seqs[a], logits.data() + a * model.head_rows, scores[thread], scratch[thread]);
      }
    }
    for (int64_t a = 0, r = 0; a < A; r += feeds[a] + 1, ++a) {
      const int64_t m = seqs[a];
      const int64_t* stops_begin = stop_ids + stop_starts[m];
      const int64_t* stops_end = stop_ids + stop_starts[m + 1];
      int64_t accepted = 0;
      for (;; ++accepted) {
        const int64_t token = k == 0 ? chosen[a] : choose(m, logits.data() + (r + accepted) * model.head_rows,
                                                          scores[0], scratch[0]);
        if (token < 0) {
          out[m * out_cols + taken[m]] = -2;
          stopped[m] = 1;
          break;
        }
        out[m * out_cols + taken[m]] = token;
        last[m] = token, ++taken[m];
        count_token(counts, m, token);
        if (k > 0) history[m].push_back(token);
        stopped[m] = stopped[m] || std::find(stops_begin, stops_end, token) != stops_end;
        if (accepted == feeds[a] || token != drafts[a * k + accepted]) break;
      }
      if (feeds[a] > 0 && lookup.verified) {
        lookup.verified[(m * steps + s) * 2] = feeds[a];
        lookup.verified[(m * steps + s) * 2 + 1] = accepted;
      }
    }
  }
  if (draft.model && draft.next) {
    std::fill(draft.next, draft.next + M * k, int64_t(-1));
    seqs.clear(), feeds.clear();
    for (int64_t m = 0; m < M; ++m)
      if (!stopped[m] && taken[m] < limits[m] && draft.capacity[m] - (positions[m] + taken[m]) >= k)
        seqs.push_back(m), feeds.push_back(k);
    drafts.resize(seqs.size() * k);
    model_drafts(draft, history, seqs, feeds, k, tables, max_blocks, block_size, drafts.data());
    for (size_t a = 0; a < seqs.size(); ++a)
      std::copy(drafts.data() + a * k, drafts.data() + (a + 1) * k, draft.next + seqs[a] * k);
  }
}

}  // namespace pagedserve
