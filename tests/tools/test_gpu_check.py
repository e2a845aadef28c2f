"""launch/gpu_check.py without a GPU: the plan for 0, 1, 2, 3 and 8 GPUs, the verdicts on
made-up results, the table, the runner (failures, timeouts, SIGTERM), the command line
(--dry-run here says no GPU was found), and the consolidate driver on gloo ranks.

What needs CUDA is docs/gpu.md's business; here only what decides PASS / FAIL / SKIP."""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "gpu_check.py"

gc = load_script(SCRIPT, register=True)   # dataclasses look their module up while the class is built

RESUME_1 = [f"resume-1gpu-z{s}-{d}" for s in range(4) for d in ("fp16", "bf16")]
RESUME_N = [f"resume-allgpu-z{s}-{d}" for s in range(4) for d in ("fp16", "bf16", "fp32")]
MULTI = ["offload-step5-allgpu", *RESUME_N, *(f"overlap-z{s}-{d}" for s in range(4) for d in ("bf16", "fp32")),
         *(f"memory-z{s}" for s in range(4)), "memory-falls", "2node-preflight", "2node-straight", "2node-resume",
         "offload-opt-z1", "offload-opt-z2", "offload-param-z3", "consolidate-offload-z1", "consolidate-offload-z2",
         "observe-allgpu", "cpu-checkpointing-allgpu"]
NODES4 = ["2node-hpz", "2node-hsdp"]   # hpZ and HSDP need nodes of 2 GPUs at least
TWO_NODES = ["2node-preflight", "2node-straight", "2node-resume", *NODES4]
SYNC_DEBUG = [f"sync-debug-z{s}-{d}" for s in range(4) for d in ("bf16", "fp16")] + ["sync-debug-z3-bf16-default"]
SINGLE = ["cpu-suite", "cuda-checkpointing", "cuda-offload", "nccl-ws1", "offload-step5-1gpu", *RESUME_1,
          "memory-overlap-z2", "memory-overlap-z3", *SYNC_DEBUG, "user-command", "compare"]


def by_name(n, quick=False):
    return {c.name: c for c in gc.plan(n, quick)}


def procs(check):
    return [p for step in check.steps if isinstance(step, list) for p in step]


def flag(argv, name):
    return argv[argv.index(name) + 1]


# ----------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("n", [0, 1, 2, 3, 8])
def test_plan_lists_every_check_and_skips_what_needs_more_gpus(n):
    checks = gc.plan(n)
    assert sorted(c.name for c in checks) == sorted(SINGLE + MULTI + NODES4)      # the same table on every machine
    skips = {c.name: c.skip for c in checks if c.skip}
    if n == 0:
        assert skips == {name: "no GPU found" for name in SINGLE + MULTI + NODES4}
    elif n == 1:
        assert skips == {**{name: "needs 2 GPUs (found 1)" for name in MULTI},
                         **{name: "needs 4 GPUs (found 1)" for name in NODES4}}
    elif n < 4:
        assert skips == {name: f"needs 4 GPUs (found {n})" for name in NODES4}
    else:
        assert skips == {}


def test_plan_with_8_gpus_uses_them_all_and_splits_them_for_two_nodes():
    c = by_name(8)
    for name in RESUME_N:
        for p in procs(c[name]):
            assert p.argv[p.argv.index("--standalone") + 1:][:2] == ["--nproc-per-node", "8"]
            assert p.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert flag(procs(c["memory-z3"])[0].argv, "--nproc-per-node") == "8"
    assert procs(c["sync-debug-z1-bf16"])[0].argv[3:5] == ["sync-debug", "8"]   # --driver NAME WORLD
    assert flag(procs(c["compare"])[0].argv, "--nproc") == "8"
    for name in TWO_NODES:
        node0, node1 = procs(c[name])
        assert node0.argv == node1.argv   # the same line on both nodes, as on a cluster
        assert [flag(node0.argv, f) for f in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint")] \
            == ["2", "4", "c10d", "127.0.0.1:{port}"]
        assert (node0.env["CUDA_VISIBLE_DEVICES"], node1.env["CUDA_VISIBLE_DEVICES"]) == ("0,1,2,3", "4,5,6,7")
        assert (node0.env["MINIZERO_HOST"], node1.env["MINIZERO_HOST"]) == ("node0", "node1")


@pytest.mark.parametrize("quick", [False, True])
def test_two_node_checks_come_first_at_full_size_every_flatparam_partitioned_without_detail(quick):
    """What the two-node checks claim is what a cluster job does: the tutorial GPT at 32x32
    (--quick or not), stage3_param_persistence_threshold 0 in every config they read (at the
    default threshold the small GPTs keep every parameter persistent, and hpZ would pass without
    a secondary shard), hpZ's k and HSDP's S = the GPUs of one node, no
    TORCH_DISTRIBUTED_DEBUG=DETAIL (it syncs the host before each collective), and a hang
    reported in well under two minutes."""
    from minizero.config import load_config
    checks = gc.plan(8, quick)
    assert [c.name for c in checks[:len(TWO_NODES)]] == TWO_NODES
    for c in checks[:len(TWO_NODES)]:
        for p in procs(c):
            assert (flag(p.argv, "--model"), flag(p.argv, "--image-size")) == ("tutorial", "32"), c.name
            assert "TORCH_DISTRIBUTED_DEBUG" not in p.env and p.env["MINIZERO_DETERMINISTIC"] == "1"
            assert p.stall and p.stall < 120
            zero = load_config(json.loads((ROOT / flag(p.argv, "--config")).read_text()), 8).zero
            assert zero.stage3_param_persistence_threshold == 0, (c.name, flag(p.argv, "--config"))
            if c.name in NODES4:
                assert max(zero.zero_hpz_partition_size, zero.hsdp_shard_size) == int(flag(p.argv, "--nproc-per-node"))
    assert [c.name for c in gc.select(checks, only=["2node-*"])] == TWO_NODES   # alone: no CPU suite before them
    assert all(gc.plan(4)[i].name == TWO_NODES[i] for i in range(len(TWO_NODES)))
    hpz2 = procs(by_name(4)["2node-hpz"])[0]
    assert flag(hpz2.argv, "--config").endswith("two_nodes_hpz2.json") and flag(hpz2.argv, "--nproc-per-node") == "2"
    assert by_name(12)["2node-hpz"].skip == "nodes of 6 GPUs: the configs carry k = S = 2, 4, 8"


def test_a_silent_step_is_hung_and_stopped_after_its_stall(tmp_path):
    """Two "nodes" that print once and then wait for good (a collective that never completes):
    after `stall` seconds with no output from either, both are stopped and the check FAILs
    as hung, long before the commands' own time limit."""
    py = sys.executable
    quiet = lambda n: gc.Proc([py, "-c", "import time; print('started', flush=True); time.sleep(300)"],
                              f"node{n}.log", timeout=300, stall=1)   # the wait is the test's time
    t0 = time.monotonic()
    (tmp_path / "logs").mkdir()
    r = gc.run_check(gc.Check("hang", "", steps=[[quiet(0), quiet(1)]]), tmp_path, tmp_path / "logs")
    assert r.status == "FAIL" and r.reason.startswith("hung: no output from any of the step's commands for 1 s"), r
    assert time.monotonic() - t0 < 30


def test_preflight_verdict_reads_both_nodes_logs():
    ok = ("preflight: ok   bandwidth: all_reduce of 64 MiB, bus bandwidth inside a node 180.2 GB/s (4 ranks); "
          "between nodes 90.1 GB/s (4 ranks) on nccl\npreflight: 8 ok, 0 warn, 0 FAIL in 21.0 s: start the job\n")
    other = "preflight: ok   this node (node1, ranks 4-7) took part; rank 0 prints the report on node0: 0 FAIL\n"
    r = gc.preflight_verdict(ok, other)
    assert r.status == "PASS" and r.numbers.startswith("inside a node 180.2 GB/s"), r
    bad = gc.preflight_verdict("preflight: FAIL save folder: host node1 does not see ...\npreflight: 7 ok, 0 warn, "
                               "1 FAIL in 20.0 s: fix\n", other)
    assert bad.status == "FAIL" and bad.reason.startswith("save folder: host node1"), bad
    assert gc.preflight_verdict("", "").reason == "no report line"


def test_plan_with_3_gpus_splits_what_divides():
    c = by_name(3)
    node0, node1 = procs(c["2node-straight"])
    assert (node0.env["CUDA_VISIBLE_DEVICES"], node1.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")


@pytest.mark.parametrize("quick", [False, True])
def test_resume_checks_resume_the_straight_runs_first_checkpoint_with_deterministic_kernels(quick):
    size = gc.QUICK if quick else gc.FULL
    for name, check in by_name(8, quick).items():
        if "resume" not in name or name in TWO_NODES:   # the two-node checks are full size, --quick or not
            continue
        for p in procs(check):
            assert p.env["MINIZERO_DETERMINISTIC"] == "1" and p.env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            assert flag(p.argv, "--model") == size.model and flag(p.argv, "--max-steps") == str(size.steps)
            if "--resume" in p.argv:
                assert flag(p.argv, "--tag") == f"global_step{size.save_every}"
                assert flag(p.argv, "--save-dir") != flag(p.argv, "--resume")
            else:
                assert flag(p.argv, "--save-every") == str(size.save_every)
    assert size.save_every < size.steps


def test_every_run_has_its_own_save_dir():
    """A save folder that holds a run is refused, so no two steps may share one (the two
    nodes of one step do share theirs: that is one run)."""
    seen = []
    for check in gc.plan(8):
        for step in check.steps:
            if isinstance(step, list):
                dirs = {p.argv[p.argv.index("--save-dir") + 1].replace("{dir}", check.name) for p in step
                        if "--save-dir" in p.argv}
                assert len(dirs) <= 1, (check.name, dirs)
                seen += sorted(dirs)
    assert len(seen) == len(set(seen)), [d for d in seen if seen.count(d) > 1]


def test_cpu_suite_hides_cuda_and_memory_keeps_igpt_s_when_quick():
    assert procs(by_name(1)["cpu-suite"])[0].env["CUDA_VISIBLE_DEVICES"] == ""
    assert procs(by_name(1)["cuda-checkpointing"])[0].env == {"MINIZERO_TEST_CUDA": "1"}   # conftest hides CUDA else
    for quick in (False, True):
        p = procs(by_name(2, quick)["memory-z0"])[0]
        assert flag(p.argv, "--model") == "igpt-s" and flag(p.argv, "--image-size") == "32"
        assert int(flag(p.argv, "--max-steps")) >= 2       # moments exist from step 2's backward on
        assert "MINIZERO_DETERMINISTIC" not in p.env        # measurements run the default kernels


def test_select_keeps_what_only_needs_and_drops_what_skip_orphans():
    names = lambda cs: [c.name for c in cs]
    assert names(gc.select(gc.plan(2), only=["2node-resume"])) == ["2node-straight", "2node-resume"]
    assert names(gc.select(gc.plan(2), only=["memory-falls"])) == [f"memory-z{s}" for s in range(4)] + ["memory-falls"]
    left = names(gc.select(gc.plan(2), skip=["memory-z*", "cpu-*"]))
    assert "memory-falls" not in left and "cpu-suite" not in left and "memory-z0" not in left
    assert len(left) == len(SINGLE + MULTI + NODES4) - 7   # memory-z0..3, memory-falls, cpu-suite, cpu-checkpointing-allgpu


def test_visible_maps_plan_indices_through_the_parents_list():
    assert gc.visible("0,1", None) == "0,1"
    assert gc.visible("2,3", "4,5,6,7") == "6,7"
    assert gc.visible("", "4,5") == ""                   # the CPU suite hides every GPU


# ----------------------------------------------------------------------------- verdicts

def summary(losses, status="completed", **kw):
    return {"status": status, "losses": losses, "samples_per_s": 100.0, **kw}


def test_max_abs_diff():
    assert gc.max_abs_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert gc.max_abs_diff([1.0, 2.0], [1.5, 1.0]) == 1.0
    assert gc.max_abs_diff([1.0], [1.0, 2.0]) is None
    assert gc.max_abs_diff([], []) is None
    for bad in (math.inf, -math.inf, math.nan, None):
        assert gc.max_abs_diff([1.0, bad], [1.0, bad]) is None


def test_resume_verdict():
    a = [3.0, 2.5, 2.25, 2.0]
    ok = gc.resume_verdict(summary(a), summary(list(a)), 2, deterministic=True)
    assert ok.status == "PASS" and "max |dloss| 0 over steps 3-4" in ok.numbers and "kernels on" in ok.numbers
    off = gc.resume_verdict(summary(a), summary(a[:3] + [2.0 + 2 ** -20]), 2, deterministic=False)
    assert off.status == "FAIL" and "differ" in off.reason and "did not turn deterministic kernels on" in off.reason
    assert "9.54e-07" in off.numbers
    assert gc.resume_verdict(summary(a), summary(a, status="diverged"), 2, True).status == "FAIL"
    assert gc.resume_verdict(summary(a), summary(a[:3]), 2, True).status == "FAIL"
    assert gc.resume_verdict(summary(a[:3] + [math.nan]), summary(a[:3] + [math.nan]), 2, True).status == "FAIL"


PSI = 76_706_304   # iGPT-S


def mem_summary(stage, states, peaks_mib, world=2):
    return {"status": "completed", "params": PSI, "world_size": world, "dtype": "bf16",
            "model_state_bytes": states, "peak_mem_mb": peaks_mib}


def z3_states(world=2, pad=0):
    """ZeRO-3, bf16: every category partitioned (2 + 2 + 4 + 8 bytes per element / N)."""
    shard = PSI // world + pad
    return {"params": 2 * shard, "grads": 2 * shard, "master_params": 4 * shard, "optimizer_states": 8 * shard}


def test_memory_verdict_on_made_up_summaries():
    states = [z3_states(pad=3), z3_states(pad=3)]
    total = sum(states[0].values())                        # 16 * (PSI/2 + 3) = 613,650,480 bytes
    assert total == 613_650_480
    ok = gc.memory_verdict(mem_summary(3, states, [4000.0, 4100.0]), 3, at_rest_mb=600.0)
    assert ok.status == "PASS", ok
    # the formula: 16 Ψ / 2 = 613,650,432 bytes = 585.2 MiB
    assert "formula 585 MiB" in ok.numbers and "peak 4,100 MiB" in ok.numbers
    low_peak = gc.memory_verdict(mem_summary(3, states, [4000.0, 585.0]), 3, at_rest_mb=600.0)
    assert low_peak.status == "FAIL" and "rank 1: peak 585.0 MiB < its model states 585.2 MiB" in low_peak.reason
    kept = (2 + 4 + 8) * (PSI // 2 + 3) / 2 ** 20         # 512.1 MiB: all but the gradients
    assert gc.memory_verdict(mem_summary(3, states, [4000.0] * 2), 3, at_rest_mb=kept + 0.1).status == "PASS"
    at_rest = gc.memory_verdict(mem_summary(3, states, [4000.0] * 2), 3, at_rest_mb=kept - 0.1)
    assert at_rest.status == "FAIL" and "rank 0 at rest" in at_rest.reason
    short = [{**z3_states(), "optimizer_states": 0}] * 2   # an engine that reports less than the formula
    assert "< formula" in gc.memory_verdict(mem_summary(3, short, [4000.0] * 2), 3, None).reason
    assert gc.memory_verdict({**mem_summary(3, states, [4000.0] * 2), "status": "failed"}, 3, None).status == "FAIL"


def test_memory_falls_verdict():
    assert gc.memory_falls_verdict({0: 5000.0, 1: 4500.0, 2: 4600.0, 3: 4400.0}).status == "PASS"  # stage 2 free
    assert gc.memory_falls_verdict({0: 5000.0, 1: 4500.0, 2: 4450.0, 3: 4500.0}).status == "FAIL"
    assert gc.memory_falls_verdict({0: 4500.0, 1: 4500.0, 2: 4400.0, 3: 4300.0}).status == "FAIL"


def test_compare_row_reads_compares_results_json(tmp_path):
    """The fields minizero.compare.stage_row writes, one row per stage, in one line."""
    lib = lambda sps, peak: {"samples_per_s": sps, "peak_mem_mb": peak, "final_loss": 3.0}
    rows = [{"stage": s, "max_abs_dloss": 3.1e-5 * s, "speed_ratio": 1.25, "minizero": lib(500.0, 1234.4),
             "deepspeed": lib(400.0, 1300.0)} for s in range(4)]
    (tmp_path / "compare" / "report").mkdir(parents=True)
    (tmp_path / "compare" / "report" / "results.json").write_text(json.dumps({"rows": rows}))
    ctx = gc.Ctx(tmp_path / "compare", tmp_path, [])
    r = gc.judge_compare("{out}/compare/report/results.json")(ctx)
    assert r.status == "PASS" and r.numbers.startswith("minizero / DeepSpeed z0: 500 / 400 samples/s, 1,234 / 1,300 MiB")
    assert "z2: 500 / 400 samples/s, 1,234 / 1,300 MiB, |dloss| 6.2e-05" in r.numbers


TORCHRUN_TAIL = ("Traceback (most recent call last):\n  File \"torch/distributed/run.py\"\n"
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
def test_pytest_counts_and_verdict():
    line = "312 passed, 3 skipped, 1 deselected, 2 warnings in 241.20s (0:04:01)"
    assert gc.pytest_counts("....\n" + line) == {"passed": 312, "skipped": 3, "deselected": 1, "warnings": 2}
    assert gc.pytest_counts("1 failed, 2 passed, 1 error in 3.1s") == {"failed": 1, "passed": 2, "errors": 1}
    ok = gc.pytest_verdict(0, line, allow_skips=True)
    assert ok.status == "PASS" and ok.numbers == "312 passed, 3 skipped, 1 deselected"
    skipped = gc.pytest_verdict(0, "3 skipped, 40 deselected in 1.0s", allow_skips=False)
    assert skipped.reason == "tests were skipped: does torch see CUDA?"      # nothing ran: CUDA not visible
    assert gc.pytest_verdict(0, "2 passed, 1 skipped in 1s", allow_skips=False).status == "FAIL"
    assert gc.pytest_verdict(0, "3 passed in 2.0s", allow_skips=False).status == "PASS"
    failed = gc.pytest_verdict(1, "FAILED tests/test_a.py::test_x - assert 1 == 2\n1 failed, 311 passed in 200s",
                               allow_skips=True)
    assert failed == gc.Result("FAIL", "pytest exit 1: tests/test_a.py::test_x", "1 failed, 311 passed")
    assert gc.pytest_verdict(5, "no tests ran in 0.1s", allow_skips=True).status == "FAIL"
    assert gc.pytest_verdict(0, "40 deselected in 0.1s", allow_skips=True).reason == "no test passed"


def test_last_error_names_the_cause_not_torchruns_wrapper():
    log = ("step=  10 loss=3.1\n[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\"\n"
           "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n" + TORCHRUN_TAIL)
    assert gc.last_error(log) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert gc.last_error("a\npython -m minizero.train: error: --resume x: no such folder\nb") == \
        "python -m minizero.train: error: --resume x: no such folder"
    assert gc.last_error("") == "(empty log)"


def test_format_table():
    rows = [("cpu-suite", gc.Result("PASS", "", "312 passed"), 201.4),
            ("memory-z0", gc.Result("FAIL", "peak does not fall", "a | b"), 12.0),
            ("overflow-z0", gc.Result("SKIP", "needs 2 GPUs (found 1)"), None)]
    assert gc.format_table(rows).splitlines() == [
        "| check | result | numbers | s |", "|---|---|---|---|",
        "| cpu-suite | PASS | 312 passed | 201 |",
        "| memory-z0 | FAIL: peak does not fall | a \\| b | 12 |",
        "| overflow-z0 | SKIP: needs 2 GPUs (found 1) |  |  |"]


# ----------------------------------------------------------------------------- the command line

def run_cli(*args, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["CUDA_VISIBLE_DEVICES"] = ""          # no GPU, even on a GPU box (the CPU suite runs there too)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, **kw)


@pytest.mark.parametrize("flag_", ["--plan", "--dry-run"])
def test_plan_on_a_machine_without_gpus_lists_every_check_with_its_commands(tmp_path, flag_, capsys, monkeypatch):
    """The command line once (--plan), its probe a fresh interpreter that finds no GPU; its
    other spelling (--dry-run, the same argparse option) through main(argv), the probe what
    the command's probe found (CUDA hidden): a second command would import torch twice more
    to count the same 0 GPUs and print the same plan."""
    out = tmp_path / "report"
    if flag_ == "--plan":
        r = run_cli(flag_, "--out", str(out))
        assert r.returncode == 0, r.stderr
        said = r.stdout
        monkeypatch.setattr(gc, "probe", lambda: {"count": 0, "names": []})
    else:
        monkeypatch.setattr(gc, "probe", lambda: {"count": 0, "names": []})
        assert gc.main([flag_, "--out", str(out)]) == 0
        said = capsys.readouterr().out
    assert "no GPU found" in said and "the plan for 8 GPUs" in said
    listed = re.findall(r"^\[\s*\d+\] (\S+): (.*)$", said, re.M)
    assert sorted(name for name, _ in listed) == sorted(SINGLE + MULTI + NODES4)
    assert not [name for name, what in listed if what.startswith("SKIP")]
    assert said.count("\n     $ ") >= len(SINGLE + MULTI + NODES4) - 5   # commands (memory-falls, compare-z* read files)
    assert not out.exists()
    # Asked for: the plan for 0 GPUs. main(argv) here, its probe what the command's probe just
    # found (CUDA hidden): the command line is tested above, and probe's own subprocess (a
    # fresh interpreter importing torch, 2 s) would only count the same 0 GPUs again.
    assert gc.main([flag_, "--gpus", "0", "--out", str(out)]) == 0
    listed = re.findall(r"^\[\s*\d+\] (\S+): SKIP: no GPU found$", capsys.readouterr().out, re.M)
    assert sorted(listed) == sorted(SINGLE + MULTI + NODES4)
    assert not out.exists()


def test_a_plan_for_gpus_this_machine_lacks_is_one_line_without_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gc, "probe", lambda: {"count": 0, "names": []})
    assert gc.main(["--gpus", "2", "--out", str(tmp_path / "report")]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(errors) == 1 and "torch sees 0 GPU(s) here; add --dry-run" in errors[0]
    assert not (tmp_path / "report").exists()


def test_unknown_check_name_and_a_used_report_folder_are_one_line(tmp_path, capsys):
    assert gc.main(["--only", "resume-9gpu-*"]) == 2
    assert "no check matches resume-9gpu-*" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "gpu_check.md").write_text("an earlier report")
    assert gc.main(["--out", str(tmp_path / "old")]) == 2
    assert "is not empty; pass a new --out" in capsys.readouterr().err


def test_run_all_goes_on_after_failures(tmp_path, capsys):
    """The runner on real (tiny) subprocesses: a failing command is a FAIL with its error
    line, a timeout is a FAIL, a check that needs a failed one is a SKIP, even a bug in a
    judge is one FAIL, and the checks after all of them still run."""
    py = sys.executable
    def proc(code, name, timeout=60):
        return [[gc.Proc([py, "-c", code], f"{name}.log", timeout=timeout)]]
    def broken_judge(ctx):
        raise RuntimeError("a bug")
    checks = [gc.Check("bad", "", steps=proc("raise SystemExit('boom: error: it broke')", "bad")),
              gc.Check("slow", "", steps=proc("import time; time.sleep(60)", "slow", timeout=1)),
              gc.Check("after", "", after=("bad",)),
              gc.Check("buggy", "", steps=proc("pass", "buggy"), judge=broken_judge),
              gc.Check("ok", "", steps=proc("print('fine')", "ok"))]
    done = {name: r for name, r, _ in gc.run_all(checks, tmp_path)}
    assert done["bad"].status == "FAIL" and "exit 1: boom: error: it broke" in done["bad"].reason
    assert done["slow"] == gc.Result("FAIL", "timed out (limit 1 s), log logs/slow.log")
    assert done["after"] == gc.Result("SKIP", "needs bad to pass (it is FAIL)")
    assert done["buggy"] == gc.Result("FAIL", "gpu_check itself failed: RuntimeError: a bug")
    assert done["ok"].status == "PASS"
    ok_cmd = gc.show([py, "-c", "print('fine')"], {})
    assert (tmp_path / "logs" / "ok.log").read_text().splitlines() == [f"$ {ok_cmd}", "fine"]
    assert "after: running" not in capsys.readouterr().out


def test_failure_names_the_command_that_failed_not_the_partner_we_stopped():
    a, b = gc.Proc(["a"], "a.log"), gc.Proc(["b"], "b.log", may_fail=True)
    assert gc.failure([(a, None, "a.log"), (a, 3, "x.log")]) == (a, 3, "x.log")
    assert gc.failure([(a, None, "a.log"), (a, 0, "x.log")]) == (a, None, "a.log")
    assert gc.failure([(b, 1, "b.log"), (a, 0, "x.log")]) is None           # may fail: the judge decides
    assert gc.failure([(b, None, "b.log")]) == (b, None, "b.log")           # but not hang


def test_a_failed_command_stops_its_partner_after_the_grace(tmp_path, monkeypatch):
    """Two "nodes" of one step: when one dies, the other (which would wait for its peer until
    NCCL's timeout) is stopped after GRACE_S, not after its own timeout."""
    monkeypatch.setattr(gc.runner, "GRACE_S", 1)
    py = sys.executable
    dead = gc.Proc([py, "-c", "raise SystemExit(3)"], "node0.log", timeout=300)
    waiting = gc.Proc([py, "-c", "import time; time.sleep(300)"], "node1.log", timeout=300)
    t0 = time.monotonic()
    res = gc.run_step([waiting, dead], tmp_path, tmp_path, tmp_path)
    assert [rc for _, rc, _ in res] == [None, 3]           # None: stopped by us
    assert time.monotonic() - t0 < 30


# ----------------------------------------------------------------------------- the shell wrapper

def test_wrapper_parses_says_what_it_runs_and_passes_arguments_on():
    sh = ROOT / "launch" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(sh)], capture_output=True).returncode == 0
    lines = sh.read_text().splitlines()[1:]                 # the comment block after the shebang
    header = "\n".join(ln.lstrip("#").strip() for ln in lines[:next(i for i, ln in enumerate(lines)
                                                                      if not ln.startswith("#"))])
    assert re.search(r"what it (runs|is for)", header, re.I)                       # test_launch.py's rules
    assert re.search(r"node.*gpu count|number of (nodes|processes)", header, re.I | re.S)
    assert 'launch/gpu_check.py "$@"' in sh.read_text()
    assert os.access(sh, os.X_OK)


def test_offload_checks_run_the_tutorials_step5_config_and_the_cuda_offload_tests():
    plan = by_name(2)
    assert procs(plan["cuda-offload"])[0].env == {"MINIZERO_TEST_CUDA": "1"}
    assert "tests/core/test_offload.py" in procs(plan["cuda-offload"])[0].argv
    for name, nproc in (("offload-step5-1gpu", 1), ("offload-step5-allgpu", 2)):
        straight, resumed = procs(plan[name])
        for p in (straight, resumed):
            assert flag(p.argv, "--config") == "launch/ds_config_step5.json"
            assert flag(p.argv, "--model") == "tutorial-24"
        assert "--resume" in resumed.argv and ("--nproc-per-node" in straight.argv) == (nproc > 1)
    assert flag(procs(by_name(2, quick=True)["offload-step5-1gpu"])[0].argv, "--model") == "tiny"


# ----------------------------------------------------------------------------- issue 25's checks

def test_memory_checks_run_zero3_with_prefetch_and_reuse_at_0():
    # At DeepSpeed's default reuse distance ZeRO-3 keeps every unit gathered from forward to
    # backward, and memory-falls would fail for a config reason.
    from minizero.config import load_config
    for stage in range(4):
        p = procs(by_name(2)[f"memory-z{stage}"])[0]
        path = ROOT / flag(p.argv, "--config")
        with open(path) as f:
            cfg = json.load(f)
        z = load_config(cfg, 2).zero
        assert (z.stage3_prefetch_bucket_size, z.stage3_max_reuse_distance) == (0, 0)
        assert flag(p.argv, "--stage") == str(stage)
        # otherwise the trainer's default config
        from minizero.train.train_args import DEFAULT_CONFIG
        assert {k: v for k, v in cfg.items() if k != "zero_optimization"} == \
            {k: v for k, v in DEFAULT_CONFIG.items() if k != "zero_optimization"}


def test_memory_overlap_checks_differ_only_in_overlap_comm_with_small_buckets():
    """With DeepSpeed's 5e8-element reduce bucket iGPT-S's whole gradient is one bucket, on or
    off; 5e6 elements (10 MB in bf16) leave room for a bounded design to show."""
    on, off = (json.loads((ROOT / gc.CONFIGS / f"memory_overlap_{k}.json").read_text()) for k in ("on", "off"))
    assert on["zero_optimization"].pop("overlap_comm") is True and off["zero_optimization"].pop("overlap_comm") is False
    assert on == off and on["zero_optimization"]["reduce_bucket_size"] == 5_000_000
    for stage in (2, 3):
        p_on, p_off = procs(by_name(1)[f"memory-overlap-z{stage}"])
        assert flag(p_on.argv, "--stage") == flag(p_off.argv, "--stage") == str(stage)
        assert flag(p_on.argv, "--model") == "igpt-s" and "--nproc-per-node" not in p_on.argv


def test_every_check_config_is_a_valid_config():
    from minizero.config import load_config
    for path in sorted((ROOT / "launch" / "gpu_check_configs").glob("*.json")):
        with open(path) as f:
            load_config(json.load(f), 8)   # the world the plan is for (2 nodes x 4): hpZ's and HSDP's k divide it


def test_consolidate_and_sync_debug_verdicts():
    good = {"master_on_host": True, "equals_checkpoint": True, "finite": True}
    assert gc.consolidate_verdict([dict(good, rank=r) for r in range(2)]).status == "PASS"
    bad = gc.consolidate_verdict([dict(good, rank=0), dict(good, rank=1, equals_checkpoint=False)])
    assert bad.status == "FAIL" and "rank 1: gathered state != the checkpoint's" in bad.reason
    one = ["minizero/engine.py:290"]
    ok = gc.sync_debug_verdict([{"rank": r, "syncs": one, "loss": 2.0} for r in range(2)])
    assert ok.status == "PASS" and "minizero/engine.py:290" in ok.numbers
    two = gc.sync_debug_verdict([{"rank": 0, "syncs": one + ["minizero/zero3.py:180"], "loss": 2.0}])
    assert two.status == "FAIL" and "[2]" in two.reason and "minizero/zero3.py:180" in two.reason
    assert gc.sync_debug_verdict([{"rank": 0, "syncs": [], "loss": 2.0}]).status == "FAIL"


def test_nccl_ws1_and_memory_overlap_verdicts():
    case = lambda ok, why="", calls=None: {"identical": ok, "reason": why, "calls": calls or {"all_reduce": 3}}
    ok = gc.nccl_ws1_verdict({"backend": "nccl", "cases": {"a": case(True), "b": case(True)}})
    assert ok.status == "PASS" and ok.numbers == "2 cases, 6 collectives through nccl, each issued late"
    bad = gc.nccl_ws1_verdict({"backend": "nccl", "cases": {"a": case(True), "b": case(False, "losses differ")}})
    assert bad.status == "FAIL" and bad.reason == "b: losses differ"
    psi = 76_706_304
    run = lambda peak: {"status": "completed", "params": psi, "peak_mem_mb": [peak]}
    assert gc.memory_overlap_verdict(run(3000.0), run(2990.0)).status == "PASS"
    held = gc.memory_overlap_verdict(run(3000.0 + 146.3), run(3000.0))     # the whole bf16 gradient: 2Ψ bytes
    assert held.status == "FAIL" and "not bounded" in held.reason and "2Ψ = 146 MiB" in held.numbers
    assert gc.memory_overlap_verdict({**run(1.0), "status": "failed"}, run(1.0)).status == "FAIL"


def test_user_command_verdict_falls_back_to_synthetic_only_when_cifar_cannot_be_fetched():
    done = {"status": "completed", "world_size": 8, "steps": 781, "final_loss": 2.5, "samples_per_s": 9000.0}
    assert gc.user_command_verdict(done, "", None).numbers.startswith("CIFAR-10: world 8")
    offline = "python -m minizero.train: error: CIFAR-10 not found in /data: fetching it failed (URLError: ...)"
    r = gc.user_command_verdict(None, offline, done)
    assert r.status == "PASS" and r.numbers.startswith("CIFAR-10 unreachable here, synthetic")
    assert gc.user_command_verdict(None, offline, None).status == "FAIL"
    crash = "Traceback (most recent call last):\n  ...\n[rank0]: RuntimeError: NCCL error"
    r = gc.user_command_verdict(None, crash, done)
    assert r.status == "FAIL" and "NCCL error" in r.reason


def test_a_fallback_runs_only_when_the_command_it_stands_in_for_failed(tmp_path):
    for first_rc, want in ((1, ["first", "fallback"]), (0, ["first"])):
        out = tmp_path / str(first_rc)
        log = lambda name: gc.Proc([gc.PY, "-c", f"import sys; print('{name}'); sys.exit({first_rc if name == 'first' else 0})"],
                                   f"{name}.log", may_fail=name == "first",
                                   fallback_for="first.log" if name == "fallback" else None)
        check = gc.Check("fb", "a fallback", steps=[[log("first")], [log("fallback")]])
        (out / "logs").mkdir(parents=True)
        assert gc.run_check(check, out, out / "logs").status == "PASS"
        assert sorted(p.stem for p in (out / "logs").iterdir()) == sorted(want)


def _rows_of_docs():
    """The check names (patterns: <S> a stage, <dtype> a dtype) of docs/gpu.md's table."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    table = text[text.index("| check | needs | asserts |"):]
    names = []
    for line in table.splitlines()[2:]:
        if not line.startswith("| `"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return [re.compile("^" + re.escape(n).replace("<S>", "[0-3]").replace("<dtype>", "(fp16|bf16|fp32)") + "$")
            for n in names]


def test_docs_gpu_md_lists_every_check():
    rows = _rows_of_docs()
    missing = [c.name for c in gc.plan(8) if not any(r.match(c.name) for r in rows)]
    assert not missing, f"docs/gpu.md's table lacks {missing}"


def _consolidate_on_gloo(folder):
    return gc.consolidate_rank(1, folder)


def test_the_consolidate_driver_runs_on_cpu_ranks(tmp_path):
    from tests.support.launcher import run_ranks
    for r in run_ranks(_consolidate_on_gloo, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=180):
        assert r["master_on_host"] and r["equals_checkpoint"] and r["finite"], r


def test_sigterm_stops_the_running_check_and_skips_the_rest(tmp_path, monkeypatch):
    """`timeout` (the lease's parts) ends gpu_check with SIGTERM: the running command is stopped
    (it would otherwise outlive us in its own session), that check FAILs, the rest SKIP, and
    the report of what finished is written after every check."""
    import signal
    old = signal.getsignal(signal.SIGTERM)
    py = sys.executable
    pidfile = tmp_path / "child.pid"
    term = (f"import os, signal, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
            "os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)")
    checks = [gc.Check("first", "", steps=[[gc.Proc([py, "-c", "pass"], "first.log")]]),
              gc.Check("killed", "", steps=[[gc.Proc([py, "-c", term], "killed.log")]]),
              gc.Check("later", "", steps=[[gc.Proc([py, "-c", "pass"], "later.log")]])]
    written = []
    try:
        gc.stop_on_sigterm()
        rows = gc.run_all(checks, tmp_path, lambda rows: written.append(len(rows)))
    finally:
        signal.signal(signal.SIGTERM, old)
    done = {name: r for name, r, _ in rows}
    assert done["first"].status == "PASS" and done["killed"] == gc.Result("FAIL", "stopped (SIGTERM) while running")
    assert done["later"] == gc.Result("SKIP", "stopped (SIGTERM) before it ran")
    assert written == [1, 2, 3]
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
