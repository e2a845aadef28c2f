import os
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests import `tests.support.launcher`; make the repository root importable.
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The suite is a CPU suite on any machine: gloo ranks, the CPU defaults of the training
# scripts (synthetic data, tiny model), DeepSpeed's CPU accelerator. On a GPU box hide the
# GPUs (before torch starts CUDA), unless the GPU check asks for its CUDA-only tests
# (MINIZERO_TEST_CUDA=1, launch/gpu_check.py).
if os.environ.get("MINIZERO_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One thread per process, as torchrun gives each rank (and the test ranks run with): this
# suite's tensors are small, and a 2-thread OpenMP pool in every `python -m minizero.train` the
# tests start (and in pytest itself) spins against the ranks and other jobs for each op. On
# this 2-core machine under load a 3-step single-process run took 23 s with 2 threads, 8 s
# with 1. Set before torch is imported; an OMP_NUM_THREADS of your own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-compiles a small C++ op (deepspeed_shm_comm) on its first CPU run and
# caches it by source path. Keep the cache per checkout: two clones sharing
# ~/.cache/torch_extensions would rebuild it back and forth (a minute each time). The folder
# is the one reference/build_ops.py builds the ops into before a first run.
from reference.build_ops import EXTENSIONS_DIR  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
# Under pytest-xdist each worker keeps to its own CPU (its own share of them), with every
# process it starts: on 2 cores the suite used 7-10% less CPU (tests/support/worker_cpus.py).
from tests.support.worker_cpus import pin_this_worker  # noqa: E402

pin_this_worker()


def pytest_configure(config):
    """Under pytest-xdist this process (the controller) picks the run's id itself, which
    xdist hands every worker (PYTEST_XDIST_TESTRUNUID), so that pytest_sessionfinish knows
    which shared folder of agreement runs to remove (tests/support/agreement.py, _shared)."""
    if (not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
            and getattr(config.option, "testrunuid", "") is None):   # -n N given, no id of the user's
        import uuid
        config.option.testrunuid = uuid.uuid4().hex


@pytest.fixture(scope="session", autouse=True)
def _children_keep_their_temporary_files_in_pytests_folder(tmp_path_factory):
    """Every process the tests start (ranks, torchrun, the commands) writes its temporary files
    under this run's pytest folder, which pytest prunes (it keeps the last 3 runs): torchrun
    leaves a torchelastic_* log folder in the temp folder on every launch, about five per run
    of the suite, which piled up in /tmp. Set after pytest picked its own folder, so this
    process's tempfile (cached by then) and the controller's shared agreement folder
    (tests/support/agreement.py) still agree on the usual temp folder."""
    tempfile.gettempdir()                            # cache this process's choice before the change
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children-tmp", numbered=False))
    yield


def pytest_collection_finish(session):
    """Have the tests' forkserver (minizero.runtime.spawn, started by the first test that
    launches ranks) import every collected test module once. A rank runs a function of its
    test module, pickled by reference: without this, every launch imported that module again
    in each rank, 13 s of the suite's rank time (py-spy). A module that skipped at import
    (pytest.importorskip) was not collected, so it is not imported there either."""
    from minizero.runtime import spawn
    spawn.preload(*sorted({item.module.__name__ for item in session.items
                           if getattr(item, "module", None) is not None}))


def pytest_sessionfinish(session):
    """The controller removes the workers' shared agreement runs (tens of MB in the temp folder).
    Only after a run with workers: without them no id was set and nothing is imported here."""
    run = getattr(session.config.option, "testrunuid", None)
    if run and not hasattr(session.config, "workerinput"):
        import shutil

        from tests.support.agreement import shared_folder
        shutil.rmtree(shared_folder(run), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the heaviest test files first (tests/support/schedule.py): the
    workers collect, and the controller deals the files in the order they report. A run
    without workers keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.support.schedule import heavy_first
        items.sort(key=lambda item: heavy_first(item.nodeid))     # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)      # an xdist hook: `-p no:xdist` (no xdist) must still run
def pytest_xdist_make_scheduler(config, log):
    """xdist's default (`-n N` alone, which means `--dist load`) becomes whole files in
    collection order, the heaviest first (tests/support/schedule.py); a --dist you name,
    `--dist load` included, is kept."""
    named = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if named or config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling
    config.option.loadscopereorder = False     # keep the heaviest-first order, not "most tests first"
    return LoadFileScheduling(config, log)
