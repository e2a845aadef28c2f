"""Every tensor handed to a collective lives on the rank's device.

Under NCCL a collective takes only GPU tensors: a CPU tensor fails every multi-rank GPU
run ("No backend type associated with device type cpu"), while gloo, which the tests use,
takes CPU tensors happily. So on a CPU a misplaced tensor is invisible: the rank's device
*is* the CPU. `strict_collectives` makes it visible.

The technique: make the device the code asks for different from the CPU. In one rank,
`comm.get_device()` returns `torch.device("meta")` (a real device type that holds shapes
and no data), and torch.distributed's tensor collectives (all_reduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor; minizero.comm's wrappers call them, and so
does code that calls torch.distributed directly) are replaced by a check that every
tensor they get is on that device. A tensor the code placed with `comm.get_device()` (or
with an engine's `.device`, which comes from it) arrives on meta and passes; one made on
the CPU and never moved arrives on the CPU and raises `Misplaced`, naming the collective.

Meta tensors hold no data, so the checked collectives move nothing, and the run ends at
the first place that reads a value out of a meta tensor (`.item()`, `.cpu()`): everything
up to there is checked. Object collectives (broadcast_object, all_gather_object, barrier)
still run for real; they pick their device themselves.

Every check of the file runs in one launch of two ranks (the `checked` fixture), one after
another: strict_collectives puts comm.get_device and the collectives back after each, and
each builds what it checks afresh; a launch of two ranks costs about a second of CPU.
"""
import traceback

import pytest
import torch
import torch.distributed as dist

from minizero.gpt import codebook
from minizero import comm
from minizero.gpt.synthetic_images import synthetic_images
from tests.support.launcher import run_ranks

INJECTED = torch.device("meta")
# each logged under its classic name; torch >= 2.13's *_single spellings (which comm.py calls) too
TENSOR_COLLECTIVES = {"all_reduce": "all_reduce", "broadcast": "broadcast",
                      "all_gather_into_tensor": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
                      "all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


class Misplaced(AssertionError):
    """A collective was handed a tensor that is not on comm.get_device()."""


def strict_collectives(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) in this rank with comm.get_device() = meta and every tensor
    collective checked (see the module docstring). Returns (log, stopped): log lists
    (collective, [device of each tensor argument]) in call order; stopped is the message of
    the meta-tensor read that ended the run, or None if fn returned. Call it on every rank.
    To check an engine, build its model on comm.get_device() before taking its parameters:
    moving a module to meta gives it new Parameter objects."""
    log = []

    def checked(name):
        name = TENSOR_COLLECTIVES[name]

        def collective(*a, **k):
            tensors = [x for x in (*a, *k.values()) if torch.is_tensor(x)]
            log.append((name, [str(t.device) for t in tensors]))
            for t in tensors:
                if t.device != INJECTED:
                    raise Misplaced(f"{name} was handed a tensor on {t.device}, not on comm.get_device() "
                                    f"(here {INJECTED}): under NCCL this collective would fail")
        return collective

    real_get_device, real = comm.get_device, {n: getattr(dist, n) for n in TENSOR_COLLECTIVES if hasattr(dist, n)}
    comm.get_device = lambda: INJECTED
    for n in real:
        setattr(dist, n, checked(n))
    try:
        fn(*args, **kwargs)
        return log, None
    except (NotImplementedError, RuntimeError) as e:
        if "meta tensor" not in str(e):
            raise
        return log, str(e)
    finally:
        comm.get_device = real_get_device
        for n, f in real.items():
            setattr(dist, n, f)


# ----------------------------------------------------------------------------- the check catches

def _misplaced_all_reduce():
    """The exception the check raised, as its traceback's last line (None if none: a miss)."""
    try:
        strict_collectives(lambda: comm.all_reduce(torch.ones(2), label="forgot_the_device"))
    except Exception as e:   # noqa: BLE001 -- whatever it is, the test reads its line
        return traceback.format_exception_only(e)[-1]
    return None


def _placed_all_reduce():
    return strict_collectives(lambda: comm.all_reduce(torch.ones(2, device=comm.get_device())))


def test_the_check_catches_a_cpu_tensor_and_passes_a_placed_one(checked):
    for raised in checked["_misplaced_all_reduce"]:
        assert raised is not None, "a CPU tensor handed to all_reduce was not caught"
        assert "Misplaced: all_reduce was handed a tensor on cpu" in raised
    assert checked["_placed_all_reduce"] == [([("all_reduce", ["meta"])], None)] * 2


# ----------------------------------------------------------------------------- minizero.gpt.codebook

def _codebook_strict():
    images = synthetic_images(40, 8, seed=3)
    return strict_collectives(codebook.compute_codebook, images, ncluster=16, niter=4)


def test_codebook_broadcast_is_on_the_device(checked):
    for log, stopped in checked["_codebook_strict"]:
        assert log == [("broadcast", ["meta"])]
        assert "meta tensor" in stopped  # the check ended at .cpu(), after the broadcast


# ----------------------------------------------------------------------------- reference.ds_run

class _Engine:
    """Just enough of a DeepSpeed engine for reference.ds_run.train_steps; its device is
    what DeepSpeed's would be, the rank's accelerator (here: the injected one)."""

    def __init__(self):
        self.device = comm.get_device()

    def gradient_accumulation_steps(self):
        return 1

    def train(self):
        pass

    def __call__(self, x, y):
        return None, torch.tensor(2.0)

    def backward(self, loss):
        pass

    def step(self):
        pass


def _loss_bookkeeping_strict():
    from reference.ds_run import SyntheticBatches, train_steps

    return strict_collectives(lambda: train_steps(_Engine(), SyntheticBatches(8, 4, 2), 1, lambda e: 1.0))


def test_ds_run_loss_all_reduce_is_on_the_engines_device(checked):
    for log, stopped in checked["_loss_bookkeeping_strict"]:
        assert log == [("all_reduce", ["meta"])]
        assert "meta tensor" in stopped  # the check ended at .item(), after the all-reduce


# ----------------------------------------------------------------------------- minizero.sharded_optimizer

class _Flat:
    """The parts of a FlatParam that full_fp32_state reads: 2 ranks, a 2x2 parameter."""

    def __init__(self):
        from minizero.sharding import plain
        self.padded_numel, self.num_shards, self.names, self.shapes = 4, 2, ["w"], [(2, 2)]
        self.sharding = plain(2, comm.get_rank())
        self.device = comm.get_device()


def _consolidate_with_host_master_strict():
    from types import SimpleNamespace

    from minizero.comm import host_empty
    from minizero.sharded_optimizer import ShardedOptimizer

    def consolidate():
        # offload_optimizer: the fp32 master shard lives in host memory (offload.new_master)
        opt = SimpleNamespace(flat_params=[_Flat()], masters=[host_empty(2, torch.float32, pin=False).zero_()])
        return ShardedOptimizer.full_fp32_state(opt)
    return strict_collectives(consolidate)


def test_full_fp32_state_dict_with_offload_gathers_on_the_device(checked):
    # Before: the host master went straight into the all-gather; NCCL refuses a CPU input.
    for log, stopped in checked["_consolidate_with_host_master_strict"]:
        assert log == [("all_gather_into_tensor", ["meta", "meta"])]
        assert "meta tensor" in stopped   # the check ended at .cpu(), after the gather


def test_adam_step_is_where_a_fused_or_capturable_adam_reads_it():
    # torch's _init_group puts `step` on the parameter's device for fused/capturable Adam and
    # on the CPU otherwise; init_optimizer_states must agree (a CUDA fused Adam with a CPU
    # step fails). meta stands in for the GPU: a device that is not the CPU.
    from minizero.adam import init_optimizer_states
    for kwargs, where in (({"capturable": True}, "meta"), ({}, "cpu"), ({"foreach": False}, "cpu")):
        p = torch.nn.Parameter(torch.zeros(3, device="meta"))
        opt = torch.optim.AdamW([p], **kwargs)
        init_optimizer_states(opt)
        assert (str(opt.state[p]["step"].device), opt.state[p]["step"].dtype) == (where, torch.float32), kwargs
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], fused=True)
    init_optimizer_states(opt)
    assert opt.state[p]["step"].device == p.device


# ----------------------------------------------------------------------------- launch/bench_collectives.py

def _bench_collectives_timings_strict():
    from pathlib import Path
    from tests.support.scripts import load_script
    bench = load_script(Path(__file__).resolve().parents[2] / "launch" / "bench_collectives.py")
    return strict_collectives(lambda: bench.slowest_median_ms([0.1, 0.2], comm.get_device()))


def test_bench_collectives_all_reduces_its_timings_on_the_device(checked):
    # Before: a CPU tensor of timings, all-reduced on every GPU run (NCCL refuses it).
    for log, stopped in checked["_bench_collectives_timings_strict"]:
        assert log == [("all_reduce", ["meta"])]
        assert "meta tensor" in stopped   # the check ended at .tolist(), after the all-reduce


# ----------------------------------------------------------------------------- a whole step, every stage

STEP_CASES = [(0, "bf16"), (1, "bf16"), (2, "fp16"), (3, "bf16"), (3, "fp16")]


class _ReachedTheSync(Exception):
    pass


def _step_strict(stage: int, dtype: str):
    """One training step of the micro GPT on the injected device. On meta every read of a
    device value raises, so the run stops at the first host read; engine.read_on_host (the
    step's one documented sync) is replaced by a marker, so reaching it proves that forward,
    backward, the gradient reduction, the norm and the fp16 vote read nothing on the host."""
    import minizero
    from minizero import engine as engine_module
    from tests.support.harness import SyntheticBatches, make_config, make_model

    reached = []

    def read_on_host(norm_sq, vote):
        reached.append([str(norm_sq.device)] + ([] if vote is None else [str(vote.device)]))
        raise _ReachedTheSync()

    def step():
        torch.manual_seed(0)
        model = make_model("micro", "gpt").to(comm.get_device())
        cfg = make_config(stage, dtype, micro_batch=2, lr=1e-3, zero={"stage3_param_persistence_threshold": 0})
        engine, *_ = minizero.initialize(model=model, config=cfg, model_parameters=model.configure_param_groups(0.1))
        batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
        x, y = (t.to(comm.get_device()) for t in batches(0, 0, comm.get_rank(), comm.get_world_size()))
        _, loss = engine(x, y)
        engine.backward(loss)
        try:
            engine.step()
        except _ReachedTheSync:
            pass
    real, engine_module.read_on_host = engine_module.read_on_host, read_on_host
    try:
        log, stopped = strict_collectives(step)
    finally:
        engine_module.read_on_host = real
    return sorted({name for name, _ in log}), stopped, reached


@pytest.mark.parametrize("stage, dtype", STEP_CASES)
def test_a_step_at_every_stage_keeps_collectives_on_the_device_and_reads_nothing_before_its_sync(checked, stage, dtype):
    for ops, stopped, reached in checked[("_step_strict", stage, dtype)]:
        assert stopped is None, stopped                  # no meta read before the documented sync
        assert reached == [["meta"] if dtype != "fp16" else ["meta", "meta"]], reached   # the norm (and vote) on the device
        assert "broadcast" in ops and ("all_gather_into_tensor" in ops) == (stage == 3), ops


# ----------------------------------------------------------------------------- every check, one launch

CHECKS = ["_misplaced_all_reduce", "_placed_all_reduce", "_codebook_strict", "_loss_bookkeeping_strict",
          "_consolidate_with_host_master_strict", "_bench_collectives_timings_strict",
          *(("_step_strict", stage, dtype) for stage, dtype in STEP_CASES)]


def _check_all(checks: list) -> list:
    """On each rank: every check of `checks` (a function's name, or (name, *args)), in order."""
    out = []
    for check in checks:
        name, *args = (check,) if isinstance(check, str) else check
        out.append(globals()[name](*args))
    return out


@pytest.fixture(scope="module")
def checked():
    """Every check of the file -> the ranks' results, from one launch of two ranks."""
    per_rank = run_ranks(_check_all, world_size=2, args=(CHECKS,), timeout=300)
    return {c: [r[i] for r in per_rank] for i, c in enumerate(CHECKS)}
