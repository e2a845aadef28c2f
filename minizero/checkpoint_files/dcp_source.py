"""A PyTorch Distributed Checkpoint (DCP) folder read as a CheckpointSource.

dcp_checkpoint.py has the keys (torchtitan's) and the writers; this is the reader: names and
shapes from `.metadata` (read through the allow-list: dcp_files.py), the small values (step
counters, schedule, loss scale, client_state, the run record, Adam's steps) read once, and a
parameter's slices read through DCP's own resharding reader, which fetches only the saved
chunks that overlap them. So `engine.load_checkpoint`, `python -m minizero.reshard` and
`python -m minizero.export_deepspeed` take a DCP folder the way they take minizero's and
DeepSpeed's (checkpoint_state.rank_state).
"""
from __future__ import annotations

import json
import os
import re

import torch

from .checkpoint_errors import CheckpointError
from .checkpoint_state import CheckpointSource, slice_bounds
from .dcp_checkpoint import NAMESPACES, Pieces
from .dcp_files import check_files, load_items, read_metadata


_STATE_KEY = re.compile(r"state\.(.+)\.(exp_avg|exp_avg_sq|step|max_exp_avg_sq)$")
_GROUP_KEY = re.compile(r"param_groups\.(.+)\.([A-Za-z_][A-Za-z0-9_]*)$")


def _set(root: dict, path: tuple, value) -> None:
    """Put `value` at `path` in `root`: dict keys, and list positions where the path's next
    element is an int (how DCP's planner_data spells a value's place in the nested state)."""
    cur = root
    for here, nxt in zip(path[:-1], path[1:]):
        if isinstance(cur, list):
            cur.extend([None] * (here + 1 - len(cur)))
            if cur[here] is None:
                cur[here] = [] if isinstance(nxt, int) else {}
            cur = cur[here]
        else:
            cur = cur.setdefault(here, [] if isinstance(nxt, int) else {})
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    cur[path[-1]] = value


class DcpSource(CheckpointSource):
    """A DCP folder (written by FSDP2, torchtitan, minizero's `save` or export_dcp) as a
    CheckpointSource: names and shapes from `.metadata`; a parameter's slice read through
    DCP's own resharding reader (only the saved chunks that overlap it), a rank's slices all
    at once when rank_state announces them (`prefetch`).

    Recognised layouts: torchtitan's (model at the top level, `optimizer.` flattened per
    parameter, above) and the DCP tutorial's (`model.` and `optim.`/`optimizer.`, either
    optimizer form). Without a `run` record (a folder FSDP2 or torchtitan wrote) the param
    groups are the parameters of equal hyper-parameters, and a loading engine's own groups
    are adopted when the saved values agree with them (`adopt_groups`), as
    set_optimizer_state_dict does."""
    library = "dcp"
    KEEP_NUMEL = 1 << 26   # fp32 elements read and held for later slices: 256 MB

    def __init__(self, folder: str):
        self.folder = os.path.normpath(folder)
        self.metadata = md = read_metadata(self.folder)
        check_files(self.folder, md)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        paths = md.planner_data or {}
        self._tensor = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        path_of = {k: tuple(paths.get(k, (k,))) for k in md.state_dict_metadata}
        # in metadata order: rank 0's keys first, which is the model's order for FSDP2 (every rank holds every key)
        top = [k for k, p in path_of.items() if len(p) == 1 and k in self._tensor and p[0] not in NAMESPACES]
        model_ns = None
        if not top:   # the DCP tutorial's {"model": ..., "optim": ...}
            model_ns = "model" if any(p[0] == "model" for p in path_of.values()) else None
            top = [k for k, p in path_of.items() if model_ns and p[0] == model_ns and k in self._tensor]
        if not top:
            raise CheckpointError(f"{self.folder}: a DCP checkpoint with no model parameters minizero can find "
                                  f"(neither torchtitan's top-level names nor a 'model.' section)")
        self._model_key = {(path_of[k][-1] if model_ns else k): k for k in top}
        self._state_key, self._hparam = {}, {}
        self._nested_groups: dict[int, dict] = {}
        for k, p in path_of.items():
            if p[0] not in ("optimizer", "optim"):
                continue
            rest = p[1:]
            if len(rest) == 1 and (m := _STATE_KEY.match(rest[0])):      # flattened per parameter
                self._state_key[(m.group(2), m.group(1))] = k
            elif len(rest) == 1 and (m := _GROUP_KEY.match(rest[0])):
                self._hparam.setdefault(m.group(1), {})[m.group(2)] = k
            elif len(rest) == 3 and rest[0] == "state":                       # nested: state.<fqn>.<kind>
                self._state_key[(rest[2], rest[1])] = k
            elif len(rest) >= 3 and rest[0] == "param_groups" and isinstance(rest[1], int):
                self._nested_groups.setdefault(rest[1], {})[rest[2]] = k
        self._paths = path_of
        small = {k for k, p in path_of.items() if p[0] in ("train_state", "lr_scheduler", "loss_scaler",
                                                            "client_state", "run")}
        small |= {k for (kind, _), k in self._state_key.items() if kind == "step"}
        self._small = self._read(small)
        run = self._small.get("run") or {}
        self.run = run
        names = list(run.get("param_names") or [])
        mine = set(self._model_key)
        if names and set(names) != mine:
            raise CheckpointError(f"{self.folder}: its run record names other parameters than its metadata; the "
                                  f"folder is damaged")
        self.names = names or [n for n in self._model_key]   # metadata order: rank 0's, the model's for FSDP2
        self.shapes = {n: tuple(md.state_dict_metadata[self._model_key[n]].size) for n in self.names}
        self.world_size = int(run.get("world_size") or len({i.relative_path for i in md.storage_data.values()}) or 1)
        self.zero_stage = int(run.get("zero_stage", 3))
        self.dtype = run.get("dtype") or "fp32"
        self.writer = run.get("library") or "dcp"   # who wrote it: minizero, torch, or unknown
        self.config = json.loads(run["config"]) if run.get("config") else None
        self.has_optimizer_state = any(kind == "exp_avg" for kind, _ in self._state_key)
        self.lr_scheduler = self._small.get("lr_scheduler") or None
        self.loss_scaler = self._small.get("loss_scaler") or None
        self.client_state = self._small.get("client_state") or {}
        self._steps = {name: float(self._small_value(k)) for (kind, name), k in self._state_key.items()
                       if kind == "step"}
        self._read_groups(run.get("param_groups"))
        self.counters = self._counters()
        self._have: dict = {}   # (kind, name) -> (lo, hi, elements [lo, hi)), oldest first
        self._held = 0

    # ------------------------------------------------------------------ small values
    def _read(self, keys) -> dict:
        """The values of these keys, unflattened to their nested form (DCP's planner_data)."""
        md = self.metadata.state_dict_metadata
        flat = {k: (torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) if k in self._tensor else None)
                for k in keys}
        if flat:
            load_items(self.folder, flat, metadata=self.metadata)
        out: dict = {}
        for k, v in flat.items():
            _set(out, self._paths[k], v)
        self._flat_small = {**getattr(self, "_flat_small", {}), **flat}
        return out

    def _small_value(self, key):
        return self._flat_small[key]

    def _counters(self) -> dict:
        ts = self._small.get("train_state") or {}
        cfg = self.config or {}
        steps = int(ts["step"]) if "step" in ts else int(max(self._steps.values(), default=0))
        gas = int(cfg.get("gradient_accumulation_steps") or 1)
        batch = cfg.get("train_batch_size") or 0
        return {"global_steps": steps,
                "skipped_steps": int(ts.get("skipped_steps", 0)),
                "micro_steps": int(ts["micro_steps"]) if "micro_steps" in ts else steps * gas,
                "global_samples": int(ts["global_samples"]) if "global_samples" in ts else steps * int(batch)}

    def _hparams_of(self, name: str) -> dict:
        keys = self._hparam.get(name, {})
        missing = [k for k in keys.values() if k not in self._flat_small]
        if missing:
            self._read(missing)
        return {h: self._flat_small[k] for h, k in keys.items()}

    def _read_groups(self, recorded) -> None:
        order = {n: i for i, n in enumerate(self.names)}
        if recorded:
            members = [sorted(g, key=order.__getitem__) for g in recorded]
        elif self._nested_groups:
            got = self._read([k for g in self._nested_groups.values() for k in g.values()])
            ns = "optimizer" if "optimizer" in got else "optim"
            pgs = got[ns]["param_groups"]
            members = [sorted(pg.get("params", []), key=lambda n: order.get(n, 1 << 30)) for pg in pgs]
            self.groups = [{"names": m, "hparams": {k: v for k, v in pg.items() if k != "params"},
                            "step": int(self._steps.get(m[0], 0)) if m else 0} for m, pg in zip(members, pgs)]
            return
        else:   # FSDP2's flattened form keeps no grouping: parameters of equal hyper-parameters
            seen: list[tuple[dict, list]] = []
            for n in self.names:
                h = self._hparams_of(n)
                for hp, ms in seen:
                    if hp == h:
                        ms.append(n)
                        break
                else:
                    seen.append((h, [n]))
            members = [ms for _, ms in seen]
        self.groups = [self._group(ms) for ms in members]

    def _group(self, names: list) -> dict:
        hp = self._hparams_of(names[0]) if names else {}
        return {"names": list(names), "hparams": hp, "step": int(self._steps.get(names[0], 0)) if names else 0}

    def adopt_groups(self, ours: list[set], path: str) -> None:
        """Take the loading run's param groups when the folder keeps none of its own (FSDP2's
        flattened optimizer state): every member of each group must have the same saved
        hyper-parameters and Adam step, else one CheckpointError line."""
        if self.run.get("param_groups") or self._nested_groups:
            return
        order = {n: i for i, n in enumerate(self.names)}
        groups = []
        for g, names in enumerate(ours):
            names = sorted((n for n in names if n in order), key=order.__getitem__)
            if not names:
                groups.append({"names": [], "hparams": {}, "step": 0})
                continue
            first = self._hparams_of(names[0])
            odd = [n for n in names if self._hparams_of(n) != first or
                   self._steps.get(n, 0) != self._steps.get(names[0], 0)]
            if odd:
                raise CheckpointError(f"checkpoint {path}: param group {g} of this run holds {names[0]} and {odd[0]}, "
                                      f"whose saved hyper-parameters or Adam steps differ; build the param groups "
                                      f"as the saved run did")
            groups.append(self._group(names))
        self.groups = groups

    def require_optimizer_state(self, path: str | None = None) -> None:
        """One CheckpointError line when the folder holds no optimizer state (a model-only
        DCP save): it cannot continue training, and nothing is converted or loaded from it."""
        if not self.has_optimizer_state:
            raise CheckpointError(f"{path or self.folder} holds no optimizer state (no optimizer.state.<name>.exp_avg "
                                  f"entries: saved without the optimizer?): it cannot continue training; save it with "
                                  f"the optimizer's state (get_optimizer_state_dict), or start a new run from its weights")

    # ------------------------------------------------------------------ tensors
    def _key(self, kind: str, name: str) -> str:
        if kind == "master":
            return self._model_key[name]
        try:
            return self._state_key[(kind, name)]
        except KeyError:
            raise CheckpointError(f"{self.folder}: no Adam {kind} for {name} (saved without optimizer state?)") from None

    def prefetch(self, wanted) -> None:
        """Read these slices, (kind, name, lo, hi) each, in one DCP load: each becomes the
        `boxes` it covers, and DCP reads the saved chunks that overlap them."""
        sd, where = {}, {}
        for kind, name, lo, hi in wanted:
            if hi <= lo or (kind != "master" and not self.has_optimizer_state):
                continue
            key = self._key(kind, name)
            t = Pieces.empty(self.shapes[name], lo, hi)
            t.loading = True
            sd[key], where[key] = t, (kind, name, lo, hi)
        if sd:
            load_items(self.folder, sd, metadata=self.metadata)
        for key, (kind, name, lo, hi) in where.items():
            self._keep((kind, name), (lo, hi, sd[key].flat()))

    def _keep(self, key, held) -> None:
        """Hold what was read, the oldest dropped beyond KEEP_NUMEL elements (a reader that
        comes back to each parameter once per rank, as a DeepSpeed export does, reads its
        whole tensor once)."""
        old = self._have.pop(key, None)
        self._held += held[1] - held[0] - (old[1] - old[0] if old else 0)
        self._have[key] = held
        while len(self._have) > 1 and self._held > self.KEEP_NUMEL:
            lo, hi, _ = self._have.pop(next(iter(self._have)))
            self._held -= hi - lo

    def read(self, kind: str, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        start, stop = slice_bounds(self, kind, name, start, stop)
        n = self.numel(name)
        have = self._have.get((kind, name))
        if have is None or not (have[0] <= start and stop <= have[1]):
            self.prefetch([(kind, name, 0, n)])   # a slice not announced: the whole tensor, kept
            have = self._have[(kind, name)]
        return have[2][start - have[0]:stop - have[0]].clone()

    def rng_state(self, rank: int) -> dict | None:
        key = f"rank_{rank}"
        if not hasattr(self, "_rng"):
            self._rng = self._read({k for k, p in self._paths.items() if p[0] == "rng"}).get("rng", {})
        st = self._rng.get(key)
        return dict(st) if st else None

    def describe(self) -> str:
        who = {"minizero": "minizero", "torch": "PyTorch", "deepspeed": "DeepSpeed"}.get(self.writer, "an unknown writer")
        return f"{self.folder} (DCP, written by {who}: {self.world_size} rank{'s' if self.world_size != 1 else ''})"


def open_source(folder: str) -> DcpSource:
    return DcpSource(folder)
