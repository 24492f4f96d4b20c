// The C entry points' shared plumbing: nothing throws across the C boundary. A body's exception
// becomes `on_error` with its message in `err` (at most errlen - 1 characters, NUL-terminated).
#ifndef FUSIONFLOW_KERNELS_C_API_H_
#define FUSIONFLOW_KERNELS_C_API_H_

#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include "lent_arena.h"

namespace fusionflow {

template <typename R, typename F>
R c_call(char *err, int errlen, R on_error, F &&body) noexcept {
  try {
    return body();
  } catch (const std::exception &e) {
    if (err && errlen > 0) {
      std::strncpy(err, e.what(), errlen - 1);
      err[errlen - 1] = '\0';
    }
    return on_error;
  }
}

// Regions handed back, as the (bases, sizes) arrays the Python side passes; returns how many.
inline int write_ranges(const std::vector<LentArena::Range> &back, uint64_t *bases, uint64_t *sizes) {
  for (size_t i = 0; i < back.size(); ++i) {
    bases[i] = back[i].base;
    sizes[i] = back[i].size;
  }
  return static_cast<int>(back.size());
}

}  // namespace fusionflow

#endif  // FUSIONFLOW_KERNELS_C_API_H_
