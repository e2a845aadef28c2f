"""Build DeepSpeed's two JIT-compiled C++ ops once, into the folder the tests use.

    python reference/build_ops.py       # once per checkout, before the first `python -m pytest`

DeepSpeed compiles C++ ops the first time something needs them: `deepspeed_shm_comm` for its
CPU process group (about 30 s on 2 cores) and `async_io` for NVMe offload (3-6 minutes; it
links libaio: on Debian/Ubuntu `apt-get install libaio-dev`). Left to the tests, that compile
lands inside the suite's time: from a fresh clone the README's test command took 484 s on 2
cores (2026-11-26) against 220-250 s with the ops built first. Built here, into
`.torch_extensions/` of this checkout, where tests/conftest.py points TORCH_EXTENSIONS_DIR
(unless you set it), every later run loads them in a second. .ci/run calls this too.

One line per op: ready (and how long it took), or why not. Without libaio the NVMe op
cannot be built and DeepSpeed's NVMe tests skip with that reason: not an error. Exit 1 only
when an op this machine can build failed; its compiler output is in `<op>.build.log` beside it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTENSIONS_DIR = os.path.join(REPO, ".torch_extensions")   # tests/conftest.py's default


@contextlib.contextmanager
def _output_to(path: str):
    """stdout and stderr to `path`: Python's (DeepSpeed's prints) and the file descriptors
    (ninja and the compiler run as child processes)."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            log.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def build(name: str, make_builder, folder: str) -> tuple[bool, str]:
    """Build (or load, when already built) one op: (False only when it failed, its line).
    make_builder() returns DeepSpeed's op builder, or None when this machine cannot build it
    (the reason is then in the builder's compatibility check)."""
    log = os.path.join(folder, f"{name}.build.log")
    t0 = time.perf_counter()
    try:
        with _output_to(log):
            builder = make_builder()
            if builder is not None:
                builder.load()
    except Exception as e:   # noqa: BLE001: one line, whatever the compiler or DeepSpeed raised
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return False, f"{name}: FAILED after {time.perf_counter() - t0:.0f} s: {reason} (compiler output: {log})"
    if builder is None:
        return True, f"{name}: cannot be built on this machine (see {log}); the tests that need it skip"
    return True, f"{name}: ready in {time.perf_counter() - t0:.0f} s"


def _shm_comm():
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().create_op_builder("ShareMemCommBuilder")


def _async_io():
    from deepspeed.ops.op_builder import AsyncIOBuilder
    b = AsyncIOBuilder()
    return b if b.is_compatible(verbose=True) else None


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    folder = os.environ["TORCH_EXTENSIONS_DIR"]
    os.makedirs(folder, exist_ok=True)
    print(f"build_ops: DeepSpeed's C++ ops into {folder} (a first build takes minutes)", flush=True)
    ok = True
    for name, make in (("deepspeed_shm_comm", _shm_comm), ("async_io", _async_io)):
        built, line = build(name, make, folder)
        ok &= built
        print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
