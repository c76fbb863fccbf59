// A row's logits processed as the sampler processes them before it draws (workers/layers/sampler.py's _process),
// for the C++ steps: logit bias, then the presence and frequency penalties over the row's generated tokens and the
// repetition penalty over every token it has seen (prompt and generated), in float32 on the row's scores; then its
// bad words' bans.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace pagedserve {

// Per row (null presence: no row has any): presence, frequency and repetition (0, 0, 1: none); its logit bias
// bias_ids / bias_values [bias_starts[m], bias_starts[m + 1]); its generated tokens before the call
// output[output_starts[m] ..] and its prompt's prompt[prompt_starts[m] ..]; its bad words, words
// [word_rows[m], word_rows[m + 1]), word w the tokens words[word_starts[w], word_starts[w + 1]).
struct RowPenalties {
  const float *presence = nullptr, *frequency = nullptr, *repetition = nullptr;
  const int64_t *bias_ids = nullptr, *bias_starts = nullptr;
  const float* bias_values = nullptr;
  const int64_t *output = nullptr, *output_starts = nullptr;
  const int64_t *prompt = nullptr, *prompt_starts = nullptr;
  const int64_t *words = nullptr, *word_starts = nullptr, *word_rows = nullptr;
};

inline bool has_bad_words(const RowPenalties& p, int64_t m) { return p.word_rows[m + 1] > p.word_rows[m]; }

// One row's tokens as its penalties count them, kept up to date as the call takes tokens.
struct PenaltyCounts {
  std::unordered_map<int64_t, int64_t> generated;  // token -> times generated
  std::vector<char> seen;  // [vocab]: in the prompt or generated
  std::vector<int64_t> seen_ids;  // those tokens, each once
  bool bans = false;  // whether it has bad words: then `tokens` holds its prompt and generated tokens
  std::vector<int64_t> tokens;
  void see(int64_t token) {
    if (token >= 0 && token < int64_t(seen.size()) && !seen[token]) seen[token] = 1, seen_ids.push_back(token);
  }
};

// Each row's counts from the tokens before the call (empty without penalties).
inline std::vector<PenaltyCounts> penalty_counts(const RowPenalties& p, int64_t M, int64_t vocab) {
  std::vector<PenaltyCounts> counts(p.presence ? M : 0);
  for (int64_t m = 0; m < int64_t(counts.size()); ++m) {
    if ((counts[m].bans = has_bad_words(p, m))) {
      counts[m].tokens.assign(p.prompt + p.prompt_starts[m], p.prompt + p.prompt_starts[m + 1]);
      counts[m].tokens.insert(counts[m].tokens.end(), p.output + p.output_starts[m], p.output + p.output_starts[m + 1]);
    }
    if (!(p.presence[m] != 0.f || p.frequency[m] != 0.f || p.repetition[m] != 1.f)) continue;
    counts[m].seen.assign(vocab, 0);
    for (int64_t i = p.prompt_starts[m]; i < p.prompt_starts[m + 1]; ++i) counts[m].see(p.prompt[i]);
    for (int64_t i = p.output_starts[m]; i < p.output_starts[m + 1]; ++i) {
      ++counts[m].generated[p.output[i]];
      counts[m].see(p.output[i]);
    }
  }
  return counts;
}

// Whether row m's scores need processing.
inline bool processes(const RowPenalties& p, int64_t m) {
  return p.presence && (p.bias_starts[m + 1] > p.bias_starts[m] || p.presence[m] != 0.f || p.frequency[m] != 0.f ||
                        p.repetition[m] != 1.f || has_bad_words(p, m));
}

// Row m's bad words' bans: the last token of each word whose other tokens end the row's tokens (a one-token word
// always), as workers/request_state.py's banned_token_ids rules.
inline void ban_bad_words(const RowPenalties& p, int64_t m, const PenaltyCounts& counts, float* scores,
                          int64_t vocab) {
  const std::vector<int64_t>& tokens = counts.tokens;
  for (int64_t w = p.word_rows[m]; w < p.word_rows[m + 1]; ++w) {
    const int64_t* word = p.words + p.word_starts[w];
    const int64_t prefix = p.word_starts[w + 1] - p.word_starts[w] - 1;
    if (prefix < 0 || prefix > int64_t(tokens.size())) continue;
    const int64_t last = word[prefix];
    if (last < 0 || last >= vocab) continue;
    if (std::equal(word, word + prefix, tokens.end() - prefix)) scores[last] = -std::numeric_limits<float>::infinity();
  }
}

// Row m's scores [vocab] in place: bias, then scores -= presence * [count > 0] + frequency * count, then a seen
// token's score divided by the repetition penalty if positive, else multiplied, then the bans; each product and
// sum rounded to float32 as torch's separate ops round them (no fused multiply-add: the volatile keeps f * count
// apart).
inline void penalize(const RowPenalties& p, int64_t m, const PenaltyCounts& counts, float* scores, int64_t vocab) {
  for (int64_t i = p.bias_starts[m]; i < p.bias_starts[m + 1]; ++i)
    if (p.bias_ids[i] >= 0 && p.bias_ids[i] < vocab) scores[p.bias_ids[i]] += p.bias_values[i];
  if (!counts.seen.empty()) {
    for (const auto& [token, count] : counts.generated) {
      if (token < 0 || token >= vocab) continue;
      volatile float frequency = p.frequency[m] * float(count);
      scores[token] -= p.presence[m] + frequency;
    }
    const float r = p.repetition[m];
    if (r != 1.f)
      for (const int64_t v : counts.seen_ids) scores[v] = scores[v] > 0.f ? scores[v] / r : scores[v] * r;
  }
  if (counts.bans) ban_bad_words(p, m, counts, scores, vocab);
}

// Row m took `token`: its counts follow.
inline void count_token(std::vector<PenaltyCounts>& counts, int64_t m, int64_t token) {
  if (m >= int64_t(counts.size())) return;
  if (counts[m].bans) counts[m].tokens.push_back(token);
  if (counts[m].seen.empty()) return;
  ++counts[m].generated[token];
  counts[m].see(token);
}

}  // namespace pagedserve
