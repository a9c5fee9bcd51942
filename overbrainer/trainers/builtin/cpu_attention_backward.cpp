// The backward of causal attention, bf16 on a CPU with AMX (oneDNN's bf16 brgemm with packed
// operands): cpu_attention_kernel.py builds it on first use, cpu_attention.py calls it.
//
// One task per (sequence, key head). Its G query heads are stacked as rows (position t, head
// g) -> row t*G+g, so every product is against the shared key head. For each tile of 64 keys,
// the rows at or after its first position are taken by chunks of up to 256: the scores and
// dO·Vᵀ come out of brgemm in float32 (bf16 operands, float32 sums and results: the scores
// are never rounded to bf16 before the log-sum-exp is taken off them), P and dS are computed
// in one vectorized pass, and dQ += dS·K, dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS are summed in float32
// (each task lays out its rows and their transposes once, so that no tile is ever transposed).
// Where there are few tasks (one or two sequences, few key heads), each task's keys are cut into
// parts of about equal work, each with a dQ of its own, summed in a fixed order after. How many
// parts there are follows the shapes, not the threads: the same inputs give the same bits on
// any number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace overbrainer_cpu;  // the kernels' shared helpers (cpu_kernels.h)

constexpr int64_t TILE = 64;

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

constexpr int64_t CHUNK = 256;  // rows a product takes at once (brgemm's M, or K for dK and dV)
constexpr int64_t SPLIT_BELOW = 8;  // tasks under which each task's keys are cut into parts

// the first row (a multiple of 64) a tile of keys starting at k0 reaches: the causal band's start
int64_t first_row(int64_t k0, int64_t groups) { return (k0 * groups) / TILE * TILE; }

// One task's keys [k_begin, k_end): Q, dO (R x D) and their transposes (D x R); K, V (Tk x D)
// and their transposes (D x Tk); lse, delta (R). Out: dQ (R x D) and the keys' columns of dKᵀ
// and dVᵀ (D x Tk), float32, accumulated.
void backward_of(const BFloat16* Q, const BFloat16* Qt, const BFloat16* dO, const BFloat16* dOt, const BFloat16* K,
                 const BFloat16* Kt, const BFloat16* Vt, const float* lse, const float* delta, float* dQ, float* dKt,
                 float* dVt, int64_t R, int64_t Tk, int64_t D, int64_t groups, int64_t length, float scale, bool vnni,
                 int64_t k_begin, int64_t k_end) {
  const int64_t DB = column_block(D), ND = D / DB;
  const int64_t rows_used = std::min(R, (length * groups + TILE - 1) / TILE * TILE);
  std::vector<float> S(CHUNK * TILE), dP(CHUNK * TILE), keys(TILE);
  std::vector<BFloat16> P(CHUNK * TILE), dS(CHUNK * TILE), Pb(CHUNK * TILE), dSb(CHUNK * TILE);
  std::vector<BFloat16> ktB(D * TILE), vtB(D * TILE), kB(TILE * D);
  for (int64_t k0 = k_begin; k0 < std::min({k_end, length, Tk}); k0 += TILE) {
    // this tile of keys as B operands: Kᵀ and Vᵀ (D x 64) for the scores and dO·Vᵀ, K (64 x DB
    // blocks) for dQ += dS·K
    as_b(Kt + k0, D, TILE, Tk, vnni, ktB.data());
    as_b(Vt + k0, D, TILE, Tk, vnni, vtB.data());
    for (int64_t nd = 0; nd < ND; ++nd) as_b(K + k0 * D + nd * DB, TILE, DB, D, vnni, kB.data() + nd * TILE * DB);
    for (int64_t a = 0; a < TILE; ++a) keys[a] = static_cast<float>(k0 + a);
    // the rows at or after these keys' first position, by chunks
    for (int64_t c0 = first_row(k0, groups); c0 < rows_used; c0 += CHUNK) {
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

// a task's heads of dQ (rows t*G + g, float32) into dq (B, H, T, D), in bf16
void write_dq(const float* dQ, uint16_t* dq, int64_t i, int64_t kvh, int64_t H, int64_t T, int64_t G, int64_t D) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      uint16_t* to = dq + ((i * H + kvh * G + g) * T + t) * D;
      const float* from = dQ + (t * G + g) * D;
      for (int64_t d = 0; d < D; ++d) to[d] = bf16_bits(from[d]);
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
// Each unit of work lays out its task's rows, transposes and padding (in its thread), and
// writes its own part of the results.
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
  const int64_t tasks = B * KVH, key_tiles = (T + TILE - 1) / TILE;
  const float scale_f = static_cast<float>(scale);

  // a task's rows (t, g) -> t*G + g and their transposes, its keys and values, padded with
  // zeros; lse and delta = rowsum(dO ∘ O) by row
  auto lay_out = [&](int64_t task, BFloat16* Qr, BFloat16* Qt, BFloat16* dOr, BFloat16* dOt, BFloat16* Kr,
                     BFloat16* Kt, BFloat16* Vt, float* lse_r, float* delta_r) {
    const int64_t i = task / KVH, kvh = task % KVH, used = T * G;
    // the buffers come uninitialized: every element is written here, padding as zeros
    std::fill(Qr + used * D, Qr + R * D, BFloat16(0.0f));
    std::fill(dOr + used * D, dOr + R * D, BFloat16(0.0f));
    std::fill(lse_r + used, lse_r + R, 0.0f);
    std::fill(delta_r + used, delta_r + R, 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g, head = kvh * G + g;
        const BFloat16* drow = dOs.row(i, head, t);
        std::memcpy(Qr + r * D, Qs.row(i, head, t), sizeof(BFloat16) * D);
        std::memcpy(dOr + r * D, drow, sizeof(BFloat16) * D);
        delta_r[r] = dot(drow, Os.row(i, head, t), D);
        lse_r[r] = L[(i * H + head) * T + t];
      }
    }
    transpose(Qr, R, D, Qt);
    transpose(dOr, R, D, dOt);
    for (int64_t t = 0; t < T; ++t) std::memcpy(Kr + t * D, Ks.row(i, kvh, t), sizeof(BFloat16) * D);
    std::fill(Kr + T * D, Kr + Tk * D, BFloat16(0.0f));
    transpose(Kr, Tk, D, Kt);
    // Vᵀ straight from v's rows (T of them, Vs.t apart), its padding columns zeros
    transpose(Vs.row(i, kvh, 0), Vs.t, T, D, Vt, Tk);
    for (int64_t d = 0; d < D; ++d) std::fill(Vt + d * Tk + T, Vt + (d + 1) * Tk, BFloat16(0.0f));
  };
  // a task's keys [k_begin, k_end) of dK and dV (float32 Dx Tk) into dk and dv, in bf16
  auto write_dk_dv = [&](int64_t task, const float* dKt, const float* dVt, int64_t k_begin, int64_t k_end) {
    const int64_t i = task / KVH, kvh = task % KVH;
    for (int64_t t = k_begin; t < std::min(k_end, T); ++t) {
      uint16_t* to_k = dKo + ((i * KVH + kvh) * T + t) * D;
      uint16_t* to_v = dVo + ((i * KVH + kvh) * T + t) * D;
      for (int64_t d = 0; d < D; ++d) to_k[d] = bf16_bits(dKt[d * Tk + t]), to_v[d] = bf16_bits(dVt[d * Tk + t]);
    }
  };

  // Fewer than 8 tasks (one or two sequences, few key heads): each task's keys are cut into parts
  // of about equal work (the causal band makes the early keys' tiles the longest), each part a
  // unit of work on the task's layout (made once) with a dQ of its own, the parts' dQ summed
  // after: about 8 units in all. How many follows the shapes, never the threads, so that the
  // bits are the same on any number of them (the ranks of a run may have different numbers).
  // (at most SPLIT_BELOW parts, and the parts' dQ within 256 MiB: a long sequence)
  const int64_t dq_bytes = tasks * R * D * static_cast<int64_t>(sizeof(float));
  const int64_t parts = tasks >= SPLIT_BELOW
      ? 1 : std::max<int64_t>(1, std::min({key_tiles, (SPLIT_BELOW + tasks - 1) / tasks,
                                           (int64_t{256} << 20) / std::max<int64_t>(dq_bytes, 1)}));
  if (parts == 1) {  // a task a unit, its layout in its thread's buffers
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      // uninitialized (lay_out writes them whole; the sums are zeroed for each task)
      auto Qr = buffer<BFloat16>(R * D), Qt = buffer<BFloat16>(D * R), dOr = buffer<BFloat16>(R * D),
           dOt = buffer<BFloat16>(D * R), Kr = buffer<BFloat16>(Tk * D), Kt = buffer<BFloat16>(D * Tk),
           Vt = buffer<BFloat16>(D * Tk);
      auto lse_r = buffer<float>(R), delta_r = buffer<float>(R), dQ = buffer<float>(R * D), dKt = buffer<float>(D * Tk),
           dVt = buffer<float>(D * Tk);
      for (int64_t task = begin; task < end; ++task) {
        lay_out(task, Qr.get(), Qt.get(), dOr.get(), dOt.get(), Kr.get(), Kt.get(), Vt.get(), lse_r.get(),
                delta_r.get());
        std::fill(dQ.get(), dQ.get() + R * D, 0.0f);
        std::fill(dKt.get(), dKt.get() + D * Tk, 0.0f);
        std::fill(dVt.get(), dVt.get() + D * Tk, 0.0f);
        backward_of(Qr.get(), Qt.get(), dOr.get(), dOt.get(), Kr.get(), Kt.get(), Vt.get(), lse_r.get(),
                    delta_r.get(), dQ.get(), dKt.get(), dVt.get(), R, Tk, D, G, T, scale_f, vnni, 0, Tk);
        write_dk_dv(task, dKt.get(), dVt.get(), 0, Tk);
        write_dq(dQ.get(), dQo, task / KVH, task % KVH, H, T, G, D);
      }
      brgemm_release(vnni);
    });
    return {dq, dk, dv};
  }
  const int64_t rows_used = std::min(R, (T * G + TILE - 1) / TILE * TILE);
  std::vector<int64_t> bounds{0};  // the parts' first keys, then Tk
  {
    int64_t total = 0, done = 0;
    for (int64_t kt = 0; kt < key_tiles; ++kt) total += rows_used - first_row(kt * TILE, G);
    for (int64_t kt = 0; kt + 1 < key_tiles; ++kt) {
      done += rows_used - first_row(kt * TILE, G);
      if (static_cast<int64_t>(bounds.size()) < parts && done * parts >= total * static_cast<int64_t>(bounds.size()))
        bounds.push_back((kt + 1) * TILE);
    }
    bounds.push_back(Tk);
  }
  const int64_t units = static_cast<int64_t>(bounds.size()) - 1;
  auto bf16 = q.options();
  auto f32 = q.options().dtype(at::kFloat);
  auto Qr = at::empty({tasks, R, D}, bf16), Qt = at::empty({tasks, D, R}, bf16), dOr = at::empty({tasks, R, D}, bf16),
       dOt = at::empty({tasks, D, R}, bf16), Kr = at::empty({tasks, Tk, D}, bf16), Kt = at::empty({tasks, D, Tk}, bf16),
       Vt = at::empty({tasks, D, Tk}, bf16), lse_r = at::empty({tasks, R}, f32), delta_r = at::empty({tasks, R}, f32);
  auto dQ = at::zeros({tasks, units, R, D}, f32), dKt = at::zeros({tasks, D, Tk}, f32), dVt = at::zeros({tasks, D, Tk}, f32);
  auto b16 = [](at::Tensor& x, int64_t task) { return x.data_ptr<BFloat16>() + task * x.stride(0); };
  auto f = [](at::Tensor& x, int64_t task) { return x.data_ptr<float>() + task * x.stride(0); };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      lay_out(task, b16(Qr, task), b16(Qt, task), b16(dOr, task), b16(dOt, task), b16(Kr, task), b16(Kt, task),
              b16(Vt, task), f(lse_r, task), f(delta_r, task));
  });
  at::parallel_for(0, tasks * units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t task = unit / units, part = unit % units;
      // dK and dV: this part's own keys' columns; dQ: this part's own sum
      backward_of(b16(Qr, task), b16(Qt, task), b16(dOr, task), b16(dOt, task), b16(Kr, task), b16(Kt, task),
                  b16(Vt, task), f(lse_r, task), f(delta_r, task), f(dQ, task) + part * R * D, f(dKt, task),
                  f(dVt, task), R, Tk, D, G, T, scale_f, vnni, bounds[part], bounds[part + 1]);
      write_dk_dv(task, f(dKt, task), f(dVt, task), bounds[part], bounds[part + 1]);
    }
    brgemm_release(vnni);
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      float* sum = f(dQ, task);
      for (int64_t part = 1; part < units; ++part) {
        const float* more = sum + part * R * D;
        for (int64_t x = 0; x < R * D; ++x) sum[x] += more[x];
      }
      write_dq(sum, dQo, task / KVH, task % KVH, H, T, G, D);
    }
  });
  return {dq, dk, dv};
}

// whether this CPU's oneDNN runs a bf16 brgemm on packed operands (AMX)
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
