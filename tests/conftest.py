import os

import numpy as np
import pytest

# Global managers spawned by the tests (and by the torchrun ranks they start) exit 0.3 s after their
# last loader instead of 2 s, so the leak checks need not wait for them.
os.environ["FUSIONFLOW_GM_LINGER_S"] = "0.3"

from fusionflow.tools.synthetic import make_image


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
