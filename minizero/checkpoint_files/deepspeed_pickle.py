"""DeepSpeed's own classes in its checkpoint files, read and written without importing deepspeed.

DeepSpeed pickles some of its objects into its checkpoints (the loss scaler, ZeroStageEnum,
fragment_address). `torch_load` unpickles each as a `Foreign` stand-in that keeps its
attributes; `torch_save` writes a Foreign back as the DeepSpeed global it stands for, so
DeepSpeed reads the file as its own. A file that cannot be read is one CheckpointError line.
"""
from __future__ import annotations

import copyreg
import pickle
import types

import torch

from .checkpoint_folder import CheckpointError, _why


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
        return copyreg._reconstructor, (type(self), object, None), dict(self.__dict__)

    def __repr__(self):
        return f"Foreign({self.module}.{self.name}, {getattr(self, 'args', None) or self.__dict__})"


_FOREIGN: dict = {}


def foreign_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _FOREIGN:
        _FOREIGN[key] = type(name, (Foreign,), {"module": module, "name": name})
    return _FOREIGN[key]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return foreign_class(module, name)
        return super().find_class(module, name)


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


PICKLE = types.ModuleType("minizero_deepspeed_pickle")
PICKLE.Unpickler, PICKLE.Pickler = _Unpickler, _Pickler
PICKLE.load, PICKLE.dump = pickle.load, pickle.dump


def torch_load(path: str, mmap: bool = True):
    """torch.load a DeepSpeed file (its DeepSpeed objects as Foreign); a failure is one line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=PICKLE)
    except Exception as e:
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint file ({_why(path, e)})") from None


def torch_save(obj, path: str) -> None:
    torch.save(obj, path, pickle_module=PICKLE)
