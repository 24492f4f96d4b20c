// FusionFlow allocator bridge: a sub-allocator over GPU blocks that PyTorch lends for one window (the
// bridge's arena, from the accelerator's start until its pipelines are gone). Pure address arithmetic (it never touches the memory), so it is unit-tested on a machine
// without a GPU through lent_arena_capi.cc; dali_bridge_resource.cc wraps it as DALI's device
// memory resource.
//
// Rules:
//   - regions (lent blocks) are independent: free ranges never merge across two regions, even when
//     the blocks are adjacent in the address space, because each region goes back to PyTorch whole;
//   - best fit over free ranges, honouring the requested alignment; a free range remembers the
//     stream that freed it (kMixed after merging ranges freed on different streams), so the caller
//     can order a reuse on another stream after that stream's work;
//   - allocate() serves only while accepting (a window is open); deallocate() works at any time;
//   - reclaim() closes the window and hands back every region with no live allocation; a region
//     still holding one stays lent ("pinned") and goes back at a later reclaim. The caller orders
//     the lender's stream after every stream that used the arena before calling it, and each later
//     window starts after the lender's stream, so reclaim() also forgets which stream freed the
//     pinned regions' free ranges (they become kNone): stream tags never outlive a window.
#ifndef FUSIONFLOW_KERNELS_LENT_ARENA_H_
#define FUSIONFLOW_KERNELS_LENT_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace fusionflow {

class LentArena {
 public:
  static constexpr uintptr_t kMixed = ~uintptr_t(0);  // a free range freed on several streams
  static constexpr uintptr_t kNone = ~uintptr_t(0) - 1;  // never used since it was lent

  struct Range {
    uintptr_t base;
    size_t size;
  };

  struct Stats {
    size_t lent_bytes = 0;       // regions currently held (open window or pinned)
    size_t live_bytes = 0;       // bytes allocated to the borrower now (as requested; alignment gaps stay free)
    size_t peak_live_bytes = 0;  // since the last reset_peak()
    size_t served_bytes = 0;     // total bytes ever served from lent regions
    size_t allocations = 0;      // live allocations now
    size_t regions = 0;
  };

  void lend(uintptr_t base, size_t size) {
    if (size == 0) throw std::invalid_argument("lend: empty block");
    if (base + size < base) throw std::invalid_argument("lend: block wraps the address space");
    auto next = regions_.lower_bound(base);
    if (next != regions_.end() && next->first < base + size)
      throw std::invalid_argument("lend: block overlaps a region already lent");
    if (next != regions_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > base)
        throw std::invalid_argument("lend: block overlaps a region already lent");
    }
    regions_[base] = Region{size, 0};
    free_[base] = Free{size, kNone, base};
    stats_.lent_bytes += size;
    stats_.regions += 1;
  }

  void set_accepting(bool on) { accepting_ = on; }
  bool accepting() const { return accepting_; }

  // Returns 0 when no free range fits (or no window is open). *freed_on is the stream that last
  // freed the chosen range (kNone: untouched since lent, kMixed: several streams).
  uintptr_t allocate(size_t bytes, size_t alignment, uintptr_t stream, uintptr_t* freed_on) {
    if (!accepting_ || bytes == 0) return 0;
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
      throw std::invalid_argument("allocate: alignment must be a power of two");
    auto best = free_.end();
    size_t best_size = SIZE_MAX;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      uintptr_t start = align_up(it->first, alignment);
      if (start < it->first || start - it->first > it->second.size) continue;
      if (it->second.size - (start - it->first) < bytes) continue;
      if (it->second.size < best_size) {
        best = it;
        best_size = it->second.size;
      }
    }
    if (best == free_.end()) return 0;
    uintptr_t range_base = best->first;
    Free range = best->second;
    free_.erase(best);
    uintptr_t start = align_up(range_base, alignment);
    uintptr_t end = start + bytes;
    if (start > range_base) free_[range_base] = Free{start - range_base, range.freed_on, range.region};
    if (end < range_base + range.size) free_[end] = Free{range_base + range.size - end, range.freed_on, range.region};
    live_[start] = Live{bytes, range.region};
    regions_[range.region].live += 1;
    stats_.live_bytes += bytes;
    stats_.allocations += 1;
    stats_.served_bytes += bytes;
    if (stats_.live_bytes > stats_.peak_live_bytes) stats_.peak_live_bytes = stats_.live_bytes;
    if (freed_on) *freed_on = range.freed_on;
    (void)stream;
    return start;
  }

  bool owns(uintptr_t ptr) const { return live_.count(ptr) != 0; }

  void deallocate(uintptr_t ptr, uintptr_t stream) {
    auto it = live_.find(ptr);
    if (it == live_.end()) throw std::invalid_argument("deallocate: pointer was not served by the arena");
    Live a = it->second;
    live_.erase(it);
    regions_[a.region].live -= 1;
    stats_.live_bytes -= a.size;
    stats_.allocations -= 1;
    uintptr_t base = ptr;
    size_t size = a.size;
    uintptr_t tag = stream;
    auto next = free_.lower_bound(ptr);
    if (next != free_.end() && next->first == ptr + size && next->second.region == a.region) {
      size += next->second.size;
      tag = merge_tag(tag, next->second.freed_on);
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size == base && prev->second.region == a.region) {
        base = prev->first;
        size += prev->second.size;
        tag = merge_tag(tag, prev->second.freed_on);
        free_.erase(prev);
      }
    }
    free_[base] = Free{size, tag, a.region};
  }

  // Closes the window and removes every region without a live allocation; returns them.
  std::vector<Range> reclaim() {
    accepting_ = false;
    std::vector<Range> back;
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second.live != 0) {
        ++it;
        continue;
      }
      auto f = free_.find(it->first);  // an idle region is one whole free range
      if (f == free_.end() || f->second.size != it->second.size)
        throw std::logic_error("reclaim: idle region is not one free range");
      free_.erase(f);
      back.push_back(Range{it->first, it->second.size});
      stats_.lent_bytes -= it->second.size;
      stats_.regions -= 1;
      it = regions_.erase(it);
    }
    for (auto& f : free_) f.second.freed_on = kNone;
    return back;
  }

  Stats stats() const { return stats_; }

  // lent, live, peak_live, served, allocations, regions: the order of the C entry points' arrays
  void stats_into(uint64_t out[6]) const {
    out[0] = stats_.lent_bytes;
    out[1] = stats_.live_bytes;
    out[2] = stats_.peak_live_bytes;
    out[3] = stats_.served_bytes;
    out[4] = stats_.allocations;
    out[5] = stats_.regions;
  }
  void reset_peak() { stats_.peak_live_bytes = stats_.live_bytes; }

 private:
  struct Region {
    size_t size;
    size_t live;
  };
  struct Free {
    size_t size;
    uintptr_t freed_on;
    uintptr_t region;
  };
  struct Live {
    size_t size;
    uintptr_t region;
  };

  static uintptr_t align_up(uintptr_t p, size_t a) { return (p + (a - 1)) & ~uintptr_t(a - 1); }
  static uintptr_t merge_tag(uintptr_t a, uintptr_t b) {
    if (a == b || b == kNone) return a;
    if (a == kNone) return b;
    return kMixed;
  }

  bool accepting_ = false;
  std::map<uintptr_t, Region> regions_;
  std::map<uintptr_t, Free> free_;
  std::unordered_map<uintptr_t, Live> live_;
  Stats stats_;
};

}  // namespace fusionflow

#endif  // FUSIONFLOW_KERNELS_LENT_ARENA_H_
