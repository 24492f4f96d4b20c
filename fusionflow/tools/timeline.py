"""Read a loader trace (fusionflow/loader/trace.py): a short summary, and a timeline PNG (matplotlib).

The PNG has one row per track -- the training loop's waits at next() (black), each ring slot's
mini-batches, the accelerator, each CPU worker and each borrowed worker -- with every tiny-batch a
bar coloured by its mini-batch (the same colour on the slot row), lent stretches hatched grey, and,
when stage times are given, a second panel with each worker's stage shares.
"""

from __future__ import annotations

import numpy as np

from fusionflow.loader.trace import TID_ACCEL, TID_CPU, TID_GUEST, TID_SLOT, TID_TRAINING

WAIT_COLOUR = "#111111"
# mini-batch colours: tab20's without its greys (black is a wait, grey a lent stretch)
MB_COLOURS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
]
MINOR_SHARE = 0.02  # stages below this share on every worker are drawn together as "other"
OTHER = "other (<2% each)"


def _tracks(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def spans(trace: dict, cat: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (cat is None or e.get("cat") == cat)]


def summarize(trace: dict) -> dict:
    """Waits at next() (mean, p95), samples per second over the traced stretch, and each worker's
    busy / idle share of that stretch (from its first tiny-batch's start to the last wait's end)."""
    waits = spans(trace, "wait")
    tiny = spans(trace, "tiny-batch")
    lent = spans(trace, "lent")
    out = {
        "mini_batches": len(waits),
        "tiny_batches": len(tiny),
        "samples": int(sum(e["args"]["samples"] for e in waits)),
        "dropped_events": trace.get("otherData", {}).get("dropped_events", 0),
    }
    w = np.array([e["dur"] for e in waits]) / 1e3 if waits else np.zeros(1)
    out["wait_mean_ms"], out["wait_p95_ms"] = float(w.mean()), float(np.percentile(w, 95))
    everything = tiny + waits
    if not everything:
        out.update(seconds=0.0, samples_per_s=0.0, workers={})
        return out
    start = min(e["ts"] for e in (tiny or everything))  # the first tiny-batch's start: worker start-up is not idle
    end = max(e["ts"] + e["dur"] for e in everything)
    seconds = (end - start) / 1e6
    out["seconds"] = seconds
    out["samples_per_s"] = out["samples"] / seconds if seconds > 0 else 0.0
    names = _tracks(trace)
    workers = {}
    for tid in sorted({e["tid"] for e in tiny}):
        busy = sum(e["dur"] for e in tiny if e["tid"] == tid) / 1e6
        away = sum(e["dur"] for e in lent if e["tid"] == tid) / 1e6
        workers[names.get(tid, str(tid))] = {
            "tiny_batches": sum(1 for e in tiny if e["tid"] == tid),
            "busy_s": busy,
            "lent_s": away,
            "idle_share": max(0.0, 1.0 - (busy + away) / seconds) if seconds > 0 else 0.0,
        }
    out["workers"] = workers
    return out


def format_summary(s: dict, stage_shares: dict | None = None, per_worker_shares: dict | None = None) -> str:
    from fusionflow.ops.stages import format_shares

    lines = [
        f"{s['mini_batches']} mini-batches, {s['tiny_batches']} tiny-batches, {s['samples']} samples "
        f"in {s.get('seconds', 0):.2f} s traced: {s.get('samples_per_s', 0):.1f} samples/s",
        f"wait at next(): mean {s['wait_mean_ms']:.1f} ms, p95 {s['wait_p95_ms']:.1f} ms",
    ]
    if stage_shares:
        lines.append(f"CPU pipeline stages: {format_shares(stage_shares)}")
    for name, w in s.get("workers", {}).items():
        line = (
            f"  {name}: {w['tiny_batches']} tiny-batches, busy {w['busy_s']:.2f} s, idle {100 * w['idle_share']:.0f}%"
        )
        if w["lent_s"]:
            line += f", lent {w['lent_s']:.2f} s"
        if per_worker_shares and name in per_worker_shares:
            line += f"; {format_shares(per_worker_shares[name], top=3)}"
        lines.append(line)
    if s.get("dropped_events"):
        lines.append(f"(the trace's ring dropped its {s['dropped_events']} oldest spans)")
    return "\n".join(lines)


def _row_order(tids) -> list[int]:
    def key(tid):
        group = (
            0
            if tid == TID_TRAINING
            else 1
            if TID_SLOT <= tid < TID_CPU
            else 2
            if tid == TID_ACCEL
            else 3
            if TID_CPU <= tid < TID_GUEST
            else 4
        )
        return group, tid

    return sorted(tids, key=key)


def plot_timeline(trace: dict, path: str, stage_seconds: dict | None = None, title: str | None = None) -> str:
    """Write the timeline PNG to `path` (returned). `stage_seconds`: {worker track name: {stage: s}}
    for the stage-share panel (e.g. from loader.stats), or None."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "the timeline PNG needs matplotlib: pip install 'fusionflow[plot]' "
            "(or matplotlib==3.11.2); the trace JSON is written without it"
        ) from exc
    from matplotlib.figure import Figure  # no pyplot: the caller's backend and figures are left alone

    names = _tracks(trace)
    events = spans(trace)
    rows = _row_order({e["tid"] for e in events} | {TID_TRAINING})
    panels = 2 if stage_seconds else 1
    height = 0.9 + 0.42 * len(rows) + (0.35 * len(stage_seconds) + 1.2 if stage_seconds else 0)
    fig = Figure(figsize=(13, max(3.0, height)))
    axes = fig.subplots(
        panels,
        1,
        squeeze=False,
        gridspec_kw={"height_ratios": [len(rows) + 1, len(stage_seconds) + 1.5] if stage_seconds else [1]},
    )
    _spans_panel(axes[0][0], trace, events, rows, names, title)
    if stage_seconds:
        _stage_panel(axes[1][0], stage_seconds, matplotlib.colormaps)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _spans_panel(ax, trace: dict, events: list, rows: list, names: dict, title: str | None) -> None:
    """The timeline itself: one row per track, waits, loans and tiny-batches (coloured by mini-batch)."""
    from matplotlib.patches import Patch

    y_of = {tid: k for k, tid in enumerate(rows)}
    for e in events:
        y = y_of[e["tid"]]
        x, w = e["ts"] / 1e6, e["dur"] / 1e6
        cat = e.get("cat")
        if cat == "wait":
            ax.broken_barh([(x, max(w, 1e-4))], (y - 0.4, 0.8), facecolors=WAIT_COLOUR, edgecolor="none")
        elif cat == "lent":
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors="#dddddd", edgecolor="#888888", hatch="//")
        else:
            colour = MB_COLOURS[e["args"].get("mini_batch", 0) % len(MB_COLOURS)]
            ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=colour, edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(rows)), [names.get(t, str(t)) for t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the trace started (CLOCK_MONOTONIC)")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(color=WAIT_COLOUR, label="training loop blocked in next()"),
        Patch(facecolor=MB_COLOURS[0], label="tiny-batch (colour: its mini-batch)"),
    ]
    if any(e.get("cat") == "lent" for e in events):
        handles.append(Patch(facecolor="#dddddd", edgecolor="#888888", hatch="//", label="lent to another rank"))
    ax.legend(
        handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles), frameon=False, fontsize=8
    )
    s = summarize(trace)
    ax.set_title(
        title
        or (
            f"{s['samples']} samples, {s.get('samples_per_s', 0):.0f} samples/s\nwait at next(): "
            f"mean {s['wait_mean_ms']:.1f} ms, p95 {s['wait_p95_ms']:.1f} ms"
        ),
        fontsize=9,
        loc="left",
    )


def _stage_panel(ax, stage_seconds: dict, colormaps) -> None:
    from fusionflow.ops.stages import shares

    workers = list(stage_seconds)
    per_worker = {w: shares(stage_seconds[w]) for w in workers}
    order = list(dict.fromkeys(k for w in workers for k in stage_seconds[w]))  # pipeline order
    stages = [k for k in order if any(per_worker[w].get(k, 0.0) >= MINOR_SHARE for w in workers)]
    minor = [k for k in order if k not in stages]
    for w in workers:
        per_worker[w][OTHER] = sum(per_worker[w].get(k, 0.0) for k in minor)
    if minor:
        stages.insert(len(stages) - 1 if stages and stages[-1] == "write" else len(stages), OTHER)
    cmap = colormaps["Set2" if len(stages) <= 8 else "tab20"]
    left = np.zeros(len(workers))
    for k, stage in enumerate(stages):
        vals = np.array([per_worker[w].get(stage, 0.0) for w in workers])
        ax.barh(range(len(workers)), vals, left=left, color=cmap(k % cmap.N), label=stage)
        for y, (x0, v) in enumerate(zip(left, vals)):
            if v >= 0.05:
                ax.text(x0 + v / 2, y, f"{100 * v:.0f}%", ha="center", va="center", fontsize=7)
        left += vals
    ax.set_yticks(range(len(workers)), workers)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    listed = ", ".join(minor[:8]) + (f" and {len(minor) - 8} more" if len(minor) > 8 else "")
    ax.set_title(
        "share of each worker's CPU pipeline time per stage (stage_times=True)"
        + (f"; other: {listed}" if minor else ""),
        fontsize=8,
        loc="left",
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=min(len(stages), 8), frameon=False, fontsize=8)
    ax.set_xticks([])
