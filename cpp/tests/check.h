// The C++ tests' checks, no framework: CHECK prints the failure and counts it.
#pragma once

#include <cstdio>

inline int g_failures = 0;
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)
#define CHECK_THROWS(expr, Exc)             \
  do {                                      \
    bool thrown = false;                    \
    try {                                   \
      expr;                                 \
    } catch (const Exc&) {                  \
      thrown = true;                        \
    }                                       \
    CHECK(thrown && #expr " throws " #Exc); \
  } while (0)
