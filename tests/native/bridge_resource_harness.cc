// Drives kernels/dali_bridge_resource.cc's BridgeResource through DALI's memory resource interface
// on a machine without a GPU: the CUDA runtime calls it makes are defined here as fakes that log
// themselves (events E0, E1, ... in creation order; streams T, S1, S2), and its upstream is a fake
// resource. tests/test_bridge.py compiles this, runs it, and checks the log against the ordering
// protocol written at the top of dali_bridge_resource.cc.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "dali_bridge_resource.cc"  // NOLINT: the class under test lives in that file's anonymous namespace

namespace {
std::map<const void *, std::string> g_names;
bool (*g_lock_free)() = nullptr;  // set by main: whether another thread can take the resource's lock now
int g_events = 0;
bool g_fail_record = false;  // cudaEventRecord fails as it does while the CUDA runtime unloads
std::map<const void *, unsigned long long> g_ids;  // a stream's CUDA id (its handle's value until set)

std::string name(const void *p) {
  auto it = g_names.find(p);
  return it == g_names.end() ? "?" : it->second;
}
void say(const std::string &s) { std::printf("%s\n", s.c_str()); }
}  // namespace

extern "C" {
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { say("set device " + std::to_string(d)); return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t) { return "fake"; }
const char *cudaGetErrorName(cudaError_t) { return "fake"; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(0xE000 + g_events);
  g_names[*e] = "E" + std::to_string(g_events++);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  say("record " + name(e) + " on " + name(s) + (g_fail_record ? " fails" : ""));
  return g_fail_record ? cudaErrorCudartUnloading : cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  say("wait " + name(s) + " for " + name(e));
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  say("host waits for " + name(e));
  if (g_lock_free) say(g_lock_free() ? "the resource's lock is free meanwhile" : "the resource's lock is HELD meanwhile");
  return cudaSuccess;
}
cudaError_t cudaStreamGetId(cudaStream_t s, unsigned long long *id) {
  auto it = g_ids.find(s);
  *id = it == g_ids.end() ? reinterpret_cast<uintptr_t>(s) : it->second;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { say("host syncs " + name(s)); return cudaSuccess; }
}

class FakeUpstream : public dali::mm::device_async_resource {
 protected:
  void *do_allocate_async(size_t bytes, size_t, dali::mm::stream_view s) override {
    say("upstream allocates " + std::to_string(bytes) + " on " + name(s.get()));
    return reinterpret_cast<void *>(0xF0000000);
  }
  void do_deallocate_async(void *, size_t bytes, size_t, dali::mm::stream_view s) override {
    say("upstream frees " + std::to_string(bytes) + " on " + name(s.get()));
  }
  void *do_allocate(size_t bytes, size_t) override {
    say("upstream allocates " + std::to_string(bytes) + " (sync)");
    return reinterpret_cast<void *>(0xF1000000);
  }
  void do_deallocate(void *, size_t bytes, size_t) override { say("upstream frees " + std::to_string(bytes) + " (sync)"); }
  bool do_is_equal(const dali::mm::memory_resource<dali::mm::memory_kind::device> &o) const noexcept override {
    return this == &o;
  }
};

int main() {
  const size_t MiB = 1 << 20;
  auto T = reinterpret_cast<cudaStream_t>(0x7), S1 = reinterpret_cast<cudaStream_t>(0x51),
       S2 = reinterpret_cast<cudaStream_t>(0x52);
  g_names[T] = "T";
  g_names[S1] = "S1";
  g_names[S2] = "S2";
  auto up = std::make_shared<FakeUpstream>();
  fusionflow::BridgeResource res(0, up);
  static fusionflow::BridgeResource *resp = &res;
  g_lock_free = [] {  // another thread reads the counters (takes the lock) within 2 s, or it is held
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([done] {
      uint64_t out[7];
      resp->stats(out);
      *done = true;
    }).detach();
    for (int i = 0; i < 200 && !*done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done->load();
  };
  say(std::string("upstream reachable: ") + (res.upstream() == up.get() ? "yes" : "no"));
  auto at = [](void *p) { char b[32]; std::snprintf(b, sizeof b, "%#lx", (unsigned long)(uintptr_t)p); return std::string(b); };

  say("-- before any window");
  res.deallocate_async(res.allocate_async(MiB, 256, S1), MiB, 256, S1);
  say("-- window 1");
  res.lend(0x10000000, 4 * MiB);
  res.open(T);
  void *p1 = res.allocate_async(MiB, 256, S1);
  say("p1 " + at(p1));
  void *p2 = res.allocate_async(MiB, 256, S1);
  say("p2 " + at(p2));
  res.deallocate_async(p1, MiB, 256, S1);
  void *p3 = res.allocate_async(MiB, 256, S2);
  say("p3 " + at(p3));
  res.allocate_async(8 * MiB, 256, S1);  // does not fit in what is lent
  void *q = res.allocate(512 * 1024, 256);
  say("q " + at(q));
  res.deallocate_async(p3, MiB, 256, S2);
  uint64_t stats[7];
  res.stats(stats);
  say("fallback " + std::to_string(stats[6]) + " live " + std::to_string(stats[1]));
  auto back = res.close(T, 1);
  say("close returned " + std::to_string(back.size()));
  say("-- between windows");
  res.deallocate_async(p2, MiB, 256, S1);
  res.deallocate(q, 512 * 1024, 256);
  res.allocate_async(MiB, 256, S1);
  say("-- window 2");
  res.open(T);
  back = res.close(T, 1);
  say("close returned " + std::to_string(back.size()) + (back.empty() ? "" : " " + at((void *)back[0].base)));
  try {
    res.close(T, 0);
    res.lend(0x20000000, MiB);
    res.close(T, 0);
  } catch (const std::length_error &) {
    say("close refused: cap");
  }
  say("-- a free whose event record fails");
  res.open(T);
  void *r = res.allocate_async(MiB, 256, S2);
  say("r " + at(r));
  g_fail_record = true;
  res.deallocate_async(r, MiB, 256, S2);  // must not throw: DALI frees from deleters
  g_fail_record = false;
  back = res.close(T, 4);
  say("close returned " + std::to_string(back.size()) + (back.empty() ? "" : " " + at((void *)back[0].base)));
  say("-- paused (a rebuild): DALI's own pool while the window is open, lent memory again after");
  res.lend(0x30000000, 4 * MiB);
  res.pause(true);
  res.open(T);
  res.allocate_async(MiB, 256, S1);
  res.pause(false);
  void *u = res.allocate_async(MiB, 256, S1);
  say("u " + at(u));
  res.deallocate_async(u, MiB, 256, S1);
  back = res.close(T, 4);
  say("close returned " + std::to_string(back.size()) + (back.empty() ? "" : " " + at((void *)back[0].base)));
  say("-- a destroyed stream's handle reused by a new stream: waits as any other stream");
  res.lend(0x40000000, MiB);
  res.open(T);
  void *v = res.allocate_async(MiB, 256, S2);
  say("v " + at(v));
  res.deallocate_async(v, MiB, 256, S2);
  g_ids[S2] = 0x9999;  // S2 destroyed (a decoder's stream, with its pipeline); a new stream got its handle
  void *w = res.allocate_async(MiB, 256, S2);
  say("w " + at(w));
  res.deallocate_async(w, MiB, 256, S2);
  back = res.close(T, 4);
  say("close returned " + std::to_string(back.size()) + (back.empty() ? "" : " " + at((void *)back[0].base)));
  return 0;
}
