"""How a FusionFlowLoader pickles and copies (pickle, copy.deepcopy, copy.copy): as its class and constructor
arguments, rebuilt into a new loader -- no workers, no progress (state_dict() carries that) -- as a torch DataLoader
unpickles before its first iteration; attributes the script set on it afterwards come along. A subclass with an
__init__ of its own is refused when pickled (its own arguments are not known here): it defines its own __reduce__."""

from __future__ import annotations

BUILT = frozenset({"_arguments", "_adopted", "config", "dataset", "parts", "stats"})  # what the constructor makes


def reduce_loader(loader, base: type, arguments: dict):
    """`loader.__reduce__()`: (rebuild, (class, its constructor's `arguments`), the attributes set after it)."""
    cls = type(loader)
    if cls.__init__ is not base.__init__:
        raise TypeError(
            f"{cls.__name__} cannot be pickled or copied as a {base.__name__} is (rebuilt from the arguments "
            f"{base.__name__}.__init__ took): its __init__ takes arguments of its own; give it a __reduce__"
        )
    return rebuild, (cls, arguments), {k: v for k, v in vars(loader).items() if k not in BUILT} or None


def rebuild(cls: type, arguments: dict):
    return cls(**arguments)
