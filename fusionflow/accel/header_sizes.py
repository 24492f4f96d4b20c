"""The accelerator's image sizes: each sample's (height, width) read from its header once per loader.

DALI's crop window is computed on the host from the image's size, as a CPU worker computes it; the
first accelerator read every sample's header twice per run (Pillow: once to check the policy's
pixel limit, once for the window), every epoch. An image does not change, so its size is read the
first time and kept in one array (16 bytes a sample: 20 MB for ImageNet's 1.28M).
"""

from __future__ import annotations

import zlib

import numpy as np

from fusionflow.errors import DecodeError


class HeaderSizes:
    """Each sample's (height, width), read from its encoded header the first time the accelerator meets
    it (libjpeg-turbo's header read for JPEGs, else Pillow's) and kept: an image does not change, so
    later epochs read no header at all. (0, 0) for a sample whose header cannot be read (not bytes,
    or unreadable: the CPU path reports it precisely)."""

    def __init__(self, n: int):
        self._hw = np.full((n, 2), -1, np.int64)  # -1: not read yet; 0: unreadable

    def many(self, indices, samples) -> np.ndarray:
        """(height, width) of each of a run's samples as an (n, 2) int64 array, (0, 0) where unreadable:
        one gather for the sizes known, the headers of the samples met the first time read together."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        inside = (idx >= 0) & (idx < len(self._hw))
        hw = np.full((len(idx), 2), -1, np.int64)
        hw[inside] = self._hw[idx[inside]]
        new = np.flatnonzero(hw[:, 0] < 0)
        if len(new):
            hw[new] = _header_sizes([samples[k] for k in new.tolist()])
            kept = new[inside[new]]
            self._hw[idx[kept]] = hw[kept]
        return hw


# What DALI's image decoders read (Pillow's names): another format (a GIF) goes to the CPU workers, not into a DALI run
# that fails whole, its neighbours with it, and counts towards the accelerator's retirement. Not TIFF (since session
# 40): a truncated one passes a header read and fails its whole run, every epoch (it cannot be told cheaply).
DALI_FORMATS = frozenset({"JPEG", "MPO", "PNG", "BMP", "PPM", "JPEG2000", "WEBP"})  # MPO: a camera's JPEG
# the pixel modes DALI decodes as the CPU path does (Pillow's names): 16-bit, float, LAB, CMYK go to the CPU workers
# (a CMYK JPEG without an Adobe marker came out black from DALI; 16-bit and float images scaled otherwise)
DALI_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1"})


def _header_sizes(data: list) -> np.ndarray:
    """(height, width) of each encoded image of `data`, (0, 0) where unreadable: the JPEGs among bytes objects
    in one native call (ops/jpeg.py `info_many`: a first epoch meets every sample, ~170 a run on a GPU), the
    rest -- other formats, other buffer types, headers libjpeg-turbo refuses -- one by one."""
    from fusionflow.ops import jpeg

    hw = jpeg.info_many(data) if data and set(map(type, data)) == {bytes} else None
    hw = np.zeros((len(data), 2), np.int64) if hw is None else hw.astype(np.int64)
    for k in np.flatnonzero(hw[:, 0] <= 0).tolist():
        hw[k] = _header_size(data[k])
    jpegs = [k for k in np.flatnonzero(hw[:, 0] > 0).tolist() if bytes(data[k][:2]) == b"\xff\xd8"]
    native = all(type(data[k]) is bytes for k in jpegs)  # the native call takes bytes objects only
    clean = jpeg.scan_clean_many([data[k] for k in jpegs]) if jpegs and native else None
    if clean is None:
        clean = [scan_is_clean(data[k]) for k in jpegs]
    for k, ok in zip(jpegs, clean):
        if not ok:
            hw[k] = 0
    return hw


def scan_is_clean(data) -> bool:
    """No 0xFF 0x01..0xBF pair (a marker that exists nowhere) from a JPEG's first scan header to its end (EOI: an
    MPO's next frame or a phone's trailer may follow). Random bytes in place of its entropy-coded data (a disk's or
    a copy's error) hold hundreds; libjpeg-turbo refuses the file on the CPU path, where DALI's decoder went past
    them and delivered the garbage as pixels. False for a header that cannot be walked too: a doubt costs only speed
    (the CPU workers take the sample and decide)."""
    pos, n = 2, len(data)
    while pos + 4 <= n:  # the header's segments, by their lengths, up to and over the first SOS
        if data[pos] != 0xFF:
            return False
        if data[pos + 1] == 0xFF:  # a fill byte
            pos += 1
            continue
        marker, pos = data[pos + 1], pos + 2 + int.from_bytes(bytes(data[pos + 2 : pos + 4]), "big")
        if marker == 0xDA:
            break
    else:
        return False
    scan = np.frombuffer(data, np.uint8)[pos:]
    marks = np.flatnonzero(scan[:-1] == 0xFF)
    after = scan[marks + 1]
    end = np.flatnonzero(after == 0xD9)
    if end.size and _image_ends_at(scan, int(marks[end[0]])):  # not what follows: an MPO's next frame, a trailer
        after = after[: end[0]]
    return not ((after >= 0x01) & (after <= 0xBF)).any()


def _image_ends_at(scan, p: int) -> bool:
    """Whether the FF D9 at scan[p] ends the image: a next frame (FF D8) follows, or what follows does not itself
    end in FF D9 (a trailer). Random bytes in place of the scan hold an FF D9 ~1 time in 190 before a bad marker,
    and the real end after them: scanned on."""
    rest = scan[p + 2 :]
    return rest.size < 2 or bytes(rest[:2]) == b"\xff\xd8" or bytes(rest[-2:]) != b"\xff\xd9"


def _header_size(data) -> tuple[int, int]:
    """(height, width) from an encoded image's header, (0, 0) when it is not bytes, cannot be read, is in a
    format DALI does not decode or is a JPEG without its end (truncated): the CPU workers take those, and Pillow
    reports a truncated file there every epoch, where DALI's window decode succeeds whenever the crop window
    lies before the missing bytes (a corrupt sample delivered in one epoch, an error in the next)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return 0, 0
    from fusionflow.ops import jpeg

    complete = jpeg.is_complete_jpeg(data)
    if not complete and jpeg.is_cut_short(data):
        return 0, 0
    if complete and jpeg.available():
        try:
            height, width, components = jpeg.info(bytes(data))
            return (height, width) if components in (1, 3) else (0, 0)  # CMYK, YCCK: the CPU workers'
        except jpeg.WindowDecodeError:
            pass
    try:
        h, w, fmt, mode = _pillow_header(data, None)
    except DecodeError:
        return 0, 0
    return (h, w) if fmt in DALI_FORMATS and mode in DALI_MODES and _whole(data, fmt) else (0, 0)


def _whole(data, fmt: str) -> bool:
    """Not visibly damaged: a PNG's chunks whole, each with its CRC (`png_is_whole`), a BMP at least its header's file
    size (a header read succeeds on a cut or damaged file; DALI's decode of it fails its whole run, its neighbours
    with it, and counts towards the accelerator's retirement, where the CPU path reports the sample)."""
    if fmt == "PNG":
        return png_is_whole(data)
    if fmt == "BMP" and len(data) >= 6:
        return int.from_bytes(bytes(data[2:6]), "little") <= len(data)
    return True


def png_is_whole(data) -> bool:
    """Whether a PNG's chunks, from its signature to IEND, each hold their length and a matching CRC-32 (zlib's, at
    C speed: once per sample, as its header). A bit flipped in the image data, or a file cut and given an IEND back,
    fails it; DALI's decoder failed such a file's whole run (a sweep, 2026-12-01: 4 such runs in a row retired
    the accelerator for the loader's life)."""
    view, pos, n = memoryview(data).cast("B"), 8, len(data)
    while pos + 12 <= n:
        length = int.from_bytes(view[pos : pos + 4], "big")
        end = pos + 8 + length
        if end + 4 > n or zlib.crc32(view[pos + 4 : end]) != int.from_bytes(view[end : end + 4], "big"):
            return False
        if view[pos + 4 : pos + 8] == b"IEND":
            return True
        pos = end + 4
    return False


def image_size(data, what: str | None = None) -> tuple[int, int]:
    """(height, width) from an encoded image's header, without decoding it."""
    return _pillow_header(data, what)[:2]


def _pillow_header(data, what) -> tuple[int, int, str | None, str]:
    """(height, width, Pillow's format name, its mode) from the header, or DecodeError."""
    from fusionflow.ops.decode import open_encoded

    try:
        with open_encoded(data, what) as img:  # Pillow's bomb warning silenced: the policy's limit governs
            w, h = img.size
            return h, w, img.format, img.mode
    except Exception as exc:  # Pillow raises several types for unreadable headers
        raise DecodeError(f"cannot read the image header of {len(data)} bytes: {exc}", what) from exc
