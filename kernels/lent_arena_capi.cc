// C entry points over LentArena alone (no CUDA, no DALI), so the sub-allocator the bridge runs
// on the GPU is tested on any machine with a C++ compiler. Errors come back as 0 / -1 with the
// message in `err`; nothing throws across the C boundary.
#include <cstring>
#include <exception>

#include "lent_arena.h"

using fusionflow::LentArena;

namespace {
void put_error(const std::exception& e, char* err, int errlen) {
  if (err && errlen > 0) {
    std::strncpy(err, e.what(), errlen - 1);
    err[errlen - 1] = '\0';
  }
}
}  // namespace

extern "C" {

void* ff_arena_new() { return new LentArena(); }
void ff_arena_delete(void* a) { delete static_cast<LentArena*>(a); }
void ff_arena_set_accepting(void* a, int on) { static_cast<LentArena*>(a)->set_accepting(on != 0); }

int ff_arena_lend(void* a, uint64_t base, uint64_t size, char* err, int errlen) {
  try {
    static_cast<LentArena*>(a)->lend(base, size);
    return 0;
  } catch (const std::exception& e) {
    put_error(e, err, errlen);
    return -1;
  }
}

uint64_t ff_arena_allocate(void* a, uint64_t bytes, uint64_t alignment, uint64_t stream, uint64_t* freed_on,
                           char* err, int errlen) {
  try {
    uintptr_t tag = 0;
    uintptr_t p = static_cast<LentArena*>(a)->allocate(bytes, alignment, stream, &tag);
    if (freed_on) *freed_on = tag;
    return p;
  } catch (const std::exception& e) {
    put_error(e, err, errlen);
    return 0;
  }
}

int ff_arena_deallocate(void* a, uint64_t ptr, uint64_t stream, char* err, int errlen) {
  try {
    static_cast<LentArena*>(a)->deallocate(ptr, stream);
    return 0;
  } catch (const std::exception& e) {
    put_error(e, err, errlen);
    return -1;
  }
}

// Writes up to `cap` (base, size) pairs; returns how many regions went back (-1 on error).
int ff_arena_reclaim(void* a, uint64_t* bases, uint64_t* sizes, int cap, char* err, int errlen) {
  try {
    auto* arena = static_cast<LentArena*>(a);
    if (arena->stats().regions > static_cast<size_t>(cap))  // checked before anything is handed back
      throw std::length_error("reclaim: output arrays smaller than the number of lent regions");
    auto back = arena->reclaim();
    for (size_t i = 0; i < back.size(); ++i) {
      bases[i] = back[i].base;
      sizes[i] = back[i].size;
    }
    return static_cast<int>(back.size());
  } catch (const std::exception& e) {
    put_error(e, err, errlen);
    return -1;
  }
}

// lent, live, peak_live, served, allocations, regions
void ff_arena_stats(void* a, uint64_t out[6]) { static_cast<LentArena*>(a)->stats_into(out); }

}  // extern "C"
