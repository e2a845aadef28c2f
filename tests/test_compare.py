"""python -m minizero.compare end to end: minizero and DeepSpeed on the same tiny run,
stages 0 and 3, fp32, 2 ranks (4 launches, ~1-2 minutes on 2 CPU cores); and stage 3 with
both ZeRO-Offloads (2 launches), whose report shows device and host bytes.

The config is train.py's default with gradient_clipping 0 (off). minizero and DeepSpeed
differ in one piece of arithmetic, the gradient norm, which reaches the weights only
through clipping (tests/test_agreement_loss.py: test_clipping_active_*); with it off both
libraries run the same ops in the same order, so the losses must agree BITWISE, on any CPU.
(With clipping on, as by default, this run measured 1-2 fp32 ulps of the loss.)"""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
N = 2


def compare(*args, timeout=300):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "minizero.compare", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(md: str) -> dict:
    """{stage: {column title: cell}} from report.md's markdown table."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {int(r["stage"]): r for r in rows}


def run_compare(out, stages, zero=()):
    """compare on the tiny run, fp32, train.py's default config with clipping off and `zero`
    added to zero_optimization."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    from minizero.train_args import DEFAULT_CONFIG

    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["gradient_clipping"] = 0.0
    cfg["zero_optimization"].update(zero)
    (out / "noclip.json").write_text(json.dumps(cfg))
    r = compare("--stages", *map(str, stages), "--dtype", "fp32", "--nproc", str(N), "--model", "tiny",
                "--dataset", "synthetic", "--image-size", "8", "--max-steps", "10", "--out", str(out),
                # passed through to both training scripts:
                "--synthetic-train", "256", "--synthetic-test", "32", "--num-samples", "4",
                "--data-dir", str(out / "data"), "--config", str(out / "noclip.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_compare(tmp_path_factory.mktemp("compare"), (0, 3))


@pytest.fixture(scope="module")
def offload_report(tmp_path_factory):
    return run_compare(tmp_path_factory.mktemp("compare-offload"), (3,),
                       {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})


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


def test_losses_agree_fp32(report):
    out, _ = report
    rows = table_rows((out / "report.md").read_text())
    results = json.loads((out / "results.json").read_text())
    for stage in (0, 3):
        d = float(rows[stage]["max abs dloss/step"])
        assert d == 0.0, f"stage {stage}: minizero and DeepSpeed losses differ by {d} (fp32)"
        s = results["summaries"][str(stage)]
        assert len(s["minizero"]["losses"]) == len(s["deepspeed"]["losses"]) == 10
        assert s["minizero"]["losses"] == s["deepspeed"]["losses"]
        assert s["minizero"]["library"] == "minizero" and s["deepspeed"]["library"] == "deepspeed"
    assert [r["stage"] for r in results["rows"]] == [0, 3]
    assert all(r["max_abs_dloss"] == 0.0 for r in results["rows"])


def test_memory_columns(report):
    out, _ = report
    from minizero.model import GPT, get_preset

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

    from minizero import compare
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
    (docs/deepspeed.md, "ZeRO-Offload's extra host buffers"); the losses still agree bitwise."""
    out, _ = offload_report
    md = (out / "report.md").read_text()
    row = table_rows(md)[3]
    results = json.loads((out / "results.json").read_text())
    mz, ds = (results["summaries"]["3"][lib]["model_state_bytes"][0] for lib in ("minizero", "deepspeed"))
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
    assert float(row["max abs dloss/step"]) == 0.0
    from PIL import Image
    with Image.open(out / "memory.png") as im:
        assert im.size[0] >= 2 * 500   # two panels (device, host), each at least 5 inches at 100 dpi


@pytest.mark.parametrize("args, needle", [
    (["--stages", "7"], "unknown stage 7"),
    (["--stages", "0", "--nproc", "0"], "--nproc must be >= 1"),
    (["--stages", "0", "--dtype", "fp8"], "unknown --dtype"),
])
def test_bad_input_is_one_line(args, needle, tmp_path):
    r = compare(*args, "--out", str(tmp_path), timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("python -m minizero.compare: error:")
