// DeepSeek-V3's multi-token-prediction layer as the drafter inside the C++ steps (greedy_decode.h), as
// workers/spec_decode/mtp.py drafts: at position p the layer takes the target's final hidden state h_p with token
// p + 1 and predicts token p + 2; further drafts take its own output in place of the target's next hidden state.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "greedy_model.h"

namespace pagedserve {

// The layer's input: eh_proj [enorm(embedding row of the token) | hnorm(hidden state)].
template <typename T>
struct MtpInputs {
  const T* embedding = nullptr;  // [vocab, hidden]
  Norm<T> enorm, hnorm;
  const T* eh_proj = nullptr;  // [hidden, 2 hidden]
  const uint16_t* eh_pairs = nullptr;  // its gemv_pairs.h copy, or null
  int64_t hidden = 0;
};

// x [R, H]: the layer's input for tokens[r] with the hidden state hidden[r] (joined: scratch).
template <typename T>
void mtp_inputs(const MtpInputs<T>& in, const int64_t* tokens, const T* hidden, int64_t R, T* x,
                std::vector<T>& joined) {
  const int64_t H = in.hidden;
  joined.resize(R * 2 * H);
  for (int64_t r = 0; r < R; ++r) {
    norm_row(in.enorm, in.embedding + tokens[r] * H, joined.data() + r * 2 * H, H);
    norm_row(in.hnorm, hidden + r * H, joined.data() + r * 2 * H + H, H);
  }
  products(joined.data(), in.eh_proj, in.eh_pairs, static_cast<const T*>(nullptr), x, R, H, 2 * H);
}

// The layer as a draft model (draft_steps.h's DraftModel::mtp): its decoder layer with the shared head's norm as
// the final norm and the shared head (a GreedyModel), its inputs, and per row seeds[m] [hidden], the layer's output
// at the position before the row's last token's where seeded[m] (what the first draft's logits come from; the
// steps keep both up to date). Without drafting the steps verify no drafts but the layer still takes each step's
// hidden states (a batch past speculation's cut-off: the Python steps observe every step too).
template <typename T>
struct MtpLayer {
  MtpInputs<T> inputs;
  T* seeds = nullptr;
  int64_t* seeded = nullptr;
  bool drafting = true;
};

template <typename T>
struct MtpScratch {
  std::vector<int64_t> tokens, pos, slots, lens, table, owners;
  std::vector<T> h, x, normed, sums, joined, logits;
};

// The layer over s.tokens / s.h at s.pos (row tables in s.table), writing its K/V: s.normed (for the head) and
// s.sums (its output, the next draft's hidden state).
template <typename T>
void mtp_forward(const GreedyModel<T>& model, const MtpInputs<T>& inputs, int64_t block_size, int64_t max_blocks,
                 MtpScratch<T>& s) {
  const int64_t H = inputs.hidden, R = int64_t(s.tokens.size());
  s.x.resize(R * H), s.normed.resize(R * H), s.sums.resize(R * H);
  mtp_inputs(inputs, s.tokens.data(), s.h.data(), R, s.x.data(), s.joined);
  stage_layers(model.layers, model.caches, model.final_norm, s.x.data(), static_cast<const T*>(nullptr),
               s.normed.data(), s.sums.data(), s.pos.data(), s.slots.data(), block_size, s.table.data(), max_blocks,
               s.lens.data(), R);
}

// One row of s: token at position p over row_table, its hidden state h.
template <typename T>
void mtp_row(MtpScratch<T>& s, int64_t token, const T* h, int64_t H, int64_t p, const int64_t* row_table,
             int64_t max_blocks, int64_t block_size) {
  s.tokens.push_back(token), s.pos.push_back(p), s.lens.push_back(p + 1);
  s.slots.push_back(row_table[p / block_size] * block_size + p % block_size);
  s.table.insert(s.table.end(), row_table, row_table + max_blocks);
  s.h.insert(s.h.end(), h, h + H);
}

template <typename T>
void mtp_clear(MtpScratch<T>& s) {
  s.tokens.clear(), s.pos.clear(), s.lens.clear(), s.slots.clear(), s.table.clear(), s.h.clear(), s.owners.clear();
}

// want[a] drafts for each row a of seqs (its last token at last_pos[a]) into drafts[a * k ..], the token
// pick(a, j, logits) chooses from the logits of row a's j-th: the first from its seed, each next from the layer fed
// the draft before at the position before it, with the layer's output before (every row of a round in one pass).
template <typename T, typename Pick>
void mtp_drafts(const GreedyModel<T>& model, const MtpLayer<T>& mtp, const std::vector<int64_t>& seqs,
                const std::vector<int64_t>& want, const std::vector<int64_t>& last_pos, int64_t k,
                const int64_t* tables, int64_t max_blocks, int64_t block_size, int64_t* drafts, MtpScratch<T>& s,
                Pick&& pick) {
  const int64_t H = mtp.inputs.hidden, A = int64_t(seqs.size());
  std::vector<int64_t> owners;
  std::vector<T> outputs;  // each owner's last output of the layer
  for (int64_t a = 0; a < A; ++a)
    if (want[a] > 0) {
      owners.push_back(a);
      outputs.insert(outputs.end(), mtp.seeds + seqs[a] * H, mtp.seeds + (seqs[a] + 1) * H);
    }
  for (int64_t j = 0; !owners.empty(); ++j) {
    const int64_t n = int64_t(owners.size());
    s.normed.resize(n * H);
    if (j == 0) {
      for (int64_t i = 0; i < n; ++i) norm_row(model.final_norm, outputs.data() + i * H, s.normed.data() + i * H, H);
    } else {
      mtp_clear(s);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t a = owners[i];
        mtp_row(s, drafts[a * k + j - 1], outputs.data() + i * H, H, last_pos[a] + j - 1,
                tables + seqs[a] * max_blocks, max_blocks, block_size);
      }
      mtp_forward(model, mtp.inputs, block_size, max_blocks, s);
      outputs.assign(s.sums.begin(), s.sums.end());
    }
    s.logits.resize(n * model.head_rows);
    products(s.normed.data(), model.head, model.head_pairs, static_cast<const T*>(nullptr), s.logits.data(), n,
             model.head_rows, H);
    for (int64_t i = 0; i < n; ++i)
      drafts[owners[i] * k + j] = pick(owners[i], j, s.logits.data() + i * model.head_rows);
    std::vector<int64_t> kept;
    std::vector<T> kept_outputs;
    for (int64_t i = 0; i < n; ++i)
      if (want[owners[i]] > j + 1) {
        kept.push_back(owners[i]);
        kept_outputs.insert(kept_outputs.end(), outputs.begin() + i * H, outputs.begin() + (i + 1) * H);
      }
    owners.swap(kept), outputs.swap(kept_outputs);
  }
}

// After a target step: the layer takes each row's hidden states with the tokens now known after them (s: rows added
// by mtp_row() in row order, s.owners[i] the model row m of each), and each row's last output becomes its seed.
template <typename T>
void mtp_observe(const GreedyModel<T>& model, const MtpLayer<T>& mtp, int64_t block_size, int64_t max_blocks,
                 MtpScratch<T>& s) {
  const int64_t H = mtp.inputs.hidden, R = int64_t(s.tokens.size());
  if (R == 0) return;
  mtp_forward(model, mtp.inputs, block_size, max_blocks, s);
  for (int64_t i = 0; i < R; ++i)
    if (i + 1 == R || s.owners[i + 1] != s.owners[i]) {
      std::copy(s.sums.data() + i * H, s.sums.data() + (i + 1) * H, mtp.seeds + s.owners[i] * H);
      mtp.seeded[s.owners[i]] = 1;
    }
}

}  // namespace pagedserve
