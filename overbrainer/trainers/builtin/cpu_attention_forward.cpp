// The forward of causal attention, bf16 on a CPU with AMX (oneDNN's bf16 brgemm with packed
// operands): cpu_kernels.py builds it, cpu_attention.py calls it; its outputs are what the
// backward (cpu_attention_backward.cpp) takes.
//
// Flash attention's forward: the rows (position t, query head g of a key head) -> t*G+g, so
// that every product is against the shared key head, are taken by chunks of up to 256, and
// each chunk goes over the tiles of 64 keys up to its last position, keeping each row's
// running maximum, sum of exponentials and float32 output, rescaled when the maximum grows.
// The scores come out of brgemm in float32 (bf16 operands, float32 sums); the probabilities
// are rounded to bf16 for P·V, as sdpa's CPU kernel does. Out: the output (B, T, H, D), the
// layout transformers' attention interface returns, and each row's log-sum-exp (B, H, T).
// Each chunk is one unit of work, on one thread: the same shapes give the same bits.

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
#error "the attention forward kernel is built for a CPU with AVX-512 BF16 (every CPU with AMX has it)"
#endif

namespace {

using namespace overbrainer_cpu;  // the kernels' shared helpers (cpu_kernels.h)

constexpr int64_t TILE = 64;    // keys a tile
constexpr int64_t CHUNK = 256;  // rows a unit of work

std::tuple<at::Tensor, at::Tensor> causal_attention_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                            const at::Tensor& v_in, double scale) {
  auto dense_last = [](const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); };
  const auto q = dense_last(q_in), k = dense_last(k_in), v = dense_last(v_in);
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->scalar_type() == at::kBFloat16 && x->dim() == 4, "bf16 (batch, heads, length, head size)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KVH = k.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == D,
              "matching shapes");
  TORCH_CHECK(D % 16 == 0 && D <= 512, "a head size that is a multiple of 16, at most 512");
  const int64_t G = H / KVH, R = T * G, chunks = (R + CHUNK - 1) / CHUNK, DB = column_block(D), ND = D / DB;
  auto out = at::empty({B, T, H, D}, q.options());
  auto lse = at::empty({B, H, T}, q.options().dtype(at::kFloat));
  const BFloat16* Q = q.data_ptr<BFloat16>();
  const BFloat16* K = k.data_ptr<BFloat16>();
  const BFloat16* V = v.data_ptr<BFloat16>();
  BFloat16* O = out.data_ptr<BFloat16>();
  float* LS = lse.data_ptr<float>();
  const bool vnni = could_pack(at::kBFloat16);
  const float scale_f = static_cast<float>(scale);
  // each (sequence, key head)'s tiles of keys as B operands, packed once: Kᵀ (D x 64) for the
  // scores, V (64 x DB blocks) for P·V; keys past the sequence are zeros (and masked: after
  // every row's position)
  const int64_t tiles = (T + TILE - 1) / TILE;
  auto kB = at::empty({B * KVH, tiles, D * TILE}, q.options()), vB = at::empty({B * KVH, tiles, TILE * D}, q.options());
  BFloat16* KB = kB.data_ptr<BFloat16>();
  BFloat16* VB = vB.data_ptr<BFloat16>();
  at::parallel_for(0, B * KVH * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> Kr(TILE * D), Kt(D * TILE), Vr(TILE * D);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t task = unit / tiles, k0 = (unit % tiles) * TILE, i = task / KVH, kvh = task % KVH;
      const int64_t keys = std::min(TILE, T - k0);
      for (int64_t a = 0; a < TILE; ++a) {
        if (a < keys) {
          std::memcpy(Kr.data() + a * D, K + i * k.stride(0) + kvh * k.stride(1) + (k0 + a) * k.stride(2),
                      sizeof(BFloat16) * D);
          std::memcpy(Vr.data() + a * D, V + i * v.stride(0) + kvh * v.stride(1) + (k0 + a) * v.stride(2),
                      sizeof(BFloat16) * D);
        } else {
          std::fill(Kr.begin() + a * D, Kr.begin() + (a + 1) * D, BFloat16(0.0f));
          std::fill(Vr.begin() + a * D, Vr.begin() + (a + 1) * D, BFloat16(0.0f));
        }
      }
      transpose(Kr.data(), TILE, D, Kt.data());
      as_b(Kt.data(), D, TILE, TILE, vnni, KB + unit * D * TILE);
      for (int64_t nd = 0; nd < ND; ++nd) as_b(Vr.data() + nd * DB, TILE, DB, D, vnni, VB + unit * TILE * D + nd * TILE * DB);
    }
  });
  // a unit: one chunk of one (sequence, key head)'s rows
  at::parallel_for(0, B * KVH * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> Qc(CHUNK * D), P(CHUNK * TILE);
    std::vector<float> S(CHUNK * TILE), acc(CHUNK * D), most(CHUNK), sums(CHUNK);
    for (int64_t unit = begin; unit < end; ++unit) {
      // a task's chunks dealt from both ends (the first, the last, the second, ...): the later
      // ones see more keys, and a thread's contiguous range of units gets a mix of both
      const int64_t task = unit / chunks, nth = unit % chunks, i = task / KVH, kvh = task % KVH;
      const int64_t c0 = (nth % 2 == 0 ? nth / 2 : chunks - 1 - nth / 2) * CHUNK;
      const int64_t M = std::min(CHUNK, R - c0);
      const int64_t last = (c0 + M - 1) / G;  // the chunk's last position: the keys it sees end there
      for (int64_t row = 0; row < M; ++row) {
        const int64_t r = c0 + row, t = r / G, g = r % G;
        std::memcpy(Qc.data() + row * D, Q + i * q.stride(0) + (kvh * G + g) * q.stride(1) + t * q.stride(2),
                    sizeof(BFloat16) * D);
      }
      std::fill(acc.begin(), acc.begin() + M * D, 0.0f);
      std::fill(most.begin(), most.begin() + M, NEG_INF);
      std::fill(sums.begin(), sums.begin() + M, 0.0f);
      for (int64_t k0 = 0; k0 <= last; k0 += TILE) {
        const BFloat16* ktB = KB + (task * tiles + k0 / TILE) * D * TILE;
        const BFloat16* vtB = VB + (task * tiles + k0 / TILE) * TILE * D;
        // the rows that see at least one of these keys: from the first at or after k0
        const int64_t first = std::max<int64_t>(0, k0 * G - c0);
        const int64_t rows = M - first;
        if (rows <= 0) continue;
        brgemm(rows, TILE, D, D, TILE, TILE, false, Qc.data() + first * D, ktB, S.data(), vnni);
        const __m512 sc = _mm512_set1_ps(scale_f);
        const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t at = first + row;
          const float position = static_cast<float>((c0 + at) / G - k0);  // keys after it are masked
          const float* s = S.data() + row * TILE;
          __m512 x[TILE / LANES];
          __mmask16 seen[TILE / LANES];
          __m512 top16 = _mm512_set1_ps(NEG_INF);
          for (int64_t j = 0; j < TILE / LANES; ++j) {
            seen[j] = _mm512_cmp_ps_mask(_mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(j * LANES))),
                                         _mm512_set1_ps(position), _CMP_LE_OQ);
            x[j] = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), seen[j], _mm512_loadu_ps(s + j * LANES), sc);
            top16 = _mm512_max_ps(top16, x[j]);
          }
          const float top = std::max(most[at], _mm512_reduce_max_ps(top16));
          // 0 the first time (most = -inf: exp_approx clamps it to e^-87, times sums and acc of 0);
          // inline rather than libm's expf, which took an eighth of the forward
          const float shrink = top == most[at] ? 1.0f : exp_approx(most[at] - top);
          most[at] = top;
          const __m512 m = _mm512_set1_ps(top);
          __m512 total = _mm512_setzero_ps();
          uint16_t* p = reinterpret_cast<uint16_t*>(P.data() + at * TILE);
          for (int64_t j = 0; j < TILE / LANES; ++j) {
            const __m512 e = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(x[j], m)));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j * LANES), (__m256i)_mm512_cvtneps_pbh(e));
          }
          sums[at] = sums[at] * shrink + _mm512_reduce_add_ps(total);
          if (shrink != 1.0f) {
            float* o = acc.data() + at * D;
            const __m512 f = _mm512_set1_ps(shrink);
            for (int64_t d = 0; d < D; d += LANES) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), f));
          }
        }
        for (int64_t nd = 0; nd < ND; ++nd)
          brgemm(rows, DB, TILE, TILE, DB, D, true, P.data() + first * TILE, vtB + nd * TILE * DB,
                 acc.data() + first * D + nd * DB, vnni);
      }
      for (int64_t row = 0; row < M; ++row) {
        const int64_t r = c0 + row, t = r / G, head = kvh * G + r % G;
        const float inv = 1.0f / sums[row];
        const float* o = acc.data() + row * D;
        BFloat16* to = O + ((i * T + t) * H + head) * D;
        for (int64_t d = 0; d < D; ++d) to[d] = BFloat16(o[d] * inv);
        LS[(i * H + head) * T + t] = most[row] + std::log(sums[row]);
      }
    }
    brgemm_release(vnni);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overbrainer_cpu, m) {
  m.def("causal_attention_forward(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(overbrainer_cpu, CPU, m) {
  m.impl("causal_attention_forward", &causal_attention_forward);
}
