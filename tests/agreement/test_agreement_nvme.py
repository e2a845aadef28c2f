"""ZeRO-Infinity's NVMe tier: minizero against DeepSpeed's NVMe offload, on the same config.

DeepSpeed swaps with its `async_io` op (libaio), JIT-built into ~/.cache/torch_extensions on
first use; on its CPU accelerator it builds and runs when libaio's header is installed
(Debian: libaio-dev; .ci/run installs it where apt-get works). Where it cannot build these
tests skip with the reason; minizero's side is tested without DeepSpeed (tests/core/test_nvme.py).

One config, ZeRO-3 bf16, both offloads on NVMe, every parameter partitioned, clipping off (the
micro GPT at width 171, 3 steps, torch_adam in both), run by each library with "device": "cpu" and "nvme":

(Clipping is off because at DeepSpeed's default 1.0 it fires here, norms 1.1-1.4, and then
minizero's and DeepSpeed's weights differed by up to 3.7e-9 after 3 steps, with "cpu" as with
"nvme": DeepSpeed's ZeRO-3 offload rounds the squared gradient norm to fp32 before its
all-reduce, minizero keeps fp64. That rounding is the whole difference, NVMe or not:
docs/deepspeed.md, "ZeRO-3 with offload_optimizer sums the gradient norm in fp32", and
test_deepspeed_facts.py::test_zero3_offload_norm_is_the_whole_clipping_difference.)

- losses and final fp32 weights: each library's nvme run equals its cpu run bit for bit, and
  minizero's equals DeepSpeed's (the same arithmetic in the same order on a CPU, as the
  offload agreement tests find for "cpu");
- bytes on NVMe, measured as the swap files' sizes on disk at the end of training, per rank:
  the optimizer's files hold fp32 master + two moments. minizero's are 12 x its shard
  (Σs, its FlatParams padded to N); DeepSpeed's are 12 x its partition S (ceil(n/N) per
  parameter) rounded up per file to its I/O alignment: the named difference below.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.support.harness import PatternBatches, make_config, make_model
from tests.support.launcher import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

N, STEPS = 2, 3
# The micro GPT at width 171 (odd, 3 heads): its decay group's fp32 partition, 4 x 355,000 bytes
# per rank, is above the 1 MiB DeepSpeed swaps at least (below it a sub-group stays in memory)
MODEL = functools.partial(make_model, "micro", "gpt", n_embd=171, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
BATCHES = PatternBatches(62, 16, 8)


def aio_unavailable() -> str | None:
    """Why DeepSpeed's async_io op cannot run here, in one line; None when it can."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not os.path.exists("/usr/include/libaio.h"):
        return ("DeepSpeed's async_io op needs libaio's header (/usr/include/libaio.h is missing): "
                "apt-get install libaio-dev (.ci/run does it where apt-get works)")
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed's AsyncIOBuilder().is_compatible() is False on this machine (no libaio to link)"
    try:   # JIT-builds it on first use (minutes; .ci/run does it before the tests)
        AsyncIOBuilder().load(verbose=False)
    except Exception as e:   # a compiler error, a missing toolchain: the reason, not a crash
        return f"DeepSpeed's async_io op did not build ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def config(device: str, path: str) -> dict:
    """max_in_cpu 0: DeepSpeed keeps no parameter partition in host memory between uses (its
    default, 1e9 elements, would keep this whole model there); buffer_size 1e6 elements: its
    pinned swap buffers (5 of them) hold the largest partition without 1 GB of host memory."""
    where = {"device": device, **({"nvme_path": path} if device == "nvme" else {})}
    par = {**where, **({"max_in_cpu": 0, "buffer_size": 1_000_000} if device == "nvme" else {})}
    return make_config(3, "bf16", micro_batch=4, lr=3e-3, clip=0.0, zero={
        "offload_optimizer": dict(where), "offload_param": par, "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0})


def swap_file_bytes(path: str, rank: int) -> dict:
    """{"optimizer": bytes, "params": bytes} of this rank's swap files under `path`, by file name:
    minizero's minizero_swap/rank<r>/<label>.<master|exp_avg|exp_avg_sq|shard>.swp, DeepSpeed's
    zero_stage_3/optimizer/rank<r>/... and zero_stage_3/<dtype>params/rank<r>/...."""
    out = {"optimizer": 0, "params": 0}
    for root, _, files in os.walk(path):
        if f"rank{rank}" not in root.split(os.sep):
            continue
        for name in files:
            if name.startswith("."):
                continue
            kind = "params" if (name.endswith(".shard.swp") or "params" in root) else "optimizer"
            out[kind] += os.path.getsize(os.path.join(root, name))
    return out


def _run(lib: str, device: str, path: str) -> dict:
    from minizero import comm
    from tests.support.harness import build_model, prepare_ds_config, train_steps
    cfg = prepare_ds_config(config(device, path))
    model, groups = build_model(MODEL, cfg, 0, None)
    numels = [[p.numel() for p in g["params"]] for g in groups]   # before initialize takes them
    if lib == "deepspeed":
        engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
        state = lambda: _ds_fp32_state(engine)
    else:
        import minizero
        engine = minizero.initialize(model=model, model_parameters=groups, config=cfg)[0]
        state = engine.full_fp32_state_dict
    r = train_steps(engine, BATCHES, STEPS, lambda e: 1.0)
    r["files"] = swap_file_bytes(path, comm.get_rank()) if device == "nvme" else None
    r["final_state"] = state()
    if lib == "minizero":
        r["shard"] = sum(f.shard_numel for f in engine.zero.flat_params)
        r["memory"] = engine.memory_breakdown()
        engine.destroy()
    else:
        r["groups"] = [sum(-(-n // comm.get_world_size()) for n in g) for g in numels]   # S per param group
        from reference.ds_memory import deepspeed_model_state_bytes
        r["memory"] = deepspeed_model_state_bytes(engine)
        if device == "nvme":
            r["param_partitions"] = _ds_param_partitions(engine)
    return r


def _ds_param_partitions(engine) -> dict:
    """Where DeepSpeed keeps each parameter's partition with offload_param "nvme": its bytes,
    its final_location (OffloadDeviceEnum.nvme when it lives in a swap file), the swapper's
    threshold (min_aio_bytes = max(MIN_AIO_BYTES, aio.block_size)), and how many partitions
    lie inside the swapper's pinned pool of buffers."""
    params = list(engine.module.parameters())
    swapper = params[0].nvme_swapper
    pool = swapper.buffers.untyped_storage()
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.nbytes()
    return {"bytes": [p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params],
            "final_location": [None if p.ds_tensor.final_location is None else str(p.ds_tensor.final_location)
                               for p in params],
            "min_aio_bytes": swapper.min_aio_bytes,
            "in_pool": sum(lo <= p.ds_tensor.untyped_storage().data_ptr() < hi for p in params)}


def _ds_fp32_state(engine):
    from reference.ds_run import full_fp32_state_dict
    return full_fp32_state_dict(engine)


def _run_all(base: str, cpu_info: dict) -> dict:
    """On each rank: every (library, device) run of the file, each in its own folder, in ONE
    launch: minizero's first, as DeepSpeed's ZeRO-3 patches torch for the rest of the process
    (minizero patches nothing). Each run builds its engine from its own config and seed, so it
    returns here what it returns in a launch of its own (every field checked equal, tensors
    with torch.equal, when the four launches became one)."""
    _answer_cpu_info_with(cpu_info)
    return {(lib, device): _run(lib, device, os.path.join(base, f"{lib}-{device}"))
            for lib in ("minizero", "deepspeed") for device in ("cpu", "nvme")}


def _answer_cpu_info_with(info: dict):
    """py-cpuinfo's get_cpu_info, answered with `info`; returns the function it replaced.

    DeepSpeed asks it for the compiler flags of the async_io op it loads (op_builder/builder.py,
    cpu_arch and simd_width, both called by AsyncIOBuilder.cxx_args on every load: the flags
    must equal the build's or torch rebuilds the op). Each call starts `python cpuinfo.py
    --json`, which runs CPUID in a child that sleeps a second to time the clock: ~0.45 s of CPU
    and ~2 s of wall time, twice per process that loads the op (the test's own check and each
    DeepSpeed rank: 6 calls a run of this file). The CPU does not change while the tests run:
    asked once by the test, the same dict everywhere, so DeepSpeed computes the same flags."""
    import cpuinfo
    replaced = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = lambda: info
    return replaced


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import cpuinfo
    info = cpuinfo.get_cpu_info()
    replaced = _answer_cpu_info_with(info)
    try:
        why = aio_unavailable()
    finally:
        cpuinfo.get_cpu_info = replaced
    if why:
        pytest.skip(why)
    per_rank = run_ranks(_run_all, N, args=(str(tmp_path_factory.mktemp("nvme_agree")), info),
                         env={"DS_ACCELERATOR": "cpu"}, timeout=900)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def test_nvme_trains_as_cpu_offload_in_both_libraries_and_they_agree(runs):
    for rank in range(N):
        mz, ds = runs[("minizero", "nvme")][rank], runs[("deepspeed", "nvme")][rank]
        for lib in ("minizero", "deepspeed"):
            cpu, nvme = runs[(lib, "cpu")][rank], runs[(lib, "nvme")][rank]
            assert cpu["losses"] == nvme["losses"], lib
            assert all(torch.equal(cpu["final_state"][k], nvme["final_state"][k]) for k in cpu["final_state"]), lib
        assert mz["losses"] == ds["losses"]
        assert all(torch.equal(mz["final_state"][k], ds["final_state"][k].float()) for k in mz["final_state"])


def test_bytes_on_nvme_per_rank(runs):
    """minizero: the files hold exactly what memory_breakdown()["nvme"] says: 12Σs of optimizer
    state and 2Σs of parameters, every FlatParam. DeepSpeed (measured, and from its source):
    - optimizer: one file each for fp32 partition, exp_avg, exp_avg_sq of each sub-group (here a
      param group: sub_group_size 1e9) whose fp32 bytes reach MIN_AIO_BYTES = 1 MiB
      (runtime/swap_tensor/utils.py; is_swappable_tensor in optimizer_utils.py), its numel
      rounded up to AIO_ALIGNED_BYTES x intra_op_parallelism / 4 = 256 elements. The no-decay
      group (biases, layer norms) is below it and stays in host memory;
    - parameters: no swap file is written under zero_stage_3/bfloat16params/, though max_in_cpu
      is 0: a partition goes to NVMe only when it has at least max(1 MiB, aio.block_size) bytes
      (test_deepspeed_swaps_no_parameter_partition_under_1_mib)."""
    MIN_AIO_BYTES, ALIGN = 1 << 20, 256
    for rank in range(N):
        mz, ds = runs[("minizero", "nvme")][rank], runs[("deepspeed", "nvme")][rank]
        assert mz["files"] == {"optimizer": 12 * mz["shard"], "params": 2 * mz["shard"]}
        nv = mz["memory"]["nvme"]
        assert mz["files"]["optimizer"] == nv["master_params"] + nv["optimizer_states"]
        assert mz["files"]["params"] == nv["params"]
        swapped = [-(-n // ALIGN) * ALIGN for n in ds["groups"] if 4 * n >= MIN_AIO_BYTES]
        assert len(swapped) == 1 and len(ds["groups"]) == 2, ds["groups"]
        assert ds["files"] == {"optimizer": 12 * sum(swapped), "params": 0}


def test_deepspeed_bytes_in_files_are_counted(runs):
    """reference/ds_nvme.py: what DeepSpeed holds only in swap files after the last step is the
    swappable sub-group's fp32 master and its two moments, 4S + 8S for the S of that group (the
    files round each up to the I/O alignment; the count is of the tensors), nothing of the
    other group, no gradient. Counted in the totals, so the "cpu" run and the "nvme" run hold
    the same model states; the "cpu" run has no "nvme" place at all."""
    MIN_AIO_BYTES = 1 << 20
    for rank in range(N):
        cpu, nvme = runs[("deepspeed", "cpu")][rank], runs[("deepspeed", "nvme")][rank]
        (swapped,) = [s for s in nvme["groups"] if 4 * s >= MIN_AIO_BYTES]
        assert "nvme" not in cpu["memory"]
        assert nvme["memory"]["nvme"] == {"params": 0, "master_params": 4 * swapped,
                                          "optimizer_states": 8 * swapped, "grads": 0}
        for c in ("master_params", "optimizer_states"):
            assert nvme["memory"][c] == cpu["memory"][c], c



def test_deepspeed_swaps_no_parameter_partition_under_1_mib(runs):
    """docs/nvme.md, "DeepSpeed's NVMe offload": ZeRO-3's Init makes a parameter's partition
    live in NVMe only when `param_swapper.swappable_tensor(numel=partition_size)` holds
    (runtime/zero/partition_parameters.py, _partition_param), i.e. it has at least
    `min_aio_bytes` = max(MIN_AIO_BYTES = 1 MiB, aio.block_size) bytes
    (runtime/swap_tensor/partitioned_param_swapper.py). The micro GPT at width 171 has
    partitions of at most 116,964 bytes (114 KiB): every one is an ordinary host tensor,
    none in a swap file and none in the swapper's pinned pool of buffers. (The old text said
    they sit in that pool.)"""
    from pathlib import Path

    for rank in range(N):
        got = runs[("deepspeed", "nvme")][rank]["param_partitions"]
        assert got["min_aio_bytes"] == 1 << 20
        assert max(got["bytes"]) == 116_964 < got["min_aio_bytes"]
        assert got["final_location"] == [None] * len(got["bytes"])
        assert got["in_pool"] == 0
    page = " ".join((Path(__file__).resolve().parents[2] / "docs" / "nvme.md").read_text().split())
    assert "max(1 MiB, `aio.block_size`)" in page and "pinned swap buffers" not in page
