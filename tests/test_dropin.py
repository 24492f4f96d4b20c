"""FusionFlowLoader as a drop-in for DataLoader in real training scripts (issue 14): collate_fn with
DataLoader's contract, warnings instead of errors where DataLoader warns, raw-sample check, seed default.

The reference is DataLoader itself, over a dataset that runs torchvision's pipeline with the same
per-sample draws (tests/tv_reference.py), so "the same recipe" is checked end to end."""

import collections
import functools
import io
import itertools
import os

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
from PIL import Image
from test_loader import no_leaks  # noqa: F401  (autouse: no process or segment left)
from torch.utils.data import DataLoader, default_collate
from tv_reference import tv_sample

from fusionflow.errors import SampleError
from fusionflow.loader import FusionFlowLoader
from fusionflow.policy import crop_window, draw, load_policy
from fusionflow.tools.synthetic import make_jpegs

NUM_CLASSES = 5
EXACT = {
    "output": {"size": 24},
    "flip": 0.5,
    "crop": {"scale": [0.3, 1.0]},
    "decode": {"mode": "exact"},
    "augment": {
        "type": "rand",
        "num_ops": 2,
        "magnitude": 5,
        "num_bins": 11,
        "ops": {"Rotate": {"range": [0, 30], "signed": True}, "Posterize": {"range": [8, 4]}, "Equalize": {}},
    },
}
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
NORMALIZED = dict(EXACT, output={"size": 24, "normalize": {"mean": MEAN, "std": STD}})
JPEGS = make_jpegs(21, 30, 90, seed=11)


class Raw:
    """What FusionFlow is given: encoded JPEG bytes and a class label."""

    def __len__(self):
        return len(JPEGS)

    def __getitem__(self, i):
        return JPEGS[i], i % NUM_CLASSES


class Torchvision:
    """What DataLoader is given: torchvision's pixels for the same per-sample draws as FusionFlow's."""

    def __init__(self, policy, seed, epoch=0):
        self.policy, self.seed, self.epoch = load_policy(policy), seed, epoch

    def __len__(self):
        return len(JPEGS)

    def __getitem__(self, i):
        data = JPEGS[i]
        width, height = Image.open(io.BytesIO(data)).size
        d = draw(self.policy, self.seed, self.epoch, i)
        x = torch.from_numpy(tv_sample(self.policy, data, d, crop_window(self.policy, d, height, width)).copy())
        if self.policy.normalize:
            x = v2.Normalize(MEAN, STD)(v2.ToDtype(torch.float32, scale=True)(x))
        return x, i % NUM_CLASSES


def both(policy, collate_fn, num_workers, batch_size=6):
    """(FusionFlowLoader's batches, DataLoader's batches) for one epoch with the same collate_fn."""
    ff = FusionFlowLoader(
        Raw(), batch_size=batch_size, num_workers=num_workers, policy=policy, seed=3, collate_fn=collate_fn
    )
    dl = DataLoader(Torchvision(policy, seed=3), batch_size=batch_size, collate_fn=collate_fn)
    return list(ff), list(dl)


# ---------------------------------------------------------------- collate_fn
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [None, default_collate])
def test_default_collate_is_the_no_cost_path_and_equals_dataloader(collate_fn, num_workers):
    ff, dl = both(EXACT, collate_fn, num_workers)
    loader = FusionFlowLoader(Raw(), batch_size=6, policy=EXACT, collate_fn=collate_fn)
    assert loader._collate is None  # delivered as collated in place: no per-sample work
    assert len(ff) == len(dl) == 4
    for (x, y), (rx, ry) in zip(ff, dl):
        assert x.dtype == rx.dtype == torch.uint8 and y.dtype == ry.dtype == torch.int64
        assert torch.equal(x, rx) and torch.equal(y, ry)


def to_dict(batch):
    """A collate that returns a dict, with the targets left as the dataset gave them."""
    return {"image": torch.stack([x for x, _ in batch]), "target": [t for _, t in batch], "n": len(batch)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_returning_a_dict_equals_dataloader(num_workers):
    ff, dl = both(EXACT, to_dict, num_workers)
    assert len(ff) == len(dl) == 4
    for got, ref in zip(ff, dl):
        assert set(got) == {"image", "target", "n"} and got["n"] == ref["n"]
        assert torch.equal(got["image"], ref["image"])
        assert got["target"] == ref["target"] and all(type(t) is int for t in got["target"])


def test_collate_gets_views_of_the_delivered_batch():
    seen = []

    def spy(batch):
        seen.append(batch)
        return default_collate(batch)

    ff = FusionFlowLoader(Raw(), batch_size=6, policy=EXACT, collate_fn=spy)
    x, y = next(iter(ff))
    images = [img for img, _ in seen[0]]
    assert len(images) == 6 and images[0].shape == (3, 24, 24)
    base = images[0].untyped_storage().data_ptr()
    assert all(img.untyped_storage().data_ptr() == base for img in images)  # one batch tensor, no copies
    assert [t for _, t in seen[0]] == y.tolist()


_cutmix_or_mixup = v2.RandomChoice(
    [v2.MixUp(alpha=0.8, num_classes=NUM_CLASSES), v2.CutMix(alpha=1.0, num_classes=NUM_CLASSES)]
)


def mixup_cutmix(batch):
    """torchvision's reference-script collate, `lambda b: mixup_cutmix(*default_collate(b))`, under a
    generator fixed per batch, so the two loaders' own uses of torch's RNG do not matter."""
    with torch.random.fork_rng():
        torch.manual_seed(1000 + len(batch) * 7 + int(batch[0][1]))
        return _cutmix_or_mixup(*default_collate(batch))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mixup_cutmix_collate_equals_dataloader(num_workers):
    ff, dl = both(NORMALIZED, mixup_cutmix, num_workers, batch_size=5)
    assert len(ff) == len(dl) == 5
    for (x, y), (rx, ry) in zip(ff, dl):
        assert x.dtype == torch.float32 and y.shape == (len(x), NUM_CLASSES)
        assert torch.equal(y, ry)  # soft targets: the same lambda, the same boxes, the same pairing
        # the same pixels mixed the same way; FusionFlow normalises as x*(1/255std) - mean/std (float rounding)
        torch.testing.assert_close(x, rx, rtol=0, atol=1e-5)
    assert any((y.max(1).values < 1).any() for _, y in ff)  # something was actually mixed


def _mixup_lam(batch):  # as torchvision's reference mixup_cutmix: draws from torch's global stream
    x, y = default_collate(batch)
    return x, y, float(torch.distributions.Beta(torch.tensor([0.2]), torch.tensor([0.2])).sample())


def test_a_collate_fn_that_draws_leaves_the_training_process_streams_as_dataloader_s_workers_do():
    """With workers, DataLoader calls a collate_fn in them: the training process's random streams are untouched,
    so later epochs' shuffles and the script's own draws follow. Ours ran it in the training process, which
    shifted them; it now runs on streams of its own, seeded per batch (its draws reproducible)."""

    def run(make):
        torch.manual_seed(0)
        loader = make(Raw(), batch_size=4, shuffle=True, num_workers=2, collate_fn=_mixup_lam)
        epochs = [[(y.tolist(), lam) for _, y, lam in loader] for _ in range(2)]
        return epochs, torch.rand(1).item()

    (ours, after), (dl, dl_after) = run(functools.partial(FusionFlowLoader, policy=EXACT)), run(DataLoader)
    assert [[y for y, _ in e] for e in ours] == [[y for y, _ in e] for e in dl] and after == dl_after
    again, _ = run(functools.partial(FusionFlowLoader, policy=EXACT))
    assert again == ours and len({lam for e in ours for _, lam in e}) > 1  # reproducible, drawn anew per batch


def test_pin_memory_pins_what_the_collate_fn_returns(monkeypatch):
    """DataLoader pins a collate_fn's output (tensors, and custom types by their pin_memory()); the loader pinned
    the image batch before it, and the collate_fn's stack of its views came out unpinned (a synchronous copy to the
    GPU in torchvision's recipe). Without a GPU here, CUDA is said to be there and the pinning step recorded."""
    from fusionflow.loader import epoch

    pinned = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(epoch, "pin_batch", lambda out: pinned.append(out) or out)

    def stack(batch):
        return torch.stack([x for x, _ in batch]), torch.tensor([y for _, y in batch])

    with FusionFlowLoader(Raw(), batch_size=4, policy=EXACT, collate_fn=stack, pin_memory=True) as loader:
        batches = list(loader)
    assert len(pinned) == len(batches) and all(p is b for p, b in zip(pinned, batches))


def test_collate_fn_must_be_callable():
    with pytest.raises(TypeError, match=r"collate_fn=3 must be callable"):
        FusionFlowLoader(Raw(), batch_size=4, policy=EXACT, collate_fn=3)


def test_break_out_of_a_collated_iteration_cleans_up():
    ff = FusionFlowLoader(Raw(), batch_size=4, num_workers=2, policy=EXACT, collate_fn=to_dict)
    for batch in ff:  # noqa: B007 (the batch outlives the loop on purpose)
        break
    del batch
    assert ff._manager is None  # the worker iteration under the collate ended with the break


# ---------------------------------------------------------------- small frictions
def test_more_workers_than_cores_warns_and_runs(monkeypatch):
    import fusionflow.loader.front as loader_mod

    monkeypatch.setattr(loader_mod, "_usable_cpus", lambda: 1)
    with pytest.warns(UserWarning, match=r"num_workers=2 exceeds the 1 CPU cores"):
        ff = FusionFlowLoader(Raw(), batch_size=7, num_workers=2, policy=EXACT, seed=0)
    labels = torch.cat([y for _, y in ff])
    assert labels.tolist() == [i % NUM_CLASSES for i in range(len(JPEGS))]


class Transformed:
    """A dataset that already applies torchvision transforms: float tensors."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(3, 24, 24), 0


class TransformedArrays(Transformed):
    def __getitem__(self, i):
        return np.zeros((24, 24, 3), np.float32), 0


@pytest.mark.parametrize("ds", [Transformed(), TransformedArrays()])
def test_already_transformed_dataset_is_refused_at_construction(ds):
    with pytest.raises(ValueError, match=r"raw images \(fusionflow.ImageFolder, or this dataset without its transform"):
        FusionFlowLoader(ds, batch_size=2, policy=EXACT)


class OpensAtFirstRead(Raw):
    """A dataset that opens its file at its first read (the HDF5/LMDB pattern): which processes read it."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().__getitem__(i)


def test_with_workers_the_training_process_reads_no_sample(tmp_path):
    """A lazily opened file opened in the training process would be shared by forked workers (one offset: other
    samples' bytes) and could not be pickled to spawned ones: with workers, only workers read."""
    log = tmp_path / "reads"
    with FusionFlowLoader(OpensAtFirstRead(log), batch_size=4, num_workers=1, policy=EXACT) as loader:
        assert not log.exists()  # construction read nothing
        assert sum(len(y) for _, y in loader) == len(Raw())
    assert str(os.getpid()) not in log.read_text().split()


def test_already_transformed_samples_read_by_workers_say_so():
    from fusionflow.errors import SampleError

    with pytest.raises(SampleError, match=r"already-transformed sample\? FusionFlow decodes and augments"):
        with FusionFlowLoader(Transformed(), batch_size=2, num_workers=1, policy=EXACT) as loader:
            next(iter(loader))


def _first(loader):
    """The first batch's images (an epoch starts: a seed=None loader draws its seed)."""
    return next(iter(loader))[0]


def test_seed_default_is_the_first_epochs_base_seed_as_dataloader_draws_it():
    """seed=None: the base seed the first epoch draws where DataLoader's iterator draws its own (no extra draw), kept
    after. So, as with DataLoader: re-seeding before the first epoch reproduces -- also after the loader was built,
    and a notebook cell (seed, build) run twice --, two loaders differ even zipped, a loader built anew differs
    (until session 40 the seed was read at construction: none of the three held), equal fresh generators agree."""
    state = torch.get_rng_state()

    def make(**kw):
        return FusionFlowLoader(Raw(), batch_size=4, policy=EXACT, **kw)

    try:
        torch.manual_seed(1234)
        base = iter(DataLoader(Raw(), batch_size=4))._base_seed  # DataLoader's draw, the reference
        torch.manual_seed(1234)
        a, b = make(), make()
        assert a.seed is None and b.seed is None  # not drawn before the first epoch
        xa, xb = _first(a), _first(b)
        assert a.seed == base and b.seed not in (None, base) and not torch.equal(xa, xb)
        for _ in a:  # later epochs keep it
            pass
        assert a.seed == base
        c = make()
        assert not torch.equal(_first(c), xa) and c.seed not in (a.seed, b.seed)
        late = make()
        torch.manual_seed(1234)  # after construction, before the first epoch: DataLoader reproduces, so does this
        assert torch.equal(_first(late), xa)
        torch.manual_seed(1234)
        make()
        torch.manual_seed(1234)  # the same cell run twice
        assert torch.equal(_first(make()), xa)
        torch.manual_seed(1234)
        p, q = make(), make()
        for (xp, _), (xq, _) in zip(p, q):  # both iterators made before either draws
            assert p.seed != q.seed and not torch.equal(xp, xq)
            break
        seeded = [make(generator=torch.Generator().manual_seed(77)) for _ in range(2)]
        assert torch.equal(_first(seeded[0]), _first(seeded[1])) and seeded[0].seed == seeded[1].seed != a.seed
        assert make(seed=5, generator=torch.Generator().manual_seed(77)).seed == 5
    finally:
        torch.set_rng_state(state)


def test_a_seeded_script_repeats_its_loaders_seeds_and_two_loaders_differ():
    """Launches of one script calling torch.manual_seed(1234) draw the same two loaders' seeds, different from each
    other; a launch seeded 99 gets others."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fusionflow.loader import FusionFlowLoader\n"
        "from fusionflow.tools.synthetic import make_jpegs\n"
        "torch.manual_seed(int(sys.argv[1]))\n"
        "loaders = [FusionFlowLoader([(j, 0) for j in make_jpegs(2, 16, 17)], policy='default') for _ in range(2)]\n"
        "print([next(iter(ld)) and ld.seed for ld in loaders])"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def launch(seed):
        cmd = [sys.executable, "-c", code, str(seed)]
        return eval(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root, timeout=120).stdout)

    first, again, other = launch(1234), launch(1234), launch(99)
    assert first == again and first[0] != first[1]
    assert set(other).isdisjoint(first)


def test_seed_default_does_not_consume_torch_rng():
    """Building draws nothing; an epoch draws what DataLoader's iterator draws (its base seed) and no more."""
    torch.manual_seed(5)
    for _ in DataLoader(Raw(), batch_size=4):
        pass
    expected = torch.rand(3)
    torch.manual_seed(5)
    for _ in FusionFlowLoader(Raw(), batch_size=4, policy=EXACT):
        pass
    assert torch.equal(torch.rand(3), expected)


def test_launches_without_manual_seed_differ():
    """A fresh process (torch seeds itself from the OS) draws a fresh seed; DataLoader's base seed does too."""
    import subprocess
    import sys

    code = (
        "from fusionflow.loader import FusionFlowLoader\n"
        "from fusionflow.tools.synthetic import make_jpegs\n"
        "ld = FusionFlowLoader([(j, 0) for j in make_jpegs(2, 16, 17)], policy='default')\n"
        "next(iter(ld))\n"
        "print(ld.seed)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seeds = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
        for _ in range(2)
    }
    assert len(seeds) == 2


def test_a_torchvision_imagefolder_with_its_transform_is_the_whole_change(tmp_path, caplog):
    """torchvision's train.py passes ImageFolder(root, preset) to DataLoader: FusionFlowLoader given the
    same object reads the same files in the same order and augments with the transform as policy."""
    import torchvision

    from fusionflow import policy_from_transform

    for k, data in enumerate(make_jpegs(10, 60, 140, seed=5)):
        os.makedirs(tmp_path / f"c{k % 3}", exist_ok=True)
        (tmp_path / f"c{k % 3}" / f"{k}.jpg").write_bytes(data)
    tf = v2.Compose([v2.RandomResizedCrop(48), v2.RandomHorizontalFlip(), v2.TrivialAugmentWide(), v2.PILToTensor()])
    ds = torchvision.datasets.ImageFolder(str(tmp_path), tf)
    with pytest.warns(UserWarning, match="augmenting with its transform"):  # shown with no logging set up
        loader = FusionFlowLoader(ds, batch_size=4, num_workers=1, seed=2)
    assert loader.dataset is ds and loader.policy == policy_from_transform(tf)
    with loader:
        got = [(x.shape, y.tolist()) for x, y in loader]
    assert [y for _, ys in got for y in ys] == [t for _, t in ds.samples]
    assert all(shape[1:] == (3, 48, 48) for shape, _ in got)
    ds.target_transform = lambda t: t + 1
    with pytest.raises(ValueError, match="target_transform"):
        FusionFlowLoader(ds, batch_size=4)
    ds.target_transform, ds.transform = None, v2.Compose([v2.ColorJitter(0.4), v2.PILToTensor()])
    with pytest.raises(ValueError, match="transform 0 .*ColorJitter"):
        FusionFlowLoader(ds, batch_size=4)


def _folder(tmp_path, n=9):
    for k, data in enumerate(make_jpegs(n, 60, 140, seed=5)):
        os.makedirs(tmp_path / f"c{k % 3}", exist_ok=True)
        (tmp_path / f"c{k % 3}" / f"{k}.jpg").write_bytes(data)
    return str(tmp_path)


def test_a_subset_of_a_torchvision_imagefolder_is_adopted_with_its_indices(tmp_path):
    """Subset(ImageFolder(root, transform)) (a train/val split) ran the transform in the dataset, then the default
    policy on its output: 224 px out of a 32 px transform. Now the folder is adopted under the same indices."""
    import torchvision

    tf = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor()])
    split = torch.utils.data.Subset(torchvision.datasets.ImageFolder(_folder(tmp_path), tf), [7, 1, 4, 2, 8])
    want = [(x.shape, y.tolist()) for x, y in DataLoader(split, batch_size=2)]
    with pytest.warns(UserWarning, match="augmenting with its transform"):
        loader = FusionFlowLoader(split, batch_size=2)
    assert loader.dataset is split
    with loader:
        assert [(x.shape, y.tolist()) for x, y in loader] == want


def test_a_torchvision_folder_with_a_file_gone_since_its_scan_fails_at_that_sample_not_at_construction(tmp_path):
    """A file listed by torchvision's ImageFolder and removed (or a dangling link) failed the loader's construction
    with a bare FileNotFoundError, where DataLoader fails at that sample and on_error="skip" could have skipped it.
    Now the sample fails at its read: skipped and counted, or raised naming its index and path."""
    import torchvision

    tf = v2.Compose([v2.RandomResizedCrop(32), v2.PILToTensor()])
    folder = torchvision.datasets.ImageFolder(_folder(tmp_path), tf)  # adopted: its files read by FusionFlow
    gone = folder.samples[4][0]
    os.remove(gone)
    with pytest.warns(UserWarning, match="on_error='skip'|augmenting with its transform"):
        with FusionFlowLoader(folder, batch_size=3, num_workers=1, on_error="skip") as loader:
            delivered = [i for _, y in loader for i in y.tolist()]
    assert len(delivered) == len(folder) - 1 and loader.stats.skipped == 1
    with pytest.warns(UserWarning, match="augmenting with its transform"):
        loader = FusionFlowLoader(folder, batch_size=3, num_workers=1)
    with loader, pytest.raises(SampleError, match=f"sample 4 .*{os.path.basename(gone)}"):
        list(loader)


def test_an_adopted_folder_s_transform_set_later_is_refused_at_iter_not_ignored(tmp_path):
    """Progressive resizing by `loader.dataset.transform = ...` between epochs: the loader runs the policy it read
    at construction, so a transform that reads as another policy is refused by name at iter() (it was ignored
    silently); the same transform made again goes on."""
    import torchvision

    def tf(size):
        return v2.Compose([v2.RandomResizedCrop(size), v2.PILToTensor()])

    split = torch.utils.data.Subset(torchvision.datasets.ImageFolder(_folder(tmp_path), tf(16)), [0, 3, 5, 6])
    with pytest.warns(UserWarning, match="augmenting with its transform"):
        loader = FusionFlowLoader(split, batch_size=2)
    with loader:
        assert [x.shape[-1] for x, _ in loader] == [16, 16]
        split.dataset.transform = tf(16)  # made again, the same policy
        assert [x.shape[-1] for x, _ in loader] == [16, 16]
        split.dataset.transform = tf(24)
        with pytest.raises(ValueError, match=r"loader.dataset.transform changed .*Build a new FusionFlowLoader"):
            iter(loader)
        split.dataset.transform = None
        with pytest.raises(ValueError, match=r"changed since the loader was built \(to None\)"):
            iter(loader)
        split.dataset.transform, split.dataset.target_transform = tf(16), lambda t: t + 100
        with pytest.raises(ValueError, match=r"target_transform was set after the loader was built"):
            iter(loader)


def test_a_torchvision_folder_s_transform_that_would_run_before_fusionflow_s_is_refused(tmp_path):
    """Each of these ran the folder's transform in the dataset and FusionFlow's policy on its output (cropped
    twice), or skipped a subclass's own __getitem__, silently."""
    import torchvision

    tf = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor()])
    root = _folder(tmp_path)

    class WithPaths(torchvision.datasets.ImageFolder):
        def __getitem__(self, index):
            return (*super().__getitem__(index), self.samples[index][0])

    with pytest.raises(ValueError, match="ImageFolder with a transform, and policy=: .*augmenting twice"):
        FusionFlowLoader(torchvision.datasets.ImageFolder(root, tf), batch_size=2, policy="default")
    as_rgb = torchvision.datasets.ImageFolder(root, v2.Lambda(lambda im: im.convert("RGB")))  # a conversion: read
    with FusionFlowLoader(as_rgb, batch_size=3, policy=EXACT) as loader:  # through it, as it was
        assert next(iter(loader))[0].shape == (3, 3, 24, 24)
    with pytest.raises(ValueError, match="WithPaths with its own __getitem__ and a transform"):
        FusionFlowLoader(WithPaths(root, tf), batch_size=2)
    both = torch.utils.data.ConcatDataset([torchvision.datasets.ImageFolder(root, tf)] * 2)
    with pytest.raises(ValueError, match="ConcatDataset holding a torchvision ImageFolder with a transform"):
        FusionFlowLoader(both, batch_size=2, policy="default")
    with FusionFlowLoader(WithPaths(root), batch_size=3, policy=EXACT) as loader:  # no transform: read as it is
        images, labels, paths = next(iter(loader))
        assert images.shape == (3, 3, 24, 24) and len(paths) == 3 and paths[0].endswith(".jpg")
    with pytest.raises(TypeError, match=r"policy=fusionflow.policy_from_transform\(it\)"):
        FusionFlowLoader(WithPaths(root), batch_size=2, policy=tf)


# ---------------------------------------------------------------- DataLoader's whole signature
def test_every_dataloader_argument_is_taken_with_dataloaders_default():
    """A script's DataLoader(...) call, any keyword of it, works with FusionFlowLoader unchanged."""
    import inspect

    ours = inspect.signature(FusionFlowLoader.__init__).parameters
    for name, param in inspect.signature(DataLoader.__init__).parameters.items():
        assert name in ours, f"DataLoader's {name}= is not taken"
        if param.default is not inspect.Parameter.empty and name != "batch_size":
            assert ours[name].default == param.default, name
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:  # positional where DataLoader's is
            assert ours[name].kind is param.kind, name


@pytest.mark.parametrize("num_workers", [0, 2])
def test_in_order_and_pin_memory_device_are_taken_as_dataloader_takes_them(num_workers):
    gen = torch.Generator().manual_seed(5)
    ff = FusionFlowLoader(
        Raw(),
        batch_size=6,
        num_workers=num_workers,
        policy=EXACT,
        seed=3,
        in_order=False,
        pin_memory_device="",
        generator=gen,
        shuffle=True,
    )
    assert ff.in_order is False and ff.pin_memory_device == "" and ff.generator is gen
    reference = DataLoader(
        Torchvision(EXACT, seed=3), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    for (x, y), (rx, ry) in zip(ff, reference, strict=True):  # in order: a permitted order under in_order=False
        assert torch.equal(y, ry) and torch.equal(x, rx)


def test_pin_memory_device_is_ignored_with_dataloaders_deprecation_and_bad_types_are_refused(monkeypatch):
    from fusionflow.runtime import host

    monkeypatch.setattr(host.torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="pin_memory_device='cuda:0' is deprecated in DataLoader and ignored"):
        loader = FusionFlowLoader(Raw(), batch_size=6, policy=EXACT, pin_memory=True, pin_memory_device="cuda:0")
    assert loader.pin_memory_device == "cuda:0"
    with pytest.raises(TypeError, match="in_order=1 must be True or False"):
        FusionFlowLoader(Raw(), batch_size=6, policy=EXACT, in_order=1)
    with pytest.raises(TypeError, match="pin_memory_device=0 must be a str"):
        FusionFlowLoader(Raw(), batch_size=6, policy=EXACT, pin_memory_device=0)


# ---------------------------------------------------------------- the workers as DataLoader's
def _record_worker(worker_id):
    """worker_init_fn: what DataLoader's worker has set up by then (its info, its RNGs' first draws)."""
    import json
    import random

    from torch.utils.data import get_worker_info

    info = get_worker_info()
    state = [info.id, info.num_workers, info.seed, type(info.dataset).__name__, torch.initial_seed()]
    state += [random.random(), float(np.random.random()), float(torch.rand(()))]
    with open(os.path.join(os.environ["FF_TEST_DIR"], f"{os.getpid()}-{worker_id}.json"), "w") as f:
        json.dump(state, f)


class WorkerTagged(Raw):
    """Each sample's target: the id of the worker that read it (get_worker_info() in the dataset), -1 in
    the main process."""

    def __getitem__(self, i):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return JPEGS[i], -1 if info is None else info.id


def _as_list(batch):
    return batch


def _records(directory) -> list:
    import json

    found = sorted(json.load(open(os.path.join(directory, n))) for n in os.listdir(directory))
    for n in os.listdir(directory):
        os.remove(os.path.join(directory, n))
    return found


@pytest.mark.parametrize("context", [None, "spawn"])
def test_workers_are_seeded_and_described_as_dataloaders_are(tmp_path, monkeypatch, context):
    """get_worker_info() in worker_init_fn and in the dataset, and the workers' Python/NumPy/torch RNGs, as
    DataLoader's, epoch after epoch (its workers restart each epoch with a new base seed). Spawned workers, one epoch:
    each of its 4 workers imports torch anew (the suite's slowest test with two)."""
    monkeypatch.setenv("FF_TEST_DIR", str(tmp_path))
    kwargs = dict(batch_size=6, num_workers=2, shuffle=True, worker_init_fn=_record_worker)
    kwargs.update(multiprocessing_context=context)
    ff = FusionFlowLoader(WorkerTagged(), policy=EXACT, generator=torch.Generator().manual_seed(7), **kwargs)
    dl = DataLoader(WorkerTagged(), generator=torch.Generator().manual_seed(7), collate_fn=_as_list, **kwargs)
    for epoch in range(2 if context is None else 1):
        tags = torch.cat([y for _, y in ff])
        ours = _records(tmp_path)
        list(dl)
        assert ours == _records(tmp_path), f"epoch {epoch}"
        assert len(ours) == 2 and ours[0][:2] == [0, 2] and ours[0][3] == "WorkerTagged"
        assert set(tags.tolist()) <= {0, 1} and len(tags) == len(JPEGS)
    inline = FusionFlowLoader(WorkerTagged(), batch_size=6, policy=EXACT)  # in the main process: None
    assert set(torch.cat([y for _, y in inline]).tolist()) == {-1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_is_a_list_as_dataloaders_is(num_workers):
    """default_collate makes a list of (image, target) tuples' columns: scripts assign into it."""
    ff = next(iter(FusionFlowLoader(Raw(), batch_size=6, num_workers=num_workers, policy=EXACT, seed=3)))
    dl = next(iter(DataLoader(Torchvision(EXACT, seed=3), batch_size=6)))
    assert type(ff) is type(dl) is list and len(ff) == len(dl) == 2
    ff[0] = ff[0].float()  # e.g. batch[0] = batch[0].cuda(non_blocking=True)


# ---------------------------------------------------------------- a sample's exception, as DataLoader raises it
class DatasetOwnError(Exception):
    """A training script's own exception class."""


class TwoArgError(Exception):
    def __init__(self, code, detail):
        super().__init__(code, detail)


class FinalError(Exception):
    """A class that refuses subclasses: raised as a plain SampleError."""

    def __init_subclass__(cls, **kwargs):
        raise TypeError("FinalError cannot be subclassed")


class Failing(Raw):
    def __init__(self, exc):
        self.exc = exc

    def __getitem__(self, i):
        if i == 7:
            raise self.exc
        return super().__getitem__(i)


def _dataloader_raises(dataset, num_workers, monkeypatch):
    """The type of what DataLoader raises over `dataset` (its workers shut down before this returns). After a
    worker's exception torch's workers miss the shutdown's stop message (pytorch/pytorch#39570): the shutdown
    joins each for MP_STATUS_CHECK_INTERVAL (5 s) and then terminates it -- 10 s a call of nothing but waiting,
    shortened here (what it raises does not depend on it)."""
    import gc

    import torch.utils.data._utils as dataloader_utils

    monkeypatch.setattr(dataloader_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    kind = None
    try:
        list(DataLoader(dataset, batch_size=6, num_workers=num_workers, collate_fn=_as_list))
    except Exception as e:  # (e and its traceback, which holds the iterator, go at the block's end)
        kind = type(e)
    gc.collect()  # the iterator's finalizer stops the workers
    return kind


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(2, "No such file", "/data/7.jpg"),
        KeyError("label"),
        DatasetOwnError("bad"),
        TwoArgError(3, "x"),
        StopIteration("a next() on an exhausted iterator in __getitem__"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_samples_exception_is_raised_as_its_own_type_too(num_workers, exc, monkeypatch):
    """DataLoader re-raises a worker's exception as its type, made from one message (RuntimeError where the
    type cannot be): `except FileNotFoundError:` catches it. Here it is that type and a SampleError (the worker's
    traceback in its message), at the same batch, with the exception's attributes (errno, filename); a plain
    SampleError where DataLoader's is a RuntimeError, and never a StopIteration (DataLoader's then ends the
    epoch early, silently: ours raises); pickled, a plain SampleError."""
    import pickle

    from fusionflow.errors import SampleError

    if num_workers and not isinstance(exc, StopIteration):  # DataLoader's workers (without: the original object)
        assert issubclass(
            _dataloader_raises(Failing(exc), num_workers, monkeypatch), type(exc) if exc.args[0] != 3 else RuntimeError
        )
    combined = not isinstance(exc, (TwoArgError, StopIteration))
    loader = FusionFlowLoader(Failing(exc), batch_size=6, num_workers=num_workers, policy=EXACT, seed=3)
    it = iter(loader)
    next(it)  # samples 0-5
    with pytest.raises(type(exc) if combined else SampleError) as caught:
        next(it)
    err = caught.value
    assert isinstance(err, type(exc)) == combined and not isinstance(err, StopIteration)
    if isinstance(exc, OSError):
        assert (err.errno, err.filename) == (2, "/data/7.jpg")
    assert isinstance(err, SampleError) and err.index == 7 and err.exc_type == type(exc).__name__
    assert f"sample 7 failed: {type(exc).__name__}" in str(err) and "Original traceback" in str(err)
    assert type(pickle.loads(pickle.dumps(err))) is SampleError
    loader.close()


def test_an_exception_class_that_cannot_be_combined_is_a_plain_sample_error():
    from fusionflow.errors import SampleError

    loader = FusionFlowLoader(Failing(FinalError("s")), batch_size=8, num_workers=2, policy=EXACT, seed=3)
    with pytest.raises(SampleError, match="FinalError: s") as caught:
        list(loader)
    assert type(caught.value) is SampleError


def test_attributes_a_script_reads_are_dataloaders():
    """batch_size is None beside a batch_sampler, collate_fn is default_collate when none is given, and an
    epoch's iterator has a length: as DataLoader's."""
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(len(JPEGS))), 4, False)
    for kwargs in ({"batch_size": 6}, {"batch_sampler": batches}, {"batch_size": 6, "collate_fn": _as_list}):
        ff, dl = FusionFlowLoader(Raw(), policy=EXACT, **kwargs), DataLoader(Raw(), **kwargs)
        assert (ff.batch_size, ff.collate_fn, ff.drop_last) == (dl.batch_size, dl.collate_fn, dl.drop_last)
        it = iter(ff)
        assert len(it) == len(iter(dl)) == len(ff)
        it.close()


# ---------------------------------------------------------------- samples that are not (image, target) pairs
class Triples(Raw):
    """(image, class, index): a third column, as noisy-label and contrastive scripts return."""

    def __getitem__(self, i):
        return JPEGS[i], i % NUM_CLASSES, f"id{i}"


class TorchvisionTriples(Torchvision):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y, f"id{i}"


class BareImages(Raw):
    def __getitem__(self, i):
        return JPEGS[i]


class TorchvisionBare(Torchvision):
    def __getitem__(self, i):
        return super().__getitem__(i)[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_samples_of_three_columns_and_bare_images_are_batched_as_dataloader_batches_them(num_workers):
    for ours, reference in ((Triples(), TorchvisionTriples(EXACT, seed=3)), (BareImages(), TorchvisionBare(EXACT, 3))):
        ff = list(FusionFlowLoader(ours, batch_size=6, num_workers=num_workers, policy=EXACT, seed=3))
        dl = list(DataLoader(reference, batch_size=6))
        assert len(ff) == len(dl) == 4
        for got, want in zip(ff, dl):
            assert type(got) is type(want)
            if isinstance(want, torch.Tensor):  # bare images: the images tensor alone
                assert torch.equal(got, want)
                continue
            assert len(got) == len(want) == 3 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[2] == want[2]  # strings: as default_collate gives them


def test_a_collate_fn_gets_samples_shaped_as_the_dataset_gave_them():
    seen = []

    def keep(batch):
        seen.append([tuple(type(v).__name__ for v in (s if isinstance(s, tuple) else (s,))) for s in batch])
        return len(batch)

    assert list(FusionFlowLoader(Triples(), batch_size=8, policy=EXACT, collate_fn=keep)) == [8, 8, 5]
    assert seen[0][0] == ("Tensor", "int", "str")
    assert list(FusionFlowLoader(BareImages(), batch_size=8, policy=EXACT, collate_fn=keep)) == [8, 8, 5]
    assert seen[-1][0] == ("Tensor",)


Sample = collections.namedtuple("Sample", "image label")
Sample3 = collections.namedtuple("Sample3", "image label key")


class Named(Raw):
    """Items as namedtuples (DataLoader's default_collate keeps their class: batch.label)."""

    def __init__(self, kind):
        self.kind = kind

    def __getitem__(self, i):
        return self.kind(JPEGS[i], i % NUM_CLASSES, *([i * 10] if self.kind is Sample3 else []))


class TorchvisionNamed(Torchvision):
    def __init__(self, kind, *args):
        super().__init__(*args)
        self.kind = kind

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return self.kind(x, y, *([i * 10] if self.kind is Sample3 else []))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_namedtuple_samples_are_batched_as_their_namedtuple_as_dataloader_batches_them(num_workers):
    """A namedtuple item lost its class: batch.label raised AttributeError on FusionFlow's list."""
    for kind in (Sample, Sample3):
        ff = list(FusionFlowLoader(Named(kind), batch_size=6, num_workers=num_workers, policy=EXACT, seed=3))
        dl = list(DataLoader(TorchvisionNamed(kind, EXACT, 3), batch_size=6))
        assert len(ff) == len(dl) == 4
        for got, want in zip(ff, dl):
            assert type(got) is type(want) is kind and got._fields == want._fields
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    seen = []
    list(FusionFlowLoader(Named(Sample3), batch_size=8, policy=EXACT, collate_fn=seen.extend))
    assert type(seen[0]) is Sample3 and seen[0].key == 0 and seen[1].label == 1


class WithPrefetch(Raw):
    """A dataset's own attribute named `prefetch` (a flag here): FusionFlow called it with the indices."""

    prefetch = True


class WithSizes(Raw):
    def __init__(self, sizes):
        self.sizes = sizes


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_s_own_prefetch_and_odd_sizes_are_not_taken_for_fusionflow_s(num_workers):
    """`prefetch` is ReadAhead's (read_ahead=) alone: a user's flag of that name killed every worker. `sizes` that
    are not one encoded size per sample (w, h pairs, too few, a method) failed the epoch with a bare TypeError or
    IndexError; they are now ignored with a warning naming them."""
    got = [y for _, y in FusionFlowLoader(WithPrefetch(), batch_size=6, num_workers=num_workers, policy=EXACT)]
    assert torch.cat(got).tolist() == [i % NUM_CLASSES for i in range(len(JPEGS))]
    from fusionflow.datasets import sizes
    from fusionflow.datasets.views import SplitViews

    pairs = [(64, 48)] * len(JPEGS)
    for bad, says in (
        (pairs, r"a list of shape \(21, 2\) and dtype int64, not"),
        ([10] * (len(JPEGS) - 3), r"a list of shape \(18,\)"),
        (WithSizes.__init__, "a function, not"),
        ([float("nan")] * len(JPEGS), "with negative or non-finite values"),
    ):
        for read_ahead in (None, 2):  # named as the user's class, not the loader's wrapper
            with pytest.warns(UserWarning, match=rf"WithSizes.sizes is {says}.*ignored"):
                loader = FusionFlowLoader(
                    WithSizes(bad), batch_size=6, num_workers=2, policy=EXACT, shuffle=True, read_ahead=read_ahead
                )  # fmt: skip (num_workers=0 never reads sizes)
                got = sorted(torch.cat([y for _, y in loader]).tolist())
            assert got == sorted(i % NUM_CLASSES for i in range(21))
            sizes.WARNED.clear()
    with pytest.warns(UserWarning, match="WithSizes.sizes is a function"):  # timm's AugMix views: a TypeError before
        assert not hasattr(SplitViews(WithSizes(WithSizes.__init__), 2), "sizes")
    sizes.WARNED.clear()


class Locked(Raw):
    def __init__(self):
        import threading

        self.lock = threading.Lock()


def test_a_dataset_that_cannot_be_pickled_for_spawned_workers_is_named():
    """Under spawn, the bare error named `_thread.lock`, not the dataset, nor what to do."""
    with pytest.raises(TypeError, match=r"the dataset \(Locked\) cannot be pickled .*cannot pickle '_thread.lock'"):
        list(FusionFlowLoader(Locked(), batch_size=6, num_workers=1, policy=EXACT, multiprocessing_context="spawn"))
    with pytest.raises(TypeError, match=r"the worker_init_fn \(function\) cannot be pickled .*local object"):
        list(FusionFlowLoader(Raw(), batch_size=6, num_workers=1, policy=EXACT, multiprocessing_context="spawn",
                              worker_init_fn=lambda wid: None))  # fmt: skip


class Ragged(Raw):
    def __getitem__(self, i):
        return (JPEGS[i], 0, 1) if i < 10 else (JPEGS[i], 0)


def test_a_batch_mixing_sample_shapes_is_refused():
    with pytest.raises(TypeError, match="one batch holds samples of different shapes"):
        list(FusionFlowLoader(Ragged(), batch_size=6, policy=EXACT, num_workers=1))


class OpenedInWorkers(Raw):
    """Bare images read through a handle each worker opens in worker_init_fn (get_worker_info()): dataset[0]
    cannot be read in the training process, so a sample's shape is told where it is read, not at construction."""

    handle = None

    def __getitem__(self, i):
        if self.handle is None:
            raise RuntimeError("no handle: open it in worker_init_fn")
        if i == 0 and self.handle == "skip 0":
            raise ValueError("a corrupt first file")
        return (JPEGS[i], i % NUM_CLASSES, f"id{i}") if self.handle == "skip 0" else JPEGS[i]


def _open_handle(worker_id):
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    info.dataset.handle = "skip 0" if info.dataset.skip_first else "open"


def test_sample_shapes_need_not_be_readable_at_construction():
    ds = OpenedInWorkers()
    ds.skip_first = False
    batches = list(FusionFlowLoader(ds, batch_size=6, num_workers=2, policy=EXACT, worker_init_fn=_open_handle))
    assert len(batches) == 4 and all(isinstance(b, torch.Tensor) for b in batches)  # the images alone
    ds.skip_first = True  # (image, class, id) samples, the first one corrupt: dropped, the rest delivered
    with pytest.warns(UserWarning, match="dropping sample 0"):
        kw = dict(batch_size=6, num_workers=2, policy=EXACT, worker_init_fn=_open_handle, on_error="skip")
        batches = list(FusionFlowLoader(ds, **kw))
    assert [i for _, _, ids in batches for i in ids] == [f"id{i}" for i in range(1, len(JPEGS))]


class InfoNamed(Raw):
    """Each sample's target: the class of get_worker_info().dataset where it was read."""

    def __getitem__(self, i):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return JPEGS[i], "main process" if info is None else type(info.dataset).__name__, i


def test_worker_info_names_the_users_dataset_not_the_loaders_view_of_it():
    """Read ahead (a wrapper of the loader's) and three-column samples (another): get_worker_info().dataset
    is still the dataset the script gave, as in DataLoader's workers."""
    loader = FusionFlowLoader(InfoNamed(), batch_size=6, num_workers=2, policy=EXACT, read_ahead=2)
    names = {n for _, batch_names, _ in loader for n in batch_names}
    assert names == {"InfoNamed"}


class CountingBuckets:
    """A batch sampler of its own without a batch_size: it counts its passes and shuffles buckets with torch's
    global RNG and with a generator of its own (as bucketing and curriculum samplers do)."""

    def __init__(self, n):
        import random

        self.n, self.passes, self.generator = n, 0, torch.Generator().manual_seed(9)
        self.numpy_rng, self.legacy_rng, self.python_rng = (
            np.random.default_rng(3),
            np.random.RandomState(4),
            random.Random(5),
        )

    def __iter__(self):
        self.passes += 1
        order = torch.randperm(self.n).tolist()
        sizes = torch.randint(2, 6, (self.n,), generator=self.generator).tolist()
        batches, k = [], 0
        while k < self.n:
            batches.append(order[k : k + sizes[k]])
            k += sizes[k]
        self.numpy_rng.shuffle(batches)  # the buckets' order from generators of each other kind
        self.legacy_rng.shuffle(batches)
        self.python_rng.shuffle(batches)
        yield from batches

    def __len__(self):
        return self.n  # an upper bound, as some samplers give


class SystemShuffled:
    """A batch sampler drawing from the OS's entropy (random.SystemRandom: no state to save or put back)."""

    def __init__(self):
        import random

        self.rng = random.SystemRandom()

    def __iter__(self):
        order = list(range(len(JPEGS)))
        self.rng.shuffle(order)
        return iter([order[k : k + 4] for k in range(0, len(order), 4)])


def test_a_batch_sampler_on_the_systems_entropy_is_sized_too():
    batches = list(FusionFlowLoader(Raw(), batch_sampler=SystemShuffled(), policy=EXACT))
    assert sorted(int(t) for _, y in batches for t in y) == sorted(i % NUM_CLASSES for i in range(len(JPEGS)))


def test_sizing_shared_memory_leaves_a_batch_samplers_state_and_the_rng_streams_alone():
    """Without a batch_size attribute the loader reads one pass to size shared memory; DataLoader reads none.
    That pass must not show: not in the sampler's pass count, its generator, or torch's global stream (model
    initialisation after building the loader, the epoch's order)."""
    torch.manual_seed(1)
    sampler = CountingBuckets(len(JPEGS))
    loader = FusionFlowLoader(Raw(), batch_sampler=sampler, policy=EXACT, num_workers=2)
    after = torch.rand(3)
    ours = [y.tolist() for _, y in loader]
    torch.manual_seed(1)
    reference = CountingBuckets(len(JPEGS))
    dl = DataLoader(Raw(), batch_sampler=reference, collate_fn=_as_list)
    assert torch.equal(torch.rand(3), after) and sampler.passes == 1  # the epoch's pass only
    assert ours == [[t for _, t in batch] for batch in dl]


class Wrapped:
    """A batch sampler of one's own: its random stream held a few attributes deep (a RandomSampler in an attribute
    not named `sampler`, a NumPy generator in a dict), a len() that makes a pass, an __iter__ that draws at once."""

    def __init__(self, n: int):
        self.inner = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(1))
        self.state = {"rng": np.random.default_rng(0)}

    def __iter__(self):
        cut = int(self.state["rng"].integers(2, 5))
        order = list(self.inner)
        return iter([order[k : k + cut] for k in range(0, len(order), cut)])

    def __len__(self):
        return sum(1 for _ in self)


def test_sizing_shared_memory_leaves_random_streams_held_deeper_alone():
    import weakref

    class Gone:
        pass

    sampler = Wrapped(len(JPEGS))
    sampler.inner.extra = {"proxy": weakref.proxy(Gone())}  # dead at once: looked at, it raises ReferenceError
    ours = [y.tolist() for _, y in FusionFlowLoader(Raw(), batch_sampler=sampler, policy=EXACT)]
    dl = DataLoader(Raw(), batch_sampler=Wrapped(len(JPEGS)), collate_fn=_as_list)
    assert ours == [[t for _, t in batch] for batch in dl]


def test_an_endless_batch_sampler_without_a_batch_size_is_refused_not_probed_forever(monkeypatch):
    from fusionflow.loader import batch_capacity

    class Endless:
        def __iter__(self):
            k = 0
            while True:
                yield [k % 4]
                k += 1

    monkeypatch.setattr(batch_capacity, "PROBE_BATCHES", 1000)
    with pytest.raises(ValueError, match=r"did not end within 1,000 batches .*give it a batch_size attribute"):
        FusionFlowLoader(Raw(), batch_sampler=Endless(), policy=EXACT)
    Endless.__len__ = lambda self: 10**9  # an iteration-based sampler's length: not a bound to read to
    with pytest.raises(ValueError, match=r"did not end within 1,000 batches"):
        FusionFlowLoader(Raw(), batch_sampler=Endless(), policy=EXACT)
    Endless.batch_size = 1  # what it says: sized by it, iterated as DataLoader does
    batches = FusionFlowLoader(Raw(), batch_sampler=Endless(), policy=EXACT)
    assert [y.tolist() for _, y in itertools.islice(batches, 3)] == [[0], [1], [2]]


def test_sizing_a_batch_sampler_leaves_what_it_wraps_as_it_was():
    """A batch sampler without batch_size is passed over once at construction to size shared memory, on a copy.
    The copy was shallow: a wrapped sampler's own pass counter advanced (every epoch then drew the order DataLoader
    draws one epoch later) and a wrapped index stream was used up (epoch 0 came empty, without a word)."""

    class Big(torch.utils.data.Dataset):  # what the sampler reads: shared by the copy, never copied (gigabytes)
        def __len__(self):
            return len(JPEGS)

        def __deepcopy__(self, memo):
            raise AssertionError("the dataset was copied")

    class Counting(torch.utils.data.Sampler):  # orders each pass by its own pass count (accelerate's seedable one)
        def __init__(self, data):
            self.data, self.n, self.passes = data, len(data), 0

        def __iter__(self):
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes))
            self.passes += 1
            return iter(order.tolist())

    class Chunks:  # a batch sampler of one's own, no batch_size attribute
        def __init__(self, indices):
            self.indices = indices

        def __iter__(self):
            batch = []
            for i in self.indices:
                batch.append(i)
                if len(batch) == 3:
                    yield batch
                    batch = []
            if batch:
                yield batch

    for make in (lambda: Chunks(Counting(Big())), lambda: Chunks(iter(range(len(JPEGS))))):
        ours = FusionFlowLoader(Raw(), batch_sampler=make(), policy=EXACT)
        dl = DataLoader(Raw(), batch_sampler=make(), collate_fn=_as_list)
        assert [y.tolist() for _, y in ours] == [[t for _, t in batch] for batch in dl]
    counting = Counting(Big())
    FusionFlowLoader(Raw(), batch_sampler=Chunks(counting), policy=EXACT)
    assert counting.passes == 0


def test_a_finite_batch_sampler_longer_than_the_probe_is_taken_at_its_len(monkeypatch):
    """A bucketing batch sampler over a large set (more batches than the probe's bound, a true len()) was refused as
    endless; its len() now bounds the probe, up to PROBE_BY_LEN (an endless one saying 10**9 is still refused)."""
    from fusionflow.loader import batch_capacity

    class Long:
        def __iter__(self):
            return ([k % 4] if k % 7 else [0, k % 4] for k in range(2500))

        def __len__(self):
            return 2500

    monkeypatch.setattr(batch_capacity, "PROBE_BATCHES", 1000)
    loader = FusionFlowLoader(Raw(), batch_sampler=Long(), policy=EXACT)
    assert loader.config.capacity == 2
    monkeypatch.setattr(batch_capacity, "PROBE_BY_LEN", 2000)
    with pytest.raises(ValueError, match=r"did not end within 1,000 batches"):
        FusionFlowLoader(Raw(), batch_sampler=Long(), policy=EXACT)


def test_under_ddp_a_sampler_that_gives_every_rank_the_whole_set_is_warned_about(monkeypatch):
    """torch's stock samplers under DDP (world size > 1) deal each rank the whole set: what a Lightning or
    Accelerate script gets, as they put a DistributedSampler into torch DataLoaders only. Iterating warns at the
    script's line; a DistributedSampler, a sampler of the script's own class, or one process does not. (Real
    ranks under torchrun: tests/test_timm_loader.py.)"""
    import warnings

    from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

    from fusionflow.loader import delivery

    class Halves(torch.utils.data.Sampler):  # the script's own: it may shard, not judged
        def __iter__(self):
            return iter(range(0, 8, 2))

        def __len__(self):
            return 4

    def warned(world: int, **kw) -> list:
        monkeypatch.setattr(delivery, "torch_rank_world", lambda: (1, world))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with FusionFlowLoader(Raw(), policy=EXACT, **kw) as loader:
                next(iter(loader))
        return [w for w in caught if "gives every rank the whole dataset" in str(w.message)]

    (w,) = warned(4, batch_size=4, shuffle=True)
    assert "rank 1 of 4" in str(w.message) and "RandomSampler" in str(w.message) and "read 4 times" in str(w.message)
    assert w.filename == __file__  # at the line that iterates, where Python's filter shows it once
    assert len(warned(2, batch_sampler=BatchSampler(SequentialSampler(range(8)), 4, False))) == 1
    assert warned(4, batch_size=4, sampler=DistributedSampler(Raw(), num_replicas=4, rank=1)) == []
    assert warned(4, batch_size=4, sampler=Halves()) == []

    class Sharding(BatchSampler):  # the script's own batch sampler (it may shard), over a stock sampler
        pass

    assert warned(4, batch_sampler=Sharding(SequentialSampler(range(8)), 4, False)) == []
    assert warned(1, batch_size=4, shuffle=True) == []


class Subclassed(FusionFlowLoader):
    pass


class WithItsOwnInit(FusionFlowLoader):
    def __init__(self, dataset, extra, **kw):
        super().__init__(dataset, **kw)
        self.extra = extra


def _local_collate(batch):  # module-level: pickles by name
    return default_collate(batch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_pickles_and_deep_copies_as_a_new_loader_of_the_same_arguments(num_workers):
    """DataLoader pickles; FusionFlowLoader raised "cannot pickle 'weakref.ReferenceType' object" (and a deep copy
    copied its running parts). A copy is a new loader of the same arguments: the same batches from a fresh start,
    its own workers; an argument that does not pickle is named by pickle, as with DataLoader."""
    import copy
    import pickle

    kw = dict(batch_size=4, shuffle=True, num_workers=num_workers, policy=EXACT, seed=3, collate_fn=_local_collate)
    loader = FusionFlowLoader(Raw(), generator=torch.Generator().manual_seed(5), persistent_workers=num_workers > 0,
                              **kw)  # fmt: skip
    thawed = pickle.loads(pickle.dumps(loader))
    first = [x.clone() for x, _ in loader]  # the original runs (and keeps its workers) meanwhile
    twin = copy.deepcopy(loader)  # taken after an epoch: a fresh loader, its generator as the epoch left it
    assert isinstance(thawed, FusionFlowLoader) and thawed.batch_size == 4 and thawed.num_workers == num_workers
    again = [x for x, _ in thawed]
    assert len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(again, first))
    assert [x.shape[0] for x, _ in twin] == [x.shape[0] for x in first]
    assert twin.generator is not loader.generator and twin.dataset is not loader.dataset
    for other in (thawed, twin, loader):
        other.close()
    tagged = Subclassed(Raw(), policy=EXACT)
    tagged.tag = "run-7"  # an attribute the script set: it comes along, as a DataLoader's does
    sub = pickle.loads(pickle.dumps(tagged))  # its class kept
    assert type(sub) is Subclassed and sub.tag == "run-7" and copy.copy(tagged).tag == "run-7"
    sub.close()
    with pytest.raises(TypeError, match=r"WithItsOwnInit cannot be pickled or copied .* give it a __reduce__"):
        pickle.dumps(WithItsOwnInit(Raw(), "extra", policy=EXACT))  # refused when pickled, not when loaded
    with pytest.raises((AttributeError, pickle.PicklingError, TypeError), match="local"):
        pickle.dumps(FusionFlowLoader(Raw(), collate_fn=lambda b: b, policy=EXACT))
