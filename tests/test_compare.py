"""python -m minizero.compare end to end: minizero and DeepSpeed on the same tiny run,
stages 0 and 3, fp32, 2 ranks (4 launches, ~1-2 minutes on 2 CPU cores).

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


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    from minizero.train_args import DEFAULT_CONFIG

    out = tmp_path_factory.mktemp("compare")
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["gradient_clipping"] = 0.0
    (out / "noclip.json").write_text(json.dumps(cfg))
    r = compare("--stages", "0", "3", "--dtype", "fp32", "--nproc", str(N), "--model", "tiny",
                "--dataset", "synthetic", "--image-size", "8", "--max-steps", "10", "--out", str(out),
                # passed through to both training scripts:
                "--synthetic-train", "256", "--synthetic-test", "32", "--num-samples", "4",
                "--data-dir", str(out / "data"), "--config", str(out / "noclip.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


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
