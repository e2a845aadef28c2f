"""The desync detector (comm.py, docs/debugging.md): ranks that issue different collectives
end in seconds with an error naming the collective, never a hang.

The model takes a branch on rank 1 only (an extra module, its own ZeRO-3 unit, used only
there): at ZeRO-3 rank 1 gathers that unit in forward while rank 0 goes on to backward;
at ZeRO-2 (one bucket per parameter) rank 1 reduces the branch's gradients during backward
while rank 0 reduces them only after backward, so the buckets go out in another order.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from tests.support.harness import make_config
from tests.support.launcher import run_ranks, side_by_side

DIM = 8


class Branchy(nn.Module):
    """Two blocks and a head; `extra` (its own ZeRO-3 unit) is used only when `take_branch`."""

    def __init__(self, take_branch: bool):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.extra = nn.ModuleList([nn.Linear(DIM, 2 * DIM)])   # sizes unlike the blocks': a mismatch
        self.head = nn.Linear(DIM, 1)                            # cannot pass silently
        self.take_branch = take_branch

    def forward(self, x, y):
        h = x
        for b in self.blocks:
            h = torch.tanh(b(h))
        if self.take_branch:
            h = h + self.extra[0](h)[:, :DIM]
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def config(stage: int, check: bool = False, timeout_s=None) -> dict:
    # stage 3: every unit partitioned (no persistent small parameters); stage 2: one bucket per parameter
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {"reduce_bucket_size": 1}
    cfg = make_config(stage, micro_batch=4, lr=1e-2, zero=zero)
    coll = {k: v for k, v in (("check", check), ("timeout_s", timeout_s)) if v}
    if coll:
        cfg["minizero_collectives"] = coll
    return cfg


def train(stage: int, branch_rank, steps: int = 2, check: bool = False, timeout_s=None, count_backend=False,
          short_rank=None, linger_s: float = 0.0, done_flag: str | None = None):
    """Train `steps` steps; rank `branch_rank` takes the branch (None: no rank). Rank
    `short_rank` trains one step fewer and then stays alive `linger_s` seconds without any
    collective (a rank that skips collectives but has not crashed), or until a rank that
    failed creates the file `done_flag`: the wait the test is about is then over, and the
    rest of the linger would be sleep. Returns the losses, the ledger and (count_backend)
    the backend calls made, or the error raised."""
    import torch.distributed as dist

    import minizero
    from minizero import comm

    calls = {"n": 0}
    if count_backend:   # count what really reaches torch.distributed
        from tests.support.engine_runs import torch_names
        for name in (n for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast") for n in torch_names(op)):
            real = getattr(dist, name)

            def counted(*a, _real=real, **k):
                calls["n"] += 1
                return _real(*a, **k)
            setattr(dist, name, counted)
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = Branchy(take_branch=rank == branch_rank)
    t0 = time.perf_counter()
    try:
        engine, _, _, _ = minizero.initialize(model=model, config=config(stage, check, timeout_s))
        losses = []
        if rank == short_rank:
            steps -= 1
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, DIM, generator=g), torch.randn(4, generator=g)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    except Exception as e:   # returned, not raised: the test sees every rank's error
        seconds = time.perf_counter() - t0
        if done_flag:
            open(done_flag, "w").close()
        return {"error": f"{type(e).__name__}: {e}", "seconds": seconds}
    if rank == short_rank:
        deadline = time.perf_counter() + linger_s
        while time.perf_counter() < deadline and not (done_flag and os.path.exists(done_flag)):
            time.sleep(0.05)
        return {"losses": losses, "seconds": time.perf_counter() - t0}
    state = {k: v.clone() for k, v in engine.full_fp32_state_dict().items()}
    return {"losses": losses, "comm": engine.comm_stats(), "backend_calls": calls["n"], "state": state,
            "seconds": time.perf_counter() - t0}


@pytest.mark.parametrize("stage", [2, 3])
def test_switch_on_every_rank_names_the_mismatch_within_the_step(stage):
    results = run_ranks(train, 2, args=(stage, 1), kwargs=dict(check=True), timeout=120)
    errors = [r.get("error") for r in results]
    assert all(e and e.startswith("CollectiveMismatch: ranks issued different collectives") for e in errors), errors
    assert errors[0] == errors[1]   # the same message on every rank, so rank 0 can speak for all
    msg = errors[0]
    assert "rank 0: " in msg and "rank 1: " in msg
    assert "global step 0, micro-step 0" in msg   # the first step, where the branch is taken
    assert ("extra.0.g0.fwd" if stage == 3 else "grads") in msg
    assert max(r["seconds"] for r in results) < 30, [r["seconds"] for r in results]


TIMEOUT_S = 2


@pytest.fixture(scope="module")
def short_rank_runs(tmp_path_factory):
    """test_switch_off_a_short_timeout_names_the_waiting_collective's two launches (stage 2,
    stage 3), side by side: each waits TIMEOUT_S, together once."""
    tmp = tmp_path_factory.mktemp("short_rank")
    return dict(zip((2, 3), side_by_side(*[
        (train, 2, dict(args=(stage, None), kwargs=dict(timeout_s=TIMEOUT_S, short_rank=0, linger_s=TIMEOUT_S + 5,
                                                        done_flag=str(tmp / f"failed-{stage}")), timeout=120))
        for stage in (2, 3)])))


@pytest.mark.parametrize("stage", [2, 3])
def test_switch_off_a_short_timeout_names_the_waiting_collective(short_rank_runs, stage):
    """Rank 0 trains one step fewer (a different number of micro-steps) and stays alive:
    rank 1's first collective of step 2 waits, and gloo raises after the group's timeout
    (2 s here, as in the tests below: the wait is the test's time, and 2 s still stands
    apart from the healthy collectives before it, which take milliseconds), which the
    wrapper re-raises naming that collective."""
    timeout_s = TIMEOUT_S
    results = short_rank_runs[stage]
    assert "error" not in results[0] and len(results[0]["losses"]) == 1
    e = results[1].get("error")
    first = "all_gather 'root.g0.fwd'" if stage == 3 else "reduce_scatter 'group0.bucket0.grads'"
    assert e and e.startswith(f"CollectiveError: rank 1: {first} ("), e
    assert ("in forward" if stage == 3 else "in backward") in e
    assert "of global step 1, micro-step 1 did not complete" in e and "MINIZERO_DEBUG_COLLECTIVES=1" in e, e
    assert timeout_s <= results[1]["seconds"] < timeout_s + 20, results[1]["seconds"]


@pytest.mark.parametrize("stage", [2, 3])
def test_switch_costs_nothing_off_and_changes_no_number_on(stage):
    off, on = (run_ranks(train, 2, args=(stage, None), kwargs=dict(check=c, count_backend=True)) for c in (False, True))
    for r_off, r_on in zip(off, on):
        assert r_off.get("error") is None and r_on.get("error") is None
        calls = sum(v["calls"] for op, v in r_off["comm"].items() if op not in ("d2h", "h2d"))
        # off: exactly the ledger's collectives reach the backend; on: one check before each
        assert r_off["backend_calls"] == calls, (r_off["backend_calls"], calls)
        assert r_on["backend_calls"] == 2 * r_off["backend_calls"]
        assert r_on["comm"] == r_off["comm"]
        assert r_on["losses"] == r_off["losses"]
        assert all(torch.equal(r_on["state"][k], r_off["state"][k]) for k in r_off["state"])


def test_environment_switch_and_a_rank_left_alone_in_the_check(tmp_path):
    """MINIZERO_DEBUG_COLLECTIVES=1 turns the check on without touching the config; a rank
    that skips collectives leaves the other alone in the check, which then times out
    (timeout_s) and names the collective it was about to issue."""
    env = {"MINIZERO_DEBUG_COLLECTIVES": "1"}
    mismatch = run_ranks(train, 2, args=(3, 1), env=env, timeout=120)
    assert all(r["error"].startswith("CollectiveMismatch: ") for r in mismatch), mismatch
    alone = run_ranks(train, 2, args=(3, None), kwargs=dict(timeout_s=2, short_rank=0, linger_s=7,
                                                            done_flag=str(tmp_path / "failed")), env=env, timeout=120)
    e = alone[1].get("error")
    assert e and e.startswith("CollectiveError: rank 1: all_gather 'root.g0.fwd' ("), e
    assert "Another rank issued no collective" in e, e


def test_config_key_is_parsed_and_checked():
    from minizero.config import ConfigError, load_config
    cfg = load_config({"train_batch_size": 2, "minizero_collectives": {"check": True, "timeout_s": 30}}, 1)
    assert (cfg.collectives.check, cfg.collectives.timeout_s) == (True, 30.0)
    default = load_config({"train_batch_size": 2}, 1).collectives
    assert (default.check, default.timeout_s) == (False, None)
    with pytest.raises(ConfigError, match="minizero_collectives.timeout_s must be >= 1"):
        load_config({"train_batch_size": 2, "minizero_collectives": {"timeout_s": 0}}, 1)
    with pytest.raises(ConfigError, match="chek"):
        load_config({"train_batch_size": 2, "minizero_collectives": {"chek": True}}, 1)


@pytest.mark.parametrize("rank, printed", [(0, True), (1, False)])
def test_train_prints_a_mismatch_once_from_rank_0_as_one_line(monkeypatch, capsys, rank, printed):
    from minizero import comm
    from minizero.observe import desync
    from minizero.train import train as train_cli

    def out_of_step(args, lib):
        raise desync.CollectiveMismatch("ranks issued different collectives: rank 0: ...; rank 1: ...")
    monkeypatch.setattr(train_cli, "train", out_of_step)
    monkeypatch.setattr(train_cli, "_let_rank0_speak", lambda: None)
    monkeypatch.setattr(comm, "get_rank", lambda: rank)
    with pytest.raises(SystemExit) as exit_:
        train_cli.main([])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == ("python -m minizero.train: error: ranks issued different collectives: rank 0: ...; rank 1: ..."
                   if printed else ""), err


def test_train_prints_a_timeout_on_the_rank_that_waited(monkeypatch, capsys):
    from minizero import comm
    from minizero.observe import desync
    from minizero.train import train as train_cli

    def waited(args, lib):
        raise desync.CollectiveError("rank 1: all_gather 'root.g0.fwd' (5 x float32), 40 bytes, ... did not complete")
    monkeypatch.setattr(train_cli, "train", waited)
    monkeypatch.setattr(comm, "get_rank", lambda: 1)
    with pytest.raises(SystemExit):
        train_cli.main([])
    assert capsys.readouterr().err.strip().endswith("error: rank 1: all_gather 'root.g0.fwd' (5 x float32), 40 bytes, "
                                                    "... did not complete")


# ----------------------------------------------------------------------------- the timeout on torch < 2.14

def _wait_alone_with_a_short_timeout(done_flag: str, hide_set_timeout: bool):
    """configure(timeout_s=1) on a group started with init_distributed's 1800 s, then rank 1
    all-reduces alone (rank 0 waits for `done_flag`): the one collective under the short
    timeout is the one meant to time out, so 1 s cannot cut a healthy one short. hide_set_timeout: play a torch before
    2.14, which has no torch.distributed.set_timeout (the lent GPU machines have 2.11)."""
    import torch.distributed as dist

    from minizero.observe import desync
    if hide_set_timeout and hasattr(dist, "set_timeout"):
        delattr(dist, "set_timeout")
    try:
        desync.configure(timeout_s=1)
    except Exception as e:   # before: AttributeError where set_timeout does not exist
        open(done_flag, "w").close()
        return f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(done_flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        desync.configure()
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        waited = None
    except RuntimeError:
        waited = time.monotonic() - t0
    open(done_flag, "w").close()
    desync.configure()
    return waited


@pytest.fixture(scope="module")
def lonely_all_reduces(tmp_path_factory):
    """The two launches of the test below (set_timeout hidden, and not), side by side."""
    tmp = tmp_path_factory.mktemp("lonely")
    return dict(zip((True, False), side_by_side(*[
        (_wait_alone_with_a_short_timeout, 2, dict(args=(str(tmp / f"done-{hide}"), hide), timeout=120))
        for hide in (True, False)])))


@pytest.mark.parametrize("hide_set_timeout", [True, False], ids=["as-before-2.14", "this-torch"])
def test_a_configured_timeout_reaches_the_group_on_every_torch(lonely_all_reduces, hide_set_timeout):
    """The group's own timeout becomes the configured 1 s, with or without set_timeout: rank
    1's lonely all-reduce raises after about 1 s, not after the group's 1800 s (nor does
    configure raise AttributeError, as it did on torch < 2.14)."""
    out = lonely_all_reduces[hide_set_timeout]
    assert out[0] is None, out
    assert isinstance(out[1], float) and 1 <= out[1] < 20, out


# ----------------------------------------------------------------------------- timeouts under NCCL, faked
# NCCL cannot run here; what minizero does with it is decided by configure() and wait_named(),
# checked with torch.distributed's queries and CUDA's event faked.

def _configured(monkeypatch, backend, **kwargs):
    from minizero.observe import desync
    set_to = []
    monkeypatch.setattr(desync.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(desync.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(desync, "set_group_timeout", set_to.append)
    monkeypatch.delenv("MINIZERO_DEBUG_COLLECTIVES", raising=False)
    desync.configure(**kwargs)
    return set_to


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_check_alone_never_shortens_the_groups_timeout(monkeypatch, backend):
    # Before: 60 s with the check on, so NCCL's watchdog (or gloo) ended a healthy run
    # whenever rank 0 worked alone for a minute (sampling, a slow save).
    from minizero.observe import desync
    set_to = _configured(monkeypatch, backend, check=True)
    assert desync.guard.timeout_s == desync.DEFAULT_TIMEOUT_S
    assert set_to == ([] if backend == "gloo" else [desync.DEFAULT_TIMEOUT_S + desync.WATCHDOG_MARGIN_S])
    desync.configure()


def test_nccl_with_the_check_moves_the_watchdog_behind_the_named_timeout(monkeypatch):
    from minizero.observe import desync
    assert _configured(monkeypatch, "nccl", check=True, timeout_s=30) == [30 + desync.WATCHDOG_MARGIN_S]
    assert _configured(monkeypatch, "nccl", check=False, timeout_s=30) == [30]   # no check: the watchdog's own
    assert _configured(monkeypatch, "gloo", check=True, timeout_s=30) == [30]
    desync.configure()


class _NeverDone:
    """A CUDA event of a collective that another rank never joins."""

    def record(self):
        pass

    def query(self):
        return False


class _GpuTensor:
    is_cuda, dtype = True, torch.float32

    def numel(self):
        return 5


def test_a_hang_under_nccl_with_the_check_on_is_named_after_the_timeout(monkeypatch):
    from minizero.observe import desync
    monkeypatch.setattr(desync.torch.cuda, "Event", _NeverDone)
    monkeypatch.setattr(desync.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(desync.guard, "check", True)
    monkeypatch.setattr(desync.guard, "timeout_s", 0.2)
    t0 = time.monotonic()
    with pytest.raises(desync.CollectiveError) as e:
        desync.wait_named(_GpuTensor(), "all_gather", "root.g0.fwd", 40)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert str(e.value).startswith("rank 1: all_gather 'root.g0.fwd' (5 x float32), 40 bytes, in ")
    assert "not done after 0.2 s" in str(e.value) and "Another rank issued no collective" in str(e.value)
    monkeypatch.setattr(desync.guard, "check", False)
    desync.wait_named(_GpuTensor(), "all_gather", "root.g0.fwd", 40)   # check off: no host wait at all


# ----------------------------------------------------------------------------- node groups (hpZ, HSDP)

def _node_group_left_alone(check: bool, done_flag: str):
    """4 ranks, node groups [0, 1] and [2, 3] (process_group.new_groups, as sharding.py makes
    hpZ's and HSDP's), the collective timeout 2 s. Ranks 2 and 3 all-gather on their group;
    rank 0 does on its group, which rank 1 never joins (it waits for `done_flag`). Returns
    rank 0's error and how long it took, the others' None."""
    import torch.distributed as dist

    from minizero import comm
    from minizero.observe import desync
    group = comm.new_groups([[0, 1], [2, 3]])
    desync.subscribe()
    desync.configure(check=check, timeout_s=2)
    rank, out = dist.get_rank(), None
    try:
        if rank == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(done_flag) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            t0 = time.monotonic()
            try:
                comm.all_gather_into_tensor(torch.empty(2 * DIM), torch.ones(DIM), label="node.g0", group=group)
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
                open(done_flag, "w").close()
    finally:
        desync.configure()
    return out


@pytest.fixture(scope="module")
def node_groups_left_alone(tmp_path_factory):
    """The two launches of the test below (check off, on), side by side."""
    tmp = tmp_path_factory.mktemp("node_groups")
    return dict(zip((False, True), side_by_side(*[
        (_node_group_left_alone, 4, dict(args=(check, str(tmp / f"done-{check}")), timeout=60))
        for check in (False, True)])))


@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
def test_a_node_group_collective_left_alone_ends_in_the_named_line_within_the_timeout(node_groups_left_alone, check):
    """A node group gets the main group's timeout (process_group.new_groups) and follows
    configure's (process_group.set_timeout), so the collective that rank 1 never joins ends
    on rank 0 after about 2 s in minizero's named CollectiveError, with the check off (gloo
    raises, the wrapper names it) and on (the fingerprint is all-gathered among the node
    group's ranks, where rank 0 waits alone). Before: the node group kept torch's own 30
    minutes under gloo (10 under NCCL), past this test's 60 s limit; with the check on it
    was not checked at all."""
    out = node_groups_left_alone[check]
    assert out[1:] == [None, None, None], out
    e = out[0]["error"]
    assert e.startswith("CollectiveError: rank 0: all_gather 'node.g0' (8 x float32), 64 bytes, in "), e
    assert ("Another rank issued no collective" if check else "MINIZERO_DEBUG_COLLECTIVES=1") in e, e
    assert 2 <= out[0]["seconds"] < 20, out
