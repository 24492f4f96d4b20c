"""TarShards (fusionflow/datasets/shards.py) against the files it was written from, its index cache, its
errors; dict samples (sample_keys), read-ahead (read_ahead) and streams at the loader."""

import io
import json
import os
import pickle
import tarfile
import time

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset

from fusionflow import DictSamples, ImageFolder, ShardError, TarShards
from fusionflow.datasets.shards import expand_shards, split_member
from fusionflow.datasets.wrappers import ReadAhead
from fusionflow.errors import SampleError
from fusionflow.loader import FusionFlowLoader
from fusionflow.tools.synthetic import make_image_folder

SMALL = {
    "output": {"size": 24},
    "flip": 0.5,
    "crop": {"scale": [0.3, 1.0]},
    "augment": {"type": "rand", "num_ops": 1, "magnitude": 5, "num_bins": 11, "ops": {"Rotate": {"range": [0, 30]}}},
}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: ImageFolder, out_dir: str, per_shard: int, extra=None, fmt=tarfile.USTAR_FORMAT) -> str:
    """WebDataset layout: sample i is KEY.jpg + KEY.cls (+ extra(i) -> {ext: bytes}); returns the
    brace pattern of the shards written."""
    os.makedirs(out_dir, exist_ok=True)
    n = len(folder)
    shards = (n + per_shard - 1) // per_shard
    for s in range(shards):
        with tarfile.open(os.path.join(out_dir, f"train-{s:06d}.tar"), "w", format=fmt) as tar:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                key = f"{folder.targets[i]:02d}/sample_{i:06d}"
                with open(folder.paths[i], "rb") as f:
                    _add(tar, f"{key}.jpg", f.read())
                _add(tar, f"{key}.cls", str(folder.targets[i]).encode())
                for ext, data in (extra(i) if extra else {}).items():
                    _add(tar, f"{key}.{ext}", data)
    return os.path.join(out_dir, f"train-{{000000..{shards - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    return ImageFolder(make_image_folder(str(root), num_classes=3, per_class=9, min_side=40, max_side=120, seed=4))


@pytest.fixture
def shards(folder, tmp_path):
    return write_shards(folder, str(tmp_path / "shards"), per_shard=10)


def test_same_bytes_targets_and_sizes_as_the_files(folder, shards):
    ds = TarShards(shards)
    assert len(ds) == len(folder) == 27 and len(ds.shards) == 3
    for i in range(len(folder)):
        data, target = ds[i]
        assert data == folder[i][0] and target == folder.targets[i] and type(target) is int
    assert ds.sizes == folder.sizes
    assert ds.keys[11] == f"{folder.targets[11]:02d}/sample_000011"
    assert ds.describe(11).endswith("train-000001.tar:" + ds.keys[11])


def test_shard_lists_globs_and_braces(folder, shards, tmp_path):
    paths = sorted(str(p) for p in (tmp_path / "shards").glob("*.tar"))
    assert expand_shards(shards) == paths
    assert expand_shards(str(tmp_path / "shards" / "train-*.tar")) == paths
    assert TarShards(paths).sizes == TarShards(str(tmp_path / "shards" / "*.tar")).sizes
    assert expand_shards("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert expand_shards("{train,val}-{0..1}.tar") == ["train-0.tar", "train-1.tar", "val-0.tar", "val-1.tar"]
    assert split_member("d.x/k.seg.jpg") == ("d.x/k", "seg.jpg") and split_member("d/noext") is None
    loose = str(tmp_path / "shards" / "train-*")  # a glob that also matches the indexes written beside them
    assert expand_shards(loose) == paths and os.listdir(tmp_path / "shards") and TarShards(loose).sizes
    (tmp_path / "shards" / "train-000000.tar.ffindex.123.tmp").write_bytes(b"")  # an index being written
    assert any(n.endswith(".ffindex") for n in os.listdir(tmp_path / "shards")) and TarShards(loose).sizes
    assert expand_shards(loose) == paths
    with pytest.raises(ShardError, match="no file matches"):
        TarShards(str(tmp_path / "nothing-*.tar"))
    with pytest.raises(ShardError, match="cannot be opened"):
        TarShards(str(tmp_path / "missing.tar"))


def test_target_kinds_and_alternative_keys(folder, tmp_path):
    meta = lambda i: {"json": json.dumps({"i": i}).encode(), "txt": b" 7\n", "raw": b"\x00\x01"}  # noqa: E731
    pattern = write_shards(folder, str(tmp_path / "s"), per_shard=30, extra=meta)
    assert TarShards(pattern, target_key="json")[5][1] == {"i": 5}
    assert TarShards(pattern, target_key=".txt")[5][1] == 7
    assert TarShards(pattern, target_key="raw")[5][1] == b"\x00\x01"
    assert TarShards(pattern, target_key=None)[5][1] is None
    assert TarShards(pattern, image_key=("png", "jpg"))[5][0] == folder[5][0]
    with pytest.raises(
        ShardError, match=r"no sample has a '.npy' member for its target \(the first sample's members: "
    ):
        TarShards(pattern, target_key="npy")  # at construction, not at the first batch (serve waited for clients)


def test_index_is_cached_reused_and_rebuilt_after_a_change(folder, shards, tmp_path, monkeypatch):
    from fusionflow.datasets import shards as mod

    first = TarShards(shards)
    index = first.shards[0] + mod.INDEX_SUFFIX
    assert os.path.exists(index)
    calls = []
    real_scan = mod.scan
    monkeypatch.setattr(mod, "scan", lambda *a, **k: calls.append(a[0]) or real_scan(*a, **k))
    assert TarShards(shards).sizes == first.sizes and calls == []  # all three from their indexes
    # shard 1 rewritten with one sample fewer: only its index is rebuilt
    path = first.shards[1]
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()][:-2]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    os.utime(path, ns=(1, 1))
    again = TarShards(shards)
    assert calls == [path] and len(again) == len(first) - 1
    assert again[18][0] == folder[18][0] and again[19][0] == folder[20][0]  # sample 19 went


def test_index_dir_and_a_read_only_shard_directory(folder, shards, tmp_path, monkeypatch):
    from fusionflow.datasets import shards as mod

    TarShards(shards, index_dir=tmp_path / "idx")
    assert len(list((tmp_path / "idx").glob("*.ffindex"))) == 3
    assert not list((tmp_path / "shards").glob("*.ffindex"))
    # a directory we cannot write (simulated: the tests run as root) -> the user's cache directory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = mod._write_index
    monkeypatch.setattr(mod, "_write_index", lambda place, data: "cache" in place and real(place, data))
    ds = TarShards(shards)
    assert len(list((tmp_path / "cache" / "fusionflow" / "tar-index").glob("*.ffindex"))) == 3
    assert ds[3][0] == folder[3][0]


def test_pax_and_gnu_long_names(folder, tmp_path):
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        out = tmp_path / str(fmt)
        out.mkdir()
        long_key = "x" * 150 + "/sample"
        with tarfile.open(out / "s-0.tar", "w", format=fmt) as tar:
            _add(tar, f"{long_key}.jpg", folder[0][0])
            _add(tar, f"{long_key}.cls", b"2")
        ds = TarShards(str(out / "s-0.tar"))
        assert ds.keys == [long_key] and ds[0] == (folder[0][0], 2)


def test_errors_name_the_shard_the_sample_and_the_key(folder, shards, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with tarfile.open(bad / "nojpg.tar", "w") as tar:
        _add(tar, "k1.jpg", folder[0][0])
        _add(tar, "k2.png", folder[1][0])
        _add(tar, "k2.cls", b"1")
    with pytest.raises(ShardError, match=r"nojpg.tar', sample 'k2' has no '.jpg' member \(its members: cls, png\)"):
        TarShards(str(bad / "nojpg.tar"))
    (bad / "notatar.tar").write_bytes(b"hello, not a tar" * 100)
    with pytest.raises(ShardError, match="notatar.tar' is not a tar file"):
        TarShards(str(bad / "notatar.tar"))
    path = TarShards(shards).shards[0]
    data = open(path, "rb").read()
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    # cut inside a member's data, inside a header, exactly at a header, and right after the last member
    for k, cut in enumerate([len(data) // 2, last.offset + 100, last.offset, last.offset_data + last.size]):
        (bad / f"cut{k}.tar").write_bytes(data[:cut])
        with pytest.raises(ShardError, match=rf"cut{k}.tar' is truncated"):
            TarShards(str(bad / f"cut{k}.tar"))
    garbled = bytearray(data)
    garbled[last.offset : last.offset + 512] = b"\x07" * 512
    (bad / "garbled.tar").write_bytes(bytes(garbled))
    with pytest.raises(ShardError, match=r"garbled.tar' is truncated or damaged after member"):
        TarShards(str(bad / "garbled.tar"))
    with pytest.raises(ValueError, match="image_key"):
        TarShards(shards, image_key="")


def test_pickles_without_file_handles(folder, shards):
    ds = TarShards(shards)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    copy = pickle.loads(blob)
    assert copy[26] == ds[26] and copy._fds.keys() == {2}


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def _same_batches(got, want) -> bool:
    return len(got) == len(want) > 0 and all(
        torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(got, want)
    )


def test_loader_over_shards_equals_loader_over_the_folder(folder, shards):
    kw = dict(
        batch_size=5, shuffle=True, num_workers=2, policy=SMALL, seed=3, generator=torch.Generator().manual_seed(1)
    )
    want = _batches(FusionFlowLoader(folder, **kw))
    kw["generator"] = torch.Generator().manual_seed(1)
    got = _batches(FusionFlowLoader(TarShards(shards), **kw))
    assert len(got) == 6 and _same_batches(got, want)


def test_exactly_once_with_a_distributed_sampler_over_shards(folder, tmp_path):
    ident = lambda i: {"json": json.dumps(i).encode()}  # noqa: E731
    ds = TarShards(write_shards(folder, str(tmp_path / "s"), per_shard=4, extra=ident), target_key="json")
    seen, dealt = [], []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5, drop_last=False)
        loader = FusionFlowLoader(ds, batch_size=4, sampler=sampler, num_workers=2, policy=SMALL)
        seen += [int(v) for _, y in loader for v in y]
        dealt += list(sampler)
    assert sorted(seen) == sorted(dealt) and set(seen) == set(range(27))  # the sampler pads 27 to 28


class DictDataset:
    def __init__(self, folder, style):
        self.folder, self.style = folder, style

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        data, target = self.folder[i]
        if self.style == "wids":
            return {"__key__": f"s{i}", ".jpg": data, ".cls": str(target).encode()}
        if self.style == "hf":
            return {"image": {"bytes": data, "path": None}, "label": target}
        return {"image": {"bytes": None, "path": self.folder.paths[i]}, "label": target}


@pytest.mark.parametrize(
    "style,keys", [("wids", ("jpg", "cls")), ("hf", ("image", "label")), ("hf-path", ("image", "label"))]
)
def test_dict_samples_through_sample_keys(folder, style, keys):
    kw = dict(batch_size=6, num_workers=2, policy=SMALL, seed=1)
    want = _batches(FusionFlowLoader(folder, **kw))
    got = _batches(FusionFlowLoader(DictDataset(folder, style), sample_keys=keys, **kw))
    assert _same_batches(got, want)
    assert DictSamples(DictDataset(folder, style), keys[0])[4] == (folder[4][0], None)


class BatchedDicts(torch.utils.data.Dataset):
    """Dict samples read only by `__getitems__` (a Hugging Face dataset reads a batch in one Arrow call)."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return len(self.folder)

    def __getitems__(self, indices):
        return [{"image": {"bytes": self.folder[i][0], "path": None}, "label": self.folder[i][1]} for i in indices]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dict_samples_take_the_dataset_s_batched_read(folder, num_workers):
    """sample_keys' wrapper read item by item: a dataset's __getitems__ (Hugging Face's) was never called."""
    kw = dict(batch_size=6, num_workers=num_workers, policy=SMALL, seed=1)
    want = _batches(FusionFlowLoader(folder, **kw))
    assert _same_batches(_batches(FusionFlowLoader(BatchedDicts(folder), sample_keys=("image", "label"), **kw)), want)
    ahead = FusionFlowLoader(BatchedDicts(folder), sample_keys=("image", "label"), read_ahead=2, **kw)
    assert _same_batches(_batches(ahead), want)  # (read_ahead= read each through the wrapper's dataset[i]: it failed)


def test_a_dict_sample_s_cls_is_an_int_only_as_a_shard_s_is():
    """b"+-3" passed DictSamples' digit check and raised int()'s ValueError; as TarShards reads it: the bytes."""
    from fusionflow.datasets.shards import parse_target

    for raw in (b"3", b" 7\n", b"-2", b"+4", b"+-3", b"--5", b"1.5", b"cat"):
        got = DictSamples([{"jpg": b"x", "cls": raw}], "jpg", "cls")[0][1]
        assert got == parse_target(raw, "cls"), raw


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("keys", [("jpg",), "jpg"])
def test_samples_without_targets_deliver_the_same_images_and_none(folder, keys, num_workers):
    """sample_keys=(image key,): every batch is (the images the (image, target) dataset gives, None)."""
    kw = dict(batch_size=6, num_workers=num_workers, policy=SMALL, seed=1)
    want = _batches(FusionFlowLoader(folder, **kw))
    got = [(x, y) for x, y in FusionFlowLoader(DictDataset(folder, "wids"), sample_keys=keys, **kw)]
    assert len(got) == len(want) and all(y is None and torch.equal(x, x2) for (x, y), (x2, _) in zip(got, want))


def test_dict_samples_without_sample_keys_say_which_keys_to_give(folder):
    with pytest.raises(ValueError, match=r"keys: '__key__', '.jpg', '.cls'.*sample_keys=\('.jpg', '.cls'\)"):
        FusionFlowLoader(DictDataset(folder, "wids"), batch_size=4, policy=SMALL)
    with pytest.raises(KeyError, match=r"no image key 'png' \(its keys: 'image', 'label'\)"):
        DictSamples(DictDataset(folder, "hf"), "png", "label")[0]
    with pytest.raises(ValueError, match="sample_keys"):
        FusionFlowLoader(DictDataset(folder, "hf"), batch_size=4, policy=SMALL, sample_keys=("a", "b", "c"))
    with pytest.raises(ValueError, match="image key 1 must be a key such as 'jpg'"):  # (was a bare TypeError)
        FusionFlowLoader(DictDataset(folder, "hf"), batch_size=4, policy=SMALL, sample_keys=(1, 2))


def test_a_stream_is_refused_at_construction_with_what_to_use():
    class Stream(IterableDataset):
        def __iter__(self):
            yield b"", 0

    with pytest.raises(TypeError, match=r"map-style dataset.*got Stream, a stream.*fusionflow.TarShards"):
        FusionFlowLoader(Stream(), batch_size=4, policy=SMALL)


def test_the_make_shards_example_writes_what_tarshards_reads(folder, tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "make_shards.py")
    spec = importlib.util.spec_from_file_location("make_shards", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = TarShards(mod.write_shards(folder.root, str(tmp_path / "out"), per_shard=8, shuffle_seed=2))
    assert len(ds.shards) == 4 and sorted(int(k) for k in ds.keys) == list(range(len(folder)))
    assert ds.keys != sorted(ds.keys)  # shuffled across shards
    for i, key in enumerate(ds.keys):
        assert ds[i] == (folder[int(key)][0], folder.targets[int(key)])


class Named(DictDataset):
    sizes = property(lambda self: self.folder.sizes)

    def describe(self, i):
        return self.folder.paths[i]


def test_dict_samples_keep_the_datasets_sizes_and_names(folder):
    wrapped = pickle.loads(pickle.dumps(DictSamples(Named(folder, "wids"), "jpg", "cls")))
    assert wrapped.sizes == folder.sizes and wrapped.describe(3) == folder.paths[3]
    assert not hasattr(DictSamples(DictDataset(folder, "wids"), "jpg"), "describe")


class SlowReads:
    """ImageFolder's samples, each read taking `seconds` (a network filesystem's wait); records the
    most reads in flight at once within a process, and fails sample `bad`."""

    def __init__(self, folder, seconds, bad=None):
        self.folder, self.seconds, self.bad = folder, seconds, bad
        self.sizes = folder.sizes
        self.in_flight = self.most = 0

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.seconds)
            if i == self.bad:
                raise OSError(f"read of sample {i} failed")
            return self.folder[i]
        finally:
            self.in_flight -= 1

    def describe(self, i):
        return self.folder.paths[i]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_read_ahead_gives_the_same_batches(folder, num_workers):
    kw = dict(batch_size=6, shuffle=True, num_workers=num_workers, policy=SMALL, seed=2, tiny_batch_size=3)
    want = _batches(FusionFlowLoader(folder, generator=torch.Generator().manual_seed(4), **kw))
    loader = FusionFlowLoader(SlowReads(folder, 0.002), read_ahead=3, generator=torch.Generator().manual_seed(4), **kw)
    got = _batches(loader)
    assert _same_batches(got, want)
    assert DictSamples(DictDataset(folder, "wids"), "jpg", "cls")[2] == folder[2]  # and inline, dicts work too


def test_read_ahead_overlaps_reads_and_keeps_failures_where_they_were(folder):
    slow = SlowReads(folder, 0.02)
    loader = FusionFlowLoader(slow, batch_size=8, num_workers=0, policy=SMALL, read_ahead=4)
    assert sum(len(y) for _, y in loader) == len(folder) and slow.most >= 3  # inline: reads ran together
    plain = SlowReads(folder, 0.0)
    list(FusionFlowLoader(plain, batch_size=8, num_workers=0, policy=SMALL))
    assert plain.most == 1
    bad = FusionFlowLoader(SlowReads(folder, 0.001, bad=5), batch_size=8, num_workers=2, policy=SMALL, read_ahead=2)
    with pytest.raises(SampleError, match=r"sample 5 \(.*img_.*\).*OSError: read of sample 5 failed"):
        list(bad)
    bad.close()
    skip = FusionFlowLoader(
        SlowReads(folder, 0.001, bad=5), batch_size=8, num_workers=2, policy=SMALL, read_ahead=2, on_error="skip"
    )
    with pytest.warns(UserWarning):
        assert sorted(int(v) for _, y in skip for v in y) == sorted(folder.targets[i] for i in range(27) if i != 5)


def test_read_ahead_arguments_and_pickling(folder):
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="read_ahead"):
            FusionFlowLoader(folder, batch_size=4, policy=SMALL, read_ahead=bad)
    assert FusionFlowLoader(folder, batch_size=4, policy=SMALL, read_ahead=0).config.read_ahead is None
    ra = ReadAhead(folder, 2)
    ra.prefetch([0, 1])
    copy = pickle.loads(pickle.dumps(ra))
    assert copy._pool is None and copy._pending == {} and copy[1] == ra[1] == folder[1]
    assert ra.sizes == folder.sizes and ra.describe(1) == folder.paths[1]


def test_shards_written_by_webdatasets_shardwriter(folder, tmp_path):
    wds = pytest.importorskip("webdataset")
    pattern = str(tmp_path / "w-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=10, verbose=0) as sink:
        for i in range(len(folder)):
            sink.write({"__key__": f"s{i:05d}", "jpg": folder[i][0], "cls": folder.targets[i]})
    ds = TarShards(str(tmp_path / "w-{000000..000002}.tar"))
    assert [ds[i] for i in range(len(folder))] == [folder[i] for i in range(len(folder))]


def test_a_key_met_again_later_in_a_shard_is_another_sample_as_webdataset_reads_it(folder, tmp_path):
    """Two class folders' `img_0001` written into one shard: four samples, in member order, as WebDataset's own
    reader gives them (they were merged into two, the later copies' bytes at the first's places). An extension
    twice in a row for one key is refused, naming the shard and the key."""
    wds = pytest.importorskip("webdataset")
    path = str(tmp_path / "dup.tar")
    order = [("img_0001", 0), ("img_0002", 1), ("img_0001", 2), ("img_0002", 3)]
    with tarfile.open(path, "w") as tar:
        for key, i in order:
            _add(tar, f"{key}.jpg", folder[i][0])
            _add(tar, f"{key}.cls", str(i).encode())
    ds = TarShards(path)
    assert [ds[i] for i in range(len(ds))] == [(folder[i][0], i) for _, i in order]
    theirs = [(s["jpg"], int(s["cls"])) for s in wds.WebDataset(path, shardshuffle=False, empty_check=False)]
    assert [ds[i] for i in range(len(ds))] == theirs and ds.keys == [k for k, _ in order]
    twice = str(tmp_path / "twice.tar")
    with tarfile.open(twice, "w") as tar:
        for name in ("a.jpg", "a.cls", "a.jpg"):
            _add(tar, name, folder[0][0] if name.endswith("jpg") else b"0")
    with pytest.raises(ShardError, match=r"twice.tar.*two 'jpg' members for sample 'a'"):
        TarShards(twice)


@pytest.mark.parametrize("kind", ["folder", "shards"])
def test_relative_paths_read_the_same_files_from_a_process_in_another_directory(kind, tmp_path, monkeypatch):
    """A dataset made with relative paths and sent to a process whose working directory is another (a worker
    lent by a loader started elsewhere) reads the files it was made over, and the cache tells the two apart."""
    from fusionflow.cache.attach import fingerprint

    made, read = {}, {}
    for where, seed in (("x", 1), ("y", 2)):  # the same relative names, other images
        root = tmp_path / where
        make_image_folder(str(root / "data"), num_classes=2, per_class=3, min_side=40, max_side=60, seed=seed)
        monkeypatch.chdir(root)
        if kind == "shards":
            write_shards(ImageFolder("data"), "shards", per_shard=4)
            made[where] = TarShards("shards/train-{000000..000001}.tar")
        else:
            made[where] = ImageFolder("data")
        read[where] = [made[where][i] for i in range(len(made[where]))]
        made[where] = pickle.dumps(made[where])  # (no descriptor kept open)
    assert read["x"] != read["y"]
    sent = pickle.loads(made["x"])  # read in y, the working directory now
    assert [sent[i] for i in range(len(sent))] == read["x"]
    assert fingerprint(sent) != fingerprint(pickle.loads(made["y"]))


def test_wids_and_hugging_face_datasets_through_sample_keys(folder, shards, tmp_path):
    wids = pytest.importorskip("wids")
    datasets = pytest.importorskip("datasets")
    kw = dict(batch_size=6, num_workers=2, policy=SMALL, seed=1)
    want = _batches(FusionFlowLoader(folder, **kw))
    spec = [{"url": p, "nsamples": n} for p, n in zip(TarShards(shards).shards, (10, 10, 7))]
    raw = wids.ShardListDataset(spec, transformations=[], cache_dir=str(tmp_path / "wids"))  # BytesIO values
    hf = datasets.Dataset.from_dict(
        {"image": [{"bytes": folder[i][0], "path": None} for i in range(len(folder))], "label": folder.targets}
    ).cast_column("image", datasets.Image(decode=False))
    for ds, keys in ((raw, ("jpg", "cls")), (hf, ("image", "label"))):
        got = _batches(FusionFlowLoader(ds, sample_keys=keys, **kw))
        assert _same_batches(got, want)
    decoded = wids.ShardListDataset(spec, cache_dir=str(tmp_path / "wids2"))  # its default: PIL images, int targets
    labels = [int(v) for _, y in FusionFlowLoader(decoded, sample_keys=("jpg", "cls"), **kw) for v in y]
    assert labels == [int(v) for _, y in want for v in y]


def test_the_cache_fingerprint_is_the_same_in_another_process_and_moves_with_the_shards(shards, tmp_path):
    """The decoded-image cache finds its segment by this fingerprint: a pickle's hash held the process id, so no
    two processes (DDP ranks, co-located jobs) shared one cache of the same shards."""
    import subprocess
    import sys

    from fusionflow.cache.attach import fingerprint

    ds = TarShards(shards)
    code = (
        "from fusionflow import TarShards; from fusionflow.cache.attach import fingerprint; "
        f"print(fingerprint(TarShards({shards!r})))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fingerprint(ds) == other and fingerprint(pickle.loads(pickle.dumps(ds))) == other
    first = ds.shards[0]
    os.utime(first, ns=(time.time_ns(), time.time_ns() + 10**9))  # rewritten: its modification time moves
    assert fingerprint(TarShards(shards)) != other
