"""`cache=`: what a user gives FusionFlowLoader, checked when the loader is built.

`cache="64GB"` (or an int of bytes) is `DecodedCache(size="64GB")`; a `DecodedCache` says more. Sizes:
an int of bytes, or a number with a unit -- KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB (and K/M/G/T,
as docker's --shm-size reads them) powers of 1024.
"""

from __future__ import annotations

import numbers
import os
import re

from fusionflow.cache.store import ADMISSIONS

# The short side the cache keeps at most: at 320 a 224 random resized crop (and flip) of an ImageNet-
# sized image is a median 46.5 dB from the uncached fast mode's, 1st percentile 43.5 dB
# (experiments/bench_cache.py's fidelity table; RandAugment's median: 43.2 dB at 256, 45.8 at 320,
# 51.9 at 384).
DEFAULT_MAX_SIDE = 320
MIN_SIZE = 1 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS.update({f"{u}ib": v for u, v in list(_UNITS.items()) if u not in ("", "b")})
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_EXAMPLE = "e.g. cache='64GB', cache=8 * 2**30, or cache=fusionflow.DecodedCache(size='64GB', max_side=320)"


def parse_size(value, what: str = "cache") -> int:
    """Bytes from an int or a string such as '64GB', '512MiB', '1.5G'."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(f"{what}={value!r} must be a byte budget (an int or a string with a unit), {_EXAMPLE}")
    given, value = value, value if isinstance(value, str) else int(value)  # numpy's ints too
    if isinstance(value, str):
        found = _SIZE_RE.fullmatch(value)
        unit = found and _UNITS.get(found[2].lower())
        if not found or unit is None:
            raise ValueError(
                f"{what}={value!r} is not a size: write a number and a unit (KB, MB, GB, TB or KiB, MiB, GiB, "
                f"TiB), {_EXAMPLE}"
            )
        value = int(float(found[1]) * unit)
    if value < MIN_SIZE:
        raise ValueError(
            f"{what}={given!r} ({value} bytes) is too small for a decoded-image cache: give at least 1 MiB, {_EXAMPLE}"
        )
    return value


class DecodedCache:
    """A node-wide cache of decoded images for FusionFlowLoader (`cache=`).

    size       the memory it may take: bytes, or a string such as "64GB" (see `parse_size`)
    max_side   the cached images' short side at most (pixels); the random resized crop is taken from
               the cached image, so below the crop's own size it loses detail (DEFAULT_MAX_SIDE's note)
    path       None: shared memory (/dev/shm); a directory on a local disk: a nameless file there, mapped
               (the page cache holds what fits, the disk the rest)
    admission  "score" (default): when the budget is below the dataset, keep the images that save the
               most decode time per stored byte; "first": keep whatever comes first while room is left
    reuse_crop_epochs
               None (default): a new crop every epoch. R > 1: refurbishing -- each sample's crop and flips
               are drawn once per R epochs and its cropped image kept for them (a loader's own memory:
               len(dataset) x the output's bytes, reserved up front), so those epochs only draw and apply
               their ops; fewer distinct crops per sample (docs/cache.md says what that does)
    fill_share "auto" (default): fill as samples come while the training loop does not wait for the
               loader (the workers' spare time pays the whole-image decodes), and paced at 0.1 while it
               does (the loader is the bottleneck: epochs slow by at most ~10%, the cache fills over ~9);
               None: every sample is written the first time it is decoded (the first epoch pays the
               whole-image decodes, ~0.5x); a share of time in (0, 1], e.g. 0.1: each worker spends at
               most that share of its time decoding images for the cache, always

    Loaders over the same dataset with the same max_side and admission on one node share one cache
    (the first one's size governs), and it is released when the last of them closes.
    """

    def __init__(
        self,
        size,
        max_side: int = DEFAULT_MAX_SIDE,
        path: str | None = None,
        admission: str = "score",
        fill_share: float | str | None = "auto",
        reuse_crop_epochs: int | None = None,
    ):
        self.size = parse_size(size, "DecodedCache size")
        if isinstance(max_side, bool) or not isinstance(max_side, numbers.Integral) or not 16 <= max_side <= 65535:
            raise ValueError(f"DecodedCache(max_side={max_side!r}) must be an int of pixels in [16, 65535], e.g. 320")
        if path is not None and not (isinstance(path, (str, os.PathLike)) and os.path.isdir(path)):
            raise ValueError(
                f"DecodedCache(path={path!r}) must be an existing directory on a local disk (the cache's file "
                "is made there, nameless), or None for shared memory"
            )
        if admission not in ADMISSIONS:
            raise ValueError(f"DecodedCache(admission={admission!r}) must be one of {ADMISSIONS}")
        if (
            fill_share is not None
            and fill_share != "auto"
            and (isinstance(fill_share, bool) or not isinstance(fill_share, numbers.Real) or not 0 < fill_share <= 1)
        ):
            raise ValueError(
                f"DecodedCache(fill_share={fill_share!r}) must be 'auto' (paced only while training waits for the "
                "loader), None (fill as samples come) or a share of time in (0, 1], e.g. 0.1"
            )
        if reuse_crop_epochs is not None and (
            isinstance(reuse_crop_epochs, bool)
            or not isinstance(reuse_crop_epochs, numbers.Integral)
            or reuse_crop_epochs < 1
        ):
            raise ValueError(
                f"DecodedCache(reuse_crop_epochs={reuse_crop_epochs!r}) must be None (a new crop every epoch) or an "
                "int >= 1 of epochs that reuse a sample's crop, e.g. 2"
            )
        self.max_side, self.admission = int(max_side), admission  # plain Python numbers from numpy's too
        self.fill_share = float(fill_share) if fill_share not in (None, "auto") else fill_share
        self.reuse_crop_epochs = int(reuse_crop_epochs or 1)
        self.path = os.fspath(path) if path is not None else None

    def __repr__(self) -> str:
        return (
            f"DecodedCache(size={self.size}, max_side={self.max_side}, path={self.path!r}, "
            f"admission={self.admission!r}, fill_share={self.fill_share!r}, "
            f"reuse_crop_epochs={self.reuse_crop_epochs!r})"
        )


def resolve_cache(cache, policy) -> DecodedCache | None:
    """`cache=` as a DecodedCache (None: no cache), refused with the reason where it cannot work."""
    if cache is None:
        return None
    if not isinstance(cache, DecodedCache):
        if isinstance(cache, bool) or not isinstance(cache, (numbers.Integral, str)):
            raise TypeError(f"cache={cache!r} must be None, a byte budget or a fusionflow.DecodedCache, {_EXAMPLE}")
        cache = DecodedCache(parse_size(cache, "cache"))
    if not policy.fast_downscale:
        raise ValueError(
            f"cache= needs the policy's decode.mode fast ({policy.source} is exact): exact mode reproduces "
            "torchvision's pixels from the full-resolution decode, and the cache crops from images kept at "
            f"max_side={cache.max_side}. Use a fast policy (decode: {{mode: fast}}) or cache=None"
        )
    if cache.reuse_crop_epochs > 1 and policy.augment.type == "deepaa":
        raise ValueError(
            f"DecodedCache(reuse_crop_epochs={cache.reuse_crop_epochs}) cannot apply to {policy.source}: Deep "
            "AutoAugment's crops are layers of its augmentation, drawn with its ops; use reuse_crop_epochs=None"
        )
    short = min(policy.size)
    if cache.max_side < short:
        raise ValueError(
            f"DecodedCache(max_side={cache.max_side}) is below the policy's output size {policy.size}: every "
            f"crop would be enlarged from a smaller image than the output; use max_side >= {short} "
            f"(the default is {DEFAULT_MAX_SIDE})"
        )
    return cache
