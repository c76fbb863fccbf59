// DeepSeek's routing of a mixture of experts (kernels/fused_moe_ref.py's select_experts with groups): float32
// logits, softmax (V2) or sigmoid (V3) scores, experts chosen within each row's best groups, by score plus a
// correction bias where V3 has one (noaux_tc), weighted by their unbiased score.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "gemv.h"

namespace pagedserve {

// router: float32 [count, hidden] (router == null: none); bias: float32 [count] or null; groups: the experts'
// equal groups, topk_groups of them compete (groups <= 1: all).
struct GroupedRouting {
  const float* router = nullptr;
  const float* bias = nullptr;
  int64_t groups = 0, topk_groups = 0;
  bool sigmoid = false;
};

// Row m's top_k experts and weights into ids/weights [m * top_k ..] for x [M, hidden]: as select_experts, a group
// ranked by its best choice score (the sum of its two best with a bias), the other groups' choices 0, the top_k
// largest (the lower id of equal ones), renormalized where set, times scaling.
template <typename T>
void route_grouped(const GroupedRouting& R, const T* x, int64_t M, int64_t H, int64_t count, int64_t top_k,
                   bool renormalize, float scaling, int64_t* ids, float* weights) {
  std::vector<float> xf(M * H), logits(M * count);
  for (int64_t i = 0; i < M * H; ++i) xf[i] = widen(x[i]);
  gemv(xf.data(), R.router, static_cast<const float*>(nullptr), logits.data(), M, count, H);
  const int64_t per = R.groups > 1 ? count / R.groups : count, groups = R.groups > 1 ? R.groups : 1;
  std::vector<float> scores(count), choice(count), group_score(groups);
  std::vector<char> taken(std::max(count, groups));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = logits.data() + m * count;
    if (R.sigmoid) {
      for (int64_t e = 0; e < count; ++e) scores[e] = 1.f / (1.f + std::exp(-row[e]));
    } else {
      const float top = *std::max_element(row, row + count);
      float sum = 0.f;
      for (int64_t e = 0; e < count; ++e) sum += scores[e] = std::exp(row[e] - top);
      for (int64_t e = 0; e < count; ++e) scores[e] /= sum;
    }
    for (int64_t e = 0; e < count; ++e) choice[e] = scores[e] + (R.bias ? R.bias[e] : 0.f);
    if (groups > 1) {
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<float> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(members.begin(), members.end(), std::greater<float>());
        group_score[g] = members[0] + (R.bias && per > 1 ? members[1] : 0.f);
      }
      std::fill(taken.begin(), taken.end(), 0);
      for (int64_t k = 0; k < R.topk_groups; ++k) {
        int64_t best = -1;
        for (int64_t g = 0; g < groups; ++g)
          if (!taken[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        taken[best] = 1;
      }
      for (int64_t e = 0; e < count; ++e)
        if (!taken[e / per]) choice[e] = 0.f;
    }
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < count; ++e)
        if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      taken[best] = 1;
      ids[m * top_k + k] = best;
      chosen += weights[m * top_k + k] = R.bias ? scores[best] : choice[best];
    }
    for (int64_t k = 0; k < top_k; ++k) {
      float& w = weights[m * top_k + k];
      if (renormalize) w = w / (chosen + 1e-20f);
      if (scaling != 1.f) w *= scaling;
    }
  }
}

}  // namespace pagedserve
