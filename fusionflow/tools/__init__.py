"""Tools around the loader, not needed to train with it: the `python -m fusionflow` subcommands and
what they share with the tests and experiments.

  demo.py       `python -m fusionflow demo`: the main job; dispatches `profile` and `bench` too
  bench.py      FusionFlowLoader vs DataLoader + torchvision on a folder of images
  baseline.py   the torchvision baseline both of them time
  serve.py      `python -m fusionflow serve`: a SharedLoader from a shell
  cli.py        what the commands share: --on-error, a failed sample or a Ctrl-C said in a line
  profile.py    trace, timeline PNG and summary of a run on your data
  timeline.py   summary and timeline PNG of a trace file (matplotlib, the `plot` extra)
  synthetic.py  synthetic images and encoded datasets (demo data, tests, benchmarks)
"""
