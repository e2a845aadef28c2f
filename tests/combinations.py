"""Every combination of features the config accepts either trains and equals its simpler twin,
or is refused by `minizero.initialize` in one line, before any rank allocates.

    python -m tests.combinations --pairs        # a sample of cells covering every pair of feature values
    python -m tests.combinations --all          # every cell (about 40 minutes on 2 cores)
    python -m tests.combinations --cell stage=3,hierarchy=hsdp,offload_param=nvme   # one cell and its twin
    add --markdown OUT.md to write the table as a results page

A *cell* is one value per axis below; each axis is a key (or a few) of the DeepSpeed config
minizero reads, with the values that key accepts, so a feature the config gains is a feature the
matrix must name: tests/core/test_combinations.py checks that every key of zero_optimization,
activation_checkpointing, fp16 and bf16 that changes what runs is an axis here or in
`NOT_AXES`, with the reason and the test that covers it.

Each cell's *twin* is the same cell with every axis that must not change a number set to its
simplest value: no offload, no hpZ, no activation checkpointing, overlap and prefetch off. The
axes that do change numbers (stage, precision, gradient accumulation, clipping, HSDP) are kept:
their cells with every other axis at its simplest are the *roots*, each checked elsewhere
against the library it copies (stages and precisions against DeepSpeed in tests/agreement/,
HSDP against FSDP2's HSDP in tests/agreement/test_hierarchy.py). "equal" means bit for bit:
each micro-step's loss, each step's loss scale and skip count, and every fp32 master element
after the last step. That is the right bound, not a hope: every neutral axis changes where a
tensor lives or when a collective runs, never the order of any sum (offload runs the same fp32
operations on the host; NVMe adds files under the host tensors; hpZ gathers the same values
from another shard; overlap and prefetch move the same bytes earlier; recomputation replays the
forward, RNG included), so any difference is a bug.

All cells run on 4 gloo ranks pretending to be 2 nodes of 2 (MINIZERO_RANKS_PER_NODE=2: hpZ's
k and HSDP's S are 2), the micro GPT with dropout on (so recomputation must replay the RNG), a
persistence threshold of 100 elements at stage 3 (its norms and biases stay gathered, its
weights are partitioned: both paths in every cell), 2 optimizer steps of learnable batches,
torch's AdamW (`torch_adam`: the same Adam on the host as on the device). Cells run many to a
launch; a launch that fails or hangs is rerun cell by cell, so a crash or a hang is named by its
cell.

Why 2 steps: the first step runs from the initial weights with empty Adam moments, the second
from weights the optimizer wrote and moments it keeps, and that second step already walks every
path a neutral axis adds: ZeRO-3's prefetch trace is recorded by the first micro-step and read
ahead from the second on (minizero/prefetch.py); offloaded optimizer states and NVMe files are
written by the first step and read back by the second; offloaded parameters are gathered from
what the first step wrote, and hpZ's secondary shards are cut from them again. A third
step repeats the second's operations on other numbers (no loss-scale change: the window is 1000
steps; no overflow at 2^8), so it adds no path a twin could part on. The roots' check that the
loss fell holds with margin at 2 steps: 4.123 -> 4.066 (accumulation 1) and 4.144 -> 4.076 over
4 micro-steps (accumulation 2), the same in every precision to 3 decimals.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from tests.support.harness import PatternBatches, checkpoint_blocks, make_model

N, PER_NODE = 4, 2
STEPS, GLOBAL_BATCH, SEQ = 2, 8, 16   # the module docstring says why 2 steps
THRESHOLD = 100         # stage3_param_persistence_threshold: the micro GPT's norms and biases persistent
CLIP = 0.05             # gradient_clipping "on": below the micro GPT's norms, so every step clips
CELL_TIMEOUT = 10       # seconds a cell may take in a launch (a loaded 2-core machine: about 1)


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple
    covers: tuple          # the config keys it sets (sections as written: zero_optimization.stage, ...)
    simplest: object = None   # the twin's value; None: the axis changes numbers (kept in the twin)
    stages: tuple = (0, 1, 2, 3)   # where the config accepts it (elsewhere: its first value only)


Z, AC = "zero_optimization", "activation_checkpointing"
AXES = (
    Axis("stage", (0, 1, 2, 3), (f"{Z}.stage",)),
    Axis("dtype", ("fp32", "bf16", "fp16"), ("bf16.enabled", "fp16.enabled")),
    Axis("offload_optimizer", ("none", "cpu", "nvme"), (f"{Z}.offload_optimizer", f"{Z}.offload_optimizer.device"),
         simplest="none", stages=(1, 2, 3)),
    Axis("offload_param", ("none", "cpu", "nvme"), (f"{Z}.offload_param", f"{Z}.offload_param.device"),
         simplest="none", stages=(3,)),
    Axis("hierarchy", ("plain", "hpz", "hsdp"), (f"{Z}.zero_hpz_partition_size", f"{Z}.hsdp_shard_size"),
         stages=(3,)),
    Axis("activation", ("off", "on", "partition", "cpu", "contiguous"),
         (AC, f"{AC}.partition_activations", f"{AC}.cpu_checkpointing", f"{AC}.contiguous_memory_optimization",
          f"{AC}.number_checkpoints"), simplest="off"),
    Axis("overlap", ("off", "on"), (f"{Z}.overlap_comm", f"{Z}.stage3_prefetch_bucket_size",
                                    f"{Z}.stage3_max_reuse_distance"), simplest="off"),
    Axis("accumulation", (1, 2), ("gradient_accumulation_steps",)),
    Axis("clipping", ("off", "on"), ("gradient_clipping",)),
)
BY_NAME = {a.name: a for a in AXES}

# The keys that change what runs but are no axis, and where each is covered.
NOT_AXES = {
    "zero_optimization.reduce_bucket_size": "a size, not a mode: several buckets per group in "
        "tests/core/test_buckets.py and tests/number_snapshot.py's small-bucket ZeRO-2 run",
    "zero_optimization.stage3_param_persistence_threshold": "fixed at 100 here so every stage-3 cell has "
        "persistent and partitioned FlatParams; all-persistent and none-persistent in tests/number_snapshot.py",
    "zero_optimization.stage3_max_live_parameters": "a limit, not a mode: tests/core/test_prefetch.py "
        "and the live-limit run of tests/number_snapshot.py",
    "zero_optimization.mics_shard_size": "DeepSpeed's removed name for hsdp_shard_size (the hierarchy axis)",
    "zero_optimization.offload_optimizer.pin_memory": "pins host buffers on a GPU only (a CPU run has none): "
        "tests/core/test_offload.py's CUDA tests",
    "zero_optimization.offload_param.pin_memory": "as offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.nvme_path": "where the nvme value's files go (set for every nvme cell)",
    "zero_optimization.offload_param.nvme_path": "as offload_optimizer.nvme_path",
    "zero_optimization.offload_param.buffer_count": "how many NVMe shards are read ahead: tests/core/test_nvme.py",
    "activation_checkpointing.synchronize_checkpoint_boundary": "a device synchronize, no number: "
        "tests/core/test_checkpointing.py",
    "activation_checkpointing.profile": "timings only: tests/core/test_checkpointing.py",
    "fp16.loss_scale": "a static scale: tests/agreement/test_loss_scaler.py",
    "fp16.initial_scale_power": "fixed at 8 here (no overflow in 2 steps); overflows: tests/core/test_overflow.py",
    "fp16.loss_scale_window": "when the scale grows: tests/agreement/test_loss_scaler.py",
    "fp16.hysteresis": "as loss_scale_window",
    "fp16.consecutive_hysteresis": "as loss_scale_window",
    "fp16.min_loss_scale": "as loss_scale_window",
    "bf16.check_grad_overflow": "skips a bf16 step whose norm is not finite: tests/core/test_nonfinite.py",
    "optimizer.params.torch_adam": "true in every cell, so offload's host Adam is torch's default one as "
        "on the device; without it offload picks torch's fused CPU AdamW (as DeepSpeed picks its CPU Adam), "
        "which rounds as another kernel does: tests/core/test_offload.py",
}


def applies(axis: Axis, stage: int) -> bool:
    return stage in axis.stages


def all_cells() -> list[dict]:
    """Every cell the axes make, in a fixed order (axes not accepted at a stage at their first value)."""
    cells = []
    for stage in BY_NAME["stage"].values:
        ranges = [a.values if applies(a, stage) else a.values[:1] for a in AXES[1:]]
        for combo in itertools.product(*ranges):
            cells.append(dict(zip([a.name for a in AXES], (stage, *combo))))
    return cells


def twin(cell: dict) -> dict:
    """The same cell with every axis that must not change a number at its simplest (hpZ is plain
    ZeRO-3's; HSDP keeps its own: it sums in another order)."""
    t = {a.name: (cell[a.name] if a.simplest is None else a.simplest) for a in AXES}
    if cell["hierarchy"] == "hpz":
        t["hierarchy"] = "plain"
    return t


def is_root(cell: dict) -> bool:
    return twin(cell) == cell


def name(cell: dict) -> str:
    """A cell in one line: its values that differ from the first of their axis, after its stage."""
    parts = [f"stage {cell['stage']}", cell["dtype"]]
    parts += [f"{a.name}={cell[a.name]}" for a in AXES[2:] if cell[a.name] != a.values[0]]
    return ", ".join(parts)


def parse_cell(text: str) -> dict:
    """`stage=3,hierarchy=hsdp`: a cell, the rest at each axis's first value."""
    cell = {a.name: a.values[0] for a in AXES}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        if k not in BY_NAME:
            raise SystemExit(f"python -m tests.combinations: error: no axis {k!r}; the axes: {', '.join(BY_NAME)}")
        match = [x for x in BY_NAME[k].values if str(x) == v]
        if not match:
            raise SystemExit(f"python -m tests.combinations: error: {k} takes {', '.join(map(str, BY_NAME[k].values))}")
        cell[k] = match[0]
    return cell


# ----------------------------------------------------------------------------- pairs

def pairs_of(cell: dict) -> set:
    names = [a.name for a in AXES]
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}


def covering_sample(cells: list[dict] | None = None) -> list[dict]:
    """A small set of cells in which every pair of values that some accepted cell holds appears
    at least once: greedy (each pick covers the most pairs not yet covered; ties to the first in
    all_cells' order), so the same sample every run."""
    cells = all_cells() if cells is None else cells
    cell_pairs = [pairs_of(c) for c in cells]
    uncovered = set().union(*cell_pairs)
    chosen = []
    while uncovered:
        best = max(range(len(cells)), key=lambda i: len(cell_pairs[i] & uncovered))
        chosen.append(cells[best])
        uncovered -= cell_pairs[best]
    return chosen


# ----------------------------------------------------------------------------- one cell, on every rank

def config(cell: dict, folder: str) -> dict:
    """The DeepSpeed config of a cell (`folder`: where its NVMe swap files go)."""
    stage, acc = cell["stage"], cell["accumulation"]
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = THRESHOLD
    on = cell["overlap"] == "on"
    zero["overlap_comm"] = on
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = 10 ** 9 if on else 0
        zero["stage3_max_reuse_distance"] = 10 ** 9 if on else 0
    for key in ("offload_optimizer", "offload_param"):
        dev = cell[key]
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": os.path.join(folder, key)} if dev == "nvme" else {})}
    if cell["hierarchy"] == "hpz":
        zero["zero_hpz_partition_size"] = PER_NODE
    elif cell["hierarchy"] == "hsdp":
        zero["hsdp_shard_size"] = PER_NODE
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // acc // N, "gradient_accumulation_steps": acc,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "torch_adam": True}},
           "gradient_clipping": CLIP if cell["clipping"] == "on" else 0.0, "zero_optimization": zero,
           "steps_per_print": 10 ** 9}
    if cell["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif cell["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    ac = cell["activation"]
    if ac != "off":
        cfg["activation_checkpointing"] = {
            "on": {}, "partition": {"partition_activations": True}, "cpu": {"cpu_checkpointing": True},
            "contiguous": {"partition_activations": True, "contiguous_memory_optimization": True,
                           "number_checkpoints": 2}}[ac]
    return cfg


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def run_cell(cell: dict, folder: str) -> dict:
    """Train one cell on this rank (a collective: every rank runs the same cells in order)."""
    import minizero
    from minizero import comm
    from minizero.config import ConfigError

    torch.manual_seed(0)
    model = make_model("micro", "gpt")
    calls_before = sum(v["calls"] for v in comm.ledger.snapshot().values())
    t0 = time.perf_counter()
    try:
        cfg = config(cell, folder)
        engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1), config=cfg)
        checkpoint_blocks(model, cfg)   # the model checkpoints its own blocks, as under DeepSpeed
    except ConfigError as e:
        issued = sum(v["calls"] for v in comm.ledger.snapshot().values()) - calls_before
        return {"status": "refused", "line": str(e), "lines": len(str(e).splitlines()), "issued": issued}
    batches = PatternBatches(model.tok_emb.num_embeddings, SEQ, GLOBAL_BATCH, cell["accumulation"])
    rank, losses, scales = comm.get_rank(), [], []
    try:
        for step in range(STEPS):
            for micro in range(cell["accumulation"]):
                x, y = batches(step, micro, rank, N)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            scales.append(engine.loss_scale)
        state = engine.full_fp32_state_dict()
        skipped = engine.skipped_steps
    finally:
        engine.destroy()
        _free_groups(engine)
    flat = torch.cat([state[k].reshape(-1) for k in sorted(state)]) if rank == 0 else None
    return {"status": "ran", "losses": losses, "scales": scales, "skipped": skipped, "state": flat,
            "seconds": time.perf_counter() - t0}


def _free_groups(engine) -> None:
    """hpZ's and HSDP's process groups, let go after the cell (a launch makes hundreds)."""
    import torch.distributed as dist
    s = getattr(engine.zero, "sharding", None)
    for g in (getattr(s, "group", None), getattr(s, "replicas", None), getattr(s, "secondary_group", None)):
        if g is not None:
            dist.destroy_process_group(g)


def run_cells_on_rank(cells: list) -> list:
    import logging
    logging.getLogger("minizero").setLevel(logging.WARNING)   # each cell's start-up notes, hundreds of times
    folder = tempfile.mkdtemp(prefix="minizero_cells_")
    out = []
    for cell in cells:
        try:
            out.append(run_cell(cell, folder))
        except Exception as e:   # noqa: BLE001  every rank fails alike or the launch times out
            out.append({"status": "failed", "line": f"{type(e).__name__}: {first_line(e)}"})
    return out


# ----------------------------------------------------------------------------- launches

def run(cells: list[dict], batch: int = 100, progress=None) -> list[dict]:
    """Each cell's result (rank 0's; a cell whose ranks disagree on its outcome failed), `batch`
    cells to a launch of N ranks. A launch that fails or hangs is split in two and each half run
    again, down to the cell that fails alone (a crash or a hang is named by its cell)."""
    results: list = []
    for i in range(0, len(cells), batch):
        results += _launch(cells[i:i + batch])
        if progress is not None:
            progress(len(results), len(cells))
    return results


def _launch(chunk: list[dict]) -> list[dict]:
    from tests.support.launcher import run_ranks
    env = {"MINIZERO_RANKS_PER_NODE": str(PER_NODE), "DS_ACCELERATOR": "cpu"}
    try:
        per_rank = run_ranks(run_cells_on_rank, world_size=N, args=(chunk,), env=env,
                             timeout=60 + CELL_TIMEOUT * len(chunk))
    except RuntimeError as e:
        if len(chunk) == 1:
            why = next((ln for ln in str(e).splitlines() if ln.strip() and "distributed run failed" not in ln), "")
            return [{"status": "failed", "line": f"the launch failed or hung: {why.strip()[:200]} (alone: python -m "
                     f"tests.combinations --cell {_cell_arg(chunk[0])})"}]
        half = len(chunk) // 2
        return _launch(chunk[:half]) + _launch(chunk[half:])
    return [_agree([r[j] for r in per_rank]) for j in range(len(chunk))]


def _agree(per_rank: list[dict]) -> dict:
    """Rank 0's result; a cell whose ranks disagree on its outcome failed."""
    first = per_rank[0]
    if any(r["status"] != first["status"] for r in per_rank):
        return {"status": "failed", "line": "ranks disagree: " + "; ".join(r["status"] for r in per_rank)}
    return first


def _cell_arg(cell: dict) -> str:
    return ",".join(f"{a.name}={cell[a.name]}" for a in AXES if cell[a.name] != a.values[0])


def verdicts(cells: list[dict], progress: bool = False) -> list[dict]:
    """Each cell with its twin (run too, once per twin), and the verdict: equal / refused /
    trains (a root) / failed, with the gap to the twin where they differ. progress: a bar on
    stderr, launch by launch."""
    twins = [twin(c) for c in cells]
    todo, seen = [], set()
    for c in cells + twins:
        k = tuple(c.values())
        if k not in seen:
            seen.add(k)
            todo.append(c)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), unit="run", file=sys.stderr)
    ran = run(todo, progress=(lambda n, total: bar.update(n - bar.n)) if bar is not None else None)
    if bar is not None:
        bar.close()
    done = dict(zip((tuple(c.values()) for c in todo), ran))
    rows = []
    for c, t in zip(cells, twins):
        r, rt = done[tuple(c.values())], done[tuple(t.values())]
        rows.append({"cell": c, "twin": t, **judge(c, r, t, rt)})
    return rows


def judge(cell: dict, r: dict, t: dict, rt: dict) -> dict:
    if r["status"] == "refused":
        ok = r["lines"] == 1 and r["issued"] == 0
        return {"verdict": "refused" if ok else "failed",
                "note": r["line"] if ok else f"refused in {r['lines']} lines after {r['issued']} collectives: {r['line']}"}
    if r["status"] == "failed":
        return {"verdict": "failed", "note": r["line"]}
    if not all(torch.isfinite(torch.tensor(r["losses"]))):
        return {"verdict": "failed", "note": f"a loss is not finite: {r['losses']}"}
    if cell == t:
        fell = r["losses"][-1] < r["losses"][0]
        return {"verdict": "trains" if fell else "failed", "note": "root" + ("" if fell else ": the loss did not fall"),
                "seconds": r["seconds"]}
    if rt["status"] != "ran":
        return {"verdict": "failed", "note": f"its twin did not run: {rt.get('line', rt['status'])}"}
    same = (r["losses"] == rt["losses"] and r["scales"] == rt["scales"] and r["skipped"] == rt["skipped"]
            and torch.equal(r["state"], rt["state"]))
    if same:
        return {"verdict": "equal", "note": "bit for bit", "seconds": r["seconds"]}
    dl = max(abs(a - b) for a, b in zip(r["losses"], rt["losses"]))
    ds = float((r["state"].double() - rt["state"].double()).abs().max())
    return {"verdict": "failed", "note": f"differs from its twin: max |dloss| {dl:.3g}, max |dmaster| {ds:.3g}"}


# ----------------------------------------------------------------------------- the table

def table(rows: list[dict]) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("equal", "trains", "refused", "failed")}
    out = [f"{len(rows)} cells: {counts['equal']} equal to their twin bit for bit, {counts['trains']} roots that "
           f"train, {counts['refused']} refused in one line, {counts['failed']} failed", "",
           "| cell | twin | verdict | note |", "|---|---|---|---|"]
    for r in rows:
        tw = "" if r["cell"] == r["twin"] else name(r["twin"])
        out.append(f"| {name(r['cell'])} | {tw} | {r['verdict']} | {r['note']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.combinations", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every cell")
    which.add_argument("--pairs", action="store_true", help="a sample covering every pair of feature values")
    which.add_argument("--cell", help="one cell, e.g. stage=3,hierarchy=hsdp (the rest at each axis's first value)")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args(argv)
    cells = all_cells() if args.all else covering_sample() if args.pairs else [parse_cell(args.cell)]
    print(f"{len(cells)} cells of {len(all_cells())} "
          f"({'every cell' if args.all else 'every pair of values at least once' if args.pairs else 'one cell'}), "
          f"each against its twin, on {N} gloo ranks as {N // PER_NODE} nodes of {PER_NODE}", flush=True)
    t0 = time.time()
    rows = verdicts(cells, progress=len(cells) > 1)
    text = table(rows)
    print(text)
    print(f"\n{time.time() - t0:.0f} s")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    return 1 if any(r["verdict"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
