// What the CPU kernels share (cpu_attention_forward.cpp, cpu_attention_backward.cpp,
// cpu_token_loss.cpp): exponentials, bf16 rounding, brgemm's B operands and the names they
// use. Built by cpu_kernels.py.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace overbrainer_cpu {

using at::BFloat16;
using at::native::cpublas::brgemm;
using at::native::cpublas::brgemm_release;
using at::native::cpublas::could_pack;

constexpr int64_t LANES = 16;  // floats in an AVX-512 register
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// n elements, uninitialized (a std::vector zeroes them first)
template <typename T>
std::unique_ptr<T[]> buffer(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

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

// out (cols x rows, rows ld_out apart) = in (rows x cols, rows ld_in apart)ᵀ, by blocks of 32 x 32
// in AVX-512 registers (ATen's transpose_mxn, built for AVX-512: cpu_kernels.py's
// -DCPU_CAPABILITY_AVX512); an element at a time, these took a third of the attention's backward
inline void transpose(const BFloat16* in, int64_t ld_in, int64_t rows, int64_t cols, BFloat16* out, int64_t ld_out) {
  constexpr int64_t B = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += B)
    for (int64_t c0 = 0; c0 < cols; c0 += B)
      at::vec::transpose_mxn<BFloat16>(in + r0 * ld_in + c0, ld_in, out + c0 * ld_out + r0, ld_out,
                                       static_cast<int>(std::min(B, rows - r0)), static_cast<int>(std::min(B, cols - c0)));
}

// out (cols x rows) = in (rows x cols)ᵀ, both dense
inline void transpose(const BFloat16* in, int64_t rows, int64_t cols, BFloat16* out) {
  transpose(in, cols, rows, cols, out, rows);
}

// brgemm's B operand from a (k x n) row-major matrix with leading dimension ld (n <= 64):
// VNNI-packed where the CPU wants it, else copied as it is
inline void as_b(const BFloat16* in, int64_t k, int64_t n, int64_t ld, bool vnni, BFloat16* out) {
  if (vnni) {
    at::native::cpublas::pack(k, n, ld, n, at::kBFloat16, at::kBFloat16, in, out);
  } else {
    for (int64_t i = 0; i < k; ++i) std::memcpy(out + i * n, in + i * ld, sizeof(BFloat16) * n);
  }
}

// the widest block of at most 64 columns that divides a head size (a multiple of 16): what
// a packed B operand takes
inline int64_t column_block(int64_t D) {
  for (int64_t n : {64, 48, 32})
    if (D % n == 0) return n;
  return 16;
}

#if defined(__AVX512F__)
// e^x for 16 floats: exp_approx's polynomial
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3333337680e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// the sum of a[d]·b[d] over d < n (a multiple of 16) in float32, 16 lanes at a time
inline float dot(const BFloat16* a, const BFloat16* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += LANES) {
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d))), 16));
    const __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))), 16));
    sum = _mm512_fmadd_ps(x, y, sum);
  }
  return _mm512_reduce_add_ps(sum);
}

#endif

}  // namespace overbrainer_cpu
