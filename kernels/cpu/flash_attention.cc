// Flash attention forward and backward for CPUs (see flash_attention.py).
//
// Every product is C (+)= A B on 64-wide float32 tiles with A and B row-major, in registers
// (gemm below). To make that so, each call first copies the operands it multiplies into
// float32 buffers padded to whole tiles, transposed where a product needs them transposed
// (kᵀ, and in the backward qᵀ and doᵀ): O(T·D) copies for O(T²·D) products. The scores are in
// base 2 (q is scaled by scale·log2(e) in its copy), so the softmax is exp2.
//
// Forward, per query tile: s = q kᵀ tile by tile with the online softmax (running max m, sum
// l, output o rescaled as m grows); it writes o / l and lse = m + log2(l).
// Backward, per (batch, kv head) and segment of its key tiles, per query head of the group, per
// key tile j, per query tile i: sᵀ = k qᵀ, pᵀ = exp2(sᵀ - lse), dv_j += pᵀ do, dpᵀ = v doᵀ,
// dsᵀ = pᵀ (dpᵀ - delta), dk_j += dsᵀ q, dqᵀ_i += kᵀ dsᵀ (all in the transposed frame, so no
// tile is transposed).
//
// The copies are the kernels' own allocations (not XLA's): where one fails, the call returns a
// resource-exhausted error.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "common.h"

namespace jaxfuse {
namespace {

typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kV = 16;     // floats in a vector
constexpr int64_t kTile = 64;  // query and key tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = std::numeric_limits<float>::infinity();

JAXFUSE_INLINE v16 vload(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
JAXFUSE_INLINE void vstore(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// A zeroed float32 buffer aligned to 64 bytes (p is null where the allocation failed).
struct Floats {
  float* p = nullptr;
  explicit Floats(int64_t n) {
    size_t bytes = ((static_cast<size_t>(std::max<int64_t>(n, 1)) * 4 + 63) / 64) * 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (p) std::memset(p, 0, bytes);
  }
  ~Floats() { std::free(p); }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
};

// Whether every buffer was allocated.
template <typename... Buffers>
bool allocated(const Buffers&... buffers) { return ((buffers.p != nullptr) && ...); }

JAXFUSE_INLINE int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// 2**x to about 2 ulp (Cephes' exp2f polynomial); exactly 0 below -126, so a masked score
// (-inf) gives a zero probability.
JAXFUSE_INLINE float exp2_f(float x) {
  float c = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);
  float n = __builtin_floorf(c + 0.5f);
  float f = c - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  float y = p * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x < -126.0f ? 0.0f : y;
}

// Products ---------------------------------------------------------------------------------------

// C[R x 16·NV] (+)= A[R x K] B[K x 16·NV], the C block in registers.
template <int R, int NV, bool kAccumulate>
JAXFUSE_INLINE void block(int64_t K, const float* __restrict A, int64_t lda,
                          const float* __restrict B, int64_t ldb, float* __restrict C,
                          int64_t ldc) {
  v16 c[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = kAccumulate ? vload(C + r * ldc + v * kV) : v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * kV);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float a = A[r * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * kV, c[r][v]);
}

// C[M x 16·NV] (+)= A[M x K] B[K x 16·NV] in blocks of 6 rows, then 4 or 2 (M is even).
template <int NV, bool kAccumulate>
JAXFUSE_INLINE void panel(int64_t M, int64_t K, const float* A, int64_t lda, const float* B,
                          int64_t ldb, float* C, int64_t ldc) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) block<6, NV, kAccumulate>(K, A + m * lda, lda, B, ldb, C + m * ldc, ldc);
  if (M - m >= 4) {
    block<4, NV, kAccumulate>(K, A + m * lda, lda, B, ldb, C + m * ldc, ldc);
    m += 4;
  }
  if (M - m >= 2) block<2, NV, kAccumulate>(K, A + m * lda, lda, B, ldb, C + m * ldc, ldc);
}

// C[M x N] (+)= A[M x K] B[K x N], row-major with leading dimensions lda, ldb, ldc; M a
// multiple of 2, N of 16.
template <bool kAccumulate>
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc) {
  for (int64_t n = 0; n < N; n += 4 * kV) {
    switch (std::min<int64_t>(4, (N - n) / kV)) {
      case 4: panel<4, kAccumulate>(M, K, A, lda, B + n, ldb, C + n, ldc); break;
      case 3: panel<3, kAccumulate>(M, K, A, lda, B + n, ldb, C + n, ldc); break;
      case 2: panel<2, kAccumulate>(M, K, A, lda, B + n, ldb, C + n, ldc); break;
      default: panel<1, kAccumulate>(M, K, A, lda, B + n, ldb, C + n, ldc); break;
    }
  }
}

// The largest and the sum of a vector's lanes, by halves.
JAXFUSE_INLINE float lanes_max(v16 x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  a = a > b ? a : b;
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > d ? c : d;
  float m = c[0] > c[1] ? c[0] : c[1], n = c[2] > c[3] ? c[2] : c[3];
  return m > n ? m : n;
}

JAXFUSE_INLINE float lanes_sum(v16 x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

JAXFUSE_INLINE float row_max(const float* x) {   // of kTile floats
  v16 m = vload(x);
  for (int64_t v = 1; v < kTile / kV; ++v) {
    v16 y = vload(x + v * kV);
    m = y > m ? y : m;
  }
  return lanes_max(m);
}

JAXFUSE_INLINE v16 row_vsum(const float* x) {   // of kTile floats, by lanes
  v16 s = vload(x);
  for (int64_t v = 1; v < kTile / kV; ++v) s += vload(x + v * kV);
  return s;
}

// The problem ------------------------------------------------------------------------------------

struct Problem {
  int64_t batch, tq, tk, hq, hkv, d;
  int64_t dp, tqp, tkp;   // d padded to 16, the lengths to whole tiles
  int32_t causal;         // 0: none, 1: top-left, 2: bottom-right
  int64_t window;         // 0: none
  float scale, softcap;   // softcap 0: none
  const int32_t* q_seg;   // [batch, tq] or null
  const int32_t* kv_seg;  // [batch, tk] or null
  const int32_t* lengths; // [batch] or null

  int64_t group() const { return hq / hkv; }
  int64_t kv_len(int64_t b) const {
    return lengths ? std::clamp<int64_t>(lengths[b], 0, tk) : tk;
  }
  int64_t offset(int64_t b) const { return causal == 2 ? kv_len(b) - tq : 0; }

  // The keys [lo, hi) that query rows [i0, i1) can see, before segments.
  void key_range(int64_t b, int64_t i0, int64_t i1, int64_t& lo, int64_t& hi) const {
    int64_t off = offset(b);
    lo = 0;
    hi = kv_len(b);
    if (causal) hi = std::min(hi, i1 - 1 + off + 1);
    if (window) lo = std::max<int64_t>(0, i0 + off - window + 1);
  }
  // The queries [lo, hi) that can see some key of [j0, j1), before segments.
  void query_range(int64_t b, int64_t j0, int64_t j1, int64_t& lo, int64_t& hi) const {
    int64_t off = offset(b);
    lo = 0;
    hi = tq;
    if (j0 >= kv_len(b)) { hi = 0; return; }
    if (causal) lo = std::max<int64_t>(0, j0 - off);
    if (window) hi = std::min<int64_t>(tq, j1 - 1 - off + window);
  }
  // Whether every query of [i0, i1) sees every key of [j0, j0 + kTile).
  bool all_visible(int64_t b, int64_t i0, int64_t i1, int64_t j0) const {
    int64_t off = offset(b), j1 = j0 + kTile;
    return !q_seg && j1 <= kv_len(b) && (!causal || j1 - 1 <= i0 + off) &&
           (!window || j0 > i1 - 1 + off - window);
  }
};

// Copies rows [first, first + count) of x[b, :, h, :] (rows past `rows` are zero) into dst,
// times `factor`: as rows [count][dp], or transposed tile by tile, [count / kTile][dp][kTile]
// (a tile's transpose contiguous: its rows 256 bytes apart, not the whole length apart, which
// would put them in one L1 set). Both layouts put the tile of row first + t0 at dst + t0 * dp.
template <typename T>
void copy_head(const T* x, int64_t b, int64_t first, int64_t count, int64_t rows,
               int64_t heads, int64_t h, int64_t d, int64_t dp, float factor, bool transpose,
               float* dst) {
  std::memset(dst, 0, count * dp * sizeof(float));
  const T* base = x + (b * rows * heads + h) * d;
  for (int64_t t = 0; t < std::min(count, rows - first); ++t) {
    const T* row = base + (first + t) * heads * d;
    if (transpose) {
      float* tile = dst + t / kTile * kTile * dp + t % kTile;
      for (int64_t c = 0; c < d; ++c) tile[c * kTile] = load(row, c) * factor;
    } else {
      for (int64_t c = 0; c < d; ++c) dst[t * dp + c] = load(row, c) * factor;
    }
  }
}

// Sets the masked scores of a tile to -inf: rows are queries from i0 and columns keys from j0
// (transposed: rows keys, columns queries). The causal, window and length masks leave each row
// one interval of columns; segment ids are compared within it.
void mask_tile(const Problem& P, int64_t b, int64_t i0, int64_t j0, bool transposed, float* s) {
  const int64_t off = P.offset(b), len = P.kv_len(b);
  for (int64_t r = 0; r < kTile; ++r) {
    int64_t lo, hi;   // the visible columns
    if (!transposed) {
      int64_t i = i0 + r;
      lo = (P.window ? i + off - P.window + 1 : 0) - j0;
      hi = (P.causal ? std::min(len, i + off + 1) : len) - j0;
      if (i >= P.tq) lo = hi = kTile;
    } else {
      int64_t j = j0 + r;
      lo = (P.causal ? j - off : 0) - i0;
      hi = (P.window ? std::min(P.tq, j - off + P.window) : P.tq) - i0;
      if (j >= len) lo = hi = kTile;
    }
    lo = std::clamp<int64_t>(lo, 0, kTile);
    hi = std::clamp<int64_t>(hi, lo, kTile);
    float* row = s + r * kTile;
    for (int64_t c = 0; c < lo; ++c) row[c] = -kInf;
    for (int64_t c = hi; c < kTile; ++c) row[c] = -kInf;
    if (P.q_seg) {
      for (int64_t c = lo; c < hi; ++c) {
        int64_t i = i0 + (transposed ? c : r), j = j0 + (transposed ? r : c);
        if (P.q_seg[b * P.tq + i] != P.kv_seg[b * P.tk + j]) row[c] = -kInf;
      }
    }
  }
}

// Scores s (scaled, natural units) to capped base-2 scores; keeps 1 - tanh² for the backward.
void cap_tile(float softcap, float* s, float* dcap) {
  for (int64_t e = 0; e < kTile * kTile; ++e) {
    float t = tanh_f(s[e] / softcap);
    s[e] = softcap * t * kLog2e;
    if (dcap) dcap[e] = 1.0f - t * t;
  }
}

// Forward ----------------------------------------------------------------------------------------

// False where an allocation failed.
template <typename T>
bool forward(ffi::ThreadPool& pool, const Problem& P, const T* q, const T* k, const T* v, T* o,
             float* lse, bool base2) {
  const int64_t G = P.group(), dp = P.dp, tiles = P.tqp / kTile;
  const float qscale = P.softcap ? P.scale : P.scale * kLog2e;
  // The (batch, kv head) pairs go in groups whose copies of kᵀ and v fit in about 64 MiB.
  const int64_t pair_floats = 2 * P.tkp * dp;
  const int64_t pairs = P.batch * P.hkv;
  const int64_t per_round = std::clamp<int64_t>((int64_t{16} << 20) / pair_floats, 1, pairs);
  Floats kt(per_round * pair_floats);   // per pair: kᵀ tile by tile, then v [tkp][dp]
  if (!allocated(kt)) return false;
  std::atomic<bool> failed{false};
  for (int64_t first = 0; first < pairs && !failed; first += per_round) {
    const int64_t count = std::min(per_round, pairs - first);
    parallel_chunks(pool, count, count, [&](int64_t, int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        int64_t b = (first + p) / P.hkv, h = (first + p) % P.hkv;
        float* buf = kt.p + p * pair_floats;
        copy_head(k, b, 0, P.tkp, P.tk, P.hkv, h, P.d, dp, 1.0f, true, buf);
        copy_head(v, b, 0, P.tkp, P.tk, P.hkv, h, P.d, dp, 1.0f, false, buf + P.tkp * dp);
      }
    });
    // Items: (pair, query head of its group, query tile), the costliest (last) tiles first.
    const int64_t items = count * G * tiles;
    parallel_chunks(pool, items, items, [&](int64_t, int64_t lo, int64_t hi) {
      Floats qtile(kTile * dp), acc(kTile * dp), s(kTile * kTile);
      if (!allocated(qtile, acc, s)) { failed = true; return; }
      float m[kTile];
      v16 l[kTile];   // each row's sum, by lanes (summed across them at the end)
      for (int64_t item = lo; item < hi; ++item) {
        int64_t tile = tiles - 1 - item % tiles, rest = item / tiles;
        int64_t g = rest % G, p = rest / G;
        int64_t b = (first + p) / P.hkv, hk = (first + p) % P.hkv, h = hk * G + g;
        const float* kT = kt.p + p * pair_floats;
        const float* vv = kT + P.tkp * dp;
        int64_t i0 = tile * kTile, i1 = std::min(P.tq, i0 + kTile);
        std::memset(qtile.p, 0, kTile * dp * sizeof(float));
        const T* qrow = q + ((b * P.tq + i0) * P.hq + h) * P.d;
        for (int64_t r = 0; r < i1 - i0; ++r)
          for (int64_t c = 0; c < P.d; ++c)
            qtile.p[r * dp + c] = load(qrow + r * P.hq * P.d, c) * qscale;
        std::memset(acc.p, 0, kTile * dp * sizeof(float));
        for (int64_t r = 0; r < kTile; ++r) { m[r] = -kInf; l[r] = v16{}; }
        int64_t klo, khi;
        P.key_range(b, i0, i1, klo, khi);
        for (int64_t j0 = klo / kTile * kTile; j0 < khi; j0 += kTile) {
          gemm<false>(kTile, kTile, dp, qtile.p, dp, kT + j0 * dp, kTile, s.p, kTile);
          if (P.softcap) cap_tile(P.softcap, s.p, nullptr);
          if (!P.all_visible(b, i0, i1, j0)) mask_tile(P, b, i0, j0, false, s.p);
          for (int64_t r = 0; r < kTile; ++r) {
            float* row = s.p + r * kTile;
            float mnew = std::max(m[r], row_max(row));
            float safe = mnew == -kInf ? 0.0f : mnew;
            float alpha = exp2_f(m[r] - safe);
            for (int64_t c = 0; c < kTile; ++c) row[c] = exp2_f(row[c] - safe);
            l[r] = l[r] * alpha + row_vsum(row);
            m[r] = mnew;
            if (alpha != 1.0f) {
              float* a = acc.p + r * dp;
              for (int64_t c = 0; c < dp; ++c) a[c] *= alpha;
            }
          }
          gemm<true>(kTile, dp, kTile, s.p, kTile, vv + j0 * dp, dp, acc.p, dp);
        }
        for (int64_t r = 0; r < i1 - i0; ++r) {
          T* out = o + ((b * P.tq + i0 + r) * P.hq + h) * P.d;
          float sum = lanes_sum(l[r]);
          float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
          for (int64_t c = 0; c < P.d; ++c) store(out, c, acc.p[r * dp + c] * inv);
          if (lse) {
            float value = sum > 0.0f ? m[r] + std::log2(sum) : kInf;
            lse[(b * P.hq + h) * P.tq + i0 + r] = base2 ? value : value * kLn2;
          }
        }
      }
    });
  }
  return !failed;
}

// Backward ---------------------------------------------------------------------------------------

// dq[b, :, h, :] = scale times the sum of `count` shares of dqᵀ, each tile by tile
// [tqp / kTile][dp][kTile].
template <typename T>
void store_dq(const Problem& P, int64_t b, int64_t h, const float* const* shares, int64_t count,
              T* dq) {
  for (int64_t i = 0; i < P.tq; ++i) {
    T* row = dq + ((b * P.tq + i) * P.hq + h) * P.d;
    const int64_t at = i / kTile * kTile * P.dp + i % kTile;
    for (int64_t c = 0; c < P.d; ++c) {
      float sum = 0.0f;
      for (int64_t s = 0; s < count; ++s) sum += shares[s][at + c * kTile];
      store(row, c, sum * P.scale);
    }
  }
}

// The key tiles [first, last) of segment s of `segments` for batch b: contiguous, of about
// equal work (the query tiles each one meets, plus one).
void segment_tiles(const Problem& P, int64_t b, int64_t s, int64_t segments, int64_t& first,
                   int64_t& last) {
  const int64_t n = P.tkp / kTile;
  if (segments == 1) { first = 0; last = n; return; }
  std::unique_ptr<int64_t[]> work(new int64_t[n + 1]);
  work[0] = 0;
  for (int64_t j = 0; j < n; ++j) {
    int64_t lo, hi;
    P.query_range(b, j * kTile, std::min(P.tk, (j + 1) * kTile), lo, hi);
    work[j + 1] = work[j] + 1 + (hi > lo ? (hi + kTile - 1) / kTile - lo / kTile : 0);
  }
  auto boundary = [&](int64_t k) {
    int64_t j = 0;
    while (j < n && work[j] * segments < work[n] * k) ++j;
    return j;
  };
  first = boundary(s);
  last = boundary(s + 1);
}

// False where an allocation failed.
template <typename T>
bool backward(ffi::ThreadPool& pool, const Problem& P, const T* q, const T* k, const T* v,
              const T* o, const float* lse, const T* dout, T* dq, T* dk, T* dv, bool base2) {
  const int64_t G = P.group(), dp = P.dp, tqp = P.tqp;
  const float qscale = P.softcap ? P.scale : P.scale * kLog2e;
  const int64_t pairs = P.batch * P.hkv, head_floats = tqp * dp;
  // Items: (batch, kv head, segment of its key tiles). With fewer (batch, kv head) pairs than
  // two per thread, each pair's key tiles are split into segments, each summing its own share
  // of dq (at most 256 MiB of them), added up at the end.
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t segments = std::clamp<int64_t>((2 * workers + pairs - 1) / pairs, 1, P.tkp / kTile);
  segments = std::min(segments,
                      std::max<int64_t>(1, (int64_t{1} << 26) / (pairs * G * head_floats)));
  Floats partial(segments > 1 ? pairs * segments * G * head_floats : 0);
  if (!allocated(partial)) return false;
  std::atomic<bool> failed{false};
  const int64_t items = pairs * segments;
  parallel_chunks(pool, items, items, [&](int64_t, int64_t lo, int64_t hi) {
    // Per query head: q, scaled qᵀ, do, doᵀ, its lse and delta, and dqᵀ (when not a segment's).
    Floats qq(head_floats), qT(head_floats), dd(head_floats), dT(head_floats), ls(tqp),
        delta(tqp), own_dq(segments == 1 ? head_floats : 0);
    Floats pt(kTile * kTile), dpt(kTile * kTile), dcap(P.softcap ? kTile * kTile : 0);
    if (!allocated(qq, qT, dd, dT, ls, delta, own_dq, pt, dpt, dcap)) { failed = true; return; }
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t pair = item / segments, seg = item % segments;
      const int64_t b = pair / P.hkv, hk = pair % P.hkv;
      int64_t t0, t1;
      segment_tiles(P, b, seg, segments, t0, t1);
      if (t0 == t1) continue;
      const int64_t j_lo = t0 * kTile, rows = (t1 - t0) * kTile;
      // This segment's keys: k, kᵀ, v, and its dk and dv.
      Floats kk(rows * dp), kT(rows * dp), vv(rows * dp), dk_acc(rows * dp), dv_acc(rows * dp);
      if (!allocated(kk, kT, vv, dk_acc, dv_acc)) { failed = true; return; }
      copy_head(k, b, j_lo, rows, P.tk, P.hkv, hk, P.d, dp, 1.0f, false, kk.p);
      copy_head(k, b, j_lo, rows, P.tk, P.hkv, hk, P.d, dp, 1.0f, true, kT.p);
      copy_head(v, b, j_lo, rows, P.tk, P.hkv, hk, P.d, dp, 1.0f, false, vv.p);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        copy_head(q, b, 0, tqp, P.tq, P.hq, h, P.d, dp, 1.0f, false, qq.p);
        copy_head(q, b, 0, tqp, P.tq, P.hq, h, P.d, dp, qscale, true, qT.p);
        copy_head(dout, b, 0, tqp, P.tq, P.hq, h, P.d, dp, 1.0f, false, dd.p);
        copy_head(dout, b, 0, tqp, P.tq, P.hq, h, P.d, dp, 1.0f, true, dT.p);
        for (int64_t i = 0; i < tqp; ++i) {
          if (i >= P.tq) { ls.p[i] = kInf; delta.p[i] = 0.0f; continue; }
          float x = lse[(b * P.hq + h) * P.tq + i];
          ls.p[i] = base2 ? x : x * kLog2e;
          const T* orow = o + ((b * P.tq + i) * P.hq + h) * P.d;
          const float* drow = dd.p + i * dp;
          float sum = 0.0f;
          for (int64_t c = 0; c < P.d; ++c) sum += load(orow, c) * drow[c];
          delta.p[i] = sum;
        }
        float* dqT = segments == 1 ? own_dq.p
                                   : partial.p + ((pair * segments + seg) * G + g) * head_floats;
        if (segments == 1) std::memset(dqT, 0, head_floats * sizeof(float));
        for (int64_t j0 = j_lo; j0 < std::min(P.tk, j_lo + rows); j0 += kTile) {
          const int64_t at = (j0 - j_lo) * dp;
          int64_t qlo, qhi;
          P.query_range(b, j0, std::min(P.tk, j0 + kTile), qlo, qhi);
          for (int64_t i0 = qlo / kTile * kTile; i0 < qhi; i0 += kTile) {
            const int64_t i1 = std::min(P.tq, i0 + kTile);
            const float* L = ls.p + i0;
            const float* D = delta.p + i0;
            // sᵀ = k_j (scaled q_i)ᵀ, then pᵀ.
            gemm<false>(kTile, kTile, dp, kk.p + at, dp, qT.p + i0 * dp, kTile, pt.p, kTile);
            if (P.softcap) cap_tile(P.softcap, pt.p, dcap.p);
            if (!P.all_visible(b, i0, i1, j0)) mask_tile(P, b, i0, j0, true, pt.p);
            for (int64_t r = 0; r < kTile; ++r) {
              float* row = pt.p + r * kTile;
              for (int64_t c = 0; c < kTile; ++c) row[c] = exp2_f(row[c] - L[c]);
            }
            gemm<true>(kTile, dp, kTile, pt.p, kTile, dd.p + i0 * dp, dp, dv_acc.p + at, dp);
            // dpᵀ = v_j doᵀ_i, then dsᵀ = pᵀ (dpᵀ - delta) (times the cap's derivative).
            gemm<false>(kTile, kTile, dp, vv.p + at, dp, dT.p + i0 * dp, kTile, dpt.p, kTile);
            for (int64_t r = 0; r < kTile; ++r) {
              float* ds = dpt.p + r * kTile;
              const float* p = pt.p + r * kTile;
              for (int64_t c = 0; c < kTile; ++c) ds[c] = p[c] * (ds[c] - D[c]);
              if (P.softcap) {
                const float* dc = dcap.p + r * kTile;
                for (int64_t c = 0; c < kTile; ++c) ds[c] *= dc[c];
              }
            }
            gemm<true>(kTile, dp, kTile, dpt.p, kTile, qq.p + i0 * dp, dp, dk_acc.p + at, dp);
            gemm<true>(dp, kTile, kTile, kT.p + at, kTile, dpt.p, kTile, dqT + i0 * dp, kTile);
          }
        }
        if (segments == 1) {
          const float* share = dqT;
          store_dq(P, b, h, &share, 1, dq);
        }
      }
      for (int64_t r = 0; r < std::min(rows, P.tk - j_lo); ++r) {
        T* dkr = dk + ((b * P.tk + j_lo + r) * P.hkv + hk) * P.d;
        T* dvr = dv + ((b * P.tk + j_lo + r) * P.hkv + hk) * P.d;
        for (int64_t c = 0; c < P.d; ++c) {
          store(dkr, c, dk_acc.p[r * dp + c] * P.scale);
          store(dvr, c, dv_acc.p[r * dp + c]);
        }
      }
    }
  });
  if (failed) return false;
  if (segments == 1) return true;
  // dq: the segments' shares added up, per (pair, query head).
  parallel_chunks(pool, pairs * G, pairs * G, [&](int64_t, int64_t lo, int64_t hi) {
    std::unique_ptr<const float*[]> parts(new const float*[segments]);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t pair = item / G, g = item % G;
      const int64_t b = pair / P.hkv, h = pair % P.hkv * G + g;
      for (int64_t s = 0; s < segments; ++s)
        parts[s] = partial.p + ((pair * segments + s) * G + g) * head_floats;
      store_dq(P, b, h, parts.get(), segments, dq);
    }
  });
  return true;
}

// The handlers -----------------------------------------------------------------------------------

// The problem's sizes from q [..., tq, hq, d] and k [..., tk, hkv, d].
Problem problem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& q_seg,
                const ffi::AnyBuffer& kv_seg, const ffi::AnyBuffer& lengths, int32_t causal,
                int64_t window, float scale, float softcap) {
  auto qd = q.dimensions(), kd = k.dimensions();
  size_t r = qd.size();
  Problem P{};
  P.batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) P.batch *= qd[i];
  P.tq = qd[r - 3];
  P.hq = qd[r - 2];
  P.d = qd[r - 1];
  P.tk = kd[r - 3];
  P.hkv = kd[r - 2];
  P.dp = round_up(P.d, kV);
  P.tqp = round_up(std::max<int64_t>(P.tq, 1), kTile);
  P.tkp = round_up(std::max<int64_t>(P.tk, 1), kTile);
  P.causal = causal;
  P.window = window;
  P.scale = scale;
  P.softcap = softcap;
  P.q_seg = q_seg.element_count() ? static_cast<const int32_t*>(q_seg.untyped_data()) : nullptr;
  P.kv_seg = P.q_seg ? static_cast<const int32_t*>(kv_seg.untyped_data()) : nullptr;
  P.lengths = lengths.element_count() ? static_cast<const int32_t*>(lengths.untyped_data())
                                      : nullptr;
  return P;
}

ffi::Error out_of_memory() {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "attention (cpu): out of memory for the kernels' float32 copies");
}

ffi::Error unsupported(ffi::DataType dtype) {
  return ffi::Error::InvalidArgument("attention (cpu): float32, bfloat16 or float16, got dtype " +
                                     std::to_string(static_cast<int>(dtype)));
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer lengths,
                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, int32_t causal,
                   int64_t window, float scale, float softcap, bool base2) {
  Problem P = problem(q, k, q_seg, kv_seg, lengths, causal, window, scale, softcap);
  float* plse = lse->element_count() ? static_cast<float*>(lse->untyped_data()) : nullptr;
  bool done = false;
  bool known = with_storage(q.element_type(), [&]<typename T>() {
    done = forward(pool, P, static_cast<const T*>(q.untyped_data()),
            static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()),
            static_cast<T*>(o->untyped_data()), plse, base2);
  });
  if (!known) return unsupported(q.element_type());
  return done ? ffi::Error::Success() : out_of_memory();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer lengths,
                    ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, int32_t causal, int64_t window, float scale,
                    float softcap, bool base2) {
  Problem P = problem(q, k, q_seg, kv_seg, lengths, causal, window, scale, softcap);
  bool done = false;
  bool known = with_storage(q.element_type(), [&]<typename T>() {
    done = backward(pool, P, static_cast<const T*>(q.untyped_data()),
             static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()),
             static_cast<const T*>(o.untyped_data()),
             static_cast<const float*>(lse.untyped_data()),
             static_cast<const T*>(dout.untyped_data()), static_cast<T*>(dq->untyped_data()),
             static_cast<T*>(dk->untyped_data()), static_cast<T*>(dv->untyped_data()), base2);
  });
  if (!known) return unsupported(q.element_type());
  return done ? ffi::Error::Success() : out_of_memory();
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_attention_forward, jaxfuse::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // q
                                  .Arg<ffi::AnyBuffer>()   // k
                                  .Arg<ffi::AnyBuffer>()   // v
                                  .Arg<ffi::AnyBuffer>()   // q segment ids (or empty)
                                  .Arg<ffi::AnyBuffer>()   // kv segment ids (or empty)
                                  .Arg<ffi::AnyBuffer>()   // kv lengths (or empty)
                                  .Ret<ffi::AnyBuffer>()   // o
                                  .Ret<ffi::AnyBuffer>()   // lse (or empty)
                                  .Attr<int32_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("base2"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_attention_backward, jaxfuse::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // q
                                  .Arg<ffi::AnyBuffer>()   // k
                                  .Arg<ffi::AnyBuffer>()   // v
                                  .Arg<ffi::AnyBuffer>()   // q segment ids (or empty)
                                  .Arg<ffi::AnyBuffer>()   // kv segment ids (or empty)
                                  .Arg<ffi::AnyBuffer>()   // kv lengths (or empty)
                                  .Arg<ffi::AnyBuffer>()   // o
                                  .Arg<ffi::AnyBuffer>()   // lse
                                  .Arg<ffi::AnyBuffer>()   // do
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Attr<int32_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("base2"));
