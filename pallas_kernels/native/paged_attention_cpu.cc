// Paged attention for XLA:CPU, an XLA FFI custom call (pallas_kernels/native_cpu.py builds, loads
// and calls it for decode and prefill; the plain-jnp references in paged_attention.py and
// paged_prefill.py are its oracles).
//
// Why native: on XLA:CPU a dot cannot read the pool through a block table, so the XLA paths gather
// every page into a copy and then run small batched dots over it. This kernel reads each live K/V
// row where it lies in the pool.
//
// Shapes: q f32[T, Hq, D], one query row per token; k_pool, v_pool [L, Hkv, N, Bs, D] of f32, or
// u16 holding bfloat16 bits (jpaged.models.kv_pool.storage_dtype); block_tables i32[S, M];
// row_seq i32[T]: the sequence of each row; row_keys i32[T]: how many of its sequence's first
// tokens the row attends to (decode: the context length; prefill: its position + 1, causal;
// 0: a padded row, whose output is zeros); layer i32[1]; out f32[T, Hq, D]. Token t of sequence s
// lies in block block_tables[s, t / Bs], slot t % Bs. Only those first tokens are read, so stale
// slots (possibly NaN) never reach an output. Key counts are clamped to M * Bs, and sequence ids,
// block ids and the layer into range, so no table can make the kernel read outside its inputs.
//
// Work items are (row, KV head) pairs, spread over XLA's intra-op thread pool. Each item keeps one
// online-softmax state per query head of its group, a page at a time (float32 throughout).

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;

// Element i of a K/V row as float32 (bfloat16 bits: shifted into the high half, exact).
inline float Value(const float* row, int64_t i) { return row[i]; }
inline float Value(const uint16_t* row, int64_t i) {
  return std::bit_cast<float>(static_cast<uint32_t>(row[i]) << 16);
}

// Asks for the next page's K and V while this one is computed: pages lie at random places in the
// pool, so the hardware prefetcher cannot guess the next one (each would start with a cache miss).
template <typename T>
inline void Prefetch(const T* k_pool, const T* v_pool, int64_t head_base, int64_t block, int64_t num_blocks,
                     int64_t elements) {
  block = std::clamp<int64_t>(block, 0, num_blocks - 1);
  const char* k = reinterpret_cast<const char*>(k_pool + (head_base + block) * elements);
  const char* v = reinterpret_cast<const char*>(v_pool + (head_base + block) * elements);
  for (int64_t byte = 0; byte < elements * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(k + byte);
    __builtin_prefetch(v + byte);
  }
}

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* row_seq;
  const int32_t* row_keys;
  float* out;
  int64_t num_seqs, num_q_heads, num_kv_heads, num_blocks, block_size, head_dim, max_blocks, layer;
  float scale;
};

// One (query row r, KV head h) item: all query heads of h's group over the row's keys. kDim is
// the head dim when known at compile time (its loops then unroll and keep `acc` in registers),
// 0 for any other (read from the problem).
template <typename T, int kDim>
void AttendOne(const Problem& p, int64_t r, int64_t h) {
  const int64_t group = p.num_q_heads / p.num_kv_heads, bs = p.block_size;
  const int64_t d = kDim > 0 ? kDim : p.head_dim;
  const int64_t length = std::clamp<int64_t>(p.row_keys[r], 0, p.max_blocks * bs);
  const int32_t* table = p.tables + std::clamp<int64_t>(p.row_seq[r], 0, p.num_seqs - 1) * p.max_blocks;
  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
  const int64_t head_base = (p.layer * p.num_kv_heads + h) * p.num_blocks;  // row of block 0
  for (int64_t g = 0; g < group; ++g) {
    const int64_t offset = (r * p.num_q_heads + h * group + g) * d;
    alignas(64) float q[kMaxHeadDim], acc[kMaxHeadDim];
    for (int64_t i = 0; i < d; ++i) q[i] = p.q[offset + i] * p.scale, acc[i] = 0.0f;
    float scores[kMaxBlockSize];
    float running_max = -INFINITY, denom = 0.0f;
    for (int64_t start = 0; start < length; start += bs) {
      const int64_t block = std::clamp<int64_t>(table[start / bs], 0, p.num_blocks - 1);
      const T* k_block = k_pool + (head_base + block) * bs * d;  // slot 0 of the block
      const T* v_block = v_pool + (head_base + block) * bs * d;
      const int64_t live = std::min(bs, length - start);
      if (start + bs < length) Prefetch(k_pool, v_pool, head_base, table[start / bs + 1], p.num_blocks, bs * d);
      float page_max = running_max;
      for (int64_t s = 0; s < live; ++s) {
        const T* k = k_block + s * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += q[i] * Value(k, i);
        scores[s] = dot;
        page_max = std::max(page_max, dot);
      }
      const float correction = std::exp(running_max - page_max);  // exp(-inf) = 0 on the first page
      float page_sum = 0.0f;
#pragma omp simd reduction(+ : page_sum)
      for (int64_t s = 0; s < live; ++s) {
        scores[s] = std::exp(scores[s] - page_max);
        page_sum += scores[s];
      }
      denom = denom * correction + page_sum;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
      for (int64_t s = 0; s < live; ++s) {
        const T* v = v_block + s * d;
        const float weight = scores[s];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] += weight * Value(v, i);
      }
      running_max = page_max;
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int64_t i = 0; i < d; ++i) p.out[offset + i] = acc[i] * inv;
  }
}

template <typename T>
void Attend(const Problem& p, int64_t r, int64_t h) {
  switch (p.head_dim) {
    case 64:
      return AttendOne<T, 64>(p, r, h);
    case 128:
      return AttendOne<T, 128>(p, r, h);
    default:
      return AttendOne<T, 0>(p, r, h);
  }
}

// Claims items from a shared counter until none is left. Held by shared_ptr: a pool task that
// starts after the call has returned finds no item left and touches nothing else.
struct Work {
  Problem problem;
  bool bf16;
  int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t item = next.fetch_add(1); item < total; item = next.fetch_add(1)) {
      const int64_t r = item / problem.num_kv_heads, h = item % problem.num_kv_heads;
      if (bf16) {
        Attend<uint16_t>(problem, r, h);
      } else {
        Attend<float>(problem, r, h);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                              ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> row_seq,
                              ffi::Buffer<ffi::S32> row_keys, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto kd = k_pool.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || td[0] < 1 || row_seq.element_count() != qd[0] ||
      row_keys.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: expected q [T, Hq, D], pools [L, Hkv, N, Bs, D], "
                                       "block_tables [S >= 1, M], row_seq and row_keys [T]");
  }
  const bool bf16 = k_pool.element_type() == ffi::DataType::U16;
  if ((!bf16 && k_pool.element_type() != ffi::DataType::F32) || v_pool.element_type() != k_pool.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: pools must both be f32 or both u16 (bf16 bits)");
  }
  if (kd[4] != qd[2] || kd[4] > kMaxHeadDim || kd[3] > kMaxBlockSize || qd[1] % kd[1] != 0) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: head_dim/block_size/heads do not fit");
  }
  auto work = std::make_shared<Work>();
  work->problem = Problem{q.typed_data(), k_pool.untyped_data(), v_pool.untyped_data(), block_tables.typed_data(),
                          row_seq.typed_data(), row_keys.typed_data(), out->typed_data(), td[0], qd[1], kd[1], kd[2],
                          kd[3], kd[4], td[1], std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1), scale};
  work->bf16 = bf16;
  work->total = qd[0] * kd[1];
  // Helpers on the other pool threads; this thread works too, then waits for items others claimed.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()          // k_pool
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_seq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_keys
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("scale"));
