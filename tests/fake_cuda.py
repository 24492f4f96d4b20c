"""A recording stand-in for the parts of `torch.cuda` the GPU delivery path calls, so that path runs
on a machine without a GPU and its CUDA protocol can be checked: which device was current, which
stream each copy, event record and wait went on, whether events block, what was page-locked.

Per thread, as in CUDA and PyTorch: the current device (0 to start with) and each device's current
stream (its default stream to start with). Streams and events remember their device; recording an
event on a stream of another device than the current one is refused, as PyTorch refuses it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading


class FakeStream:
    def __init__(self, cuda, device: int, name: str, default: bool = False):
        self.cuda, self.device_index, self.name, self.default = cuda, device, name, default
        self.cuda_stream = 0 if default else 0x5000 + next(cuda.ids)

    def wait_event(self, event) -> None:
        self.cuda.log("wait", stream=self, event=event)

    def synchronize(self) -> None:
        self.cuda.log("stream_sync", stream=self)

    def __repr__(self):
        return f"<stream {self.name} on cuda:{self.device_index}>"


class FakeEvent:
    def __init__(self, cuda, enable_timing=False, blocking=False, interprocess=False):
        self.cuda, self.blocking = cuda, blocking
        self.name = f"E{next(cuda.ids)}"
        self.stream = None  # where it was last recorded

    def record(self, stream=None) -> None:
        cuda = self.cuda
        stream = stream if stream is not None else cuda.current_stream()
        if stream.device_index != cuda.current_device():
            raise RuntimeError(f"event recorded on {stream!r} while cuda:{cuda.current_device()} is current")
        self.stream = stream
        cuda.log("record", stream=stream, event=self)

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronize() on an event never recorded"
        self.cuda.log("host_wait", event=self)

    def query(self) -> bool:
        return True


class FakeCudart:
    def __init__(self, cuda, register_rc: int = 0):
        self.cuda, self.register_rc = cuda, register_rc
        self.registered: list[tuple[int, int]] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.cuda.log("host_register", ptr=ptr, size=size, flags=flags)
        if self.register_rc == 0:
            self.registered.append((ptr, ptr + size))
        return self.register_rc

    def cudaHostUnregister(self, ptr):
        self.cuda.log("host_unregister", ptr=ptr)
        self.registered = [r for r in self.registered if r[0] != ptr]
        return 0


class FakeCuda:
    """Install with `install(monkeypatch, torch)`; `records` holds what happened, in order."""

    def __init__(self, devices: int = 2, register_rc: int = 0):
        self.devices = devices
        self.ids = itertools.count()
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._tls = threading.local()
        self.defaults = [FakeStream(self, d, f"default{d}", default=True) for d in range(devices)]
        self.cudart_ = FakeCudart(self, register_rc)

    # ---- state
    def _state(self):
        tls = self._tls
        if not hasattr(tls, "device"):
            tls.device, tls.streams = 0, list(self.defaults)
        return tls

    def log(self, kind, **kw):
        with self._lock:
            self.records.append(
                dict(kind=kind, thread=threading.current_thread().name, device=self.current_device(), **kw)
            )

    def of(self, kind):
        return [r for r in self.records if r["kind"] == kind]

    # ---- the torch.cuda surface
    def is_available(self):
        return True

    def device_count(self):
        return self.devices

    def current_device(self):
        return self._state().device

    def _index(self, device):
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        index = getattr(device, "index", None)
        return self.current_device() if index is None else index

    @contextlib.contextmanager
    def device(self, device):
        st = self._state()
        before, st.device = st.device, self._index(device)
        try:
            yield
        finally:
            st.device = before

    def current_stream(self, device=None):
        return self._state().streams[self._index(device)]

    @contextlib.contextmanager
    def stream(self, stream):
        st = self._state()
        d = stream.device_index
        before, st.streams[d] = st.streams[d], stream
        try:
            yield
        finally:
            st.streams[d] = before

    def Stream(self, device=None, priority=0):  # noqa: N802 (torch's name)
        return FakeStream(self, self._index(device), f"S{next(self.ids)}")

    def Event(self, enable_timing=False, blocking=False, interprocess=False):  # noqa: N802
        return FakeEvent(self, enable_timing, blocking, interprocess)

    def cudart(self):
        return self.cudart_

    def mem_get_info(self, device=None):
        self.log("mem_get_info", of=self._index(device))
        return 8 << 30, 16 << 30

    def synchronize(self, device=None):
        self.log("device_sync", of=self._index(device))

    def install(self, monkeypatch, torch):
        for name in (
            "is_available",
            "device_count",
            "current_device",
            "device",
            "current_stream",
            "stream",
            "Stream",
            "Event",
            "cudart",
            "mem_get_info",
            "synchronize",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
