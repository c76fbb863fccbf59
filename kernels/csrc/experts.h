// A mixture of experts in place of a layer's dense MLP, for a step of few tokens: the router's product, each row's
// top-k experts by softmax score, each chosen expert's SwiGLU MLP over the rows routed to it (one grouped product
// per expert, its weights read once for all of them), their outputs weighted and summed; what the Python layer
// (workers/layers/fused_moe.py, kernels/fused_moe_ref.py) computes, with the same roundings.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "common.h"
#include "gemv.h"
#include "grouped_routing.h"
#include "gemv_pairs.h"
#include "layer_ops.h"
#include "pairs_amx.h"

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
  // bf16: gate_up's and down's gemv_pairs.h copies, each expert's in turn (kernels.cpu_gemv.pair_weight), or null
  const uint16_t *gate_up_pairs = nullptr, *down_pairs = nullptr;
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

// The (row, choice) pairs of a step grouped by expert: active[i], the i-th expert some row chose (ascending), runs
// pairs[starts[i] .. starts[i + 1]) (each an index row * top_k + choice, ascending).
struct ExpertGroups {
  std::vector<int64_t> pairs, active, starts;
};

inline ExpertGroups group_by_expert(const int64_t* ids, int64_t count, int64_t pairs) {
  std::vector<int64_t> at(count + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++at[ids[i] + 1];
  ExpertGroups g;
  for (int64_t e = 0; e < count; ++e) {
    if (at[e + 1]) g.active.push_back(e), g.starts.push_back(at[e]);
    at[e + 1] += at[e];
  }
  g.starts.push_back(pairs);
  g.pairs.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) g.pairs[at[ids[i]]++] = i;
  return g;
}

// A shared expert whose products join the routed experts' parallel regions (both read the layer's normed rows):
// the pairs copies of its gate_up [2 inter, hidden] and down [hidden, inter], its gated activation, and out
// [M, hidden] for its output. gate_up null: none (the caller runs it on its own).
template <typename T>
struct SharedExpert {
  const uint16_t *gate_up = nullptr, *down = nullptr;
  int64_t inter = 0, activation = kSiluGlu;
  T* out = nullptr;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kExpertPairs = true;
// A tile's cost in input rows: streaming its weights costs about what this many rows' products do, so a split by
// cost balances a batch-1 step (all weights) and a batch-32 one (mostly products) alike.
constexpr int64_t kTileStreamRows = 8;

// One expert's product in a step: y [rows, N] = x [rows, K] W^T from W's gemv_pairs.h copy.
struct ExpertProduct {
  const uint16_t* pairs;
  const uint16_t* x;
  uint16_t* y;
  int64_t rows, N, K;
};

// Every expert's product, one parallel region for all. The (product, tile) items in order are split into one
// contiguous run per thread of about equal cost, so the threads share every expert's weights (one expert or many,
// each read once) and a tile stays in L1 while its expert's rows pass over it. The first pass over a tile prefetches
// the next (the product's next tile, or the next product's first): a step's experts stream from memory (a model's
// experts outgrow the caches), and at few rows per expert the products no longer hide it. With AMX the products are
// tile products (pairs_amx.h) at every row count, so a row's output is the same in any step: at the few rows an
// expert gets, vdpbf16ps's products bound the step, tile products leave it to the weights' stream.
inline void expert_products(const std::vector<ExpertProduct>& each) {
  const int64_t count = int64_t(each.size());
  auto tiles = [](const ExpertProduct& p) { return (p.N + kPairTileRows - 1) / kPairTileRows; };
  auto tile_elems = [](const ExpertProduct& p) { return (p.K + 1) / 2 * 2 * kPairTileRows; };
  std::vector<int64_t> before(count + 1, 0);  // the cost of the items ahead of product i's first tile
  for (int64_t i = 0; i < count; ++i)  // a tile's cost: its column pairs times its rows and streaming
    before[i + 1] = before[i] + tiles(each[i]) * (each[i].K + 1) / 2 * (kTileStreamRows + each[i].rows);
#pragma omp parallel if (count > 0)
  {
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t team = 1, me = 0;
#endif
    // This thread's items: those whose cost ahead lies in [from, to).
    const int64_t from = before[count] * me / team, to = before[count] * (me + 1) / team;
#ifdef PAGEDSERVE_AMX
    const bool amx = amx_usable();
    AmxPairs amx_tiles;
#endif
    for (int64_t i = 0; i < count; ++i) {
      const ExpertProduct& p = each[i];
      const int64_t n = tiles(p), elems = tile_elems(p), cost = (p.K + 1) / 2 * (kTileStreamRows + p.rows);
      const int64_t t0 = std::clamp<int64_t>((from - before[i] + cost - 1) / cost, 0, n);
      const int64_t t1 = std::clamp<int64_t>((to - before[i] + cost - 1) / cost, 0, n);
      for (int64_t t = t0; t < t1; ++t) {
        const uint16_t* after = t + 1 < n ? p.pairs + (t + 1) * elems : i + 1 < count ? each[i + 1].pairs : nullptr;
#ifdef PAGEDSERVE_AMX
        if (amx) {
          for (int64_t m0 = 0; m0 < p.rows; m0 += 16)
            amx_tiles.tile(p.pairs + t * elems, p.x, p.y, t * kPairTileRows, m0, std::min<int64_t>(16, p.rows - m0),
                           p.N, p.K, m0 == 0 ? after : nullptr);
          continue;
        }
#endif
        for (int64_t m0 = 0; m0 < p.rows; m0 += kPairGroupRows)
          pair_group(p.pairs + t * elems, p.x, nullptr, p.y, t * kPairTileRows, m0,
                     std::min(kPairGroupRows, p.rows - m0), p.N, p.K, nullptr, m0 == 0 ? after : nullptr);
      }
    }
  }
}
#else
constexpr bool kExpertPairs = false;
#endif

// Each pair's expert MLP output into y [pairs, H] (pairs' order) from x [M, H]: the rows gathered by expert, then
// from the experts' pairs copies each of the two products of every expert (the shared one's too, where given) in one
// parallel region; else each active expert on one thread (with at least as many of them as threads), or each product
// over all of them.
template <typename T>
void run_experts(const Experts<T>& E, const ExpertGroups& g, const T* x, T* y, int64_t M, int64_t H,
                 const SharedExpert<T>& shared) {
  const int64_t K = E.top_k, I = E.inter, P = int64_t(g.pairs.size());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (E.gate_up_pairs && E.down_pairs) {
      const int64_t S = shared.gate_up ? shared.inter : 0, up_elems = (2 * I + 31) / 32 * ((H + 1) / 2) * 64;
      const int64_t down_elems = (H + 31) / 32 * ((I + 1) / 2) * 64;  // an expert's pairs copies' sizes
      Scratch<T> xs(P * H), h(P * 2 * I + M * 2 * S), act(P * I + M * S);
#pragma omp parallel for if (P * H >= kParallelMinElements)
      for (int64_t p = 0; p < P; ++p) std::copy(x + g.pairs[p] / K * H, x + (g.pairs[p] / K + 1) * H, &xs[p * H]);
      std::vector<ExpertProduct> up, down;
      for (size_t i = 0; i < g.active.size(); ++i) {
        const int64_t first = g.starts[i], rows = g.starts[i + 1] - first;
        up.push_back({E.gate_up_pairs + g.active[i] * up_elems, &xs[first * H], &h[first * 2 * I], rows, 2 * I, H});
        down.push_back({E.down_pairs + g.active[i] * down_elems, &act[first * I], y + first * H, rows, H, I});
      }
      if (S) {
        up.push_back({shared.gate_up, x, &h[P * 2 * I], M, 2 * S, H});
        down.push_back({shared.down, &act[P * I], shared.out, M, H, S});
      }
      expert_products(up);
#pragma omp parallel for if ((P * I + M * S) >= kParallelMinElements)
      for (int64_t p = 0; p < P + (S ? M : 0); ++p) {
        if (p < P) silu_and_mul_row(&h[p * 2 * I], &act[p * I], I);
        else activate_row(shared.activation, &h[P * 2 * I + (p - P) * 2 * S], &act[P * I + (p - P) * S], S);
      }
      expert_products(down);
      return;
    }
  }
#endif
  auto run = [&](size_t i) {
    const int64_t e = g.active[i], first = g.starts[i], n = g.starts[i + 1] - first;
    Scratch<T> xs(n * H), h(n * 2 * I), act(n * I);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = g.pairs[first + r] / K;
      std::copy(x + row * H, x + (row + 1) * H, xs.data() + r * H);
    }
    gemv(xs.data(), E.gate_up + e * 2 * I * H, static_cast<const T*>(nullptr), h.data(), n, 2 * I, H);
    for (int64_t r = 0; r < n; ++r) silu_and_mul_row(h.data() + r * 2 * I, act.data() + r * I, I);
    gemv(act.data(), E.down + e * H * I, static_cast<const T*>(nullptr), y + first * H, n, H, I);
  };
#ifdef _OPENMP
  const bool across = int64_t(g.active.size()) >= omp_get_max_threads() && omp_get_max_threads() > 1;
#else
  const bool across = false;
#endif
#pragma omp parallel for schedule(dynamic) if (across)
  for (size_t i = 0; i < g.active.size(); ++i) run(i);
}

// out [M, H] = the experts' weighted sum for x [M, H]: each expert that some rows chose runs its MLP over those rows
// together (run_experts); each row's float32 sum takes its experts in ascending order (as index_add_ over rows
// sorted by expert).
template <typename T>
void mixture_of_experts(const Experts<T>& E, const T* x, T* out, int64_t M, int64_t H,
                        const SharedExpert<T>& shared = {}) {
  const int64_t K = E.top_k;
  std::vector<int64_t> ids(M * K);
  std::vector<float> weights(M * K);
  if (E.grouped.router) {
    route_grouped(E.grouped, x, M, H, E.count, K, E.renormalize, E.scaling, ids.data(), weights.data());
  } else {
    std::vector<T> logits(M * E.count);
    gemv(x, E.router, static_cast<const T*>(nullptr), logits.data(), M, E.count, H);
    route(E, logits.data(), M, ids.data(), weights.data());
  }
  const ExpertGroups g = group_by_expert(ids.data(), E.count, M * K);
  Scratch<T> y(int64_t(g.pairs.size()) * H);  // each pair's expert output, in pairs' order
  run_experts(E, g, x, y.data(), M, H, shared);
  // Each pair's slot in y, then every row's sum over its pairs in expert order.
  std::vector<int64_t> slot(M * K);
  for (size_t p = 0; p < g.pairs.size(); ++p) slot[g.pairs[p]] = int64_t(p);
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
