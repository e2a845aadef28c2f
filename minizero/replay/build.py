"""A traced step as the replay page reads it: every rank's events in one order, each with what
the rank held and what it was doing, computed from the trace alone.

The trace (observe/trace.py) records, per rank and on one clock, the step's phases, each
unit's forward/backward/recompute, every collective and host copy (op, label, payload, wire
and inter-node bytes, the ranks it ran among, its seq in the step), and a memory sample at
every one of those events (observe/memory_track.py). `run_data` turns one traced step into:

    moments   every memory sample of every rank, in time order: [t (us from the step's
              start), rank, the sample's index on that rank]. The page steps through these.
    samples   per rank, each sample: the event it was taken at, the bytes held by kind and
              place ([place, kind, bytes], indices into `places` and `kinds`), the units
              gathered (indices into `units`)
    colls     every collective and copy: rank, op, label, unit, bytes, ranks, and the moments
              it runs between, [m0, m1) (its begin and end samples, matched by seq)
    spans     every unit's forward/backward/recompute and every phase, as moment ranges
              (matched by time: a span's begin and end are the marks its samples were taken at)

The page computes everything it shows from these: the ledger is the sum of the collectives
that ended by the current moment, the memory stack is the rank's latest sample. The ZeRO
paper's formulas (`paper`) are the only numbers not from the trace; the page prints them
beside the measured ones at the step's end.
"""
from __future__ import annotations

import bisect
import json
import os
import re

KIND_ORDER = ("params.gathered", "params.shard", "params.secondary", "master_params", "optimizer_states",
              "grads.shard", "grads.buffer", "grads.param")
PLACE_ORDER = ("device", "host", "nvme")
DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def unit_of(label: str, units: list[str]) -> str | None:
    """The unit a FlatParam or collective label belongs to ('blocks.0.g1.bwd' -> 'blocks.0',
    'root.g0.persist' -> 'root'); None for a label of no unit (ZeRO-2's buckets, the norm)."""
    head = re.split(r"\.g\d+(?:\.|$)", label, maxsplit=1)[0]
    return head if head in units else None


def scheme_of(other: dict) -> str:
    """ "zero3", "hpz", "hsdp", or "stageN" for stages 0-2, from the trace's otherData."""
    stage = int(other.get("stage", 0))
    world = int(other.get("world_size", 1))
    if stage == 3 and 1 < int(other.get("hpz_partition_size") or 0) < world:
        return "hpz"
    if stage == 3 and 0 < int(other.get("hsdp_shard_size") or 0) < world:
        return "hsdp"
    return "zero3" if stage == 3 else f"stage{stage}"


def title_of(other: dict, name: str) -> str:
    world = int(other.get("world_size", 1))
    per_node = int(other.get("ranks_per_node") or world)
    scheme = scheme_of(other)
    what = {"hpz": f"ZeRO-3 + hpZ (k = {other.get('hpz_partition_size')})",
            "hsdp": f"ZeRO-3, HSDP (S = {other.get('hsdp_shard_size')})",
            "zero3": "ZeRO-3"}.get(scheme, f"ZeRO stage {other.get('stage')}")
    nodes = f", {world // per_node} nodes of {per_node}" if per_node < world else ""
    return (f"{name}: {other.get('library', 'minizero')} {what}, {DTYPES.get(other.get('dtype'), other.get('dtype', ''))}, "
            f"{world} rank{'s' * (world > 1)}{nodes}")


# ----------------------------------------------------------------------------- the paper's formulas

def paper(other: dict) -> dict | None:
    """The ZeRO paper's bytes for one optimizer step of this run, per rank, without padding:
    {"wire": {op: (bytes, formula)}, "states": (bytes, formula)}; None when the trace does not
    say Ψ. Ψ parameters of b bytes, N ranks, G micro-steps per optimizer step (ZeRO-2/3 reduce
    every micro-step, ZeRO-3 gathers every micro-step; stage 0/1 reduce once, at the step).
    Paper, section 7: all-reduce = reduce-scatter + all-gather, Ψ(N-1)/N each on a ring; hpZ
    (ZeRO++, arXiv 2306.10209, 3.2) gathers backward's among the k ranks of a node; HSDP (PyTorch
    FSDP, arXiv 2304.11277, 3.2.2) shards over S and all-reduces the 1/S shard across R = N/S."""
    psi = other.get("params")
    if not psi:
        return None
    b, n = int(other.get("element_bytes", 4)), int(other.get("world_size", 1))
    g = int(other.get("gradient_accumulation_steps", 1))
    mixed = other.get("dtype") != "torch.float32"
    ring = lambda m: (m - 1) / m
    scheme = scheme_of(other)
    B = b * psi
    if scheme == "stage0":
        wire = {"all_reduce": (2 * B * ring(n), "2Ψb(N-1)/N")}
    elif scheme in ("stage1", "stage2"):
        rs = (B * ring(n), "Ψb(N-1)/N") if scheme == "stage1" else (g * B * ring(n), "GΨb(N-1)/N")
        wire = {"reduce_scatter": rs, "all_gather": (B * ring(n), "Ψb(N-1)/N")}
    elif scheme == "zero3":
        wire = {"all_gather": (2 * g * B * ring(n), "2GΨb(N-1)/N"), "reduce_scatter": (g * B * ring(n), "GΨb(N-1)/N")}
    elif scheme == "hpz":
        k = int(other["hpz_partition_size"])
        wire = {"all_gather": (g * B * (ring(n) + ring(k)), "GΨb((N-1)/N + (k-1)/k)"),
                "reduce_scatter": (g * B * ring(n), "GΨb(N-1)/N")}
    else:   # hsdp
        s = int(other["hsdp_shard_size"])
        r = n // s
        wire = {"all_gather": (2 * g * B * ring(s), "2GΨb(S-1)/S"), "reduce_scatter": (g * B * ring(s), "GΨb(S-1)/S"),
                "all_reduce": (g * 2 * B / s * ring(r), "2GΨb/S·(R-1)/R")}
    # model states per rank (memory.paper_bytes; hpZ adds its secondary bΨ/k, HSDP shards over S)
    k_opt = 12 if mixed else 8
    per = {"stage0": (b + b + k_opt) * psi, "stage1": (b + b) * psi + k_opt * psi / n,
           "stage2": b * psi + (b + k_opt) * psi / n}
    lp = "2" if mixed else "4"
    forms = {"stage0": f"({lp}+{lp}+{k_opt})Ψ", "stage1": f"({lp}+{lp})Ψ + {k_opt}Ψ/N",
             "stage2": f"{lp}Ψ + ({lp}+{k_opt})Ψ/N"}
    if scheme in per:
        states = (per[scheme], forms[scheme])
    elif scheme == "hpz":
        k = int(other["hpz_partition_size"])
        states = ((b + b + k_opt) * psi / n + B / k, f"({lp}+{lp}+{k_opt})Ψ/N + {lp}Ψ/k")
    elif scheme == "hsdp":
        s = int(other["hsdp_shard_size"])
        states = ((b + b + k_opt) * psi / s, f"({lp}+{lp}+{k_opt})Ψ/S")
    else:
        states = ((b + b + k_opt) * psi / n, f"({lp}+{lp}+{k_opt})Ψ/N")
    return {"psi": psi, "wire": {op: [round(v), f] for op, (v, f) in wire.items()},
            "states": [round(states[0]), states[1]], "G": g, "N": n, "b": b}


# ----------------------------------------------------------------------------- one traced step

def run_data(doc: dict, name: str, step: int | None = None) -> dict:
    """The page's view of one traced step of a merged trace document (trace.json, or
    timeline.merge of the rank files). `step`: which traced step (default: the first)."""
    other = doc.get("otherData", {})
    memory = {int(r): samples for r, samples in doc.get("memoryTrack", {}).items()}
    if not memory:
        raise ValueError("the trace has no memory track (it was written before minizero recorded one); "
                         "trace the run again with --trace")
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in xs if "step" in e.get("args", {})})
    if not steps:
        raise ValueError("the trace holds no traced step")
    step = steps[0] if step is None else step
    if step not in steps:
        raise ValueError(f"step {step} was not traced; the trace holds step{'s' * (len(steps) > 1)} "
                         f"{', '.join(map(str, steps))}")
    xs = [e for e in xs if e["args"].get("step") == step]
    ranks = sorted(memory)
    begin = min(e["ts"] for e in xs if e["cat"] == "step" and e["name"].startswith("step "))
    samples = {r: [s for s in memory[r] if s.get("step") == step] for r in ranks}
    units = list(dict.fromkeys(e["args"]["unit"] for e in sorted(xs, key=lambda e: e["ts"]) if e["cat"] == "units"))

    # moments: every sample of every rank, in time order (a rank's own order kept on ties)
    order = sorted(((s["t"], r, i) for r in ranks for i, s in enumerate(samples[r])))
    index = {(r, i): m for m, (_, r, i) in enumerate(order)}
    times = {r: [s["t"] for s in samples[r]] for r in ranks}

    def moment_at(r: int, t: float) -> int:
        """The first moment of rank r at or after time t (past the end: one past the last)."""
        i = bisect.bisect_left(times[r], t)
        return index[(r, i)] if i < len(samples[r]) else len(order)

    # a sample's bytes as [place, kind, bytes] and its gathered units, by index into the run's
    # places, kinds and units: a long run has thousands of samples
    held_kinds = {k for r in ranks for s in samples[r] for ks in s["held"].values() for k, b in ks.items() if b}
    held_places = {p for r in ranks for s in samples[r] for p, ks in s["held"].items() if any(ks.values())}
    kinds = [k for k in KIND_ORDER if k in held_kinds] + sorted(held_kinds - set(KIND_ORDER))
    places = [p for p in PLACE_ORDER if p in held_places] + sorted(held_places - set(PLACE_ORDER))
    unit_index: dict = {}   # FlatParam label -> its unit's index (None: no unit), each label worked out once

    def index_of_unit(label: str) -> int | None:
        if label not in unit_index:
            u = unit_of(label, units)
            unit_index[label] = units.index(u) if u else None
        return unit_index[label]

    out_samples = {}
    for r in ranks:
        rows = []
        for s in samples[r]:
            row = {k: s[k] for k in ("event", "op", "label", "unit", "kind", "phase", "seq", "bytes", "wire_bytes")
                   if k in s}
            row["held"] = [[places.index(p), kinds.index(k), b] for p, ks in s["held"].items() for k, b in ks.items() if b]
            row["gathered"] = sorted({i for i in map(index_of_unit, s.get("gathered", [])) if i is not None})
            rows.append(row)
        out_samples[str(r)] = rows

    by_seq = {(r, s.get("seq"), s["event"]): i for r in ranks for i, s in enumerate(samples[r]) if "seq" in s}
    colls = []
    for e in sorted(xs, key=lambda e: (e["pid"], e["ts"])):
        if e["cat"] not in ("collectives", "copies"):
            continue
        a, r = e["args"], e["pid"]
        b0, b1 = by_seq.get((r, a.get("seq"), "begin")), by_seq.get((r, a.get("seq"), "end"))
        m0 = index[(r, b0)] if b0 is not None else moment_at(r, e["ts"])
        m1 = index[(r, b1)] if b1 is not None else moment_at(r, e["ts"] + e["dur"])
        colls.append({"r": r, "op": a["op"], "label": a.get("label", ""), "unit": unit_of(a.get("label", ""), units),
                      "bytes": a.get("bytes", 0), "wire": a.get("wire_bytes", 0), "inter": a.get("inter_node_bytes", 0),
                      "wait": round(a.get("wait_us", 0.0), 1), "async": bool(a.get("async")),
                      "ranks": a.get("ranks", [r]), "copy": e["cat"] == "copies",
                      "m0": m0, "m1": m1, "ts": round(e["ts"] - begin, 1), "te": round(e["ts"] + e["dur"] - begin, 1)})
    spans = []
    for e in sorted(xs, key=lambda e: (e["pid"], e["ts"])):
        if e["cat"] == "units" or (e["cat"] == "step" and not e["name"].startswith("step ")):
            r = e["pid"]
            spans.append({"r": r, "unit": e["args"].get("unit"), "name": e["args"].get("phase", e["name"]),
                          "phase": e["cat"] == "step", "m0": moment_at(r, e["ts"]), "m1": moment_at(r, e["ts"] + e["dur"]),
                          "ts": round(e["ts"] - begin, 1), "te": round(e["ts"] + e["dur"] - begin, 1)})
    world = int(other.get("world_size", len(ranks)))
    return {
        "name": name, "title": title_of(other, name), "step": step, "steps": steps, "ranks": ranks,
        "per_node": int(other.get("ranks_per_node") or world), "stage": other.get("stage"),
        "scheme": scheme_of(other), "units": units,
        "kinds": kinds, "places": places,
        "moments": [[round(t - begin, 1), r, i] for t, r, i in order],
        "samples": out_samples, "colls": colls, "spans": spans,
        "duration": round(max(e["ts"] + e["dur"] for e in xs) - begin, 1), "paper": paper(other),
    }


# ----------------------------------------------------------------------------- finding the trace

def find_trace(path: str) -> str:
    """A trace folder (rank*.json or trace.json), a trace file, or a run folder whose
    summary.json names its trace (`minizero.train --trace`): the trace folder or file."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    names = os.listdir(path)
    if any(re.fullmatch(r"rank\d+\.json", n) for n in names) or "trace.json" in names:
        return path
    summary = os.path.join(path, "summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            cfg = json.load(f).get("config") or {}
        traced = (cfg.get("minizero_trace") or {}).get("output_path")
        if traced:
            for candidate in (traced, os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(traced))):
                if os.path.isdir(candidate):
                    return candidate
            raise FileNotFoundError(f"{path}: its run traced into {traced}, which is not there")
        raise FileNotFoundError(f"{path}: this run was not traced (run it with --trace DIR)")
    raise FileNotFoundError(f"{path}: neither a trace folder (rank0.json, ...) nor a run folder with summary.json; "
                            f"write one with python -m minizero.train ... --trace DIR")


def load(path: str) -> dict:
    """The merged trace document of `path` (find_trace)."""
    from ..observe.timeline import merge
    where = find_trace(path)
    if os.path.isdir(where):
        if any(re.fullmatch(r"rank\d+\.json", n) for n in os.listdir(where)):
            return merge(where)
        where = os.path.join(where, "trace.json")
    try:
        with open(where) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a readable trace ({e})") from None
