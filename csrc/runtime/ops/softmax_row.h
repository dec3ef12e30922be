// The optimized SOFTMAX row shared by SOFTMAX and SOFTMAX_MASKED (docs/qgraph.md §4.4): the
// reference's quotients Q_i = floor(E_i · 2^30 / S) from typed loads, an int32 table and the
// exact division, without an int64 division per element.
#ifndef QDSL_RUNTIME_OPS_SOFTMAX_ROW_H_
#define QDSL_RUNTIME_OPS_SOFTMAX_ROW_H_

#include <cstdint>

#include "dispatch.h"
#include "runtime/ops/last_axis.h"

namespace qdsl {

// One row's quotients Q into q (e: scratch for the E_i) from table32 (entries <= 2^24,
// table32[255] >= 1).  keep: nullptr (every position) or per position 1 kept / 0 masked;
// a masked position gets E_i = 0 (so Q_i = 0), a row with none kept all Q_i = 0.
template <typename T>
void SoftmaxRowFast(const int32_t* table32, const T* x, const uint8_t* keep, int64_t n, FloorDivScaledKernel div,
                    int32_t* e, int32_t* q) {
  int64_t s = 0;
  if (keep == nullptr) {
    T mx = x[0];
    for (int64_t i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
    const int32_t* table = table32 + 255 - static_cast<int32_t>(mx);  // table[x - max + 255]
    for (int64_t i = 0; i < n; ++i) s += e[i] = table[static_cast<int32_t>(x[i])];
  } else {
    int32_t mx = INT32_MIN;
    for (int64_t i = 0; i < n; ++i) mx = keep[i] && x[i] > mx ? static_cast<int32_t>(x[i]) : mx;
    if (mx == INT32_MIN) {  // nothing kept: probability 0 everywhere
      for (int64_t i = 0; i < n; ++i) q[i] = 0;
      return;
    }
    const int32_t* table = table32 + 255 - mx;
    // keep[i] in {0, 1}: a branch-free select; a masked x_i > m indexes past table32[255]
    // (SOFTMAX_MASKED's table32 has 512 entries, zeros past 255)
    for (int64_t i = 0; i < n; ++i) s += e[i] = table[static_cast<int32_t>(x[i])] & -static_cast<int32_t>(keep[i]);
  }
  if (div != nullptr) {  // E_i · 2^30 <= 2^54 with 25 significant bits; S < 2^52; Q_i <= 2^30
    div(e, n, 1073741824.0, 0.0, static_cast<double>(s), q);
    return;
  }
  const double inv = 1.0 / static_cast<double>(s);
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int32_t>(FloorDivByReciprocal(static_cast<int64_t>(e[i]) << 30, s, inv));
}

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_SOFTMAX_ROW_H_
