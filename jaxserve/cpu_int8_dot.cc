// w8a8's int8 x int8 -> int32 dot for x86 CPUs with AVX-512 VNNI, an XLA FFI custom call
// (jaxserve/cpu_int8_dot.py builds, registers and calls it).
//
// y[m, n] = sum_k x[m, k] w[n, k] for x [M, K] (a few tokens) and w [N, K] (a Linear weight as
// stored, [out, in]). VPDPBUSD multiplies unsigned by signed bytes, so x is offset by 128 into
// unsigned bytes once per call and the offset taken back per output: x w = (x + 128) w - 128 sum(w),
// sum(w) being the products of a token of ones, computed as token 0 along with the others.
// Four weight rows are multiplied at a time by up to four tokens (16 accumulators in registers),
// the weight read from memory once, in its own layout: no packing, no copy.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;   // cpu_int8_dot.MAX_ROWS: tokens past it go to XLA's dot

// {sum(a), sum(b), sum(c), sum(d)} of four vectors of 16 int32 lanes.
inline __m128i Sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// out[g * 4 + j] = (unsigned) token g . weight row j, for G tokens of `chunks` 64-byte chunks each.
template <int G>
void Products(const uint8_t* tokens, int64_t chunks, const int8_t* const rows[4], __mmask64 last, int32_t* out) {
  __m512i acc[G][4];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_si512();
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask64 mask = c == chunks - 1 ? last : ~0ULL;   // bytes past the row's end load as 0
    __m512i w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_maskz_loadu_epi8(mask, rows[j] + c * 64);
    for (int g = 0; g < G; ++g) {
      const __m512i x = _mm512_loadu_si512(tokens + (g * chunks + c) * 64);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_dpbusd_epi32(acc[g][j], x, w[j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * g), Sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
}

ffi::Error Int8Dot(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> y) {
  const int64_t n_out = w.dimensions()[0], k = w.dimensions()[1];
  const int64_t rows = x.element_count() / k;
  if (rows > kMaxRows || rows * k != static_cast<int64_t>(x.element_count())) {
    return ffi::Error::InvalidArgument("jaxserve_int8_dot: x must be [rows <= 16, in] for w [out, in]");
  }
  const int64_t chunks = (k + 63) / 64, tokens = rows + 1;
  const __mmask64 last = k % 64 ? (~0ULL >> (64 - k % 64)) : ~0ULL;
  // Token 0: ones; token m + 1: x[m] + 128; each padded to whole chunks.
  std::vector<uint8_t> xu(tokens * chunks * 64, 0);
  std::fill(xu.begin(), xu.begin() + k, 1);
  const int8_t* xp = x.typed_data();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t i = 0; i < k; ++i) xu[(m + 1) * chunks * 64 + i] = static_cast<uint8_t>(xp[m * k + i] + 128);
  }
  std::vector<int32_t> products(tokens * 4);
  const int8_t* wp = w.typed_data();
  int32_t* yp = y->typed_data();
  for (int64_t n = 0; n < n_out; n += 4) {
    const int8_t* block[4];   // past the last row: the last row again, its products dropped
    for (int j = 0; j < 4; ++j) block[j] = wp + std::min(n + j, n_out - 1) * k;
    for (int64_t t = 0; t < tokens; t += 4) {
      const uint8_t* group = xu.data() + t * chunks * 64;
      int32_t* out = products.data() + 4 * t;
      switch (std::min<int64_t>(4, tokens - t)) {
        case 1: Products<1>(group, chunks, block, last, out); break;
        case 2: Products<2>(group, chunks, block, last, out); break;
        case 3: Products<3>(group, chunks, block, last, out); break;
        default: Products<4>(group, chunks, block, last, out); break;
      }
    }
    for (int64_t j = 0; j < 4 && n + j < n_out; ++j) {
      for (int64_t m = 0; m < rows; ++m) yp[m * n_out + n + j] = static_cast<int32_t>(   // modulo 2^32: exact wherever x . w fits in int32
            static_cast<uint32_t>(products[4 * (m + 1) + j]) - 128u * static_cast<uint32_t>(products[j]));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Dot, Int8Dot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
