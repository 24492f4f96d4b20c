"""FusionFlow: CPU-GPU cooperative data augmentation for PyTorch training.

Public API: `FusionFlowLoader`, `DaliAccelerator` (the DALI accelerator's settings, `accelerator=`),
`DecodedCache` (the node's cache of decoded images, `cache=`), `RayWorkers` (remote CPU workers; needs the
`ray` extra), `SharedLoader` and
`SharedLoaderClient` (one loader's batches shared by co-located training jobs), `GlobalManagerClient` (a DDP
job's worker lending: its local managers, `set_workers`), `ImageFolder`,
`TarShards` (WebDataset tar shards, indexed), `DictSamples`, `load_policy`, `policy_from_transform`
(torchvision and timm transforms), `from_timm` (timm's create_transform arguments), `Policy`, and
FusionFlow's errors; `fusionflow.timm.create_loader` is timm's create_loader with FusionFlow underneath.
`FusionFlowLoader` and the shared loader (which import torch) are loaded on first use, so policy tooling stays light.
"""

from fusionflow.accel.config import DaliAccelerator  # no torch, no DALI: a frozen, checked configuration
from fusionflow.cache.config import DecodedCache  # no torch: the decoded-image cache's settings (cache=)
from fusionflow.datasets.folder import ImageFolder
from fusionflow.datasets.shards import ShardError, TarShards
from fusionflow.datasets.wrappers import DictSamples
from fusionflow.errors import (
    AcceleratorError,
    BridgeError,
    DecodeError,
    DeviceOutOfMemory,
    FusionFlowError,
    GatewayLost,
    ImageTooLargeError,
    NativeBuildError,
    RemoteWorkerError,
    SampleError,
    SampleKilledWorkersError,
    SharedLoaderError,
    SharedMemoryError,
    WorkerStartError,
)
from fusionflow.policy import Policy, load_policy
from fusionflow.policy.from_torchvision import from_timm, policy_from_transform  # torchvision / timm: when called

__all__ = [
    "AcceleratorError",
    "BridgeError",
    "DaliAccelerator",
    "DecodeError",
    "DecodedCache",
    "DeviceOutOfMemory",
    "DictSamples",
    "FusionFlowError",
    "FusionFlowLoader",
    "GatewayLost",
    "GlobalManagerClient",
    "ImageFolder",
    "ImageTooLargeError",
    "NativeBuildError",
    "Policy",
    "RayWorkers",
    "RemoteWorkerError",
    "SampleError",
    "SampleKilledWorkersError",
    "ShardError",
    "SharedLoader",
    "SharedLoaderClient",
    "SharedLoaderError",
    "SharedMemoryError",
    "TarShards",
    "WorkerStartError",
    "from_timm",
    "load_policy",
    "policy_from_transform",
]


def __getattr__(name):
    if name == "FusionFlowLoader":
        from fusionflow.loader import FusionFlowLoader

        return FusionFlowLoader
    if name == "RayWorkers":  # imports ray only when constructed (an optional extra: fusionflow[ray])
        from fusionflow.remote.config import RayWorkers

        return RayWorkers
    if name == "SharedLoader":  # one loader's batches served to co-located training jobs (fusionflow/shared/)
        from fusionflow.shared.producer import SharedLoader

        return SharedLoader
    if name == "timm":  # fusionflow.timm.create_loader: timm's create_loader, FusionFlow underneath (needs timm)
        import importlib

        return importlib.import_module("fusionflow.timm")
    if name == "GlobalManagerClient":  # a DDP job's worker lending: look at it, set its worker count
        from fusionflow.runtime.gm.manager import GlobalManagerClient

        return GlobalManagerClient
    if name == "SharedLoaderClient":
        from fusionflow.shared.client import SharedLoaderClient

        return SharedLoaderClient
    raise AttributeError(f"module 'fusionflow' has no attribute {name!r}")


__version__ = "0.1.0"
