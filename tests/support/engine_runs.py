"""Shared multi-rank training runs for the engine tests (test_engine, test_comm_volume,
test_memory, test_overflow).

Every run function here is module level (the forkserver pickles it by reference) and
returns plain Python / CPU tensors. `get(spec)` caches results per spec in the pytest
process, so one run feeds every assertion (in any test file) that needs it. `prefetch`
trains every run a test file reads in one launch of ranks per world size (`run_many`), so a
file pays for one launch, not one per run.

A spec is a dict (see DEFAULTS); `config_of`, `build` and `batches_of` turn it into
tests/support/harness.py's config, model and batches. The data are learnable PatternBatches rows,
so the loss really falls, and a single process (world 1) sees exactly the same rows per
optimizer step as N ranks do. Dropout is off, so ranks and world sizes compute the same
function.
What the runs read inside the engine comes from tests/support/probes.py.
"""
from __future__ import annotations

import functools
import json
import math

import torch

from tests.support import launcher, probes
from tests.support.harness import (NO_DROPOUT, PatternBatches, build_model, make_config, make_model,  # noqa: F401
                           max_abs_diff, max_list_diff)
from tests.support.launcher import run_ranks

# Let the forkserver import this module too, so ranks forked for these runs start with it loaded.
launcher.preload("tests.support.engine_runs")

DEFAULTS = dict(
    preset="micro", model="gpt", stage=0, dtype="fp32", world=2, steps=10, gas=1,
    global_batch=8, seq=16, lr=1e-2, eps=1e-6, clip=None, zero=(), fp16=(), perm=(),
)


def spec_of(**kw) -> dict:
    unknown = set(kw) - set(DEFAULTS)
    assert not unknown, unknown
    s = dict(DEFAULTS, **kw)
    s["zero"] = tuple(sorted(dict(s["zero"]).items()))
    s["fp16"] = tuple(sorted(dict(s["fp16"]).items()))
    s["perm"] = tuple(s["perm"])
    return s


# ----------------------------------------------------------------------------- config, model, data

def config_of(spec, world):
    rows = spec["global_batch"] // spec["gas"]
    assert rows % world == 0
    return make_config(spec["stage"], spec["dtype"], micro_batch=rows // world, gas=spec["gas"],
                       optimizer="AdamW", lr=spec["lr"], eps=spec["eps"], zero=spec["zero"],
                       fp16=spec["fp16"], clip=spec["clip"])


WEIGHT_DECAY = 0.1


def model_fn_of(spec):
    return functools.partial(make_model, spec["preset"], spec["model"], **NO_DROPOUT)


def build(spec, cfg):
    """(model, param groups): seed 0, the spec's model, Linear weights decaying by 0.1."""
    return build_model(model_fn_of(spec), cfg, 0, WEIGHT_DECAY)


def batches_of(spec) -> PatternBatches:
    from minizero.gpt.model import get_preset
    return PatternBatches(get_preset(spec["preset"]).vocab_size, spec["seq"], spec["global_batch"],
                          spec["gas"], spec["perm"])


# ----------------------------------------------------------------------------- ledger

def _ledger_delta(before, after):
    out = {}
    for k, v in after.items():
        b = before.get(k, {})
        d = {kk: vv - b.get(kk, 0) for kk, vv in v.items()}
        if any(d.values()):
            out[k] = d
    return out


def _ledger_state():
    from minizero import comm
    return ({op: dict(v) for op, v in comm.ledger.stats.items()},
            {k: dict(v) for k, v in comm.ledger.by_label.items()})


def _patch_dist(record):
    """Wrap torch.distributed's collectives (as comm.py calls them) to record the byte size
    of the tensors actually handed over, independently of the ledger. Returns the function
    that puts the originals back (the next run in the same ranks records afresh)."""
    import torch.distributed as dist
    originals = {}

    def wrap(name, op, pick):
        orig = originals[name] = getattr(dist, name)

        def f(*a, **k):
            t = pick(a, k)
            record[op]["calls"] += 1
            record[op]["bytes"] += t.numel() * t.element_size()
            return orig(*a, **k)
        setattr(dist, name, f)

    wrap("all_reduce", "all_reduce", lambda a, k: a[0] if a else k["tensor"])
    wrap("broadcast", "broadcast", lambda a, k: a[0] if a else k["tensor"])
    for name in torch_names("all_gather"):
        wrap(name, "all_gather", lambda a, k: a[0] if a else k["output_tensor"])
    for name in torch_names("reduce_scatter"):
        wrap(name, "reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k["input"])

    def restore():
        for name, orig in originals.items():
            setattr(dist, name, orig)
    return restore


def torch_names(op: str) -> list[str]:
    """torch.distributed's names for one collective in this torch: from 2.13 the gather and
    the reduce-scatter have two (comm.py calls the new *_single; DeepSpeed the old). The old
    name calls the new one inside torch, never through the module attribute, so wrapping
    both counts each call once."""
    import torch.distributed as dist
    names = {"all_gather": ("all_gather_into_tensor", "all_gather_single"),
             "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single")}.get(op, (op,))
    return [n for n in names if hasattr(dist, n)]


# ----------------------------------------------------------------------------- the run

def train_run(spec: dict) -> dict:
    """Train `steps` optimizer steps; return losses, norms, final fp32 weights and probes."""
    import minizero
    from minizero import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    dist_record = {op: {"calls": 0, "bytes": 0} for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter")}
    restore_dist = _patch_dist(dist_record) if world > 1 else (lambda: None)
    comm.ledger.reset()
    cfg = config_of(spec, world)
    model, groups = build(spec, cfg)
    batches = batches_of(spec)
    engine, *_ = minizero.initialize(model=model, model_parameters=groups, config=cfg)
    out = {"rank": rank, "world": world, "losses": [], "norms": [], "scales": [], "skipped": [],
           "flats": probes.flat_layout(engine), "memory_breakdown_init": engine.memory_breakdown()}
    live = probes.watch_live_grad_numel(engine)
    gathered_fwd = probes.watch_z3_gathered(engine) if spec["stage"] == 3 else {"max": 0}

    for step in range(spec["steps"]):
        if step == spec["steps"] - 1:
            ledger_before = _ledger_state()
        if spec["model"] != "gpt":
            model.use_side = step % 2 == 0
        tot = 0.0
        for m in range(spec["gas"]):
            loss = engine(*batches(step, m, rank, world))[1]
            engine.backward(loss)
            if step == 0 and m == spec["gas"] - 1:
                out["after_backward"] = probes.after_backward(engine)
            if step == spec["steps"] - 1 and m == spec["gas"] - 1:
                out["measured_after_backward"] = probes.measured_bytes(engine)
            engine.step()
            tot += float(loss.detach())
        out["losses"].append(tot / spec["gas"])
        out["norms"].append(engine.get_global_grad_norm())
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
    ledger_after = _ledger_state()
    out["comm_last_step"] = {"stats": _ledger_delta(ledger_before[0], ledger_after[0]),
                             "by_label": _ledger_delta(ledger_before[1], ledger_after[1])}
    out["max_live_grad_numel"] = live["max"]
    out["z3_max_gathered_fwd"] = gathered_fwd["max"]
    out["memory_breakdown"] = engine.memory_breakdown()
    out["measured_after_step"] = probes.measured_bytes(engine)
    if spec["stage"] == 3:
        out["z3_between_steps"] = probes.z3_between_steps(engine)
    out["ledger_total"] = comm.ledger.snapshot()
    restore_dist()
    out["dist_record"] = {op: dict(v) for op, v in dist_record.items()}
    out["global_steps"] = engine.global_steps
    state = engine.full_fp32_state_dict()
    out["state"] = state if rank == 0 else None
    return out


def reference_run(spec: dict) -> dict:
    """Plain single-process PyTorch, one tensor per parameter, written from the spec and not
    from minizero, in the engine's order of operations so the two compare BITWISE.

    Same model, data and AdamW. Each optimizer step's gradient is built from the
    micro-batches the spec's ranks see: g[r][m] = grad(loss[r][m] / gas) (a parameter that
    got none: zeros), summed in the order of the engine's collectives -- stages 0/1
    accumulate each rank's gradient over its micro-steps and then average the ranks,
    ZeRO-2/3 average the ranks every micro-step and then accumulate. An average of N = 2 ranks
    is a/2 + b/2: one addition, commutative, so the all-reduce and every reduce-scatter
    round alike; world 1 divides by nothing. (N > 2: gloo's ring adds in an order that
    depends on the chunk, which this does not copy.) Clipping as DeepSpeed does it:
    norm = sqrt(fp64 sum of squares, param group by group) rounded to fp32, factor
    clamp((norm + 1e-6) / clip, min=1), gradient * (1 / factor).
    `norms` are those fp32 norms; `norms64` the fp64 norm of the per-parameter fp64 norms,
    an order-independent check of them."""
    N, gas = spec["world"], spec["gas"]
    assert N <= 2, "the reference copies the reduction order of at most 2 ranks"
    model, groups = build(spec, config_of(spec, N))
    batches = batches_of(spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"], eps=spec["eps"])
    params = [p for g in groups for p in g["params"]]
    clip = 1.0 if spec["clip"] is None else spec["clip"]
    out = {"losses": [], "norms": [], "norms64": []}
    for step in range(spec["steps"]):
        if spec["model"] != "gpt":
            model.use_side = step % 2 == 0
        g = [[None] * gas for _ in range(N)]      # g[r][m]: one list of per-parameter grads
        local = [0.0] * N
        for m in range(gas):
            for r in range(N):
                loss = model(*batches(step, m, r, N))[1]
                got = torch.autograd.grad(loss.float() / gas, params, allow_unused=True)
                g[r][m] = [torch.zeros_like(p) if t is None else t for p, t in zip(params, got)]
                local[r] += float(loss.detach())

        def avg(ts):                               # the ranks' average, as the collectives do it
            return ts[0] if N == 1 else ts[0] / N + ts[1] / N

        def acc(ts):                               # accumulation over micro-steps, in order
            total = ts[0]
            for t in ts[1:]:
                total = total + t
            return total
        if spec["stage"] <= 1:
            grads = [avg([acc([g[r][m][i] for m in range(gas)]) for r in range(N)]) for i in range(len(params))]
        else:
            grads = [acc([avg([g[r][m][i] for r in range(N)]) for m in range(gas)]) for i in range(len(params))]
        out["norms64"].append(float(torch.linalg.vector_norm(torch.stack([t.double().norm() for t in grads]))))
        sq = torch.zeros((), dtype=torch.float64)
        k = 0
        for grp in groups:
            n = len(grp["params"])
            if n:
                sq += torch.cat([t.reshape(-1) for t in grads[k:k + n]]).double().pow(2).sum()
            k += n
        norm = sq.sqrt().float()
        if clip > 0:
            factor = torch.clamp(((norm / 1.0) + 1e-6) / clip, min=1.0) * 1.0
            for t in grads:
                t.mul_(1.0 / factor)
        for p, t in zip(params, grads):
            p.grad = t
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(sum(lr / gas for lr in local) / N)
        out["norms"].append(float(norm))
    out["state"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def overflow_run(stage: int) -> dict:
    """fp16, N ranks: step 0 clean; step 1 rank 1's loss is multiplied by inf; step 2 one
    element of rank 1's reduced gradient (grad_shard, right after zero.reduce_gradients) is
    set to inf; step 3 clean. Per step: did the fp32 weights move,
    loss scale, counters, optimizer step counts, and the "minizero" log lines emitted."""
    import logging

    import minizero
    from minizero import comm

    msgs = []

    class Capture(logging.Handler):
        def emit(self, record):
            msgs.append(record.getMessage())
    capture = Capture()
    logging.getLogger("minizero").addHandler(capture)

    spec = spec_of(stage=stage, dtype="fp16", steps=4, zero=Z3P0 if stage == 3 else {})
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = config_of(spec, world)
    model, groups = build(spec, cfg)
    batches = batches_of(spec)
    engine, *_ = minizero.initialize(model=model, model_parameters=groups, config=cfg)
    log = []
    for step in range(spec["steps"]):
        before = engine.full_fp32_state_dict()
        loss = engine(*batches(step, 0, rank, world))[1]
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        if step == 2 and rank == 1:
            # poison rank 1's *reduced* gradient right after the engine's reduction, so only
            # rank 1 can see it (at stage 0 nothing else is all-reduced: only the vote tells rank 0)
            probes.poison_reduced_grad(engine, stage)
        n = len(msgs)
        engine.step()
        probes.unpoison(engine)
        after = engine.full_fp32_state_dict()
        log.append(dict(
            loss=float(loss.detach()),
            changed=max_abs_diff(before, after),
            scale=engine.loss_scale, skipped=engine.skipped_steps, global_steps=engine.global_steps,
            opt_steps=probes.opt_step_counts(engine),
            grads_left=probes.grads_left(engine),
            norm=engine.get_global_grad_norm(),
            msgs=[m for m in msgs[n:]]))
    logging.getLogger("minizero").removeHandler(capture)   # the next run in these ranks logs afresh
    return {"rank": rank, "log": log}


# ZeRO-3 as the paper describes it: every parameter partitioned, each unit gathered before
# each use and freed after (prefetch and reuse off; DeepSpeed's defaults keep units gathered
# from forward to backward: minizero/prefetch.py)
Z3P0 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


# ----------------------------------------------------------------------------- cache

_cache: dict = {}


def _key(spec):
    return json.dumps(spec, sort_keys=True, default=str)


def run_many(jobs: list) -> list:
    """On each rank: every (kind, argument) of `jobs` one after another in this process, kind
    "train" (train_run(spec)), "reference" (reference_run(spec)) or "overflow"
    (overflow_run(stage)). Each run builds its own engine, model, optimizer and data from its
    seed and config; minizero patches nothing process-wide; the comm ledger is reset and the
    wrapped collectives put back (_patch_dist) by each train_run, and overflow_run removes its
    log handler: so a run returns what it returns in processes of its own (every field checked
    equal, bit for bit, for every spec of test_engine, test_comm_volume, test_memory and
    test_overflow: the commit that added run_many says how). One launch of ranks costs about
    a second of CPU, several times a 2-step run of the micro GPT."""
    fns = {"train": train_run, "reference": reference_run, "overflow": overflow_run}
    return [fns[kind](arg) for kind, arg in jobs]


def _launch(world: int, jobs: list) -> list:
    """run_many(jobs) on `world` ranks (one rank: with a process group, as a user's single
    process under torchrun has); per job, the list of the ranks' results."""
    env = {"MINIZERO_FORCE_PG": "1"} if world == 1 else None
    per_rank = run_ranks(run_many, world, args=(jobs,), env=env)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(jobs))]


def prefetch(specs=(), references=(), overflow_stages=()) -> None:
    """Run, in one launch per world size, every train run (`specs`: dicts of spec_of's keywords),
    reference run (`references`, on one rank) and overflow run (`overflow_stages`, 2 ranks)
    not cached yet, and cache them for get / get_reference / get_overflow. A test file calls
    it once (a module fixture) with every run its tests read, instead of a launch per run."""
    todo: dict = {}
    for kw in specs:
        spec = spec_of(**kw)
        k = _key(spec)
        if k not in _cache:
            todo.setdefault(spec["world"], {})[k] = ("train", spec)
    for kw in references:
        spec = reference_spec(**kw)
        k = "ref:" + _key(spec)
        if k not in _cache:
            todo.setdefault(1, {})[k] = ("reference", spec)
    for stage in overflow_stages:
        k = f"overflow:{stage}"
        if k not in _cache:
            todo.setdefault(2, {})[k] = ("overflow", stage)
    for world, jobs in todo.items():
        results = _launch(world, list(jobs.values()))
        for k, per_rank in zip(jobs, results):
            _cache[k] = per_rank[0] if k.startswith("ref:") else per_rank


def get(**kw) -> list[dict]:
    """Per-rank results of train_run for this spec (cached for the pytest session)."""
    prefetch(specs=[kw])
    return _cache[_key(spec_of(**kw))]


def get_overflow(stage: int) -> list[dict]:
    prefetch(overflow_stages=[stage])
    return _cache[f"overflow:{stage}"]


def reference_spec(**kw) -> dict:
    """spec_of(**kw) as reference_run reads it: of the stage only its order of sums (stages
    0/1: accumulate, then average the ranks; ZeRO-2/3: average, then accumulate), and none of
    the zero_optimization keys. Stage 1 is stage 0's computation and ZeRO-3 (any knobs)
    ZeRO-2's, so specs that differ only there share one reference run."""
    spec = spec_of(**kw)
    spec["stage"] = 0 if spec["stage"] <= 1 else 2
    spec["zero"] = ()
    return spec


def get_reference(**kw) -> dict:
    prefetch(references=[kw])
    return _cache["ref:" + _key(reference_spec(**kw))]


# ----------------------------------------------------------------------------- helpers for tests

def global_losses(results) -> list[float]:
    """Mean over ranks of each rank's per-step loss = the loss over the global batch."""
    n = len(results)
    return [sum(r["losses"][i] for r in results) / n for i in range(len(results[0]["losses"]))]


def isfinite_all(xs) -> bool:
    return all(math.isfinite(x) for x in xs)
