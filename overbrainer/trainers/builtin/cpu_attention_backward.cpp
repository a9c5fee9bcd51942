// The backward of causal attention, bf16 on a CPU whose oneDNN has a bf16 brgemm (AMX or
// AVX-512 BF16): cpu_attention.py builds it on first use and calls it where it can.
//
// One task per (sequence, key head). Its G query heads are stacked as rows (position t, head
// g) -> row t*G+g, so every product is against the shared key head. For each tile of 64 keys,
// the rows at or after its first position are taken by chunks of up to 256: the scores and
// dO·Vᵀ come out of brgemm in float32 (bf16 operands, float32 sums and results: the scores
// are never rounded to bf16 before the log-sum-exp is taken off them), P and dS are computed
// in one vectorized pass, and dQ += dS·K, dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS are summed in float32
// (the transposed sides are the caller's, made once, so that no tile is ever transposed).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using at::BFloat16;
using at::native::cpublas::brgemm;
using at::native::cpublas::brgemm_release;
using at::native::cpublas::could_pack;
using at::native::cpublas::pack;

constexpr int64_t TILE = 64;

// e^x for x <= 88, in a form the compiler vectorizes (Cephes' expf: 2^n times a polynomial)
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3333337680e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

// x rounded to the nearest bf16 (ties to even), as its bits (x is never NaN here)
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// one row of a chunk against a tile of keys: P = e^(s·scale - lse) for the keys at or before
// the row's position (else 0) and dS = P (dP - delta) · scale (the scores' gradient, scaled
// for dQ and dK), both rounded to bf16. Vectorized (built with -fno-trapping-math: no
// branch, no call)
void probabilities(const float* __restrict__ s, const float* __restrict__ dp, const float* __restrict__ keys,
                   float lse, float delta, float position, float scale, uint16_t* __restrict__ p_out,
                   uint16_t* __restrict__ ds_out) {
  for (int64_t a = 0; a < TILE; ++a) {
    const float e = exp_approx(s[a] * scale - lse);
    const float p = keys[a] <= position ? e : 0.0f;
    p_out[a] = bf16_bits(p);
    ds_out[a] = bf16_bits(p * (dp[a] - delta) * scale);
  }
}

// brgemm's B operand from a (k x n) row-major matrix with leading dimension ld (n <= 64):
// VNNI-packed where the CPU wants it, else copied as it is
void as_b(const BFloat16* in, int64_t k, int64_t n, int64_t ld, bool vnni, BFloat16* out) {
  if (vnni) {
    pack(k, n, ld, n, at::kBFloat16, at::kBFloat16, in, out);
  } else {
    for (int64_t i = 0; i < k; ++i) std::memcpy(out + i * n, in + i * ld, sizeof(BFloat16) * n);
  }
}

constexpr int64_t CHUNK = 256;  // rows a product takes at once (brgemm's M, or K for dK and dV)

// One task: Q, dO (R x D) and their transposes (D x R); K, V (Tk x D) and their transposes
// (D x Tk); lse, delta (R). Out: dQ (R x D), dKᵀ and dVᵀ (D x Tk), float32, accumulated.
void backward_of(const BFloat16* Q, const BFloat16* Qt, const BFloat16* dO, const BFloat16* dOt, const BFloat16* K,
                 const BFloat16* Kt, const BFloat16* Vt, const float* lse, const float* delta, float* dQ, float* dKt,
                 float* dVt, int64_t R, int64_t Tk, int64_t D, int64_t groups, int64_t length, float scale, bool vnni) {
  const int64_t DB = std::min<int64_t>(D, TILE), ND = D / DB;
  const int64_t rows_used = std::min(R, (length * groups + TILE - 1) / TILE * TILE);
  std::vector<float> S(CHUNK * TILE), dP(CHUNK * TILE), keys(TILE);
  std::vector<BFloat16> P(CHUNK * TILE), dS(CHUNK * TILE), Pb(CHUNK * TILE), dSb(CHUNK * TILE);
  std::vector<BFloat16> ktB(D * TILE), vtB(D * TILE), kB(TILE * D);
  for (int64_t k0 = 0; k0 < std::min(length, Tk); k0 += TILE) {
    // this tile of keys as B operands: Kᵀ and Vᵀ (D x 64) for the scores and dO·Vᵀ, K (64 x DB
    // blocks) for dQ += dS·K
    as_b(Kt + k0, D, TILE, Tk, vnni, ktB.data());
    as_b(Vt + k0, D, TILE, Tk, vnni, vtB.data());
    for (int64_t nd = 0; nd < ND; ++nd) as_b(K + k0 * D + nd * DB, TILE, DB, D, vnni, kB.data() + nd * TILE * DB);
    for (int64_t a = 0; a < TILE; ++a) keys[a] = static_cast<float>(k0 + a);
    // the rows at or after these keys' first position, by chunks
    for (int64_t c0 = (k0 * groups) / TILE * TILE; c0 < rows_used; c0 += CHUNK) {
      const int64_t M = std::min(CHUNK, rows_used - c0);
      brgemm(M, TILE, D, D, TILE, TILE, false, Q + c0 * D, ktB.data(), S.data(), vnni);
      brgemm(M, TILE, D, D, TILE, TILE, false, dO + c0 * D, vtB.data(), dP.data(), vnni);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t r = c0 + i, t = r / groups;
        probabilities(S.data() + i * TILE, dP.data() + i * TILE, keys.data(), lse[r], delta[r],
                      t < length ? static_cast<float>(t) : -1.0f,  // a padding row sees no key
                      scale, reinterpret_cast<uint16_t*>(P.data() + i * TILE),
                      reinterpret_cast<uint16_t*>(dS.data() + i * TILE));
      }
      // dQ (rows x D) += dS·K; dVᵀ and dKᵀ (D x keys) += dOᵀ·P and Qᵀ·dS
      for (int64_t nd = 0; nd < ND; ++nd)
        brgemm(M, DB, TILE, TILE, DB, D, true, dS.data(), kB.data() + nd * TILE * DB, dQ + c0 * D + nd * DB, vnni);
      as_b(P.data(), M, TILE, TILE, vnni, Pb.data());
      as_b(dS.data(), M, TILE, TILE, vnni, dSb.data());
      brgemm(D, TILE, M, R, TILE, Tk, true, dOt + c0, Pb.data(), dVt + k0, vnni);
      brgemm(D, TILE, M, R, TILE, Tk, true, Qt + c0, dSb.data(), dKt + k0, vnni);
    }
  }
}

// (dQ (tasks, R, D), dKᵀ and dVᵀ (tasks, D, Tk)), float32. q and dout (tasks, R, D),
// R a multiple of 64 (rows past length*groups are padding and ignored), and their transposes;
// k (tasks, Tk, D), Tk a multiple of 64, and the transposes of k and v; lse and delta
// (tasks, R) float32
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& q, const at::Tensor& qt, const at::Tensor& dout, const at::Tensor& doutt, const at::Tensor& k,
    const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& lse, const at::Tensor& delta, int64_t groups,
    int64_t length, double scale) {
  for (const auto* x : {&q, &qt, &dout, &doutt, &k, &kt, &vt})
    TORCH_CHECK(x->scalar_type() == at::kBFloat16 && x->is_contiguous() && x->dim() == 3, "contiguous bf16 (tasks, n, m)");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat && lse.is_contiguous() &&
              delta.is_contiguous(), "contiguous float32 lse and delta");
  const int64_t tasks = q.size(0), R = q.size(1), D = q.size(2), Tk = k.size(1);
  TORCH_CHECK(R % TILE == 0 && Tk % TILE == 0 && D % 16 == 0 && (D <= TILE || D % TILE == 0), "padded shapes");
  TORCH_CHECK(qt.size(1) == D && qt.size(2) == R && kt.size(1) == D && kt.size(2) == Tk && vt.sizes() == kt.sizes() &&
              dout.sizes() == q.sizes() && doutt.sizes() == qt.sizes() && lse.size(1) == R && delta.sizes() == lse.sizes(),
              "matching shapes");
  auto dQ = at::zeros({tasks, R, D}, q.options().dtype(at::kFloat));
  auto dKt = at::zeros({tasks, D, Tk}, q.options().dtype(at::kFloat));
  auto dVt = at::zeros({tasks, D, Tk}, q.options().dtype(at::kFloat));
  const bool vnni = could_pack(at::kBFloat16);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rows = i * R * D, keys = i * Tk * D;
      backward_of(q.data_ptr<BFloat16>() + rows, qt.data_ptr<BFloat16>() + rows, dout.data_ptr<BFloat16>() + rows,
                  doutt.data_ptr<BFloat16>() + rows, k.data_ptr<BFloat16>() + keys, kt.data_ptr<BFloat16>() + keys,
                  vt.data_ptr<BFloat16>() + keys, lse.data_ptr<float>() + i * R, delta.data_ptr<float>() + i * R,
                  dQ.data_ptr<float>() + rows, dKt.data_ptr<float>() + keys, dVt.data_ptr<float>() + keys, R, Tk, D,
                  groups, length, static_cast<float>(scale), vnni);
    }
    brgemm_release(vnni);
  });
  return {dQ, dKt, dVt};
}

// whether this CPU's oneDNN runs a bf16 brgemm (AMX, AVX-512 BF16)
bool can_run() { return could_pack(at::kBFloat16); }

}  // namespace

TORCH_LIBRARY(overbrainer_cpu, m) {
  m.def("causal_attention_backward(Tensor q, Tensor qt, Tensor dout, Tensor doutt, Tensor k, Tensor kt, Tensor vt, "
        "Tensor lse, Tensor delta, int groups, int length, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("can_run() -> bool", &can_run);
}

TORCH_LIBRARY_IMPL(overbrainer_cpu, CPU, m) {
  m.impl("causal_attention_backward", &causal_attention_backward);
}
