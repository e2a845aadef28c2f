"""How the README's command deals the test files to its two pytest-xdist workers: whole files,
the heaviest first (longest-processing-time first), each to whichever worker is free.

Why: with each worker kept to its own core (tests/support/worker_cpus.py), a multi-rank test
has one core, so the worker that draws the step-5 agreement test (120 s then; 55-66 s at 3
tokens) late ends last: 26 s after the other in a 299 s run under xdist's default
`--dist load`, which deals runs of consecutive tests as workers free up. Heaviest first, the big files start at once, the
hundreds of sub-second tests fill in behind them, and both workers end within about 2 s.
Whole files also keep each module's fixtures (a training run shared by its tests) on one
worker, where `--dist load` may split a module and train its fixture on both. Back to back on
the 2-core machine: 318 s against 334 s with `--dist load`, both pinned, the same CPU time
(611 and 612 core-seconds; README, "Tests and CI").

HEAVY_FIRST is the order, from the CPU each file took in a serial run (core-seconds from
/proc/stat around each test, 2026-11-26): a file not listed runs after these, in collection
order. A stale list costs only time; tests/tools/test_ci.py checks that every entry exists.
The step-5 test has since shrunk (sequences of 3 tokens, not 15) and is still the heaviest.
"""
from __future__ import annotations

HEAVY_FIRST = [
    "tests/agreement/test_agreement_step5.py",            # 131 core-s at 15 tokens; 55-66 s of setup at 3 (README)
    "tests/tools/test_two_nodes.py",                      # 150 on an AVX2 core: two 8-rank launches (10 processes)
    "tests/agreement/test_agreement_checkpointing.py",    # 86 (trains every agreement configuration)
    "tests/tools/test_train_size_overrides.py",           # 46
    "tests/tools/test_compare.py",                        # 46
    "tests/tools/test_lesson_numbers.py",                 # 36
    "tests/agreement/test_agreement_loss.py",             # 35
    "tests/agreement/test_agreement_memory_offload.py",   # 32
    "tests/tools/test_train.py",                          # 24
    "tests/core/test_offload.py",                         # 21
    "tests/tools/test_run_folder.py",                     # 18
    "tests/agreement/test_checkpoint_deepspeed.py",       # 18
    "tests/core/test_overlap.py",                         # 17
    "tests/tools/test_reshard.py",                        # 15
    "tests/agreement/test_agreement_nvme.py",             # 14
    "tests/tools/test_bench_two_nodes.py",                # 38 (AVX2): one run in two network namespaces
    "tests/agreement/test_hierarchy.py",                  # 33 (AVX2): trains the 2 x 2 runs that
]   # test_hpz_references.py and test_hsdp_fsdp2.py then read (unlisted: they run after, from the shared files)


_RANK = {path: i for i, path in enumerate(HEAVY_FIRST)}


def heavy_first(nodeid: str) -> int:
    """Sort key: a test of HEAVY_FIRST's k-th file gets k, every other test len(HEAVY_FIRST).
    A stable sort by it keeps the order within a file and among the unlisted files."""
    return _RANK.get(nodeid.split("::")[0], len(HEAVY_FIRST))
