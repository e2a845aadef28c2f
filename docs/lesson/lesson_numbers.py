"""Every number docs/lesson.md and docs/reading.md quote, printed by the commands that make them.

    python docs/lesson/lesson_numbers.py                 # runs the lesson's training commands, ~2 min on 2 CPU cores
    python docs/lesson/lesson_numbers.py --runs runs/    # reads runs/trace-* the lesson's commands already wrote
    python docs/lesson/lesson_numbers.py --img           # and redraws the lesson's pictures in docs/img/

Why a script: a number typed into a page drifts the day the code changes. This one runs
the lesson's own commands (as the page prints them, small sizes included), reads their
traces and the layout code, and prints each number the pages quote;
tests/tools/test_lesson_numbers.py fails when a page quotes a number it does not print. Times (ms) are printed for you to compare with yours, and quoted nowhere: they
change from run to run, bytes and counts do not.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# The lesson's commands, exactly as docs/lesson.md prints them (a test checks that it does);
# run() fills in $s / $k and puts runs/ under --runs.
SMALL = "--max-steps 3 --synthetic-train 256 --synthetic-test 16 --num-samples 0"
TRAIN = "torchrun --standalone --nproc-per-node 2 -m minizero.train"
COMMANDS = {
    "stages": f"{TRAIN} --config docs/lesson/stages.json --stage $s {SMALL} --save-dir runs/lesson-z$s --trace runs/trace-z$s",
    "overlap": f"{TRAIN} --config docs/lesson/overlap_$k.json {SMALL} --save-dir runs/lesson-overlap-$k --trace runs/trace-overlap-$k",
    "figure1": "python -m minizero.memory_table --paper-figure1 --png runs/figure1.png",
    "memory": "python -m minizero.memory_table --model tutorial --world-size 2 8 64 1024",
    "step5": f"{TRAIN} --config docs/lesson/offload_step5.json --model tutorial-24 --n-embd 32 --image-size 8 "
             f"--micro-batch 8 {SMALL} --save-dir runs/lesson-step5 --trace runs/trace-step5",
}
RUNS = {**{f"z{s}": ("stages", {"$s": str(s)}) for s in range(4)},
        **{f"overlap-{k}": ("overlap", {"$k": k}) for k in ("off", "on")}, "step5": ("step5", {})}


def run(name: str, runs: str) -> str:
    """Run one lesson command (if its trace is not there yet); its trace folder."""
    trace = os.path.join(runs, f"trace-{name}")
    if not os.path.exists(os.path.join(trace, "rank0.json")):
        command, values = RUNS[name]
        words = COMMANDS[command].split()
        for var, value in values.items():
            words = [w.replace(var, value) for w in words]
        words = [os.path.join(runs, w[len("runs/"):]) if w.startswith("runs/") else w for w in words]
        cmd = [sys.executable, "-m", "torch.distributed.run"] + words[1:]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"})
    return trace


def rank0(trace: str) -> tuple[dict, list[dict]]:
    """(the traced step's ledger, its events) on rank 0."""
    d = json.load(open(os.path.join(trace, "rank0.json")))
    (ledger,) = d["otherData"]["ledger"].values()
    return ledger, [e for e in d["traceEvents"] if e.get("ph") == "X"]


def memory_numbers(runs: str) -> None:
    from minizero.observe import memory_table
    from minizero.observe.memory_table import compute, figure1
    print("## part 1: memory (python -m minizero.memory_table)")
    for name in ("figure1", "memory"):   # the page's commands, their output as printed
        words = [os.path.join(runs, w[len("runs/"):]) if w.startswith("runs/") else w for w in COMMANDS[name].split()]
        assert words[:3] == ["python", "-m", "minizero.memory_table"], words
        # `python -m minizero.memory_table ARGS` is its main(ARGS): run here, not in a second
        # interpreter that imports torch again (2-3 s each); both commands compute, start nothing.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            memory_table.main(words[3:])
        print(out.getvalue())
    # the same numbers, one line per row, with the sums the page quotes
    print("figure1: Ψ = 7.5B parameters, N = 64, K = 12")
    for row in figure1():
        print(f"figure1 stage {row['stage']}: {row['total'] / 1e9:.1f} GB")
    table = compute("tutorial", [2, 8, 64, 1024], "bf16")
    for n, by_stage in table.items():
        for s, (b, psi) in by_stage.items():
            total = sum(b[k] for k in ("params", "grads", "master_params", "optimizer_states"))
            print(f"tutorial N={n} stage {s}: params {b['params']:,} grads {b['grads']:,} master "
                  f"{b['master_params']:,} optimizer {b['optimizer_states']:,} total {total:,} "
                  f"({total / 1e6:.1f} MB; weights + grads {(b['params'] + b['grads']) / 1e6:.1f} MB)")
    print(f"tutorial Ψ = {psi:,}")
    from minizero.observe.memory_table import meta_model
    from minizero.zero_config import ZeroConfig
    weight = dict(meta_model("tutorial")[0].named_parameters())["blocks.0.mlp.0.weight"]
    print(f"reading.md: blocks.0.mlp.0.weight {weight.shape[0]} x {weight.shape[1]} = {weight.numel():,} elements; "
          f"stage3_param_persistence_threshold default {ZeroConfig().stage3_param_persistence_threshold:,}")


def volume_numbers() -> None:
    """Bytes per step at N = 2 and N = 4 for the tiny GPT, from the layout the stages build
    (memory_table.layout, each FlatParam padded to a multiple of N) and comm.py's ring
    formulas: payload = the buffer; wire = (N-1)/N of it per reduce-scatter or all-gather,
    2(N-1)/N per all-reduce."""
    from minizero.observe.memory_table import layout, meta_model
    from minizero.partition import padded_numel
    model, groups = meta_model("tiny")
    psi = sum(p.numel() for g in groups for p in g["params"])
    print(f"## part 2b: volume at N = 2 and 4 (tiny GPT, Ψ = {psi:,}, fp32: 4 bytes)")
    for n in (2, 4):
        z0 = sum(padded_numel(p.numel, 1) for p in layout(model, groups, 0)) * 4
        z1 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 1)) * 4
        z3 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 3)) * 4
        ar = 2 * z0 * (n - 1) // n
        print(f"N={n} stage 0: all-reduce payload {z0:,} wire/rank {ar:,} = 2(N-1)/N x {z0:,}")
        print(f"N={n} stage 1/2: reduce-scatter + all-gather payload {z1:,} + {z1:,} "
              f"wire/rank {z1 * (n - 1) // n:,} + {z1 * (n - 1) // n:,}")
        print(f"N={n} stage 3: reduce-scatter {z3:,} + all-gathers {2 * z3:,} "
              f"wire/rank {z3 * (n - 1) // n:,} + {2 * z3 * (n - 1) // n:,} = {3 * z3 * (n - 1) // n:,}")
        print(f"N={n} stage 3 / stage 0: wire {3 * z3 * (n - 1) // n / ar:.1f}, payload {3 * z3 / z0:.0f}")


def stage_numbers(runs: str) -> None:
    print("## part 2: one step per stage (docs/lesson/stages.json, step 2, rank 0)")
    zero = json.load(open(os.path.join(ROOT, "docs/lesson/stages.json")))["zero_optimization"]
    print(f"stages.json: reduce_bucket_size {zero['reduce_bucket_size']} elements")
    for s in range(4):
        ledger, events = rank0(run(f"z{s}", runs))
        ops = {op: v for op, v in ledger.items() if v["calls"] and op in ("all_reduce", "reduce_scatter", "all_gather")}
        print(f"stage {s}: " + "; ".join(f"{op} calls {v['calls']} payload {v['bytes']:,} wire {v['wire_bytes']:,}"
                                          for op, v in ops.items()))
        backward = [e for e in events if e["name"] == "backward"][0]
        blocks = [e for e in events if e.get("cat") == "units" and e["args"]["phase"] == "backward"
                  and e["args"]["unit"] != "root"]
        last_block_end = max(e["ts"] + e["dur"] for e in blocks)
        rs = [e for e in events if e.get("cat") == "collectives" and e["args"]["op"] == "reduce_scatter"]
        during = sum(e["ts"] < last_block_end for e in rs)
        in_backward = sum(backward["ts"] <= e["ts"] < backward["ts"] + backward["dur"] for e in rs)
        print(f"stage {s}: reduce-scatters {len(rs)}, started inside backward {in_backward}, "
              f"started before the last block's backward ended {during}")


def overlap_numbers(runs: str) -> None:
    print("## part 3: the overlap knobs (step 2, rank 0; times vary from run to run)")
    for k in ("off", "on"):
        ledger, events = rank0(run(f"overlap-{k}", runs))
        step = [e for e in events if e["name"].startswith("step ")][0]
        coll = [e for e in events if e.get("cat") == "collectives"]
        wait = sum(e["args"].get("wait_us", 0) for e in coll) / 1e3
        ag = ledger["all_gather"]
        print(f"overlap {k}: all-gathers {ag['calls']} payload {ag['bytes']:,}; "
              f"step {step['dur'] / 1e3:.1f} ms, waiting {wait:.1f} ms")


def offload_numbers(runs: str) -> None:
    print("## part 5: offload (docs/lesson/offload_step5.json, step 2, rank 0)")
    ledger, _ = rank0(run("step5", runs))
    for op in ("d2h", "h2d"):
        print(f"{op}: calls {ledger[op]['calls']} bytes {ledger[op]['bytes']:,}")
    psi = json.load(open(os.path.join(runs, "lesson-step5", "summary.json")))["params"]
    print(f"step5 shrunk Ψ = {psi:,}; 2Ψ/N (fp16, N = 2) = {psi:,} bytes")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", help="folder of the lesson's runs (default: a new temporary one)")
    ap.add_argument("--img", action="store_true", help="also redraw docs/img/ (pictures.py; needs matplotlib)")
    args = ap.parse_args(argv)
    runs = args.runs or tempfile.mkdtemp(prefix="minizero-lesson-")
    memory_numbers(runs)
    volume_numbers()
    stage_numbers(runs)
    overlap_numbers(runs)
    offload_numbers(runs)
    if args.img:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from pictures import draw_all
        from minizero.observe.memory_table import plot_figure1
        plot_figure1(os.path.join(ROOT, "docs/img/zero_figure1.png"))
        for path in draw_all(runs, os.path.join(ROOT, "docs/img")):
            print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
