// EXPECT for the C++ self-tests (no gtest): on a false condition, counts a failure in the
// `failures` int of the enclosing scope and prints the file, line and a printf-style
// message; the test goes on.  Shared by test_main.cc and solo_policy_test.h (which also
// compiles alone, so it cannot take the macro from test_main.cc).
#ifndef QDSL_TESTS_EXPECT_H_
#define QDSL_TESTS_EXPECT_H_

#include <cstdio>

#define EXPECT(cond, ...)                              \
  do {                                                 \
    if (!(cond)) {                                     \
      ++failures;                                      \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                        \
      std::printf("\n");                               \
    }                                                  \
  } while (0)

#endif  // QDSL_TESTS_EXPECT_H_
