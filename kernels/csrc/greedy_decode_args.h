// How greedy_decode()'s Python arguments (pointers, and lists of them per feature) become its structs, and the call.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "greedy_decode.h"
#include "model_args.h"

namespace pagedserve::binding {

// Greedy steps of the whole model (greedy_decode.h); drafts from `draft` if given (its K/V known per row at
// draft_known, int64 [m], updated), else by prompt lookup.
template <typename T>
void greedy_decode(const ModelArgs& model_args, uintptr_t tokens, uintptr_t positions, uintptr_t tables,
                   int64_t max_blocks, int64_t block_size, uintptr_t limits, uintptr_t stop_ids, uintptr_t stop_starts,
                   const std::vector<int64_t>& lookup, uintptr_t history, uintptr_t history_starts,
                   uintptr_t verified, const std::vector<uintptr_t>& sampled, const std::vector<uintptr_t>& penalized,
                   const std::vector<uintptr_t>& masks, int64_t mask_words, const std::function<void()>& before_step,
                   const std::vector<uintptr_t>& logprobs, int64_t logprob_width, uintptr_t adapters,
                   const std::optional<DraftArgs>& draft, uintptr_t draft_known, int64_t max_rows,
                   uintptr_t tokens_out, int64_t out_cols, int64_t m, int64_t steps) {
  const pagedserve::GreedyModel<T> model = model_of<T>(model_args);
  std::optional<pagedserve::GreedyModel<T>> draft_model;
  std::optional<pagedserve::MtpLayer<T>> mtp;
  pagedserve::DraftModel<T> drafter{nullptr, out<int64_t>(draft_known)};
  if (draft) {
    draft_model = model_of<T>(std::get<0>(*draft));
    if (const auto& layer = std::get<4>(*draft))
      mtp = pagedserve::MtpLayer<T>{mtp_inputs_of<T>(std::get<0>(*layer)), out<T>(std::get<1>(*layer)),
                                    out<int64_t>(std::get<2>(*layer)), std::get<3>(*layer)};
    drafter = {&*draft_model, out<int64_t>(draft_known), in<int64_t>(std::get<1>(*draft)),
               out<int64_t>(std::get<2>(*draft)), out<float>(std::get<3>(*draft)), mtp ? &*mtp : nullptr};
  }
  const pagedserve::PromptLookup drafts{lookup.at(0), lookup.at(1), lookup.at(2), in<int64_t>(history),
                                        in<int64_t>(history_starts), out<int64_t>(verified)};
  // sampled: temperature, top_k, top_p, min_p, draws [m, columns], columns, drawn (empty: every row argmax)
  const pagedserve::RowSampling sampling = sampled.empty() ? pagedserve::RowSampling{} : pagedserve::RowSampling{
      in<float>(sampled.at(0)), in<int64_t>(sampled.at(1)), in<float>(sampled.at(2)), in<float>(sampled.at(3)),
      in<double>(sampled.at(4)), int64_t(sampled.at(5)), out<int64_t>(sampled.at(6))};
  // penalized: presence, frequency, repetition, bias ids, starts and values, generated tokens and starts, prompt
  // tokens and starts, bad words' tokens, word starts and each row's first word (empty: no row processed)
  const pagedserve::RowPenalties penalties = penalized.empty() ? pagedserve::RowPenalties{} :
      pagedserve::RowPenalties{in<float>(penalized.at(0)), in<float>(penalized.at(1)), in<float>(penalized.at(2)),
                               in<int64_t>(penalized.at(3)), in<int64_t>(penalized.at(4)), in<float>(penalized.at(5)),
                               in<int64_t>(penalized.at(6)), in<int64_t>(penalized.at(7)), in<int64_t>(penalized.at(8)),
                               in<int64_t>(penalized.at(9)), in<int64_t>(penalized.at(10)),
                               in<int64_t>(penalized.at(11)), in<int64_t>(penalized.at(12))};
  // masks: bits, constrained, halted (empty: no row constrained); before_step fills them (grammar_masks.h)
  const pagedserve::RowMasks grammar = masks.empty() ? pagedserve::RowMasks{} : pagedserve::RowMasks{
      in<int32_t>(masks.at(0)), mask_words, in<uint8_t>(masks.at(1)), in<uint8_t>(masks.at(2)), before_step};
  // logprobs: num, ids, values, ranks (empty: no row reports them)
  const pagedserve::RowLogprobs reported = logprobs.empty() ? pagedserve::RowLogprobs{} : pagedserve::RowLogprobs{
      in<int64_t>(logprobs.at(0)), logprob_width, out<int64_t>(logprobs.at(1)), out<float>(logprobs.at(2)),
      out<int64_t>(logprobs.at(3))};
  pagedserve::greedy_decode(model, in<int64_t>(tokens), in<int64_t>(positions), in<int64_t>(tables), max_blocks,
                            block_size, in<int64_t>(limits), in<int64_t>(stop_ids), in<int64_t>(stop_starts), drafts,
                            drafter, sampling, penalties, grammar, reported, in<int64_t>(adapters), max_rows,
                            out<int64_t>(tokens_out), out_cols, m, steps);
}

}  // namespace pagedserve::binding
