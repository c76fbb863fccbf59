// A mixture of experts in place of a layer's dense MLP, for a step of few tokens: the router's product, each row's
// top-k experts by softmax score, each chosen expert's SwiGLU MLP over the rows routed to it (one grouped product
// per expert, its weights read once for all of them), their outputs weighted and summed; what the Python layer
// (workers/layers/fused_moe.py, kernels/fused_moe_ref.py) computes, with the same roundings.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common.h"
#include "gemv.h"
#include "grouped_routing.h"
#include "layer_ops.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagedserve {

// count > 0: the layer's MLP is a mixture of `count` experts. router [count, hidden], gate_up [count, 2 inter,
// hidden] (gate rows first), down [count, hidden, inter], all of T; each row's top_k weights renormalized to sum 1
// where set, times scaling. shared_gate: where set, the layer's dense MLP is a shared expert every row passes
// through, weighted by sigmoid(x shared_gate^T) ([1, hidden]) and added (Qwen-MoE); without it, added as it is
// (DeepSeek). grouped.router set: DeepSeek's routing (grouped_routing.h) instead of the softmax top-k.
template <typename T>
struct Experts {
  int64_t count = 0, top_k = 0, inter = 0;
  const T *router = nullptr, *gate_up = nullptr, *down = nullptr, *shared_gate = nullptr;
  bool renormalize = false;
  float scaling = 1.f;
  GroupedRouting grouped{};
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
// With at least as many experts to run as threads, each runs on one thread; else each product over all of them.
template <typename T>
void mixture_of_experts(const Experts<T>& E, const T* x, T* out, int64_t M, int64_t H) {
  const int64_t K = E.top_k, I = E.inter;
  std::vector<int64_t> ids(M * K);
  std::vector<float> weights(M * K);
  if (E.grouped.router) {
    route_grouped(E.grouped, x, M, H, E.count, K, E.renormalize, E.scaling, ids.data(), weights.data());
  } else {
    std::vector<T> logits(M * E.count);
    gemv(x, E.router, static_cast<const T*>(nullptr), logits.data(), M, E.count, H);
    route(E, logits.data(), M, ids.data(), weights.data());
  }
  // The (row, choice) pairs by expert, ascending: expert active[i] runs pairs [starts[i], starts[i + 1]).
  std::vector<int64_t> pairs, active, starts;
  for (int64_t e = 0; e < E.count; ++e) {
    const size_t before = pairs.size();
    for (int64_t i = 0; i < M * K; ++i)
      if (ids[i] == e) pairs.push_back(i);
    if (pairs.size() > before) active.push_back(e), starts.push_back(int64_t(before));
  }
  starts.push_back(int64_t(pairs.size()));
  std::vector<T> y(pairs.size() * H);  // each pair's expert output, in pairs' order
  auto run = [&](size_t i) {
    const int64_t e = active[i], first = starts[i], n = starts[i + 1] - first;
    std::vector<T> xs(n * H), h(n * 2 * I), act(n * I);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = pairs[first + r] / K;
      std::copy(x + row * H, x + (row + 1) * H, xs.data() + r * H);
    }
    gemv(xs.data(), E.gate_up + e * 2 * I * H, static_cast<const T*>(nullptr), h.data(), n, 2 * I, H);
    for (int64_t r = 0; r < n; ++r) silu_and_mul_row(h.data() + r * 2 * I, act.data() + r * I, I);
    gemv(act.data(), E.down + e * H * I, static_cast<const T*>(nullptr), y.data() + first * H, n, H, I);
  };
#ifdef _OPENMP
  const bool across = int64_t(active.size()) >= omp_get_max_threads() && omp_get_max_threads() > 1;
#else
  const bool across = false;
#endif
#pragma omp parallel for schedule(dynamic) if (across)
  for (size_t i = 0; i < active.size(); ++i) run(i);
  // Each pair's slot in y, then every row's sum over its pairs in expert order.
  std::vector<int64_t> slot(M * K);
  for (size_t p = 0; p < pairs.size(); ++p) slot[pairs[p]] = int64_t(p);
#pragma omp parallel for if (M * H * K >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    std::vector<int64_t> order(K);
    std::iota(order.begin(), order.end(), m * K);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    std::vector<float> sum(H, 0.f);
    for (const int64_t i : order) {
      const T* from = y.data() + slot[i] * H;
      for (int64_t d = 0; d < H; ++d) {
        const float weighted = widen(from[d]) * weights[i];
        sum[d] += weighted;
      }
    }
    for (int64_t d = 0; d < H; ++d) store(sum[d], out + m * H + d);
  }
}

// out += round(sigmoid(x shared_gate^T) * shared) for each row: the shared expert's output `shared` [M, H] joins;
// without a gate, out += shared.
template <typename T>
void add_shared_expert(const Experts<T>& E, const T* x, const T* shared, T* out, int64_t M, int64_t H) {
  if (!E.shared_gate) {
    for (int64_t i = 0; i < M * H; ++i) out[i] = round_to<T>(widen(out[i]) + widen(shared[i]));
    return;
  }
  std::vector<T> gate(M);
  gemv(x, E.shared_gate, static_cast<const T*>(nullptr), gate.data(), M, 1, H);
  for (int64_t m = 0; m < M; ++m) {
    const float g = widen(round_to<T>(1.f / (1.f + std::exp(-widen(gate[m])))));
    for (int64_t d = 0; d < H; ++d)
      out[m * H + d] = round_to<T>(widen(out[m * H + d]) + widen(round_to<T>(g * widen(shared[m * H + d]))));
  }
}

}  // namespace pagedserve
