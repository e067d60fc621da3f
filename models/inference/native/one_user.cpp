// The one-user path of serving (``models.inference.one_user``) as two ops, one call each per request:
//
// - ``one_user_side``: ``OneUserScorer.user_side``'s context and per-block K/V: the events' id embeddings gathered
//   and summed (ids outside a table -> its OOV row) and normalized, the user's cached tokens projected in front,
//   and each block's LayerNorm + K/V projection;
// - ``one_user_score``: ``OneUserScorer.forward``: a request's N candidates through the target-aware blocks and
//   the head, over that K/V.
//
// The GEMMs stay ATen's (MKL's sgemm, at this CPU's float32 peak on these shapes), as does the GELU (vectorized
// erf) and the attention (``gemflow::shared_context_attend``). What the ops remove is everything around them: as
// ~150 small TorchScript ops, the gathers, residual adds, bias broadcasts, LayerNorms, the head's expanded LayerNorm
// (six passes) and the concatenations each allocated a tensor, streamed the rows through memory and ran its own
// kernel. Back to back, that costs little more than one op; but a server runs other work between two scoring
// calls, and each call then meets cold caches: in process, alternating with the TorchScript path call by call,
// the scorer op took 12-17% less CPU, 17-23% less after a 10-40 ms pause (docs/serving-speed.md, round 11). A bias and a
// residual ride on a GEMM (``addmm_``: beta = 1 adds into the running rows in place) or on the LayerNorm pass that
// reads the rows next, and each LayerNorm is one pass over rows that fit in L1.
//
// Per block (pre-norm, as ``TargetAwareBlock``):   p = LN_q(q) Wq^T + bq   (block 0: the cached ``first_query``)
//     q = q + attend(p, K, V) Wo^T + bo;   h = GELU(LN_2(q) Wu^T + bu);   q = q + h Wd^T + bd
// Head (``OneUserHead``'s expansion of LayerNorm + Linear over x = [q, q * token, token] ++ profile):
//     z = c + rstd * (x (W_x * g_x)^T + (profile * g_p) W_p^T - mean * (W g)),   c = b_1 + W b
//     logits = GELU(z) W_2^T + b_2
// Row statistics are exact two-pass ones over each row (in cache), the head's combined with the profile's by Chan's
// formula, as ``OneUserHead`` computes them.
//
// Plain C++ between the ATen calls (the compiler vectorizes the row loops for the CPU it runs on): it runs wherever
// the library builds. The reference is the eager ``OneUserScorer`` (PyTorch ops); tests compare the two.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "shared_context_attend.h"

namespace {

constexpr int64_t kPerBlock = 12;  // norm_q w/b, q W/b, out W/b, norm2 w/b, up W/b, down W/b
constexpr int64_t kHead = 6;       // norm w/b, first W/b, last W/b
constexpr int64_t kGrain = 256;    // rows per task of a row pass (~1 us of work per row)

// The row passes are compiled for AVX-512, AVX2 and baseline x86-64 (the loader picks one for the CPU), so the
// compiler vectorizes these plain loops at this CPU's width. Each takes a range of rows: a lambda of
// ``at::parallel_for`` would not inherit the target.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GEMFLOW_ROWS __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define GEMFLOW_ROWS
#endif

// Sum of (x[i] - shift), or of its squares, over x[0..n), in 16 independent lanes (so the compiler vectorizes it
// without reassociating a float sum).
template <bool kSquare>
inline float lane_sum(const float* __restrict__ x, int64_t n, float shift) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = x[i + l] - shift;
      lanes[l] += kSquare ? v * v : v;
    }
  float total = 0.f;
  for (; i < n; ++i) {
    const float v = x[i] - shift;
    total += kSquare ? v * v : v;
  }
  for (float v : lanes) total += v;
  return total;
}

struct Moments {
  float mean, var;
};

inline Moments moments(const float* __restrict__ x, int64_t n) {
  const float mean = lane_sum<false>(x, n, 0.f) / static_cast<float>(n);
  return {mean, lane_sum<true>(x, n, mean) / static_cast<float>(n)};
}

struct LayerNormArgs {
  float* rows;        // (N, d): the bias is added in place
  const float* bias;  // (d,) or nullptr
  float* out;         // (N, d)
  const float *g, *b;
  int64_t d;
  float eps;
};

// rows[r] += bias (if given); out[r] = LayerNorm(rows[r]) * g + b, for r in [begin, end).
GEMFLOW_ROWS void bias_layer_norm_rows(const LayerNormArgs& a, int64_t begin, int64_t end) {
  const int64_t d = a.d;
  for (int64_t r = begin; r < end; ++r) {
    float* __restrict__ x = a.rows + r * d;
    if (a.bias != nullptr)
#pragma GCC ivdep
      for (int64_t j = 0; j < d; ++j) x[j] += a.bias[j];
    const Moments m = moments(x, d);
    const float rstd = 1.f / std::sqrt(m.var + a.eps);
    float* __restrict__ y = a.out + r * d;
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) y[j] = (x[j] - m.mean) * rstd * a.g[j] + a.b[j];
  }
}

void bias_layer_norm(const LayerNormArgs& a, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { bias_layer_norm_rows(a, begin, end); });
}

struct HeadRowsArgs {
  const float *q, *bias, *token;  // (N, d) rows, the last block's pending (d,) bias, (N, d) tokens
  float *x, *mean, *rstd;         // (N, 3d) head rows, (N,) statistics
  int64_t d, profile_size;
  Moments profile;
  float eps;
};

// The head's rows x = [q + bias, (q + bias) * token, token] and their statistics combined with the profile's
// (mean and 1 / sqrt(var + eps) of [x ++ profile]), for r in [begin, end).
GEMFLOW_ROWS void head_rows(const HeadRowsArgs& a, int64_t begin, int64_t end) {
  const int64_t d = a.d, k = 3 * d;
  const float n_c = static_cast<float>(k), n_p = static_cast<float>(a.profile_size);
  for (int64_t r = begin; r < end; ++r) {
    const float* __restrict__ qr = a.q + r * d;
    const float* __restrict__ t = a.token + r * d;
    float* __restrict__ xr = a.x + r * k;
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) {
      const float v = qr[j] + a.bias[j];
      xr[j] = v;
      xr[d + j] = v * t[j];
      xr[2 * d + j] = t[j];
    }
    const Moments c = moments(xr, k);
    const float mu = (n_c * c.mean + n_p * a.profile.mean) / (n_c + n_p);
    const float dc = c.mean - mu, dp = a.profile.mean - mu;
    const float var = (n_c * (c.var + dc * dc) + n_p * (a.profile.var + dp * dp)) / (n_c + n_p);
    a.mean[r] = mu;
    a.rstd[r] = 1.f / std::sqrt(var + a.eps);
  }
}

struct HeadAffineArgs {
  float* z;  // (N, hidden)
  const float *c, *from_profile, *wg, *mean, *rstd;
  int64_t hidden;
};

// z[r] = c + rstd[r] * (z[r] + from_profile - mean[r] * wg), in place, for r in [begin, end).
GEMFLOW_ROWS void head_affine_rows(const HeadAffineArgs& a, int64_t begin, int64_t end) {
  const int64_t hidden = a.hidden;
  for (int64_t r = begin; r < end; ++r) {
    float* __restrict__ zr = a.z + r * hidden;
    const float m = a.mean[r], s = a.rstd[r];
#pragma GCC ivdep
    for (int64_t j = 0; j < hidden; ++j) zr[j] = a.c[j] + s * (zr[j] + a.from_profile[j] - m * a.wg[j]);
  }
}

float* ptr(const at::Tensor& t) { return t.data_ptr<float>(); }

void check_inputs(const at::Tensor& token, at::TensorList keys, at::TensorList values, at::TensorList weights,
                  at::ArrayRef<double> eps) {
  const int64_t blocks = static_cast<int64_t>(keys.size());
  TORCH_CHECK(token.dim() == 2 && token.scalar_type() == at::kFloat && token.device().is_cpu(),
              "one_user_score: token must be a (N, d) float32 CPU tensor, got ", token.sizes(), " ",
              token.scalar_type());
  TORCH_CHECK(blocks >= 1 && static_cast<int64_t>(values.size()) == blocks, "one_user_score: ", keys.size(),
              " keys and ", values.size(), " values (one of each per block, at least one block)");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerBlock * blocks + kHead, "one_user_score: expected ",
              kPerBlock * blocks + kHead, " weights for ", blocks, " blocks, got ", weights.size());
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == 2 * blocks + 1, "one_user_score: expected ", 2 * blocks + 1,
              " LayerNorm eps, got ", eps.size());
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
                "one_user_score: weights must be contiguous float32 CPU tensors");
}

at::Tensor one_user_score(const at::Tensor& token, const std::optional<at::Tensor>& first_query,
                          at::TensorList keys, at::TensorList values, const at::Tensor& profile,
                          at::TensorList weights, at::ArrayRef<double> eps) {
  check_inputs(token, keys, values, weights, eps);
  const int64_t blocks = static_cast<int64_t>(keys.size());
  const int64_t n = token.size(0), d = token.size(1);
  const at::Tensor tok = token.contiguous();
  at::Tensor q = at::empty({n, d}, tok.options());   // the running rows (the residual stream)
  at::Tensor xn = at::empty({n, d}, tok.options());  // a LayerNorm's output
  const float* pending_bias = nullptr;               // the last down projection's bias: the next pass adds it

  for (int64_t i = 0; i < blocks; ++i) {
    const at::Tensor* w = weights.data() + kPerBlock * i;
    const at::Tensor &norm_q_w = w[0], &norm_q_b = w[1], &q_w = w[2], &q_b = w[3], &out_w = w[4], &out_b = w[5];
    const at::Tensor &norm2_w = w[6], &norm2_b = w[7], &up_w = w[8], &up_b = w[9], &down_w = w[10], &down_b = w[11];
    const bool cached_query = i == 0 && first_query.has_value();
    at::Tensor projected;
    if (cached_query) {
      projected = first_query->contiguous();
    } else {
      if (i == 0) q.copy_(tok);
      bias_layer_norm({ptr(q), pending_bias, ptr(xn), ptr(norm_q_w), ptr(norm_q_b), d, static_cast<float>(eps[2 * i])},
                      n);
      pending_bias = nullptr;
      projected = at::addmm(q_b, xn, q_w.t());
    }
    const at::Tensor attended = gemflow::shared_context_attend(projected, keys[i], values[i]);
    if (cached_query)
      at::addmm_out(q, tok, attended, out_w.t());  // q = token + attended Wo^T
    else
      q.addmm_(attended, out_w.t());  // q += attended Wo^T
    bias_layer_norm(
        {ptr(q), ptr(out_b), ptr(xn), ptr(norm2_w), ptr(norm2_b), d, static_cast<float>(eps[2 * i + 1])}, n);
    at::Tensor h = at::addmm(up_b, xn, up_w.t());
    at::gelu_(h);
    q.addmm_(h, down_w.t());
    pending_bias = ptr(down_b);
  }

  const at::Tensor* hw = weights.data() + kPerBlock * blocks;
  const at::Tensor &g = hw[0], &b = hw[1], &first_w = hw[2], &first_b = hw[3], &last_w = hw[4], &last_b = hw[5];
  const at::Tensor prof = profile.contiguous().view({-1});
  const int64_t k = 3 * d, hidden = first_w.size(0), p = prof.numel();
  TORCH_CHECK(first_w.size(1) == k + p && g.numel() == k + p, "one_user_score: the head's first linear takes ",
              first_w.size(1), " inputs, but the rows give ", k, " and the profile ", p);
  at::Tensor x = at::empty({n, k}, tok.options()), mean = at::empty({n}, tok.options()),
             rstd = at::empty({n}, tok.options());
  const HeadRowsArgs rows{ptr(q), pending_bias, ptr(tok), ptr(x), ptr(mean), ptr(rstd),
                          d,      p,            moments(ptr(prof), p),       static_cast<float>(eps[2 * blocks])};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { head_rows(rows, begin, end); });
  // the profile's share of the first linear, and the expansion's per-request vectors (~5 us)
  const at::Tensor from_profile = at::mv(first_w.narrow(1, k, p), prof * g.narrow(0, k, p));
  const at::Tensor wg = at::mv(first_w, g), c = first_b + at::mv(first_w, b);
  at::Tensor z = at::mm(x, (first_w.narrow(1, 0, k) * g.narrow(0, 0, k)).t());
  const HeadAffineArgs affine{ptr(z), ptr(c), ptr(from_profile), ptr(wg), ptr(mean), ptr(rstd), hidden};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { head_affine_rows(affine, begin, end); });
  at::gelu_(z);
  return at::addmm(last_b, z, last_w.t());
}

struct GatherArgs {
  const int64_t* const* ids;  // per field, (T,) ids
  const float* const* tables;  // per field, (size + 1, d): the last row is the OOV row
  const int64_t* sizes;
  int64_t fields, d;
  float* out;  // (T, d)
};

// out[r] = sum over the fields of table_f[ids_f[r]] (an id outside [0, size_f) reads the OOV row), r in [begin, end).
GEMFLOW_ROWS void gather_sum_rows(const GatherArgs& a, int64_t begin, int64_t end) {
  const int64_t d = a.d;
  for (int64_t r = begin; r < end; ++r) {
    float* __restrict__ y = a.out + r * d;
    for (int64_t f = 0; f < a.fields; ++f) {
      const int64_t id = a.ids[f][r], size = a.sizes[f];
      const float* __restrict__ row = a.tables[f] + (id >= 0 && id < size ? id : size) * d;
      if (f == 0) {
#pragma GCC ivdep
        for (int64_t j = 0; j < d; ++j) y[j] = row[j];
      } else {
#pragma GCC ivdep
        for (int64_t j = 0; j < d; ++j) y[j] += row[j];
      }
    }
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>> one_user_side(
    at::TensorList event_ids, at::TensorList event_tables, at::IntArrayRef event_sizes, const at::Tensor& norm_w,
    const at::Tensor& norm_b, double norm_eps, const std::optional<at::Tensor>& user_tokens,
    const std::optional<at::Tensor>& proj_w, const std::optional<at::Tensor>& proj_b, at::TensorList kv_weights,
    at::ArrayRef<double> kv_eps, int64_t heads) {
  const int64_t fields = static_cast<int64_t>(event_ids.size());
  TORCH_CHECK(fields >= 1 && static_cast<int64_t>(event_tables.size()) == fields &&
                  static_cast<int64_t>(event_sizes.size()) == fields,
              "one_user_side: ", event_ids.size(), " id fields, ", event_tables.size(), " tables and ",
              event_sizes.size(), " sizes (one of each per field)");
  const int64_t blocks = static_cast<int64_t>(kv_eps.size());
  TORCH_CHECK(static_cast<int64_t>(kv_weights.size()) == 4 * blocks, "one_user_side: expected ", 4 * blocks,
              " K/V weights for ", blocks, " blocks, got ", kv_weights.size());
  const int64_t d = event_tables[0].size(1), t = event_ids[0].numel();
  std::vector<at::Tensor> ids(fields), tables(fields);
  std::vector<const int64_t*> id_ptrs(fields);
  std::vector<const float*> table_ptrs(fields);
  for (int64_t f = 0; f < fields; ++f) {
    TORCH_CHECK(event_ids[f].scalar_type() == at::kLong && event_ids[f].numel() == t,
                "one_user_side: every id field must be int64 with one id per event (", t, ")");
    TORCH_CHECK(event_tables[f].scalar_type() == at::kFloat && event_tables[f].dim() == 2 &&
                    event_tables[f].size(1) == d && event_tables[f].size(0) == event_sizes[f] + 1,
                "one_user_side: table ", f, " must be float32 (size + 1, ", d, "), got ", event_tables[f].sizes());
    ids[f] = event_ids[f].contiguous();
    tables[f] = event_tables[f].contiguous();
    id_ptrs[f] = ids[f].data_ptr<int64_t>();
    table_ptrs[f] = tables[f].data_ptr<float>();
  }
  const bool with_tokens = user_tokens.has_value() && proj_w.has_value() && proj_b.has_value();
  const int64_t k = with_tokens ? user_tokens->size(0) : 0, c = k + t;
  const at::TensorOptions opts = event_tables[0].options();
  at::Tensor context = at::empty({c, d}, opts);
  if (with_tokens) {  // the user's cached tokens, projected, in front of the events
    at::Tensor front = context.narrow(0, 0, k);
    at::addmm_out(front, *proj_b, user_tokens->contiguous(), proj_w->t());
  }
  if (t > 0) {
    at::Tensor summed = at::empty({t, d}, opts);
    const GatherArgs gather{id_ptrs.data(), table_ptrs.data(), event_sizes.data(), fields, d, ptr(summed)};
    at::parallel_for(0, t, kGrain, [&](int64_t begin, int64_t end) { gather_sum_rows(gather, begin, end); });
    bias_layer_norm({ptr(summed), nullptr, ptr(context) + k * d, ptr(norm_w), ptr(norm_b), d,
                     static_cast<float>(norm_eps)},
                    t);
  }
  std::vector<at::Tensor> kv(blocks);
  at::Tensor xn = at::empty({c, d}, opts);
  for (int64_t i = 0; i < blocks; ++i) {
    const at::Tensor* w = kv_weights.data() + 4 * i;  // norm w/b, kv W/b
    bias_layer_norm({ptr(context), nullptr, ptr(xn), ptr(w[0]), ptr(w[1]), d, static_cast<float>(kv_eps[i])}, c);
    kv[i] = at::addmm(w[3], xn, w[2].t()).view({c, 2, heads, d / heads});
  }
  return {context, kv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemflow, m) {
  m.def("one_user_side(Tensor[] event_ids, Tensor[] event_tables, int[] event_sizes, Tensor norm_w, "
        "Tensor norm_b, float norm_eps, Tensor? user_tokens, Tensor? proj_w, Tensor? proj_b, Tensor[] kv_weights, "
        "float[] kv_eps, int heads) -> (Tensor, Tensor[])");
  m.def("one_user_score(Tensor token, Tensor? first_query, Tensor[] keys, Tensor[] values, Tensor profile, "
        "Tensor[] weights, float[] eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemflow, CPU, m) {
  m.impl("one_user_side", one_user_side);
  m.impl("one_user_score", one_user_score);
}
