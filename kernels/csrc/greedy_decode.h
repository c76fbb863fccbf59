// Decode steps of a whole model in one call: embedding, layers, final norm, LM head and the argmax (or a sampled
// token) for every step of a multi-step call after its first, what the Python loop computes step by step (the
// same kernels in the same order, so the same tokens) without its per-step Python and tensor dispatch.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "decoder_layer.h"
#include "draft_steps.h"
#include "driver_steps.h"
#include "grammar_masks.h"
#include "greedy_model.h"
#include "logprobs.h"
#include "penalties.h"
#include "prompt_lookup.h"
#include "sample.h"

namespace pagedserve {

// Rows with a grammar's mask (grammar_masks.h; no drafts for them), penalties or a logit bias (penalties.h) take
// the argmax or draw from their masked and processed scores; rows that report logprobs (logprobs.h) get them for
// each token they take (its slot's column: out's); with adapters (null: none) row m's token rows run with adapter
// slot adapters[m] (-1: the base model).
// M rows: tokens[m], the row's last token, at positions[m]; tables [M, max_blocks]; the row takes up to limits[m]
// tokens and none after a step that gave it a token of its stop set stop_ids[stop_starts[m], stop_starts[m + 1]).
// With prompt lookup (or a draft model) a step feeds each row but a constrained one its last token and its drafts
// (what its limit leaves room for, and at most max_rows token rows in all) and keeps the drafts up to the first the
// argmax disagrees with (a sampled row's: verify_row rejects), then the token chosen there: the tokens plain steps
// give. out [M, out_cols]: the row's tokens in order, -1 after its last; -2 where a sampled row had no token to
// draw (a NaN, or no finite logit), which ends it. A step's rows are those still going, in row order.
template <typename T>
void greedy_decode(const GreedyModel<T>& model, const int64_t* tokens, const int64_t* positions,
                   const int64_t* tables, int64_t max_blocks, int64_t block_size, const int64_t* limits,
                   const int64_t* stop_ids, const int64_t* stop_starts, const PromptLookup& lookup,
                   const DraftModel<T>& draft, const RowSampling& sampling, const RowPenalties& penalties,
                   const RowMasks& grammar, const RowLogprobs& logprobs, const int64_t* adapters, int64_t max_rows,
                   int64_t* out,
                   int64_t out_cols, int64_t M, int64_t steps) {
  const int64_t H = model.layers.front().hidden, k = lookup.k;
  std::fill(out, out + M * out_cols, int64_t(-1));
  if (lookup.verified) std::fill(lookup.verified, lookup.verified + M * steps * 2, int64_t(-1));
  std::vector<std::vector<int64_t>> history(k > 0 ? M : 0);
  for (int64_t m = 0; m < int64_t(history.size()); ++m)
    history[m].assign(lookup.history + lookup.history_starts[m], lookup.history + lookup.history_starts[m + 1]);
  std::vector<int64_t> last(tokens, tokens + M), taken(M, 0), seqs, feeds, wants, drafts, pos, slots, table, lens, lora,
      fed, last_pos, before, packed;
  const StepFollowers followers = model.followers(k > 0);
  MtpScratch<T> mtp_scratch;
  std::vector<char> stopped(M, 0);
  std::vector<T> x, hidden, residual, logits, local_logits;
  std::vector<PenaltyCounts> counts = penalty_counts(penalties, M, model.vocab);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
#else
  const int threads = 1;
#endif
  // Each thread's scores (a row's logits as the sampler reads them) and sampling scratch.
  std::vector<std::vector<float>> scores(threads, std::vector<float>(model.vocab));
  std::vector<SampleScratch> scratch(threads, SampleScratch(sampling.temperature ? model.vocab : 0));
  std::vector<std::vector<float>> exps(logprobs.num ? threads : 0, std::vector<float>(model.vocab));
  std::vector<int64_t> chosen(M);
  auto sampled = [&](int64_t m) { return sampling.temperature && sampling.temperature[m] > 0.f; };
  if (sampling.temperature) std::fill(sampling.drawn, sampling.drawn + M, int64_t(0));
  // Row m's i-th draw of this step (0 for a row that draws none).
  auto draw = [&](int64_t m, int64_t i) { return sampled(m) ? sampling.draws[m * sampling.columns +
                                                                             sampling.drawn[m] + i] : 0.0; };
  // Row m's next token from a row of its logits: drawn (sampled rows, by `with`), else the argmax, of its scores
  // processed where it has penalties or a bias; -2 where a sampled row has none to draw.
  auto choose = [&](int64_t m, const T* row, std::vector<float>& row_scores, SampleScratch& row_scratch,
                    const TokenDraws& with) {
    if (!sampled(m) && !processes(penalties, m) && !masks(grammar, m)) return best_token(model, row, row_scores);
    score_row(model, row, row_scores.data());
    if (masks(grammar, m)) mask_row(grammar, m, row_scores.data(), model.vocab);
    if (processes(penalties, m)) penalize(penalties, m, counts[m], row_scores.data(), model.vocab);
    if (!sampled(m)) return argmax_row(row_scores.data(), model.vocab);
    const int64_t token =
        with.draft >= 0 ? verify_row(row_scores.data(), model.vocab, sampling.temperature[m], sampling.top_k[m],
                                     sampling.top_p[m], sampling.min_p[m], with.draft, with.q, with.accept,
                                     with.uniform, row_scratch)
                        : sample_row(row_scores.data(), model.vocab, sampling.temperature[m], sampling.top_k[m],
                                     sampling.top_p[m], sampling.min_p[m], with.uniform, row_scratch);
    return token < 0 ? int64_t(-2) : token;
  };
  // Row m takes `token` (-2: its sampling failed, which ends it); whether it took one.
  auto take = [&](int64_t m, int64_t token) {
    if (token < 0) {
      out[m * out_cols + taken[m]] = -2;
      stopped[m] = 1;
      return false;
    }
    out[m * out_cols + taken[m]] = token;
    last[m] = token, ++taken[m];
    count_token(counts, m, token);
    if (k > 0) history[m].push_back(token);
    stopped[m] = stopped[m] || std::find(stop_ids + stop_starts[m], stop_ids + stop_starts[m + 1], token) !=
                                   stop_ids + stop_starts[m + 1];
    return true;
  };
  // Row m's token and its logprobs (where it reports them) from a row of its logits, with a thread's scratch.
  auto take_token = [&](int64_t m, const T* row, int thread, const TokenDraws& with) {
    const int64_t token = choose(m, row, scores[thread], scratch[thread], with);
    if (token >= 0 && logprobs.reports(m)) {
      score_row(model, row, scores[thread].data());  // as they are: choose() may have processed them
      report_logprobs(logprobs, m, m * out_cols + taken[m], token, scores[thread].data(), model.vocab,
                      exps[thread].data());
    }
    return token;
  };
  // The drafts' distributions this step (sampled rows with a draft model: [A, k, vocab]), and the draft model's
  // scores and counts (each row's tokens and its drafts so far, where it has penalties).
  std::vector<float> q, draft_scores(draft.model ? draft.model->vocab : 0);
  std::vector<PenaltyCounts> draft_counts;
  // Row m's (a-th of the round) j-th draft from the draft model's logits: processed and drawn as the target will
  // (the distribution into q_rows[j], then its next draw), else their argmax.
  auto pick_draft = [&](int64_t m, int64_t a, int64_t j, const T* row, float* q_rows) {
    const GreedyModel<T>& d = *draft.model;
    if (!sampled(m) && !processes(penalties, m)) return best_token(d, row, draft_scores);
    score_row(d, row, draft_scores.data());
    if (processes(penalties, m)) {
      if (int64_t(draft_counts.size()) <= a) draft_counts.resize(a + 1);
      if (j == 0) draft_counts[a] = counts[m];
      penalize(penalties, m, draft_counts[a], draft_scores.data(), d.vocab);
    }
    int64_t token = -1;
    if (sampled(m)) {
      float* q_row = q_rows + j * model.vocab;
      std::fill(q_row + d.vocab, q_row + model.vocab, 0.f);
      token = draft_row(draft_scores.data(), d.vocab, sampling.temperature[m], sampling.top_k[m], sampling.top_p[m],
                        sampling.min_p[m], draw(m, j), q_row, scratch[0]);
      if (token < 0) {  // nothing to draw from (a NaN): the argmax, as a one-hot guess (the sampler's draft too)
        token = argmax_row(draft_scores.data(), d.vocab);
        std::fill(q_row, q_row + model.vocab, 0.f);
        q_row[token] = 1.f;
      }
    } else {
      token = argmax_row(draft_scores.data(), d.vocab);
    }
    if (processes(penalties, m)) count_token(draft_counts, a, token);
    return token;
  };
  for (int64_t s = 0; s < steps; ++s) {
    if (grammar.bits) grammar.before_step();
    seqs.clear();
    for (int64_t m = 0; m < M; ++m) {
      stopped[m] = stopped[m] || halted(grammar, m);
      if (!stopped[m] && taken[m] < limits[m]) seqs.push_back(m);
    }
    const int64_t A = int64_t(seqs.size());
    if (A == 0) break;
    feeds.assign(A, 0), wants.assign(A, 0), drafts.resize(A * std::max<int64_t>(k, 1));
    int64_t R = A;
    for (int64_t a = 0; a < A && k > 0 && followers.leads(); ++a) {
      const int64_t m = seqs[a], room = masks(grammar, m) ? 0 : std::min(limits[m] - taken[m] - 1, max_rows - R);
      // A draft model drafts k for a row with k slots ahead, as the Python steps do, of which the step feeds what
      // the row has room for.
      if (draft.model && !masks(grammar, m) && draft.capacity[m] - (positions[m] + taken[m]) >= k &&
          (!draft.mtp || (draft.mtp->drafting && draft.mtp->seeded[m])))
        R += feeds[a] = std::min(wants[a] = k, std::max<int64_t>(room, 0));
      else if (!draft.model && room > 0)
        R += feeds[a] = lookup_drafts(history[m], std::min(k, room), lookup.min_n, lookup.max_n,
                                      drafts.data() + a * k);
    }
    if (draft.model && followers.leads()) {
      if (sampling.temperature) q.resize(A * k * model.vocab);
      auto pick = [&](int64_t a, int64_t j, const T* row) {
        return pick_draft(seqs[a], a, j, row, q.empty() ? nullptr : q.data() + a * k * model.vocab);
      };
      if (draft.mtp) {
        last_pos.resize(A);
        for (int64_t a = 0; a < A; ++a) last_pos[a] = positions[seqs[a]] + taken[seqs[a]];
        mtp_drafts(*draft.model, *draft.mtp, seqs, wants, last_pos, k, tables, max_blocks, block_size, drafts.data(),
                   mtp_scratch, pick);
      } else {
        model_drafts(draft, history, seqs, wants, k, tables, max_blocks, block_size, drafts.data(), pick);
      }
      for (int64_t a = 0; a < A; ++a)
        if (sampled(seqs[a])) sampling.drawn[seqs[a]] += wants[a];
    }
    if (followers.group && k > 0) {
      share_drafts(followers, k, feeds, drafts, packed);
      R = A + std::accumulate(feeds.begin(), feeds.end(), int64_t(0));
    }
    pos.resize(R), slots.resize(R), lens.resize(R), lora.resize(R), fed.resize(R), table.resize(R * max_blocks);
    hidden.resize(R * H), residual.resize(R * H), logits.resize(R * model.head_rows);
    for (int64_t a = 0, r = 0; a < A; ++a) {
      const int64_t m = seqs[a];
      const int64_t* row_table = tables + m * max_blocks;
      for (int64_t j = 0; j <= feeds[a]; ++j, ++r) {
        const int64_t p = positions[m] + taken[m] + j;
        fed[r] = j ? drafts[a * k + j - 1] : last[m];
        std::copy(row_table, row_table + max_blocks, table.data() + r * max_blocks);
        pos[r] = p, lens[r] = p + 1, slots[r] = row_table[p / block_size] * block_size + p % block_size;
        lora[r] = adapters ? adapters[m] : -1;
      }
    }
    forward_rows(model, fed.data(), pos.data(), R, H, x, hidden.data(), residual.data(),
                 [&](const T* in, const T* in_residual) {
                   stage_layers(model.layers, model.caches, model.final_norm, in, in_residual, hidden.data(),
                                residual.data(), pos.data(), slots.data(), block_size, table.data(), max_blocks,
                                lens.data(), R, adapters ? lora.data() : nullptr, model.tp());
                 });
    if (model.has_head()) head_logits(model, hidden.data(), R, H, logits.data(), local_logits);
    // Without drafts each row has one row of logits: every row's token is chosen over the threads (processing and
    // sampling a vocabulary is serial work per row), then taken in order below (by the driver alone where the
    // others follow it: driver_steps.h).
    if (k == 0 && model.has_head() && followers.leads()) {
#pragma omp parallel if (A > 1)
      {
#ifdef _OPENMP
        const int thread = omp_get_thread_num();
#else
        const int thread = 0;
#endif
#pragma omp for schedule(dynamic)
        for (int64_t a = 0; a < A; ++a)
          chosen[a] = take_token(seqs[a], logits.data() + a * model.head_rows, thread, {draw(seqs[a], 0)});
      }
    }
    if (draft.mtp) mtp_clear(mtp_scratch);
    before.resize(A);
    for (int64_t a = 0; a < A; ++a) before[a] = taken[seqs[a]];
    for (int64_t a = 0, r = 0; a < A && followers.leads(); r += feeds[a] + 1, ++a) {
      const int64_t m = seqs[a];
      // A step that verifies drafts reads this row's accept draws, then its uniform ones (see RowSampling).
      const int64_t verifies = R > A, f = feeds[a];
      int64_t accepted = 0;
      for (;; ++accepted) {
        const bool draft = accepted < f;
        const TokenDraws with{draw(m, verifies * (f + 1) + accepted), draft ? drafts[a * k + accepted] : -1,
                              draft && !q.empty() ? q.data() + (a * k + accepted) * model.vocab : nullptr,
                              draft ? draw(m, accepted) : 0.0};
        const int64_t token =
            k == 0 ? chosen[a] : take_token(m, logits.data() + (r + accepted) * model.head_rows, 0, with);
        if (!take(m, token) || accepted == feeds[a] || token != drafts[a * k + accepted]) break;
      }
      if (sampled(m)) sampling.drawn[m] += verifies ? 2 * (f + 1) : 1;
      for (int64_t i = 0; draft.mtp && i < taken[m] - before[a]; ++i) {  // the target's h_p with token p + 1
        mtp_row(mtp_scratch, out[m * out_cols + before[a] + i], hidden.data() + (r + i) * H, H,
                positions[m] + before[a] + i, tables + m * max_blocks, max_blocks, block_size);
        mtp_scratch.owners.push_back(m);
      }
      if (feeds[a] > 0 && lookup.verified) {
        lookup.verified[(m * steps + s) * 2] = feeds[a];
        lookup.verified[(m * steps + s) * 2 + 1] = accepted;
      }
    }
    if (draft.mtp) mtp_observe(*draft.model, *draft.mtp, block_size, max_blocks, mtp_scratch);
    if (followers.group) {  // each row's tokens (up to k + 1, and a failure) as the driver took them
      share_taken(followers, seqs, before, k + 2, out, out_cols, packed);
      for (int64_t a = 0; a < A && !followers.leads(); ++a)
        for (int64_t j = 0; j < k + 2 && packed[a * (k + 2) + j] != -1 && take(seqs[a], packed[a * (k + 2) + j]);)
          ++j;
    }
  }
  if (draft.model && draft.next) {
    std::fill(draft.next, draft.next + M * k, int64_t(-1));
    seqs.clear(), feeds.clear();
    for (int64_t m = 0; m < M; ++m)
      if (!stopped[m] && !masks(grammar, m) && taken[m] < limits[m] &&
          draft.capacity[m] - (positions[m] + taken[m]) >= k)
        seqs.push_back(m), feeds.push_back(k);
    drafts.resize(seqs.size() * k);
    model_drafts(draft, history, seqs, feeds, k, tables, max_blocks, block_size, drafts.data(),
                 [&](int64_t a, int64_t j, const T* row) {
                   return pick_draft(seqs[a], a, j, row, draft.next_q ? draft.next_q + seqs[a] * k * model.vocab
                                                                       : nullptr);
                 });
    for (size_t a = 0; a < seqs.size(); ++a)
      if (sampled(seqs[a])) sampling.drawn[seqs[a]] += k;
    for (size_t a = 0; a < seqs.size(); ++a)
      std::copy(drafts.data() + a * k, drafts.data() + (a + 1) * k, draft.next + seqs[a] * k);
  }
}

}  // namespace pagedserve
