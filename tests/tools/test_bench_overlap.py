"""launch/bench_overlap.py, the overlap benchmark: its schedule, its trace arithmetic, bad flags,
and one tiny run (micro model, stage 0, fp32, 1 repetition, 2 timed steps) whose table has one
row per (dtype, knobs, stage) and one cell per column. Timing itself is not tested.

The tiny runs call the script's main(argv) here, their ranks forked from the tests' preloaded
forkserver (tests/support/script_main.py: a fresh interpreter and a forkserver of its own
saved per run); test_the_command_starts_from_any_folder runs the command itself."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.script_main import run_script_main
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "bench_overlap.py"

bench = load_script(SCRIPT)


def test_schedule_interleaves_repetitions_and_alternates_libraries(tmp_path):
    args = bench.parse_args(["--stages", "0,3", "--dtypes", "fp32", "--reps", "2", "--trace-dir", str(tmp_path)])
    bench.check_args(args, cuda=False, gpus=0)
    runs = bench.schedule(args)
    assert len(runs) == 2 * 2 * 2 * 2                                  # reps x stages x knobs x libs
    assert [r["rep"] for r in runs] == [0] * 8 + [1] * 8               # a repetition is whole before the next
    firsts = [runs[i]["lib"] for i in range(0, len(runs), 2)]
    assert firsts[:2] == ["minizero", "deepspeed"] and set(firsts) == {"minizero", "deepspeed"}
    traced = [r for r in runs if "trace_dir" in r]                      # minizero, first repetition only
    assert {r["lib"] for r in traced} == {"minizero"} and {r["rep"] for r in traced} == {0} and len(traced) == 4
    assert all(r["config"]["minizero_trace"]["steps"] == [2] for r in traced)
    zero = {(r["knobs"], r["lib"]): r["config"]["zero_optimization"] for r in runs if r["stage"] == 3}
    assert zero["default", "minizero"] == zero["default", "deepspeed"] == {"stage": 3, **bench.PINNED}
    assert zero["off", "minizero"]["stage3_prefetch_bucket_size"] == 0 and zero["off", "deepspeed"]["overlap_comm"] is False


def test_trace_shares(tmp_path):
    """blocked: a synchronous collective's whole span plus an asynchronous one's wait, as a
    union (a synchronous one inside an asynchronous one's wait counts once); skew: the
    synchronous ones' wait_us."""
    def rank_file(r, step_us, colls):
        events = [{"name": "step 2", "cat": "step", "ph": "X", "ts": 0, "dur": step_us, "args": {}},
                  {"name": "forward", "cat": "step", "ph": "X", "ts": 0, "dur": 10, "args": {}}]
        events += [{"name": "all_reduce", "cat": "collectives", "ph": "X", "ts": ts, "dur": d,
                    "args": {"wait_us": w, **({"async": True} if a else {})}} for ts, d, w, a in colls]
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"traceEvents": events}))
    # rank 0: sync [1, 21) waiting 5, sync [30, 40); blocked 30 of 100, skew 5
    rank_file(0, 100.0, [(1, 20.0, 5.0, False), (30, 10.0, 0.0, False)])
    # rank 1: async issued at 0, in flight to 100, blocked in wait() over [80, 100); a sync one
    # [90, 110) overlaps that wait by 10: blocked = [80, 110) = 30 of 200, skew 4
    rank_file(1, 200.0, [(0, 100.0, 20.0, True), (90, 20.0, 4.0, False)])
    s = bench.trace_shares(str(tmp_path))
    assert s["blocked"] == pytest.approx((0.30 + 0.15) / 2) and s["skew"] == pytest.approx((0.05 + 0.02) / 2)
    assert s["asynchronous"] == pytest.approx(0.5)
    assert bench.trace_shares(str(tmp_path / "none")) is None


@pytest.mark.parametrize("spans, length", [([], 0.0), ([(0, 1)], 1.0), ([(0, 2), (1, 3)], 3.0),
                                           ([(5, 6), (0, 10)], 10.0), ([(0, 1), (2, 3)], 2.0)])
def test_union_length(spans, length):
    assert bench.union_length(spans) == length


def test_floor_counts_the_collectives_the_config_requires():
    """Gradient reductions per 500,000-element bucket (the pinned reduce_bucket_size), padded
    to the ranks; ZeRO-1/2 one all-gather of the parameters; ZeRO-3 each unit gathered twice
    with the knobs off, once with DeepSpeed's reuse distance, persistent parameters once after
    the step; one rank needs none."""
    psi, world = 1_200_001, 2
    units = {"off": [(600_000, 0), (600_002, 0)], "default": [(500_000, 0), (500_000, 0), (0, 200_001)]}
    req = lambda stage, knobs: sorted(map(tuple, bench.required_collectives(stage, knobs, psi, units, world)))
    assert req(0, "off") == [("all_reduce", 200_001, 1), ("all_reduce", 500_000, 2)]
    assert req(2, "default") == [("all_gather", 1_200_002, 1), ("reduce_scatter", 200_002, 1),
                                 ("reduce_scatter", 500_000, 2)]
    assert req(1, "on") == req(2, "off") == req(2, "default")
    assert [c for c in req(3, "off") if c[0] == "all_gather"] == [("all_gather", 600_000, 2), ("all_gather", 600_002, 2)]
    assert [c for c in req(3, "default") if c[0] == "all_gather"] == [("all_gather", 200_002, 1),
                                                                      ("all_gather", 500_000, 2)]
    assert bench.required_collectives(3, "off", psi, units, 1) == []
    parts = {"fwd_bwd": 0.5, "opt": 0.1, "required": {"off": [["all_reduce", 10, 3], ["all_gather", 4, 2]], "on": []},
             "coll_s": {"all_reduce:10": 0.01, "all_gather:4": 0.02}}
    fl = bench.floor_ms(parts, "off")
    assert fl == pytest.approx({"fwd_bwd": 500, "optimizer": 100, "comm": 70, "floor": 670, "collectives": 5})
    assert bench.floor_ms(parts, "on")["comm"] == 0


def test_units_are_the_blocks_and_the_root_with_small_parameters_persistent():
    from minizero.gpt.model import GPT, get_preset
    model = GPT(get_preset("micro"))
    units = bench.unit_numels(model, 2, 0)
    assert len(units) == len(model.blocks) + 1 and all(p == 0 for _, p in units)
    assert sum(g for g, _ in units) >= sum(p.numel() for p in model.parameters())
    kept = bench.unit_numels(model, 2, 10 ** 9)
    assert all(g == 0 for g, _ in kept) and sum(p for _, p in kept) == sum(p.numel() for p in model.parameters())


def test_torch_runs_stages_0_2_3_in_one_knob_row_and_never_fp16():
    args = bench.parse_args(["--libs", "minizero,deepspeed,torch", "--dtypes", "bf16,fp16", "--knobs", "off,on",
                             "--no-trace"])
    bench.check_args(args, cuda=False, gpus=0)
    runs = bench.schedule(args)
    torch_cells = {(r["stage"], r["dtype"], r["knobs"]) for r in runs if r["lib"] == "torch"}
    assert torch_cells == {(0, "bf16", "off"), (2, "bf16", "off"), (3, "bf16", "off")}
    firsts = [r["lib"] for r in runs[::1] if r["rep"] == 0][:1]
    assert firsts == ["minizero"] and len({r["lib"] for r in runs}) == 3
    assert bench.main(["--step5", "--libs", "torch"]) == 2


def test_step5_is_zero3_with_both_offloads_on_the_24_layer_model():
    args = bench.parse_args(["--step5", "--no-trace"])
    bench.check_args(args, cuda=False, gpus=0)
    assert (args.stages, args.knobs, args.model) == ([3], ["default"], "tutorial-24")
    zero = bench.schedule(args)[0]["config"]["zero_optimization"]
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu"} and zero["stage"] == 3
    plain = bench.parse_args(["--no-trace"])
    bench.check_args(plain, cuda=False, gpus=0)
    assert (plain.stages, plain.model) == ([0, 1, 2, 3], "tutorial")
    assert "offload_param" not in bench.schedule(plain)[0]["config"]["zero_optimization"]


def test_knobs_on_turn_overlap_on_at_every_stage():
    assert bench.zero_section(1, "on") == {"stage": 1, **bench.PINNED, "overlap_comm": True}
    assert "overlap_comm" not in bench.zero_section(1, "default")


@pytest.mark.parametrize("argv, says", [
    (["--libs", "minizero,torchzero"], "--libs"),
    (["--stages", "5"], "--stages"),
    (["--dtypes", "fp8"], "--dtypes"),
    (["--knobs", "of"], "--knobs"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--warmup", "2"], "--warmup 2"),
    (["--model", "huge"], "unknown model preset"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_give_one_line(argv, says, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_overlap: error:") and says in err[0], err


def test_the_command_starts_from_any_folder(tmp_path):
    """`python3 launch/bench_overlap.py` from another folder finds minizero and launch/kit.py
    (its sys.path lines) and gives its one line on a bad flag, before torch is imported."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--reps", "0"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("bench_overlap: error: --reps must be >= 1"), err


def test_tiny_run_prints_the_table(tmp_path, monkeypatch):
    js = tmp_path / "bench.json"
    argv = ["--libs", "minizero,deepspeed,torch", "--model", "micro", "--seq", "16", "--n-embd", "21",
           "--micro-batch", "2", "--stages", "0", "--dtypes", "fp32", "--reps", "1", "--steps", "2", "--json", str(js),
           "--trace-dir", str(tmp_path / "traces")]
    monkeypatch.chdir(tmp_path)
    r = run_script_main(SCRIPT, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    tables = [t.splitlines() for t in r.stdout.split("\n\n") if t.startswith("|")]
    assert len(tables) == 3, r.stdout      # against the floor, samples/s, where the step goes
    floor_table, tables = tables[0], tables[1:]
    fhead = [c.strip() for c in floor_table[0].strip("|").split("|")]
    assert fhead[:3] == ["dtype", "knobs", "stage"] and "minizero step / floor" in fhead \
        and "deepspeed step / floor" in fhead and "minizero speed / DeepSpeed's" in fhead \
        and "torch step / floor" in fhead and "minizero speed / PyTorch's" in fhead
    frows = [[c.strip() for c in x.strip("|").split("|")] for x in floor_table[2:]]
    assert [row[:3] for row in frows] == [["fp32", "default", "0"], ["fp32", "off", "0"]]
    torch_cols = {i for i, h in enumerate(fhead) if h.startswith("torch") or h.endswith("PyTorch's")}
    for row in frows:
        assert len(row) == len(fhead) and "-" not in [c for i, c in enumerate(row) if i not in torch_cols], row
        assert len(row[3].replace("=", "/").split("/")) == 4          # fwd+bwd / optimizer / comm = floor
        assert row[4] == "1"     # Ψ under 500,000: one all-reduce bucket, whatever the knobs
    assert all(c != "-" for i, c in enumerate(frows[0]) if i in torch_cols)      # DDP in the default row
    assert all(c == "-" for i, c in enumerate(frows[1]) if i in torch_cols)      # and only there
    floors = json.loads(js.read_text())["floors"]
    parts = floors[0]["parts"]
    assert len(floors) == 1 and parts["fwd_bwd"] > 0 and parts["opt"] > 0
    assert parts["required"]["default"] == parts["required"]["off"] and len(parts["coll_s"]) >= 1
    assert all(v > 0 for v in parts["coll_s"].values())
    for row in json.loads(js.read_text())["floor_rows"]:
        assert row["minizero_over_floor"] > 0 and row["deepspeed_over_floor"] > 0
    lines = tables[0]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["dtype", "knobs", "stage"] and "minizero / DeepSpeed" in head
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in lines[2:]]
    assert [row[:3] for row in rows] == [["fp32", "default", "0"], ["fp32", "off", "0"]]
    torch_cols = {i for i, h in enumerate(head) if h.startswith("torch")}
    for row in rows:
        assert len(row) == len(head) and "-" not in [c for i, c in enumerate(row) if i not in torch_cols], row
        assert row[head.index("minizero / its stage 0")] == "1.00"
    assert "-" not in [rows[0][i] for i in torch_cols]
    runs = json.loads(js.read_text())["runs"]
    assert len(runs) == 5 and all(x["samples_per_s"] > 0 for x in runs)       # torch: the default row only
    traced = [x for x in runs if x.get("trace")]
    assert len(traced) == 2 and all(0 < x["trace"]["blocked"] <= 1 and 0 <= x["trace"]["skew"] <= x["trace"]["blocked"]
                                    for x in traced)
    assert all(set(x["phases_ms"]) == {"forward", "backward", "step"} and min(x["phases_ms"].values()) > 0
               and sum(x["phases_ms"].values()) <= x["ms"] * 1.5 for x in runs)
    phase_head = [c.strip() for c in tables[1][0].strip("|").split("|")]
    assert phase_head == ["dtype", "knobs", "stage", "minizero forward / backward / step, ms",
                          "deepspeed forward / backward / step, ms", "torch forward / backward / step, ms"]
    assert len(tables[1]) == 2 + len(rows) and "-" not in tables[1][2].split("|")


def test_one_rank_minizero_only(tmp_path, monkeypatch):
    """--world-size 1 --libs minizero, what a one-GPU lease runs: the floor's one rank needs its own
    process group (it failed "Default process group has not been initialized" before), and the
    table is the minizero half alone. With --no-trace it makes no trace folder (each run of the
    suite left an empty bench_overlap_trace_* in the temporary folder before)."""
    js = tmp_path / "bench.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))      # where mkdtemp would put one
    argv = ["--libs", "minizero", "--world-size", "1", "--model", "micro", "--seq", "16",
           "--n-embd", "21", "--micro-batch", "2", "--stages", "0,3", "--dtypes", "fp32", "--knobs", "off",
           "--reps", "1", "--steps", "2", "--no-trace", "--json", str(js)]
    monkeypatch.chdir(tmp_path)
    r = run_script_main(SCRIPT, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(js.read_text())["floor_rows"]
    assert [(x["stage"], x["knobs"]) for x in rows] == [(0, "off"), (3, "off")]
    assert all(x["minizero_over_floor"] > 0 and x.get("deepspeed_over_floor") is None for x in rows), rows
    floors = json.loads(js.read_text())["floors"]
    assert all(f["parts"]["fwd_bwd"] > 0 and f["parts"]["world_size"] == 1 for f in floors), floors
    assert list(scratch.iterdir()) == [] and "traces in" not in r.stderr


def test_on_a_gpu_the_floor_table_adds_tokens_per_s_and_peak_cuda_memory(tmp_path):
    """A GPU run's table (args.cuda): per library tokens/s from the median step (every rank's
    micro-batches of --seq tokens) and the peak CUDA memory (the largest rank's); a CPU run's
    table has neither column. Rows built by hand: nothing here needs a GPU."""
    args = bench.parse_args(["--stages", "0", "--dtypes", "bf16", "--knobs", "default", "--reps", "2",
                             "--world-size", "1", "--seq", "1023", "--micro-batch", "16", "--trace-dir", str(tmp_path)])
    bench.check_args(args, cuda=True, gpus=1)
    run = {"stage": 0, "dtype": "bf16", "knobs": "default"}
    results = [{**run, "lib": "minizero", "rep": 0, "ms": 20.0, "peak_cuda_bytes": 3 << 30},
               {**run, "lib": "minizero", "rep": 1, "ms": 30.0, "peak_cuda_bytes": 2 << 30},
               {**run, "lib": "deepspeed", "rep": 0, "ms": 40.0, "peak_cuda_bytes": 1 << 30},
               {**run, "lib": "deepspeed", "rep": 1, "ms": 40.0, "peak_cuda_bytes": 1 << 30}]
    parts = {"psi": 10, "world_size": 1, "fwd_bwd": 0.010, "opt": 0.0005, "required": {"default": []}, "coll_s": {}}
    floors = [{"rep": r, "dtype": "bf16", "stage": 0, "parts": parts} for r in (0, 1)]
    rows = bench.floor_rows(results, floors, args)
    assert rows[0]["minizero_tokens_per_s"] == pytest.approx(16 * 1023 / 0.025)   # the median step, 25 ms
    assert rows[0]["minizero_peak_cuda_mib"] == 3 * 1024 and rows[0]["deepspeed_peak_cuda_mib"] == 1024
    lines = bench.floor_table(rows, args).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert cells["minizero tokens/s"] == "654,720" and cells["deepspeed tokens/s"] == "409,200"
    assert cells["minizero peak CUDA MiB"] == "3,072" and cells["minizero step / floor"] == "2.38"
    args.cuda = False
    assert "tokens/s" not in bench.floor_table(rows, args)
