// A tensor-parallel group's all-reduce inside a C++ step, through the shared memory that
// workers/shm_communicator.py maps: the same rounds, slots, round counters and FIFO wake-ups, sums in rank order
// with the same roundings, so the C++ layers and the Python collectives take turns on one group and every rank gets
// bit-identical sums.
#pragma once
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "layer_ops.h"

namespace pagedserve {

// Round k: each rank copies its piece into slot (k % 2, rank), publishes k + 1 in its counter and writes a byte to
// every peer's FIFO; it then polls the peers' counters for up to spin_ns (yielding the CPU), and past that blocks
// reading its own FIFO, whose bytes only wake it. `round` is this rank's count of rounds, shared with the Python
// communicator (a one-element int64 array it also counts in).
struct ShmGroup {
  uint8_t* slots = nullptr;  // slot (buffer, rank) at (buffer * size + rank) * slot_bytes
  int64_t slot_bytes = 0;
  int64_t* counters = nullptr;
  int64_t* round = nullptr;
  std::vector<int64_t> fifos;
  int64_t rank = 0, size = 1, spin_ns = 0;
};

namespace tp_detail {

inline int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

inline bool peers_published(const ShmGroup& g, int64_t round) {
  for (int64_t r = 0; r < g.size; ++r)
    if (r != g.rank && __atomic_load_n(g.counters + r, __ATOMIC_ACQUIRE) < round) return false;
  return true;
}

inline void wait_for_peers(const ShmGroup& g, int64_t round) {
  const int64_t deadline = now_ns() + g.spin_ns;
  while (!peers_published(g, round)) {
    if (now_ns() < deadline) {
      sched_yield();
      continue;
    }
    char drained[4096];
    if (read(int(g.fifos[g.rank]), drained, sizeof drained) < 0 && errno != EINTR)
      throw std::runtime_error(std::string("tensor-parallel all-reduce: reading the wake-up FIFO failed: ") +
                               std::strerror(errno));
  }
}

// Publish `count` elements of x as this rank's piece of the next round; the round's slots once every peer has
// published its own.
template <typename T>
void exchange(const ShmGroup& g, const T* x, int64_t count) {
  const int64_t buffer = *g.round % 2;
  std::memcpy(g.slots + (buffer * g.size + g.rank) * g.slot_bytes, x, count * sizeof(T));
  const int64_t round = ++*g.round;
  __atomic_store_n(g.counters + g.rank, round, __ATOMIC_RELEASE);
  const char wake = 1;
  for (int64_t r = 0; r < g.size; ++r)
    if (r != g.rank && write(int(g.fifos[r]), &wake, 1) < 0 && errno != EAGAIN && errno != EINTR)
      throw std::runtime_error(std::string("tensor-parallel all-reduce: waking a peer failed: ") +
                               std::strerror(errno));
  wait_for_peers(g, round);
}

}  // namespace tp_detail

// x [n] summed over the group in place, added in rank order in float32 and rounded once to T (what
// shm_communicator's _sum_in_rank_order computes), in pieces of a slot.
template <typename T>
void all_reduce(const ShmGroup& g, T* x, int64_t n) {
  const int64_t piece = g.slot_bytes / int64_t(sizeof(T));
  for (int64_t start = 0; start < n; start += piece) {
    const int64_t count = std::min(piece, n - start);
    tp_detail::exchange(g, x + start, count);
    const int64_t buffer = (*g.round - 1) % 2;
    std::vector<const T*> parts(g.size);
    for (int64_t r = 0; r < g.size; ++r)
      parts[r] = reinterpret_cast<const T*>(g.slots + (buffer * g.size + r) * g.slot_bytes);
    for (int64_t i = 0; i < count; ++i) {
      float total = widen(parts[0][i]);
      for (int64_t r = 1; r < g.size; ++r) total += widen(parts[r][i]);
      x[start + i] = round_to<T>(total);
    }
  }
}

// x [n] of rank src copied to every other rank's x (the others publish nothing), in pieces of a slot: a pipeline
// stage's hand-off to the next, or the driver's tokens to every rank.
template <typename T>
void broadcast(const ShmGroup& g, T* x, int64_t n, int64_t src) {
  const int64_t piece = g.slot_bytes / int64_t(sizeof(T));
  for (int64_t start = 0; start < n; start += piece) {
    const int64_t count = std::min(piece, n - start);
    tp_detail::exchange(g, x + start, g.rank == src ? count : 0);
    if (g.rank != src)
      std::memcpy(x + start, g.slots + (((*g.round - 1) % 2) * g.size + src) * g.slot_bytes, count * sizeof(T));
  }
}

// x [rows, width], this rank's columns, beside every other rank's in out [rows, size * width] (rank r's at columns
// r * width): the vocabulary-parallel LM head's logits, whole on every rank. In pieces of whole rows that fit a slot.
template <typename T>
void all_gather_columns(const ShmGroup& g, const T* x, int64_t rows, int64_t width, T* out) {
  const int64_t row_bytes = width * int64_t(sizeof(T)), piece = g.slot_bytes / row_bytes;
  if (piece < 1) throw std::invalid_argument("tensor-parallel all-gather: a row is wider than a slot");
  for (int64_t start = 0; start < rows; start += piece) {
    const int64_t count = std::min(piece, rows - start);
    tp_detail::exchange(g, x + start * width, count * width);
    const int64_t buffer = (*g.round - 1) % 2;
    for (int64_t r = 0; r < g.size; ++r) {
      const uint8_t* part = g.slots + (buffer * g.size + r) * g.slot_bytes;
      for (int64_t m = 0; m < count; ++m)
        std::memcpy(out + ((start + m) * g.size + r) * width, part + m * row_bytes, row_bytes);
    }
  }
}

// A row-parallel product's partial sums y [M, N] reduced over the group, then its bias (held whole by every rank)
// added once, rounded to T: RowParallelLinear's order.
template <typename T>
void reduce_rows(const ShmGroup& g, T* y, const T* bias, int64_t M, int64_t N) {
  all_reduce(g, y, M * N);
  if (!bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = round_to<T>(widen(y[m * N + n]) + widen(bias[n]));
}

}  // namespace pagedserve
