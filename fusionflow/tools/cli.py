"""What the command-line tools share: the `--on-error` option and how a failed sample or a Ctrl-C ends a
command (a short line naming the cause and the fix, exit 1 or 130, never a traceback: a corrupt image is the
data's fault, not a bug to report)."""

from __future__ import annotations

import os
import sys

from fusionflow.errors import SampleError

ON_ERROR_HELP = "a sample that fails to load or decode: 'raise' stops (the default), 'skip' drops it and goes on"


def add_on_error(p) -> None:
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise", help=ON_ERROR_HELP)


def failed_sample(prog: str, e: SampleError, skip_option: bool = True, skipping: bool = False) -> int:
    """Say which sample failed and how to go on (exit status 1): the first line of its error, not the workers'
    tracebacks. `skip_option`: the command has --on-error (a comparison with torchvision's loader has not: both
    must read the same images); `skipping`: --on-error skip was given (so every sample failed)."""
    first = str(e).split("\n", 1)[0]
    fix = (
        "every sample failed, and --on-error skip drops a bad sample, not a dataset that fails them all: check the "
        "data (are these images?)"
        if skipping
        else "--on-error skip drops such samples and goes on"
        if skip_option
        else "fix or remove that file"
    )
    print(f"{prog}: {first}\n({fix})", file=sys.stderr)
    return 1


def interrupted(prog: str) -> int:
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130


def check_out_file(p, flag: str, path: str) -> None:
    """A file the command writes at its end, judged before any work (argparse's error, exit 2): not a directory,
    in a writable folder that exists -- not a traceback after the whole run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        p.error(f"{flag} {path!r} is a directory: name a file")
    if not os.path.isdir(folder):
        p.error(f"{flag} {path!r}: its folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        p.error(f"{flag} {path!r} is not writable here")


def check_out_dir(p, flag: str, path: str) -> None:
    """That the directory the command writes into can be made and written (argparse's error, exit 2, if not), before
    any work -- made, and removed again if this made it: a run refused later (no images there, an unknown policy)
    leaves no empty directory behind (by default ./fusionflow-profile)."""
    made, there = [], os.path.abspath(path)
    while not os.path.exists(there):  # the folders this makes, deepest first
        made.append(there)
        there = os.path.dirname(there)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        p.error(f"{flag} {path!r} cannot be made a directory ({e.strerror})")
    writable = os.access(path, os.W_OK | os.X_OK)
    for folder in made:
        os.rmdir(folder)
    if not writable:
        p.error(f"{flag} {path!r} is not writable here")
