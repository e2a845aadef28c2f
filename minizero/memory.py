"""Model-state memory per rank: the ZeRO paper's formulas, and what minizero really holds.

Mixed-precision Adam training keeps, per parameter (ZeRO paper, Rajbhandari et al.,
SC'20, section 3.1): 2 bytes of bf16/fp16 parameter, 2 bytes of gradient, and K = 12
bytes of optimizer state (4 fp32 master + 4 momentum + 4 variance). With N ranks:

    stage 0   2Ψ + 2Ψ + 12Ψ            (everything replicated)
    stage 1   2Ψ + 2Ψ + 12Ψ/N          (P_os: optimizer states partitioned)
    stage 2   2Ψ + (2 + 12)Ψ/N         (P_os+g: gradients too)
    stage 3   (2 + 2 + 12)Ψ/N          (P_os+g+p: parameters too)

`paper_bytes` is that formula. `expected_bytes` is the same formula applied to minizero's
actual layout: each FlatParam (flat_param.py) is padded up to a multiple of N, so Ψ/N
becomes ceil(Ψ_f/N) summed over FlatParams. Tests assert `engine.memory_breakdown()`
equals `expected_bytes` exactly, and that the padding is all that separates it from the
paper.

fp32 training (no mixed precision) has no separate master copy in minizero: the fp32
parameters are the masters, so K = 8 and params/grads are 4 bytes each.

Where each byte lives (offload/host.py). `memory_breakdown()` and `expected_bytes` return the
four categories' totals plus the same four split by place:

    {"params": b, "grads": b, "master_params": b, "optimizer_states": b,
     "device": {the four categories}, "host": {the four categories}}

With `"device": "nvme"` (offload/nvme.py) a third place, "nvme", holds what the offloads would keep
in host memory: it lives in files between uses, and "host" counts none of it.

Without offload everything is on the device. `offload_optimizer` moves the optimizer's
shard (fp32 master + moments: 12Ψ/N in mixed precision) to the host; in fp32 training the
device keeps its fp32 shard to compute with, so the host needs its own master: the device
saves 8Ψ/N and the host holds 12Ψ/N. `offload_param` (stage 3) moves the partitioned
low-precision parameter shard (2Ψ/N) to the host too; persistent parameters stay gathered
on the device, so they have no shard of their own to move.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .partition import padded_numel


def paper_bytes(psi: int, world_size: int, stage: int, mixed: bool = True) -> dict:
    """The ZeRO paper's per-rank bytes, split as memory_breakdown() splits them."""
    n = world_size
    lp = 2 if mixed else 4
    part = lambda x: x / n
    params = lp * psi if stage < 3 else part(lp * psi)
    grads = lp * psi if stage < 2 else part(lp * psi)
    master = (part(4 * psi) if stage >= 1 else 4 * psi) if mixed else 0
    opt = part(8 * psi) if stage >= 1 else 8 * psi
    return {"params": params, "grads": grads, "master_params": master, "optimizer_states": opt}


CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


def placed(device: dict, host: dict, nvme: dict | None = None) -> dict:
    """The breakdown's shape: per-category totals, then the `device` and `host` split, and
    `nvme` when something is swapped to files ("device": "nvme", offload/nvme.py)."""
    out = {**{k: device[k] + host[k] + (nvme[k] if nvme else 0) for k in CATEGORIES},
           "device": dict(device), "host": dict(host)}
    if nvme is not None:
        out["nvme"] = dict(nvme)
    return out


def expected_bytes(flat_numels: Sequence[int], world_size: int, stage: int, mixed: bool = True,
                   persistent: Iterable[bool] | None = None, offload_optimizer: bool = False,
                   offload_param: bool = False, nvme: bool = False) -> dict:
    """Per-rank bytes for minizero's layout: `flat_numels` are the Ψ of each FlatParam.

    `persistent` marks ZeRO-3 FlatParams kept gathered (small parameters): their params
    count in full, their gradients and optimizer state stay partitioned. `nvme`: the
    offloads are `"device": "nvme"` (offload/nvme.py): what they put in host memory lives in files
    between uses, a third place, "nvme".
    """
    n = world_size if stage >= 1 else 1
    lp = 2 if mixed else 4
    persistent = list(persistent) if persistent is not None else [False] * len(flat_numels)
    shard = [padded_numel(x, n) // n for x in flat_numels]
    full = [padded_numel(x, n) for x in flat_numels]
    psi = sum(flat_numels)
    gathered = sum(f for f, p in zip(full, persistent) if stage < 3 or p) * lp
    shards = sum(s for s, p in zip(shard, persistent) if stage == 3 and not p) * lp
    grads = psi * lp if stage < 2 else sum(shard) * lp
    if mixed or offload_optimizer:
        master = sum(shard) * 4
    else:   # fp32: the shard is the master, unless offload_param moved the shard to the host
        master = sum(s for s, p in zip(shard, persistent) if stage == 3 and not p) * 4 if offload_param else 0
    opt = sum(shard) * 8
    device = {"params": gathered + (0 if offload_param else shards), "grads": grads,
              "master_params": 0 if offload_optimizer else master,
              "optimizer_states": 0 if offload_optimizer else opt}
    host = {"params": shards if offload_param else 0, "grads": 0,
            "master_params": master if offload_optimizer else 0,
            "optimizer_states": opt if offload_optimizer else 0}
    if not nvme:
        return placed(device, host)
    return placed(device, dict.fromkeys(CATEGORIES, 0), host)   # all the host held, in files


def total(breakdown: dict) -> int:
    """Sum of the four categories (a breakdown's `device`/`host` split is not added again)."""
    return int(sum(breakdown[k] for k in CATEGORIES))


# ----------------------------------------------------------------------------- measured, not computed

def held_bytes(engine) -> dict:
    """What this rank's model states occupy right now, measured from the engine's buffers.

    `engine.memory_breakdown()` is the layout formula: what a rank holds at the end of
    backward, whatever the moment. This reads the tensors themselves, so it changes as a step
    goes on: the gradients exist from backward to the step and are gone after it (stage 0
    and ZeRO-1 hold them in each p.grad until the step reduces them, ZeRO-2/3 in the reduced
    grad_shard; the flat buffer a reduction reads counts while its storage is allocated), and
    a ZeRO-3 unit gathered at that moment counts its full buffer. Each storage is counted
    once, whole (the ZeRO-0/1/2 shard is a view of the full buffer; in fp32 the master is
    the shard), in the first category that holds it, in the order params, master_params,
    optimizer_states, grads: the way reference/ds_memory.py walks a DeepSpeed engine, so the
    two libraries are measured alike (runlog.MemoryMoments).
    Place is logical, as in memory_breakdown: a shard or master in host memory (offload/host.py)
    counts on the host even when the training device is the CPU too.

    Returns memory_breakdown's shape: the four categories, then "device" and "host"; and
    "elements", the layout they come from: {"full": padded elements of the FlatParams kept
    gathered, "shard": elements of this rank's shards, padding included} (at stage 0 both
    are the whole model), so a comparison can tell padding from anything else.
    """
    zero, opt = engine.zero, engine.sharded_optimizer
    offload = getattr(engine, "offload", None)
    # "device": "nvme": writes in flight finished first, so each state is counted in one place
    nvme = offload.swapped_out_bytes(zero.flat_params, opt) if offload is not None and offload.tier is not None else None
    where = {"device": dict.fromkeys(CATEGORIES, 0), "host": dict.fromkeys(CATEGORIES, 0)}
    seen: set[int] = set()

    def claim(category: str, tensors, on_host: bool) -> None:
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:   # a freed ZeRO-3 buffer, or counted
                continue
            seen.add(storage.data_ptr())
            where["host" if on_host else "device"][category] += storage.nbytes()

    for f in zero.flat_params:
        claim("params", [f.full], False)              # allocated: ZeRO-0/1/2, persistent, or gathered now
        claim("params", [f.shard], f.storage.on_host)   # ZeRO-3's own shard (a view of full otherwise)
        secondary = f.sharding.secondary(f)                 # hpZ: this rank's node-local shard, while cut
        if secondary is not None:
            claim("params", [secondary.tensor], secondary.on_host)
    claim("master_params", opt.masters, opt.on_host)
    claim("optimizer_states", [v for st in opt.optimizer.state.values() for v in st.values()
                               if torch.is_tensor(v) and v.dim() > 0], opt.on_host)   # not Adam's scalar step
    for f in zero.flat_params:
        claim("grads", [f.grad_shard, f.grad_buffer] + [p.grad for p in f.params], False)
    elements = {"full": sum(f.padded_numel for f in zero.flat_params if f.persistent),
                "shard": sum(f.shard_numel for f in zero.flat_params)}
    if nvme is None:
        return {**placed(where["device"], where["host"]), "elements": elements}
    return {**placed(where["device"], where["host"], nvme), "elements": elements}
