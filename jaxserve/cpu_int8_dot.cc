// w8a8's int8 x int8 -> int32 dot for x86 CPUs with AVX-512 VNNI, an XLA FFI custom call
// (jaxserve/cpu_int8_dot.py builds, registers and calls it).
//
// y[m, n] = sum_k x[m, k] w[n, k] for x [M, K] (a few tokens) and w [N, K] (a Linear weight as
// stored, [out, in]). VPDPBUSD multiplies unsigned by signed bytes, so x is offset by 128 into
// unsigned bytes once per call and the offset taken back per output row:
// x w = (x + 128) w - 128 sum(w), sum(w) by VPDPBUSD with a vector of ones in the same pass.
// The weight is read once, row by row, in its own layout: no packing, no copy.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;   // tokens held in registers; cpu_int8_dot.MAX_ROWS

ffi::Error Int8Dot(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> y) {
  const int64_t n_out = w.dimensions()[0], k = w.dimensions()[1];
  const int64_t rows = x.element_count() / k;
  if (rows > kMaxRows || rows * k != static_cast<int64_t>(x.element_count())) {
    return ffi::Error::InvalidArgument("jaxserve_int8_dot: x must be [rows <= 16, in] for w [out, in]");
  }
  const int64_t chunks = (k + 63) / 64;   // the last one masked when k is not a multiple of 64
  const __mmask64 last = k % 64 ? (~0ULL >> (64 - k % 64)) : ~0ULL;
  // x + 128 as unsigned bytes, zero-padded to whole chunks (a zero byte adds nothing).
  std::vector<uint8_t> xu(rows * chunks * 64, 0);
  const int8_t* xp = x.typed_data();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t i = 0; i < k; ++i) xu[m * chunks * 64 + i] = static_cast<uint8_t>(xp[m * k + i] + 128);
  }
  const __m512i ones = _mm512_set1_epi8(1);
  const int8_t* wp = w.typed_data();
  int32_t* yp = y->typed_data();
  for (int64_t n = 0; n < n_out; ++n) {
    const int8_t* row = wp + n * k;
    __m512i acc[kMaxRows];
    for (int64_t m = 0; m < rows; ++m) acc[m] = _mm512_setzero_si512();
    __m512i sum_w = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i wv = _mm512_maskz_loadu_epi8(c == chunks - 1 ? last : ~0ULL, row + c * 64);
      sum_w = _mm512_dpbusd_epi32(sum_w, ones, wv);
      for (int64_t m = 0; m < rows; ++m) {
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu.data() + (m * chunks + c) * 64), wv);
      }
    }
    const int32_t offset = 128 * _mm512_reduce_add_epi32(sum_w);
    for (int64_t m = 0; m < rows; ++m) yp[m * n_out + n] = _mm512_reduce_add_epi32(acc[m]) - offset;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Dot, Int8Dot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
