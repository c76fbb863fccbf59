// Fused paged-attention decode: each K and V row read once, in place, from the paged cache.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_amx.h"
#include "attention_rows.h"
#include "common.h"
#include "kv_cache.h"

namespace pagedserve {

// The hardware prefetcher stops at the scattered block boundaries, so blocks are prefetched in two steps: those
// kPrefetchBlocks ahead into L2 (and, during the K pass, the same V blocks, whose pass follows), then the next one
// from L2 into L1. Straight into L1 from DRAM the requests fill its few miss buffers and stall the loads of the block
// at hand (Zen 4); into L2 alone each block's first loads still wait on L2 (Zen 5). python
// benchmarks/cpu_decode_attention.py, 2-core EPYC Zen 5, 16-96 sequences: L2 alone 20-27 GB/s of K/V from DRAM,
// both steps 28-36 GB/s, where a pure gather of random 2 KiB blocks (the block size of one head) peaks at 36 GB/s.
// The distance is in bytes (three bf16 blocks of one head of 64), so that an fp8 cache's half-size blocks keep as
// many bytes in flight.
constexpr int64_t kPrefetchBytes = 6 << 10;
constexpr int64_t kScoresBytes = 512 << 10;  // a piece of a run's scores at most (about half an L2): decode()
template <int Locality, typename T>
inline void prefetch(const T* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t off = 0; off < elems * int64_t(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, Locality);
}

template <typename T>
inline int64_t prefetch_blocks(int64_t bs, int64_t dim) {
  return std::max<int64_t>(1, kPrefetchBytes / (bs * dim * int64_t(sizeof(T))));
}

// The first blocks [start, start + prefetch_blocks] of KV head h from each cache into L2 (another item's, ahead).
template <typename T>
inline void prefetch_first(std::initializer_list<const T*> caches, const int64_t* table, int64_t h, int64_t kv_heads,
                           int64_t bs, int64_t dim, int64_t start, int64_t len) {
  const int64_t last = start / bs + prefetch_blocks<T>(bs, dim);
  for (int64_t a = start / bs; a <= last && a * bs < len; ++a)
    for (const T* c : caches) prefetch<1>(c + (table[a] * kv_heads + h) * bs * dim, bs * dim);
}

// fn(j0, j1, rows) for each block's share [j0, j1) of the positions [start, len) of KV head h, in block order; the
// rows as stored, position j at rows + (j - j0) * dim. The same head's blocks prefetch_blocks ahead are prefetched
// into L2 from each cache in `ahead` (the first ones too unless `warm`), the next block of `cache` into L1.
template <typename T, typename Fn>
inline void for_each_block(const T* cache, const int64_t* table, int64_t h, int64_t kv_heads, int64_t bs, int64_t dim,
                           int64_t start, int64_t len, std::initializer_list<const T*> ahead, Fn fn,
                           bool warm = false) {
  const int64_t distance = prefetch_blocks<T>(bs, dim);
  if (!warm) prefetch_first(ahead, table, h, kv_heads, bs, dim, start, len);
  for (int64_t b = start / bs; b * bs < len; ++b) {
    const int64_t j0 = std::max(start, b * bs), j1 = std::min(len, (b + 1) * bs);
    if ((b + distance) * bs < len)
      for (const T* other : ahead) prefetch<1>(other + (table[b + distance] * kv_heads + h) * bs * dim, bs * dim);
    if ((b + 1) * bs < len) prefetch<3>(cache + (table[b + 1] * kv_heads + h) * bs * dim, bs * dim);
    fn(j0, j1, cache + (table[b] * kv_heads + h) * bs * dim + (j0 - b * bs) * dim);
  }
}

// Rows [first, end) that share one block table: the tokens of one sequence in this step (speculative verification,
// a short prompt chunk). They are attended together, so each K and V row is read once for all of them.
inline int64_t run_end(const int64_t* tables, int64_t max_blocks, int64_t first, int64_t num_rows) {
  int64_t end = first + 1;
  while (end < num_rows && std::equal(tables + end * max_blocks, tables + (end + 1) * max_blocks,
                                      tables + first * max_blocks))
    ++end;
  return end;
}

// D > 0 fixes head_dim at compile time so the inner loops fully unroll; D == 0 handles any head_dim.
// soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) before the softmax (Gemma 2).
// Row s attends to its context [max(0, lens[s] - window), lens[s]) over block table row s.
// C: the caches' element type (T, or fp8 read as widen_rows gives it): scale includes K's factor to values, out_mul
// is V's (1 for T).
template <typename T, typename C, int D>
void decode(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t bs, int64_t head_dim,
            int64_t max_blocks, float scale, float out_mul, float soft_cap, int64_t window) {
  const int64_t dim = D ? D : head_dim, G = num_heads / kv_heads;
  // bf16 with AVX-512 BF16: products straight from the cache's rows (the query scaled after its products), for
  // head dims of a multiple of 32 (at compile time, or any at run time: MLA's latent rows).
  // An fp8 cache's blocks take that path converted to bf16 (exactly) a block at a time.
  constexpr bool bf16_cache = kNativeBf16Attention && std::is_same_v<T, uint16_t> &&
                              (std::is_same_v<C, T> || kIsFp8<C>);
  const bool native = bf16_cache && dim % 32 == 0;
  // With AMX the scores of all the item's query heads against a block's K rows are tile products (attention_amx.h),
  // from groups of 8 query heads per KV head on: a tile product costs as much for 2 queries as for 16, and up to 4
  // the vdpbf16ps rows are as fast or faster (benchmarks/cpu_decode_attention.py --heads, caches from memory).
  // Decided per call, so that a row's output does not depend on the rows beside it.
  const bool amx = native && G >= 8 && amx_usable();
  std::vector<int64_t> runs{0};  // row ranges sharing a table
  while (runs.back() < num_seqs) runs.push_back(run_end(tables, max_blocks, runs.back(), num_seqs));
  // Runs split into pieces of rows, each reading the run's K/V again (from cache): so many rows that their scores
  // [rows x G x positions] would outgrow kScoresBytes (a long prompt chunk: past L2 they cost more than the reread),
  // and, with fewer (run, KV head) items than two per thread (one sequence verifying drafts, few KV heads), enough
  // pieces that every thread gets a share. A row's values do not depend on the rows beside it.
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lens, lens + num_seqs));
  const int64_t most_rows = std::max<int64_t>(16, kScoresBytes / int64_t(G * longest * sizeof(float)));
  int64_t pieces = 1;
#ifdef _OPENMP
  const int64_t wanted = 2 * omp_get_max_threads(), items = (int64_t(runs.size()) - 1) * kv_heads;
  if (items < wanted) pieces = (wanted + items - 1) / items;
#endif
  std::vector<int64_t> split{0};
  for (size_t r = 1; r < runs.size(); ++r) {
    const int64_t rows = runs[r] - runs[r - 1];
    const int64_t size = std::min(most_rows, std::max<int64_t>(1, (rows + pieces - 1) / pieces));
    for (int64_t end = runs[r - 1] + size; end < runs[r]; end += size) split.push_back(end);
    split.push_back(runs[r]);
  }
  runs.swap(split);
  const int64_t num_runs = int64_t(runs.size()) - 1, num_items = num_runs * kv_heads;
  // The positions [lo, hi) that rows [first, first + rows) see together, each row's own window start into `starts`
  // (a row sees [starts[r], lens[first + r])).
  auto span = [&](int64_t first, int64_t rows, std::vector<int64_t>* starts) {
    if (starts) starts->resize(rows);
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = lens[first + r], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (starts) (*starts)[r] = start;
      if (start < len) lo = std::min(lo, start), hi = std::max(hi, len);
    }
    return std::pair<int64_t, int64_t>{lo, hi};
  };
  // Items are dealt in chunks so that a thread knows its next one and prefetches its first blocks during its V pass
  // (else each item would start waiting on memory); small chunks keep the threads' shares even.
  int64_t chunk = 1;
#ifdef _OPENMP
  chunk = std::clamp<int64_t>(num_items / (8 * omp_get_max_threads()), 1, 8);
#endif
#pragma omp parallel
  {
    // Two passes over keys (scores, then V) with the scores kept here: each K and V row is read exactly once.
    std::vector<float> scores, qf, acc, row(native ? 0 : bs * dim), inv;
    std::vector<uint16_t> row16(native && kIsFp8<C> ? bs * dim : 0), p16;
    using Pairs = typename PairsOf<C>::type;
    const Pairs pairs;
    std::vector<int64_t> starts;
    AmxScores tiles(amx ? dim : 0);
    int64_t warmed = -1;  // the item whose first blocks the previous one prefetched
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t first = runs[item / kv_heads], rows = runs[item / kv_heads + 1] - first, h = item % kv_heads;
      const int64_t* table = tables + first * max_blocks;
      const auto [lo, hi] = span(first, rows, &starts);
      const int64_t n = hi > lo ? hi - lo : 0, queries = rows * G;
      scores.resize(queries * std::max<int64_t>(n, 1));
      qf.resize(native ? 0 : queries * dim);
      acc.assign(queries * dim, 0.f);
      inv.resize(queries);
      p16.resize(native ? scores.size() : 0);
      for (int64_t r = 0; !native && r < rows; ++r) {
        const T* qs = q + ((first + r) * num_heads + h * G) * dim;
        for (int64_t i = 0; i < G * dim; ++i) qf[r * G * dim + i] = widen(qs[i]) * scale;
      }
      if (amx)
        tiles.set_queries(queries, [&](int64_t j) { return q + ((first + j / G) * num_heads + h * G + j % G) * dim; },
                          scores.data(), std::max<int64_t>(n, 1), scale);
      if (n > 0) {
        for_each_block(kc, table, h, kv_heads, bs, dim, lo, hi, {kc, vc}, [&](int64_t j0, int64_t j1, const C* block) {
          const float* k = nullptr;
          const uint16_t* k16 = nullptr;
          if (native) {
            if constexpr (bf16_cache)
              k16 = bf16_rows(block, amx && kIsFp8<C> ? tiles.stage(j1 - j0) : row16.data(), (j1 - j0) * dim);
            if (amx) {  // every query's scores over the whole block (those outside a row's own range go unread)
              tiles.add(k16, j1 - j0, j0 - lo);
              return;
            }
          } else {
            k = widen_rows(block, row.data(), (j1 - j0) * dim);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t a = std::max(j0, starts[r]), b = std::min(j1, lens[first + r]);
            for (int64_t g = 0; a < b && g < G; ++g) {
              float* sc = scores.data() + (r * G + g) * n + a - lo;
              if (native) {
                if constexpr (bf16_cache)
                  score_rows_bf16<D>(q + ((first + r) * num_heads + h * G + g) * dim, k16 + (a - j0) * dim, b - a,
                                     scale, sc, dim);
              } else {
                dot_rows<D>(qf.data() + (r * G + g) * dim, k + (a - j0) * dim, b - a, dim, sc);
              }
            }
          }
        }, warmed == item);
        tiles.flush();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t a = starts[r] - lo, b = lens[first + r] - lo;  // this query's scores
            if (b <= a) continue;
            float* sc = scores.data() + (r * G + g) * n;
            if (soft_cap > 0.f) soft_cap_scores(sc + a, b - a, soft_cap);
            inv[r * G + g] = 1.f / exp_sum(sc + a, b - a, max_of(sc + a, b - a));
            if (native) bf16_probabilities(sc + a, p16.data() + (r * G + g) * n + a, b - a);
          }
        if ((item + 1) % chunk != 0 && item + 1 < num_items) {
          const int64_t next = runs[(item + 1) / kv_heads], next_rows = runs[(item + 1) / kv_heads + 1] - next;
          const auto [next_lo, next_hi] = span(next, next_rows, nullptr);
          if (next_hi > next_lo)
            prefetch_first({kc, vc}, tables + next * max_blocks, (item + 1) % kv_heads, kv_heads, bs, dim, next_lo,
                           next_hi);
          warmed = item + 1;
        }
        for_each_block(vc, table, h, kv_heads, bs, dim, lo, hi, {vc}, [&](int64_t j0, int64_t j1, const C* block) {
          const float* v = nullptr;
          const uint16_t* v16 = nullptr;
          if (native) {
            if constexpr (bf16_cache && !PairsOf<C>::direct) v16 = bf16_rows(block, row16.data(), (j1 - j0) * dim);
          } else {
            v = widen_rows(block, row.data(), (j1 - j0) * dim);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t a = std::max(j0, starts[r]), b = std::min(j1, lens[first + r]);
            if (a >= b) continue;
            if (native) {  // the row's G query heads share its range of keys
              const uint16_t* p = p16.data() + r * G * n + a - lo;
              float* sums = acc.data() + r * G * dim;
              if constexpr (bf16_cache && PairsOf<C>::direct)
                accumulate_group_bf16<D>(p, n, block + (a - j0) * dim, b - a, sums, G, dim, pairs);
              else if constexpr (bf16_cache)
                accumulate_group_bf16<D>(p, n, v16 + (a - j0) * dim, b - a, sums, G, dim, Bf16RowPairs{});
              continue;
            }
            for (int64_t g = 0; g < G; ++g)
              accumulate_rows<D>(scores.data() + (r * G + g) * n + a - lo, v + (a - j0) * dim, b - a, dim,
                                 acc.data() + (r * G + g) * dim);
          }
        }, true);  // the K pass prefetched V's blocks
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + ((first + r) * num_heads + h * G) * dim;
        const bool empty = starts[r] >= lens[first + r];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < dim; ++d)
            store(empty ? 0.f : acc[(r * G + g) * dim + (native ? pair_slot(d) : d)] * inv[r * G + g] * out_mul,
                  o + g * dim + d);
      }
    }
  }
}

// decode() with the common head sizes' loops unrolled.
template <typename T, typename C>
void decode_dims(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* lens, T* out,
                 int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t bs, int64_t head_dim,
                 int64_t max_blocks, float scale, float out_mul, float soft_cap, int64_t window) {
  auto run = [&](auto kernel) {
    kernel(q, kc, vc, tables, lens, out, num_seqs, num_heads, kv_heads, bs, head_dim, max_blocks, scale, out_mul,
           soft_cap, window);
  };
  if (head_dim == 32) run(decode<T, C, 32>);
  else if (head_dim == 64) run(decode<T, C, 64>);
  else if (head_dim == 128) run(decode<T, C, 128>);
  else run(decode<T, C, 0>);
}

// decode() over a layer's cache of any kind: an fp8 one's scales (and kFp8Unit) folded into the query's scale (K)
// and the output (V).
template <typename T>
void decode_any(const T* q, const KvCache& kv, const int64_t* tables, const int64_t* lens, T* out, int64_t num_seqs,
                int64_t num_heads, int64_t kv_heads, int64_t bs, int64_t head_dim, int64_t max_blocks, float scale,
                float soft_cap, int64_t window) {
  auto run = [&](auto* cache) {
    using C = std::remove_pointer_t<decltype(cache)>;
    const C *kc = static_cast<const C*>(kv.k), *vc = static_cast<const C*>(kv.v);
    if constexpr (kIsFp8<C>)
      decode_dims<T, C>(q, kc, vc, tables, lens, out, num_seqs, num_heads, kv_heads, bs, head_dim, max_blocks,
                        scale * kv.k_scale * kFp8Unit<C>, kv.v_scale * kFp8Unit<C>, soft_cap, window);
    else
      decode_dims<T, C>(q, kc, vc, tables, lens, out, num_seqs, num_heads, kv_heads, bs, head_dim, max_blocks, scale,
                        1.f, soft_cap, window);
  };
  if (kv.kind == kCacheE4m3) run(static_cast<Fp8E4m3*>(nullptr));
  else if (kv.kind == kCacheE5m2) run(static_cast<Fp8E5m2*>(nullptr));
  else run(static_cast<T*>(nullptr));
}

}  // namespace pagedserve
