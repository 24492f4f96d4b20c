"""A built wheel is the product: it must hold the whole runtime, the shipped policies and the native
sources, and work from outside the repository (not only the editable checkout)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter whose only copy of fusionflow is the unpacked wheel.
PROBE = r"""
import sys, numpy as np
import fusionflow
from fusionflow import FusionFlowLoader, load_policy
from fusionflow import native
from fusionflow.policy.schema import shipped_policies
from fusionflow.tools.synthetic import encode, make_image
root = sys.argv[1]
assert fusionflow.__file__.startswith(root), fusionflow.__file__
assert {"default", "randaugment", "autoaugment", "trivialaugment"} <= set(shipped_policies()), shipped_policies()
assert load_policy("randaugment").name == "randaugment"
assert (native.KERNELS / "dali_bridge_resource.cc").is_file() and str(native.KERNELS).startswith(root)
data = [(encode(make_image(90 + 7 * i, 120, seed=i)), i % 3) for i in range(12)]
seen = []
with FusionFlowLoader(data, batch_size=4, num_workers=1, policy="randaugment", tiny_batch_size=2) as loader:
    for images, labels in loader:
        assert tuple(images.shape) == (len(labels), 3, 224, 224)
        seen += labels.tolist()
assert sorted(seen) == sorted(i % 3 for i in range(12)), seen
print("wheel ok")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("fusionflow-*.whl")
    return whl


def test_wheel_holds_runtime_policies_and_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected_modules = {str(p.relative_to(REPO)) for p in (REPO / "fusionflow").rglob("*.py")}
    assert expected_modules <= names, sorted(expected_modules - names)
    for f in (
        "fusionflow/configs/randaugment.yaml",
        "fusionflow/configs/README.md",
        "fusionflow/kernels/dali_bridge_resource.cc",
        "fusionflow/kernels/lent_arena.h",
    ):
        assert f in names, f


def test_wheel_runs_a_loader_from_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"  # a fresh install target: pip installs the wheel there (its deps are this venv's)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # ahead of site-packages, so the editable install is not used
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wheel ok" in run.stdout
