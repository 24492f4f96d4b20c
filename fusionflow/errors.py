"""FusionFlow's own runtime errors.

Bad arguments and bad config files raise the builtin ValueError / TypeError (with the file, key and
a fix); faults found while data flows (an image that cannot be decoded, a worker that died) raise
these, so training scripts can catch FusionFlow's failures as one family.
"""

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not a builtin type


class FusionFlowError(RuntimeError):
    """Base class of every runtime fault FusionFlow raises."""


class DecodeError(FusionFlowError):
    """An encoded sample could not be decoded into an image.

    ``what`` names the sample (index, path or a short description) so the message can point at it.
    """

    def __init__(self, message: str, what: str | None = None):
        super().__init__(f"{what}: {message}" if what else message)
        self.what = what


class ImageTooLargeError(DecodeError):
    """An encoded image's header declares more pixels than the policy's ``decode.max_pixels``: it is
    refused before decoding (a decompression bomb: a few KB that would decode to gigabytes)."""


class SampleError(FusionFlowError):
    """A sample failed to load, decode or augment in a worker; carries the worker's traceback. Raised through
    `sample_error`, it is also an instance of the worker's exception class where that can be had (so
    `except FileNotFoundError:` catches it, as DataLoader re-raises a worker's exception as its own type)."""

    def __new__(cls, index, what, exc_type, message, worker_traceback, hint=None):
        # the builtin exception whose memory layout the class has (OSError's, combined with an OSError) makes it
        builtin = max((t for t in cls.__mro__ if not t.__flags__ & _HEAPTYPE), key=lambda t: t.__basicsize__)
        return builtin.__new__(cls, _sample_text(what, exc_type, message, worker_traceback, hint))

    def __init__(self, index: int, what: str, exc_type: str, message: str, worker_traceback: str, hint=None):
        super().__init__(_sample_text(what, exc_type, message, worker_traceback, hint))
        self.index, self.what, self.exc_type, self.worker_traceback = index, what, exc_type, worker_traceback
        self._fields = (index, what, exc_type, message, worker_traceback, hint)

    def __str__(self) -> str:  # the text whatever the worker's class would make of it (KeyError quotes, OSError...)
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # a plain SampleError (a class made by sample_error is not importable by name)
        return SampleError, self._fields


def _sample_text(what, exc_type, message, worker_traceback, hint) -> str:
    if hint is None:  # a sample the dataset gave in a form FusionFlow cannot take is the dataset's to fix
        hint = (
            "fix the dataset's __getitem__ (on_error='skip' would drop every sample it returns so)"
            if exc_type == "TypeError"
            else "pass on_error='skip' to drop such samples"
        )
    return f"{what} failed: {exc_type}: {message}\n({hint})\n\nOriginal traceback in the worker:\n{worker_traceback}"


_AS_ALSO: dict = {}  # (our error class, the worker's exception class) -> the two combined


def _as_also(base: type, exc_class: str, message: str, args: tuple):
    """`base(*args)` as an instance of the worker's exception class too (`exc_class`, "module:qualname"), when this
    process has its module loaded, it can be made from one message (DataLoader's test: a class its re-raise could
    make) and the classes combine; else None."""
    cls = _class_named(exc_class)
    if cls is None or issubclass(cls, (base, StopIteration, StopAsyncIteration)):
        return None
    try:
        cls(message)
        if (base, cls) not in _AS_ALSO:
            _AS_ALSO[base, cls] = type(f"{base.__name__}[{cls.__name__}]", (base, cls), {"__module__": __name__})
        return _AS_ALSO[base, cls](*args)
    except Exception:  # a constructor that wants more, layouts that do not combine, a class refusing subclasses
        return None


def sample_error(
    index, what, exc_type, message, worker_traceback, hint=None, exc_class: str = "", attributes=None
) -> SampleError:
    """A SampleError that is also an instance of the worker's exception class, named by `exc_class`
    ("module:qualname"), when this process has that module loaded, the class can be made from one message (as
    DataLoader re-raises: RuntimeError otherwise, which a SampleError is) and the two classes combine; its
    `attributes` (the worker's exception's errno, filename, ... as sent) set on it. Else a plain SampleError.
    Never a StopIteration: a loop would take it for the epoch's end."""
    args = (index, what, exc_type, message, worker_traceback, hint)
    err = _as_also(SampleError, exc_class, message, args)
    if err is None:
        return SampleError(*args)
    for name, value in (attributes or {}).items():
        try:
            setattr(err, name, value)
        except Exception:  # read-only on this class: left as the constructor made it
            pass
    return err


def exception_attributes(exc) -> dict:
    """What a worker sends of an exception beside its message: OSError's errno/strerror/filename/filename2 and the
    instance's own attributes (set by the class's __init__) that are small plain values -- numbers, strings,
    short bytes, tuples of them: a handler reading e.filename or e.code works, and nothing large travels."""
    found = {k: getattr(exc, k) for k in ("errno", "strerror", "filename", "filename2") if isinstance(exc, OSError)}
    mine = vars(exc) if hasattr(exc, "__dict__") else {}
    return found | {k: v for k, v in mine.items() if _plain(v)}


def _plain(value, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex)):
        return True
    if isinstance(value, (str, bytes)):
        return len(value) <= 4096
    if isinstance(value, (tuple, list)) and depth == 0:
        return len(value) <= 16 and all(_plain(v, 1) for v in value)
    return False


def class_name(exc: BaseException) -> str:
    """`exc`'s class as "module:qualname", as a worker sends it (`_class_named` looks it up)."""
    return f"{type(exc).__module__}:{type(exc).__qualname__}"


def _class_named(name: str):
    """The exception class `module:qualname` names, if its module is loaded here (nothing is imported)."""
    import sys

    module, _, qualname = name.partition(":")
    module = "__main__" if module == "__mp_main__" else module  # a spawned worker's name for the main script
    obj = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None and qualname else ():
        obj = getattr(obj, part, None)
    ok = isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ in (module, "__mp_main__")
    return obj if ok else None


class SharedMemoryError(FusionFlowError):
    """The shared-memory batch ring could not be reserved (e.g. a container's small /dev/shm), or a
    worker died of SIGBUS touching shared memory. Not a sample's fault: the message names the bytes
    needed and free and the fixes."""


class AcceleratorError(FusionFlowError):
    """The accelerator's DALI pipeline failed for a reason that is not one sample's fault (it was
    closed, it could not be rebuilt, the device ran out of memory)."""


class DeviceOutOfMemory(AcceleratorError):
    """DALI could not allocate device (or pinned host) memory for a tiny-batch."""


class WorkerStartError(FusionFlowError):
    """A CPU worker could not start (its traceback is in the message)."""


def worker_start_error(message: str, exc_class: str = "") -> WorkerStartError:
    """A WorkerStartError that is also an instance of the exception that stopped the worker (its worker_init_fn's
    ValueError: `except ValueError` catches it, as DataLoader's re-raise), where the class allows (`_as_also`)."""
    return _as_also(WorkerStartError, exc_class, message, (message,)) or WorkerStartError(message)


class SampleKilledWorkersError(FusionFlowError):
    """A sample kept killing worker processes; ``indices`` are the samples of the tiny-batch."""

    def __init__(self, message: str, indices: list[int]):
        super().__init__(message)
        self.indices = indices


class BridgeError(FusionFlowError):
    """The allocator bridge's native side reported a failure."""


class NativeBuildError(BridgeError):
    """A native part of the allocator bridge could not be built or loaded."""


class RemoteWorkerError(FusionFlowError):
    """Remote (Ray) CPU workers could not start or cannot run this loader's samples (e.g. the dataset's
    files are not readable on a remote node); the message names the node and the sample."""


class GatewayLost(RemoteWorkerError):
    """The Ray gateway process itself failed while it started -- killed, ended without a word, or stopped -- rather
    than reporting why Ray or the dataset cannot run: a fault of the machine, not of the configuration. The loader
    does not raise it: its local workers run the epoch and a new gateway is started later (remote/kind.py)."""


class SharedLoaderError(FusionFlowError):
    """A SharedLoaderClient lost its producer: the SharedLoader it named is not serving, exited, was
    killed, stopped, failed (its error is in the message), or did not answer within the client's
    timeout. The message names the producer (its name and pid)."""


class EmptyBatch(Exception):
    """Not raised to the caller: on_error='skip' left a mini-batch no sample, so the iterator (or a
    SharedLoader) goes on to the next one instead of delivering it."""
