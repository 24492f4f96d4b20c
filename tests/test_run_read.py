"""A DALI run's samples read with whole-run operations (accel/run_read.py): the same samples, targets
and sizes as one by one, tiny-batches DALI must not see given back whole, malformed items refused by
index, and a fixed number of Python calls per run whatever its size (issue 41's feeder bar)."""

import sys

import numpy as np
import pytest

from fusionflow.accel.header_sizes import HeaderSizes
from fusionflow.accel.run_read import read_run
from fusionflow.scheduling.queue import Work
from fusionflow.tools.synthetic import EncodedImages, make_jpegs

JPEGS = make_jpegs(8, 20, 60, seed=3)


class OneByOne:
    """A dataset without a batched read."""

    def __init__(self, items):
        self.items = items

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def works_of(indices, per=2):
    return [
        Work(0, 1, 0, 0, tuple(range(k, k + len(indices[k : k + per]))), tuple(indices[k : k + per]))
        for k in range(0, len(indices), per)
    ]


def header_hw(data):
    import io

    from PIL import Image

    w, h = Image.open(io.BytesIO(data)).size
    return h, w


@pytest.mark.parametrize("batched", [True, False])
def test_a_run_reads_each_samples_bytes_target_and_size(batched):
    ds = EncodedImages(JPEGS, classes=3)
    if not batched:
        ds = OneByOne([ds[i] for i in range(len(ds))])
    order = [5, 2, 7, 0, 3]
    read = read_run(ds, works_of(order), HeaderSizes(len(JPEGS)), None)
    assert read.given_back == [] and len(read.runnable) == 3
    assert read.samples == [JPEGS[i] for i in order] and read.labels == [i % 3 for i in order]
    assert [tuple(z) for z in np.asarray(read.sizes).tolist()] == [header_hw(JPEGS[i]) for i in order]


def test_tiny_batches_over_the_pixel_limit_or_unreadable_are_given_back_whole():
    sizes = [header_hw(d) for d in JPEGS]
    big = max(range(len(JPEGS)), key=lambda i: sizes[i][0] * sizes[i][1])
    limit = sizes[big][0] * sizes[big][1] - 1
    items = [(d, i) for i, d in enumerate(JPEGS)]
    items[6] = (b"not an image", 6)
    others = [i for i in range(len(JPEGS)) if i not in (big, 6)]
    order = [others[0], big, others[1], others[2], 6, others[3]]
    works = works_of(order)
    read = read_run(OneByOne(items), works, HeaderSizes(len(items)), limit)
    assert read.given_back == [w for w in works if big in w.indices or 6 in w.indices]
    kept = [i for w in read.runnable for i in w.indices]
    assert read.samples == [items[i][0] for i in kept] and read.labels == kept
    assert [tuple(z) for z in read.sizes] == [sizes[i] for i in kept]


@pytest.mark.parametrize("item", [{"image": b"x", "label": 1}, (b"x",), "ab"])
def test_an_item_that_is_not_a_sample_target_pair_goes_back_for_the_cpu_workers_to_refuse(item):
    """Given back with its tiny-batch (the CPU workers refuse it naming its index: test_loader), never a failed run."""
    items = [(JPEGS[0], 0), item, (JPEGS[2], 2)]
    works = works_of([0, 1, 2], per=1)
    read = read_run(OneByOne(items), works, HeaderSizes(3), None)
    assert read.given_back == [works[1]] and read.runnable == [works[0], works[2]] and read.unreadable
    assert read.samples == [JPEGS[0], JPEGS[2]] and read.labels == [0, 2]


class Raising(OneByOne):
    """A dataset whose read of some indices raises (a missing file), by the batched read too."""

    def __init__(self, items, bad):
        super().__init__(items)
        self.bad = bad

    def __getitem__(self, i):
        if i in self.bad:
            raise FileNotFoundError(f"sample {i}")
        return super().__getitem__(i)

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_a_sample_the_dataset_cannot_read_gives_back_its_tiny_batch_only():
    """A run's read that raised failed the whole run, counted towards the accelerator's retirement: with a few
    bad files among many (on_error='skip') DALI retired. Now its tiny-batch goes back, the rest run."""
    items = [(d, i) for i, d in enumerate(JPEGS)]
    works = works_of(list(range(6)), per=2)
    read = read_run(Raising(items, {3}), works, HeaderSizes(len(items)), None)
    assert read.given_back == [works[1]] and read.runnable == [works[0], works[2]] and read.unreadable
    assert read.labels == [0, 1, 4, 5] and read.samples == [JPEGS[i] for i in (0, 1, 4, 5)]
    assert len(read.sizes) == 4
    whole = read_run(Raising(items, {9}), works, HeaderSizes(len(items)), None)
    assert not whole.given_back and not whole.unreadable


def test_header_sizes_are_read_once_then_gathered():
    dims = HeaderSizes(len(JPEGS))
    first = dims.many([1, 4], [JPEGS[1], JPEGS[4]])
    assert [tuple(z) for z in first.tolist()] == [header_hw(JPEGS[1]), header_hw(JPEGS[4])]
    again = dims.many([4, 1], [None, None])  # known: the bytes are not looked at
    assert [tuple(z) for z in again.tolist()] == [header_hw(JPEGS[4]), header_hw(JPEGS[1])]
    assert dims.many([99], [b"junk"]).tolist() == [[0, 0]]


def test_a_truncated_jpeg_is_no_runs_sample():
    """A JPEG without its end: DALI's window decode succeeds where the crop lies before the missing bytes, so it
    would be delivered in one epoch and fail in the next; (0, 0) sends it to the CPU workers, which report it."""
    cut = JPEGS[3][: len(JPEGS[3]) * 85 // 100]
    padded = JPEGS[3] + b"\x00" * 8  # a complete one with trailing padding still runs
    trailer = JPEGS[3] + bytes(range(32))  # and one with a trailer past its end
    whole, other = list(header_hw(JPEGS[3])), list(header_hw(JPEGS[4]))
    got = HeaderSizes(4).many([0, 1, 2, 3], [cut, padded, trailer, JPEGS[4]]).tolist()
    assert got == [[0, 0], whole, whole, other]


def test_what_dali_decodes_otherwise_or_fails_whole_runs_on_goes_to_the_cpu_workers():
    """A sample DALI decodes differently from the CPU path, or fails its whole run on (its neighbours redone on the
    CPU, the pipeline rebuilt, every epoch): no size for a run. A CMYK JPEG without an Adobe marker came out black;
    16-bit and float images scaled otherwise; a cut PNG or BMP passes a header read, and so does a PNG with a damaged
    chunk (a 2026-12-01 sweep: four runs holding one each retired the accelerator). Plain ones keep theirs."""
    import io

    from PIL import Image

    def enc(img, fmt, **kw):
        out = io.BytesIO()
        img.save(out, fmt, **kw)
        return out.getvalue()

    def flipped(data):
        at = data.index(b"IDAT") + 20
        return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), np.uint8))
    png, bmp = enc(rgb, "PNG"), enc(rgb, "BMP")
    plain = [enc(rgb, "JPEG"), enc(rgb.convert("L"), "JPEG"), png, bmp, enc(rgb.convert("P"), "PNG"), enc(rgb, "WEBP")]
    cmyk = enc(rgb.convert("CMYK"), "JPEG")
    no_adobe = cmyk.replace(b"\xff\xeeAdobe", b"\xff\xeeXdobe")  # the marker's name changed: not read as Adobe's
    odd = [
        cmyk,
        no_adobe,
        enc(Image.fromarray(np.full((40, 50), 40000, np.uint16)), "PNG"),  # 16-bit
        enc(Image.fromarray(np.zeros((40, 50), np.float32)), "TIFF"),
        enc(rgb, "TIFF"),  # TIFF: a cut one cannot be told from its header
        png[: len(png) // 2],
        bmp[: len(bmp) // 2],
        flipped(png),  # a byte of its image data changed, its chunks' lengths and IEND intact
        png[: len(png) // 2] + png[-12:],  # cut, and given its IEND back
    ]
    dims = HeaderSizes(len(plain) + len(odd))
    hw = dims.many(list(range(len(plain) + len(odd))), plain + odd).tolist()
    assert hw[: len(plain)] == [[40, 50]] * len(plain) and hw[len(plain) :] == [[0, 0]] * len(odd), hw


def test_first_met_headers_are_read_in_one_native_call_and_the_rest_one_by_one(monkeypatch):
    """A run's new JPEG bytes go to the native reader together (one call); a PNG, a JPEG it refuses and
    other buffer types are read one by one as before; all sizes equal Pillow's, (0, 0) where unreadable (or a CMYK
    JPEG: the CPU workers', since session 40)."""
    import io

    from PIL import Image

    from fusionflow.ops import jpeg

    png = io.BytesIO()
    Image.new("RGB", (13, 7)).save(png, "PNG")
    cmyk = io.BytesIO()
    Image.new("CMYK", (9, 5)).save(cmyk, "JPEG")
    items = [JPEGS[0], png.getvalue(), JPEGS[1], b"junk", cmyk.getvalue(), JPEGS[2]]
    batches = []
    real = jpeg.info_many
    monkeypatch.setattr(jpeg, "info_many", lambda data: batches.append(len(data)) or real(data))
    dims = HeaderSizes(len(items) + 1)
    hw = dims.many(list(range(len(items))), items)
    expected = [header_hw(d) for d in items[:3]] + [(0, 0), (0, 0), header_hw(items[5])]  # junk; CMYK: the CPU's
    assert [tuple(z) for z in hw.tolist()] == expected
    assert batches == [len(items)]
    assert dims.many([6], [bytearray(JPEGS[3])]).tolist() == [list(header_hw(JPEGS[3]))]  # not bytes: one by one
    assert batches == [len(items)]  # a bytearray is not sent to the batched reader
    again = dims.many([5, 0, 3], [None, None, None])  # known, unreadable included: nothing read again
    assert [tuple(z) for z in again.tolist()] == [expected[5], expected[0], (0, 0)]


def calls_of(fn) -> int:
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_runs_read_and_target_store_take_calls_per_tiny_batch_not_per_sample():
    """With a batched dataset, sizes known and int targets, reading a run and storing its targets take
    the same number of Python calls for 8 samples and for 256 in tiny-batches of as many samples."""
    from fusionflow.runtime.targets import store_works

    data = JPEGS * 32
    ds, dims = EncodedImages(data, classes=10), HeaderSizes(len(data))
    dims.many(list(range(len(data))), data)

    def read_and_store(n: int, per: int) -> int:
        works, ring = works_of(list(range(n)), per=per), np.zeros((1, 256), np.int64)
        calls = calls_of(lambda: store_works(ring, works, read_run(ds, works, dims, 10**6).labels))
        assert ring[0, :n].tolist() == [i % 10 for i in range(n)]
        return calls

    assert read_and_store(8, 4) == read_and_store(256, 128)


def test_a_subclass_that_reads_its_own_way_is_read_through_its_getitem():
    class Renamed(EncodedImages):
        def __getitem__(self, i):
            return b"x" + self.data[i], -i

    ds = Renamed(JPEGS[:3])
    assert ds.__getitems__([2, 0]) == [(b"x" + JPEGS[2], -2), (b"x" + JPEGS[0], 0)]
    assert EncodedImages(JPEGS[:3], classes=2).__getitems__([2, 1]) == [(JPEGS[2], 0), (JPEGS[1], 1)]


def test_a_batched_read_returning_a_tuple_or_a_generator_is_read_as_a_list():
    """The accelerator's read took len() of what __getitems__ returned: a generator retired the accelerator
    ("object of type 'generator' has no len()") and its runs went back to the CPU workers, read again."""
    from fusionflow.accel.run_read import read_items

    class Lazy(EncodedImages):
        def __getitems__(self, indices):
            return (self[i] for i in indices)

    class Tupled(EncodedImages):
        def __getitems__(self, indices):
            return tuple(self[i] for i in indices)

    for ds in (Lazy(JPEGS[:4], classes=3), Tupled(JPEGS[:4], classes=3)):
        assert read_items(ds, [3, 1]) == [(JPEGS[3], 0), (JPEGS[1], 1)]
