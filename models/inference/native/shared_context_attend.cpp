// Attention of many queries over ONE shared context, fused: scores, softmax and the weighted sum of values for a few
// rows at a time, in registers and L1, instead of three batched ops that each stream the (H, N, T) scores through
// memory (1 MB per head group at 1,000 candidates x 66 tokens: more than a core's L2).
//
//     out[i, h] = softmax_j(q[i, h] . keys[h, :, j]) values[h, j, :]      (keys already scaled into log2 units)
//
// The operands are ``models.attention.shared_context.context_layout``'s: keys (H, d, T) pre-scaled by
// log2(e) / sqrt(d) so that exp2 gives the softmax, values (H, T, d); q and the output are (N, H * d) rows. Each
// row's max is subtracted before exp2 (the standard, overflow-free softmax: here it costs no extra pass).
//
// Three paths with one result (up to float rounding): AVX-512 on x86-64 CPUs that have it (d 16 or 32; a row's
// scores in up to 9 registers of 16 keys), AVX2 + FMA (d a multiple of 8, up to 32; up to 9 registers of 8 keys),
// longer contexts in L1 on both, and a portable scalar loop for everything else. ``max_bits`` caps the width (512,
// 256, 0 = portable: tests run every path). The plain PyTorch reference is ``shared_context.reference_attend``;
// tests compare every path with it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "shared_context_attend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GEMFLOW_X86 1
#endif

namespace {

#ifdef GEMFLOW_X86
// 2^x for x <= 0: 2^n * 2^f with n = round(x), |f| <= 1/2, and 2^f = e^(f ln 2) by its Taylor series to degree 6
// (truncation < 1.3e-7 relative: float32's own rounding). Below 2^-126 (far under a softmax term that counts
// next to its row's max, which is 1) the result is clamped to 2^-126. A NaN stays NaN (maxps returns its second
// operand when either is NaN), so a NaN score reaches the output as in PyTorch's softmax.
__attribute__((target("avx2,fma"))) inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-126.f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// The AVX-512 twin of ``exp2_nonpositive``: the same polynomial; ``scalef`` multiplies by 2^n (n = round(x)).
__attribute__((target("avx512f"))) inline __m512 exp2_nonpositive_512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-126.f), x);  // a NaN stays NaN, as in the AVX2 version
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// The raw operands of one call: heads of ``dim`` values, ``ctx`` context tokens.
struct Operands {
  const float* q;       // (N, H * dim)
  const float* keys;    // (H, dim, ctx)
  const float* values;  // (H, ctx, dim)
  float* out;           // (N, H * dim)
  int64_t heads, dim, ctx;
};

void attend_rows_scalar(const Operands& a, int64_t begin, int64_t end) {
  const int64_t width = a.heads * a.dim;
  std::vector<float> p(a.ctx);
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t h = 0; h < a.heads; ++h) {
      const float* qi = a.q + i * width + h * a.dim;
      const float* kh = a.keys + h * a.dim * a.ctx;
      const float* vh = a.values + h * a.ctx * a.dim;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < a.ctx; ++j) {
        float s = 0.f;
        for (int64_t k = 0; k < a.dim; ++k) s += qi[k] * kh[k * a.ctx + j];
        p[j] = s;
        top = std::max(top, s);
      }
      float total = 0.f;
      for (int64_t j = 0; j < a.ctx; ++j) total += (p[j] = std::exp2(p[j] - top));
      float* oi = a.out + i * width + h * a.dim;
      std::fill(oi, oi + a.dim, 0.f);
      for (int64_t j = 0; j < a.ctx; ++j)
        for (int64_t k = 0; k < a.dim; ++k) oi[k] += p[j] * vh[j * a.dim + k];
      for (int64_t k = 0; k < a.dim; ++k) oi[k] /= total;
    }
  }
}

#ifdef GEMFLOW_X86

// Scores and softmax of one row of one head, the context in ``VECS`` registers of 8 scores (VECS = 0: any length,
// the scores in ``probs``): leaves the row's unnormalized probabilities in ``probs`` and returns 1 / their sum.
// (Not inlined: inlined into the tile, GCC kept the exponential's constants in registers and spilled the scores.)
template <int VECS, int DIM>
__attribute__((target("avx2,fma"), noinline)) float row_probs(const float* qi, const float* kp, int64_t vecs,
                                                          __m256 tail_mask, float* probs) {
  const int64_t n_vecs = VECS > 0 ? VECS : vecs;
  const int64_t stride = n_vecs * 8;
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = minus_inf;
  if constexpr (VECS > 0) {
    __m256 s[VECS];
#pragma GCC unroll 32
    for (int v = 0; v < VECS; ++v) s[v] = _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int k = 0; k < DIM; ++k) {
      const __m256 b = _mm256_broadcast_ss(qi + k);
      const float* kr = kp + k * stride;
#pragma GCC unroll 32
      for (int v = 0; v < VECS; ++v) s[v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(kr + 8 * v), s[v]);
    }
    s[VECS - 1] = _mm256_blendv_ps(minus_inf, s[VECS - 1], tail_mask);
#pragma GCC unroll 32
    for (int v = 0; v < VECS; ++v) {
      top = _mm256_max_ps(top, s[v]);
      _mm256_storeu_ps(probs + 8 * v, s[v]);
    }
  } else {
    for (int64_t v = 0; v < n_vecs; ++v) {
      __m256 s = _mm256_setzero_ps();
#pragma GCC unroll 32
      for (int k = 0; k < DIM; ++k)
        s = _mm256_fmadd_ps(_mm256_broadcast_ss(qi + k), _mm256_loadu_ps(kp + k * stride + 8 * v), s);
      if (v == n_vecs - 1) s = _mm256_blendv_ps(minus_inf, s, tail_mask);
      top = _mm256_max_ps(top, s);
      _mm256_storeu_ps(probs + 8 * v, s);
    }
  }
  const __m256 row_max = _mm256_set1_ps(horizontal_max(top));
  __m256 sums = _mm256_setzero_ps();
  for (int64_t v = 0; v < n_vecs; ++v) {
    __m256 e = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(probs + 8 * v), row_max));
    if (v == n_vecs - 1) e = _mm256_and_ps(e, tail_mask);
    sums = _mm256_add_ps(sums, e);
    _mm256_storeu_ps(probs + 8 * v, e);
  }
  return 1.f / horizontal_sum(sums);
}

// ``ROWS`` consecutive rows of one head: each row's probabilities, then their weighted sums of the values together,
// so that every value vector loaded serves ROWS rows and ROWS x DIM / 8 accumulators (>= 8) keep both FMA units
// busy (one row alone has DIM / 8 dependent chains, each waiting ~4 cycles per token).
template <int VECS, int DIM, int ROWS>
__attribute__((target("avx2,fma"))) void attend_tile(const float* q, int64_t width, const float* kp, int64_t vecs,
                                                    const float* vh, int64_t ctx, float* probs, float* out) {
  constexpr int kVecs = DIM / 8;
  const int64_t stride = (VECS > 0 ? VECS : vecs) * 8;
  const int tail = static_cast<int>(ctx - (stride - 8));  // valid lanes of the last vector, 1..8
  const __m256 tail_mask = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  float inv[ROWS];
  for (int r = 0; r < ROWS; ++r) inv[r] = row_probs<VECS, DIM>(q + r * width, kp, vecs, tail_mask, probs + r * stride);
  __m256 acc[ROWS][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < ctx; ++j) {
    __m256 v[kVecs];
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c) v[c] = _mm256_loadu_ps(vh + j * DIM + 8 * c);
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) {
      const __m256 p = _mm256_broadcast_ss(probs + r * stride + j);
#pragma GCC unroll 32
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm256_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c)
      _mm256_storeu_ps(out + r * width + 8 * c, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r])));
  }
}

// Rows [begin, end) of every head: tiles of ROWS rows, the rest one by one.
template <int VECS, int DIM>
__attribute__((target("avx2,fma"))) void attend_rows(const Operands& a, const float* padded_keys, int64_t vecs,
                                                    int64_t begin, int64_t end) {
  constexpr int kRows = DIM == 8 ? 8 : DIM == 16 ? 4 : DIM == 24 ? 3 : 2;  // >= 8 accumulators, <= 12 registers
  const int64_t width = a.heads * DIM, stride = vecs * 8;
  std::vector<float> probs(kRows * stride);
  for (int64_t h = 0; h < a.heads; ++h) {
    const float* kp = padded_keys + h * DIM * stride;
    const float* vh = a.values + h * a.ctx * DIM;
    int64_t i = begin;
    for (; i + kRows <= end; i += kRows)
      attend_tile<VECS, DIM, kRows>(a.q + i * width + h * DIM, width, kp, vecs, vh, a.ctx, probs.data(),
                                    a.out + i * width + h * DIM);
    for (; i < end; ++i)
      attend_tile<VECS, DIM, 1>(a.q + i * width + h * DIM, width, kp, vecs, vh, a.ctx, probs.data(),
                                a.out + i * width + h * DIM);
  }
}

using RowsFn = void (*)(const Operands&, const float*, int64_t, int64_t, int64_t);

template <int DIM>
RowsFn pick_rows_fn(int64_t vecs) {
  switch (vecs) {
    case 1: return attend_rows<1, DIM>;
    case 2: return attend_rows<2, DIM>;
    case 3: return attend_rows<3, DIM>;
    case 4: return attend_rows<4, DIM>;
    case 5: return attend_rows<5, DIM>;
    case 6: return attend_rows<6, DIM>;
    case 7: return attend_rows<7, DIM>;
    case 8: return attend_rows<8, DIM>;
    case 9: return attend_rows<9, DIM>;
    default: return attend_rows<0, DIM>;
  }
}

RowsFn pick_rows_fn(int64_t dim, int64_t vecs) {
  switch (dim) {
    case 8: return pick_rows_fn<8>(vecs);
    case 16: return pick_rows_fn<16>(vecs);
    case 24: return pick_rows_fn<24>(vecs);
    default: return pick_rows_fn<32>(vecs);
  }
}

// ---- AVX-512: the same three levels on 16 lanes (head dims 16 and 32: one or two registers per row of values)

template <int VECS, int DIM>
__attribute__((target("avx512f"), noinline)) float row_probs_512(const float* qi, const float* kp, int64_t vecs,
                                                                 __mmask16 tail_mask, float* probs) {
  const int64_t n_vecs = VECS > 0 ? VECS : vecs;
  const int64_t stride = n_vecs * 16;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  if constexpr (VECS > 0) {
    __m512 s[VECS];
#pragma GCC unroll 32
    for (int v = 0; v < VECS; ++v) s[v] = _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int k = 0; k < DIM; ++k) {
      const __m512 b = _mm512_set1_ps(qi[k]);
      const float* kr = kp + k * stride;
#pragma GCC unroll 32
      for (int v = 0; v < VECS; ++v) s[v] = _mm512_fmadd_ps(b, _mm512_loadu_ps(kr + 16 * v), s[v]);
    }
    s[VECS - 1] = _mm512_mask_blend_ps(tail_mask, minus_inf, s[VECS - 1]);
#pragma GCC unroll 32
    for (int v = 0; v < VECS; ++v) {
      top = _mm512_max_ps(top, s[v]);
      _mm512_storeu_ps(probs + 16 * v, s[v]);
    }
  } else {
    for (int64_t v = 0; v < n_vecs; ++v) {
      __m512 s = _mm512_setzero_ps();
#pragma GCC unroll 32
      for (int k = 0; k < DIM; ++k)
        s = _mm512_fmadd_ps(_mm512_set1_ps(qi[k]), _mm512_loadu_ps(kp + k * stride + 16 * v), s);
      if (v == n_vecs - 1) s = _mm512_mask_blend_ps(tail_mask, minus_inf, s);
      top = _mm512_max_ps(top, s);
      _mm512_storeu_ps(probs + 16 * v, s);
    }
  }
  const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sums = _mm512_setzero_ps();
  for (int64_t v = 0; v < n_vecs; ++v) {
    __m512 e = exp2_nonpositive_512(_mm512_sub_ps(_mm512_loadu_ps(probs + 16 * v), row_max));
    if (v == n_vecs - 1) e = _mm512_maskz_mov_ps(tail_mask, e);
    sums = _mm512_add_ps(sums, e);
    _mm512_storeu_ps(probs + 16 * v, e);
  }
  return 1.f / _mm512_reduce_add_ps(sums);
}

template <int VECS, int DIM, int ROWS>
__attribute__((target("avx512f"))) void attend_tile_512(const float* q, int64_t width, const float* kp,
                                                        int64_t vecs, const float* vh, int64_t ctx, float* probs,
                                                        float* out) {
  constexpr int kVecs = DIM / 16;
  const int64_t stride = (VECS > 0 ? VECS : vecs) * 16;
  const int tail = static_cast<int>(ctx - (stride - 16));  // valid lanes of the last vector, 1..16
  const __mmask16 tail_mask = static_cast<__mmask16>((1u << tail) - 1u);
  float inv[ROWS];
  for (int r = 0; r < ROWS; ++r)
    inv[r] = row_probs_512<VECS, DIM>(q + r * width, kp, vecs, tail_mask, probs + r * stride);
  __m512 acc[ROWS][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < ctx; ++j) {
    __m512 v[kVecs];
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c) v[c] = _mm512_loadu_ps(vh + j * DIM + 16 * c);
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * stride + j]);
#pragma GCC unroll 32
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c)
      _mm512_storeu_ps(out + r * width + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
  }
}

template <int VECS, int DIM>
__attribute__((target("avx512f"))) void attend_rows_512(const Operands& a, const float* padded_keys, int64_t vecs,
                                                        int64_t begin, int64_t end) {
  constexpr int kRows = DIM == 16 ? 8 : 4;  // 8 accumulators
  const int64_t width = a.heads * DIM, stride = vecs * 16;
  std::vector<float> probs(kRows * stride);
  for (int64_t h = 0; h < a.heads; ++h) {
    const float* kp = padded_keys + h * DIM * stride;
    const float* vh = a.values + h * a.ctx * DIM;
    int64_t i = begin;
    for (; i + kRows <= end; i += kRows)
      attend_tile_512<VECS, DIM, kRows>(a.q + i * width + h * DIM, width, kp, vecs, vh, a.ctx, probs.data(),
                                        a.out + i * width + h * DIM);
    for (; i < end; ++i)
      attend_tile_512<VECS, DIM, 1>(a.q + i * width + h * DIM, width, kp, vecs, vh, a.ctx, probs.data(),
                                    a.out + i * width + h * DIM);
  }
}

template <int DIM>
RowsFn pick_rows_fn_512(int64_t vecs) {
  switch (vecs) {
    case 1: return attend_rows_512<1, DIM>;
    case 2: return attend_rows_512<2, DIM>;
    case 3: return attend_rows_512<3, DIM>;
    case 4: return attend_rows_512<4, DIM>;
    case 5: return attend_rows_512<5, DIM>;
    case 6: return attend_rows_512<6, DIM>;
    case 7: return attend_rows_512<7, DIM>;
    case 8: return attend_rows_512<8, DIM>;
    case 9: return attend_rows_512<9, DIM>;
    default: return attend_rows_512<0, DIM>;
  }
}

RowsFn pick_rows_fn_512(int64_t dim, int64_t vecs) {
  return dim == 16 ? pick_rows_fn_512<16>(vecs) : pick_rows_fn_512<32>(vecs);
}

#endif  // GEMFLOW_X86

// The widest path for head dim ``dim`` on this CPU, at most ``max_bits`` wide: 512, 256, or 0 (portable).
int64_t simd_bits(int64_t dim, int64_t max_bits) {
#ifdef GEMFLOW_X86
  if (max_bits >= 512 && cpu_has_avx512f() && (dim == 16 || dim == 32)) return 512;
  if (max_bits >= 256 && cpu_has_avx2_fma() && dim % 8 == 0 && dim >= 8 && dim <= 32) return 256;
#else
  (void)dim;
  (void)max_bits;
#endif
  return 0;
}

// The keys padded to whole vectors of ``lanes`` tokens, (H, d, vecs * lanes), zeros past ctx (masked out of the
// softmax).
std::vector<float> padded_keys(const float* keys, int64_t rows, int64_t ctx, int64_t vecs, int64_t lanes) {
  std::vector<float> padded(rows * vecs * lanes, 0.f);
  for (int64_t r = 0; r < rows; ++r) std::copy(keys + r * ctx, keys + (r + 1) * ctx, padded.data() + r * vecs * lanes);
  return padded;
}

}  // namespace

at::Tensor gemflow::shared_context_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                          int64_t max_bits) {
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 3 && values.dim() == 3,
              "shared_context_attend: expected q (N, H*d), keys (H, d, T), values (H, T, d); got ", q.sizes(), ", ",
              keys.sizes(), ", ", values.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "shared_context_attend: float32 tensors only");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "shared_context_attend: CPU tensors only");
  const int64_t n = q.size(0), heads = keys.size(0), dim = keys.size(1), ctx = keys.size(2);
  TORCH_CHECK(q.size(1) == heads * dim && values.size(0) == heads && values.size(1) == ctx && values.size(2) == dim,
              "shared_context_attend: shapes do not match: q ", q.sizes(), ", keys ", keys.sizes(), ", values ",
              values.sizes());
  if (ctx == 0) return at::zeros({n, heads * dim}, q.options());  // the jagged ops' empty-sequence rule
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  at::Tensor out = at::empty({n, heads * dim}, q.options());
  const Operands a{qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(),
                   heads, dim, ctx};
  // ~1 us of work per row: chunks of 64 rows keep a thread's share worth its start
  constexpr int64_t kGrain = 64;
#ifdef GEMFLOW_X86
  const int64_t bits = simd_bits(dim, max_bits);
  if (bits > 0) {
    const int64_t lanes = bits / 32, vecs = (ctx + lanes - 1) / lanes;
    const std::vector<float> padded = padded_keys(a.keys, heads * dim, ctx, vecs, lanes);
    const RowsFn rows = bits == 512 ? pick_rows_fn_512(dim, vecs) : pick_rows_fn(dim, vecs);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { rows(a, padded.data(), vecs, begin, end); });
    return out;
  }
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { attend_rows_scalar(a, begin, end); });
  return out;
}

namespace {

int64_t shared_context_attend_simd_bits(int64_t dim, int64_t max_bits) { return simd_bits(dim, max_bits); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemflow, m) {
  m.def("shared_context_attend(Tensor q, Tensor keys, Tensor values, int max_bits=512) -> Tensor");
  m.def("shared_context_attend_simd_bits(int dim, int max_bits=512) -> int", &shared_context_attend_simd_bits);
}

TORCH_LIBRARY_IMPL(gemflow, CPU, m) { m.impl("shared_context_attend", gemflow::shared_context_attend); }
