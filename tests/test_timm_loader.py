"""fusionflow.timm.create_loader against timm's own create_loader: the calls timm's train.py makes (its
create_dataset, mixup collate, AugMix splits, model dtype, losses), the batch-level semantics (timm's
FastCollateMixup + PrefetchLoader given the same random draws), every sample once per epoch, the
samplers timm builds, and the refusals at build time that name the argument."""

import dataclasses
import random

import numpy as np
import pytest
import torch

timm = pytest.importorskip("timm")
from timm.data import AugMixDataset, FastCollateMixup, Mixup, create_dataset  # noqa: E402
from timm.data import create_loader as timm_create_loader  # noqa: E402
from timm.data.loader import PrefetchLoader  # noqa: E402
from timm.loss import JsdCrossEntropy, SoftTargetCrossEntropy  # noqa: E402

from fusionflow.policy import draw  # noqa: E402
from fusionflow.timm import create_loader  # noqa: E402
from fusionflow.tools.synthetic import make_image_folder  # noqa: E402

CPU = torch.device("cpu")
IMAGENET_STD = (0.229, 0.224, 0.225)  # timm's default std
SIZE = (3, 48, 48)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """5 classes x 8 images: timm's create_dataset reads it as train.py does."""
    return make_image_folder(str(tmp_path_factory.mktemp("timm5")), 5, 8, min_side=60, max_side=200, seed=5)


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """24 classes of one image each: a sample's target names it (exact sample sets)."""
    return make_image_folder(str(tmp_path_factory.mktemp("timm24")), 24, 1, min_side=60, max_side=160, seed=6)


def train_dataset(root):
    return create_dataset("", root=root, split="train", is_training=True)


def steps(loader, model, loss_fn, n=3, dtype=None):
    """A few training steps, as train.py's train_one_epoch takes them with the prefetcher on."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == n:
            break
        out = model(x if dtype is None else x.to(dtype))
        loss = loss_fn(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == n and all(np.isfinite(losses))
    return losses


def tiny_model(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=4), torch.nn.Flatten(), torch.nn.LazyLinear(5)).to(dtype)


def test_train_py_example_flags_with_the_prefetcher(folder):
    """--mixup 0.2 --aa rand-m9-mstd0.5-inc1 --reprob 0.25 --remode pixel, prefetcher on: train.py
    passes FastCollateMixup as collate_fn and trains on soft targets with SoftTargetCrossEntropy."""
    mixup = FastCollateMixup(mixup_alpha=0.2, label_smoothing=0.1, num_classes=5)
    loader = create_loader(
        train_dataset(folder), SIZE, 8, is_training=True, re_prob=0.25, re_mode="pixel",
        auto_augment="rand-m9-mstd0.5-inc1", interpolation="random", collate_fn=mixup, num_workers=2, device=CPU,
    )  # fmt: skip
    with loader.fusionflow:
        model = tiny_model()
        model(torch.zeros(1, *SIZE))
        steps(loader, model, SoftTargetCrossEntropy())
        x, y = next(iter(loader))
        assert x.dtype == torch.float32 and x.shape == (8, *SIZE) and y.shape == (8, 5)
        assert torch.allclose(y.sum(1), torch.ones(8)) and loader.mixup_enabled
        loader.mixup_enabled = False  # train.py at --mixup-off-epoch
        assert not mixup.mixup_enabled and not loader.mixup_enabled
        x, y = next(iter(loader))
        assert sorted(y.max(1).values.tolist()) == [pytest.approx(0.92)] * 8  # smoothed one-hot, unmixed
        assert len(loader) == 5


def test_train_py_without_the_prefetcher_applies_mixup_in_the_loop(folder):
    loader = create_loader(
        train_dataset(folder), SIZE, 8, is_training=True, re_prob=0.25, re_mode="pixel",
        auto_augment="rand-m9-mstd0.5-inc1", use_prefetcher=False, num_workers=2, device=CPU,
    )  # fmt: skip
    mixup = Mixup(mixup_alpha=0.2, num_classes=5)
    with loader.fusionflow:
        x, y = next(iter(loader))
        assert x.dtype == torch.float32 and x.device == CPU and y.dtype == torch.int64
        assert float(x.min()) < 0 and float(x.max()) < 8  # normalised (erased with normal noise), not 0..255
        x, y = mixup(x, y)
        assert y.shape == (8, 5)


def test_aug_splits_with_jsd_loss_and_bfloat16(folder):
    """--aug-splits 3 --jsd-loss --model-dtype bfloat16: train.py wraps the dataset in AugMixDataset."""
    ds = AugMixDataset(train_dataset(folder), num_splits=3)
    loader = create_loader(
        ds, SIZE, 8, is_training=True, auto_augment="augmix-m3-w3", num_aug_splits=3, re_prob=0.25, re_split=True,
        num_workers=2, device=CPU, img_dtype=torch.bfloat16,
    )  # fmt: skip
    assert loader.batch_size == 8  # create_loader's, as timm's loader says it (its views are built as batches)
    with loader.fusionflow:
        x, y = next(iter(loader))
        assert x.shape == (24, *SIZE) and x.dtype == torch.bfloat16 and y.shape == (24,)
        assert torch.equal(y[:8], y[8:16]) and torch.equal(y[:8], y[16:])  # timm's fast collate order
        model = tiny_model(torch.bfloat16)
        model(torch.zeros(1, *SIZE, dtype=torch.bfloat16))
        steps(loader, model, JsdCrossEntropy(num_splits=3, smoothing=0.1))


def test_aug_splits_without_the_prefetcher_are_a_list_of_views_as_timm_s_default_collate(folder):
    kw = dict(is_training=True, auto_augment="augmix-m3-w3", num_aug_splits=3, use_prefetcher=False, device=CPU)
    got = {}
    for name, make in (("ours", create_loader), ("timm", timm_create_loader)):
        loader = make(AugMixDataset(train_dataset(folder), num_splits=3), SIZE, 4, num_workers=0, **kw)
        got[name] = next(iter(loader))
        if name == "ours":
            loader.close()
    (x, y), (tx, ty) = got["ours"], got["timm"]
    assert isinstance(x, list) and isinstance(tx, list) and len(x) == len(tx) == 3
    assert all(v.shape == t.shape == (4, *SIZE) and v.dtype == t.dtype for v, t in zip(x, tx))
    assert y.shape == ty.shape == (4,)


def test_aug_splits_with_a_collate_fn_of_the_script_s_own_are_refused_naming_it(folder):
    """timm's collate_fn gets a tuple of views per sample; FusionFlow delivers each view as a sample, so a script's
    own collate_fn would see another structure (and the list of views was cut from what it returned)."""

    def my_collate(batch):
        return batch

    kw = dict(is_training=True, auto_augment="augmix-m3-w3", num_aug_splits=2, use_prefetcher=False, device=CPU)
    with pytest.raises(ValueError, match=r"collate_fn=...\): with num_aug_splits"):
        create_loader(AugMixDataset(train_dataset(folder), num_splits=2), SIZE, 4, collate_fn=my_collate, **kw)


def test_views_share_the_crop_and_the_first_is_clean(folder):
    ds = AugMixDataset(train_dataset(folder), num_splits=3)
    loader = create_loader(
        ds, SIZE, 4, is_training=True, auto_augment="augmix-m3-w3", num_aug_splits=3, gaussian_blur_prob=1.0, device=CPU
    )
    policy = loader.fusionflow.policy
    assert policy.views == 3 and policy.blur.p == 1.0
    for sample in range(6):
        views = [draw(policy, 1, 0, sample * 3 + v) for v in range(3)]
        assert len({d.crop_u for d in views}) == 1 and len({d.flip for d in views}) == 1
        assert views[0].mix is None and not views[0].steps and views[1].mix is not None and views[2].mix is not None
        assert views[0].blur is None and views[1].blur is not None  # timm's secondary (the blur too) skips view 0
        assert views[1].mix != views[2].mix
    plain = draw(policy.__class__(**{**policy.__dict__, "views": 1}), 1, 0, 7)
    assert plain.crop_u != draw(policy, 1, 0, 7).crop_u  # a view's crop is its sample's, not its own index's
    with loader.fusionflow:
        x, _ = next(iter(loader))
    assert x.shape == (12, *SIZE) and not torch.equal(x[:4], x[4:8])


def test_mixup_and_erasing_equal_timm_s_collate_and_prefetcher_given_the_same_draws():
    """The batch-level work against timm's own objects on the same uint8 batch and the same numpy /
    random state: FastCollateMixup then PrefetchLoader's normalisation and RandomErasing. Equal but
    for timm's rounding of a mixed image to uint8 (half a grey level, in normalised units)."""
    from timm.data.random_erasing import RandomErasing

    from fusionflow.timm.batch import BatchPrep

    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (8, *SIZE), dtype=np.uint8))
    targets = torch.arange(8) % 5
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for mode, cutmix in (("batch", 0.0), ("pair", 0.0), ("elem", 0.0), ("batch", 1.0), ("elem", 1.0)):
        kw = dict(mixup_alpha=0.2, cutmix_alpha=cutmix, mode=mode, label_smoothing=0.1, num_classes=5)
        np.random.seed(3), random.seed(4), torch.manual_seed(5)  # mixup, erasing's rectangles, its noise
        out, want_y = FastCollateMixup(**kw)([(img.numpy(), int(t)) for img, t in zip(images, targets)])
        prefetch = PrefetchLoader([(out, want_y)], mean=mean, std=std, device=CPU, re_prob=0.5, re_mode="pixel")
        want_x, want_y = next(iter(prefetch))
        np.random.seed(3), random.seed(4), torch.manual_seed(5)  # mixup, erasing's rectangles, its noise
        erasing = RandomErasing(0.5, mode="pixel", device=CPU)
        prep = BatchPrep(mean, std, torch.float32, CPU, True, FastCollateMixup(**kw), erasing)
        got_x, got_y = prep(images.clone(), targets.clone())
        torch.testing.assert_close(got_y, want_y)
        half_level = 0.5 / 255 / min(std) + 1e-5
        assert float((got_x - want_x).abs().max()) <= half_level, mode


def test_every_sample_once_per_epoch_and_eval_in_order(singles):
    ds = train_dataset(singles)
    loader = create_loader(ds, SIZE, 5, is_training=True, num_workers=2, device=CPU, auto_augment="rand-m9")
    with loader.fusionflow:
        for _ in range(2):
            seen = [int(t) for _, y in loader for t in y]
            assert len(seen) == 20 and len(set(seen)) == 20  # drop_last for training, as timm
    evaluation = create_loader(ds, SIZE, 5, is_training=False, num_workers=1, device=CPU, crop_pct=0.9)
    with evaluation.fusionflow:
        batches = list(evaluation)
        seen = [int(t) for _, y in batches for t in y]
        assert all(x.dtype == torch.float32 and x.shape[1:] == SIZE for x, _ in batches)
    assert seen == [int(ds.reader.samples[i][1]) for i in range(24)]


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_training=False, crop_pct=0.875, interpolation="bilinear"),
        dict(is_training=False, crop_pct=0.9, crop_mode="squash", interpolation="bicubic"),
        dict(is_training=True, no_aug=True),  # timm squashes to the input size (Resize((h, w))), shuffled
        dict(is_training=False, crop_pct=0.9, crop_mode="border", crop_border_pixels=2, interpolation="bicubic"),
    ],
)
def test_deterministic_batches_match_timm_s_loader_within_the_fast_mode_bound(singles, kw):
    """Samples matched by target (one image per class), so a shuffled order compares too."""
    kw = dict(kw, num_workers=0, device=CPU)
    ours = create_loader(create_dataset("", root=singles, split="train"), SIZE, 8, **kw)
    theirs = timm_create_loader(create_dataset("", root=singles, split="train"), SIZE, 8, **kw)

    def by_target(loader):
        batches = list(loader)
        assert all(x.dtype == torch.float32 and x.shape[1:] == SIZE for x, _ in batches)
        return {int(t): x[i] for x, y in batches for i, t in enumerate(y)}

    mine, timms = by_target(ours), by_target(theirs)
    assert len(mine) == 24 and mine.keys() == timms.keys()
    for t in mine:
        assert float((mine[t] - timms[t]).abs().median()) < 0.05, t  # normalised units: fast mode's resize


def test_a_collate_fn_of_the_script_s_own_gets_uint8_and_its_batch_is_normalised_as_timm_s(folder):
    """With the prefetcher, timm's collate_fn gets uint8 samples and the prefetcher normalises what it returns;
    a script's own wrapper of fast_collate must see the same here, not samples the workers normalised."""
    from timm.data.loader import fast_collate

    seen = set()

    def my_collate(batch):
        seen.add(batch[0][0].dtype)
        return fast_collate(batch)

    got = {}
    for name, make in (("ours", create_loader), ("timm", timm_create_loader)):
        kw = dict(is_training=False, num_workers=0, device=CPU, collate_fn=my_collate)
        loader = make(create_dataset("", root=folder, split="train"), SIZE, 8, **kw)
        got[name] = next(iter(loader))
        close = getattr(loader, "fusionflow", None)
        if close is not None:
            close.close()
    assert seen == {torch.uint8}
    (x, y), (tx, ty) = got["ours"], got["timm"]
    assert x.dtype == tx.dtype == torch.float32 and torch.equal(y, ty)
    assert float((x - tx).abs().median()) < 0.05 and abs(float(x.mean() - tx.mean())) < 0.05  # normalised both


@pytest.mark.parametrize("kind", ["torch/image_folder", "FakeData"])
def test_timm_s_torch_datasets_load_as_timm_loads_them(singles, kind):
    """train.py's --dataset torch/<name>: create_dataset gives torchvision's own dataset (no timm reader): a
    folder's files, or PIL images in memory (torchvision's FakeData standing in for CIFAR10)."""
    import torchvision

    def make():
        if kind == "FakeData":
            return torchvision.datasets.FakeData(size=12, image_size=(3, 60, 80), num_classes=4, random_offset=3)
        return create_dataset(kind, root=singles, split="train", is_training=False)

    kw = dict(is_training=False, num_workers=0, device=CPU, interpolation="bicubic")
    ours, theirs = create_loader(make(), SIZE, 8, **kw), timm_create_loader(make(), SIZE, 8, **kw)
    with ours.fusionflow:
        mine = list(ours)
    timms = list(theirs)
    assert [y.tolist() for _, y in mine] == [y.tolist() for _, y in timms]
    for (x, _), (tx, _) in zip(mine, timms):
        assert x.shape == tx.shape and float((x - tx).abs().median()) < 0.05
    dressed = make()
    dressed.transform = torchvision.transforms.ToTensor()
    with pytest.raises(ValueError, match="with a transform: create_loader makes the augmentation"):
        create_loader(dressed, SIZE, 8, **kw)


@pytest.mark.parametrize("kind", ["torchvision", "timm"])
def test_a_dataset_class_with_its_own_getitem_is_read_through_it(singles, kind):
    """A DatasetFolder subclass (or, until session 47, a timm ImageDataset subclass) overriding __getitem__ was read
    as its files, or through its reader: its own reads (here targets moved by 10) never ran, without a word. It is
    now read item by item, as timm's loader reads it."""
    import torchvision
    from timm.data.dataset import ImageDataset

    base = torchvision.datasets.ImageFolder if kind == "torchvision" else ImageDataset

    class Shifted(base):
        def __getitem__(self, index):
            image, target = super().__getitem__(index)
            return image, target + 10

    kw = dict(is_training=False, num_workers=0, device=CPU)
    ours = create_loader(Shifted(singles), SIZE, 8, **kw)
    with ours.fusionflow:
        mine = [(x, y.tolist()) for x, y in ours]
    theirs = [(x, y.tolist()) for x, y in timm_create_loader(Shifted(singles), SIZE, 8, **kw)]
    assert [y for _, y in mine] == [y for _, y in theirs]
    assert min(min(y) for _, y in mine) >= 10
    assert all(torch.allclose(a, b, atol=1e-5) for (a, _), (b, _) in zip(mine, theirs))  # normalised floats


def test_evaluation_decodes_exactly_as_timm_and_training_fast_unless_asked(singles, tmp_path):
    """Eval pixels are timm's (Pillow's decode and resize; accuracy comparable with timm's) even where fast mode's
    DCT-scaled decoding would read 33-50 dB from them (a 4-10x shrink); training decodes fast; `decode=` chooses."""
    from fusionflow.tools.synthetic import make_image_folder

    big = make_image_folder(str(tmp_path / "big"), 6, 1, min_side=300, max_side=480, seed=7)
    kw = dict(is_training=False, num_workers=0, device=CPU)
    ours = create_loader(create_dataset("", root=big, split="train"), SIZE, 6, **kw)
    (x, _), (tx, _) = (
        next(iter(ours)),
        next(iter(timm_create_loader(create_dataset("", root=big, split="train"), SIZE, 6, **kw))),
    )
    assert ours.fusionflow.config.policy.decode_mode == "exact"
    assert float((x - tx).abs().max()) <= 1.01 / 255 / min(IMAGENET_STD)  # a level: the normalisation's rounding
    ours.fusionflow.close()
    for is_training, decode, want in ((True, None, "fast"), (False, "fast", "fast"), (True, "exact", "exact")):
        loader = create_loader(train_dataset(singles), SIZE, 4, is_training=is_training, device=CPU, decode=decode)
        assert loader.fusionflow.config.policy.decode_mode == want
        loader.fusionflow.close()
    with pytest.raises(ValueError, match=r"decode='bit'.*'fast' or 'exact'"):
        create_loader(train_dataset(singles), SIZE, 4, is_training=True, device=CPU, decode="bit")


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_eval_of_small_images_is_timms_to_the_level(tmp_path, interpolation):
    """The default centre crop of small noisy images: the box was resized from a window cut around it, whose offset
    moved Pillow's coefficients (bicubic up to 6 levels on 15% of pixels): exact mode now resizes it from the whole
    image, as timm's Resize does. (Nearest still samples a row or column off now and then: timm resizes, then crops
    whole pixels; one resize of the fractional box rounds its edge otherwise.)"""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, hw in enumerate([(168, 67), (104, 116), (90, 150)]):
        (tmp_path / "val" / f"c{c}").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)).save(tmp_path / "val" / f"c{c}" / "a.jpg")
    kw = dict(is_training=False, num_workers=0, device=CPU, interpolation=interpolation, crop_pct=0.875)
    ours = create_loader(create_dataset("", root=str(tmp_path), split="val"), (3, 56, 56), 3, **kw)
    theirs = timm_create_loader(create_dataset("", root=str(tmp_path), split="val"), (3, 56, 56), 3, **kw)
    with ours.fusionflow:
        (x, y), (tx, ty) = next(iter(ours)), next(iter(theirs))
    assert torch.equal(y, ty) and float((x - tx).abs().max()) <= 1.01 / 255 / min(IMAGENET_STD)


@pytest.mark.parametrize("crop_pct", [0.875, 1.15])
def test_eval_at_a_non_square_size_crops_and_pads_as_timm(singles, crop_pct):
    """timm's default eval crop at a non-square input_size is ResizeKeepRatio + torchvision's CenterCrop (which
    pads with 0 where crop_pct > 1 leaves the resized image smaller than the crop)."""
    kw = dict(is_training=False, num_workers=0, device=CPU, crop_pct=crop_pct)
    ours = create_loader(create_dataset("", root=singles, split="train"), (3, 40, 56), 8, **kw)
    theirs = timm_create_loader(create_dataset("", root=singles, split="train"), (3, 40, 56), 8, **kw)
    with ours.fusionflow:
        mine = list(ours)
    for (x, y), (tx, ty) in zip(mine, theirs, strict=True):
        assert torch.equal(y, ty) and x.shape == tx.shape == (8, 3, 40, 56)
        assert float((x - tx).abs().max()) <= 1.01 / 255 / min(IMAGENET_STD)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(input_size_choices=[32, 48]), r"input_size_choices"),
        (dict(tf_preprocessing=True), r"tf_preprocessing"),
        (dict(num_aug_splits=3), r"AugMixDataset"),
        (dict(num_aug_repeats=3), r"distributed=True"),
        (dict(collate_fn=FastCollateMixup(mode="half")), r"mode 'half'"),
        (dict(use_prefetcher=False, collate_fn=FastCollateMixup()), r"use_prefetcher=True"),
        (dict(worker_seeding="some"), r"worker_seeding='some'"),
        (dict(policy="eval"), r"create_loader\(policy=...\): the policy is the transform timm's arguments"),
        (dict(shuffle=False), r"create_loader\(shuffle=...\): is_training=True shuffles"),
        (dict(sampler=[0, 1]), r"create_loader\(sampler=...\)"),
        (dict(drop_last=False), r"create_loader\(drop_last=...\)"),
        (dict(batch_sampler=[[0, 1]]), r"create_loader\(batch_sampler=...\)"),
        # timm's prefetcher fails at its in-place division; ours truncated the normalised values (-2..2)
        (dict(img_dtype=torch.int32), r"img_dtype=torch.int32 must be a floating torch dtype"),
        (dict(img_dtype=torch.uint8), r"img_dtype=torch.uint8 must be a floating"),
        # each named with its value (they listed every argument set, defaults included, and torchvision's `p`)
        (dict(hflip=1.5), r"create_loader\(hflip=1.5\): a probability must be a number in \[0, 1\]"),
        (dict(grayscale_prob=-0.1), r"create_loader\(grayscale_prob=-0.1\)"),
        (dict(re_prob=2.0), r"create_loader\(re_prob=2.0\)"),  # (it ran with the prefetcher: always erased)
        (dict(re_prob=2.0, use_prefetcher=False), r"create_loader\(re_prob=2.0\)"),
        (dict(auto_augment="rand-m9-n0"), r"create_loader\(auto_augment='rand-m9-n0'\).*num_ops"),
        (dict(input_size=4), r"create_loader\(input_size=4\).*output.size"),
    ],
)
def test_what_cannot_be_expressed_is_refused_when_built_naming_the_argument(folder, kw, match):
    size = kw.pop("input_size", SIZE)
    with pytest.raises(ValueError, match=match):
        create_loader(train_dataset(folder), size, 8, is_training=True, device=CPU, **kw)


def test_a_misspelt_keyword_names_create_loader_and_the_nearest_argument(folder):
    """Keywords beyond timm's go to FusionFlowLoader: a misspelt one named FusionFlowLoader.__init__, which the
    script never called."""
    with pytest.raises(TypeError, match=r"create_loader\(\) got an unexpected keyword argument 're_porb': did you "
                       r"mean 're_prob'\?"):  # fmt: skip
        create_loader(train_dataset(folder), SIZE, 8, is_training=True, device=CPU, re_porb=0.25)
    with pytest.raises(TypeError, match=r"argument 'zzz' \(neither timm's create_loader nor FusionFlowLoader"):
        create_loader(train_dataset(folder), SIZE, 8, is_training=True, device=CPU, zzz=1)


def test_resuming_warns_only_about_a_seed_the_script_gave(folder, recwarn):
    """create_loader draws a seed for timm's worker seeding when none is given: a resume replaced it with a
    warning that a seed "was given"; one the script gave still warns."""
    kw = dict(is_training=True, device=CPU, num_workers=0)
    first = create_loader(train_dataset(folder), SIZE, 4, **kw)
    with first.fusionflow:
        a = next(iter(first))[0]
        state = first.state_dict()
    again = create_loader(train_dataset(folder), SIZE, 4, **kw)
    with again.fusionflow:
        again.load_state_dict(state)
        assert not [w for w in recwarn if "was given" in str(w.message)]
        assert again.fusionflow.seed == state["seed"]
    given = create_loader(train_dataset(folder), SIZE, 4, seed=state["seed"] + 1, **kw)
    with given.fusionflow, pytest.warns(UserWarning, match="was given, but the state was saved"):
        given.load_state_dict(state)
    assert a.shape[0] == 4


def test_what_timm_takes_or_ignores_is_taken(folder):
    """A scalar mean/std (timm's prefetcher repeats it per channel; it crashed at build), tf_preprocessing without
    the prefetcher (timm's create_transform ignores it; it was refused), and a refused eval interpolation names
    interpolation (it named crop_mode / crop_pct, which the caller had not passed)."""
    kw = dict(is_training=False, num_workers=0, device=CPU, mean=0.5, std=0.25)
    ours = create_loader(create_dataset("", root=folder, split="train"), SIZE, 8, **kw)
    theirs = timm_create_loader(create_dataset("", root=folder, split="train"), SIZE, 8, **kw)
    with ours.fusionflow:
        (x, _), (tx, _) = next(iter(ours)), next(iter(theirs))
    assert float((x - tx).abs().max()) <= 1.01 / 255 / 0.25
    create_loader(train_dataset(folder), SIZE, 8, is_training=True, device=CPU, use_prefetcher=False,
                  tf_preprocessing=True).fusionflow.close()  # fmt: skip
    with pytest.raises(ValueError, match=r"create_loader\(crop_mode / crop_pct / interpolation\)"):
        create_loader(create_dataset("", root=folder, split="train"), SIZE, 8, is_training=False, device=CPU,
                      interpolation="hamming")  # fmt: skip


def test_refusals_of_the_dataset_and_channels(folder):
    with pytest.raises(ValueError, match=r"on_error='skip'.*views misaligned"):
        ds = AugMixDataset(train_dataset(folder), num_splits=3)
        create_loader(ds, SIZE, 8, is_training=True, num_aug_splits=3, device=CPU, on_error="skip")
    with pytest.raises(ValueError, match=r"on_error='skip'.*mixup .* needs even batches"):  # it asserted mid-epoch
        create_loader(train_dataset(folder), SIZE, 8, is_training=True, device=CPU, collate_fn=FastCollateMixup(),
                      on_error="skip")  # fmt: skip
    with pytest.raises(ValueError, match=r"create_loader\(crop_pct / crop_mode\)"):  # it named every argument
        create_loader(train_dataset(folder), SIZE, 8, is_training=False, device=CPU, crop_pct=1.15)
    with pytest.raises(ValueError, match=r"input_size=\(1, 48, 48\).*RGB"):
        create_loader(train_dataset(folder), (1, 48, 48), 8, is_training=True, device=CPU)
    ds = AugMixDataset(train_dataset(folder), num_splits=2)
    with pytest.raises(ValueError, match="num_splits=2; pass the same number"):
        create_loader(ds, SIZE, 8, is_training=True, device=CPU, num_aug_splits=3)


def _seed_noting_the_dataset(path, info):
    with open(path, "a") as f:
        f.write(f"{info.id} {type(info.dataset).__name__}\n")
    return info.seed


def test_a_worker_seeding_callable_gets_the_worker_s_dataset_as_timm_s(folder, tmp_path):
    import functools

    note = tmp_path / "seen.txt"
    seeding = functools.partial(_seed_noting_the_dataset, str(note))
    ds = train_dataset(folder)
    loader = create_loader(ds, SIZE, 4, is_training=True, num_workers=2, device=CPU, worker_seeding=seeding)
    with loader.fusionflow:
        next(iter(loader))
    assert sorted(note.read_text().split("\n")[:-1]) == ["0 ImageFolder", "1 ImageFolder"]  # what the workers read


def test_worker_seeding_callable_and_part(folder):
    from fusionflow.timm.arguments import WorkerSeeding

    calls = []
    WorkerSeeding(lambda info: calls.append((info.id, info.seed)) or 11, 100, 2)(1)
    assert calls == [(1, 101)] and random.random() == random.Random(11).random()
    seen = []  # a worker_init_fn among create_loader's extra keywords runs after timm's seeding
    WorkerSeeding("all", 100, 2, then=lambda wid: seen.append((wid, random.random())))(1)
    assert seen == [(1, random.Random(101).random())]
    np.random.seed(5)
    WorkerSeeding("part", 7, 2)(0)
    assert np.random.randint(1 << 30) == np.random.RandomState(5).randint(1 << 30)  # numpy left as it was
    assert random.random() == random.Random(7).random()


def _draws_in_its_worker(root):
    """A timm dataset that draws from numpy and random as it reads (its target: the draws)."""
    from timm.data.dataset import ImageDataset

    class Draws(ImageDataset):
        def __getitem__(self, i):
            image, _ = super().__getitem__(i)
            return image, int(np.random.randint(1000)) * 1000 + random.randint(0, 999)

    return Draws(root)


@pytest.mark.parametrize("seeding", ["all", "part"])
def test_worker_seeding_gives_each_epoch_new_draws_without_persistent_workers(folder, seeding):
    """timm seeds numpy in each worker from the worker's seed, new each epoch (the epoch's base seed + id). Ours
    reseeded random, torch and numpy from one seed fixed at create_loader: without persistent workers, what a dataset
    drew in its workers came again every epoch (1 of 3 epochs distinct at 1 worker)."""
    ds = _draws_in_its_worker(folder)
    kw = dict(is_training=False, num_workers=1, persistent_workers=False, device=CPU, worker_seeding=seeding)
    loader = create_loader(ds, SIZE, len(ds), **kw)
    with loader.fusionflow:
        epochs = [tuple(next(iter(loader))[1].tolist()) for _ in range(3)]
    numpys, randoms = {tuple(t // 1000 for t in e) for e in epochs}, {tuple(t % 1000 for t in e) for e in epochs}
    assert len(numpys) == len(randoms) == 3, epochs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["timm", "torchvision"])
@pytest.mark.parametrize("repeats", [0, 3])
def test_two_ranks_under_torchrun_get_their_sampler_s_shares(singles, tmp_path, kind, repeats):
    """timm's train.py (distributed=True, num_aug_repeats) and torchvision's (its own DistributedSampler or
    RASampler kept, FusionFlowLoader in DataLoader's place): each rank gets what the sampler deals it --
    disjoint halves whose union is the dataset; with 3 repeats a repeated index augmented anew. A loader over
    the same set with shuffle=True and no distributed sampler (what Lightning or Accelerate leave to a
    FusionFlowLoader) warns that every rank reads the whole set; the sharded ones do not."""
    import json
    import os
    import subprocess
    import sys

    from test_ddp import _free_port
    from timm.data.distributed_sampler import RepeatAugSampler
    from torch.utils.data import DistributedSampler

    script = os.path.join(os.path.dirname(__file__), "dropin_ddp_rank.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), script, kind, singles, str(tmp_path), str(repeats)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if kind == "timm":
        ds = train_dataset(singles)
        target_of = [int(t) for _, t in ds.reader.samples]
    else:
        import torchvision

        ds = torchvision.datasets.ImageFolder(singles)
        target_of = list(ds.targets)
    drop_last = kind == "timm"  # timm's training loader drops the last incomplete batch; DataLoader's default keeps it
    for epoch in ("0", "1"):
        got = [json.loads((tmp_path / f"rank{r}.json").read_text())["seen"][epoch] for r in range(2)]
        for rank in range(2):
            if repeats:
                ref = RepeatAugSampler(ds, num_replicas=2, rank=rank, num_repeats=repeats)
            else:
                ref = DistributedSampler(ds, num_replicas=2, rank=rank)
            ref.set_epoch(int(epoch))
            want = [target_of[i] for i in ref]
            want = want[: len(want) // 4 * 4] if drop_last else want
            assert sorted(t for t, _ in got[rank]) == sorted(want), (rank, epoch)
        if not repeats:
            union = [t for rank in got for t, _ in rank]
            assert sorted(union) == sorted(target_of)  # disjoint halves, the whole dataset
        else:
            by_target = {}
            for t, digest in got[0]:
                by_target.setdefault(t, []).append(digest)
            repeated = [v for v in by_target.values() if len(v) > 1]
            assert repeated and all(len(set(v)) == len(v) for v in repeated)  # each copy its own augmentation
    for rank in range(2):  # DDP: no warning about the sampler's shares; one for a loader that has none
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["unsharded"] == [0, 1]


def test_transform_arguments_reach_the_policy(folder):
    """Each create_transform argument lands where timm puts it (the pixels per op: tests/test_timm.py)."""
    loader = create_loader(
        train_dataset(folder), SIZE, 8, is_training=True, scale=(0.5, 0.9), ratio=(0.8, 1.2), hflip=0.3, vflip=0.2,
        color_jitter=0.3, color_jitter_prob=0.6, grayscale_prob=0.1, gaussian_blur_prob=0.4, interpolation="bicubic",
        device=CPU,
    )  # fmt: skip
    p = loader.fusionflow.policy
    assert (p.scale, p.ratio, p.flip, p.vflip, p.grayscale) == ((0.5, 0.9), (0.8, 1.2), 0.3, 0.2, 0.1)
    assert p.jitter.p == 0.6 and p.jitter.brightness == pytest.approx((0.7, 1.3)) and p.crop_interpolation == "bicubic"
    assert (p.blur.p, p.blur.kernel_size, p.blur.sigma) == (0.4, (23, 23), (0.1, 2.0))
    assert p.normalize is not None and p.erase is None  # CPU device: the workers normalise; no erasing asked
    with loader.fusionflow:
        x, y = next(iter(loader))
    assert x.shape == (8, *SIZE) and x.dtype == torch.float32


@pytest.mark.parametrize("mode", ["rkrr", "rkrc"])
def test_train_crop_mode_keep_ratio_reaches_the_policy_and_trains(folder, mode):
    """timm's keep-ratio crops (pixels against timm's own: tests/test_timm_crops.py)."""
    kw = dict(is_training=True, train_crop_mode=mode, scale=(0.6, 1.0), ratio=(0.8, 1.25), device=CPU, num_workers=1)
    loader = create_loader(train_dataset(folder), SIZE, 8, **kw)
    kr = loader.fusionflow.policy.keep_ratio
    place = {"rkrr": "random", "rkrc": "center"}[mode]
    assert (kr.scale, kr.ratio, kr.place, kr.pad, kr.scale_p, kr.ratio_p) == (
        (0.6, 1.0),
        (0.8, 1.25),
        place,
        None,
        0.5,
        0.5,
    )
    with loader.fusionflow:
        batches = list(loader)
    assert all(x.shape == (8, *SIZE) and torch.isfinite(x).all() for x, _ in batches)
    assert sorted(int(t) for _, y in batches for t in y) == [c for c in range(5) for _ in range(8)]


def test_3a_and_an_auto_augment_with_grayscale_keep_timm_s_order(folder):
    """timm puts ColorJitter (with '3a') and RandomGrayscale after the augmentation: the policy keeps that
    order (color_after_augment), and the pixels follow it -- the grey after the ops, not before."""
    from fusionflow.ops.pipeline import CpuPipeline

    three = create_loader(train_dataset(folder), SIZE, 8, is_training=True, auto_augment="3a", device=CPU)
    p = three.fusionflow.policy
    assert p.color_after_augment and p.jitter is not None and p.augment.type == "timm-auto"
    assert [s[0][0] for s in p.augment.timm.subpolicies] == ["Solarize", "Desaturate", "GaussianBlurRand"]
    with three.fusionflow:
        x, _ = next(iter(three))
    assert x.shape == (8, *SIZE)
    grey = create_loader(
        train_dataset(folder), SIZE, 8, is_training=True, auto_augment="rand-m9-n3", grayscale_prob=1.0, device=CPU
    )
    policy = dataclasses.replace(grey.fusionflow.policy, fast_downscale=False)
    assert policy.color_after_augment and policy.grayscale == 1.0
    pipe, data = CpuPipeline(policy), open(grey.fusionflow.dataset.paths[0], "rb").read()
    differs = 0
    for index in range(30):
        d = draw(policy, 0, 0, index)
        base = pipe.image(data, dataclasses.replace(d, ops=(), grayscale=False))
        want = pipe.augment_image(base, d).convert("L").convert("RGB")  # ops, then the grey
        assert np.array_equal(np.asarray(pipe.image(data, d)), np.asarray(want)), index
        before = pipe.augment_image(base.convert("L").convert("RGB"), d)
        differs += not np.array_equal(np.asarray(before), np.asarray(want))
    assert differs > 0  # the order matters for these draws: the test can tell them apart


@pytest.mark.parametrize("mode", ["elem", "pair"])
def test_per_sample_mixup_of_a_half_precision_batch_keeps_its_soft_targets_exact(mode):
    """timm's Mixup makes its per-sample lam in the batch's dtype: on a bfloat16 batch (img_dtype) the soft targets'
    rows summed to 1 only within 2e-3. The batch is mixed in float32, then stored back."""
    from fusionflow.timm.batch import mix

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, num_classes=10, label_smoothing=0.1)
    images = torch.rand(8, 3, 16, 16).to(torch.bfloat16)
    out, targets = mix(mixup, images, torch.arange(8))
    assert out is images and out.dtype == torch.bfloat16
    assert float((targets.sum(1) - 1).abs().max()) < 1e-6
