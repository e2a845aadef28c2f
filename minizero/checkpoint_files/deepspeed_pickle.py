"""DeepSpeed's own classes in its checkpoint files, read and written without importing deepspeed.

DeepSpeed pickles a few of its objects into its checkpoints (the loss scaler, ZeroStageEnum,
fragment_address: safe_load.DEEPSPEED_GLOBALS). `torch_load` reads a DeepSpeed file through
torch's weights-only unpickler with exactly those globals allowed, each as a `Foreign`
stand-in that keeps its attributes and can do nothing else, so a DeepSpeed folder loads
without running code, as minizero's own do (safe_load.py); any other global is refused in
one line. `torch_save` writes a Foreign back as the DeepSpeed global it stands for, so
DeepSpeed reads the file as its own. A file that cannot be read is one CheckpointError line.
"""
from __future__ import annotations

import copyreg
import pickle
import types

import torch

from . import durable
from .checkpoint_folder import CheckpointError, UnsafeCheckpointError, _why
from .safe_load import DEEPSPEED_GLOBALS, refusal
from .safe_load import torch_load as safe_torch_load


class Foreign:
    """Stands in for an object of a DeepSpeed class in a pickle: keeps its constructor
    arguments (an Enum's value) and its attributes. `module`/`name` say which class."""
    module = name = ""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __int__(self):   # ZeroStageEnum(1) -> 1
        return int(self.args[0])

    def __reduce_ex__(self, protocol):
        # object.__new__(cls) and then its attributes: how DeepSpeed's own objects are pickled
        # (protocol 2's NEWOBJ), so the file names DeepSpeed's class and nothing else
        return copyreg.__newobj__, (type(self),), dict(self.__dict__)

    def __repr__(self):
        return f"Foreign({self.module}.{self.name}, {getattr(self, 'args', None) or self.__dict__})"


_FOREIGN: dict = {}


def foreign_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _FOREIGN:
        _FOREIGN[key] = type(name, (Foreign,), {"module": module, "name": name})
    return _FOREIGN[key]


def _foreign_reconstructor(cls, base, state):
    """copyreg._reconstructor, for the one use a DeepSpeed file may make of it: a stand-in
    built as object.__new__(cls) (the form of the files `python -m minizero.export_deepspeed`
    wrote before it wrote protocol 2's NEWOBJ, as DeepSpeed does). Anything else is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Foreign) and base is object and state is None):
        raise pickle.UnpicklingError(f"Weights only load failed: copyreg._reconstructor({cls!r}, {base!r}) is not "
                                     f"a DeepSpeed object")
    return object.__new__(cls)


def allow_list() -> list:
    """(stand-in, "module.name") pairs added to torch's weights-only allow-list for a DeepSpeed file."""
    pairs = [(foreign_class(*g.rsplit(".", 1)), g) for g in DEEPSPEED_GLOBALS]
    return pairs + [(_foreign_reconstructor, "copyreg._reconstructor"), (object, "builtins.object")]


class _Pickler(pickle._Pickler):
    """Writes a Foreign class as the DeepSpeed global it stands for (without importing it)."""

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, Foreign) and obj is not Foreign:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def foreign_object(module: str, name: str, attrs: dict) -> Foreign:
    """An object that pickles as DeepSpeed's `module.name` with these attributes."""
    cls = foreign_class(module, name)
    obj = cls.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


# torch.save's pickle_module for writing (torch.save asks only for its Pickler); it has no
# loader, so nothing can unpickle through it
PICKLE = types.ModuleType("minizero_deepspeed_pickle")
PICKLE.Pickler = _Pickler


def torch_load(path: str, mmap: bool = True):
    """A DeepSpeed file, its DeepSpeed objects as Foreign stand-ins, through the allow-list;
    a refused or damaged file is one CheckpointError line."""
    allow = allow_list()
    try:
        return safe_torch_load(path, mmap=mmap, allow=allow)
    except Exception as e:
        line = refusal(path, e, allow)
        if line is not None:
            raise UnsafeCheckpointError(line) from None
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint file ({_why(path, e)})") from None


def torch_save(obj, path: str) -> None:
    """Write a DeepSpeed file (fsynced: durable.py)."""
    durable.save(obj, path, writer=lambda o, p: torch.save(o, p, pickle_module=PICKLE))
