"""FusionFlow's own runtime errors.

Bad arguments and bad config files raise the builtin ValueError / TypeError (with the file, key and
a fix); faults found while data flows (an image that cannot be decoded, a worker that died) raise
these, so training scripts can catch FusionFlow's failures as one family.
"""


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
    """A sample failed to load, decode or augment in a worker; carries the worker's traceback."""

    def __init__(self, index: int, what: str, exc_type: str, message: str, worker_traceback: str, hint=None):
        if hint is None:  # a sample the dataset gave in a form FusionFlow cannot take is the dataset's to fix
            hint = (
                "fix the dataset's __getitem__ (on_error='skip' would drop every sample it returns so)"
                if exc_type == "TypeError"
                else "pass on_error='skip' to drop such samples"
            )
        super().__init__(
            f"{what} failed: {exc_type}: {message}\n({hint})\n\nOriginal traceback in the worker:\n{worker_traceback}"
        )
        self.index, self.what, self.exc_type, self.worker_traceback = index, what, exc_type, worker_traceback


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


class SharedLoaderError(FusionFlowError):
    """A SharedLoaderClient lost its producer: the SharedLoader it named is not serving, exited, was
    killed, stopped, failed (its error is in the message), or did not answer within the client's
    timeout. The message names the producer (its name and pid)."""


class EmptyBatch(Exception):
    """Not raised to the caller: on_error='skip' left a mini-batch no sample, so the iterator (or a
    SharedLoader) goes on to the next one instead of delivering it."""
