"""examples/train_classification.py runs a couple of steps both ways: DataLoader + torchvision, and
FusionFlowLoader with the same recipe converted by policy_from_transform."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _script():
    spec = importlib.util.spec_from_file_location(
        "train_classification", os.path.join(HERE, "..", "examples", "train_classification.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FLAGS = [
    "--synthetic",
    "--synthetic-classes",
    "3",
    "--synthetic-per-class",
    "8",
    "--model",
    "resnet18",
    "--device",
    "cpu",
    "--train-crop-size",
    "64",
    "--val-resize-size",
    "72",
    "--val-crop-size",
    "64",
    "-b",
    "6",
    "-j",
    "1",
    "--steps",
    "2",
    "--auto-augment",
    "ra",
    "--ra-magnitude",
    "7",
    "--random-erase",
    "0.25",
    "--mixup-alpha",
    "0.2",
    "--cutmix-alpha",
    "1.0",
    "--ra-sampler",
]


@pytest.mark.parametrize("loader", ["torchvision", "fusionflow"])
def test_script_trains_a_couple_of_steps(tmp_path_factory, loader):
    root = str(tmp_path_factory.getbasetemp() / "synthetic-imagefolder")  # shared by both runs
    result = _script().main(["--data-path", root, "--loader", loader, *FLAGS])
    assert result["loader"] == loader and len(result["train_losses"]) == 2
    assert all(loss == loss and loss > 0 for loss in result["train_losses"])  # finite (MixUp targets are soft)
    assert len(result["val_acc"]) == 1


def test_script_trains_with_augmix_through_fusionflow(tmp_path_factory):
    """torchvision's recipe flag --auto-augment augmix switches loaders (the AugMix policy on CPU workers)."""
    root = str(tmp_path_factory.getbasetemp() / "synthetic-imagefolder")
    flags = [f for f in FLAGS if f not in ("--ra-sampler",)]
    flags[flags.index("ra")] = "augmix"
    flags[flags.index("--ra-magnitude") : flags.index("--ra-magnitude") + 2] = ["--augmix-severity", "5"]
    result = _script().main(["--data-path", root, "--loader", "fusionflow", *flags])
    assert len(result["train_losses"]) == 2 and all(loss == loss for loss in result["train_losses"])


@pytest.mark.parametrize("auto_augment", ["ra", "ta_wide", "augmix", "imagenet", None])
def test_the_scripts_recipes_convert(auto_augment):
    from fusionflow import load_policy, policy_from_transform

    mod = _script()
    args = mod.parse_args(
        ["--data-path", "x", "--train-crop-size", "176", "--random-erase", "0.1"]
        + (["--auto-augment", auto_augment] if auto_augment else [])
    )
    train = policy_from_transform(mod.train_transform(args))
    assert train.size == (176, 176) and train.erase.p == 0.1 and train.normalize == (mod.MEAN, mod.STD)
    evalp = policy_from_transform(mod.eval_transform(args))
    assert (evalp.center_resize, evalp.size) == (256, (224, 224))
    if auto_augment == "ra":
        ref = load_policy("randaugment", size=176, interpolation="bilinear")
        assert [o.name for o in train.augment.ops] == [o.name for o in ref.augment.ops]
        assert train.augment.interpolation == "bilinear" and train.augment.magnitude == 9
    if auto_augment == "augmix":
        assert train.augment.augmix == load_policy("augmix").augment.augmix  # severity 3, torchvision's defaults
        assert train.augment.interpolation == "bilinear"
    bicubic_args = ["--data-path", "x", "--interpolation", "bicubic"]
    bicubic = mod.parse_args(bicubic_args)
    if auto_augment == "augmix":  # torchvision's own AugMix raises on tensors with bicubic: so does the conversion
        with pytest.raises(ValueError, match="bicubic"):
            policy_from_transform(mod.train_transform(mod.parse_args([*bicubic_args, "--auto-augment", "augmix"])))
        return
    train_bicubic = policy_from_transform(mod.train_transform(bicubic))
    assert train_bicubic.crop_interpolation == "bicubic"
    assert train_bicubic.augment.type == "none" or train_bicubic.augment.interpolation == "bicubic"
    assert policy_from_transform(mod.eval_transform(bicubic)).crop_interpolation == "bicubic"


def test_script_resumes_mid_epoch_with_the_remaining_batches(tmp_path_factory, tmp_path):
    """--save-every saves mid-epoch (the loader's state_dict with the model's); a run preempted after such a save,
    resumed with --resume, trains on that epoch's batches not yet trained on, then the next epoch whole."""
    root = str(tmp_path_factory.getbasetemp() / "synthetic-imagefolder")
    flags = list(FLAGS)
    flags[flags.index("--steps") + 1] = "0"  # whole epochs
    full = _script().main(["--data-path", root, "--loader", "fusionflow", *flags])
    per_epoch = len(full["train_losses"])
    assert per_epoch > 3

    class Preempted(Exception):
        pass

    mod = _script()
    real_save = mod.save

    def save_then_die(args, rank, epoch, mid_epoch, *rest):
        real_save(args, rank, epoch, mid_epoch, *rest)
        if mid_epoch:
            raise Preempted

    mod.save = save_then_die
    out = str(tmp_path / "ckpt")
    with pytest.raises(Preempted):
        mod.main(["--data-path", root, "--loader", "fusionflow", *flags, "--output-dir", out, "--save-every", "2"])
    resumed = _script().main(["--data-path", root, "--loader", "fusionflow", *flags, "--resume", out, "--epochs", "2"])
    assert len(resumed["train_losses"]) == (per_epoch - 2) + per_epoch
    assert len(resumed["val_acc"]) == 2


def _resume_as_rank(rank: int, store: str, directory: str, answers) -> None:
    """A rank of a 2-rank gloo job: resume from `directory` and report the epoch of the checkpoint it loaded."""
    import torch
    import torch.distributed as dist

    try:
        mod = _script()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        model = torch.nn.Linear(2, 2)
        args = mod.parse_args(["--data-path", directory, "--resume", directory])
        start = mod.resume(args, rank, model, torch.optim.SGD(model.parameters(), lr=0.1), object())
        answers.put((rank, start, args.save_index))
        dist.destroy_process_group()
    except BaseException as exc:  # the verdict is the parent's
        answers.put((rank, repr(exc), None))


def _resume_two_ranks(store: str, directory: str) -> list:
    """Both ranks of a 2-rank gloo job resume from `directory` (forked processes): their answers, by rank."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    answers = ctx.Queue()
    ranks = [ctx.Process(target=_resume_as_rank, args=(r, store, directory, answers)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = sorted(answers.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    return got


def test_ranks_resume_from_the_newest_save_every_rank_finished(tmp_path):
    """A job killed while one rank had written its mid-epoch checkpoint and the other not: each rank loaded its own
    newest, 2 batches apart, and gloo aborted on mismatched collectives. The ranks now agree on the newest save both
    have; each keeps its last two."""
    import torch

    mod, out = _script(), str(tmp_path / "ckpt")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for rank, saves in ((0, 4), (1, 3)):  # rank 1 was killed before its 4th save
        args = mod.parse_args(["--data-path", out, "--output-dir", out])
        for epoch in range(saves):
            mod.save(args, rank, epoch, False, model, opt, object())
    assert mod._saves(out, 0) == [3, 4] and mod._saves(out, 1) == [2, 3]  # the last two each
    got = _resume_two_ranks(str(tmp_path / "store"), out)
    assert got == [(0, 3, 3), (1, 3, 3)], got  # save 3 (epoch 2) on both: the next epoch is 3; saves go on from 3
    assert mod._saves(out, 0) == [3]  # rank 0's save 4, past what both have, is gone: a later resume never takes it
    args = mod.parse_args(["--data-path", out, "--output-dir", out])
    args.save_index = 1  # a run resumed from an older file: its saves number below those on disk
    mod.save(args, 0, 0, False, model, opt, object())
    assert mod._saves(out, 0) == [2]  # the new save kept, the higher-numbered one of an earlier run removed


def test_ranks_without_a_common_save_all_stop(tmp_path):
    """Only the rank lacking the agreed save stopped; the others loaded theirs and hung in the next collective."""
    import torch

    mod, out = _script(), str(tmp_path / "ckpt")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for rank, saves in ((0, (3, 4)), (1, (1, 2))):
        args = mod.parse_args(["--data-path", out, "--output-dir", out])
        for n in saves:
            args.save_index = n - 1
            mod.save(args, rank, n, False, model, opt, object())
    got = _resume_two_ranks(str(tmp_path / "store"), out)
    assert [g[0] for g in got] == [0, 1] and all("no checkpoint every rank saved" in g[1] for g in got), got
