// Tuning knobs read from the environment (A/B timing of a kernel choice without a rebuild).
#pragma once

#include <cstdlib>

namespace pyorch {

// The integer in environment variable `name` if it is set to one in [lo, hi], else `fallback`.
// Callers cache the result in a function-local static: it is read once per process.
inline int env_int(const char* name, int fallback, long lo, long hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  return (*end == '\0' && n >= lo && n <= hi) ? static_cast<int>(n) : fallback;
}

}  // namespace pyorch
