"""ImageFolder: exact sample set, sizes without reading, clear errors; and the demo end to end."""

import os

import pytest

from fusionflow.datasets.folder import ImageFolder
from fusionflow.tools.demo import main as demo_main
from fusionflow.tools.synthetic import make_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("imgs"))
    make_image_folder(root, num_classes=3, per_class=4, min_side=40, max_side=90)
    open(os.path.join(root, "class_1", "notes.txt"), "w").write("not an image")
    return root


def test_image_folder_lists_every_image_once(folder):
    ds = ImageFolder(folder)
    assert ds.classes == ["class_0", "class_1", "class_2"] and len(ds) == 12
    expected = {os.path.join(folder, f"class_{c}", f"img_{i:05d}.jpg") for c in range(3) for i in range(4)}
    assert set(ds.paths) == expected and len(set(ds.paths)) == 12
    for i in range(len(ds)):
        data, label = ds[i]
        assert data[:2] == b"\xff\xd8" and label == ds.classes.index(os.path.basename(os.path.dirname(ds.paths[i])))
        assert ds.sizes[i] == len(data) and ds.describe(i) == ds.paths[i]


def test_image_folder_lists_what_torchvisions_lists_at_any_depth(tmp_path):
    """Images in sub-folders of a class folder (and a linked one) are that class's, in torchvision's order."""
    from torchvision.datasets import ImageFolder as TorchvisionFolder

    root = tmp_path / "data"
    for rel in ["cat/a.jpg", "cat/sub/b.JPG", "cat/sub/deeper/c.jpg", "cat/sub b/e.png", "dog/d.jpg", "dog/x.txt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\xff\xd8" + rel.encode())
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f.jpg").write_bytes(b"\xff\xd8f")
    os.symlink(tmp_path / "elsewhere", root / "dog" / "linked")
    ours, theirs = ImageFolder(str(root)), TorchvisionFolder(str(root), loader=lambda p: p)
    assert list(zip(ours.paths, ours.targets)) == theirs.samples and len(ours) == 6
    assert ours.class_to_idx == theirs.class_to_idx
    os.symlink(root / "cat", root / "cat" / "sub" / "up")  # a loop: each image once (torchvision's repeats them)
    assert ImageFolder(str(root)).paths == ours.paths


def test_a_root_of_splits_is_said_to_be_one(folder, tmp_path):
    """Images count at any depth, so a root of train/ and val/ reads as two classes (as torchvision's does): say so."""
    (tmp_path / "train").symlink_to(folder)
    (tmp_path / "val").symlink_to(folder)
    with pytest.warns(UserWarning, match=r"look like a dataset's splits .*pass a split's own folder"):
        assert ImageFolder(str(tmp_path)).classes == ["train", "val"]


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        ImageFolder(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no class sub-directories"):
        ImageFolder(str(tmp_path))
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match="holds no files ending in"):
        ImageFolder(str(tmp_path))


def test_demo_runs_and_prints_throughput_ratio(folder, capsys, tmp_path):
    assert (
        demo_main(
            [
                "demo",
                "--data",
                folder,
                "--epochs",
                "1",
                "--batch-size",
                "4",
                "--workers",
                "0",
                "--profile-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "throughput: FusionFlowLoader" in out and "DataLoader+torchvision" in out and "x\n" in out
    png = tmp_path / "timeline.png"
    assert f"where FusionFlow's time went: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "trace.json").exists()


def test_a_dangling_link_and_an_empty_class_are_said(tmp_path):
    """torchvision's ImageFolder lists a dangling link (its read fails) and refuses a class without images; ours
    leaves the link out and keeps the class: both said, so indices that differ from torchvision's are not a surprise."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "1.jpg").write_bytes(b"\xff\xd8 one")
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "a" / "2.jpg")
    with pytest.warns(UserWarning) as caught:
        ds = ImageFolder(str(tmp_path))
    said = " ".join(str(w.message) for w in caught)
    assert len(ds) == 1 and ds.classes == ["a", "b"]
    assert "1 file(s) cannot be read" in said and "2.jpg" in said and "['b'] hold no image" in said
