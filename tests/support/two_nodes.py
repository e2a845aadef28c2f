"""The reference halves of the two-node agreement tests: DeepSpeed's hpZ and PyTorch's HSDP (and
FSDP2's own hpZ) on 4 gloo ranks pretending to be 2 nodes x 2, fp32 and bf16, the same model,
config and batches as the other agreement tests (tests/support/agreement.py).

    from tests.support import two_nodes as T
    ds = T.deepspeed_runs(T.HPZ, "bf16")      # per rank: losses, final_state, memory, phases, ...
    pt = T.fsdp2_runs(T.HSDP, "fp32")
    mz = T.minizero_runs(T.HPZ, "bf16")

Each is one launch of 4 fresh rank processes (reference/ds_run.py's run_deepspeed,
reference/torch_engine.py's run_torch), cached for the test session per (library, keys,
dtype). A "node" is a block of PER_NODE consecutive ranks, as torchrun places them and as both
libraries group them (DeepSpeed's hpZ groups ranks k by k: utils/groups.py,
_create_zero_param_parallel_group; HSDP's mesh rows are ranks r*S .. r*S+S-1).

Besides run_deepspeed's keys, each rank returns `phases`: one entry per forward, backward and
step, in order, {"phase", "step", "groups": {group ranks: {op: {calls, bytes, wire_bytes}}},
"secondary_bytes": this rank's hpZ secondary partition right after the phase (DeepSpeed)},
the collectives of that phase alone (reference/comm_counter.py's per-group record), and
`groups`: the same summed over the whole training loop.

Cost (2 shared cores): a DeepSpeed launch 10-25 s, a PyTorch one 4-8 s, the forkserver's first
start 10-20 s more.
"""
from __future__ import annotations

import functools

from reference.comm_counter import COUNTER, group_delta, node_split
from tests.support import agreement as A
from tests.support.launcher import run_ranks

N, PER_NODE = 4, 2
# 2 steps: the first forward reads the hpZ secondary cut at initialisation, the second is the
# first after an optimizer step (the secondary was dropped: its forward gathers over all N,
# its backward from the secondary the forward rebuilt), the path every later step repeats; and
# step 1 is the first to start from updated weights and Adam's moments, so the bitwise
# comparisons see that state too.
STEPS = 2
HPZ = {"zero_hpz_partition_size": PER_NODE}
HSDP = {"hsdp_shard_size": PER_NODE}
ZERO3 = {}


def config(zero: dict, dtype: str) -> dict:
    """The agreement tests' ZeRO-3 config (prefetch, reuse and persistence off: every parameter
    partitioned and gathered at each use) with the multi-node keys added."""
    cfg = A.make_config(3, dtype)
    cfg["zero_optimization"].update(zero)
    return cfg


def add(into: dict, groups: dict) -> dict:
    for ranks, ops in groups.items():
        for op, v in ops.items():
            acc = into.setdefault(ranks, {}).setdefault(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})
            for k in acc:
                acc[k] += v[k]
    return into


def secondary_bytes(engine) -> int:
    """This rank's hpZ secondary partition (DeepSpeed's ds_secondary_tensor of every parameter)."""
    return sum(t.numel() * t.element_size() for p in engine.module.parameters()
               if (t := getattr(p, "ds_secondary_tensor", None)) is not None)


class PhaseRecorder:
    """Drives the engine for reference/ds_run.py's train_steps and notes each phase's
    collectives by group: counted from just before the phase to just after it, so the loop's
    own loss all-reduce between steps is in none."""

    def __init__(self, engine):
        self.engine, self.phases, self.step_index = engine, [], 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _run(self, phase, fn, *a, **k):
        before = COUNTER.group_snapshot()
        ledger = getattr(self.engine, "comm_stats", None)   # minizero's own ledger, intra/inter split
        ledger_before = ledger() if ledger else None
        out = fn(*a, **k)
        record = {"phase": phase, "step": self.step_index, "groups": group_delta(COUNTER.group_snapshot(), before),
                  "secondary_bytes": secondary_bytes(self.engine)}
        if ledger:
            after = ledger()
            record["ledger"] = {op: {key: v[key] - ledger_before[op][key] for key in v} for op, v in after.items()}
        self.phases.append(record)
        return out

    def __call__(self, *a, **k):
        return self._run("forward", self.engine, *a, **k)

    def backward(self, loss):
        return self._run("backward", self.engine.backward, loss)

    def step(self):
        out = self._run("step", self.engine.step)
        self.step_index += 1
        return out

    def result(self) -> dict:
        total = {}
        for p in self.phases:
            add(total, p["groups"])
        return {"phases": self.phases, "groups": total}


def _deepspeed_rank(zero, dtype, steps):
    from reference.ds_run import run_deepspeed
    return run_deepspeed(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=True, drive=PhaseRecorder)


def _minizero_rank(zero, dtype, steps):
    from tests.support.harness import run_minizero
    return run_minizero(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=True, drive=PhaseRecorder)


def _torch_rank(zero, dtype, steps):
    from reference.torch_engine import run_torch
    return run_torch(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=True, drive=PhaseRecorder)


@functools.lru_cache(maxsize=None)
def _run(lib: str, zero: tuple, dtype: str, steps: int) -> tuple:
    """Trained once per test session: three test files read the same runs, and under xdist
    they may sit on both workers, so the runs are shared through files as the agreement
    runs are (tests/support/agreement.py, `_shared`)."""
    fn = {"deepspeed": _deepspeed_rank, "torch": _torch_rank, "minizero": _minizero_rank}[lib]
    env = dict(A.ENV, MINIZERO_RANKS_PER_NODE=str(PER_NODE))   # minizero's ledger: 2 "nodes" of 2
    name = "two-nodes-" + "-".join([lib, dtype, str(steps)] + [f"{k}={v}" for k, v in zero])
    with A._shared(name.replace("/", "_")) as (load, store):
        runs = load()
        if runs is None:
            runs = tuple(run_ranks(fn, world_size=N, args=(dict(zero), dtype, steps), env=env))
            store(runs)
    return runs


def deepspeed_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, DeepSpeed's ZeRO-3 with `zero` added (HPZ, or ZERO3 for plain) on 2 x 2 ranks."""
    return _run("deepspeed", tuple(sorted(zero.items())), dtype, steps)


def minizero_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, minizero's ZeRO-3 with `zero` added (HPZ, HSDP, or ZERO3) on 2 x 2 ranks; its
    phases counted by the same counter as DeepSpeed's and FSDP2's, and `ledger`: comm_stats()."""
    return _run("minizero", tuple(sorted(zero.items())), dtype, steps)


def fsdp2_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, FSDP2 (HSDP, FSDP2's hpZ, or ZERO3 for plain fully_shard) on 2 x 2 ranks."""
    return _run("torch", tuple(sorted(zero.items())), dtype, steps)


def node_of(rank: int) -> int:
    return rank // PER_NODE


def split(groups: dict) -> dict:
    """groups sorted into {"intra": {op: ...}, "inter": {op: ...}} by the 2 x 2 topology."""
    return node_split(groups, PER_NODE)


def _minizero_rank_each(zeros, dtype, steps):
    return [_minizero_rank(dict(zero), dtype, steps) for zero in zeros]


def minizero_runs_2x4(zeros: list[dict], dtype: str, steps: int = 2) -> list[tuple]:
    """minizero alone on 8 ranks as 2 nodes x 4, each of `zeros` in turn in one launch of 8
    rank processes (cheaper than one launch each); per zero, per rank, as minizero_runs.
    Two steps: hpZ's first forward reads what initialisation cut, its second gathers over all N."""
    env = dict(A.ENV, MINIZERO_RANKS_PER_NODE="4")
    per_rank = run_ranks(_minizero_rank_each, world_size=8, args=([tuple(sorted(z.items())) for z in zeros],
                                                                  dtype, steps), env=env, timeout=600)
    return [tuple(per_rank[r][i] for r in range(8)) for i in range(len(zeros))]

