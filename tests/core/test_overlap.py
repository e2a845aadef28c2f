"""Overlap and prefetch (buckets.py, prefetch.py): faster, never different.

- Losses, gradient norms and the final fp32 state are bit-identical with overlap_comm and
  ZeRO-3 prefetch/reuse on and off, at every stage, fp32 and bf16, with gradient
  accumulation, activation checkpointing, several buckets and parameters that get no
  gradient on some steps. They must be: the same buffers go through the same collectives,
  only earlier, and a gather writes the same bytes whenever it runs.
- The knobs do what they say: overlap issues asynchronous reductions from the backward
  hooks; prefetch issues gathers ahead (`.prefetch` labels); reuse removes the backward
  gathers (DeepSpeed's defaults: 2Ψ gathered per step instead of 3Ψ); a changed execution
  order invalidates the trace and stays correct.
- Gathered elements never exceed stage3_max_live_parameters (FlatParam's counter).

Every minizero run of the file is trained in one launch of two ranks (the `runs` fixture:
`_many`), DeepSpeed's in another, rather than a launch per run: each run builds its own
engine from its own seed and config, puts back what it wrapped (probes.unwatch_live_numel) or
counts into its own dict (_volume), so it returns in a shared launch what it returns alone
(checked, every field, when the fixture was written); a launch of two ranks costs about a
second of CPU.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.support import probes
from tests.support.harness import NO_DROPOUT, PatternBatches, make_config, make_model, micro_engine, train_step
from tests.support.launcher import run_ranks

OFF = {"overlap_comm": False, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
ON = {"overlap_comm": True, "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 1_000_000_000}


def _train(stage: int, dtype: str, knobs: dict, gas: int = 2, ckpt: bool = False, steps: int = 4,
           zero_extra=None, branch_step=None, evaluate: bool = False):
    """Train the micro GPT with unused parameters (GPTWithUnused: `side` used on even steps
    only) for `steps` steps. Returns losses, norms, a hash of the final fp32 state, the
    ledger by label of the last step, and the peak of live gathered elements."""
    from minizero import comm

    zero = {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0, **knobs, **(zero_extra or {})}
    cfg = make_config(stage, dtype, micro_batch=2, lr=1e-2, gas=gas, ckpt=ckpt, zero=zero)
    engine, model = micro_engine(cfg, "unused", **NO_DROPOUT)
    batches = PatternBatches(62, 16, global_batch=2 * comm.get_world_size() * gas, gas=gas)
    losses, norms = [], []
    live = probes.watch_live_numel()
    for step in range(1, steps + 1):
        model.use_side = step % 2 == 0 if branch_step is None else step == branch_step
        before = {k: dict(v) for k, v in comm.ledger.by_label.items()}
        losses += train_step(engine, batches, step, gas)
        norms.append(engine.get_global_grad_norm())
        if evaluate:   # a forward without backward (the step's last micro-batch), as the trainer's test loss
            x, y = batches(step, gas - 1, comm.get_rank(), comm.get_world_size())
            with torch.no_grad():
                _, eval_loss = engine(x, y)
            losses.append(eval_loss.item())
            assert live["now"] == 0, "an evaluation forward left units gathered"
    last = {k: v["calls"] - before.get(k, {"calls": 0})["calls"] for k, v in comm.ledger.by_label.items()}
    probes.unwatch_live_numel()
    state = engine.full_fp32_state_dict()
    digest = torch.cat([state[k].reshape(-1) for k in sorted(state)])
    return {"losses": losses, "norms": norms, "state": digest, "last_step_calls": {k: v for k, v in last.items() if v},
            "peak_live": live["peak"],
            "unit_numel": max((u.partitioned_numel for u in getattr(engine.zero, "buckets", [])
                               if hasattr(u, "partitioned_numel")), default=0)}


CASES = [(0, "fp32", 2, False), (1, "bf16", 2, False), (2, "fp32", 2, True), (2, "bf16", 1, False),
         (3, "fp32", 2, False), (3, "bf16", 2, True), (3, "bf16", 1, False)]


def _job(fn: str, *args, **kwargs):
    """One run of the `runs` fixture: this module's function `fn` with these arguments."""
    return (fn, args, kwargs)


def _key(job) -> str:
    return json.dumps(job, sort_keys=True)


def _many(jobs: list) -> list:
    """On each rank: every job, one after another in this process."""
    return [globals()[fn](*args, **kwargs) for fn, args, kwargs in jobs]


def _pair(stage, dtype, **kw):
    """The same run with the knobs off and on."""
    return _job("_train", stage, dtype, OFF, **kw), _job("_train", stage, dtype, ON, **kw)


PAIRS = {**{case: _pair(case[0], case[1], gas=case[2], ckpt=case[3]) for case in CASES},
         "reuse": _pair(3, "fp32", gas=1),
         "branch": _pair(3, "bf16", gas=1, steps=5, branch_step=3),
         "evaluate": _pair(3, "fp32", gas=1, steps=4, evaluate=True)}
PEAK = _job("_peak_live_runs")
OVERLAP_PROBE = _job("_overlap_probe", 1)
VOLUME_KNOBS = {"deepspeed-defaults": {}, "knobs-0": OFF}
VOLUMES = {lib: [_job("_volume", lib, 3, 4, knobs) for knobs in VOLUME_KNOBS.values()] for lib in ("minizero", "deepspeed")}


@pytest.fixture(scope="module")
def runs():
    """Every run of the file, key (_key) -> the ranks' results: minizero's in one launch of
    two ranks, DeepSpeed's in another."""
    import importlib.util
    launches = [[job for pair in PAIRS.values() for job in pair] + [PEAK, OVERLAP_PROBE] + VOLUMES["minizero"]]
    if importlib.util.find_spec("deepspeed") is not None:
        launches.append(VOLUMES["deepspeed"])
    out = {}
    for jobs in launches:
        per_rank = run_ranks(_many, 2, args=(jobs,), env={"DS_ACCELERATOR": "cpu"})
        out.update({_key(job): [r[i] for r in per_rank] for i, job in enumerate(jobs)})
    return out


def _pair_of(runs, name):
    return [runs[_key(job)] for job in PAIRS[name]]


@pytest.mark.parametrize("stage,dtype,gas,ckpt", CASES)
def test_bit_identical_with_overlap_and_prefetch_on_and_off(runs, stage, dtype, gas, ckpt):
    off, on = _pair_of(runs, (stage, dtype, gas, ckpt))
    for a, b in zip(off, on):
        assert a["losses"] == b["losses"]
        assert a["norms"] == b["norms"]
        assert torch.equal(a["state"], b["state"])
    labels = set(on[0]["last_step_calls"])
    if stage == 3:
        assert any(".prefetch" in k for k in labels), labels          # gathers were issued ahead
        assert not any(k.endswith(".bwd") and k.startswith("all_gather") for k in labels
                       if ".prefetch" not in k) or ckpt, labels       # reuse: no on-demand backward gather
    assert any(k.startswith("all_gather") and k.endswith(".bwd") for k in off[0]["last_step_calls"]) == (stage == 3)


def test_reuse_gathers_each_unit_once_per_step_and_knobs_off_twice(runs):
    """The paper's ZeRO-3 gathers every unit for forward and again for backward (3Ψ per
    step); DeepSpeed's default reuse distance keeps each unit from its forward to its
    backward (2Ψ): docs/deepspeed.md, "ZeRO-3's defaults keep a small model gathered"."""
    off, on = (r[0]["last_step_calls"] for r in _pair_of(runs, "reuse"))
    gathers = lambda calls: sum(v for k, v in calls.items() if k.startswith("all_gather") and ".init" not in k
                                and not k.endswith(".persist.params"))
    units = {k.split(":")[1].rsplit(".", 1)[0] for k in off if k.startswith("all_gather")}
    assert gathers(off) == 2 * len(units)
    assert gathers(on) == len(units)


def _peak_live_runs():
    """On each rank: the ZeRO-3 run with the knobs on (3 steps), then the same under two
    stage3_max_live_parameters limits sized from its unit: (base, [(limit, run), ...])."""
    base = _train(3, "fp32", ON, gas=1, steps=3)
    unit = base["unit_numel"]
    limits = (2 * unit + unit // 2, 3 * unit)    # room for the root and a block, plus a bit
    return base, [(limit, _train(3, "fp32", dict(ON, stage3_max_live_parameters=limit), gas=1, steps=3))
                  for limit in limits]


def test_peak_live_parameters_never_exceed_the_limit(runs):
    per_rank = runs[_key(PEAK)]
    bases = [base for base, _ in per_rank]
    base, unit = bases[0], bases[0]["unit_numel"]
    for i, limit in enumerate((2 * unit + unit // 2, 3 * unit)):
        r = [limited[i] for _, limited in per_rank]
        for (lim, rank), b in zip(r, bases):
            assert lim == limit
            assert rank["peak_live"] <= limit, (rank["peak_live"], limit)
            assert rank["losses"] == b["losses"]
    assert base["peak_live"] > 2 * unit + unit // 2  # unlimited, the default keeps more gathered: the limit bit


def test_a_changed_execution_order_falls_back_and_stays_exact(runs):
    """`side` is used on step 3 only: the recorded trace no longer matches; the prefetcher
    invalidates it, gathers on demand, and the numbers equal the on-demand run's."""
    off, on = _pair_of(runs, "branch")
    assert [r["losses"] for r in off] == [r["losses"] for r in on]
    assert all(torch.equal(a["state"], b["state"]) for a, b in zip(off, on))


def test_an_evaluation_forward_between_steps_stays_exact_and_frees_everything(runs):
    off, on = _pair_of(runs, "evaluate")
    assert [r["losses"] for r in off] == [r["losses"] for r in on]
    assert all(torch.equal(a["state"], b["state"]) for a, b in zip(off, on))


def test_overlap_reduces_from_the_hooks_asynchronously(runs):
    """With overlap_comm the stage-0/1/2 reductions are issued during backward as each bucket
    fills (a Pending per bucket), and all are done when backward returns."""
    r = runs[_key(OVERLAP_PROBE)]
    assert r[0]["issued_in_backward"] > 1 and r[0]["in_flight_after_backward"] == 0


def _overlap_probe(stage: int):
    from minizero import comm

    cfg = make_config(stage, "fp32", micro_batch=2, lr=1e-2, zero={"reduce_bucket_size": 3000, "overlap_comm": True})
    engine, _ = micro_engine(cfg)
    seen = {"issued": 0}
    real_issue = engine.zero.grad_buckets.issue

    def issue(bucket, *args, **kwargs):
        seen["issued"] += 1
        real_issue(bucket, *args, **kwargs)
    engine.zero.grad_buckets.issue = issue
    x, y = PatternBatches(62, 16, global_batch=4)(1, 0, comm.get_rank(), 2)
    _, loss = engine(x, y)
    engine.zero.prepare_backward(True)   # what engine.backward does first; then backward itself
    loss.backward()
    issued_in_backward = seen["issued"]
    engine.zero.finish_backward()
    return {"issued_in_backward": issued_in_backward, "in_flight_after_backward": len(engine.zero.grad_buckets.in_flight)}


# ----------------------------------------------------------------------------- the volume DeepSpeed moves

_COUNTING: dict = {}    # "seen": the op -> bytes of the _volume run now counting in this process


def _count_collectives() -> None:
    """Wrap torch.distributed's gathers and reduce-scatters, once per process, to add the
    bytes each call is handed to _COUNTING["seen"]. Once: DeepSpeed keeps the function it
    found at its first collective (measured: a second run's wrappers saw none of its calls,
    the first run's saw them all), so every run of the process counts through the first
    wrappers, each into its own dict."""
    import torch.distributed as dist

    from tests.support.engine_runs import torch_names
    if _COUNTING.get("installed"):
        return
    picks = {"all_gather": lambda a, k: a[0] if a else k["output_tensor"],
             "reduce_scatter": lambda a, k: a[1] if len(a) > 1 else k["input"]}
    for name, op, pick in ((name, op, pick) for op, pick in picks.items() for name in torch_names(op)):
        orig = getattr(dist, name)

        def f(*a, _orig=orig, _op=op, _pick=pick, **k):
            if _COUNTING.get("seen") is not None:
                t = _pick(a, k)
                _COUNTING["seen"][_op] += t.numel() * t.element_size()
            return _orig(*a, **k)
        setattr(dist, name, f)
    _COUNTING["installed"] = True


class _BytesPerStep:
    """Drives the engine for harness.run's loop (as tests/support/two_nodes.py's PhaseRecorder
    does) and copies the bytes counted so far after each engine.step()."""

    def __init__(self, engine, seen):
        self.engine, self.seen, self.after_step = engine, seen, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *a, **k):
        return self.engine(*a, **k)

    def backward(self, loss):
        return self.engine.backward(loss)

    def step(self):
        out = self.engine.step()
        self.after_step.append(dict(self.seen))
        return out

    def result(self) -> dict:
        return {"after_step": self.after_step}


def _volume(lib: str, stage: int, steps: int, knobs: dict):
    """The bytes handed to torch.distributed's collectives on this rank from initialize to
    the end of each of `steps` steps (gradient accumulation 1: one engine.step() a step):
    a list of (op -> bytes), one per step."""
    import functools

    from tests.support.harness import SyntheticBatches, run
    _count_collectives()
    seen = _COUNTING["seen"] = {"all_gather": 0, "reduce_scatter": 0}
    # even sizes everywhere (n_embd 16, vocab 62, 16 positions): no padding in either library at N = 2
    model_fn = functools.partial(make_model, "micro", n_embd=16, n_head=2, block_size=16,
                                 embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    cfg = make_config(stage, "bf16", micro_batch=2, lr=1e-3, zero={"stage3_param_persistence_threshold": 0, **knobs})
    try:
        out = run(lib, model_fn, cfg, SyntheticBatches(62, 16, 2, seed=3), steps, return_final_state=False,
                  drive=lambda engine: _BytesPerStep(engine, seen))
    finally:
        _COUNTING["seen"] = None
    assert len(out["after_step"]) == steps
    return out["after_step"]


@pytest.mark.parametrize("knobs", list(VOLUME_KNOBS))
def test_zero3_moves_what_deepspeed_moves(runs, knobs):
    """ZeRO-3's gathers and reduce-scatters per steady step (steps 3-4: the bytes counted by
    the end of step 4 less those by the end of step 2, which leaves out setup and the
    trace-recording first step) equal DeepSpeed's, byte for byte, with DeepSpeed's default
    knobs (reuse keeps every unit from its forward to its backward: one gather per step) and
    with the knobs at 0 (two)."""
    pytest.importorskip("deepspeed")
    per_lib = {}
    for lib in ("minizero", "deepspeed"):
        after_step = runs[_key(_job("_volume", lib, 3, 4, VOLUME_KNOBS[knobs]))][0]
        two, four = after_step[1], after_step[3]
        per_lib[lib] = {op: four[op] - two[op] for op in four}
    assert per_lib["minizero"] == per_lib["deepspeed"], per_lib
    gathered, reduced = per_lib["minizero"]["all_gather"], per_lib["minizero"]["reduce_scatter"]
    assert gathered == (1 if not VOLUME_KNOBS[knobs] else 2) * reduced    # reduce_scatter: Ψ per step, in both libraries


def test_the_gpu_checks_overlap_configs_differ_only_in_when_data_moves():
    """launch/gpu_check.py's overlap-z* checks compare these two configs bit for bit on NCCL."""
    import json
    on, off = (json.load(open(f"docs/lesson/overlap_{k}.json")) for k in ("on", "off"))
    moves = {"overlap_comm", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance"}
    assert {k: v for k, v in on["zero_optimization"].items() if k not in moves} == \
        {k: v for k, v in off["zero_optimization"].items() if k not in moves}
    assert {k: v for k, v in on.items() if k != "zero_optimization"} == \
        {k: v for k, v in off.items() if k != "zero_optimization"}
    assert on["zero_optimization"]["overlap_comm"] and not off["zero_optimization"]["overlap_comm"]
