"""PyTorch Distributed Checkpoint (DCP) folders read without running code, and written.

A DCP folder is what `torch.distributed.checkpoint.save` writes (FSDP2's and torchtitan's
checkpoints; docs/checkpoints.md, "DCP's layout"):

    .metadata          one pickle: every key of the state dict, each tensor's shape and dtype and
                       the chunks (offsets, sizes) the ranks wrote of it, and where each chunk's
                       bytes lie (file, offset, length)
    __<r>_0.distcp     rank r's chunks end to end, each a `torch.save`d tensor, or object for a
                       non-tensor value

torch reads `.metadata` with `pickle.load` and a non-tensor value with
`torch.load(weights_only=False)` (DefaultLoadPlanner.load_bytes): a planted folder runs
whatever its pickles name. Here neither does (safe_load.py says why it matters):

- `.metadata` goes through an Unpickler whose `find_class` knows only `METADATA_GLOBALS`, the
  classes torch 2.14's DCP pickles there (tests/tools/test_dcp.py lists the globals of real
  folders, FSDP2's and minizero's, and holds this table to them); any other global is refused
  before it is looked up, in one line naming the file and the global;
- every chunk is read with `torch.load(weights_only=True)`: `SafeLoadPlanner` for the
  non-tensor values (DCP's own reader already loads tensors that way).

`SafeReader` and `SafeLoadPlanner` are what every DCP load in this repository passes to
`torch.distributed.checkpoint.load`, minizero's (dcp_source.py) and the PyTorch
reference's (reference/torch_engine.py). A truncated or missing chunk file is one
CheckpointError line naming it.
"""
from __future__ import annotations

import io
import os
import pickle

import torch

from .checkpoint_errors import CheckpointError, UnsafeCheckpointError
from .safe_load import refusal

METADATA_FILE = ".metadata"

# What torch 2.14.1's DCP pickles into `.metadata` (measured on folders FSDP2 and minizero
# wrote: tests/tools/test_dcp.py::test_metadata_globals_are_what_real_folders_hold), plus
# pathlib's other spellings of the checkpoint_id a save records. torch's dtypes are allowed
# by kind (any torch.dtype), not by name.
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},   # Python 3.13
}


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's own Unpickler, its globals restricted to METADATA_GLOBALS (the Python docs'
    "Restricting Globals"): a GLOBAL, STACK_GLOBAL or INST naming anything else raises
    before anything is looked up or called."""

    def find_class(self, module, name):
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id (DCP's metadata has none)")


def _refused(path: str, what: str) -> str:
    return (f"{path}: refused to load: {what}; a checkpoint holds tensors and plain data only, and loading one "
            f"never runs code: do not use this file, or rewrite it from a source you trust")


def read_metadata(folder: str):
    """The folder's `.metadata` (a torch.distributed.checkpoint.metadata.Metadata), read
    through the allow-list. A refused file is an UnsafeCheckpointError line, a damaged or
    missing one a CheckpointError line."""
    from torch.distributed.checkpoint.metadata import Metadata
    path = os.path.join(folder, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        if str(e).startswith("GLOBAL "):
            name = str(e)[len("GLOBAL "):]
            module, _, attr = name.rpartition(".")
            shown = f"{name} (os.{attr})" if module in ("posix", "nt") else name
            raise UnsafeCheckpointError(_refused(path, f"unpickling it would call {shown}")) from None
        raise CheckpointError(f"{path}: damaged or incomplete DCP metadata ({e})") from None
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: not a DCP checkpoint (no {METADATA_FILE} file)") from None
    except Exception as e:   # truncated: EOFError, a garbled opcode: ValueError, ...
        raise CheckpointError(f"{path}: damaged or incomplete DCP metadata ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:120]}); {os.path.getsize(path)} bytes") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (it holds a {type(md).__name__})")
    return md


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's FileSystemReader, its `.metadata` read through the allow-list (read_metadata),
        or handed over already read (`known`: a reader that loads many times reads it once)."""
        known = None

        def read_metadata(self, *args, **kwargs):
            md = self.known if self.known is not None else read_metadata(str(self.path))
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md
    return SafeReader


def _planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's DefaultLoadPlanner, a non-tensor value read with torch.load(weights_only=True)
        (the default planner passes weights_only=False)."""
        folder = ""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as e:
                line = refusal(f"{self.folder} (entry {fqn})", e)
                if line is not None:
                    raise UnsafeCheckpointError(line) from None
                raise CheckpointError(f"{self.folder}: entry {fqn} is damaged ({type(e).__name__})") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj
    return SafeLoadPlanner


def SafeReader(folder: str, metadata=None):   # noqa: N802  (a class, built when DCP is first needed)
    r = _reader_class()(folder)
    r.known = metadata
    return r


def SafeLoadPlanner(folder: str = "", **kw):   # noqa: N802
    p = _planner_class()(**kw)
    p.folder = folder
    return p


def load_items(folder: str, state_dict: dict, process_group=None, no_dist: bool = True, metadata=None) -> None:
    """torch.distributed.checkpoint.load of these flat keys (tensors filled in place, other
    values replaced) through SafeReader and SafeLoadPlanner. no_dist: this process alone
    (minizero's ranks read their own pieces; nothing to agree on). A damaged chunk file is one
    CheckpointError line."""
    import torch.distributed.checkpoint as dcp
    planner = SafeLoadPlanner(folder, flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(state_dict, storage_reader=SafeReader(folder, metadata), planner=planner, process_group=process_group,
                 no_dist=no_dist)
    except BaseException as e:   # DCP raises its CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        inner = first_failure(e)
        if isinstance(inner, CheckpointError):   # a refused or damaged value, said by SafeLoadPlanner
            raise inner from None
        raise CheckpointError(damaged_chunks(folder, e)) from None


def first_failure(e: BaseException) -> BaseException:
    """The exception inside DCP's CheckpointException ({rank: (exception, traceback)}), or e."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def damaged_chunks(folder: str, e: Exception) -> str:
    """The one line for a DCP load that failed reading the chunk files: the file that cannot
    hold what the metadata says it holds (truncated, missing), else torch's first line."""
    e = first_failure(e)
    if isinstance(e, CheckpointError):
        return str(e)
    for name in short_files(folder):
        return f"{os.path.join(folder, name)}: damaged or incomplete checkpoint file (truncated: shorter than " \
               f"{METADATA_FILE} says)"
    missing = [n for n in chunk_files(folder) if not os.path.exists(os.path.join(folder, n))]
    if missing:
        return f"{os.path.join(folder, missing[0])}: damaged or incomplete checkpoint file (missing)"
    first = (str(e).splitlines() or [""])[0][:160]
    return f"{folder}: cannot be read as a DCP checkpoint ({type(e).__name__}: {first})"


def chunk_files(folder: str, md=None) -> list[str]:
    """The chunk files the metadata names, sorted."""
    md = md if md is not None else read_metadata(folder)
    return sorted({info.relative_path for info in md.storage_data.values()})


def short_files(folder: str, md=None) -> list[str]:
    """Chunk files shorter than the metadata says they are (a truncated copy or write)."""
    md = md if md is not None else read_metadata(folder)
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return [n for n, size in sorted(need.items())
            if os.path.exists(os.path.join(folder, n)) and os.path.getsize(os.path.join(folder, n)) < size]


def check_files(folder: str, md=None) -> None:
    """Every chunk file the metadata names is there and long enough; each non-tensor value
    loads through the allow-list. One CheckpointError line otherwise (before anything is written)."""
    md = md if md is not None else read_metadata(folder)
    for name in chunk_files(folder, md):
        if not os.path.exists(os.path.join(folder, name)):
            raise CheckpointError(f"{os.path.join(folder, name)}: damaged or incomplete checkpoint file (missing)")
    short = short_files(folder, md)
    if short:
        raise CheckpointError(f"{os.path.join(folder, short[0])}: damaged or incomplete checkpoint file (truncated: "
                              f"shorter than {METADATA_FILE} says)")


def save_items(state_dict: dict, folder: str, process_group=None, no_dist: bool = False) -> None:
    """torch.distributed.checkpoint.save into `folder` (every file fsynced: FileSystemWriter's
    sync_files); a collective unless no_dist."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    dcp.save(state_dict, storage_writer=FileSystemWriter(folder, sync_files=True), planner=DefaultSavePlanner(),
             process_group=process_group, no_dist=no_dist)


def saved_step(folder: str) -> int:
    """The optimizer step a DCP folder was saved at (train_state.step; -1 when it has none)."""
    md = read_metadata(folder)
    key = "train_state.step"
    if key not in md.state_dict_metadata or not hasattr(md.state_dict_metadata[key], "properties"):
        return -1
    sd = {key: torch.empty((), dtype=md.state_dict_metadata[key].properties.dtype)}
    load_items(folder, sd)
    return int(sd[key])
