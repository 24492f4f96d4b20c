// FusionFlow allocator bridge, DALI side: a device memory resource installed as DALI's default
// (dali::mm::SetDefaultDeviceResource, exported by the stock libdali_core) that serves DALI's
// allocations from GPU blocks PyTorch lends for a prep window, and passes everything else to the
// resource DALI had before (its own pool).
//
// Stream ordering, without host waits:
//   - open(torch_stream) records an event on PyTorch's stream; the first time a DALI stream takes
//     lent memory in the window it waits for that event (the blocks were free in PyTorch's cache,
//     but kernels queued before may still be reading them);
//   - reusing a range freed on another stream waits for that stream (an event recorded now);
//   - close(torch_stream) makes PyTorch's stream wait for every stream that used lent memory, then
//     hands back the regions with no live allocation (regions DALI still holds stay lent and go
//     back at a later close). PyTorch's caching allocator only reuses a
//     returned block on the stream it was allocated on, which now comes after DALI's work.
// The resource is installed once per device and never uninstalled or destroyed: DALI may free
// through it until the process ends (static destructors included), and memory from the previous
// resource keeps going back to it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dali/core/mm/default_resources.h"
#include "dali/core/mm/memory_resource.h"
#include "lent_arena.h"

namespace fusionflow {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class BridgeResource : public dali::mm::device_async_resource {
 public:
  BridgeResource(int device, std::shared_ptr<dali::mm::device_async_resource> upstream)
      : device_(device), upstream_(std::move(upstream)) {
    check(cudaEventCreateWithFlags(&open_event_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&join_event_, cudaEventDisableTiming), "cudaEventCreate");
  }

  void open(cudaStream_t torch_stream) {
    std::lock_guard<std::mutex> g(m_);
    check(cudaEventRecord(open_event_, torch_stream), "cudaEventRecord(open)");
    waited_.clear();
    arena_.reset_peak();
    arena_.set_accepting(true);
  }

  void lend(uintptr_t base, size_t size) {
    std::lock_guard<std::mutex> g(m_);
    arena_.lend(base, size);
  }

  std::vector<LentArena::Range> close(cudaStream_t torch_stream, int cap) {
    std::lock_guard<std::mutex> g(m_);
    if (arena_.stats().regions > static_cast<size_t>(cap))  // checked before anything is handed back
      throw std::length_error("close: output arrays smaller than the number of lent regions");
    arena_.set_accepting(false);
    for (cudaStream_t s : used_) {
      if (s == torch_stream) continue;
      check(cudaEventRecord(join_event_, s), "cudaEventRecord(join)");
      check(cudaStreamWaitEvent(torch_stream, join_event_, 0), "cudaStreamWaitEvent(join)");
    }
    used_.clear();
    return arena_.reclaim();
  }

  // lent, live, peak_live (this window), served (total), allocations, regions, fallback (total)
  void stats(uint64_t out[7]) {
    std::lock_guard<std::mutex> g(m_);
    arena_.stats_into(out);
    out[6] = fallback_bytes_;
  }

 protected:
  void *do_allocate_async(size_t bytes, size_t alignment, dali::mm::stream_view stream) override {
    cudaStream_t s = stream.get();
    {
      std::lock_guard<std::mutex> g(m_);
      if (arena_.accepting()) {
        uintptr_t freed_on = LentArena::kNone;
        uintptr_t p = arena_.allocate(bytes, std::max<size_t>(alignment, 256), reinterpret_cast<uintptr_t>(s),
                                      &freed_on);
        if (p) {
          order_after_lender(s);
          order_after_previous_user(s, freed_on);
          note_used(s);
          return reinterpret_cast<void *>(p);
        }
        fallback_bytes_ += bytes;
      }
    }
    return upstream_->allocate_async(bytes, alignment, stream);
  }

  void do_deallocate_async(void *ptr, size_t bytes, size_t alignment, dali::mm::stream_view stream) override {
    {
      std::lock_guard<std::mutex> g(m_);
      uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
      if (arena_.owns(p)) {
        arena_.deallocate(p, reinterpret_cast<uintptr_t>(stream.get()));
        note_used(stream.get());
        return;
      }
    }
    upstream_->deallocate_async(ptr, bytes, alignment, stream);
  }

  bool do_is_equal(const dali::mm::memory_resource<dali::mm::memory_kind::device> &other) const noexcept override {
    return this == &other;
  }

 private:
  void order_after_lender(cudaStream_t s) {
    if (std::find(waited_.begin(), waited_.end(), s) != waited_.end()) return;
    check(cudaStreamWaitEvent(s, open_event_, 0), "cudaStreamWaitEvent(open)");
    waited_.push_back(s);
  }

  void order_after_previous_user(cudaStream_t s, uintptr_t freed_on) {
    if (freed_on == LentArena::kNone || freed_on == reinterpret_cast<uintptr_t>(s)) return;
    for (cudaStream_t t : used_) {
      if (t == s) continue;
      if (freed_on != LentArena::kMixed && reinterpret_cast<uintptr_t>(t) != freed_on) continue;
      check(cudaEventRecord(join_event_, t), "cudaEventRecord(reuse)");
      check(cudaStreamWaitEvent(s, join_event_, 0), "cudaStreamWaitEvent(reuse)");
    }
  }

  void note_used(cudaStream_t s) {
    if (std::find(used_.begin(), used_.end(), s) == used_.end()) used_.push_back(s);
  }

  int device_;
  std::shared_ptr<dali::mm::device_async_resource> upstream_;
  std::mutex m_;
  LentArena arena_;
  cudaEvent_t open_event_ = nullptr, join_event_ = nullptr;
  std::vector<cudaStream_t> waited_;  // streams ordered after this window's open event
  std::vector<cudaStream_t> used_;    // streams that touched lent memory since the last close
  uint64_t fallback_bytes_ = 0;       // bytes DALI took from its own pool while a window was open, total
};

std::mutex g_registry_mutex;
std::vector<BridgeResource *> g_resources;  // by device; never freed (see the file comment)

BridgeResource *resource(int device) {
  std::lock_guard<std::mutex> g(g_registry_mutex);
  if (device < 0 || device >= static_cast<int>(g_resources.size()) || !g_resources[device])
    throw std::runtime_error("allocator bridge not installed on device " + std::to_string(device));
  return g_resources[device];
}

int fail(const std::exception &e, char *err, int errlen) {
  if (err && errlen > 0) {
    std::strncpy(err, e.what(), errlen - 1);
    err[errlen - 1] = '\0';
  }
  return -1;
}

}  // namespace
}  // namespace fusionflow

using fusionflow::BridgeResource;

extern "C" {

// Installs the bridge as DALI's default device resource on `device` (idempotent). Call it before
// any DALI pipeline is built so every DALI allocation passes through it.
int ff_bridge_install(int device, char *err, int errlen) {
  try {
    std::lock_guard<std::mutex> g(fusionflow::g_registry_mutex);
    if (device < 0) throw std::invalid_argument("device must be >= 0");
    if (device < static_cast<int>(fusionflow::g_resources.size()) && fusionflow::g_resources[device]) return 0;
    int count = 0;
    fusionflow::check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device >= count) throw std::invalid_argument("no CUDA device " + std::to_string(device));
    int previous = 0;
    fusionflow::check(cudaGetDevice(&previous), "cudaGetDevice");
    fusionflow::check(cudaSetDevice(device), "cudaSetDevice");
    auto upstream = dali::mm::ShareDefaultDeviceResource(device);
    auto *res = new BridgeResource(device, upstream);
    // DALI shares ownership; our registry keeps one reference forever, so it is never destroyed.
    auto shared = std::shared_ptr<dali::mm::device_async_resource>(res, [](dali::mm::device_async_resource *) {});
    dali::mm::SetDefaultDeviceResource(device, shared);
    fusionflow::check(cudaSetDevice(previous), "cudaSetDevice");
    if (static_cast<int>(fusionflow::g_resources.size()) <= device) fusionflow::g_resources.resize(device + 1);
    fusionflow::g_resources[device] = res;
    return 0;
  } catch (const std::exception &e) {
    return fusionflow::fail(e, err, errlen);
  }
}

int ff_bridge_open(int device, uint64_t torch_stream, char *err, int errlen) {
  try {
    fusionflow::resource(device)->open(reinterpret_cast<cudaStream_t>(torch_stream));
    return 0;
  } catch (const std::exception &e) {
    return fusionflow::fail(e, err, errlen);
  }
}

int ff_bridge_lend(int device, uint64_t base, uint64_t size, char *err, int errlen) {
  try {
    fusionflow::resource(device)->lend(base, size);
    return 0;
  } catch (const std::exception &e) {
    return fusionflow::fail(e, err, errlen);
  }
}

// Ends the window; writes the returned regions (at most `cap`, which must be >= the regions lent).
int ff_bridge_close(int device, uint64_t torch_stream, uint64_t *bases, uint64_t *sizes, int cap, char *err,
                    int errlen) {
  try {
    auto back = fusionflow::resource(device)->close(reinterpret_cast<cudaStream_t>(torch_stream), cap);
    for (size_t i = 0; i < back.size(); ++i) {
      bases[i] = back[i].base;
      sizes[i] = back[i].size;
    }
    return static_cast<int>(back.size());
  } catch (const std::exception &e) {
    return fusionflow::fail(e, err, errlen);
  }
}

int ff_bridge_stats(int device, uint64_t out[7], char *err, int errlen) {
  try {
    fusionflow::resource(device)->stats(out);
    return 0;
  } catch (const std::exception &e) {
    return fusionflow::fail(e, err, errlen);
  }
}

}  // extern "C"
