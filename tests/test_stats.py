"""fusionflow/loader/stats.py: LoaderStats' reset, the bridge maxima's names, and its fields beside the runtime's
counters."""

import dataclasses
import inspect

import pytest

from fusionflow.loader import LoaderStats as FromLoader
from fusionflow.loader.stats import LoaderStats


def test_importable_from_its_former_home():
    assert FromLoader is LoaderStats


def test_reset_restores_every_default_but_what_describes_the_loader():
    s = LoaderStats()
    lists = s.wait_seconds
    for f in dataclasses.fields(s):
        setattr(
            s,
            f.name,
            {"x": 1}
            if isinstance(getattr(s, f.name), dict)
            else [1]
            if isinstance(getattr(s, f.name), list)
            else "set",
        )
    s.reset()
    fresh = LoaderStats()
    for f in dataclasses.fields(s):
        if f.name in ("startup_seconds", "memory_bridge", "global_manager", "accelerator_retired"):
            assert getattr(s, f.name) == "set"  # measured once / the loader's state, not the run's: kept
        else:
            assert getattr(s, f.name) == getattr(fresh, f.name), f.name
    assert s.wait_seconds is not lists  # a fresh list, not the old one emptied


def test_the_waits_summary_reads_one_long_wait_apart_from_the_rest():
    s = LoaderStats(wait_seconds=[0.002] * 39 + [1.0])
    summary = s.summary()
    assert summary["wait_median_ms"] == pytest.approx(2.0) and summary["wait_mean_ms"] == pytest.approx(26.95)
    assert summary["wait_p95_ms"] < summary["wait_mean_ms"]  # the shape session 27's ResNet-50 / 15 run had


def test_the_bridge_maxima_and_their_deprecated_names():
    s = LoaderStats(bridge_max_lent_bytes=5, bridge_max_borrowed_bytes=3)
    with pytest.deprecated_call():
        assert s.bridge_lent_bytes == 5
    with pytest.deprecated_call():
        assert s.bridge_borrowed_bytes == 3
    with pytest.raises(AttributeError):
        s.bridge_lent_bytes = 7  # read-only: a write by the old name would be lost silently otherwise
    s.bridge_max_lent_bytes = 7
    summary = s.summary()
    assert summary["bridge_max_lent_bytes"] == summary["bridge_lent_bytes"] == 7
    assert summary["bridge_max_borrowed_bytes"] == summary["bridge_borrowed_bytes"] == 3
    s.bridge_lends = 2  # the bridge lends an arena per accelerator start; it counted prep windows before
    with pytest.deprecated_call():
        assert s.bridge_windows == 2
    assert summary["bridge_lends"] == summary["bridge_windows"] == 0 and s.summary()["bridge_windows"] == 2


def test_every_field_is_declared_once_the_runtime_s_in_runtime_counters():
    """LoaderStats extends the runtime's counters with what the loader measures: no field is declared
    in both (a redeclared one could get another default or comment and drift from the runtime's)."""
    from fusionflow.runtime.counters import RuntimeCounters

    assert issubclass(LoaderStats, RuntimeCounters)
    ours, runtime = inspect.get_annotations(LoaderStats), inspect.get_annotations(RuntimeCounters)
    assert ours and runtime
    assert not set(ours) & set(runtime), sorted(set(ours) & set(runtime))
    assert {f.name for f in dataclasses.fields(LoaderStats)} == set(ours) | set(runtime)


def _stats_writers(fields: set[str]) -> dict[str, set[str]]:
    """field -> the modules that assign, increment or append to `<...>stats.<field>`, `_stats.<field>`
    or `<...>counters.<field>` (the loader's LoaderStats, handed to the runtime as its counters), or
    set it by name (`setattr(stats, name, ...)`: every field named in a string of that module).
    shared/client.py writes its own ClientStats, not a LoaderStats; stats.py and counters.py define them."""
    import ast
    import re
    from pathlib import Path

    import fusionflow

    package = Path(fusionflow.__file__).parent
    skip = {"loader/stats.py", "runtime/counters.py", "shared/client.py"}
    write = re.compile(r"\b_?(?:stats|counters)\.([a-z_]+)(?:\[[^]\n]*\])?\s*(?:[+\-]?=(?!=)|\.append\(|\.extend\()")
    by_name = re.compile(r"\bsetattr\(\s*(?:self\.)?_?(?:stats|counters)\b")
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).as_posix()
        if rel in skip:
            continue
        text = path.read_text()
        names = set(write.findall(text))
        if by_name.search(text):
            strings = {n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)}
            names |= fields & {v for v in strings if isinstance(v, str)}
        for name in names:
            found.setdefault(name, set()).add(rel)
    return found


def test_every_stats_field_has_one_writer():
    """One owner per piece of state: each field of loader.stats is written by one module (the part that
    measures it); the others read it."""
    fields = {f.name for f in dataclasses.fields(LoaderStats)}
    writers = {name: mods for name, mods in _stats_writers(fields).items() if name in fields}
    # the scan sees the runtime's writes, the loader's, private handles (self._stats) and writes by name
    assert {"worker_restarts", "batches", "next_epoch_adopted", "bridge_lends"} <= set(writers)
    several = {name: sorted(mods) for name, mods in writers.items() if len(mods) > 1}
    assert not several, f"fields written by more than one module: {several}"


def test_a_per_batch_series_stays_bounded_and_keeps_its_newest(monkeypatch):
    """stats.wait_seconds (and taas_k) gained an entry per batch for the loader's life: ~120 MB over a 90-epoch
    ImageNet run at batch 32. Past SERIES_MAX the older half goes; a loader's own series is bounded the same way."""
    from fusionflow.runtime import counters

    monkeypatch.setattr(counters, "SERIES_MAX", 8)
    series = []
    for k in range(100):
        counters.append_bounded(series, k)
        assert len(series) <= 8 and series[-1] == k and series == list(range(series[0], k + 1))
    from fusionflow.loader import FusionFlowLoader
    from fusionflow.tools.synthetic import make_jpegs

    with FusionFlowLoader([(j, 0) for j in make_jpegs(24, 16, 17)], batch_size=1, policy="default") as loader:
        for _ in range(2):
            for _ in loader:
                pass
        assert loader.stats.batches == 48 and 4 <= len(loader.stats.wait_seconds) <= 8
