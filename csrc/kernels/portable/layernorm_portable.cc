// Portable LAYERNORM row passes (LayernormKernels in csrc/dispatch.h; the formula and its
// bounds are in csrc/runtime/ops/layernorm.cc): plain loops on int32 arrays with int64 sums.
#include <cmath>
#include <cstdint>

#include "kernels/portable/portable_kernels.h"
#include "qdsl/requant.h"

namespace qdsl {
namespace portable {

void LayernormSum(const int32_t* t0, const int32_t* t1, int64_t n, int32_t* v, int64_t* sum, int32_t* lo,
                  int32_t* hi) {
  const int32_t* s = t0;
  if (t1 != nullptr) {
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(Sat32(static_cast<int64_t>(t0[i]) + t1[i]));
    s = v;
  }
  int64_t total = 0;
  int32_t mn = s[0], mx = s[0];
  for (int64_t i = 0; i < n; ++i) {
    total += s[i];
    mn = s[i] < mn ? s[i] : mn;
    mx = s[i] > mx ? s[i] : mx;
  }
  *sum = total;
  *lo = mn;
  *hi = mx;
}

int64_t LayernormCenter(const int32_t* v, int64_t n, int64_t sum, int k, int32_t* d) {
  int64_t w = 0;
  const int64_t half = k > 0 ? int64_t{1} << (k - 1) : 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = n * v[i] - sum;
    const int64_t a = ((c < 0 ? -c : c) + half) >> k;  // round_half_away(|c| / 2^k)
    d[i] = static_cast<int32_t>(c < 0 ? -a : a);
    w += a * a;
  }
  return w;
}

// floor(a / b) from the double estimate a · (1 / b) (within 1 of it: a < 2^51 and b < 2^32
// are exact as doubles) and one step with the exact int64 remainder.
void LayernormNormalize(const int32_t* d, int64_t n, int s, int64_t r, const int32_t* gamma, const int32_t* beta,
                        int32_t* acc) {
  const int64_t b = 2 * r;
  const double inv = 1.0 / static_cast<double>(b);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = (static_cast<int64_t>(d[i] < 0 ? -d[i] : d[i]) << s) + r;
    int64_t q = static_cast<int64_t>(static_cast<double>(a) * inv);
    const int64_t rem = a - q * b;
    q += (rem >= b) - (rem < 0);
    const int32_t z = static_cast<int32_t>(d[i] < 0 ? -q : q);
    acc[i] = z * gamma[i] + beta[i];
  }
}

}  // namespace portable
}  // namespace qdsl
