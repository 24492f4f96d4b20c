"""Policy files: shipped configs equal torchvision's definitions; bad files fail with file + key."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torchvision.transforms.v2 as T
import yaml

from fusionflow import load_policy
from fusionflow.policy import shipped_policies
from fusionflow.policy.schema import configs_dir


def test_shipped_policies_load_and_are_frozen():
    assert set(shipped_policies()) >= {"default", "randaugment", "randaugment-paper", "autoaugment", "trivialaugment"}
    for name in shipped_policies():
        p = load_policy(name)
        assert p.out_shape == (3, 224, 224)
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.flip = 0.0
    assert len(load_policy("randaugment").augment.ops) == 14
    assert len(load_policy("randaugment-paper").augment.ops) == 16
    assert {"SolarizeAdd", "Cutout", "Invert"} <= {o.name for o in load_policy("randaugment-paper").augment.ops}


def _tv_values(space, name, num_bins):
    fn, signed = space[name]
    mags = fn(num_bins, 224, 224)
    if mags is None or mags.ndim == 0:
        return None, signed
    vals = [float(m) for m in mags]
    if name == "Solarize":  # torchvision: fraction of 255
        vals = [255.0 * v for v in vals]
    return vals, signed


@pytest.mark.parametrize(
    "config,tv_cls",
    [("randaugment", T.RandAugment), ("trivialaugment", T.TrivialAugmentWide), ("autoaugment", T.AutoAugment)],
)
def test_magnitude_tables_equal_torchvision(config, tv_cls):
    aug = load_policy(config).augment
    space = tv_cls._AUGMENTATION_SPACE
    assert {o.name for o in aug.ops} == set(space)
    for choice in aug.ops:
        ref, signed = _tv_values(space, choice.name, aug.num_bins)
        assert choice.signed == signed, choice.name
        if ref is None:
            assert choice.range is None, choice.name
            continue
        ours = [choice.value(b, aug.num_bins) for b in range(aug.num_bins)]
        assert ours == pytest.approx(ref, abs=1e-4), choice.name


def test_autoaugment_subpolicies_equal_torchvision():
    aug = load_policy("autoaugment").augment
    ref = T.AutoAugment()._policies
    ours = [tuple((s.op, s.prob, s.bin) for s in sp) for sp in aug.subpolicies]
    assert ours == [tuple(tuple(step) for step in sp) for sp in ref]


def test_randaugment_settings():
    aug = load_policy("randaugment").augment
    assert (aug.type, aug.num_ops, aug.magnitude, aug.num_bins) == ("rand", 2, 9, 31)


def test_policy_layer_imports_neither_torch_nor_dali():
    code = (
        "import sys, fusionflow, fusionflow.policy as p; p.draw(p.load_policy('randaugment'), 0, 0, 0);"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'nvidia', 'torchvision')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


BASE = {
    "output": {"size": 224},
    "augment": {
        "type": "rand",
        "num_ops": 2,
        "magnitude": 9,
        "num_bins": 31,
        "ops": {"Rotate": {"range": [0, 30], "signed": True}, "Equalize": {}},
    },
}


def _write(tmp_path, cfg):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def _with(path, value):
    cfg = yaml.safe_load(yaml.safe_dump(BASE, sort_keys=False))
    node = cfg
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return cfg


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (
            ("augment", "ops", "Rotat"),
            {"range": [0, 30]},
            r"augment\.ops\.Rotat: unknown op 'Rotat'; did you mean 'Rotate'",
        ),
        (("augment", "magnitude"), 31, r"augment\.magnitude: 31 is out of range \[0, 30\]"),
        (("augment", "magnitude"), "9", r"augment\.magnitude: expected an integer, got str"),
        (("augment", "num_op"), 2, r"augment\.num_op: unknown key; did you mean 'num_ops'"),
        (("augment", "num_ops"), KeyError, r"augment\.num_ops: missing required key"),
        (("output",), KeyError, r"output: missing required key"),
        (("augment",), KeyError, r"augment: missing required key \(write augment: \{type: none\} for no augmentation"),
        (("flipp",), 0.5, r"flipp: unknown key; did you mean 'flip'"),
        (("flip",), 1.5, r"flip: 1.5 is out of range"),
        (("augment", "ops", "Rotate"), {"range": [0, 300]}, r"augment\.ops\.Rotate\.range\[1\]: 300 is out of range"),
        (("augment", "ops", "Rotate"), {}, r"augment\.ops\.Rotate\.range: missing required key"),
        (("augment", "ops", "Equalize"), {"range": [0, 1]}, r"augment\.ops\.Equalize\.range: unknown key"),
        (("augment", "ops", "TranslateX"), {"range": [0, 300]}, r"TranslateX\.range\[1\]: 300 is out of range \[-224"),
        (("augment", "type"), "randd", r"augment\.type: 'randd' is not valid; did you mean 'rand'"),
        (("augment", "interpolation"), "cubic", r"augment\.interpolation: 'cubic' is not valid"),
        (("output", "size"), [224], r"output\.size: expected an int or \[height, width\]"),
        (("crop",), {"scale": [0.9, 0.1]}, r"crop\.scale: lower bound 0.9 is greater than upper bound 0.1"),
        (("augment", "ops", "Rotate", "signed"), "yes", r"augment\.ops\.Rotate\.signed: expected true or false"),
        # NaN passes every comparison, inf an open bound: both refused where a number is read
        (("flip",), float("nan"), r"flip: expected a finite number, got nan"),
        (("augment", "ops", "Rotate"), {"range": [0, float("inf")]}, r"Rotate\.range\[1\]: expected a finite number"),
        (("jitter",), {"brightness": float("inf")}, r"jitter\.brightness: expected a finite number, got inf"),
        (("augment", "fill"), [127.9, 0.5, 3], r"augment\.fill\[0\]: expected an integer 0\.\.255, got 127\.9"),
        (("augment", "fill"), 0.5, r"augment\.fill: expected an integer 0\.\.255, got 0\.5"),
        (("augment", "fill"), [1, 2], r"augment\.fill: expected a list of three integers"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, path, value, expect):
    fname = _write(tmp_path, _with(path, value))
    with pytest.raises(ValueError, match=expect) as info:
        load_policy(fname)
    assert str(info.value).startswith(fname + ": ")


def test_subpolicy_errors(tmp_path):
    cfg = {
        "output": {"size": 64},
        "augment": {
            "type": "subpolicy",
            "num_bins": 10,
            "ops": {"Rotate": {"range": [0, 30]}, "Invert": {}},
            "subpolicies": [[["Rotate", 0.5, 3], ["Invert", 0.2]]],
        },
    }
    assert load_policy(cfg).augment.max_ops == 2
    cfg["augment"]["subpolicies"] = [[["Rotate", 0.5]]]
    with pytest.raises(ValueError, match=r"subpolicies\[0\]\[0\]: op 'Rotate' takes a magnitude"):
        load_policy(cfg)
    cfg["augment"]["subpolicies"] = [[["Equalize", 0.5]]]
    with pytest.raises(ValueError, match=r"subpolicies\[0\]\[0\]\[0\]: op 'Equalize' is not listed"):
        load_policy(cfg)
    cfg["augment"]["subpolicies"] = [[["Invert", 1.2]]]
    with pytest.raises(ValueError, match=r"subpolicies\[0\]\[0\]\[1\]: 1.2 is out of range"):
        load_policy(cfg)


def test_a_shipped_name_is_the_shipped_policy_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    """A project's working directory with an eval/ folder: policy="eval" read the folder ("Is a directory")."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_policy("eval") == load_policy(os.path.join(configs_dir(), "eval.yaml"))
    with pytest.raises(ValueError, match="'mine' is a directory: give a YAML file"):
        load_policy("mine")
    read, write = os.pipe()  # a pipe (`--policy <(...)`, /dev/stdin) is read as a file
    with open(os.path.join(configs_dir(), "eval.yaml"), "rb") as f:
        os.write(write, f.read())
    os.close(write)
    try:
        piped, shipped = load_policy(f"/dev/fd/{read}"), load_policy("eval")
        assert dataclasses.replace(piped, name=shipped.name, source=shipped.source) == shipped
    finally:
        os.close(read)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist; shipped policies: .*randaugment"):
        load_policy(str(tmp_path / "nope.yaml"))
    for typo in ("randaugmnet", "RandAugment", "trivialaugmnt"):  # a near miss of a shipped name is named
        with pytest.raises(ValueError, match=r"does not exist; did you mean '(randaugment|trivialaugment)'\? shipped"):
            load_policy(typo)
    bad = tmp_path / "bad.yaml"
    bad.write_text("output: {size: 224\naugment: [")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML"):
        load_policy(str(bad))
    with pytest.raises(TypeError, match="policy must be a path"):
        load_policy(42)


def test_a_colour_may_be_written_as_whole_floats():
    assert load_policy({**BASE, "augment": {**BASE["augment"], "fill": [128.0, 0, 3.0]}}).augment.fill == (128, 0, 3)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """YAML keeps the last of two equal keys silently: a policy file's second `flip` or second op is refused."""
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False) + "flip: 0.5\nflip: 0.0\n")
    with pytest.raises(ValueError, match=r"twice\.yaml: line \d+: key 'flip' given twice"):
        load_policy(str(path))
    merged = tmp_path / "merged.yaml"  # a YAML merge overridden by the mapping's own key is not a repeat
    merged.write_text("base: &b {a: 1, b: 2}\ntop: {<<: *b, a: 3}\n")
    from fusionflow.policy.reader import read_yaml

    assert read_yaml(str(merged))["top"] == {"a": 3, "b": 2}
    with pytest.raises(ValueError, match=r"is a directory: give a YAML file"):
        load_policy(str(tmp_path))


@pytest.mark.parametrize(
    "augment,expect",
    [
        (
            {"type": "subpolicy", "num_bins": 11, "ops": {"Rotate": {"range": [0, 30]}}, "subpolicies": [[[["R"], 1]]]},
            r"subpolicies\[0\]\[0\]\[0\]: expected an op name, got list",
        ),
        ({"type": "timm-rand", "ops": [["Rotate"]]}, r"augment\.ops\[0\]: expected a timm op name, got list"),
        (
            {
                "type": "deepaa",
                "magnitude_bins": 2,
                "ops": {"Rotate": [0, 30]},
                "pairs": [[["Rotate"], 1]],
                "layers": [[1]],
            },
            r"augment\.pairs\[0\]: op \['Rotate'\] is not one of augment\.ops",
        ),
        (  # DeepAA's ranges in the authors' units, bounded by the mapped op's domain
            {
                "type": "deepaa",
                "magnitude_bins": 2,
                "ops": {"Posterize": [0, 100]},
                "pairs": [["Posterize", 1]],
                "layers": [[1]],
            },
            r"augment\.ops\.Posterize\[1\]: 100 is out of range \[0\.0, 8\.0\]",
        ),
        (
            {
                "type": "deepaa",
                "magnitude_bins": 2,
                "ops": {"Color": [0, 12]},
                "pairs": [["Color", 1]],
                "layers": [[1]],
            },
            r"augment\.ops\.Color\[1\]: 12 is out of range \[0\.0, 11\.0\]",
        ),
    ],
)
def test_a_wrong_shape_where_an_op_or_its_range_belongs_names_the_key(augment, expect):
    with pytest.raises(ValueError, match=expect):
        load_policy({"output": {"size": 32}, "augment": augment})


def test_user_subset_policy(tmp_path):
    p = load_policy(_write(tmp_path, BASE))
    assert p.name == "mine" and [o.name for o in p.augment.ops] == ["Rotate", "Equalize"]
    assert p.augment.op("Rotate").value(9, 31) == pytest.approx(9.0)


def test_decode_mode_key_and_its_older_spelling():
    base = {"output": {"size": 64}, "augment": {"type": "none"}}
    assert load_policy(base).decode_mode == "fast"
    assert load_policy({**base, "decode": {"mode": "exact"}}).fast_downscale is False
    assert load_policy({**base, "decode": {"mode": "fast"}}).decode_mode == "fast"
    assert load_policy({**base, "decode": {"fast_downscale": False}}).decode_mode == "exact"
    with pytest.raises(ValueError, match=r"decode\.mode: 'exakt' is not valid; did you mean 'exact'\?"):
        load_policy({**base, "decode": {"mode": "exakt"}})
    with pytest.raises(ValueError, match=r"decode: give decode\.mode"):
        load_policy({**base, "decode": {"mode": "fast", "fast_downscale": True}})


def test_decode_max_pixels_default_null_and_bad_values():
    base = {"output": {"size": 64}, "augment": {"type": "none"}}
    assert load_policy(base).max_pixels == 178_956_970  # Pillow's default DecompressionBombError size
    assert load_policy({**base, "decode": {"max_pixels": None}}).max_pixels is None
    assert load_policy({**base, "decode": {"max_pixels": 10**9}}).max_pixels == 10**9
    with pytest.raises(ValueError, match=r"decode\.max_pixels: 0 is out of range"):
        load_policy({**base, "decode": {"max_pixels": 0}})
    with pytest.raises(ValueError, match=r"decode\.max_pixels: expected an integer, got str"):
        load_policy({**base, "decode": {"max_pixels": "1e9"}})


def test_a_number_yaml_reads_as_text_is_refused_with_how_to_write_it(tmp_path):
    """PyYAML (YAML 1.1) reads 5e-1 as the string '5e-1': the error said 'expected a number, got str' and no more."""
    path = tmp_path / "p.yaml"
    path.write_text("name: p\noutput: {size: 32}\nflip: 5e-1\naugment: {type: none}\n")
    with pytest.raises(
        ValueError, match=r"flip: expected a number, got str '5e-1' \(YAML reads 5e-1 as text: .* 0\.5\)"
    ):
        load_policy(str(path))
    path.write_text("name: p\noutput: {size: 32}\nflip: often\naugment: {type: none}\n")
    with pytest.raises(ValueError, match=r"flip: expected a number, got str 'often'$"):
        load_policy(str(path))


def test_a_key_given_to_an_op_that_takes_none_says_so():
    """An op without a magnitude given a range: 'unknown key; allowed keys: ' with an empty list."""
    cfg = {"name": "x", "output": {"size": 32}}
    cfg["augment"] = {
        "type": "rand",
        "num_ops": 1,
        "magnitude": 5,
        "num_bins": 11,
        "ops": {"Equalize": {"range": [0, 1]}},
    }
    with pytest.raises(
        ValueError,
        match=r"augment\.ops\.Equalize\.range: unknown key; augment\.ops\.Equalize takes no keys: give it as \{\}",
    ):
        load_policy(cfg)
