"""TarShards: a map-style dataset over WebDataset-layout tar shards, read by index.

A WebDataset shard is a plain tar whose members are named KEY.EXT; the members sharing a KEY form one
sample (KEY is the member path up to the first dot of its file name, EXT the rest: `a/b.seg.jpg` is
key `a/b`, extension `seg.jpg`). FusionFlow's augmentation is a pure function of (seed, epoch, index),
so it needs random access: each shard's member offsets and sizes are indexed once (Python's tarfile
walks the headers; no member is read) and cached, after which `ds[i]` is one `os.pread` per member
and `ds.sizes` (the image members' sizes, for size-sorted tiny-batches) needs no read at all.

The index of `train-000001.tar` is `train-000001.tar.ffindex` beside it, or in `index_dir`, or, when
the shard's directory is read-only and no `index_dir` was given, in the user's cache directory. It
records the shard's size and modification time and is rebuilt when either changes.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import logging
import os
import re
import tarfile
from collections.abc import Iterable, Sequence

log = logging.getLogger("fusionflow")

INDEX_SUFFIX = ".ffindex"
_INDEX_VERSION = 1
_BRACES = re.compile(r"\{([^{}]*)\}")


class ShardError(ValueError):
    """A shard that cannot be indexed or read: the message names the shard, and the sample and key
    where there is one."""


def expand_shards(shards) -> list[str]:
    """A list of paths, a glob (`/data/train-*.tar`) or brace notation (`train-{000000..000146}.tar`,
    `{train,val}-0.tar`; several braces multiply) -> the shard paths, in order. A glob is sorted; a
    brace range keeps its zero padding."""
    if isinstance(shards, (str, os.PathLike)):
        specs = [os.fspath(shards)]
    elif isinstance(shards, Iterable):
        specs = [os.fspath(s) for s in shards]
    else:
        raise TypeError(
            f"shards must be a path, a glob, brace notation or a list of paths, got {type(shards).__name__}"
        )
    paths: list[str] = []
    for spec in specs:
        for name in _expand_braces(spec):
            if any(c in name for c in "*?["):
                found = sorted(p for p in globlib.glob(name) if not _is_index(p))  # "train-*": not our indexes
                if not found:
                    raise ShardError(f"TarShards: no file matches {name!r}")
                paths.extend(found)
            else:
                paths.append(name)
    if not paths:
        raise ShardError("TarShards: no shards given")
    return paths


def _is_index(path: str) -> bool:
    """An index TarShards writes beside a shard (or its file being written): never a shard itself."""
    return path.endswith(INDEX_SUFFIX) or re.search(re.escape(INDEX_SUFFIX) + r"\.\d+\.tmp$", path) is not None


def _expand_braces(spec: str) -> list[str]:
    m = _BRACES.search(spec)
    if m is None:
        return [spec]
    body, head, tail = m.group(1), spec[: m.start()], spec[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        lo, hi = r.group(1), r.group(2)
        if int(hi) < int(lo):
            raise ShardError(f"TarShards: the range {{{body}}} in {spec!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [out for item in items for out in _expand_braces(head + item + tail)]


def split_member(name: str) -> tuple[str, str] | None:
    """'dir/key.ext.more' -> ('dir/key', 'ext.more'); None for a name without an extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:  # no dot in the file name, or a name starting with one (hidden files)
        return None
    return name[:dot], name[dot + 1 :]


def _norm_key(key: str) -> str:
    return key[1:] if key.startswith(".") else key


class TarShards:
    """WebDataset-layout tar shards -> (encoded image bytes, target) by index.

    `image_key` / `target_key`: the member extensions of the image and the target (`"jpg"` or
    `".jpg"`; a tuple gives alternatives, the first present wins: `("jpg", "png")`). Targets: `cls`,
    `txt` (or any extension) holding an integer -> int; `json` -> the parsed object; anything else ->
    bytes. `target_key=None`: every target is None. Every sample must have the image member; a sample
    without the target member raises when it is read, naming shard, sample and key.

    `index_dir`: where the shard indexes are written and read (default: beside each shard; a
    read-only shard directory falls back to `~/.cache/fusionflow/tar-index`).

    `ds.sizes[i]` is sample i's image size in bytes; `ds.keys[i]` its key; `ds.describe(i)` names
    shard and key. Pickling sends the paths and the index (no file handles): cheap to send to worker
    processes, lent workers and Ray actors, which open the shards themselves.
    """

    def __init__(self, shards, image_key="jpg", target_key="cls", index_dir: str | os.PathLike | None = None):
        # absolute: a worker lent by another process (its own working directory) opens these paths
        self.shards = [os.path.abspath(p) for p in expand_shards(shards)]
        self.image_keys = _keys(image_key, "image_key")
        self.target_keys = None if target_key is None else _keys(target_key, "target_key")
        self.index_dir = None if index_dir is None else os.fspath(index_dir)
        self.sizes: list[int] = []
        self.keys: list[str] = []
        self._where: list[tuple[int, int, int]] = []  # (shard, image offset, image size) per sample
        self._targets: list[tuple[int, int, str] | None] = []  # (offset, size, ext) of the target member
        for s, path in enumerate(self.shards):
            members = load_index(path, self.index_dir)
            for key, exts in _samples(members, path):
                image = next((exts[k] for k in self.image_keys if k in exts), None)
                if image is None:
                    raise ShardError(
                        f"TarShards: shard {path!r}, sample {key!r} has no {_names(self.image_keys)} member "
                        f"(its members: {', '.join(sorted(exts)) or 'none'}); pass image_key= the image's extension"
                    )
                target = None
                if self.target_keys is not None:
                    ext = next((k for k in self.target_keys if k in exts), None)
                    target = None if ext is None else (*exts[ext], ext)
                self._where.append((s, *image))
                self._targets.append(target)
                self.sizes.append(image[1])
                self.keys.append(key)
        if not self._where:
            raise ShardError(f"TarShards: the shards hold no samples ({', '.join(self.shards[:3])}...)")
        if self.target_keys is not None and not any(self._targets):  # said now, not at the first batch
            members = ", ".join(sorted(_samples_members(self.shards[0], self.index_dir))) or "none"
            raise ShardError(
                f"TarShards: no sample has a {_names(self.target_keys)} member for its target (the first sample's "
                f"members: {members}); pass target_key= the target's extension, or target_key=None for no targets"
            )
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"TarShards index {index} out of range for {len(self)} samples")
        s, offset, size = self._where[index]
        image = self._read(s, offset, size, index, "/".join(self.image_keys))
        if self.target_keys is None:
            return image, None
        where = self._targets[index]
        if where is None:
            raise ShardError(
                f"TarShards: shard {self.shards[s]!r}, sample {self.keys[index]!r} has no "
                f"{_names(self.target_keys)} member for its target; pass target_key=None for no targets"
            )
        offset, size, ext = where
        return image, parse_target(self._read(s, offset, size, index, ext), ext)

    def describe(self, index: int) -> str:
        return f"{self.shards[self._where[index][0]]}:{self.keys[index]}"

    def _read(self, s: int, offset: int, size: int, index: int, ext: str) -> bytes:
        data = os.pread(self._fd(s), size, offset)
        if len(data) != size:
            raise ShardError(
                f"TarShards: shard {self.shards[s]!r}, sample {self.keys[index]!r}, key {ext!r}: read "
                f"{len(data)} of {size} bytes (the shard is shorter than its index: changed while in use?)"
            )
        return data

    def _fd(self, s: int) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors share its file offsets
            self._fds, self._pid = {}, os.getpid()  # (pread does not move them, but keep each process's own)
        fd = self._fds.get(s)
        if fd is None:  # reader threads (ReadAhead) may race here: one descriptor is kept, others closed
            fd = os.open(self.shards[s], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            kept = self._fds.setdefault(s, fd)
            if kept != fd:
                os.close(fd)
            fd = kept
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}

    def __del__(self):
        if getattr(self, "_pid", None) == os.getpid():
            self.close()

    def fingerprint(self) -> str:
        """What identifies these samples across processes (the decoded-image cache's key): the shards' paths, sizes
        and modification times, the keys read and the samples' places; not the process that opened them (a
        pickle's hash held its pid, so no two processes shared a cache)."""
        stats = [(p, st.st_size, st.st_mtime_ns) for p in self.shards for st in [os.stat(p)]]
        what = repr((stats, self.image_keys, self.target_keys, self._where, self._targets)).encode()
        return f"{len(self)}:{hashlib.sha256(what).hexdigest()}"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fds"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pid = os.getpid()


def _keys(key, what: str) -> tuple[str, ...]:
    keys = (key,) if isinstance(key, str) else tuple(key)
    if not keys or not all(isinstance(k, str) and _norm_key(k) for k in keys):
        raise ValueError(f"{what}={key!r} must be a member extension such as 'jpg' (or a tuple of them)")
    return tuple(_norm_key(k).lower() for k in keys)


def _names(keys: Sequence[str]) -> str:
    return " or ".join(f"'.{k}'" for k in keys)


def parse_target(data: bytes, ext: str):
    """cls/txt/any member holding an integer -> int; json -> the parsed object; else the bytes."""
    if ext == "json" or ext.endswith(".json"):
        return json.loads(data)
    text = data.strip()
    if re.fullmatch(rb"[+-]?\d+", text):
        return int(text)
    return data


def _samples(members: list[list], path: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """Members (name, offset, size) in shard order -> [(key, {ext: (offset, size)})]: a run of consecutive
    members with one key is a sample, as WebDataset groups them, so a key met again later (two class folders'
    `img_0001`) is another sample, not merged into the first. An extension twice in one run is refused (which
    member is the sample's?), as WebDataset does."""
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    for name, offset, size in members:
        parts = split_member(name)
        if parts is None:
            continue
        key, ext = parts
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
        exts, ext = samples[-1][1], ext.lower()
        if ext in exts:
            raise ShardError(
                f"TarShards: shard {path!r} holds two {ext!r} members for sample {key!r} in a row ({name!r}); "
                "each sample's members must have one name each"
            )
        exts[ext] = (offset, size)
    return samples


# ---- the index ---------------------------------------------------------------------------------------


def index_path(shard: str, index_dir: str | None) -> str:
    if index_dir is None:
        return shard + INDEX_SUFFIX
    tag = hashlib.sha256(os.path.abspath(shard).encode()).hexdigest()[:12]
    return os.path.join(index_dir, f"{os.path.basename(shard)}.{tag}{INDEX_SUFFIX}")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fusionflow", "tar-index")


def load_index(shard: str, index_dir: str | None = None) -> list[list]:
    """The shard's members as [name, data offset, size], from its cached index when that matches the
    shard's size and modification time, else scanned and cached."""
    try:
        st = os.stat(shard)
    except OSError as exc:
        raise ShardError(f"TarShards: shard {shard!r} cannot be opened: {exc.strerror or exc}") from None
    stamp = [st.st_size, st.st_mtime_ns]
    places = [index_path(shard, index_dir)] if index_dir is not None else [index_path(shard, None)]
    if index_dir is None:
        places.append(index_path(shard, _cache_dir()))
    for place in places:
        cached = _read_index(place, stamp)
        if cached is not None:
            return cached
    members = scan(shard, st.st_size)
    for k, place in enumerate(places):
        if _write_index(place, {"version": _INDEX_VERSION, "shard": stamp, "members": members}):
            if k:
                log.info("fusionflow: %s is not writable; its index is cached in %s", os.path.dirname(shard), place)
            break
    else:
        log.warning("fusionflow: no index of %s could be written (%s); it is scanned at every start", shard, places)
    return members


def _read_index(place: str, stamp: list) -> list[list] | None:
    try:
        with open(place) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _INDEX_VERSION or data.get("shard") != stamp:
        return None
    return data.get("members")


def _write_index(place: str, data: dict) -> bool:
    tmp = f"{place}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(place) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, place)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def scan(shard: str, size: int | None = None) -> list[list]:
    """Walk a tar's headers (Python's tarfile: ustar, GNU and pax names) -> [name, data offset, size]
    for each regular member; a non-tar or truncated file raises ShardError naming the shard and the
    member where it broke."""
    size = os.path.getsize(shard) if size is None else size
    members: list[list] = []
    last = None
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for info in tar:
                last = info.name
                if not info.isreg():
                    continue
                if info.offset_data + info.size > size:
                    raise ShardError(
                        f"TarShards: shard {shard!r} is truncated: member {info.name!r} needs {info.size} bytes "
                        f"at offset {info.offset_data}, the file ends at {size}"
                    )
                members.append([info.name, info.offset_data, info.size])
            end = tar.offset  # where tarfile stopped: the end-of-archive marker, if the shard is whole
        with open(shard, "rb") as f:
            f.seek(end)
            marker = f.read(512)
        if len(marker) < 512 or marker.count(0) != 512:  # tarfile ends quietly at a cut or garbled header
            after = f"after member {last!r}" if last is not None else "at its start"
            raise ShardError(
                f"TarShards: shard {shard!r} is truncated or damaged {after} (offset {end}: no tar header and no "
                "end-of-archive marker)"
            )
    except tarfile.ReadError as exc:
        where = f" after member {last!r}" if last is not None else ""
        kind = "is not a tar file" if last is None else "is truncated or damaged"
        raise ShardError(f"TarShards: shard {shard!r} {kind}{where} ({exc})") from None
    except OSError as exc:
        raise ShardError(f"TarShards: shard {shard!r} cannot be read: {exc}") from None
    return members


def _samples_members(path: str, index_dir) -> set:
    """The member extensions of the first sample of shard `path`."""
    for _key, exts in _samples(load_index(path, index_dir), path):
        return set(exts)
    return set()
