"""python -m minizero.compare end to end: minizero and DeepSpeed on the same tiny run,
stages 0 and 3, fp32, 2 ranks, STEPS steps (4 launches); and stage 3 with both ZeRO-Offloads
(2 launches), whose report shows device and host bytes. No run draws a sample grid
(compare's default; offload_report says where sampling under ZeRO-3 is held). Both runs have the
comms logger on (compare's default on a CPU), so they also check the memory moments section
(both libraries at the end of the last step's backward and after it, every byte of
difference named) and the side-by-side comms summaries (every differing row explained).

The config is train.py's default with gradient_clipping 0 (off). minizero and DeepSpeed
differ in one piece of arithmetic, the gradient norm, which reaches the weights only
through clipping (tests/agreement/test_agreement_loss.py: test_clipping_active_*); with it off both
libraries run the same ops in the same order, so the losses must agree BITWISE, on any CPU.
(With clipping on, as by default, this run measured 1-2 fp32 ulps of the loss.)

Both reports run compare's main(argv) in this process, its torchrun launches on ranks forked
from the tests' preloaded forkserver (tests/support/command_runs.py: three fresh interpreters'
imports saved per launch). test_the_command_launches_torchrun runs `python -m minizero.compare`
as a user types it, torchrun and all (its environment, its flags, its log), on the smallest
run that shows it: minizero alone, one step of the micro model.

What these runs check is compare's: its launches, its report, its tables and pictures, and
that every number in them is the runs' own. 3 steps show all of it: the steady state the
report describes (the memory moments of the last step, the comms logger's per-step counts,
samples/s after the first logged interval) is the second step's and every later one's, each
step the same operations on updated state. That the two libraries' fp32 losses are equal
bit for bit over the agreement runs' 10 steps at every stage is tests/agreement/test_agreement_loss.py's
(test_fp32_loss_and_weights_bitwise); here it is the report's column that is checked."""
import contextlib
import copy
import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N = 2
STEPS = 3   # the module docstring says why 3 show what 10 did


def compare(*args, timeout=300):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "minizero.compare", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(md: str) -> dict:
    """{stage: {column title: cell}} from report.md's first markdown table (the per-stage one)."""
    lines = list(itertools.takewhile(lambda line: line.startswith("|"),
                                     itertools.dropwhile(lambda line: not line.startswith("|"), md.splitlines())))
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {int(r["stage"]): r for r in rows}


def compare_forked(*args):
    """compare(*args), as compare's main(argv) in this process with its torchrun launches
    on forked ranks (tests/support/command_runs.py)."""
    from minizero.compare import compare as tool
    from tests.support.command_runs import torchrun_on_forked_ranks
    out, err, rc = io.StringIO(), io.StringIO(), 0
    with torchrun_on_forked_ranks(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            tool.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["python", "-m", "minizero.compare", *args], rc, out.getvalue(), err.getvalue())


def run_compare(out, stages, zero=(), forked=False):
    """compare on the tiny run, fp32, train.py's default config with clipping off and `zero`
    added to zero_optimization (forked: through compare_forked)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    from minizero.train.train_args import DEFAULT_CONFIG

    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["gradient_clipping"] = 0.0
    cfg["zero_optimization"].update(zero)
    (out / "noclip.json").write_text(json.dumps(cfg))
    r = (compare_forked if forked else compare)("--stages", *map(str, stages), "--dtype", "fp32", "--nproc", str(N), "--model", "tiny",
                "--dataset", "synthetic", "--image-size", "8", "--max-steps", str(STEPS), "--out", str(out),
                # passed through to both training scripts:
                "--synthetic-train", "256", "--synthetic-test", "32",
                "--data-dir", str(out / "data"), "--config", str(out / "noclip.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_compare(tmp_path_factory.mktemp("compare"), (0, 3), forked=True)


@pytest.fixture(scope="module")
def offload_report(tmp_path_factory):
    # No sample grid (compare's default): 63 sequential forwards per library and rank through
    # ZeRO-3's gathers from the host, 10 s of this file's CPU, for a picture nothing compares.
    # The forwards without backward that sampling makes are the test loss's too, which both
    # runs compute at their end (test_offload_report_shows_device_and_host checks it);
    # minizero's grid under ZeRO-3 is tests/tools/test_train.py's (test_torchrun_two_ranks[3]).
    return run_compare(tmp_path_factory.mktemp("compare-offload"), (3,),
                       {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, forked=True)


def test_report_files(report):
    out, stdout = report
    from PIL import Image
    for name in ("loss_curves.png", "memory.png"):
        with Image.open(out / name) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
    md = (out / "report.md").read_text()
    assert "python -m minizero.compare --stages 0 3" in md
    assert "torch 2." in md and "deepspeed 0." in md and "machine:" in md and "date:" in md
    assert "docs/agreement.md" in md and "all-reduce" in md
    assert set(table_rows(md)) == {0, 3}
    assert "| stage |" in stdout   # the table is printed too
    # no offload: no device / host columns, and no offload note
    assert not any("host B" in c or "device B" in c for c in table_rows(md)[0]) and "Offload" not in md
    for lib in ("minizero", "deepspeed"):
        for stage in (0, 3):
            assert (out / f"{lib}-stage{stage}" / "run.log").is_file()
            assert (out / f"{lib}-stage{stage}" / "summary.json").is_file()
            for name in ("comms_summary.json", "comms_summary.txt"):
                assert (out / f"{lib}-stage{stage}" / name).is_file()
    # both moments, both comms tables, and nothing left unexplained in either
    assert f"## Model states at the same moments (rank 0, step {STEPS})" in md
    assert "## Collectives: DeepSpeed's comms summary beside minizero's" in md
    assert "### ZeRO-0" in md and "### ZeRO-3" in md and "unexplained" not in md
    assert json.loads((out / "config.json").read_text())["comms_logger"] == {"enabled": True}


def test_losses_agree_fp32(report):
    out, _ = report
    rows = table_rows((out / "report.md").read_text())
    results = json.loads((out / "results.json").read_text())
    for stage in (0, 3):
        d = float(rows[stage]["max abs dloss/step"])
        assert d == 0.0, f"stage {stage}: minizero and DeepSpeed losses differ by {d} (fp32)"
        s = results["summaries"][str(stage)]
        assert len(s["minizero"]["losses"]) == len(s["deepspeed"]["losses"]) == STEPS
        assert s["minizero"]["losses"] == s["deepspeed"]["losses"]
        assert s["minizero"]["library"] == "minizero" and s["deepspeed"]["library"] == "deepspeed"
    assert [r["stage"] for r in results["rows"]] == [0, 3]
    assert all(r["max_abs_dloss"] == 0.0 for r in results["rows"])


def test_memory_columns(report):
    out, _ = report
    from minizero.gpt.model import GPT, get_preset

    results = json.loads((out / "results.json").read_text())
    rows = {r["stage"]: r for r in results["rows"]}
    # Padding bound: DeepSpeed's ZeRO-3 pads each parameter tensor to ceil(n/N) per rank,
    # minizero each (unit, group) FlatParam (each holds >= 1 tensor) to a multiple of N:
    # at most N - 1 elements per tensor in all, i.e. (N - 1) / N per rank.
    model = GPT(get_preset("tiny"))
    n_tensors, params = len(list(model.parameters())), model.num_params()      # 37, 108,801
    pad = n_tensors * (N - 1) / N
    for lib in ("minizero", "deepspeed"):
        # ZeRO-3 partitions the Adam states (8 bytes per element, fp32) over the N ranks
        opt = [results["summaries"][s][lib]["model_state_bytes"][0]["optimizer_states"] for s in ("0", "3")]
        assert opt[0] / N <= opt[1] <= opt[0] / N + 8 * pad, (lib, opt)
        assert rows[3][lib]["wire_bytes_per_step"] > 0 and rows[0][lib]["samples_per_s"] > 0
    # minizero's ZeRO-3 holds 16 bytes per parameter / N plus padding (fp32, Adam), less than
    # stage 0. (DeepSpeed's number is not compared: it keeps a duplicate fp32 master, and
    # its summary may count parameters left gathered by the end-of-run sampling.)
    assert rows[3]["minizero"]["state_bytes_max"] <= 16 * params / N + 16 * pad
    assert rows[3]["minizero"]["state_bytes_max"] < rows[0]["minizero"]["state_bytes_max"]


def test_memory_at_the_same_moments(report):
    """Both libraries read at the end of the last step's backward and after it. fp32 stage 0:
    the same bytes in every category at both moments. fp32 ZeRO-3: padding, DeepSpeed's
    second fp32 master (4S) and, after the step, its kept gradient partition (4S fp32), each
    named in the report to the byte; minizero holds no gradient after the step."""
    from minizero.compare import compare_memory
    from minizero.gpt.model import GPT, get_preset

    out, _ = report
    results = json.loads((out / "results.json").read_text())
    runs = {int(k): v for k, v in results["summaries"].items()}
    model = GPT(get_preset("tiny"))
    S = sum(-(-p.numel() // N) for p in model.parameters())   # DeepSpeed's ZeRO-3 partition: ceil(n/N) each
    cats = compare_memory.CATEGORIES
    for stage in (0, 3):
        for moment in compare_memory.MOMENTS:
            mz, ds = (runs[stage][lib]["memory_moments"] for lib in compare_memory.LIBS)
            assert mz["step"] == ds["step"] == STEPS and len(mz[moment]) == len(ds[moment]) == N
            for r in range(N):
                a, b = mz[moment][r], ds[moment][r]
                if stage == 0:
                    assert {c: a[c] for c in cats} == {c: b[c] for c in cats}
                for c in cats:
                    parts = compare_memory.memory_differences(stage, "fp32", moment, c, None, a, b)
                    assert sum(n for n, _ in parts) == b[c] - a[c] and all(w != "unexplained" for _, w in parts)
            if stage == 3:
                a, b = mz[moment][0], ds[moment][0]
                assert a["master_params"] == 0 and b["master_params"] == 4 * S
                assert (a["grads"], b["grads"]) == ((0, 4 * S) if moment == "after_step" else (4 * a["elements"]["shard"],
                                                                                              4 * S))
    md = (out / "report.md").read_text()
    kept = [line for line in md.splitlines() if line.startswith("| 3 | after the step | grads |")]
    assert len(kept) == 1 and f"+{4 * S:,} B ZeRO-3 keeps its gradient partition" in kept[0]
    assert "fp32 ZeRO keeps a second fp32 master copy" in md
    # the table's state columns are the end of backward, the same moment for both libraries
    rows = table_rows(md)
    for lib, col in (("minizero", "mz"), ("deepspeed", "DS")):
        entry = runs[3][lib]["memory_moments"]["after_backward"][0]
        assert rows[3][f"state B r0 {col}"] == f"{sum(entry[c] for c in cats):,}"


def test_comms_summaries_side_by_side(report):
    """Both libraries' comms logger tables, rank 0, per stage. The message sizes follow
    DeepSpeed's definitions in both: minizero's reduce_scatter rows carry the whole input,
    so their bytes per step are the ledger's wire bytes x N/(N-1); DeepSpeed's ZeRO-3
    reduce-scatters one bucket (the whole model here: reduce_bucket_size 5e5 > Ψ) of its
    per-parameter padded partitions, N x S fp32 elements, once per step."""
    from minizero.compare import compare_comms
    from minizero.gpt.model import GPT, get_preset

    out, _ = report
    results = json.loads((out / "results.json").read_text())
    runs = {int(k): v for k, v in results["summaries"].items()}
    model = GPT(get_preset("tiny"))
    S = sum(-(-p.numel() // N) for p in model.parameters())
    steps = STEPS
    mz, ds = runs[3]["minizero"]["comms_summary"], runs[3]["deepspeed"]["comms_summary"]
    assert ds["reduce_scatter_tensor"] == {str(N * S * 4): ds["reduce_scatter_tensor"][str(N * S * 4)]}
    assert ds["reduce_scatter_tensor"][str(N * S * 4)]["count"] == steps
    rs_bytes = sum(int(size) * r["count"] for size, r in mz["reduce_scatter_tensor"].items())
    wire = runs[3]["minizero"]["comm_wire_bytes_per_step"]["reduce_scatter"]
    assert rs_bytes == steps * wire * N / (N - 1)
    # DeepSpeed's logger times barriers too, log_summary's own among them (once, at the end)
    assert ds["log_summary_barrier"]["0"]["count"] == 1 and "barrier" in ds and "barrier" not in mz
    # stage 0: DeepSpeed all-reduces one bucket of all gradients (4 Ψ bytes) per step
    psi = model.num_params()
    assert runs[0]["deepspeed"]["comms_summary"]["all_reduce"][str(4 * psi)]["count"] == steps
    md = (out / "report.md").read_text()
    section = md[md.index("### ZeRO-3"):]
    assert "| reduce_scatter_tensor | " in section and "comms_logger counts reduce_scatter's input N times" in section
    for stage in (0, 3):
        for op, size, a, b in compare_comms.comms_rows(runs[stage]["minizero"]["comms_summary"],
                                                 runs[stage]["deepspeed"]["comms_summary"]):
            why = compare_comms.comms_reason(stage, op, size, a, b)
            assert why != "unexplained", (stage, op, size)
            assert (why is None) == (a is not None and b is not None and a["count"] == b["count"])


def comms_record(size, count, latency=1.0):
    return {"count": count, "total_latency_ms": latency * count, "avg_latency_ms": latency, "tput_avg_gbps": 1.0,
            "busbw_avg_gbps": 0.5, "msg_size_bytes": size, "msg_size_str": f"{size} B"}


def test_comms_table_explains_zero12_all_reduce_from_a_hand_written_summary():
    """ZeRO-1 (not in the end-to-end run): DeepSpeed all-reduces the gradient bucket where
    minizero reduce-scatters it; equal rows say so; scalars are named by size."""
    from minizero.compare import compare_comms
    mz = {"reduce_scatter_tensor": {"396648": comms_record(396648, 3)},
          "all_gather_into_tensor": {"198324": comms_record(198324, 3)},
          "all_reduce": {"8": comms_record(8, 3)}}
    ds = {"all_reduce": {"435216": comms_record(435216, 3), "4": comms_record(4, 6)},
          "all_gather_into_tensor": {"198324": comms_record(198324, 3)},
          "barrier": {"0": comms_record(0, 2)}}
    md = compare_comms.comms_table(1, mz, ds)
    rows = {(c[0], c[1]): c for c in ([x.strip() for x in line.strip("|").split("|")]
                                      for line in md.splitlines()[2:])}
    assert rows[("all_gather_into_tensor", "193.68 KB")][-1] == "same op, size and count"
    assert '"ZeRO-1/2 reduce-scatter is an all-reduce"' in rows[("all_reduce", "425.02 KB")][-1]
    assert rows[("all_reduce", "425.02 KB")][2:4] == ["-", "3"]
    rs = rows[("reduce_scatter_tensor", "387.35 KB")][-1]
    assert "ZeRO-1/2 reduce-scatter is an all-reduce" in rs and "counts reduce_scatter's input N times" in rs
    assert "fp32 gradient norm" in rows[("all_reduce", "4.0 B")][-1]
    assert "fp64 squared gradient norm" in rows[("all_reduce", "8.0 B")][-1]
    assert "barriers" in rows[("barrier", "0B")][-1]
    assert "unexplained" not in md


def test_comms_logger_switch_in_the_shared_config():
    """On: the section with enabled true goes to both libraries. Off: no section at all
    (DeepSpeed logs whenever the section is present, even with "enabled": false)."""
    from minizero.compare import compare
    args, _ = compare.parse_args(["--stages", "0"])
    args.comms_logger = True
    assert compare.base_config(args)["comms_logger"] == {"enabled": True}
    args.comms_logger = False
    assert "comms_logger" not in compare.base_config(args)


def test_own_knobs_leaves_the_when_knobs_to_the_config():
    """By default compare pins ZeRO-3's prefetch / reuse / live knobs to 0 (the paper's
    algorithm in both libraries); --own-knobs leaves them to the config (DeepSpeed's defaults),
    and a config's own value is kept either way."""
    from minizero.compare import compare
    args, _ = compare.parse_args(["--stages", "3"])
    zero = compare.base_config(args)["zero_optimization"]
    assert all(zero[k] == 0 for k in compare.WHEN_KNOBS)
    args, _ = compare.parse_args(["--stages", "3", "--own-knobs"])
    zero = compare.base_config(args)["zero_optimization"]
    assert not any(k in zero for k in compare.WHEN_KNOBS)
    assert zero["memory_efficient_linear"] is False and zero["stage3_param_persistence_threshold"] == 0


def fake_summary(lib, loss, entry):
    return {"library": lib, "losses": [loss], "final_loss": loss, "test_loss": loss, "model_state_bytes": [entry],
            "peak_mem_mb": [100.0], "samples_per_s": 10.0, "comm_wire_bytes_per_step": {"total": 0},
            "skipped_steps": 0}


def placed_entry(device, host):
    return {**{c: device.get(c, 0) + host.get(c, 0) for c in ("params", "grads", "master_params",
                                                              "optimizer_states")},
            "device": device, "host": host}


def test_table_and_picture_show_host_bytes_when_a_run_offloads(tmp_path):
    """Without host bytes the table has its usual columns; with them, device B r0 and host B
    r0 for both libraries; the memory picture gets a host panel (twice as wide)."""
    from PIL import Image

    from minizero.compare import compare
    zero = dict.fromkeys(("params", "grads", "master_params", "optimizer_states"), 0)
    on_device = placed_entry({**zero, "params": 1000, "grads": 1000, "master_params": 2000,
                              "optimizer_states": 4000}, zero)
    offloaded = placed_entry({**zero, "params": 1000, "grads": 1000},
                             {**zero, "master_params": 2000, "optimizer_states": 4000})
    old = {"grads": 1000, "params": 1000, "master_params": 2000, "optimizer_states": 4000}   # no split
    plain = {2: {"minizero": fake_summary("minizero", 1.0, on_device),
                 "deepspeed": fake_summary("deepspeed", 1.0, old)}}
    moved = {2: {"minizero": fake_summary("minizero", 1.0, offloaded),
                 "deepspeed": fake_summary("deepspeed", 1.0, placed_entry(zero, {**zero, "params": 1000,
                                                                                  "grads": 3000,
                                                                                  "master_params": 2000,
                                                                                  "optimizer_states": 4000}))}}
    widths = {}
    for name, results in (("plain", plain), ("moved", moved)):
        rows = [compare.stage_row(s, r["minizero"], r["deepspeed"]) for s, r in results.items()]
        row = table_rows(compare.table(rows))[2]
        if name == "plain":
            assert not compare.offloaded(results)
            assert list(row) == ["stage", "max abs dloss/step", "final loss mz", "final loss DS", "state B r0 mz",
                                 "state B r0 DS", "state B max mz", "state B max DS", "peak MB mz", "peak MB DS",
                                 "samples/s mz", "samples/s DS", "mz/DS speed", "wire B/step mz", "wire B/step DS"]
            assert row["state B r0 mz"] == row["state B r0 DS"] == "8,000"
        else:
            assert compare.offloaded(results)
            assert list(row)[4:10] == ["state B r0 mz", "state B r0 DS", "device B r0 mz", "device B r0 DS",
                                       "host B r0 mz", "host B r0 DS"]
            assert list(row)[-3:] == ["mz/DS speed", "wire B/step mz", "wire B/step DS"]
            assert (row["device B r0 mz"], row["host B r0 mz"], row["state B r0 mz"]) == ("2,000", "6,000", "8,000")
            assert (row["device B r0 DS"], row["host B r0 DS"], row["state B r0 DS"]) == ("0", "10,000", "10,000")
        compare.plot_memory(tmp_path / f"{name}.png", results)
        with Image.open(tmp_path / f"{name}.png") as im:
            widths[name] = im.size[0]
    assert widths["moved"] == 2 * widths["plain"]


def test_offload_report_shows_device_and_host(offload_report):
    """Stage 3 with offload_optimizer and offload_param, fp32: both summaries carry the
    split; DeepSpeed keeps no model state on the device (its gradient buffers sit at
    self.device, the host), minizero keeps its reduced gradient shard there until the step
    (docs/deepspeed.md, "ZeRO-Offload's extra host buffers"); the losses still agree bitwise,
    the test loss too."""
    out, _ = offload_report
    md = (out / "report.md").read_text()
    row = table_rows(md)[3]
    results = json.loads((out / "results.json").read_text())
    # the table reads both libraries at the end of the last step's backward
    mz, ds = (results["summaries"]["3"][lib]["memory_moments"]["after_backward"][0]
              for lib in ("minizero", "deepspeed"))
    cats = ("params", "grads", "master_params", "optimizer_states")
    for lib, e in (("mz", mz), ("DS", ds)):
        assert row[f"device B r0 {lib}"] == f"{sum(e['device'][c] for c in cats):,}"
        assert row[f"host B r0 {lib}"] == f"{sum(e['host'][c] for c in cats):,}"
        assert all(e[c] == e["device"][c] + e["host"][c] for c in cats)
    assert ds["device"] == dict.fromkeys(cats, 0)
    assert mz["device"] == {**dict.fromkeys(cats, 0), "grads": mz["grads"]} and mz["host"]["grads"] == 0
    # DeepSpeed's host also holds an fp32 gradient partition (4S) and its lp one (4S in fp32)
    assert ds["host"]["grads"] == ds["details_by_place"]["host"]["grads:grad_partitions_flat_buffer"] \
        + ds["details_by_place"]["host"]["grads:fp32_partitioned_groups_flat[i].grad"] > 0
    assert "Offload (host B > 0)" in md and "ZeRO-Offload's extra host buffers" in md
    assert "unexplained" not in md and "| 3 | end of backward | grads | device |" in md
    assert float(row["max abs dloss/step"]) == 0.0
    # the test loss: forwards without backward, in eval mode, through the gathers from the
    # host, on every rank of both libraries; the same operations, so the same number
    test = [results["summaries"]["3"][lib]["test_loss"] for lib in ("minizero", "deepspeed")]
    assert test[0] == test[1] and 0 < test[0] < 10, test
    from PIL import Image
    with Image.open(out / "memory.png") as im:
        assert im.size[0] >= 2 * 500   # two panels (device, host), each at least 5 inches at 100 dpi


def test_the_command_launches_torchrun(tmp_path):
    """`python -m minizero.compare` starts each run through a real `python -m
    torch.distributed.run` (the tests above fork their ranks instead): the launcher takes
    compare's flags and environment, the ranks' output goes to run.log, and the summary they
    write makes the report. One rank (--nproc 1): what is checked here is compare's plumbing
    around torchrun, which one rank shows whole (compare's default of 2 reaching torchrun is
    test_the_default_is_two_ranks_under_torchrun's).
    compare itself runs as `python -m` runs it (`__main__`, its sys.argv), on a process
    forked from the tests' preloaded forkserver (tests/support/python_m.py); the torchrun it
    starts is a fresh interpreter, as a user's is. That torchrun's rank is forked
    (python_m.forked_interpreters, reached through torchrun's own PYTHON_EXEC, the
    executable it starts workers with): the rank is minizero.train's main as `python -u -m`
    runs it, with torchrun's environment and fds, minus a fresh interpreter's 3-4 s of CPU
    importing torch. Fresh ranks stay tested elsewhere: minizero.train's under a real torchrun
    in tests/tools/test_run_folder.py (test_torchrun_reports_the_one_line_as_root_cause),
    those of two torchruns joined by c10d in test_preflight.py's clean run. A fresh `python
    -m minizero.compare` is test_bad_input_from_the_command_itself's."""
    pytest.importorskip("matplotlib")
    from tests.support import python_m
    from tests.support.command_runs import run_command
    out = tmp_path / "out"
    argv = ["--libs", "minizero", "--stages", "0", "--nproc", "1", "--dtype", "fp32", "--model", "micro",
            "--dataset", "synthetic", "--image-size", "8", "--max-steps", "1", "--out", str(out),
            "--synthetic-train", "64", "--synthetic-test", "16", "--data-dir", str(tmp_path / "data")]
    # (compare asks for no sample grid)
    with python_m.forked_interpreters() as forked:
        # the server, and the shim as torchrun's worker executable only (not compare's
        # sys.executable: the torchrun compare starts stays a fresh interpreter)
        rank_env = {python_m.INDEX_ENV: "0", "DS_ACCELERATOR": "cpu", python_m.SERVER_ENV: forked[python_m.SERVER_ENV],
                    "PYTHON_EXEC": forked[python_m.SHIM_ENV]}
        r = run_command("tests.support.python_m", [json.dumps([["minizero.compare", *argv]])], 1, launcher=False,
                        rank_env=[rank_env], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "minizero-stage0" / "run.log").read_text().splitlines()
    assert log[0].startswith(f"$ {sys.executable} -m torch.distributed.run ") and "--nproc-per-node 1" in log[0]
    assert any(line.startswith("minizero: world size 1 on cpu") for line in log), log[:5]
    summary = json.loads((out / "minizero-stage0" / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["steps"]) == ("completed", 1, 1)
    md = (out / "report.md").read_text()
    assert set(table_rows(md)) == {0} and table_rows(md)[0]["final loss mz"] == f"{summary['final_loss']:.6f}"


def test_the_default_is_two_ranks_under_torchrun():
    """Without --nproc, each run is `torchrun --nproc-per-node 2`, for every library."""
    from minizero.compare import compare
    args, extra = compare.parse_args(["--stages", "3"])
    for lib in compare.LIBS:
        cmd = compare.run_command(lib, 3, args, extra, "config.json", "out")
        assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("--nproc-per-node") + 1] == "2", cmd


@pytest.mark.parametrize("args, needle", [
    (["--stages", "7"], "unknown stage 7"),
    (["--stages", "0", "--nproc", "0"], "--nproc must be >= 1"),
    (["--stages", "0", "--dtype", "fp8"], "unknown --dtype"),
    (["--stages", "0", "--libs", "minizero", "jax"], "unknown library jax"),
    (["--stages", "1", "--libs", "minizero", "torch"], "torch has no ZeRO-1"),
    (["--stages", "0", "--dtype", "fp16", "--libs", "minizero", "torch"], "torch runs fp32 and bf16"),
    (["--stages", "3", "--nproc", "4", "--hsdp", "2", "--libs", "deepspeed", "torch"], "DeepSpeed 0.19.8 has no HSDP"),
    (["--stages", "2", "--nproc", "4", "--hpz", "2", "--libs", "deepspeed"], "--hpz applies to stage 3"),
    (["--stages", "3", "--nproc", "4", "--hpz", "3", "--libs", "deepspeed"], "a divisor of --nproc 4"),
    (["--stages", "2", "--nproc", "4", "--hsdp", "2", "--libs", "minizero", "torch"], "minizero's hsdp_shard_size "
                                                                                    "applies to stage 3"),
])
def test_bad_input_is_one_line(args, needle, tmp_path):
    """compare's main(argv) on a process forked from the tests' preloaded forkserver, its file
    descriptors 1 and 2 caught (tests/support/command_runs.py): the same one line as the
    command prints, without a fresh interpreter's 2 s of imports per case.
    test_bad_input_from_the_command_itself runs one case as a user types it."""
    from tests.support.command_runs import run_command
    r = run_command("minizero.compare.compare", [*args, "--out", str(tmp_path)], timeout=60)
    assert_one_error_line(r, needle)


def assert_one_error_line(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("python -m minizero.compare: error:"), lines


def test_bad_input_from_the_command_itself(tmp_path):
    """`python -m minizero.compare` in a fresh interpreter: nothing its imports print (a
    warning on stderr) may join the one line."""
    assert_one_error_line(compare("--stages", "7", "--out", str(tmp_path), timeout=60), "unknown stage 7")


def test_three_libraries_take_three_columns(tmp_path):
    """--libs minizero deepspeed torch: every per-library number gets a column per library,
    a loss gap and a speed ratio per library after the first; both pictures draw them all."""
    from minizero.compare import compare
    entry = placed_entry({"params": 1000, "grads": 1000, "master_params": 0, "optimizer_states": 2000}, {})
    results = {0: {lib: fake_summary(lib, loss, entry) for lib, loss in
                   (("minizero", 1.0), ("deepspeed", 1.5), ("torch", 1.25))}}
    libs = ["minizero", "deepspeed", "torch"]
    rows = [compare.stage_row(s, *(r[lib] for lib in libs), libs=libs) for s, r in results.items()]
    row = table_rows(compare.table(rows))[0]
    assert list(row)[:3] == ["stage", "max abs dloss/step mz-DS", "max abs dloss/step mz-PT"]
    assert (row["max abs dloss/step mz-DS"], row["max abs dloss/step mz-PT"]) == ("5.00e-01", "2.50e-01")
    assert [k for k in row if k.startswith("final loss")] == ["final loss mz", "final loss DS", "final loss PT"]
    assert list(row)[list(row).index("samples/s PT") + 1:][:2] == ["mz/DS speed", "mz/PT speed"]
    compare.plot_memory(tmp_path / "memory.png", results)
    compare.plot_losses(tmp_path / "loss.png", results)
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "loss.png").stat().st_size > 0


# ----------------------------------------------------------------------------- pretended nodes: --hpz, --hsdp

def _node_summary(lib, wire, inter_rank1):
    """A 4-rank summary of the tiny GPT, fp32, 2 pretended nodes of 2: rank 0's wire bytes per
    step, and (on a ring over all ranks and inside each node) only rank 1 and 3 sending across."""
    zero = dict.fromkeys([*wire, "total"], 0.0)
    inter_rank1 = {**inter_rank1, "total": sum(inter_rank1.values())}
    return {"library": lib, "model": "tiny", "params": 108_801, "world_size": 4, "ranks_per_node": 2,
            "comm_wire_bytes_per_step": {**wire, "total": sum(wire.values())},
            "comm_inter_node_bytes_per_step": [zero, inter_rank1, zero, inter_rank1]}


# Measured by `python -m minizero.compare --libs minizero deepspeed torch --stages 3 --nproc 4 --hpz 2
# --max-steps 4 --synthetic-train 256 --synthetic-test 32` (summary.json of each run, per step after the first).
HPZ_RUNS = {
    "minizero": ({"all_gather": 544_040.0, "reduce_scatter": 326_424.0, "all_reduce": 12.0, "broadcast": 0.0},
                 {"all_gather": 326_424.0, "reduce_scatter": 326_424.0, "all_reduce": 12.0, "broadcast": 0.0}),
    "deepspeed": ({"all_gather": 544_260.0, "reduce_scatter": 326_556.0, "all_reduce": 24.0, "broadcast": 1736 / 3},
                  {"all_gather": 326_556.0, "reduce_scatter": 326_556.0, "all_reduce": 24.0, "broadcast": 1736 / 3}),
    "torch": ({"all_gather": 609_940.0, "reduce_scatter": 365_964.0, "all_reduce": 0.0, "broadcast": 0.0},
              {"all_gather": 365_964.0, "reduce_scatter": 365_964.0, "all_reduce": 0.0, "broadcast": 0.0}),
}


def test_every_byte_between_pretended_nodes_is_predicted_from_each_librarys_padding():
    """hpZ, k = 2, on 4 ranks: each library's all-gather, reduce-scatter and all-reduce bytes,
    per rank and on the link, are its padded elements through one formula; only DeepSpeed's
    broadcasts (its trace check) are named instead. A changed byte is marked unexplained."""
    from minizero.compare import compare
    from minizero.compare.compare_nodes import nodes_section
    libs = ["minizero", "deepspeed", "torch"]
    args, _ = compare.parse_args(["--libs", *libs, "--stages", "3", "--nproc", "4", "--hpz", "2", "--dtype", "fp32"])
    results = {3: {lib: _node_summary(lib, *HPZ_RUNS[lib]) for lib in libs}}
    text = "\n".join(nodes_section(results, args, libs, 2, "hpz"))
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ")[1:] for ln in text.splitlines() if ln.startswith("| all_") or
            ln.startswith("| reduce") or ln.startswith("| broadcast")}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert all(c.startswith("= ") for c in rows[op]), (op, rows[op])
    assert rows["broadcast"][1] == "579" and "assert_ints_same_as_other_ranks" in text
    for lib, padded in (("minizero", "108,808"), ("deepspeed", "108,852"), ("torch", "121,988")):
        assert f"P = {padded} elements" in text
    results[3]["torch"]["comm_wire_bytes_per_step"]["reduce_scatter"] += 4
    assert "unexplained 365,968" in "\n".join(nodes_section(results, args, libs, 2, "hpz"))
    for lib in libs:   # the table's link column: what node 0's ranks sent across, all ops
        results[3][lib].update(losses=[1.0], final_loss=1.0, test_loss=1.0, peak_mem_mb=[1], samples_per_s=1.0,
                               skipped_steps=0, model_state_bytes=[{"params": 1, "grads": 1, "master_params": 0,
                                                                    "optimizer_states": 1}])
    row = compare.stage_row(3, *(results[3][lib] for lib in libs), libs=libs)
    assert row["minizero"]["link_bytes_per_step"] == 326_424 + 326_424 + 12
    assert table_rows(compare.table([row]))[3]["link B/step mz"] == "652,860"


@pytest.fixture(scope="module")
def hsdp_report(tmp_path_factory):
    """minizero and FSDP2 with --hsdp 2 on 4 ranks (2 pretended nodes), 3 steps of the tiny GPT."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("compare-hsdp")
    r = compare_forked("--libs", "minizero", "torch", "--stages", "3", "--nproc", "4", "--hsdp", "2", "--dtype", "fp32",
                       "--max-steps", "3", "--image-size", "8", "--out", str(out), "--synthetic-train", "256",
                       "--synthetic-test", "32", "--data-dir", str(out / "data"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_hsdp_runs_minizeros_column_and_names_every_byte_between_nodes(hsdp_report):
    md = (hsdp_report / "report.md").read_text()
    row = table_rows(md)[3]
    assert row["final loss mz"] == row["final loss PT"]          # HSDP is FSDP2's HSDP, bit for bit in fp32
    section = md.split("## Between nodes", 1)[1].split("\n## ", 1)[0]
    cells = [c.strip() for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| op")
             for c in ln.strip("|").split("|")[1:]]
    assert len(cells) == 16 and all(c.startswith("= ") for c in cells), cells   # 4 ops x wire, link x 2 libraries
    assert float(row["link B/step mz"].replace(",", "")) > 0
    log = (hsdp_report / "minizero-stage3" / "run.log").read_text().splitlines()[0]
    assert log.startswith("$ MINIZERO_RANKS_PER_NODE=2 ")    # the run's command, as it ran
