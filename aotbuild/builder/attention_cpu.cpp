// aotbuild::attention: flash attention for x86 CPUs with AVX512-BF16 (bf16 in, float32
// accumulation, bf16 out), which compiled code calls in place of ATen's CPU flash attention
// (a third of the GEMM's speed here at 1,000-4,000 tokens). No mask, no dropout, not causal.
// Registered when the library is loaded (torch.ops.load_library); the build registers its fake.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t QB = 64;   // queries a task holds
constexpr int64_t KB = 256;  // keys a block of scores holds
constexpr int64_t KPAD = 64; // keys are packed in groups of this many

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp for x <= 0 (scores minus their row's max), relative error ~1e-7.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline int32_t pair_at(const at::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// S[r][c] = scale * sum_d Q[r][d] K[c][d] for 4 query rows and 64 keys.
// kp: keys packed as [D/2][Lkp][2]; the pair p of key c at kp + (p*Lkp + c)*2.
inline void scores_4x64(const at::BFloat16* const q[4], const at::BFloat16* kp, int64_t lkp,
                        int64_t pairs, float scale, float* s, int64_t lds) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    const at::BFloat16* kr = kp + p * lkp * 2;
    __m512bh b[4];
    for (int c = 0; c < 4; c++) b[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
    for (int r = 0; r < 4; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(q[r] + 2 * p));
      for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * lds + c * 16, _mm512_mul_ps(acc[r][c], vs));
}

// O[r][:16*NV] = alpha[r] * O[r] + sum_j P[r][j] V[j][:] for 4 rows.
// vp: values packed as [Lkp/2][Dp][2]; pk: the block's P, bf16 [4][ldp].
template <int NV>
inline void update_4(const at::BFloat16* pk, int64_t ldp, const at::BFloat16* vp, int64_t dp,
                     int64_t pairs, const float* alpha, float* o, int64_t ldo) {
  __m512 acc[4][NV];
  for (int r = 0; r < 4; r++) {
    __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + v * 16), a);
  }
  for (int64_t p = 0; p < pairs; p++) {
    const at::BFloat16* vr = vp + p * dp * 2;
    __m512bh b[NV];
    for (int v = 0; v < NV; v++) b[v] = (__m512bh)_mm512_loadu_si512(vr + v * 32);
    for (int r = 0; r < 4; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(pk + r * ldp + 2 * p));
      for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < 4; r++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + r * ldo + v * 16, acc[r][v]);
}

// update_4 over `width` of the values' dims (16 to 64).
inline void update_rows(const at::BFloat16* pk, int64_t ldp, const at::BFloat16* vp, int64_t dp, int64_t width,
                        int64_t pairs, const float* alpha, float* o, int64_t ldo) {
  switch (width / 16) {
    case 4: update_4<4>(pk, ldp, vp, dp, pairs, alpha, o, ldo); break;
    case 3: update_4<3>(pk, ldp, vp, dp, pairs, alpha, o, ldo); break;
    case 2: update_4<2>(pk, ldp, vp, dp, pairs, alpha, o, ldo); break;
    default: update_4<1>(pk, ldp, vp, dp, pairs, alpha, o, ldo); break;
  }
}

}  // namespace

// q [B, H, Lq, D], k and v [B, H, Lk, D], bf16, D even and at most 512, any strides.
// Returns [B, Lq, H, D]: what diffusers makes of an attention's output next (its transpose).
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  const at::Tensor q = query.stride(-1) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(-1) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(-1) == 1 ? value : value.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "aotbuild::attention takes bf16 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "aotbuild::attention takes [batch, heads, tokens, head size]");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
  TORCH_CHECK(D % 2 == 0 && D <= 512 && k.size(3) == D && v.size(3) == D, "aotbuild::attention: head size ", D,
              " (even, at most 512, the same for query, key and value)");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H && v.size(2) == Lk,
              "aotbuild::attention: key and value of the query's batch and heads, and of one length");
  const int64_t Dp = round_up(D, 16), Lkp = round_up(Lk, KPAD), pairs_d = D / 2;

  auto opts = q.options();
  at::Tensor kpack = at::empty({B * H, pairs_d, Lkp, 2}, opts);
  at::Tensor vpack = at::empty({B * H, Lkp / 2, Dp, 2}, opts);
  at::Tensor out = at::empty({B, Lq, H, D}, opts);
  auto* kp_all = kpack.data_ptr<at::BFloat16>();
  auto* vp_all = vpack.data_ptr<at::BFloat16>();
  const auto* qd = q.const_data_ptr<at::BFloat16>();
  const auto* kd = k.const_data_ptr<at::BFloat16>();
  const auto* vd = v.const_data_ptr<at::BFloat16>();
  auto* od = out.data_ptr<at::BFloat16>();

  const int64_t kchunks = Lkp / KPAD;  // packed in chunks of keys: one head (a VAE's) spans both cores
  at::parallel_for(0, B * H * kchunks, 1, [&](int64_t begin, int64_t end) {
    const at::BFloat16 zero(0.0f);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bh = task / kchunks, j0 = task % kchunks * KPAD, b = bh / H, h = bh % H;
      const at::BFloat16* ks = kd + b * k.stride(0) + h * k.stride(1);
      const at::BFloat16* vs = vd + b * v.stride(0) + h * v.stride(1);
      at::BFloat16* kp = kp_all + bh * pairs_d * Lkp * 2;
      at::BFloat16* vp = vp_all + bh * (Lkp / 2) * Dp * 2;
      for (int64_t j = j0; j < j0 + KPAD; j++) {
        for (int64_t p = 0; p < pairs_d; p++) {
          at::BFloat16* dst = kp + (p * Lkp + j) * 2;
          dst[0] = j < Lk ? ks[j * k.stride(2) + 2 * p] : zero;
          dst[1] = j < Lk ? ks[j * k.stride(2) + 2 * p + 1] : zero;
        }
        for (int64_t d = 0; d < Dp; d++)
          vp[((j / 2) * Dp + d) * 2 + (j % 2)] = (j < Lk && d < D) ? vs[j * v.stride(2) + d] : zero;
      }
    }
  });

  const int64_t qblocks = (Lq + QB - 1) / QB;
  at::parallel_for(0, B * H * qblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(QB * KB), o(QB * Dp), m(QB), l(QB), alpha(QB);
    std::vector<at::BFloat16> pk(QB * KB);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bh = task / qblocks, qb = task % qblocks, b = bh / H, h = bh % H;
      const int64_t q0 = qb * QB, nq = std::min(QB, Lq - q0), rows = round_up(nq, 4);
      const at::BFloat16* kp = kp_all + bh * pairs_d * Lkp * 2;
      const at::BFloat16* vp = vp_all + bh * (Lkp / 2) * Dp * 2;
      const at::BFloat16* qs = qd + b * q.stride(0) + h * q.stride(1);
      std::fill(o.begin(), o.end(), 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t k0 = 0; k0 < Lkp; k0 += KB) {
        const int64_t nk = std::min(KB, Lkp - k0), valid = std::min(nk, Lk - k0);
        for (int64_t c = 0; c < nk; c += 64)  // each 64 keys' pairs stay in cache across the rows
          for (int64_t r = 0; r < rows; r += 4) {
            const at::BFloat16* qr[4];
            for (int i = 0; i < 4; i++) qr[i] = qs + (q0 + std::min(r + i, nq - 1)) * q.stride(2);
            scores_4x64(qr, kp + (k0 + c) * 2, Lkp, pairs_d, (float)scale, s.data() + r * KB + c, KB);
          }
        for (int64_t r = 0; r < rows; r++) {
          float* sr = s.data() + r * KB;
          for (int64_t c = valid; c < nk; c++) sr[c] = -INFINITY;
          __m512 mx = _mm512_set1_ps(-INFINITY);
          for (int64_t c = 0; c < nk; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c));
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
          const __m512 vm = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          at::BFloat16* pr = pk.data() + r * KB;
          for (int64_t c = 0; c < nk; c += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + c), vm));
            __m256bh eb = _mm512_cvtneps_pbh(e);
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i*)(pr + c), (__m256i)eb);
          }
          alpha[r] = std::exp(m[r] - m_new);
          l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
          m[r] = m_new;
        }
        for (int64_t d0 = 0; d0 < Dp; d0 += 64)  // each 64 dims of the block's values stay in cache across the rows
          for (int64_t r = 0; r < rows; r += 4)
            update_rows(pk.data() + r * KB, KB, vp + ((k0 / 2) * Dp + d0) * 2, Dp, std::min<int64_t>(64, Dp - d0),
                        nk / 2, alpha.data() + r, o.data() + r * Dp + d0, Dp);
      }
      for (int64_t r = 0; r < nq; r++) {
        at::BFloat16* dst = od + ((b * Lq + q0 + r) * H + h) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = at::BFloat16(o[r * Dp + d] * inv);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(aotbuild, m) { m.def("attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(aotbuild, CPU, m) { m.impl("attention", &attention); }
