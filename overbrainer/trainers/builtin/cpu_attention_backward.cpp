// The backward of causal attention, bf16 on a CPU whose oneDNN has a bf16 brgemm (AMX or
// AVX-512 BF16): cpu_attention.py builds it on first use and calls it where it can.
//
// One task per (sequence, key head). Its G query heads are stacked as rows (position t, head
// g) -> row t*G+g, so every product is against the shared key head. For each tile of 64 keys,
// the rows at or after its first position are taken by chunks of up to 256: the scores and
// dO·Vᵀ come out of brgemm in float32 (bf16 operands, float32 sums and results: the scores
// are never rounded to bf16 before the log-sum-exp is taken off them), P and dS are computed
// in one vectorized pass, and dQ += dS·K, dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS are summed in float32
// (each task lays out its rows and their transposes once, so that no tile is ever transposed).

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

// e^x, in a form the compiler vectorizes (Cephes' expf: 2^n times a polynomial); x is clamped
// to [-87, 88] (a masked entry may be far out: its value is dropped)
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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

// the widest block of at most 64 columns that divides a head size (a multiple of 16): what
// a packed B operand takes
int64_t column_block(int64_t D) {
  for (int64_t n : {64, 48, 32})
    if (D % n == 0) return n;
  return 16;
}

constexpr int64_t CHUNK = 256;  // rows a product takes at once (brgemm's M, or K for dK and dV)

// One task: Q, dO (R x D) and their transposes (D x R); K, V (Tk x D) and their transposes
// (D x Tk); lse, delta (R). Out: dQ (R x D), dKᵀ and dVᵀ (D x Tk), float32, accumulated.
void backward_of(const BFloat16* Q, const BFloat16* Qt, const BFloat16* dO, const BFloat16* dOt, const BFloat16* K,
                 const BFloat16* Kt, const BFloat16* Vt, const float* lse, const float* delta, float* dQ, float* dKt,
                 float* dVt, int64_t R, int64_t Tk, int64_t D, int64_t groups, int64_t length, float scale, bool vnni) {
  const int64_t DB = column_block(D), ND = D / DB;
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

// a (B, heads, T, D) tensor's element strides, its last dimension dense
struct Strided {
  const BFloat16* data;
  int64_t b, h, t;
  explicit Strided(const at::Tensor& x)
      : data(x.data_ptr<BFloat16>()), b(x.stride(0)), h(x.stride(1)), t(x.stride(2)) {}
  const BFloat16* row(int64_t i, int64_t head, int64_t pos) const { return data + i * b + head * h + pos * t; }
};

// (dq, dk, dv) in bf16, laid out as q, k and v (dense): q, out and dout (B, H, T, D), k and v
// (B, KVH, T, D), each with a dense last dimension and any other strides; lse (B, H, T) float32.
// Each task lays out its own rows, transposes and padding (in its thread), and writes its own
// heads of the results.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
    const at::Tensor& lse_in, const at::Tensor& dout_in, double scale) {
  auto dense_last = [](const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); };
  const auto q = dense_last(q_in), k = dense_last(k_in), v = dense_last(v_in), out = dense_last(out_in),
             dout = dense_last(dout_in);
  const auto lse = lse_in.contiguous();
  for (const auto* x : {&q, &k, &v, &out, &dout})
    TORCH_CHECK(x->scalar_type() == at::kBFloat16 && x->dim() == 4, "bf16 (batch, heads, length, head size)");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3, "float32 lse (batch, heads, length)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KVH = k.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == D &&
              out.sizes() == q.sizes() && dout.sizes() == q.sizes() && lse.size(0) == B && lse.size(1) == H &&
              lse.size(2) == T, "matching shapes");
  TORCH_CHECK(D % 16 == 0 && D <= 512, "a head size that is a multiple of 16, at most 512");
  const int64_t G = H / KVH, R = (T * G + TILE - 1) / TILE * TILE, Tk = (T + TILE - 1) / TILE * TILE;
  auto dq = at::empty({B, H, T, D}, q.options());
  auto dk = at::empty({B, KVH, T, D}, q.options());
  auto dv = at::empty({B, KVH, T, D}, q.options());
  const Strided Qs(q), Ks(k), Vs(v), Os(out), dOs(dout);
  const float* L = lse.data_ptr<float>();
  auto* dQo = reinterpret_cast<uint16_t*>(dq.data_ptr<BFloat16>());
  auto* dKo = reinterpret_cast<uint16_t*>(dk.data_ptr<BFloat16>());
  auto* dVo = reinterpret_cast<uint16_t*>(dv.data_ptr<BFloat16>());
  const bool vnni = could_pack(at::kBFloat16);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> Qr(R * D), Qt(D * R), dOr(R * D), dOt(D * R), Kr(Tk * D), Kt(D * Tk), Vt(D * Tk);
    std::vector<float> lse_r(R), delta_r(R), dQ(R * D), dKt(D * Tk), dVt(D * Tk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / KVH, kvh = task % KVH;
      // rows (t, g) -> t*G + g, zero past the last; lse and delta = rowsum(dO ∘ O) by row
      std::fill(Qr.begin(), Qr.end(), BFloat16(0.0f));
      std::fill(dOr.begin(), dOr.end(), BFloat16(0.0f));
      std::fill(lse_r.begin(), lse_r.end(), 0.0f);
      std::fill(delta_r.begin(), delta_r.end(), 0.0f);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = t * G + g, head = kvh * G + g;
          const BFloat16* qrow = Qs.row(i, head, t);
          const BFloat16* drow = dOs.row(i, head, t);
          const BFloat16* orow = Os.row(i, head, t);
          std::memcpy(Qr.data() + r * D, qrow, sizeof(BFloat16) * D);
          std::memcpy(dOr.data() + r * D, drow, sizeof(BFloat16) * D);
          float sum = 0.0f;
          for (int64_t d = 0; d < D; ++d) sum += static_cast<float>(drow[d]) * static_cast<float>(orow[d]);
          delta_r[r] = sum;
          lse_r[r] = L[(i * H + head) * T + t];
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) Qt[d * R + r] = Qr[r * D + d], dOt[d * R + r] = dOr[r * D + d];
      std::fill(Kr.begin(), Kr.end(), BFloat16(0.0f));
      std::fill(Kt.begin(), Kt.end(), BFloat16(0.0f));
      std::fill(Vt.begin(), Vt.end(), BFloat16(0.0f));
      for (int64_t t = 0; t < T; ++t) {
        const BFloat16* krow = Ks.row(i, kvh, t);
        const BFloat16* vrow = Vs.row(i, kvh, t);
        std::memcpy(Kr.data() + t * D, krow, sizeof(BFloat16) * D);
        for (int64_t d = 0; d < D; ++d) Kt[d * Tk + t] = krow[d], Vt[d * Tk + t] = vrow[d];
      }
      std::fill(dQ.begin(), dQ.end(), 0.0f);
      std::fill(dKt.begin(), dKt.end(), 0.0f);
      std::fill(dVt.begin(), dVt.end(), 0.0f);
      backward_of(Qr.data(), Qt.data(), dOr.data(), dOt.data(), Kr.data(), Kt.data(), Vt.data(), lse_r.data(),
                  delta_r.data(), dQ.data(), dKt.data(), dVt.data(), R, Tk, D, G, T, static_cast<float>(scale), vnni);
      // this task's heads of the results, in bf16
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          uint16_t* to = dQo + ((i * H + kvh * G + g) * T + t) * D;
          const float* from = dQ.data() + (t * G + g) * D;
          for (int64_t d = 0; d < D; ++d) to[d] = bf16_bits(from[d]);
        }
        uint16_t* to_k = dKo + ((i * KVH + kvh) * T + t) * D;
        uint16_t* to_v = dVo + ((i * KVH + kvh) * T + t) * D;
        for (int64_t d = 0; d < D; ++d) to_k[d] = bf16_bits(dKt[d * Tk + t]), to_v[d] = bf16_bits(dVt[d * Tk + t]);
      }
    }
    brgemm_release(vnni);
  });
  return {dq, dk, dv};
}

// whether this CPU's oneDNN runs a bf16 brgemm (AMX, AVX-512 BF16)
bool can_run() { return could_pack(at::kBFloat16); }

}  // namespace

TORCH_LIBRARY(overbrainer_cpu, m) {
  m.def("causal_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, float scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("can_run() -> bool", &can_run);
}

TORCH_LIBRARY_IMPL(overbrainer_cpu, CPU, m) {
  m.impl("causal_attention_backward", &causal_attention_backward);
}
