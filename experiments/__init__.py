"""FusionFlow's benchmarks and paper reproductions, one module each, run from the repository root:

    .venv/bin/python -m experiments.<name> --help

What they share (data sets, interleaved timing, result JSON with provenance) is experiments/harness.py;
what they measured, with the commands, is experiments/README.md.
"""
