// SoloPolicy checks alone (solo_policy_test.h); built and run by
// tests/runtime/test_solo_policy.py.
#include <cstdio>

#include "tests/solo_policy_test.h"

int main() {
  const int failures = qdsl_test::SoloPolicyFailures();
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
