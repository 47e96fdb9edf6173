// aotbuild::attention: flash attention for x86 CPUs with AVX-512 (bf16 with AVX512-BF16's dot
// products, or float32; float32 accumulation), which compiled code calls in place of ATen's CPU
// flash attention (a third of the GEMM's speed here at 1,000-4,000 tokens). No mask, no dropout,
// not causal.
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

// exp for x <= 0 (scores minus their row's max), relative error ~1e-7; NaN stays NaN (max
// returns its second operand where one is NaN), as in ATen's.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
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

// The 32 bits at p: a pair of bf16 values (a dot product's two terms), or one float.
template <typename T>
inline __m512i broadcast32(const T* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc += a . b over the 32 bits of each lane: two bf16 products (AVX512-BF16), or one float's.
template <typename T>
inline __m512 dot(__m512 acc, __m512i a, __m512i b);
template <>
inline __m512 dot<at::BFloat16>(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
template <>
inline __m512 dot<float>(__m512 acc, __m512i a, __m512i b) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

// W: the values a lane's 32 bits hold (2 bf16, 1 float); keys and values are packed so that a
// dot's terms are adjacent: keys as [D/W][Lkp][W], values as [Lkp/W][Dp][W].
template <typename T>
constexpr int64_t W = sizeof(float) / sizeof(T);

// S[r][c] = scale * sum_d Q[r][d] K[c][d] for 4 query rows and 64 keys.
template <typename T>
inline void scores_4x64(const T* const q[4], const T* kp, int64_t lkp, int64_t steps, float scale, float* s,
                        int64_t lds) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; p++) {
    const T* kr = kp + p * lkp * W<T>;
    __m512i b[4];
    for (int c = 0; c < 4; c++) b[c] = _mm512_loadu_si512(kr + c * 16 * W<T>);
    for (int r = 0; r < 4; r++) {
      __m512i a = broadcast32(q[r] + W<T> * p);
      for (int c = 0; c < 4; c++) acc[r][c] = dot<T>(acc[r][c], a, b[c]);
    }
  }
  __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * lds + c * 16, _mm512_mul_ps(acc[r][c], vs));
}

// O[r][:16*NV] = alpha[r] * O[r] + sum_j P[r][j] V[j][:] for 4 rows; pk: the block's P, [4][ldp].
template <typename T, int NV>
inline void update_4(const T* pk, int64_t ldp, const T* vp, int64_t dp, int64_t steps, const float* alpha, float* o,
                     int64_t ldo) {
  __m512 acc[4][NV];
  for (int r = 0; r < 4; r++) {
    __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + v * 16), a);
  }
  for (int64_t p = 0; p < steps; p++) {
    const T* vr = vp + p * dp * W<T>;
    __m512i b[NV];
    for (int v = 0; v < NV; v++) b[v] = _mm512_loadu_si512(vr + v * 16 * W<T>);
    for (int r = 0; r < 4; r++) {
      __m512i a = broadcast32(pk + r * ldp + W<T> * p);
      for (int v = 0; v < NV; v++) acc[r][v] = dot<T>(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < 4; r++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + r * ldo + v * 16, acc[r][v]);
}

// update_4 over `width` of the values' dims (16 to 64).
template <typename T>
inline void update_rows(const T* pk, int64_t ldp, const T* vp, int64_t dp, int64_t width, int64_t steps,
                        const float* alpha, float* o, int64_t ldo) {
  switch (width / 16) {
    case 4: update_4<T, 4>(pk, ldp, vp, dp, steps, alpha, o, ldo); break;
    case 3: update_4<T, 3>(pk, ldp, vp, dp, steps, alpha, o, ldo); break;
    case 2: update_4<T, 2>(pk, ldp, vp, dp, steps, alpha, o, ldo); break;
    default: update_4<T, 1>(pk, ldp, vp, dp, steps, alpha, o, ldo); break;
  }
}

// 16 probabilities stored as the values' type.
inline void store16(at::BFloat16* p, __m512 e) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(e)); }
inline void store16(float* p, __m512 e) { _mm512_storeu_ps(p, e); }

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
  const int64_t Dp = round_up(D, 16), Lkp = round_up(Lk, KPAD), steps_d = D / W<T>;
  at::Tensor kpack = at::empty({B * H, steps_d, Lkp, W<T>}, q.options());
  at::Tensor vpack = at::empty({B * H, Lkp / W<T>, Dp, W<T>}, q.options());
  T* kp_all = kpack.data_ptr<T>();
  T* vp_all = vpack.data_ptr<T>();
  const T* qd = q.const_data_ptr<T>();
  const T* kd = k.const_data_ptr<T>();
  const T* vd = v.const_data_ptr<T>();
  T* od = out.data_ptr<T>();

  const int64_t kchunks = Lkp / KPAD;  // packed in chunks of keys: one head (a VAE's) spans both cores
  at::parallel_for(0, B * H * kchunks, 1, [&](int64_t begin, int64_t end) {
    const T zero(0.0f);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bh = task / kchunks, j0 = task % kchunks * KPAD, b = bh / H, h = bh % H;
      const T* ks = kd + b * k.stride(0) + h * k.stride(1);
      const T* vs = vd + b * v.stride(0) + h * v.stride(1);
      T* kp = kp_all + bh * steps_d * Lkp * W<T>;
      T* vp = vp_all + bh * (Lkp / W<T>) * Dp * W<T>;
      for (int64_t j = j0; j < j0 + KPAD; j++) {
        for (int64_t d = 0; d < D; d++)
          kp[((d / W<T>) * Lkp + j) * W<T> + d % W<T>] = j < Lk ? ks[j * k.stride(2) + d] : zero;
        for (int64_t d = 0; d < Dp; d++)
          vp[((j / W<T>) * Dp + d) * W<T> + j % W<T>] = (j < Lk && d < D) ? vs[j * v.stride(2) + d] : zero;
      }
    }
  });

  const int64_t qblocks = (Lq + QB - 1) / QB;
  at::parallel_for(0, B * H * qblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(QB * KB), o(QB * Dp), m(QB), l(QB), alpha(QB);
    std::vector<T> pk(QB * KB);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bh = task / qblocks, qb = task % qblocks, b = bh / H, h = bh % H;
      const int64_t q0 = qb * QB, nq = std::min(QB, Lq - q0), rows = round_up(nq, 4);
      const T* kp = kp_all + bh * steps_d * Lkp * W<T>;
      const T* vp = vp_all + bh * (Lkp / W<T>) * Dp * W<T>;
      const T* qs = qd + b * q.stride(0) + h * q.stride(1);
      std::fill(o.begin(), o.end(), 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t k0 = 0; k0 < Lkp; k0 += KB) {
        const int64_t nk = std::min(KB, Lkp - k0), valid = std::min(nk, Lk - k0);
        for (int64_t c = 0; c < nk; c += 64)  // each 64 keys stay in cache across the rows
          for (int64_t r = 0; r < rows; r += 4) {
            const T* qr[4];
            for (int i = 0; i < 4; i++) qr[i] = qs + (q0 + std::min(r + i, nq - 1)) * q.stride(2);
            scores_4x64<T>(qr, kp + (k0 + c) * W<T>, Lkp, steps_d, (float)scale, s.data() + r * KB + c, KB);
          }
        for (int64_t r = 0; r < rows; r++) {
          float* sr = s.data() + r * KB;
          for (int64_t c = valid; c < nk; c++) sr[c] = -INFINITY;
          __m512 mx = _mm512_set1_ps(-INFINITY);
          for (int64_t c = 0; c < nk; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c));
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
          const __m512 vm = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (int64_t c = 0; c < nk; c += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + c), vm));
            sum = _mm512_add_ps(sum, e);
            store16(pk.data() + r * KB + c, e);
          }
          alpha[r] = std::exp(m[r] - m_new);
          l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
          m[r] = m_new;
        }
        for (int64_t d0 = 0; d0 < Dp; d0 += 64)  // each 64 dims of the block's values stay in cache across the rows
          for (int64_t r = 0; r < rows; r += 4)
            update_rows<T>(pk.data() + r * KB, KB, vp + ((k0 / W<T>) * Dp + d0) * W<T>, Dp,
                           std::min<int64_t>(64, Dp - d0), nk / W<T>, alpha.data() + r, o.data() + r * Dp + d0, Dp);
      }
      for (int64_t r = 0; r < nq; r++) {
        T* dst = od + ((b * Lq + q0 + r) * H + h) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = T(o[r * Dp + d] * inv);
      }
    }
  });
}

}  // namespace

// q [B, H, Lq, D], k and v [B, H, Lk, D], bf16 (D even) or float32, D at most 512, any strides.
// Returns [B, Lq, H, D]: what diffusers makes of an attention's output next (its transpose).
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  const at::Tensor q = query.stride(-1) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(-1) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(-1) == 1 ? value : value.contiguous();
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype &&
              v.scalar_type() == dtype, "aotbuild::attention takes bf16 or float32, the same for all three");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "aotbuild::attention takes [batch, heads, tokens, head size]");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
  TORCH_CHECK((dtype == at::kFloat || D % 2 == 0) && D <= 512 && k.size(3) == D && v.size(3) == D,
              "aotbuild::attention: head size ", D, " (at most 512, even in bf16, the same for query, key and value)");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H && v.size(2) == Lk,
              "aotbuild::attention: key and value of the query's batch and heads, and of one length");
  at::Tensor out = at::empty({B, Lq, H, D}, q.options());
  if (Lk == 0) return out.zero_();  // no key to attend to: ATen's zeros
  if (dtype == at::kBFloat16)
    attend<at::BFloat16>(q, k, v, scale, out);
  else
    attend<float>(q, k, v, scale, out);
  return out;
}

TORCH_LIBRARY(aotbuild, m) { m.def("attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(aotbuild, CPU, m) { m.impl("attention", &attention); }
