// The summed cross-entropy of a frozen output layer, bf16 on a CPU with AMX (oneDNN's bf16
// brgemm with packed operands), without ever holding the logits: cpu_kernels.py builds it,
// cpu_token_loss.py calls it.
//
// The logits of a small model's output layer are the largest tensor of a step (rows x a
// vocabulary of 50,000 to 150,000), and a plain loss goes over them five times (the matmul
// writes them, the log-softmax, its backward, the gradient's matmul reads them). Here the
// vocabulary is taken by tiles that stay in cache, against all the rows at once:
//
// - the forward: for each tile of 64 entries, the scores h·Wᵀ (brgemm: bf16 operands, float32
//   results) and each row's running maximum and sum of exponentials: each row's log-sum-exp
//   and loss (log-sum-exp minus its target's logit), nothing else kept;
// - the backward: for each tile of 256 entries, the scores again, dS = (softmax - one-hot) ·
//   the row's gradient in bf16, and dH += dS·W_tile.
//
// The weight is packed once (`pack_output_layer`: the layouts brgemm reads) and kept by the
// caller while it does not change. The vocabulary is cut into contiguous parts, each with
// partial sums of its own, merged in a fixed order; how many parts there are follows the
// vocabulary, not the threads: the same inputs give the same bits on any number of threads
// (the ranks of a run may have different numbers). The logits are float32 sums of bf16
// products, as Liger's fused loss computes them (a plain bf16 matmul rounds them to bf16
// first).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "the token loss kernel is built for a CPU with AVX-512 BF16 (every CPU with AMX has it)"
#endif

namespace {

using namespace overbrainer_cpu;  // the kernels' shared helpers (cpu_kernels.h)

constexpr int64_t VT = 64;     // vocabulary entries a tile of the forward's scores (brgemm's N)
constexpr int64_t VT2 = 256;   // entries a tile of the backward (dS·W's K: 4 tiles of scores)
constexpr int64_t ROWS = 512;  // rows a product takes at once (256 and 1024: as fast or slower, 2 cores)

int64_t padded(int64_t V) { return (V + VT2 - 1) / VT2 * VT2; }

// The parts the vocabulary's tiles are dealt into: contiguous, about equal, as many as `most`
// at most, however many threads there are (each part's sums are its own, merged in its order:
// the bits do not depend on the threads). The forward's partial sums are a few floats a row,
// so it cuts finer than the backward, whose parts each hold a float32 dH.
constexpr int64_t FORWARD_PARTS = 16;
constexpr int64_t BACKWARD_PARTS = 4;

std::vector<int64_t> parts_of(int64_t tiles, int64_t most) {
  const int64_t parts = std::max<int64_t>(1, std::min(most, tiles));
  std::vector<int64_t> bounds;
  for (int64_t p = 0; p <= parts; ++p) bounds.push_back(tiles * p / parts);
  return bounds;
}

// The output layer's weight (V x D) as brgemm's B operands, entries past V zeros: for the
// scores, each tile of 64 entries transposed (D x 64); for the gradient, each tile of 256
// entries by blocks of DB columns (256 x DB).
std::tuple<at::Tensor, at::Tensor> pack_output_layer(const at::Tensor& weight_in) {
  const auto weight = weight_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "a bf16 (vocabulary, hidden) weight");
  const int64_t V = weight.size(0), D = weight.size(1), Vp = padded(V), DB = column_block(D), ND = D / DB;
  TORCH_CHECK(D % 16 == 0, "a hidden size that is a multiple of 16");
  const bool vnni = could_pack(at::kBFloat16);
  auto scores_b = at::empty({Vp / VT, D * VT}, weight.options());
  auto grad_b = at::empty({Vp / VT2, ND, VT2 * DB}, weight.options());
  const BFloat16* W = weight.data_ptr<BFloat16>();
  BFloat16* SB = scores_b.data_ptr<BFloat16>();
  BFloat16* GB = grad_b.data_ptr<BFloat16>();
  at::parallel_for(0, Vp / VT2, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> rows(VT2 * D), t(D * VT);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t v0 = tile * VT2, real = std::max<int64_t>(0, std::min(VT2, V - v0));
      std::memcpy(rows.data(), W + v0 * D, sizeof(BFloat16) * real * D);
      std::fill(rows.begin() + real * D, rows.end(), BFloat16(0.0f));
      for (int64_t j = 0; j < VT2 / VT; ++j) {
        transpose(rows.data() + j * VT * D, VT, D, t.data());
        as_b(t.data(), D, VT, VT, vnni, SB + (tile * (VT2 / VT) + j) * D * VT);
      }
      for (int64_t nd = 0; nd < ND; ++nd) as_b(rows.data() + nd * DB, VT2, DB, D, vnni, GB + (tile * ND + nd) * VT2 * DB);
    }
  });
  return {scores_b, grad_b};
}

// (loss, lse), float32, a value a row: each row's log-sum-exp over the vocabulary's logits
// (scale · h·Wᵀ) and its loss, the log-sum-exp less its target's logit. hidden (L x D) bf16,
// targets (L) int64 in [0, V).
std::tuple<at::Tensor, at::Tensor> token_loss_forward(const at::Tensor& hidden_in, const at::Tensor& scores_b,
                                                      int64_t V, const at::Tensor& targets_in, double scale) {
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2, "bf16 (rows, hidden) hidden states");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == hidden.size(0),
              "an int64 target a row");
  const int64_t L = hidden.size(0), D = hidden.size(1), tiles = scores_b.size(0);
  TORCH_CHECK(scores_b.size(1) == D * VT && tiles * VT == padded(V), "an output layer packed for this hidden size");
  const bool vnni = could_pack(at::kBFloat16);
  const auto bounds = parts_of(tiles, FORWARD_PARTS);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  // each part's running maximum and sum of e^(logit - maximum), by row; the target's logit
  std::vector<float> most(parts * L, NEG_INF), sums(parts * L, 0.0f), picked(L, 0.0f);
  const BFloat16* H = hidden.data_ptr<BFloat16>();
  const BFloat16* SB = scores_b.data_ptr<BFloat16>();
  const int64_t* T = targets.data_ptr<int64_t>();
  const float s_ = static_cast<float>(scale);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(ROWS * VT);
    const __m512 sc = _mm512_set1_ps(s_);
    for (int64_t part = begin; part < end; ++part) {
      float* m = most.data() + part * L;
      float* l = sums.data() + part * L;
      for (int64_t tile = bounds[part]; tile < bounds[part + 1]; ++tile) {
        const int64_t v0 = tile * VT, real = std::min(VT, V - v0);
        if (real <= 0) continue;  // a tile of padding only
        for (int64_t r0 = 0; r0 < L; r0 += ROWS) {
          const int64_t M = std::min(ROWS, L - r0);
          brgemm(M, VT, D, D, VT, VT, false, H + r0 * D, SB + tile * D * VT, S.data(), vnni);
          for (int64_t i = 0; i < M; ++i) {
            const int64_t r = r0 + i;
            const float* s = S.data() + i * VT;
            __m512 x[VT / LANES];
            __mmask16 in[VT / LANES];  // the entries within the vocabulary
            __m512 top16 = _mm512_set1_ps(NEG_INF);
            for (int64_t j = 0; j < VT / LANES; ++j) {
              in[j] = real >= j * LANES + LANES ? 0xFFFF
                    : real > j * LANES ? static_cast<__mmask16>((1u << (real - j * LANES)) - 1u) : 0;
              x[j] = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), in[j], _mm512_loadu_ps(s + j * LANES), sc);
              top16 = _mm512_max_ps(top16, x[j]);
            }
            const float top = _mm512_reduce_max_ps(top16);
            if (top > m[r]) {
              l[r] *= std::exp(m[r] - top);
              m[r] = top;
            }
            const __m512 mr = _mm512_set1_ps(m[r]);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < VT / LANES; ++j)
              acc = _mm512_mask_add_ps(acc, in[j], acc, exp16(_mm512_sub_ps(x[j], mr)));
            l[r] += _mm512_reduce_add_ps(acc);
            const int64_t t = T[r];
            if (t >= v0 && t < v0 + real) picked[r] = s[t - v0] * s_;
          }
        }
      }
    }
    brgemm_release(vnni);
  });
  auto lse = at::empty({L}, hidden.options().dtype(at::kFloat));
  auto loss = at::empty({L}, hidden.options().dtype(at::kFloat));
  float* LS = lse.data_ptr<float>();
  float* LO = loss.data_ptr<float>();
  for (int64_t r = 0; r < L; ++r) {  // the parts merged in their order
    float top = NEG_INF;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, most[p * L + r]);
    double total = 0.0;
    for (int64_t p = 0; p < parts; ++p) total += sums[p * L + r] * std::exp(static_cast<double>(most[p * L + r] - top));
    LS[r] = top + static_cast<float>(std::log(total));
    LO[r] = LS[r] - picked[r];
  }
  return {loss, lse};
}

// dH (L x D, bf16): the gradient of Σ_r grad[r] · loss[r] with respect to the hidden states,
// Σ_v (softmax - one-hot)[r, v] · grad[r] · scale · W_v, from the forward's lse.
at::Tensor token_loss_backward(const at::Tensor& hidden_in, const at::Tensor& scores_b, const at::Tensor& grad_b,
                               int64_t V, const at::Tensor& targets_in, const at::Tensor& lse_in,
                               const at::Tensor& grad_in, double scale) {
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const auto lse = lse_in.contiguous();
  const auto grad = grad_in.to(at::kFloat).contiguous();
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2, "bf16 (rows, hidden) hidden states");
  const int64_t L = hidden.size(0), D = hidden.size(1), tiles = grad_b.size(0), DB = column_block(D), ND = D / DB;
  TORCH_CHECK(targets.numel() == L && lse.numel() == L && grad.numel() == L, "a target, lse and gradient a row");
  TORCH_CHECK(grad_b.size(1) == ND && grad_b.size(2) == VT2 * DB && scores_b.size(0) == tiles * (VT2 / VT) &&
              scores_b.size(1) == D * VT && tiles * VT2 == padded(V), "an output layer packed for this hidden size");
  const bool vnni = could_pack(at::kBFloat16);
  const auto bounds = parts_of(tiles, BACKWARD_PARTS);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1, chunks = (L + ROWS - 1) / ROWS;
  auto sums = at::zeros({parts, L, D}, hidden.options().dtype(at::kFloat));  // each part's dH, float32
  const BFloat16* H = hidden.data_ptr<BFloat16>();
  const BFloat16* SB = scores_b.data_ptr<BFloat16>();
  const BFloat16* GB = grad_b.data_ptr<BFloat16>();
  const int64_t* T = targets.data_ptr<int64_t>();
  const float* LS = lse.data_ptr<float>();
  const float* G = grad.data_ptr<float>();
  float* out = sums.data_ptr<float>();
  const float s_ = static_cast<float>(scale);
  // a unit: one part of the vocabulary against one chunk of rows (part by part: a thread's
  // units share their tiles)
  at::parallel_for(0, parts * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(ROWS * VT2);
    std::vector<BFloat16> dS(ROWS * VT2);
    const __m512 sc = _mm512_set1_ps(s_);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t part = unit / chunks;
      float* acc = out + part * L * D;
      const int64_t r0 = (unit % chunks) * ROWS, M = std::min(ROWS, L - r0);
      for (int64_t tile = bounds[part]; tile < bounds[part + 1]; ++tile) {
        const int64_t v0 = tile * VT2, real = std::min(VT2, V - v0);
        if (real <= 0) continue;
        for (int64_t j = 0; j < VT2 / VT; ++j)
          brgemm(M, VT, D, D, VT, VT2, false, H + r0 * D, SB + (tile * (VT2 / VT) + j) * D * VT, S.data() + j * VT,
                 vnni);
        for (int64_t i = 0; i < M; ++i) {
          const int64_t r = r0 + i;
          const float* s = S.data() + i * VT2;
          BFloat16* d = dS.data() + i * VT2;
          const __m512 lr = _mm512_set1_ps(LS[r]), g = _mm512_set1_ps(G[r] * s_);
          for (int64_t j = 0; j < VT2; j += LANES) {
            __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, lr));
            if (j + LANES > real)  // entries past the vocabulary: no probability
              p = _mm512_maskz_mov_ps(real > j ? static_cast<__mmask16>((1u << (real - j)) - 1u) : 0, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(p, g)));
          }
          const int64_t t = T[r] - v0;
          if (t >= 0 && t < real)  // the target's entry: (p - 1) · g, from the same float32 p
            d[t] = BFloat16((exp_approx(s[t] * s_ - LS[r]) - 1.0f) * G[r] * s_);
        }
        for (int64_t nd = 0; nd < ND; ++nd)
          brgemm(M, DB, VT2, VT2, DB, D, true, dS.data(), GB + (tile * ND + nd) * VT2 * DB, acc + r0 * D + nd * DB,
                 vnni);
      }
    }
    brgemm_release(vnni);
  });
  auto grad_hidden = at::empty({L, D}, hidden.options());
  auto* to = reinterpret_cast<uint16_t*>(grad_hidden.data_ptr<BFloat16>());
  at::parallel_for(0, L * D, 4096, [&](int64_t begin, int64_t end) {  // the parts summed in their order
    for (int64_t x = begin; x < end; ++x) {
      float total = out[x];
      for (int64_t part = 1; part < parts; ++part) total += out[part * L * D + x];
      to[x] = bf16_bits(total);
    }
  });
  return grad_hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overbrainer_cpu, m) {
  m.def("pack_output_layer(Tensor weight) -> (Tensor, Tensor)");
  m.def("token_loss_forward(Tensor hidden, Tensor scores_b, int vocabulary, Tensor targets, float scale) "
        "-> (Tensor, Tensor)");
  m.def("token_loss_backward(Tensor hidden, Tensor scores_b, Tensor grad_b, int vocabulary, Tensor targets, "
        "Tensor lse, Tensor grad, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(overbrainer_cpu, CPU, m) {
  m.impl("pack_output_layer", &pack_output_layer);
  m.impl("token_loss_forward", &token_loss_forward);
  m.impl("token_loss_backward", &token_loss_backward);
}
