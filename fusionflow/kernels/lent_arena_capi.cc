// C entry points over LentArena alone (no CUDA, no DALI), so the sub-allocator the bridge runs
// on the GPU is tested on any machine with a C++ compiler. Errors come back as 0 / -1 (0 for a
// pointer) with the message in `err`; nothing throws across the C boundary.
#include <stdexcept>

#include "c_api.h"
#include "lent_arena.h"

using fusionflow::c_call;
using fusionflow::LentArena;

namespace {
LentArena *arena(void *a) { return static_cast<LentArena *>(a); }
}  // namespace

extern "C" {

void *ff_arena_new() { return new LentArena(); }
void ff_arena_delete(void *a) { delete arena(a); }
void ff_arena_set_accepting(void *a, int on) { arena(a)->set_accepting(on != 0); }

int ff_arena_lend(void *a, uint64_t base, uint64_t size, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    arena(a)->lend(base, size);
    return 0;
  });
}

uint64_t ff_arena_allocate(void *a, uint64_t bytes, uint64_t alignment, uint64_t stream, uint64_t *freed_on,
                           char *err, int errlen) {
  return c_call(err, errlen, uint64_t(0), [&] {
    uintptr_t tag = 0;
    uintptr_t p = arena(a)->allocate(bytes, alignment, stream, &tag);
    if (freed_on) *freed_on = tag;
    return uint64_t(p);
  });
}

int ff_arena_deallocate(void *a, uint64_t ptr, uint64_t stream, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    arena(a)->deallocate(ptr, stream);
    return 0;
  });
}

// Writes up to `cap` (base, size) pairs; returns how many regions went back (-1 on error).
int ff_arena_reclaim(void *a, uint64_t *bases, uint64_t *sizes, int cap, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    if (arena(a)->stats().regions > static_cast<size_t>(cap))  // checked before anything is handed back
      throw std::length_error("reclaim: output arrays smaller than the number of lent regions");
    return fusionflow::write_ranges(arena(a)->reclaim(), bases, sizes);
  });
}

// lent, live, peak_live, served, allocations, regions
void ff_arena_stats(void *a, uint64_t out[6]) { arena(a)->stats_into(out); }

}  // extern "C"
