// A mixture of experts in place of a layer's dense MLP, for a step of few tokens: the router's product, each row's
// top-k experts by softmax score, each chosen expert's SwiGLU MLP over the rows routed to it (one grouped product
// per expert, its weights read once for all of them), their outputs weighted and summed; what the Python layer
// (workers/layers/fused_moe.py, kernels/fused_moe_ref.py) computes, with the same roundings.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "gemv.h"
#include "layer_ops.h"

namespace pagedserve {

// count > 0: the layer's MLP is a mixture of `count` experts. router [count, hidden], gate_up [count, 2 inter,
// hidden] (gate rows first), down [count, hidden, inter], all of T; each row's top_k weights renormalized to sum 1
// where set, times scaling. shared_gate: where set, the layer's dense MLP is a shared expert every row passes
// through, weighted by sigmoid(x shared_gate^T) ([1, hidden]) and added (Qwen-MoE).
template <typename T>
struct Experts {
  int64_t count = 0, top_k = 0, inter = 0;
  const T *router = nullptr, *gate_up = nullptr, *down = nullptr, *shared_gate = nullptr;
  bool renormalize = false;
  float scaling = 1.f;
};

// Row m's experts and weights into ids/weights [m * top_k ..]: softmax of its logits in float32, the top_k largest
// (the first of equal ones), renormalized as the routing says.
template <typename T>
void route(const Experts<T>& E, const T* logits, int64_t M, int64_t* ids, float* weights) {
  std::vector<float> scores(E.count);
  std::vector<char> taken(E.count);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = logits + m * E.count;
    float top = widen(row[0]), sum = 0.f;
    for (int64_t e = 1; e < E.count; ++e) top = std::max(top, widen(row[e]));
    for (int64_t e = 0; e < E.count; ++e) sum += scores[e] = std::exp(widen(row[e]) - top);
    for (int64_t e = 0; e < E.count; ++e) scores[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t k = 0; k < E.top_k; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E.count; ++e)
        if (!taken[e] && (best < 0 || scores[e] > scores[best])) best = e;
      taken[best] = 1;
      ids[m * E.top_k + k] = best;
      chosen += weights[m * E.top_k + k] = scores[best];
    }
    for (int64_t k = 0; k < E.top_k; ++k) {
      float& w = weights[m * E.top_k + k];
      if (E.renormalize) w = w / (chosen + 1e-20f);
      if (E.scaling != 1.f) w *= E.scaling;
    }
  }
}

// out [M, H] = the experts' weighted sum for x [M, H]: each expert that some rows chose runs its MLP over those rows
// together; each row's float32 sum takes its experts in ascending order (as index_add_ over rows sorted by expert).
template <typename T>
void mixture_of_experts(const Experts<T>& E, const T* x, T* out, int64_t M, int64_t H) {
  const int64_t K = E.top_k, I = E.inter;
  std::vector<T> logits(M * E.count);
  gemv(x, E.router, static_cast<const T*>(nullptr), logits.data(), M, E.count, H);
  std::vector<int64_t> ids(M * K);
  std::vector<float> weights(M * K), sum(M * H, 0.f);
  route(E, logits.data(), M, ids.data(), weights.data());
  std::vector<int64_t> rows;
  std::vector<float> row_weights;
  std::vector<T> xs, h, act, y;
  for (int64_t e = 0; e < E.count; ++e) {
    rows.clear(), row_weights.clear();
    for (int64_t i = 0; i < M * K; ++i)
      if (ids[i] == e) rows.push_back(i / K), row_weights.push_back(weights[i]);
    const int64_t n = int64_t(rows.size());
    if (n == 0) continue;
    xs.resize(n * H), h.resize(n * 2 * I), act.resize(n * I), y.resize(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy(x + rows[r] * H, x + (rows[r] + 1) * H, xs.data() + r * H);
    gemv(xs.data(), E.gate_up + e * 2 * I * H, static_cast<const T*>(nullptr), h.data(), n, 2 * I, H);
    for (int64_t r = 0; r < n; ++r) silu_and_mul_row(h.data() + r * 2 * I, act.data() + r * I, I);
    gemv(act.data(), E.down + e * H * I, static_cast<const T*>(nullptr), y.data(), n, H, I);
    for (int64_t r = 0; r < n; ++r) {
      float* to = sum.data() + rows[r] * H;
      const T* from = y.data() + r * H;
      for (int64_t d = 0; d < H; ++d) {
        const float weighted = widen(from[d]) * row_weights[r];
        to[d] += weighted;
      }
    }
  }
  for (int64_t i = 0; i < M * H; ++i) store(sum[i], out + i);
}

// out += round(sigmoid(x shared_gate^T) * shared) for each row: the shared expert's output `shared` [M, H] joins.
template <typename T>
void add_shared_expert(const Experts<T>& E, const T* x, const T* shared, T* out, int64_t M, int64_t H) {
  std::vector<T> gate(M);
  gemv(x, E.shared_gate, static_cast<const T*>(nullptr), gate.data(), M, 1, H);
  for (int64_t m = 0; m < M; ++m) {
    const float g = widen(round_to<T>(1.f / (1.f + std::exp(-widen(gate[m])))));
    for (int64_t d = 0; d < H; ++d)
      out[m * H + d] = round_to<T>(widen(out[m * H + d]) + widen(round_to<T>(g * widen(shared[m * H + d]))));
  }
}

}  // namespace pagedserve
