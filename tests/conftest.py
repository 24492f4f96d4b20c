import functools
import os

import numpy as np
import pytest

# Global managers spawned by the tests (and by the torchrun ranks they start) exit 0.3 s after their
# last loader instead of 2 s, so the leak checks need not wait for them.
os.environ["FUSIONFLOW_GM_LINGER_S"] = "0.3"
# Ray's workers (the tests' actors) at normal priority: at Ray's default niceness 15, a busy CI machine
# starves them (beside two busy loops each test's actors took ~95 s to start)
os.environ.setdefault("RAY_worker_niceness", "0")

from fusionflow.tools.synthetic import make_image

RAY_STARTUP_S = 180.0  # Ray actors importing torch beside two CPU hogs took > 60 s (RayWorkers' default)
LOADER_TIMEOUT_S = 120.0  # below pytest's 300 s (setup.cfg), above a cold start that compiles the kernels


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def image224() -> np.ndarray:
    return make_image(224, 224, seed=7)


def _default_argument(monkeypatch, cls, name: str, value) -> None:
    """Make `value` the default of `cls(..., name=...)` for this test (an explicit argument still wins)."""
    init = cls.__init__

    @functools.wraps(init)
    def with_default(self, *args, **kwargs):
        kwargs.setdefault(name, value)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", with_default)


@pytest.fixture(autouse=True)
def loaders_wait_with_a_bound(monkeypatch):
    """A loader built in a test without `timeout=` waits at most LOADER_TIMEOUT_S for a mini-batch: a
    defect that loses work fails fast with "mini-batch N was not ready within timeout", not at
    pytest's timeout with no word. Tests of `timeout=0` (DataLoader's default: wait forever) pass it."""
    from fusionflow.loader.front import FusionFlowLoader

    _default_argument(monkeypatch, FusionFlowLoader, "timeout", LOADER_TIMEOUT_S)


@pytest.fixture(autouse=True)
def ray_actors_start_with_time_to_spare(monkeypatch):
    """RayWorkers built in a test without `startup_timeout=` wait RAY_STARTUP_S for their actors: on a
    shared machine (CI) their start-up, not the behaviour under test, is what is slow."""
    from fusionflow.remote.config import RayWorkers

    _default_argument(monkeypatch, RayWorkers, "startup_timeout", RAY_STARTUP_S)
