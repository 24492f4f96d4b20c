"""Every test has a time limit (setup.cfg: [tool:pytest] timeout, pytest-timeout): a hang fails the
test instead of stalling the run. Proven here on a real hang: a pytest session in a subprocess runs a
generated test (and its control without the fault) that breaks the retry path -- a dead worker's tiny-batches are never
requeued -- and
SIGKILLs the workers mid-epoch, so the iteration waits forever. The session must fail with
pytest-timeout's "Timeout" well within a minute.

The fault is injected at a seam that outlives refactors of the runtime: the pure queue's
`TinyBatchQueue.requeue` (fusionflow/scheduling/queue.py), which every requeue goes through, and
the workers are found as this process's multiprocessing children, not through manager internals.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import fusionflow

REPO = Path(fusionflow.__file__).resolve().parent.parent

HANGS = textwrap.dedent('''
    import multiprocessing as mp
    import os
    import signal
    import time

    import pytest

    from fusionflow.loader import FusionFlowLoader
    from fusionflow.scheduling.queue import TinyBatchQueue
    from fusionflow.tools.synthetic import make_jpegs

    JPEGS = make_jpegs(32, 30, 60, seed=5)
    POLICY = {"output": {"size": 24}, "augment": {"type": "none"}}


    class Slow:
        """Every sample takes a while, so a killed worker always has work outstanding."""

        def __len__(self):
            return len(JPEGS)

        def __getitem__(self, i):
            time.sleep(0.05)
            return JPEGS[i], i


    def kill_workers_mid_epoch():
        loader = FusionFlowLoader(Slow(), batch_size=8, num_workers=2, policy=POLICY, tiny_batch_size=2,
                                  global_manager=None)
        batches = iter(loader)
        next(batches)
        for child in mp.active_children():  # the CPU workers, mid-epoch
            os.kill(child.pid, signal.SIGKILL)
        return sum(len(labels) for _, labels in batches)


    @pytest.mark.timeout(120)  # the session's --timeout is for the hang: the control may be slow on a busy machine
    def test_control_without_the_fault():
        assert kill_workers_mid_epoch() == 24  # the killed workers' tiny-batches were re-run


    def test_dead_workers_work_is_never_requeued(monkeypatch):
        monkeypatch.setattr(TinyBatchQueue, "requeue", lambda self, works: None)  # the injected fault
        kill_workers_mid_epoch()  # their tiny-batches are lost: this waits forever
''')


@pytest.mark.slow
def test_a_hanging_test_fails_with_a_timeout(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    start = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "pytest_timeout",
            "--timeout=6",
            "-p",
            "no:cacheprovider",
            "test_hangs.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "Timeout" in output, output
    assert "FAILED test_hangs.py::test_dead_workers_work_is_never_requeued" in output, output
    assert "1 failed, 1 passed" in output, output  # the control (same test, no fault) passed: the hang is the fault
    assert elapsed < 60, f"the session took {elapsed:.0f} s:\n{output}"
