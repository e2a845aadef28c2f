"""ZeRO-Offload in minizero (minizero/offload/host.py): offload moves numbers, it must not change them.

One launch of 2 gloo ranks trains the micro GPT with every offload combination beside the
same run without offload, and asserts:

- bit identity: losses, gradient norms, loss scales, skipped steps and the final fp32
  weights are equal bit for bit, at stages 1-3, in fp32/bf16/fp16, with gradient
  accumulation, with clipping firing on every step, and through fp16 overflows. On a CPU
  device the host runs the very same fp32 operations on the same values (the norm is taken
  on the device before any copy), so nothing may differ. torch_adam is set, so both runs use
  torch's default Adam; without it offload picks the fused CPU Adam (build_optimizer);
- bytes: memory_breakdown() equals memory.expected_bytes(...) exactly, per category and
  place; offload_optimizer moves exactly 12Ψ/N (mixed; 8Ψ/N from the device in fp32, whose
  host master is a copy) and offload_param the partitioned shard;
- copies: per step, d2h = this rank's gradient shard bytes, h2d = its parameter shard bytes
  (offload_optimizer); with offload_param every gather of a unit copies the unit's shard
  host -> device first (2 per step: forward, backward).

The checkpoint runs (save with one offload, resume with another) train in the same launch,
after those (the `launch` fixture): each run builds its engine from its own config and seed
and writes to its own folder, so it returns there what it returns alone (checked when the
fixture was written); a launch of two ranks costs about a second of CPU.
"""
from __future__ import annotations

import functools

import pytest
import torch

from minizero import memory
from tests.support.harness import PatternBatches, make_config, make_model
from tests.support.launcher import run_ranks

N, STEPS, GLOBAL_BATCH, SEQ, GAS = 2, 3, 8, 16, 2
MODEL = functools.partial(make_model, "micro", "gpt", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
BATCHES = PatternBatches(62, SEQ, GLOBAL_BATCH, gas=GAS)
# Stage-3 runs partition every parameter (threshold 0) except in "mixed_persist", where the
# 21x21-and-smaller tensors of the micro GPT stay persistent (gathered on the device).
PERSIST = {"all": 0, "mixed_persist": 500}

OPT, PAR = {"offload_optimizer": {"device": "cpu"}}, {"offload_param": {"device": "cpu"}}


def cases():
    out = []
    for dtype in ("fp32", "bf16", "fp16"):
        for stage in (1, 2):
            out.append((stage, dtype, "all", {}))
            out.append((stage, dtype, "all", OPT))
        for persist in PERSIST:
            out.append((3, dtype, persist, {}))
            out += [(3, dtype, persist, off) for off in (OPT, PAR, {**OPT, **PAR})]
    return out


def key(stage, dtype, persist, offload):
    return f"s{stage}-{dtype}-{persist}-" + ("+".join(sorted(k.split("_")[1] for k in offload)) or "none")


def _run_all(specs):
    from tests.support.harness import run_minizero
    out = {}
    for stage, dtype, persist, offload in specs:
        # ZeRO-3 on demand (prefetch and reuse off): the copy counts below are per gather
        zero = {**offload, "stage3_param_persistence_threshold": PERSIST[persist],
                "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
        # clip 0.05: the clip factor fires on every step; fp16 starts at 2^18 so the first two
        # steps overflow and are skipped (the vote must see the same overflow either way) and
        # the third, at a halved scale, trains. 3 steps: the argument (the same operations on
        # the same values, step after step) needs a step that reads Adam's moments and the
        # clip factor of an earlier one, which the second step already does; 2^20 took 4
        # steps to reach the same overflows-then-train (3 skipped, 1 trained)
        cfg = make_config(stage, dtype, micro_batch=GLOBAL_BATCH // GAS // N, lr=3e-3, gas=GAS, zero=zero,
                          clip=0.05, fp16={"initial_scale_power": 18} if dtype == "fp16" else ())
        r = run_minizero(MODEL, cfg, BATCHES, STEPS, capture_memory=True)
        r.pop("config")
        out[key(stage, dtype, persist, offload)] = r
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The one launch of the file: (per rank: key -> _run_all's run; per rank: the checkpoint
    runs' results, RESUMES' order)."""
    root = tmp_path_factory.mktemp("offload_resume")
    jobs = [(*job, str(root / str(i))) for i, job in enumerate(RESUMES)]
    per_rank = run_ranks(_run_all_then_resume, N, args=(cases(), jobs), timeout=900)
    return [runs for runs, _ in per_rank], [resumed for _, resumed in per_rank]


@pytest.fixture(scope="module")
def runs(launch):
    return launch[0]


def _run_all_then_resume(specs, resume_jobs):
    """On each rank: _run_all(specs), then _save_then_resume(*job) for each job."""
    return _run_all(specs), [_save_then_resume(*job) for job in resume_jobs]


def _resumed(launch, job):
    """The ranks' (whole, first, rest) of one of RESUMES."""
    return [per_rank[RESUMES.index(job)] for per_rank in launch[1]]


def pairs():
    for stage, dtype, persist, offload in cases():
        if offload:
            yield key(stage, dtype, persist, {}), key(stage, dtype, persist, offload), (stage, dtype, persist, offload)


@pytest.mark.parametrize("off,on", [(a, b) for a, b, _ in pairs()], ids=[b for _, b, _ in pairs()])
def test_offload_changes_no_bit(runs, off, on):
    for rank in range(N):
        a, b = runs[rank][off], runs[rank][on]
        for k in ("losses", "grad_norms", "loss_scales", "lrs", "skipped_steps", "global_steps"):
            assert a[k] == b[k], (k, rank)
        assert a["final_state"].keys() == b["final_state"].keys()
        for name in a["final_state"]:
            assert torch.equal(a["final_state"][name], b["final_state"][name]), (name, rank)
    if "fp16" in on:
        skipped = runs[0][on]["skipped_steps"]
        assert 0 < skipped < STEPS, f"the fp16 runs must overflow at least once and then train: {skipped} skipped"


def _expected(r, stage, dtype, offload):
    lay = r["layout"]
    return memory.expected_bytes([f["numel"] for f in lay], N, stage, mixed=dtype != "fp32",
                                 persistent=[f["persistent"] and stage == 3 for f in lay],
                                 offload_optimizer="offload_optimizer" in offload,
                                 offload_param="offload_param" in offload)


@pytest.mark.parametrize("spec", cases(), ids=[key(*c) for c in cases()])
def test_memory_breakdown_is_the_formula_by_place(runs, spec):
    stage, dtype, persist, offload = spec
    for rank in range(N):
        r = runs[rank][key(*spec)]
        exp = _expected(r, stage, dtype, offload)
        for when in ("after_init", "after_step"):
            got = r["memory"][when] if when == "after_init" else r["memory"][when][-1]
            assert got == exp, (when, rank)


@pytest.mark.parametrize("stage,dtype", [(s, d) for s in (1, 2, 3) for d in ("fp32", "bf16", "fp16")])
def test_offload_optimizer_moves_exactly_the_optimizer_shard(runs, stage, dtype):
    off = runs[0][key(stage, dtype, "all", {})]["memory"]["after_init"]
    on = runs[0][key(stage, dtype, "all", OPT)]["memory"]["after_init"]
    shard = sum(f["shard"] for f in runs[0][key(stage, dtype, "all", {})]["layout"])   # Ψ/N with padding
    saved = memory.total(off["device"]) - memory.total(on["device"])
    gained = memory.total(on["host"]) - memory.total(off["host"])
    if dtype == "fp32":
        assert (saved, gained) == (8 * shard, 12 * shard)   # the device keeps its fp32 shard
    else:
        assert saved == gained == 12 * shard
    assert memory.total(off["host"]) == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_offload_param_moves_the_partitioned_shard(runs, dtype):
    for persist in PERSIST:
        lay = runs[0][key(3, dtype, persist, {})]["layout"]
        partitioned = sum(f["shard"] for f in lay if not f["persistent"]) * 2
        off = runs[0][key(3, dtype, persist, OPT)]["memory"]["after_init"]
        on = runs[0][key(3, dtype, persist, {**OPT, **PAR})]["memory"]["after_init"]
        assert memory.total(off["device"]) - memory.total(on["device"]) == partitioned
        assert memory.total(on["host"]) - memory.total(off["host"]) == partitioned
        assert on["device"]["params"] == sum(f["padded"] for f in lay if f["persistent"]) * 2
    assert partitioned > 0


def _copies(r, direction):
    return {k.split(":", 1)[1]: v for k, v in r["comm"].items() if k.startswith(direction + ":")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_copies_are_counted_per_step(runs, dtype):
    """offload_optimizer at ZeRO-2: per optimizer step, one d2h of each gradient shard and one
    h2d of each new parameter shard, in the training dtype (the ledger starts after init)."""
    r = runs[0][key(2, dtype, "all", OPT)]
    esize = 4 if dtype == "fp32" else 2
    shard_bytes = sum(f["shard"] for f in r["layout"]) * esize
    d2h, h2d = _copies(r, "d2h"), _copies(r, "h2d")
    assert all(k.endswith(".grads") for k in d2h) and all(k.endswith(".params") for k in h2d)
    assert sum(v["bytes"] for v in d2h.values()) == STEPS * shard_bytes
    assert sum(v["bytes"] for v in h2d.values()) == STEPS * shard_bytes
    assert not _copies(runs[0][key(2, dtype, "all", {})], "d2h")


def test_offload_param_copies_each_gather(runs):
    """ZeRO-3 with offload_param alone: every gather of a partitioned FlatParam first copies
    its shard to the device (forward and backward: 2 per micro-step), and the step writes
    the new shard back to the host (1 per optimizer step). Nothing else moves."""
    r = runs[0][key(3, "bf16", "all", PAR)]
    lay = {f["label"]: f for f in r["layout"]}
    h2d, d2h = _copies(r, "h2d"), _copies(r, "d2h")
    micro_steps = STEPS * GAS
    gathers = {k: v for k, v in r["comm"].items() if k.startswith("all_gather:") and not k.endswith(".persist")}
    assert sum(v["calls"] for v in h2d.values()) == sum(v["calls"] for v in gathers.values()) \
        == 2 * micro_steps * len(lay)
    for label, f in lay.items():
        assert d2h[f"{label}.params"] == {"calls": STEPS, "bytes": STEPS * f["shard"] * 2}


def test_bad_offload_configs_are_one_line_errors():
    from minizero.config import ConfigError, load_config
    base = {"train_batch_size": 8}
    for zero, needle in [({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "needs zero_optimization.offload_optimizer.nvme_path"),
                         ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs stage 3"),
                         ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs stage 1, 2 or 3")]:
        with pytest.raises(ConfigError, match=needle) as e:
            load_config({**base, "zero_optimization": zero}, 1)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- checkpoints

def _save_then_resume(stage, dtype, saved, resumed, torch_adam, d):
    """tests/tools/test_checkpoint_io.py's run (micro GPT, dropout on, WarmupLR, fp16 with a moving
    scale) with offload `saved` while saving at step 3 and `resumed` when resuming."""
    from tests.tools.test_checkpoint_io import checkpoint_config, train_checkpointed
    cfg = lambda offload: checkpoint_config(stage, dtype, zero=offload, torch_adam=torch_adam)
    whole = train_checkpointed(stage, dtype, 6, None, config=cfg(resumed))
    first = train_checkpointed(stage, dtype, 3, d, save_at=3, config=cfg(saved))
    rest = train_checkpointed(stage, dtype, 6, d, resume=True, config=cfg(resumed))
    return whole, first, rest


BOTH = {**OPT, **PAR}
ACROSS = [(3, "fp16", BOTH, BOTH), (3, "bf16", BOTH, {}), (3, "bf16", {}, BOTH), (2, "fp32", OPT, {}), (1, "fp16", {}, OPT)]
ADAMS = [(OPT, {}, (None, None)), ({}, OPT, (True, None))]     # saved, resumed, the resumed run's Adam
# every checkpoint run of the file: (stage, dtype, saved, resumed, torch_adam)
RESUMES = [(*case, True) for case in ACROSS] + [(2, "bf16", saved, resumed, False) for saved, resumed, _ in ADAMS]


@pytest.mark.parametrize("stage,dtype,saved,resumed", ACROSS,
                         ids=["s3-fp16-on-on", "s3-bf16-on-off", "s3-bf16-off-on", "s2-fp32-on-off", "s1-fp16-off-on"])
def test_resume_across_offload_is_bit_exact(launch, stage, dtype, saved, resumed):
    """A checkpoint saved with offload resumes without it and the other way round, and the
    resumed run continues bit for bit as the run that never stopped (offload changes no bit)."""
    for whole, first, rest in _resumed(launch, (stage, dtype, saved, resumed, True)):
        assert first[0] + rest[0] == whole[0]
        assert whole[2] == rest[2]
        assert all(torch.equal(whole[1][k], rest[1][k]) for k in whole[1])


def test_resume_keeps_this_runs_adam(launch):
    """Without torch_adam, offload runs torch's fused CPU Adam (as DeepSpeed runs its own CPU
    Adam); a checkpoint saved with it resumes on the default Adam without offload, and the
    other way round: each run keeps its own implementation (torch would adopt the saved one)."""
    for saved, resumed, want in ADAMS:
        for whole, first, rest in _resumed(launch, (2, "bf16", saved, resumed, False)):
            assert first[4] == [(True, None) if saved else (None, None)] * len(first[4])
            assert rest[4] == [want] * len(rest[4])
            assert all(a == a for a in rest[0]) and len(rest[0]) == 3   # finite, resumed at step 3


# ----------------------------------------------------------------------------- CUDA (launch/gpu_check.py)

def _cuda_engine(offload, dtype="bf16", stage=3):
    """One process, world size 1, on the GPU (minizero's single-process path)."""
    import minizero
    torch.manual_seed(0)
    model = make_model("micro", "gpt", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    cfg = make_config(stage, dtype, micro_batch=8, lr=3e-3, zero={**offload, "stage3_param_persistence_threshold": 0})
    engine, *_ = minizero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _cuda_step(engine):
    x = torch.randint(0, 62, (8, SEQ + 1), generator=torch.Generator().manual_seed(3))
    loss = engine(x[:, :-1], x[:, 1:])[1]
    engine.backward(loss)
    engine.step()
    return float(loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_places_pins_and_copies():
    """On a GPU: masters, moments and (offload_param) shards in pinned host memory, the
    gathered parameters on the GPU, and one step's copies counted each way."""
    from minizero import comm
    engine = _cuda_engine({**OPT, **PAR})
    opt = engine.sharded_optimizer
    for m in opt.masters:
        assert m.device.type == "cpu" and m.is_pinned() and m.dtype == torch.float32
    for st in opt.optimizer.state.values():
        assert st["exp_avg"].device.type == "cpu"
    for f in engine.zero.flat_params:
        assert f.shard.device.type == "cpu" and f.shard.is_pinned() and f.full.device.type == "cuda"
    before = comm.ledger.snapshot()
    _cuda_step(engine)
    after = comm.ledger.snapshot()
    moved = {op: after[op]["bytes"] - before[op]["bytes"] for op in ("d2h", "h2d")}
    shards = sum(f.shard_numel for f in engine.zero.flat_params) * 2
    # d2h: gradient shards; h2d: each unit's shard before its forward and backward gathers
    assert moved == {"d2h": shards, "h2d": 2 * shards}
    assert all(torch.isfinite(m).all() for m in opt.masters)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_step_matches_the_gpu_step_to_adam_rounding():
    """One step with Adam on the CPU (offload) vs on the GPU: the same fp32 operations on the
    same gradient (the norm and the clip factor are computed identically), rounded by two
    implementations. Bound per element, derived: Adam's update u = lr * m_hat/(sqrt(v_hat)+eps)
    takes <= 12 rounded fp32 operations (each relative error <= 2^-24) on each side, so the
    two updates differ by <= 2 * 12 * 2^-24 * |u| <= 2^-19 * lr (|m_hat/sqrt(v_hat)| <= 1 on
    the first step); adding u to the master rounds once on each side (<= 1 ulp of the master
    apart). No accumulation: one step."""
    lr = 3e-3
    a, b = _cuda_engine({}, dtype="fp32", stage=2), _cuda_engine(OPT, dtype="fp32", stage=2)
    assert _cuda_step(a) == _cuda_step(b)                  # same weights, same forward
    sa, sb = a.full_fp32_state_dict(), b.full_fp32_state_dict()
    for k in sa:
        w = sa[k].double()
        ulp = torch.finfo(torch.float32).eps * w.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((sb[k].double() - w).abs() <= ulp + 2.0 ** -19 * lr).all(), k


# ----------------------------------------------------------------------------- memory_table

def test_memory_table_prints_device_and_host(capsys):
    """`python -m minizero.memory_table --offload both`: stage 0 holds everything on the device;
    at stages 1-3 the host holds the optimizer shard (12Ψ/N with padding), and at stage 3
    the parameter shard too; device + host = total on every row."""
    from minizero.observe import memory_table
    memory_table.main(["--model", "micro", "--nproc", "2", "--offload", "both"])
    rows = [ln.split("|")[1:-1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 2 |")]
    num = lambda c: int(c.strip().split(" ")[0].replace(",", ""))
    by_stage = {int(r[1]): (num(r[6]), num(r[7]), num(r[8])) for r in rows}
    assert sorted(by_stage) == [0, 1, 2, 3]
    for stage, (tot, dev, host) in by_stage.items():
        assert dev + host == tot, stage
    assert by_stage[0][2] == 0 and by_stage[1][2] == by_stage[2][2] > 0
    assert by_stage[3][2] > by_stage[2][2]        # + the parameter shard


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_param_prefetch_copies_on_a_side_stream_and_changes_no_number():
    """offload_param with prefetch: each prefetched unit's host-to-device copy runs on a side
    stream (comm.side_stream "offload_copy", sharding.Sharding.all_gather), ordered before its
    gather and before the unit's use by events; the losses and weights equal those of the run
    without prefetch, bit for bit."""
    from minizero import comm
    runs = []
    comm._side_streams.clear()
    for prefetch in (0, 10 ** 9):
        engine = _cuda_engine({**OPT, **PAR, "stage3_prefetch_bucket_size": prefetch, "stage3_max_reuse_distance": 0})
        losses = [_cuda_step(engine) for _ in range(3)]
        runs.append((losses, engine.full_fp32_state_dict()))
    assert any(purpose == "offload_copy" for _, purpose in comm._side_streams), "no prefetched copy ran on the side stream"
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
