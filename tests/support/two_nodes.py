"""The reference halves of the two-node agreement tests: DeepSpeed's hpZ and PyTorch's HSDP (and
FSDP2's own hpZ) on 4 gloo ranks pretending to be 2 nodes x 2, fp32 and bf16, the same model,
config and batches as the other agreement tests (tests/support/agreement.py).

    from tests.support import two_nodes as T
    ds = T.deepspeed_runs(T.HPZ, "bf16")      # per rank: losses, final_state, memory, phases, ...
    pt = T.fsdp2_runs(T.HSDP, "fp32")
    mz = T.minizero_runs(T.HPZ, "bf16")

Each library's configurations (RUNS: every one a test reads) are trained in ONE launch of 4
rank processes, one after another (reference/ds_run.py's run_deepspeed,
reference/torch_engine.py's run_torch, tests/support/harness.py's run_minizero), and cached
for the test session per library; a run is looked up by (keys, dtype). Each run builds its own
engine from its own seed; run in one process, every field of every run (timings aside) equals
the same run in a launch of its own, DeepSpeed's once its hpZ group is cleared between runs
(`_deepspeed_rank`). A "node" is a block of PER_NODE consecutive ranks, as torchrun places them and as both
libraries group them (DeepSpeed's hpZ groups ranks k by k: utils/groups.py,
_create_zero_param_parallel_group; HSDP's mesh rows are ranks r*S .. r*S+S-1).

Besides run_deepspeed's keys, each rank returns `phases`: one entry per forward, backward and
step, in order, {"phase", "step", "groups": {group ranks: {op: {calls, bytes, wire_bytes}}},
"secondary_bytes": this rank's hpZ secondary partition right after the phase (DeepSpeed)},
the collectives of that phase alone (reference/comm_counter.py's per-group record), and
`groups`: the same summed over the whole training loop.

Only the runs in MEMORY capture `memory` (the ones a test reads).

Cost: three launches of 4 ranks (minizero's 6 runs, DeepSpeed's 4, FSDP2's 4) and one of 8
(minizero_runs_2x4): 3.5-4.6, 7-12, 8.5-13.5 and 3.3-5 CPU seconds (all ranks on one core
of a 2-core machine, the higher figures with the machine loaded).
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
# What the tests read, per library: test_hierarchy.py (minizero against DeepSpeed and FSDP2),
# test_hpz_references.py (DeepSpeed's and FSDP2's hpZ against their plain ZeRO-3),
# test_hsdp_fsdp2.py (FSDP2's HSDP).
RUNS = {
    "minizero": [(z, d) for z in (HPZ, ZERO3, HSDP) for d in ("fp32", "bf16")],
    "deepspeed": [(z, d) for z in (HPZ, ZERO3) for d in ("fp32", "bf16")],
    "torch": [(HSDP, "fp32"), (HSDP, "bf16"), (HPZ, "fp32"), (ZERO3, "fp32")],
}
# The runs whose `memory` a test reads (test_hierarchy.py's hpZ memory, test_hpz_references.py's
# secondary partition, test_hsdp_fsdp2.py's shard): only these capture it. Capturing walks the
# buffers after init, each backward and each step, and minizero's and FSDP2's runs also track
# each phase's peak (minizero's at every announced event): a few hundredths of a second per
# rank per run (0.05 s at 2 x 4). Nothing else in a run changes without it.
MEMORY = {
    "minizero": [(HPZ, "bf16")],
    "deepspeed": [(HPZ, "fp32"), (HPZ, "bf16"), (ZERO3, "bf16")],
    "torch": [(HSDP, "fp32"), (HSDP, "bf16")],
}

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


def _deepspeed_rank(zero, dtype, steps, memory=True):
    """No peaks recorded (capture_peaks=False): no test reads them, and at ZeRO-3 the recorder
    reads every buffer at each fetch and release. DeepSpeed keeps its hpZ group in a module
    global and refuses to make a second (utils/groups.py, _create_zero_param_parallel_group),
    and stage3.py hands an existing one to the next engine even without hpZ: cleared before
    each run, so each run makes its own, as in a fresh process."""
    from deepspeed.utils import groups

    from reference.ds_run import run_deepspeed
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    return run_deepspeed(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=memory,
                         capture_peaks=False, drive=PhaseRecorder)


def _minizero_rank(zero, dtype, steps, memory=True):
    from tests.support.harness import run_minizero
    return run_minizero(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=memory, drive=PhaseRecorder)


def _torch_rank(zero, dtype, steps, memory=True):
    from reference.torch_engine import run_torch
    return run_torch(A.MODEL_FN, config(zero, dtype), A.BATCHES, steps, capture_memory=memory, drive=PhaseRecorder)


RANK_FN = {"deepspeed": _deepspeed_rank, "torch": _torch_rank, "minizero": _minizero_rank}


def _each(lib, keys, steps, memory):
    """On each rank: every (zero, dtype) of `keys` in turn, in this process, `memory` captured
    for the keys in `memory`."""
    return [RANK_FN[lib](dict(zero), dtype, steps, (zero, dtype) in memory) for zero, dtype in keys]


def _key(zero: dict, dtype: str) -> tuple:
    return tuple(sorted(zero.items())), dtype


@functools.lru_cache(maxsize=None)
def _runs(lib: str, steps: int) -> dict:
    """Every RUNS[lib] configuration, trained once per test session in one launch: three test
    files read the same runs, and under xdist they may sit on both workers, so the runs are
    shared through files as the agreement runs are (tests/support/agreement.py, `_shared`:
    a worker needing them while the other trains them waits on the lock)."""
    keys = [_key(zero, dtype) for zero, dtype in RUNS[lib]]
    memory = [_key(zero, dtype) for zero, dtype in MEMORY[lib]]
    env = dict(A.ENV, MINIZERO_RANKS_PER_NODE=str(PER_NODE))   # minizero's ledger: 2 "nodes" of 2
    with A._shared(f"two-nodes-{lib}-{steps}") as (load, store):
        runs = load()
        if runs is None:
            per_rank = run_ranks(_each, world_size=N, args=(lib, keys, steps, memory), env=env, timeout=600)
            runs = {k: tuple(per_rank[r][i] for r in range(N)) for i, k in enumerate(keys)}
            store(runs)
    return runs


def _run(lib: str, zero: dict, dtype: str, steps: int) -> tuple:
    runs = _runs(lib, steps)
    key = _key(zero, dtype)
    if key not in runs:
        raise KeyError(f"two_nodes: no {lib} run of {zero} in {dtype}; add it to RUNS[{lib!r}]")
    return runs[key]


def deepspeed_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, DeepSpeed's ZeRO-3 with `zero` added (HPZ, or ZERO3 for plain) on 2 x 2 ranks."""
    return _run("deepspeed", zero, dtype, steps)


def minizero_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, minizero's ZeRO-3 with `zero` added (HPZ, HSDP, or ZERO3) on 2 x 2 ranks; its
    phases counted by the same counter as DeepSpeed's and FSDP2's, and `ledger`: comm_stats()."""
    return _run("minizero", zero, dtype, steps)


def fsdp2_runs(zero: dict, dtype: str, steps: int = STEPS) -> tuple:
    """Per rank, FSDP2 (HSDP, FSDP2's hpZ, or ZERO3 for plain fully_shard) on 2 x 2 ranks."""
    return _run("torch", zero, dtype, steps)


def node_of(rank: int) -> int:
    return rank // PER_NODE


def split(groups: dict) -> dict:
    """groups sorted into {"intra": {op: ...}, "inter": {op: ...}} by the 2 x 2 topology."""
    return node_split(groups, PER_NODE)


def _minizero_rank_each(runs, dtype):
    return [_minizero_rank(dict(zero), dtype, steps, memory=False) for zero, steps in runs]


def minizero_runs_2x4(runs: list[tuple[dict, int]], dtype: str) -> list[tuple]:
    """minizero alone on 8 ranks as 2 nodes x 4, each (zero, steps) of `runs` in turn in one
    launch of 8 rank processes (cheaper than one launch each); per run, per rank, as
    minizero_runs, without `memory` (no test reads it at 2 x 4)."""
    env = dict(A.ENV, MINIZERO_RANKS_PER_NODE="4")
    per_rank = run_ranks(_minizero_rank_each, world_size=8,
                         args=([(tuple(sorted(z.items())), steps) for z, steps in runs], dtype), env=env, timeout=600)
    return [tuple(per_rank[r][i] for r in range(8)) for i in range(len(runs))]
