"""ZeRO-Infinity's NVMe tier in minizero (minizero/offload/nvme.py): the same numbers as host offload,
the bytes in files between uses, and nothing lost.

One launch of 2 gloo ranks trains the micro GPT with `"device": "cpu"` and `"device": "nvme"`
beside each other and asserts:

- bit identity: losses, norms, loss scales and the final fp32 weights are equal bit for bit
  (the host offload's arithmetic on the same tensors; only where their bytes wait changes);
- bytes: memory_breakdown() is the cpu run's with the swapped categories moved from "host"
  to "nvme"; per step the writes are exactly the optimizer shard (12Ψ/N with padding) plus,
  with offload_param, the new parameter shard (2Ψ/N), and the reads are the optimizer shard
  plus one parameter shard per gather (no read-ahead crosses a step: gas 1 here);
- the folder is gone after engine.destroy().

Then the start-time checks (unwritable path on one rank, not enough free space, a folder in
use, stale files) and a run killed in the middle of a swap write, resumed from its checkpoint.

The start-time checks and the killed run's uninterrupted twin run in the same launch as the
comparison (the `launch` fixture), each in its own folder, and the two resumes of the killed
run in one launch: each run builds its engine from its own config and seed, in its own
folder, and puts back what it patched (_start's disk_usage), so it returns there what it
returns alone (the twin from the shared launch equals, bit for bit, the resumes launched on
their own); a launch of two ranks costs about a second of CPU.
"""
from __future__ import annotations

import fcntl
import functools
import os

import pytest
import torch

from tests.support.harness import PatternBatches, make_config, make_model
from tests.support.launcher import run_ranks

N, STEPS, GLOBAL_BATCH, SEQ = 2, 3, 8, 16
MODEL = functools.partial(make_model, "micro", "gpt", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
BATCHES = PatternBatches(62, SEQ, GLOBAL_BATCH)

# (stage, dtype, which offloads, stage-3 persistence threshold)
CASES = [(1, "bf16", ("optimizer",), 0), (2, "fp32", ("optimizer",), 0), (3, "fp16", ("optimizer", "param"), 0),
         (3, "bf16", ("optimizer", "param"), 500), (3, "bf16", ("param",), 0)]


def _zero(offloads, device, path, persist):
    where = {"device": device, **({"nvme_path": path} if device == "nvme" else {})}
    return {**{f"offload_{o}": dict(where) for o in offloads}, "stage3_param_persistence_threshold": persist,
            "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def _cfg(stage, dtype, offloads, persist, device, path):
    return make_config(stage, dtype, micro_batch=GLOBAL_BATCH // N, lr=3e-3, clip=0.05,
                       zero=_zero(offloads, device, path, persist),
                       fp16={"initial_scale_power": 16} if dtype == "fp16" else ())


def _run_all(base):
    import minizero
    from minizero import comm, memory
    from tests.support.harness import build_model, prepare_ds_config, train_steps
    out = {}
    for i, case in enumerate(CASES):
        for device in ("cpu", "nvme"):
            path = os.path.join(base, f"case{i}")
            cfg = prepare_ds_config(_cfg(*case, device, path))
            model, groups = build_model(MODEL, cfg, 0, None)
            engine = minizero.initialize(model=model, model_parameters=groups, config=cfg)[0]
            comm.ledger.reset()
            r = train_steps(engine, BATCHES, STEPS, lambda e: float(e.loss_scale), None, None)
            r["comm"] = {k: dict(v) for k, v in comm.ledger.by_label.items()}
            r["taken"] = engine.global_steps - engine.skipped_steps   # a skipped step swaps nothing
            r["memory"] = engine.memory_breakdown()
            r["held"] = memory.held_bytes(engine)   # measured from the tensors, after the step
            r["final_state"] = engine.full_fp32_state_dict()
            r["shards"] = [(f.shard_numel, f.persistent, f.shard.element_size()) for f in engine.zero.flat_params]
            folder = os.path.join(path, "minizero_swap", f"rank{comm.get_rank()}")
            r["files"] = sorted(os.listdir(folder)) if device == "nvme" else []
            engine.destroy()
            r["left_after_destroy"] = os.path.exists(folder)
            out[(i, device)] = r
    return out


START_CHECKS = ["rank1_blocked", "full", "in_use", "stale"]


def _launch_all(base, starts, whole):
    """On each rank: _run_all(base); _start(path, mode) for each of `starts`; _train(*whole)."""
    return _run_all(base), [_start(path, mode) for path, mode in starts], _train(*whole)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The comparison's runs, the start-time checks (START_CHECKS, each in its own folder) and
    the killed run's uninterrupted twin (4 steps, cpu offload), in one launch of N ranks:
    (per rank: _run_all's runs; {check: per rank: _start's result}; per rank: the twin's
    result; {check: its folder})."""
    root = tmp_path_factory.mktemp("nvme")
    paths = {check: root / check for check in START_CHECKS}
    for path in paths.values():
        path.mkdir()
    # rank 0's folder as a start refused for "in use" leaves it (its lock file alone, with the
    # holder's line): "stale" adds a killed run's swap file beside it
    for check in ("in_use", "stale"):
        folder = paths[check] / "minizero_swap" / "rank0"
        folder.mkdir(parents=True)
        with open(folder / ".lock", "w") as lock:
            lock.write("pid 1 on elsewhere")
    (paths["stale"] / "minizero_swap" / "rank0" / "root.g0.master.swp").write_bytes(b"stale")   # a killed run's
    modes = {"rank1_blocked": "rank1_blocked", "full": "full", "in_use": None, "stale": None}
    starts = [(str(paths[c]), modes[c]) for c in START_CHECKS]
    with open(paths["in_use"] / "minizero_swap" / "rank0" / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)         # a live run holds rank 0's folder of "in_use"
        per_rank = run_ranks(_launch_all, N, args=(str(root / "compare"), starts, (str(root / "w"), None, "cpu", 4)),
                             timeout=600)
    started = {c: [r[1][i] for r in per_rank] for i, c in enumerate(START_CHECKS)}
    return [r[0] for r in per_rank], started, [r[2] for r in per_rank], paths


@pytest.fixture(scope="module")
def runs(launch):
    return launch[0]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"s{c[0]}-{c[1]}-{'+'.join(c[2])}-p{c[3]}" for c in CASES])
def test_nvme_changes_no_bit_and_moves_the_bytes(runs, i):
    stage, dtype, offloads, persist = CASES[i]
    for rank in range(N):
        cpu, nvme = runs[rank][(i, "cpu")], runs[rank][(i, "nvme")]
        for k in ("losses", "grad_norms", "loss_scales", "lrs"):
            assert cpu[k] == nvme[k], (k, rank)
        for name in cpu["final_state"]:
            assert torch.equal(cpu["final_state"][name], nvme["final_state"][name]), (name, rank)

        # memory: the host's swapped categories are on NVMe instead; the totals are the same
        moved = (["params"] if "param" in offloads else []) + \
            (["master_params", "optimizer_states"] if "optimizer" in offloads else [])
        want_host = {k: (0 if k in moved else v) for k, v in cpu["memory"]["host"].items()}
        want_nvme = {k: (v if k in moved else 0) for k, v in cpu["memory"]["host"].items()}
        assert nvme["memory"]["device"] == cpu["memory"]["device"]
        assert nvme["memory"]["host"] == want_host and nvme["memory"]["nvme"] == want_nvme
        assert sum(want_nvme.values()) > 0 and "nvme" not in cpu["memory"]
        # measured after the step (no gradients then): what cpu holds on the host, nvme holds in files
        assert nvme["held"]["nvme"] == {k: (v if k in moved else 0) for k, v in cpu["held"]["host"].items()}
        assert nvme["held"]["device"] == cpu["held"]["device"] and "nvme" not in cpu["held"]

        # bytes per step, from the ledger (it starts after init's first writes)
        def swapped(op, suffixes):
            return sum(v["bytes"] for k, v in nvme["comm"].items()
                       if k.startswith(op + ":") and k.endswith(suffixes))
        opt_shard = sum(n for n, _, _ in nvme["shards"]) * 12 if "optimizer" in offloads else 0
        par_shard = sum(n * e for n, keep, e in nvme["shards"] if not keep) if "param" in offloads else 0
        opt_keys = (".master", ".exp_avg", ".exp_avg_sq")
        taken = nvme["taken"]
        assert taken > 0
        assert swapped("nvme_write", opt_keys) == taken * opt_shard
        assert swapped("nvme_read", opt_keys) == taken * opt_shard
        assert swapped("nvme_write", ".shard") == taken * par_shard
        h2d = sum(v["bytes"] for k, v in nvme["comm"].items() if k.startswith("h2d:") and not k.endswith(".params"))
        assert swapped("nvme_read", ".shard") == (h2d if "param" in offloads else 0)   # one read per gather
        if "param" in offloads:
            assert h2d == 2 * STEPS * par_shard > 0
        assert "nvme_read:" not in str(cpu["comm"])
        # the files: one per swapped tensor; the folder gone after destroy()
        assert nvme["files"] and all(f.endswith(".swp") or f == ".lock" for f in nvme["files"])
        assert not nvme["left_after_destroy"]


# ----------------------------------------------------------------------------- config

def test_nvme_config_keys():
    from minizero.config import ConfigError, ignored_knobs, load_config
    base = {"train_batch_size": 8}
    with pytest.raises(ConfigError, match="needs zero_optimization.offload_param.nvme_path") as e:
        load_config({**base, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="must be \"none\", \"cpu\" or \"nvme\""):
        load_config({**base, "zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, 1)
    with pytest.raises(ConfigError, match="use_gds"):
        load_config({**base, "aio": {"use_gds": True}}, 1)
    cfg = load_config({**base, "aio": {"thread_count": 3, "block_size": 4096, "queue_depth": 16, "single_submit": True},
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x",
                                                                          "buffer_count": 2, "max_in_cpu": 10}}}, 1)
    assert cfg.aio.intra_op_parallelism == 3 and cfg.aio.block_size == 4096
    assert cfg.zero.offload_param_enabled and cfg.zero.offload_param.buffer_count == 2
    assert ignored_knobs(cfg) == ["offload_param.max_in_cpu", "aio.queue_depth", "aio.single_submit"]


# ----------------------------------------------------------------------------- start-time checks

def _start(path, mode=None):
    """Build a stage-3 engine with both offloads on NVMe at `path`; the ConfigError's text, or
    None. mode "full": the disk reports 1,000 free bytes; "rank1_blocked": rank 1's folder
    cannot be made (a file is in its place)."""
    import shutil
    from minizero import comm
    from minizero.config import ConfigError
    from tests.support.harness import micro_engine
    disk_usage = shutil.disk_usage
    if mode == "full":   # this forked rank only, until the engine is built
        shutil.disk_usage = lambda p: shutil._ntuple_diskusage(1 << 40, (1 << 40) - 1000, 1000)
    if mode == "rank1_blocked" and comm.get_rank() == 1:
        os.makedirs(os.path.join(path, "minizero_swap"), exist_ok=True)
        open(os.path.join(path, "minizero_swap", "rank1"), "w").close()
    try:
        engine, _ = micro_engine(_cfg(3, "bf16", ("optimizer", "param"), 0, "nvme", path))
    except ConfigError as e:
        return str(e)
    finally:
        shutil.disk_usage = disk_usage
    removed = [folder.removed_stale for folder in engine.offload.tier.folders.values()]
    engine.destroy()
    return removed


def test_unwritable_path_on_one_rank_is_one_line_on_every_rank(launch):
    out, tmp_path = launch[1]["rank1_blocked"], launch[3]["rank1_blocked"]
    assert out[0] == out[1] and "cannot write swap files there" in out[0] and "\n" not in out[0]
    assert not (tmp_path / "minizero_swap" / "rank0").exists()   # rank 0 made its folder, then removed it


def test_full_disk_is_one_line_at_start(launch):
    out, tmp_path = launch[1]["full"], launch[3]["full"]
    # the files of both ranks: 12Σs + 2Σs each (Σs = 7,551 elements of the micro GPT at N = 2)
    assert out[0] == out[1] and "need 211,428 bytes" in out[0] and "only 1,000 are free" in out[0]
    assert "2 rank(s) sharing the disk" in out[0] and "\n" not in out[0]
    assert not (tmp_path / "minizero_swap").exists()   # nothing written, no folder left


def test_folder_in_use_is_refused_and_stale_files_are_removed(launch):
    """"in_use": rank 0's folder locked by a live run (the fixture holds the lock); "stale": a
    killed run's files beside its released lock."""
    out = launch[1]["in_use"]
    assert out[0] == out[1] and "is in use by a running training (pid 1 on elsewhere)" in out[0]
    assert launch[1]["stale"] == [[1], [0]]
    assert not (launch[3]["stale"] / "minizero_swap").exists()


# ----------------------------------------------------------------------------- nothing lost

def _train(path, ckpt, device, steps, save_at=None, resume=False, kill_at=None):
    """Train to `steps` with both offloads on `device`; save at `save_at`; resume from `ckpt`;
    with kill_at, the process dies (os._exit) half-way through the first swap write of that step."""
    from minizero import comm
    from minizero.offload import nvme
    from tests.support.harness import micro_engine, train_step
    engine, _ = micro_engine(_cfg(3, "bf16", ("optimizer", "param"), 0, device, path))
    start = engine.load_checkpoint(ckpt)[1]["step"] if resume else 0
    losses = []
    for s in range(start, steps):
        if kill_at is not None and s + 1 == kill_at:   # this process only: a forked rank
            def dying(self, file, t):
                with open(file, "r+b") as fh:
                    fh.write(b"\0" * (t.numel() * t.element_size() // 2))   # half a file, then gone
                os._exit(17)
            nvme.Swapper._write = dying
        losses += train_step(engine, BATCHES, s, 1)
        if save_at == s + 1:
            engine.save_checkpoint(ckpt, client_state={"step": s + 1})
    state = engine.full_fp32_state_dict()
    tier = engine.offload.tier   # None with "device": "cpu"
    removed = [folder.removed_stale for folder in tier.folders.values()] if tier is not None else []
    engine.destroy()
    return losses, state, removed, comm.get_rank()


def _resume_twice(swap, ckpt):
    """On each rank: resume from `ckpt` with the swap files left in `swap`, then on cpu offload."""
    return {device: _train(swap, ckpt, device, 4, None, True) for device in ("nvme", "cpu")}


def test_killed_during_a_swap_resumes_bit_identically(launch, tmp_path):
    """A run saves at step 2 and is killed while writing step 3's swap files (half a file
    on disk). Resumed from the checkpoint, with the files left behind (removed at start, with a
    message) and then on cpu offload too, it continues bit for bit as a run that never
    stopped (the `launch` fixture's twin): the swap files are not the checkpoint."""
    swap, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    whole = launch[2]
    with pytest.raises(RuntimeError, match="exited with code 17"):
        run_ranks(_train, N, args=(swap, ckpt, "nvme", 4, 2, False, 3))
    left = list((tmp_path / "swap" / "minizero_swap").glob("rank*/*.swp"))
    assert left, "the killed run must leave its swap files behind"
    both = run_ranks(_resume_twice, N, args=(swap, ckpt))
    for device in ("nvme", "cpu"):
        resumed = [b[device] for b in both]
        for r in range(N):
            assert resumed[r][0] == whole[r][0][2:]
            assert all(torch.equal(whole[r][1][k], resumed[r][1][k]) for k in whole[r][1])
        if device == "nvme":
            assert all(res[2][0] > 0 for res in resumed)    # the stale files were found and removed
    assert not (tmp_path / "swap" / "minizero_swap").exists()


# ----------------------------------------------------------------------------- memory_table

def test_memory_table_nvme_column_is_the_engines_and_the_hosts_share():
    """`python -m minizero.memory_table --offload nvme`: computed from the layout, equal to the
    real engines' memory_breakdown() (2 ranks), and what "both" puts on the host is what
    "nvme" puts in files, byte for byte, the host then holding none of it."""
    from minizero.observe import memory_table as mt
    computed = mt.compute("micro", [2], offload="nvme")[2]
    both = mt.compute("micro", [2], offload="both")[2]
    measured = mt.measure("micro", 2, "bf16", offload="nvme")
    for stage in range(4):
        assert measured[0][stage][0] == measured[1][stage][0] == computed[stage][0], stage
        b, n = both[stage][0], computed[stage][0]
        assert n["device"] == b["device"] and n.get("nvme", b["host"]) == b["host"]
        assert sum(n["host"].values()) == 0 and (stage == 0) == (sum(b["host"].values()) == 0)


def test_compare_table_shows_the_nvme_place():
    """The compare report's table: an "NVMe B r0" column once a run swapped to NVMe."""
    from minizero.compare.render import table
    lib = {"final_loss": 3.0, "state_bytes_rank0": 10, "state_bytes_max": 10, "peak_mem_mb": 1.0, "samples_per_s": 1.0,
           "wire_bytes_per_step": 0, "test_loss": 3.0, "skipped_steps": 0, "device_bytes_rank0": 2,
           "host_bytes_rank0": 0}
    row = {"stage": 3, "libs": ["minizero", "deepspeed"], "max_abs_dloss": 0.0, "dloss": {"deepspeed": 0.0},
           "speed": {"deepspeed": 1.0}, "speed_ratio": 1.0,
           "minizero": {**lib, "nvme_bytes_rank0": 8}, "deepspeed": {**lib, "host_bytes_rank0": 8}}
    head, first = table([row]).splitlines()[0], table([row]).splitlines()[2]
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = [c.strip() for c in first.strip("|").split("|")]
    assert cells[cols.index("NVMe B r0 mz")] == "8" and cells[cols.index("NVMe B r0 DS")] == "-"
    assert "NVMe" not in table([{**row, "minizero": lib}])


def test_the_swap_folder_goes_when_the_swapper_dies_inside_its_own_pool(tmp_path):
    """The last reference to a Swapper can die in one of its pool's own tasks (here: the task
    drops it; in a run, the garbage collector running on an I/O thread). Its shutdown then
    cannot wait for that thread from that thread: it must not raise, and the folder must still
    go once the pool has drained (before, `cannot join current thread` was printed as ignored
    and the folder stayed)."""
    import time

    from minizero.offload.nvme import SwapFolder, Swapper
    folder = SwapFolder(str(tmp_path), 0, "offload_param.nvme_path")
    holder = [Swapper(folder, threads=2, block_size=4096)]
    holder[0].pool.submit(holder.clear).result(timeout=30)
    deadline = time.monotonic() + 30
    while os.path.exists(folder.path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(folder.path)
