"""Loading a checkpoint never runs code: every file is unpickled through an allow-list.

A torch checkpoint is a zip archive whose `data.pkl` is a pickle, and unpickling a pickle
calls whatever function it names: an object's `__reduce__` can name `os.system`, and a
plain `torch.load(path, weights_only=False)` calls it. Checkpoints travel (between
machines, libraries, people), so that would let a file run code on every machine that
resumes it. torch's own answer, its default since 2.6, is `weights_only=True`: an
unpickler that builds tensors, numbers, strings, lists, dicts, tuples, `OrderedDict`,
`torch.Size` and dtypes, and refuses any other global *before* calling it.

- minizero's own files load with `weights_only=True` and nothing added: a save writes only
  what that loads (`refuse_unsafe_values` checks what a user hands to `save_checkpoint`).
- DeepSpeed's files load through the same unpickler with exactly the classes a DeepSpeed
  0.19.8 folder pickles added (`DEEPSPEED_GLOBALS`, measured on real folders: ZeRO 0-3,
  fp32, bf16, fp16, CPU offload of optimizer and parameters), each mapped to a `Foreign`
  stand-in (deepspeed_pickle.py) that only keeps the attributes it is given.
- A refused file is one line naming the file and the global it asked for (`refusal`),
  found by reading the pickle's opcodes with `pickletools`, which runs nothing.

The data folder is read the same way (gpt/cifar10.py: numpy's array-building functions only).
"""
from __future__ import annotations

import collections
import contextlib
import io
import pickle
import pickletools
import re
import zipfile

import torch

# What a real DeepSpeed 0.19.8 checkpoint folder pickles beyond torch's own types: its loss
# scalers (in ZeRO's optimizer files, whatever the dtype), ZeRO's stage enum, and ZeRO-1/2's
# fragment addresses (param_slice_mappings). tests/agreement/test_checkpoint_safe_load.py
# lists the globals of DeepSpeed's folders and holds this tuple to them.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

# What a user may hand to save_checkpoint as client_state: what weights_only=True loads.
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size, torch.device)
PLAIN_CONTAINERS = (dict, list, tuple, set)


class RefusedFile(Exception):
    """A file whose unpickling would call something outside the allow-list. The message is
    the one line to print."""


def torch_load(path: str, *, mmap: bool = False, allow: list | tuple = ()):
    """torch.load(path) with weights_only=True, `allow` ((stand-in, "module.name") pairs)
    added to torch's allow-list for this call only."""
    with torch.serialization.safe_globals(list(allow)) if allow else contextlib.nullcontext():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def refusal(path: str, e: Exception, allow: list | tuple = ()) -> str | None:
    """The one line for a load that failed because the allow-list refused the file; None
    when it failed for another reason (a truncated or garbled file: damaged, not hostile)."""
    if not isinstance(e, pickle.UnpicklingError) or "Weights only load failed" not in str(e):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", str(e))   # torch's message names a GLOBAL opcode's target
    found = named.group(1) if named else offending_global(path, {name for _, name in allow})
    if found is None:   # refused, but not for a global: an opcode the safe unpickler does not run
        detail = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:120]
        what = f"it holds what a checkpoint does not ({detail})"
    else:
        what = f"unpickling it would call {_shown(found)}"
    return (f"{path}: refused to load: {what}; a checkpoint holds tensors and plain data only, and loading one "
            f"never runs code: do not use this file, or rewrite it from a source you trust")


def _shown(name: str) -> str:
    module, _, attr = name.rpartition(".")
    return f"{name} (os.{attr})" if module in ("posix", "nt") else name


def _allowed(name: str, allowed: set) -> bool:
    if name in allowed:
        return True
    try:   # torch's own allow-list (its private table, read only to name the offender)
        from torch import _weights_only_unpickler as wo
        return name in wo._get_allowed_globals() or name in wo._get_user_allowed_globals()
    except (ImportError, AttributeError):
        return name.startswith("torch.") or name == "collections.OrderedDict"


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_PY2_NAMES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def offending_global(path: str, allowed: set = frozenset()) -> str | None:
    """The first global in the file's pickle that the allow-list does not hold, read from
    its opcodes without running any: GLOBAL and INST name theirs, STACK_GLOBAL takes the
    two strings pushed before it. None when there is none, or the file cannot be read."""
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    except (OSError, zipfile.BadZipFile, StopIteration, KeyError):
        return None
    pushed: list = []   # what each opcode pushed: a string, or None for anything else
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST", "STACK_GLOBAL"):
                if op.name == "STACK_GLOBAL":
                    module, attr = (pushed[-2:] if len(pushed) >= 2 else [None, None])
                    if not (isinstance(module, str) and isinstance(attr, str)):
                        return "(a global computed while unpickling)"
                else:
                    module, attr = arg.split(" ", 1)
                name = f"{_PY2_NAMES.get(module, module)}.{attr}"
                if not _allowed(name, allowed):
                    return name
                pushed.append(None)
            elif op.name in _STRING_OPS:
                pushed.append(arg)
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = pushed[-1] if pushed else None
            elif op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                pushed.append(memo.get(arg))
            elif op.stack_after:
                pushed.append(None)
    except Exception:   # a garbled pickle: nothing more to name
        return None
    return None


def numbers_as_python(obj):
    """`obj` with every numpy number (np.float64(1e-3), ...) replaced by the Python number of
    the same value, through dicts, lists and tuples: for minizero's own record of a config and
    of the optimizer's hyper-parameters, where a user's numpy number means that number. (A
    user's client_state is given back as saved, so it is refused instead: refuse_unsafe_values.)"""
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, numbers_as_python(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(numbers_as_python(v) for v in obj)
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return obj.item()
    return obj


def refuse_unsafe_values(obj, where: str) -> None:
    """Raise ValueError (one line) if `obj` holds anything `torch.load(weights_only=True)`
    would refuse: only tensors and the plain types above, in dicts, lists and tuples (their
    exact types: a namedtuple, a numpy number or an OrderedDict subclass pickles its class).
    `where` names the value in the line ("client_state", "config")."""
    stack = [(obj, where)]
    while stack:
        o, at = stack.pop()
        kind = type(o)
        if kind in PLAIN_TYPES or kind is torch.Tensor or kind is torch.nn.Parameter:
            continue
        if kind in PLAIN_CONTAINERS or kind is collections.OrderedDict:
            if isinstance(o, dict):
                for k, v in o.items():
                    stack.append((k, f"{at} key {k!r}"))
                    stack.append((v, f"{at}[{k!r}]"))
            else:
                stack.extend((v, f"{at}[{i}]") for i, v in enumerate(o))
            continue
        raise ValueError(f"{at} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds tensors and plain "
                         f"data only (dict, list, tuple, str, int, float, bool, None), so that loading it never "
                         f"runs code; convert it (a tensor, .tolist(), a dict of its fields) before saving")
