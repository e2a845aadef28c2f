"""comm.destroy(): no gloo thread outlives it, and on a clean exit every rank waits for the others.

Why (issue 8): a finished run sometimes aborted at exit with "terminate called without an
active exception". A gloo worker thread lets go of a collective's tensors a moment after the
caller has the result; when that needs the GIL while the interpreter shuts down, CPython ends
the thread inside a C++ destructor and the process aborts (the core dump shows the worker in
~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate,
the main thread in Py_FinalizeEx). destroy() now stops those threads (the group is freed, and
its destructor joins them), after a barrier. The crash itself is a race (a few launches in a
hundred) and cannot be reproduced on demand: its stress test is launch/stress_exit.sh, run by
hand. What is checked here is what makes it impossible.
"""
import ast
import os
import subprocess
import sys
import time

import pytest

from tests.support.launcher import free_port, side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What train.py does, in a fresh interpreter (the order of imports matters): init, an
# optimizer (torch.optim imports torch._dynamo, which imports torch.distributed.nn.functional,
# whose default arguments would hold the group), a collective, destroy(); then the threads left.
RANK_SCRIPT = """
import os, torch
from minizero import comm
comm.init_distributed()
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
comm.all_gather_object(comm.get_rank())
comm.destroy()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_destroy_stops_the_gloo_threads():
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
        threads = ast.literal_eval(out.strip().splitlines()[-1])
        assert not [t for t in threads if "gloo" in t], f"rank {rank}: threads alive after destroy(): {threads}"


# Timing bound: one rank reaches destroy() DELAY s after the other. Both leave
# init_process_group's rendezvous together (skew: tens of ms on a busy CPU), so a barrier
# keeps the early rank DELAY s minus that skew; without one destroy() takes a few ms (measured
# at DELAY 2: 2.02 s with, 0.02 s without). Half of DELAY separates the two with a wide margin
# either way; the test's two launches wait DELAY side by side, and it is kept short.
DELAY = 1.0


def _timed_destroy(late_rank: int, fail: bool):
    """Rank `late_rank` sleeps DELAY s first; every rank returns (seconds in destroy, still up)."""
    from minizero import comm
    if comm.get_rank() == late_rank:
        time.sleep(DELAY)
    t0 = time.perf_counter()
    try:
        try:
            if fail:
                raise RuntimeError("this rank failed")
        finally:                       # as in train.main: destroy() in a finally block
            comm.destroy()
            seconds = time.perf_counter() - t0
    except RuntimeError:
        pass
    return seconds, comm.is_distributed()


def test_destroy_waits_for_every_rank_on_a_clean_exit_only():
    # The two launches side by side (tests/support/launcher.py's side_by_side: a thread each,
    # their own ranks and port), so their DELAYs overlap; each rank's seconds are its own.
    clean, failed = side_by_side((_timed_destroy, 2, dict(args=(1, False))), (_timed_destroy, 2, dict(args=(1, True))))
    # Clean exit: rank 0 (the one that aborted in the issue) waits for the late rank 1, so no
    # rank tears the group down while another still uses it.
    (wait0, up0), (_, up1) = clean
    assert wait0 > DELAY / 2, f"rank 0 left destroy() after {wait0:.3f} s, before rank 1 arrived"
    assert not up0 and not up1
    # Error exit: another rank may be gone or stuck in a collective; waiting would hang.
    (wait0, up0), (_, up1) = failed
    assert wait0 < DELAY / 2, f"rank 0 waited {wait0:.3f} s in destroy() while an exception propagated"
    assert not up0 and not up1
