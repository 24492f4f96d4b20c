"""The user's torchvision pipeline as `policy_from_transform` reads it: `flatten` opens the containers (a
Compose, a list, a recipe preset, `weights.transforms()`) into one list of transforms, `as_v2` reads each
as torchvision's v2 transform(s) with the same parameters, `unreadable` says why one cannot be read.

Only torchvision's own classes are read (`type(t) is` the class torchvision exports): a subclass, or a
container whose call does more than apply its transforms (two views, a dict), may behave otherwise, so
it is refused rather than read as the stock transform."""

from __future__ import annotations

from fusionflow.policy.tv_sections import RANDOM_APPLY


def _forwards(self, img):  # a preset's whole call, as torchvision's classification reference writes it
    return self.transforms(img)


def _only_forwards(cls) -> bool:
    """Whether `cls.__call__` is `return self.transforms(x)` and nothing else (its bytecode is _forwards')."""
    call = getattr(cls.__call__, "__code__", None)
    mine = _forwards.__code__
    return call is not None and (call.co_code, call.co_names, call.co_argcount) == (
        mine.co_code,
        mine.co_names,
        mine.co_argcount,
    )


def flatten(transform) -> list:
    """The pipeline as a flat list of transforms: a Compose (v1 or v2, nested ones opened; a subclass
    only when it keeps Compose's call), a list, a recipe preset holding its Compose in `.transforms`
    and called as `self.transforms(img)` (torchvision's ClassificationPresetTrain/Eval),
    weights.transforms() (ImageClassification: Resize + CenterCrop + float + Normalize), or one transform."""
    import torch
    import torchvision.transforms as T1
    import torchvision.transforms.v2 as T
    from torchvision.transforms._presets import ImageClassification

    if isinstance(transform, (list, tuple)):
        return [t for part in transform for t in flatten(part)]
    kind = type(transform)
    if (isinstance(transform, T1.Compose) and kind.__call__ is T1.Compose.__call__) or (
        isinstance(transform, T.Compose) and kind.forward is T.Compose.forward
    ):
        return flatten(list(transform.transforms))
    if kind is ImageClassification:
        return [
            T.Resize(list(transform.resize_size), transform.interpolation, antialias=transform.antialias),
            T.CenterCrop(list(transform.crop_size)),
            T.PILToTensor(),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(list(transform.mean), list(transform.std)),
        ]
    inner = getattr(transform, "transforms", None)
    if (
        not isinstance(transform, (T.Transform, T1.Compose))
        and isinstance(inner, (T.Compose, T1.Compose, list, tuple))
        and _only_forwards(kind)
    ):
        return flatten(inner)  # a preset object wrapping its pipeline
    return [transform]


def as_v2(t) -> list | None:
    """[t] for a v2 transform; for a torchvision.transforms (v1) one, the v2 transform(s) with the same
    parameters (ToTensor: PILToTensor + ToDtype(float32, scale=True)); RandomApply's transforms read
    alike; None for anything else (a subclass, a lambda, another library's class, a container that
    does more than apply its transforms: its behaviour may differ)."""
    import torch
    import torchvision.transforms as T1
    import torchvision.transforms.v2 as T

    name = type(t).__name__
    if type(t) not in (getattr(T, name, None), getattr(T1, name, None)):
        return None
    if name == "RandomApply":
        inner = [as_v2(u) for u in t.transforms]
        return None if None in inner else [T.RandomApply([u for part in inner for u in part], t.p)]
    if type(t) is getattr(T, name, None):
        return [t]
    convert = {
        "RandomResizedCrop": lambda: T.RandomResizedCrop(t.size, t.scale, t.ratio, t.interpolation, t.antialias),
        "Resize": lambda: T.Resize(t.size, t.interpolation, t.max_size, t.antialias),
        "CenterCrop": lambda: T.CenterCrop(t.size),
        "RandomHorizontalFlip": lambda: T.RandomHorizontalFlip(t.p),
        "RandomVerticalFlip": lambda: T.RandomVerticalFlip(t.p),
        "GaussianBlur": lambda: T.GaussianBlur(t.kernel_size, t.sigma),
        "ColorJitter": lambda: T.ColorJitter(t.brightness, t.contrast, t.saturation, t.hue),
        "RandomGrayscale": lambda: T.RandomGrayscale(t.p),
        "Grayscale": lambda: T.Grayscale(t.num_output_channels),
        "RandAugment": lambda: T.RandAugment(t.num_ops, t.magnitude, t.num_magnitude_bins, t.interpolation, t.fill),
        "TrivialAugmentWide": lambda: T.TrivialAugmentWide(t.num_magnitude_bins, t.interpolation, t.fill),
        "AutoAugment": lambda: T.AutoAugment(t.policy, t.interpolation, t.fill),
        "AugMix": lambda: T.AugMix(
            t.severity, t.mixture_width, t.chain_depth, t.alpha, t.all_ops, t.interpolation, t.fill
        ),
        "PILToTensor": lambda: T.PILToTensor(),
        "ConvertImageDtype": lambda: T.ConvertImageDtype(t.dtype),
        "Normalize": lambda: T.Normalize(  # a scalar too: timm's create_transform makes a 0-d tensor of mean=0.5
            *(torch.as_tensor(v, dtype=torch.float64).view(-1).tolist() for v in (t.mean, t.std))
        ),
        "RandomErasing": lambda: T.RandomErasing(t.p, t.scale, t.ratio, t.value),
    }
    if name == "ToTensor":
        return [T.PILToTensor(), T.ToDtype(torch.float32, scale=True)]
    return [convert[name]()] if name in convert else None


def unreadable(t) -> str:
    """Why `t` (as_v2 gave None) cannot be read."""
    import torchvision.transforms as T1
    import torchvision.transforms.v2 as T

    name = type(t).__name__
    stock = type(t) in (getattr(T1, name, None), getattr(T, name, None))
    if name == "RandomApply" and stock:
        return RANDOM_APPLY
    if stock and name != "Lambda":
        return f"torchvision's {name} has no FusionFlow equivalent"
    base = next((c for c in type(t).__mro__[1:] if c.__module__.startswith("torchvision.transforms")), None)
    if base is not None and base is not T.Transform:
        return (
            f"is a subclass of torchvision's {base.__name__}, not a torchvision or timm transform FusionFlow can read "
            "(its behaviour may differ from the stock one's): use torchvision's own class, or keep this pipeline "
            "on torchvision"
        )
    if isinstance(getattr(t, "transforms", None), (T.Compose, T1.Compose, list, tuple)):
        return (
            "holds its pipeline in .transforms, but its call does more than `return self.transforms(img)` "
            f"(e.g. two views, or a dict): pass {name}(...).transforms if it only applies them"
        )
    return (
        "is not a torchvision or timm transform FusionFlow can read; build the pipeline from "
        "torchvision.transforms(.v2) or timm.data classes (lambdas and other callables cannot be read)"
    )
