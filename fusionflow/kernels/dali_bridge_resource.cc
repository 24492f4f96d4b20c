// FusionFlow allocator bridge, DALI side: a device memory resource installed as DALI's default
// (dali::mm::SetDefaultDeviceResource, exported by the stock libdali_core) that serves DALI's
// allocations from GPU blocks PyTorch lends for a window, and passes everything else to the
// resource DALI had before (its own pool, still reachable through with_upstream). A window is the
// time from open() to close(): the bridge (fusionflow/accel/bridge/memory_bridge.py) opens one when it
// lends DALI its arena, before the accelerator's first run, and closes it once DALI's pipelines are gone.
//
// Stream ordering, without host waits on the stream-ordered path:
//   - open(torch_stream), called after the blocks are lent, records a new event on PyTorch's stream;
//     the first time a DALI stream takes lent memory in the window it waits for that event (the
//     blocks were free in PyTorch's cache, but kernels queued before may still be reading them);
//   - every free of lent memory on stream s records s's own event right there, so the free's
//     dependencies are captured at the moment of the free; reusing a range freed on another stream
//     waits for that event (all such events for a range freed on several streams);
//   - close(torch_stream) makes PyTorch's stream wait for the events of every stream that freed
//     lent memory since the last close, then hands back the regions with no live allocation
//     (regions DALI still holds stay lent and go back at a later close). PyTorch's caching
//     allocator reuses a returned block on the stream it was allocated on, now after DALI's work.
//     close() never touches a DALI stream, so a stream DALI destroyed meanwhile does no harm.
//   - The synchronous entry points (DALI's host-synchronous allocations) wait on the host for the
//     same events instead, and a synchronous free needs no event (nothing is pending on it).
// Streams are told apart by CUDA's stream id (cudaStreamGetId: unique for the context's life), never by their
// handle: a stream DALI destroys (a decoder's, with its pipeline after a failed run) may hand its handle to a new
// stream, which has waited for nothing the old one waited for and must not skip a wait as "the same stream".
// The CUDA calls of open/close/stats and of a free run with the resource's device current (a thread
// may have another one, and stream 0 means "the current device's default stream"). Frees never
// throw (they run in DALI's deleters): a failed event record falls back to a host wait.
// The resource is installed once per device and never uninstalled or destroyed: DALI may free
// through it until the process ends (static destructors included), and memory from the previous
// resource keeps going back to it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dali/core/mm/default_resources.h"
#include "dali/core/mm/memory_resource.h"
#include "dali/core/mm/with_upstream.h"
#include "c_api.h"
#include "lent_arena.h"

namespace fusionflow {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Blocking-sync: a host wait on one (the host-synchronous allocations) sleeps instead of spinning a core.
constexpr unsigned kEventFlags = cudaEventDisableTiming | cudaEventBlockingSync;

// A stream's key for the bookkeeping: its CUDA id; where CUDA cannot tell it (a stream destroyed meanwhile), a
// key used once, which matches no other stream (its range's next user waits for its event, never skips it).
uintptr_t stream_key(cudaStream_t s) noexcept {
  static std::atomic<uintptr_t> unknown{~uintptr_t(0) >> 1};  // far above CUDA's ids, below the arena's tags
  unsigned long long id = 0;
  if (cudaStreamGetId(s, &id) == cudaSuccess) return static_cast<uintptr_t>(id);
  cudaGetLastError();
  return unknown++;
}

class DeviceGuard {  // makes `device` current for a scope, then restores the caller's
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

using device_kind = dali::mm::memory_kind::device;

class BridgeResource : public dali::mm::device_async_resource, public dali::mm::with_upstream<device_kind> {
 public:
  BridgeResource(int device, std::shared_ptr<dali::mm::device_async_resource> upstream)
      : device_(device), upstream_(std::move(upstream)) {}

  dali::mm::memory_resource<device_kind> *upstream() const override { return upstream_.get(); }

  void open(cudaStream_t torch_stream) {
    std::lock_guard<std::mutex> g(m_);
    DeviceGuard d(device_);
    // an event of this window's own: a host-synchronous allocation waiting (outside the lock) on the last
    // window's keeps waiting on what it was given, never on a record made here on another stream
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, kEventFlags), "cudaEventCreate");
    open_events_.push_back(ev);  // never destroyed (as the frees' events): a wait may still hold an old one
    check(cudaEventRecord(ev, torch_stream), "cudaEventRecord(open)");
    open_event_ = ev;  // published once recorded
    waited_.clear();
    arena_.reset_peak();
    open_ = true;
    arena_.set_accepting(!paused_);
  }

  // Paused, DALI's allocations go to its own pool while a window stays open: a pipeline rebuilt after a failed
  // run allocates its lasting buffers there, not in the arena sized for the runs.
  void pause(bool paused) {
    std::lock_guard<std::mutex> g(m_);
    paused_ = paused;
    arena_.set_accepting(open_ && !paused_);
  }

  void lend(uintptr_t base, size_t size) {
    std::lock_guard<std::mutex> g(m_);
    arena_.lend(base, size);
  }

  std::vector<LentArena::Range> close(cudaStream_t torch_stream, int cap) {
    std::lock_guard<std::mutex> g(m_);
    open_ = false;
    arena_.set_accepting(false);  // first: whatever fails below, DALI stops taking lent memory
    if (arena_.stats().regions > static_cast<size_t>(cap))  // checked before anything is handed back
      throw std::length_error("close: output arrays smaller than the number of lent regions");
    DeviceGuard d(device_);
    for (auto &kv : freed_) {
      if (!kv.second.pending) continue;
      check(cudaStreamWaitEvent(torch_stream, kv.second.event, 0), "cudaStreamWaitEvent(close)");
      kv.second.pending = false;
    }
    // no range's tag names these streams after reclaim(): their entries go (streams come and go with rebuilt
    // pipelines, and every new one would add an entry for good), their events to the spares (a host wait may
    // still hold one: never destroyed)
    for (auto &kv : freed_) spare_events_.push_back(kv.second.event);
    freed_.clear();
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
      if (void *p = take(bytes, alignment, s, false, [&](cudaEvent_t ev) {
            check(cudaStreamWaitEvent(s, ev, 0), "cudaStreamWaitEvent(lent memory)");
          }))
        return p;
    }
    return upstream_->allocate_async(bytes, alignment, stream);
  }

  // Never throws: DALI frees from deleters and destructors (an exception there is std::terminate),
  // up to the process's exit, when the CUDA runtime may already be unloading.
  void do_deallocate_async(void *ptr, size_t bytes, size_t alignment, dali::mm::stream_view stream) noexcept override {
    {
      std::lock_guard<std::mutex> g(m_);
      uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
      if (arena_.owns(p)) {
        free_lent(p, stream.get());
        return;
      }
    }
    try {
      upstream_->deallocate_async(ptr, bytes, alignment, stream);
    } catch (const std::exception &e) {
      report("DALI's own pool failed to free", e.what());
    }
  }

  // Host-synchronous allocation: the memory must be usable by any stream when this returns. The range is
  // taken under the lock and waited for outside it, so DALI's other allocations and frees (and close) do
  // not wait behind this host wait. An event re-recorded meanwhile (a later free on its stream) only makes
  // the wait longer: it marks a later point of the same stream. If a wait fails, the range goes back as
  // freed on every stream (its next user waits for them all).
  void *do_allocate(size_t bytes, size_t alignment) override {
    std::vector<cudaEvent_t> events;
    void *p = nullptr;
    {
      std::lock_guard<std::mutex> g(m_);
      p = take(bytes, alignment, nullptr, true, [&](cudaEvent_t ev) { events.push_back(ev); });
    }
    if (!p) return upstream_->allocate(bytes, alignment);
    try {
      for (cudaEvent_t ev : events) check(cudaEventSynchronize(ev), "cudaEventSynchronize(lent memory)");
    } catch (...) {
      std::lock_guard<std::mutex> g(m_);
      arena_.deallocate(reinterpret_cast<uintptr_t>(p), LentArena::kMixed);
      throw;
    }
    return p;
  }

  // Host-synchronous free: no work is pending on the memory, so no stream needs to wait for it.
  // Never throws (as do_deallocate_async).
  void do_deallocate(void *ptr, size_t bytes, size_t alignment) noexcept override {
    {
      std::lock_guard<std::mutex> g(m_);
      uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
      if (arena_.owns(p)) {
        try {
          arena_.deallocate(p, LentArena::kNone);
        } catch (const std::exception &e) {
          report("freeing lent memory", e.what());
        }
        return;
      }
    }
    try {
      upstream_->deallocate(ptr, bytes, alignment);
    } catch (const std::exception &e) {
      report("DALI's own pool failed to free", e.what());
    }
  }

  bool do_is_equal(const dali::mm::memory_resource<device_kind> &other) const noexcept override {
    return this == &other;
  }

 private:
  struct Freed {
    cudaEvent_t event = nullptr;
    bool pending = false;  // recorded since the last close
  };

  Freed &freed_on(uintptr_t key) {
    Freed &f = freed_[key];
    if (!f.event && !spare_events_.empty()) {
      f.event = spare_events_.front();
      spare_events_.erase(spare_events_.begin());
    } else if (!f.event) {
      DeviceGuard d(device_);  // the event belongs to the resource's device, whatever the freeing thread has
      check(cudaEventCreateWithFlags(&f.event, kEventFlags), "cudaEventCreate");
    }
    return f;
  }

  // Under m_: a free of lent memory on stream `s`. Normally it records `s`'s event right there, so
  // the range's next user (or PyTorch, at close) waits for the work queued before the free. If
  // that fails (a failed event record, or cudaErrorCudartUnloading at exit), the host waits for
  // `s` instead and the range needs no event; if even that fails, nothing can still run on the
  // memory that is worth ordering (the context is broken or going away). Never throws.
  void free_lent(uintptr_t p, cudaStream_t s) noexcept {
    uintptr_t tag = LentArena::kNone;
    try {
      DeviceGuard d(device_);  // (stream 0 is the current device's default stream: the resource's)
      tag = stream_key(s);
      Freed &f = freed_on(tag);
      check(cudaEventRecord(f.event, s), "cudaEventRecord(free)");  // what the free waits for, captured now
      f.pending = true;
    } catch (const std::exception &e) {
      cudaGetLastError();  // do not leave the failure for DALI's next error check
      cudaError_t sync = cudaStreamSynchronize(s);
      cudaGetLastError();
      report(sync == cudaSuccess ? "free of lent memory: waited on the host instead of an event"
                                 : "free of lent memory: neither an event nor a host wait worked", e.what());
      tag = LentArena::kNone;
    }
    try {
      arena_.deallocate(p, tag);
    } catch (const std::exception &e) {
      report("freeing lent memory", e.what());
    }
  }

  void report(const char *what, const char *why) noexcept {
    if (reports_++ < 8) std::fprintf(stderr, "fusionflow allocator bridge: %s (%s)\n", what, why);
  }

  // Under m_: a range of lent memory for stream `s` (host_sync: for the host, any stream after),
  // with `wait(event)` applied to every event it must come after -- the lender's open event (once
  // per stream and window on the stream-ordered path) and the previous users' frees; nullptr when
  // no window is open or nothing fits. On a CUDA failure the range goes back to the arena.
  template <typename Wait>
  void *take(size_t bytes, size_t alignment, cudaStream_t s, bool host_sync, Wait wait) {
    if (!arena_.accepting()) return nullptr;
    uintptr_t freed_on = LentArena::kNone, key = host_sync ? 0 : stream_key(s);
    uintptr_t p = arena_.allocate(bytes, std::max<size_t>(alignment, 256), key, &freed_on);
    if (!p) {
      fallback_bytes_ += bytes;
      return nullptr;
    }
    try {
      if (host_sync) {
        wait(open_event_);
      } else if (std::find(waited_.begin(), waited_.end(), key) == waited_.end()) {
        wait(open_event_);
        waited_.push_back(key);
      }
      if (freed_on != LentArena::kNone) {
        for (auto &kv : freed_) {
          if (!host_sync && kv.first == key) continue;  // the same stream is ordered already
          if (freed_on == LentArena::kMixed || kv.first == freed_on) wait(kv.second.event);
        }
      }
    } catch (...) {
      arena_.deallocate(p, freed_on);
      throw;
    }
    return reinterpret_cast<void *>(p);
  }

  int device_;
  std::shared_ptr<dali::mm::device_async_resource> upstream_;
  std::mutex m_;
  LentArena arena_;
  cudaEvent_t open_event_ = nullptr;         // this window's (the last of open_events_)
  std::vector<cudaEvent_t> open_events_;      // one per window opened
  bool open_ = false;                         // a window is open (open() .. close())
  bool paused_ = false;                       // lent memory refused meanwhile (pause())
  std::vector<uintptr_t> waited_;             // streams (stream_key) ordered after this window's open event
  std::map<uintptr_t, Freed> freed_;          // per stream (stream_key) that freed lent memory: its last free's event
  std::vector<cudaEvent_t> spare_events_;     // events of streams forgotten at a close, for the next ones
  uint64_t fallback_bytes_ = 0;               // bytes DALI took from its own pool while a window was open
  std::atomic<int> reports_{0};               // failures written to stderr (the first few only)
};

std::mutex g_registry_mutex;
std::vector<BridgeResource *> g_resources;  // by device; never freed (see the file comment)

BridgeResource *resource(int device) {
  std::lock_guard<std::mutex> g(g_registry_mutex);
  if (device < 0 || device >= static_cast<int>(g_resources.size()) || !g_resources[device])
    throw std::runtime_error("allocator bridge not installed on device " + std::to_string(device));
  return g_resources[device];
}

}  // namespace
}  // namespace fusionflow

using fusionflow::BridgeResource;
using fusionflow::c_call;

extern "C" {

// Installs the bridge as DALI's default device resource on `device` (idempotent). Call it before
// any DALI pipeline is built so every DALI allocation passes through it.
int ff_bridge_install(int device, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    std::lock_guard<std::mutex> g(fusionflow::g_registry_mutex);
    if (device < 0) throw std::invalid_argument("device must be >= 0");
    if (device < static_cast<int>(fusionflow::g_resources.size()) && fusionflow::g_resources[device]) return 0;
    int count = 0;
    fusionflow::check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device >= count) throw std::invalid_argument("no CUDA device " + std::to_string(device));
    fusionflow::DeviceGuard guard(device);
    auto upstream = dali::mm::ShareDefaultDeviceResource(device);
    auto *res = new BridgeResource(device, upstream);
    // DALI shares ownership; our registry keeps one reference forever, so it is never destroyed.
    auto shared = std::shared_ptr<dali::mm::device_async_resource>(res, [](dali::mm::device_async_resource *) {});
    dali::mm::SetDefaultDeviceResource(device, shared);
    if (static_cast<int>(fusionflow::g_resources.size()) <= device) fusionflow::g_resources.resize(device + 1);
    fusionflow::g_resources[device] = res;
    return 0;
  });
}

int ff_bridge_open(int device, uint64_t torch_stream, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    fusionflow::resource(device)->open(reinterpret_cast<cudaStream_t>(torch_stream));
    return 0;
  });
}

int ff_bridge_lend(int device, uint64_t base, uint64_t size, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    fusionflow::resource(device)->lend(base, size);
    return 0;
  });
}

// Ends the window; writes the returned regions (at most `cap`, which must be >= the regions lent).
int ff_bridge_close(int device, uint64_t torch_stream, uint64_t *bases, uint64_t *sizes, int cap, char *err,
                    int errlen) {
  return c_call(err, errlen, -1, [&] {
    auto back = fusionflow::resource(device)->close(reinterpret_cast<cudaStream_t>(torch_stream), cap);
    return fusionflow::write_ranges(back, bases, sizes);
  });
}

int ff_bridge_pause(int device, int paused, char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    fusionflow::resource(device)->pause(paused != 0);
    return 0;
  });
}

int ff_bridge_stats(int device, uint64_t out[7], char *err, int errlen) {
  return c_call(err, errlen, -1, [&] {
    fusionflow::resource(device)->stats(out);
    return 0;
  });
}

}  // extern "C"
