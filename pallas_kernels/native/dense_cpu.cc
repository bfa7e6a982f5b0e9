// Small-M matrix multiply for XLA:CPU over weights packed once into 16-column panels, an XLA FFI
// custom call (pallas_kernels/native_dense_cpu.py packs the weights, builds, loads and calls it;
// `jnp.dot` in float32 is its oracle).
//
// Why native: a decode step multiplies 8-64 activation rows by every weight matrix of the model, so
// it is bound by reading the weights, and reads them best prepacked (as vLLM's CPU build does with
// oneDNN, docs/ARCHITECTURE.md, "CPU path"). Here each 16-column panel of W is one contiguous
// stream (read once per call from memory, then from cache for the other row tiles), and a register
// tile of kRows x kPanels accumulators does kRows * kPanels multiply-adds per kPanels vector loads.
//
// Shapes: out f32[M, N] = x [M, K] . W [K, N] (+ bias f32[N]; f32[0]: no bias), computed for the
// first rows_in_use rows (s32[1], clamped to [0, M]); the rows after it are zeros. A model step's
// rows past its real tokens are padding to a token bucket: up to a third of the rows.
//   float32:  x f32[M, K],  w f32[P, K, 16]       w[p, k, j]    = W[k, 16p + j]
//   bfloat16: x u16[M, Kp], w u16[P, Kp/2, 16, 2] w[p, i, j, t] = W[2i + t, 16p + j]  (bf16 bits)
// P = ceil(N / 16); columns past N and (bf16) the rows of zeros that pad K to Kp (a multiple of 32)
// are zeros. bf16 pairs along K are the operand layout of both bf16 dot-product instructions,
// float32 accumulation: AMX's tdpbf16ps, whose B tile is 16 pair-rows of one panel (1 KiB,
// contiguous here) and whose A tile is 16 rows x 32 K of x; and AVX-512 BF16's vdpbf16ps (lane j
// += a[2j] * b[2j] + a[2j+1] * b[2j+1]). Without either, the pairs are widened to float32 in
// registers, exactly. Attribute `bf16_path`: 0 the best the CPU has (AMX > AVX-512 BF16 > widen),
// 1 at most AVX-512 BF16, 2 widen (1 and 2 let the tests check every path on one machine).
// Work items (groups of kPanels panels, all rows) are spread over XLA's intra-op thread pool, for
// products of at least kSerialMacs multiply-adds.
// Why AMX: on this generation vdpbf16ps runs at the float32 FMA's rate (64 flops per cycle), so
// bf16 would only halve the weight bytes; XLA's own bf16 dots use AMX and win from 16 rows up.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // columns per panel: one 512-bit vector of float32
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;  // float32 lanes of one vector register
constexpr int kRows = 8;       // rows per register tile
constexpr int kPanels = 3;     // panels per register tile: 8 x 3 = 24 accumulators of 32 vector registers
#else
// AVX2: a panel is two 256-bit registers, of 16; 6 rows x 1 panel = 12 accumulators + 2 loads + 1
// broadcast (BLIS's 6 x 16 Haswell tile). A 512-bit vector type would have no machine mode here:
// GCC would keep every such vector in memory.
constexpr int kVecLanes = 8;
constexpr int kRows = 6;
constexpr int kPanels = 1;
#endif
constexpr int kHalves = kLanes / kVecLanes;  // vector registers per panel row
// Products smaller than this (M x K x N; 320 KB of float32 weights at M = 1) run on one thread:
// waking a helper and waiting for it costs more than the helper saves. Measured on a 2-core
// Sapphire Rapids: the draft model's decode (hidden 128, products up to 128 x 512) ran 5 steps in
// 0.82 ms instead of 1.0 ms; the target's 192 x 512 products (98k) stay split, as serial they made
// its decode step 0.2 ms slower (its 9.6 MB of weights stream from memory, and two cores stream
// them faster; the draft's layers stay in cache).
constexpr int64_t kSerialMacs = 80 * 1024;

// GCC/Clang vector types of one register: kVecLanes float32 (or uint32) lanes.
typedef float F32xV __attribute__((vector_size(kVecLanes * 4)));
typedef float F32xVUnaligned __attribute__((vector_size(kVecLanes * 4), aligned(4)));
typedef uint32_t U32xVUnaligned __attribute__((vector_size(kVecLanes * 4), aligned(4)));
typedef uint32_t U32xV __attribute__((vector_size(kVecLanes * 4)));

inline float Bf16ToF32(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, 4);
  return out;
}

struct Gemm {
  const void* x;
  const void* w;
  const float* bias;  // nullptr: no bias
  float* out;
  int64_t m, k, n, panels;  // k: x's row length (bf16: Kp, a multiple of 32)
};

// One row of one panel (+ bias) into out, columns past N dropped: values (a scratch copy, the bias
// is added in place) holds columns [col, col + 16).
inline void StoreRow(const Gemm& g, float* values, int64_t row, int64_t col) {
  const int64_t width = std::min<int64_t>(kLanes, g.n - col);
  if (g.bias != nullptr) {
    float bias[kLanes] = {};
    std::memcpy(bias, g.bias + col, width * sizeof(float));
    for (int j = 0; j < kLanes; ++j) values[j] += bias[j];  // a fixed 16: one or two vector adds
  }
  std::memcpy(g.out + row * g.n + col, values, width * sizeof(float));
}

// acc[r][p * kHalves + h]: row r, panel p, columns [h * kVecLanes, + kVecLanes) of the panel.
template <int R, int P>
inline void Store(const Gemm& g, F32xV (&acc)[R][P * kHalves], int64_t row, int64_t panel) {
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      float values[kLanes];
      std::memcpy(values, &acc[r][p * kHalves], sizeof(values));
      StoreRow(g, values, row + r, (panel + p) * kLanes);
    }
  }
}

// One R x (P * 16) tile of float32 out over all of K: x rows [row, row + R), panels [panel, + P).
template <int R, int P>
void TileF32(const Gemm& g, int64_t row, int64_t panel) {
  constexpr int V = P * kHalves;  // vector registers per tile row
  F32xV acc[R][V] = {};
  const float* x = static_cast<const float*>(g.x) + row * g.k;
  const float* w = static_cast<const float*>(g.w) + panel * g.k * kLanes;
  for (int64_t i = 0; i < g.k; ++i) {
    F32xV wv[V];
#pragma GCC unroll 6
    for (int v = 0; v < V; ++v) {
      wv[v] = *reinterpret_cast<const F32xVUnaligned*>(w + ((v / kHalves) * g.k + i) * kLanes + v % kHalves * kVecLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * g.k + i];
#pragma GCC unroll 6
      for (int v = 0; v < V; ++v) acc[r][v] += wv[v] * xv;
    }
  }
  Store<R, P>(g, acc, row, panel);
}

// The same tile from bf16 x and pair-packed bf16 W. kDot: vdpbf16ps; else widen each pair to two
// float32 vectors (even K rows are the low halves of the 32-bit lanes, odd rows the high halves).
template <int R, int P, bool kDot>
void TileBf16(const Gemm& g, int64_t row, int64_t panel) {
  constexpr int V = P * kHalves;  // vector registers per tile row
  F32xV acc[R][V] = {};
  const int64_t pairs = g.k / 2;
  const uint16_t* x = static_cast<const uint16_t*>(g.x) + row * g.k;
  const uint16_t* w = static_cast<const uint16_t*>(g.w) + panel * pairs * 2 * kLanes;
  for (int64_t i = 0; i < pairs; ++i) {
    U32xV wv[V];  // each uint32 lane: the bf16 pair (K rows 2i, 2i + 1) of one column
#pragma GCC unroll 6
    for (int v = 0; v < V; ++v) {
      wv[v] = *reinterpret_cast<const U32xVUnaligned*>(w + ((v / kHalves) * pairs + i) * 2 * kLanes + v % kHalves * 2 * kVecLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = x + r * g.k + 2 * i;
      if constexpr (kDot) {
#if defined(__AVX512BF16__)
        uint32_t pair;
        std::memcpy(&pair, xr, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = (F32xV)_mm512_dpbf16_ps((__m512)acc[r][v], (__m512bh)wv[v], xv);
#endif
      } else {
        const float x0 = Bf16ToF32(xr[0]), x1 = Bf16ToF32(xr[1]);
#pragma GCC unroll 6
        for (int v = 0; v < V; ++v) {
          acc[r][v] += (F32xV)(wv[v] << 16) * x0;
          acc[r][v] += (F32xV)(wv[v] & 0xFFFF0000u) * x1;
        }
      }
    }
  }
  Store<R, P>(g, acc, row, panel);
}

#if defined(__AMX_BF16__)
// Linux hands out AMX's tile state only on request, once per process.
bool AmxPermitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return permitted;
}

// Tiles 0..P-1: C (rows x 16 f32), tile 3: A (rows x 32 bf16 of x), tiles 4..6: B (16 pair-rows x 16
// columns x 2). The configuration is per thread and other code may change it: set on every use.
void ConfigureAmx(int rows) {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = t < 4 ? rows : 16;
  _tile_loadconfig(&config);
}

// One rows x (P * 16) tile of out (rows <= 16, tiles configured for `rows`) over all of K.
template <int P>
void TileAmx(const Gemm& g, int64_t row, int rows, int64_t panel) {
  const int64_t pairs = g.k / 2;
  const uint16_t* x = static_cast<const uint16_t*>(g.x) + row * g.k;
  const uint16_t* w = static_cast<const uint16_t*>(g.w) + panel * pairs * 2 * kLanes;
  _tile_zero(0);
  if constexpr (P > 1) _tile_zero(1);
  if constexpr (P > 2) _tile_zero(2);
  for (int64_t i = 0; i < pairs; i += 16) {  // 32 K values a step
    _tile_loadd(3, x + 2 * i, g.k * 2);
    _tile_loadd(4, w + i * 2 * kLanes, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (P > 1) {
      _tile_loadd(5, w + (pairs + i) * 2 * kLanes, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (P > 2) {
      _tile_loadd(6, w + (2 * pairs + i) * 2 * kLanes, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  alignas(64) float block[P][16][kLanes];
  _tile_stored(0, block[0], 64);
  if constexpr (P > 1) _tile_stored(1, block[1], 64);
  if constexpr (P > 2) _tile_stored(2, block[2], 64);
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < P; ++p) StoreRow(g, block[p][r], row + r, (panel + p) * kLanes);
  }
}

// All rows of panels [panel, panel + P) in tiles of 16 rows.
template <int P>
void GroupAmx(const Gemm& g, int64_t panel, int& configured) {
  for (int64_t row = 0; row < g.m; row += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, g.m - row));
    if (rows != configured) ConfigureAmx(configured = rows);
    TileAmx<P>(g, row, rows, panel);
  }
}
#endif

enum class Kind { kF32, kBf16Amx, kBf16Dot, kBf16Widen };

template <Kind kKind, int R, int P>
void Tile(const Gemm& g, int64_t row, int64_t panel) {
  if constexpr (kKind == Kind::kF32) {
    TileF32<R, P>(g, row, panel);
  } else {
    TileBf16<R, P, kKind == Kind::kBf16Dot>(g, row, panel);
  }
}

// All rows of panels [panel, panel + P): full kRows tiles, then one tile of the leftover rows.
// The group's panels (K x P x 16 values) stay in cache while the row tiles pass over them.
template <Kind kKind, int P>
void Group(const Gemm& g, int64_t panel) {
  int64_t row = 0;
  for (; row + kRows <= g.m; row += kRows) Tile<kKind, kRows, P>(g, row, panel);
  switch (g.m - row) {
    case 0: return;
    case 1: return Tile<kKind, 1, P>(g, row, panel);
    case 2: return Tile<kKind, 2, P>(g, row, panel);
    case 3: return Tile<kKind, 3, P>(g, row, panel);
    case 4: return Tile<kKind, 4, P>(g, row, panel);
    case 5: return Tile<kKind, 5, P>(g, row, panel);
    case 6: return Tile<kKind, 6, P>(g, row, panel);
    default: return Tile<kKind, 7, P>(g, row, panel);
  }
}

template <Kind kKind>
void RunGroup(const Gemm& g, int64_t group) {
  const int64_t panel = group * kPanels;
  switch (std::min<int64_t>(kPanels, g.panels - panel)) {
    case 3: return Group<kKind, 3>(g, panel);
    case 2: return Group<kKind, 2>(g, panel);
    default: return Group<kKind, 1>(g, panel);
  }
}

// Claims panel groups from a shared counter until none is left. Held by shared_ptr: a pool task
// that starts after the call has returned finds no group left and touches nothing else.
struct Work {
  Gemm gemm;
  Kind kind;
  int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    int configured = 0;  // AMX: the rows the tiles are configured for on this thread (0: not yet)
    for (int64_t group = next.fetch_add(1); group < total; group = next.fetch_add(1)) {
      if (kind == Kind::kBf16Amx) {
#if defined(__AMX_BF16__)
        const int64_t panel = group * kPanels;
        switch (std::min<int64_t>(kPanels, gemm.panels - panel)) {
          case 3: GroupAmx<3>(gemm, panel, configured); break;
          case 2: GroupAmx<2>(gemm, panel, configured); break;
          default: GroupAmx<1>(gemm, panel, configured);
        }
#endif
      } else if (kind == Kind::kF32) {
        RunGroup<Kind::kF32>(gemm, group);
      } else if (kind == Kind::kBf16Dot) {
        RunGroup<Kind::kBf16Dot>(gemm, group);
      } else {
        RunGroup<Kind::kBf16Widen>(gemm, group);
      }
      done.fetch_add(1, std::memory_order_release);
    }
#if defined(__AMX_BF16__)
    if (configured) _tile_release();
#endif
  }
};

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> bias,
                     ffi::Buffer<ffi::S32> rows_in_use, ffi::ResultBuffer<ffi::F32> out, int32_t bf16_path) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out->dimensions();
  const bool bf16 = w.element_type() == ffi::DataType::U16;
  if (xd.size() != 2 || od.size() != 2 || od[0] != xd[0] || wd.size() != (bf16 ? 4u : 3u) ||
      wd[0] != (od[1] + kLanes - 1) / kLanes || wd[2] != kLanes) {
    return ffi::Error::InvalidArgument("dense_cpu: expected x [M, K], w [ceil(N/16), K, 16] (f32) or "
                                       "[ceil(N/16), K/2, 16, 2] (u16), out [M, N]");
  }
  if (x.element_type() != w.element_type() || (!bf16 && w.element_type() != ffi::DataType::F32) ||
      (bf16 ? (wd[3] != 2 || 2 * wd[1] != xd[1] || xd[1] % 32 != 0) : wd[1] != xd[1])) {
    return ffi::Error::InvalidArgument("dense_cpu: x and w must both be f32, or both u16 (bf16 bits) with "
                                       "K a multiple of 32, and agree on K");
  }
  if (bias.element_count() != 0 && bias.element_count() != od[1]) {
    return ffi::Error::InvalidArgument("dense_cpu: bias must be [N] or [0] (none)");
  }
  if (rows_in_use.element_count() != 1) {
    return ffi::Error::InvalidArgument("dense_cpu: rows_in_use must hold one value");
  }
  // Rows past rows_in_use are a step's padding: zeros, not computed (the work follows the real rows).
  const int64_t m = std::clamp<int64_t>(rows_in_use.typed_data()[0], 0, xd[0]);
  std::memset(out->typed_data() + m * od[1], 0, sizeof(float) * (xd[0] - m) * od[1]);
  auto work = std::make_shared<Work>();
  work->gemm = Gemm{x.untyped_data(), w.untyped_data(), bias.element_count() ? bias.typed_data() : nullptr,
                    out->typed_data(), m, xd[1], od[1], wd[0]};
  work->kind = Kind::kF32;
  if (bf16) {
    work->kind = Kind::kBf16Widen;
#if defined(__AVX512BF16__)
    if (bf16_path <= 1) work->kind = Kind::kBf16Dot;
#endif
#if defined(__AMX_BF16__)
    if (bf16_path == 0 && AmxPermitted()) work->kind = Kind::kBf16Amx;
#endif
  }
  work->total = (wd[0] + kPanels - 1) / kPanels;
  if (m == 0) return ffi::Error::Success();
  // Helpers on the other pool threads; this thread works too, then waits for groups others claimed.
  // A product under kSerialMacs multiply-adds runs on this thread alone (see kSerialMacs).
  const int64_t helpers =
      m * xd[1] * od[1] < kSerialMacs ? 0 : std::min<int64_t>(pool.num_threads(), work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DenseCpu, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // w, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows_in_use, [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("bf16_path"));
