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
// Head dims of 32, 64 and 128 take a vector path where the CPU has AVX-512 or AVX2 (`AttendVec`):
// a vector of keys' dot products at a time (vector multiplies, then one shuffle tree that sums
// every key's lanes at once, `SumEach`), the page's exps a vector at a time (`ExpV`), and the
// value rows summed into two accumulator sets. The scalar path (`AttendOne`, any head dim) sums
// each dot product's lanes one after another (the compiler may not reorder float adds) and calls
// the scalar expf: at head dim 32 a (query head, key) pair took about 40 cycles there, and at 250
// tokens of context the 4 extra query rows of a verify step added a fifth to a decode step's time.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// What the (query row r, KV head h) item reads: the row's keys, its sequence's block table, and
// the pool rows of the layer's head h.
template <typename T>
struct Item {
  int64_t group, bs, length;  // query heads per KV head, block size, keys the row attends to
  const int32_t* table;
  const T* k_pool;
  const T* v_pool;
  int64_t head_base;   // the pool row of block 0 at (layer, h)
  int64_t num_blocks;  // N

  Item(const Problem& p, int64_t r, int64_t h)
      : group(p.num_q_heads / p.num_kv_heads),
        bs(p.block_size),
        length(std::clamp<int64_t>(p.row_keys[r], 0, p.max_blocks * p.block_size)),
        table(p.tables + std::clamp<int64_t>(p.row_seq[r], 0, p.num_seqs - 1) * p.max_blocks),
        k_pool(static_cast<const T*>(p.k)),
        v_pool(static_cast<const T*>(p.v)),
        head_base((p.layer * p.num_kv_heads + h) * p.num_blocks),
        num_blocks(p.num_blocks) {}

  // The page of keys [start, start + bs) at head dim d: its block's K and V rows (slot 0) and how
  // many of its keys the row reads.
  struct Page {
    const T* k;
    const T* v;
    int64_t live;
  };
  Page PageAt(int64_t start, int64_t d) const {
    const int64_t block = std::clamp<int64_t>(table[start / bs], 0, num_blocks - 1);
    return {k_pool + (head_base + block) * bs * d, v_pool + (head_base + block) * bs * d,
            std::min(bs, length - start)};
  }

  // Asks for the next page's K and V, if the row reads one, while the page at `start` is computed.
  void PrefetchNext(int64_t start, int64_t d) const {
    if (start + bs < length) Prefetch(k_pool, v_pool, head_base, table[start / bs + 1], num_blocks, bs * d);
  }
};

// One (query row r, KV head h) item: all query heads of h's group over the row's keys. kDim is
// the head dim when known at compile time (its loops then unroll and keep `acc` in registers),
// 0 for any other (read from the problem).
template <typename T, int kDim>
void AttendOne(const Problem& p, int64_t r, int64_t h) {
  const Item<T> item(p, r, h);
  const int64_t group = item.group, length = item.length, d = kDim > 0 ? kDim : p.head_dim;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t offset = (r * p.num_q_heads + h * group + g) * d;
    alignas(64) float q[kMaxHeadDim], acc[kMaxHeadDim];
    for (int64_t i = 0; i < d; ++i) q[i] = p.q[offset + i] * p.scale, acc[i] = 0.0f;
    float scores[kMaxBlockSize];
    float running_max = -INFINITY, denom = 0.0f;
    for (int64_t start = 0; start < length; start += item.bs) {
      const auto [k_block, v_block, live] = item.PageAt(start, d);
      item.PrefetchNext(start, d);
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

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;  // float32 lanes of one vector register
#else
constexpr int kVecLanes = 8;
#endif
typedef float F32xV __attribute__((vector_size(kVecLanes * 4)));
typedef float F32xVUnaligned __attribute__((vector_size(kVecLanes * 4), aligned(4)));
typedef int32_t I32xV __attribute__((vector_size(kVecLanes * 4)));
typedef uint32_t U32xV __attribute__((vector_size(kVecLanes * 4)));
typedef uint16_t U16xVUnaligned __attribute__((vector_size(kVecLanes * 2), aligned(2)));

inline F32xV Load(const float* row) { return *reinterpret_cast<const F32xVUnaligned*>(row); }
inline F32xV Load(const uint16_t* row) {  // bfloat16 bits into the high halves: exact
  return (F32xV)(__builtin_convertvector(*reinterpret_cast<const U16xVUnaligned*>(row), U32xV) << 16);
}

inline float SumLanes(F32xV v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

// 0, 1, ..., kVecLanes - 1.
inline F32xV Iota() {
  F32xV out;
  for (int j = 0; j < kVecLanes; ++j) out[j] = static_cast<float>(j);
  return out;
}

inline float MaxLanes(F32xV v) {
  float lanes[kVecLanes];
  std::memcpy(lanes, &v, sizeof(v));
  return *std::max_element(lanes, lanes + kVecLanes);
}

// Lane j of the result: the sum of v[j]'s lanes. A tree of kVecLanes - 1 shuffle pairs and adds,
// each level halving the partial sums per vector and doubling the vectors' count of keys (their
// order kept): about 3 operations per sum where summing each vector alone takes 9 in a chain.
inline F32xV SumEach(F32xV (&v)[kVecLanes]) {
#define JPAGED_COMBINE(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
#if defined(__AVX512F__)
  for (int j = 0; j < 8; ++j) {
    v[j] = JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int j = 0; j < 2; ++j) {
    v[j] = JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return JPAGED_COMBINE(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         JPAGED_COMBINE(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  for (int j = 0; j < 4; ++j) {
    v[j] = JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int j = 0; j < 2; ++j) {
    v[j] = JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           JPAGED_COMBINE(v[2 * j], v[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return JPAGED_COMBINE(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) + JPAGED_COMBINE(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
#undef JPAGED_COMBINE
}

// exp of each lane (x <= 0 here: scores minus their running max): 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p Cephes's degree-6 polynomial for expf (relative error about 1e-7); 0 below
// -87.3, where float32's exp leaves the normal range (and for -inf).
inline F32xV ExpV(F32xV x) {
  const I32xV underflow = x < -87.3f;  // lanes of all ones where the result is 0
  x = x < -88.0f ? F32xV{} - 88.0f : x;  // (and -inf): everything below stays finite
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (|x| < 2^22)
  const F32xV n = (x * 1.44269504088896341f + kRound) - kRound;
  const F32xV r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts: r is exact
  F32xV poly = F32xV{} + 1.9875691500e-4f;
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    poly = poly * r + c;
  }
  poly = poly * r * r + r + 1.0f;
  const I32xV bits = (I32xV)poly + (__builtin_convertvector(n, I32xV) << 23);
  return (F32xV)(bits & ~underflow);
}

// `AttendOne` for a head dim of kDim, a multiple of kVecLanes.
template <typename T, int kDim>
void AttendVec(const Problem& p, int64_t r, int64_t h) {
  constexpr int kVecs = kDim / kVecLanes;  // vector registers per K, V or q row
  const Item<T> item(p, r, h);
  const int64_t group = item.group, length = item.length;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t offset = (r * p.num_q_heads + h * group + g) * kDim;
    F32xV q[kVecs], acc[kVecs] = {}, acc_odd[kVecs] = {};  // acc_odd: the odd keys' share
    for (int v = 0; v < kVecs; ++v) q[v] = Load(p.q + offset + v * kVecLanes) * p.scale;
    alignas(64) float scores[kMaxBlockSize + kVecLanes];
    float running_max = -INFINITY, denom = 0.0f;
    for (int64_t start = 0; start < length; start += item.bs) {
      const auto [k_block, v_block, live] = item.PageAt(start, kDim);
      if (g == 0) item.PrefetchNext(start, kDim);  // (the group's later query heads find it in cache)
      // Scores a vector of kVecLanes keys at a time; keys past `live` score -inf (never read).
      F32xV max_scores = F32xV{} + running_max;
      for (int64_t first = 0; first < live; first += kVecLanes) {
        F32xV dots[kVecLanes];
        for (int j = 0; j < kVecLanes; ++j) {
          const T* k = k_block + (first + j) * kDim;
          dots[j] = F32xV{};
          if (first + j < live) {
            for (int v = 0; v < kVecs; ++v) dots[j] += q[v] * Load(k + v * kVecLanes);
          }
        }
        const F32xV page = SumEach(dots);
        const F32xV masked = Iota() < static_cast<float>(live - first) ? page : F32xV{} - INFINITY;
        *reinterpret_cast<F32xV*>(scores + first) = masked;
        max_scores = masked > max_scores ? masked : max_scores;
      }
      const float page_max = MaxLanes(max_scores);
      const float correction = std::exp(running_max - page_max);  // exp(-inf) = 0 on the first page
      F32xV sums = {};
      for (int64_t s = 0; s < live; s += kVecLanes) {
        const F32xV e = ExpV(*reinterpret_cast<F32xV*>(scores + s) - page_max);
        *reinterpret_cast<F32xV*>(scores + s) = e;
        sums += e;
      }
      denom = denom * correction + SumLanes(sums);
      for (int v = 0; v < kVecs; ++v) acc[v] *= correction, acc_odd[v] *= correction;
      int64_t s = 0;
      for (; s + 2 <= live; s += 2) {  // two keys a step into two sets: no add waits on the one before
        const T* row = v_block + s * kDim;
        for (int v = 0; v < kVecs; ++v) {
          acc[v] += scores[s] * Load(row + v * kVecLanes);
          acc_odd[v] += scores[s + 1] * Load(row + kDim + v * kVecLanes);
        }
      }
      if (s < live) {
        for (int v = 0; v < kVecs; ++v) acc[v] += scores[s] * Load(v_block + s * kDim + v * kVecLanes);
      }
      running_max = page_max;
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int v = 0; v < kVecs; ++v) {
      const F32xV out = (acc[v] + acc_odd[v]) * inv;
      std::memcpy(p.out + offset + v * kVecLanes, &out, sizeof(out));
    }
  }
}
#endif

template <typename T>
void Attend(const Problem& p, int64_t r, int64_t h) {
  switch (p.head_dim) {
#if defined(__AVX512F__) || defined(__AVX2__)
    case 32:
      return AttendVec<T, 32>(p, r, h);
    case 64:
      return AttendVec<T, 64>(p, r, h);
    case 128:
      return AttendVec<T, 128>(p, r, h);
#else
    case 64:
      return AttendOne<T, 64>(p, r, h);
    case 128:
      return AttendOne<T, 128>(p, r, h);
#endif
  }
  return AttendOne<T, 0>(p, r, h);
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
