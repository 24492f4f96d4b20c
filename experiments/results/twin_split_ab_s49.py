"""The twin with the split rule before (a run's interval always read as DALI's pace) and after 03074fd, interleaved."""

import argparse
import json
import statistics
import time

import fusionflow.scheduling.split as split
from experiments import twin_gpu as tw
from experiments.harness import rotation
from fusionflow.tools.synthetic import make_jpegs

New = split.ShareController


class Old(New):
    def accel_run(self, seconds, samples, queued=True):
        return New.accel_run(self, seconds, samples, True)


ap = argparse.ArgumentParser()
for k, v in dict(
    workers=15,
    batch_size=256,
    tiny_batch_size=4,
    train_us=77.0,
    run_ms=10.0,
    sample_us=100.0,
    run_latency_ms=25.0,
    overlap=0.9,
    worker_delay_ms=2.1,
    batches=30,
    rounds=4,
    depth=3,
).items():
    ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
ap.add_argument("--prefetch", type=int, default=None)
args = ap.parse_args()

data = make_jpegs(2048, 32, 33, seed=1)
clock = tw.DeviceClock()
loaders, streams, runs = {}, {}, {}
for name, cls in (("old", Old), ("new", New)):
    split.ShareController = cls
    runs[name] = []
    loaders[name], streams[name] = tw.ff_loader(data, args, clock, runs[name], args.depth)
split.ShareController = New
yl, streams["ff_cpu"] = tw.ff_loader(data, args)
streams["dali_alone"] = tw.dali_alone(
    clock, args.batch_size, args.run_ms * 1e-3, args.sample_us * 1e-6, args.run_latency_ms * 1e-3, args.overlap
)
step_s = args.train_us * 1e-6 * args.batch_size
rates = {k: [] for k in streams}
share = {k: [] for k in loaders}
try:
    for r in range(args.rounds):
        for name in rotation(streams, r):
            s = streams[name]
            for _ in range(3):
                next(s)
                tw.wait_until(clock.occupy(step_s))
            st = loaders[name].stats if name in loaders else None
            b = (st.samples, st.accelerator_samples) if st else None
            t0, n = time.monotonic(), 0
            for _ in range(args.batches):
                n += next(s)
                tw.wait_until(clock.occupy(step_s))
            rates[name].append(n / (time.monotonic() - t0))
            if st:
                share[name].append((st.accelerator_samples - b[1]) / max(1, st.samples - b[0]))
            print(f"round {r + 1}: {name} {rates[name][-1]:.0f}", flush=True)
finally:
    for ld in loaders.values():
        ld.close()
    yl.close()
med = {k: statistics.median(v) for k, v in rates.items()}
print(
    {k: round(v) for k, v in med.items()},
    "new/old",
    round(med["new"] / med["old"], 3),
    "paired",
    round(statistics.median(a / b for a, b in zip(rates["new"], rates["old"])), 3),
    "share",
    {k: round(statistics.median(v), 3) for k, v in share.items()},
)
json.dump({"args": vars(args), "rates": rates, "share": share}, open(f"/tmp/ff/twin_ab_w{args.workers}.json", "w"))
