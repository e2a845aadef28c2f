"""How the README's command deals the test files to its two pytest-xdist workers: whole files,
the heaviest first (longest-processing-time first), each to whichever worker is free.

Why: with each worker kept to its own core (tests/support/worker_cpus.py), a multi-rank test
has one core, so the worker that draws a heavy file late ends last, long after the other,
under xdist's default `--dist load`, which deals runs of consecutive tests as workers free
up. Heaviest first, the big files start at once, the hundreds of sub-second tests fill in
behind them, and both workers end within seconds of each other. Whole files also keep each
module's fixtures (a training run shared by its tests) on one worker, where `--dist load` may
split a module and train its fixture on both (docs/results/test-suite-workers.md measures
both ways).

HEAVY_FIRST is the order, from the seconds each file took on one core of a 2-core machine
under the README's command (docs/results/test-suite-fourth-pass.md): a file not listed
runs after these, in collection order. A stale list costs only time; tests/tools/test_ci.py
checks that every entry exists.
"""
from __future__ import annotations

HEAVY_FIRST = [
    "tests/agreement/test_agreement_checkpointing.py",    # 66 s (trains every agreement configuration)
    "tests/tools/test_lesson_numbers.py",                 # 50
    "tests/tools/test_preflight.py",                      # 39 (its clean run: two torchruns of fresh ranks)
    "tests/agreement/test_agreement_step5.py",            # 36 (the tutorial's step 5, 2 steps, both libraries)
    "tests/agreement/test_hierarchy.py",                  # 28: trains every 2 x 2 run, those test_hpz_references.py
                                                          # and test_hsdp_fsdp2.py read too (unlisted: they run after)
    "tests/tools/test_compare.py",                        # 27
    "tests/tools/test_train_size_overrides.py",           # 25
    "tests/agreement/test_agreement_memory_offload.py",   # 24
    "tests/tools/test_bench_two_nodes.py",                # 20: one run in two network namespaces
    "tests/tools/test_dcp.py",                            # 18
    "tests/core/test_combinations.py",                    # 16
    "tests/tools/test_two_nodes.py",                      # 13: two torchruns of 4 forked ranks each
    "tests/core/test_engine.py",                          # 12
    "tests/core/test_offload.py",                         # 12
    "tests/tools/test_desync.py",                         # 10 (most of it waiting for timeouts)
    "tests/tools/test_reshard.py",                        # 10
    "tests/tools/test_lab.py",                            # 10
    "tests/core/test_teardown.py",                        # 9
]


_RANK = {path: i for i, path in enumerate(HEAVY_FIRST)}


def heavy_first(nodeid: str) -> int:
    """Sort key: a test of HEAVY_FIRST's k-th file gets k, every other test len(HEAVY_FIRST).
    A stable sort by it keeps the order within a file and among the unlisted files."""
    return _RANK.get(nodeid.split("::")[0], len(HEAVY_FIRST))
