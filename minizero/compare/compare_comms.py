"""minizero vs DeepSpeed: the two comms summaries side by side, every differing row explained.

Both libraries log their collectives in DeepSpeed's `comms_logger` format (op, message size,
count, latency, bandwidth). Latencies never agree between two runs, so a row differs when its
op, size or count does; `comms_reason` says why for each such row (DeepSpeed all-reduces where
minizero reduce-scatters, counts reduce-scatter's input N times, times barriers, ...), citing
the docs/deepspeed.md section. `python -m minizero.compare` puts the tables in its report.
"""
from __future__ import annotations

from .compare_memory import DOCS, LIBS

OP_ORDER = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
SCALAR_BYTES = 64   # an all-reduce this small carries a few scalars (a norm, a flag), not a tensor
RS_COUNT = f'{DOCS}, "comms_logger counts reduce_scatter\'s input N times"'
RS_IS_AR = f'{DOCS}, "ZeRO-1/2 reduce-scatter is an all-reduce"'


def comms_rows(mz: dict | None, ds: dict | None) -> list:
    """The two summaries ({op: {msg bytes: record}}, the "summary" of log_summary) merged by
    (op, message size): [(op, size, minizero record or None, DeepSpeed record or None)]."""
    mz, ds = mz or {}, ds or {}
    ops = sorted(set(mz) | set(ds), key=lambda o: (OP_ORDER.index(o) if o in OP_ORDER else len(OP_ORDER), o))
    rows = []
    for op in ops:
        a, b = mz.get(op) or {}, ds.get(op) or {}
        for size in sorted({int(k) for k in a} | {int(k) for k in b}):
            rows.append((op, size, a.get(str(size), a.get(size)), b.get(str(size), b.get(size))))
    return rows


def comms_reason(stage: int, op: str, size: int, mz, ds) -> str | None:
    """Why a row differs between the libraries (None when op, size and count agree)."""
    if mz is not None and ds is not None and mz["count"] == ds["count"]:
        return None
    if op == "broadcast":
        return ("the initial weights from rank 0: DeepSpeed broadcasts each parameter tensor (`_broadcast_model`"
                + ("; ZeRO-3's zero.Init broadcasts each once more, plus a few small broadcasts of its init checks"
                   if stage == 3 else "") + "), minizero each FlatParam's flat buffer once")
    if op == "all_gather_into_tensor":
        if stage == 3:
            return ("ZeRO-3's parameter all-gathers: DeepSpeed one per parameter (message = its partition; a "
                    "module's parameters are issued together; every parameter once more at init), minizero one "
                    "per (unit, param group) FlatParam, in forward and again in backward")
        return ("the parameter all-gather after the step, one per flat buffer: DeepSpeed's per param group "
                "(2N-padded), minizero's per reduce bucket (N-padded)")
    if op == "reduce_scatter_tensor":
        if stage in (1, 2):
            return (f"gradient reduction: minizero reduce-scatters each bucket where DeepSpeed all-reduces it "
                    f"({RS_IS_AR}); the message size is the whole N-shard input, and algbw/busbw N times what "
                    f"moved ({RS_COUNT})")
        return ("ZeRO-3's gradient reduce-scatter: DeepSpeed one per reduce bucket (up to reduce_bucket_size "
                "elements), minizero one per (unit, param group) FlatParam as each unit's backward ends; the "
                f"message size is the whole N-shard input in both, algbw/busbw N times what moved ({RS_COUNT})")
    if op == "all_reduce":
        if size <= SCALAR_BYTES:
            return scalar_reason(stage, size, mz, ds)
        if stage == 0:
            return ("the stage-0 gradient average: DeepSpeed all-reduces one bucket of all gradients (up to "
                    "reduce_bucket_size elements), minizero one per FlatParam (a bucket per param group)")
        if stage in (1, 2):
            return f"gradient reduction: DeepSpeed all-reduces the whole bucket where minizero reduce-scatters ({RS_IS_AR})"
    if mz is None and "barrier" in op:
        return ("DeepSpeed times its barriers too (its checkpoint save, ZeRO-3's init, log_summary's own); "
                "minizero's logger times the four collectives that move data")
    return "unexplained"


def scalar_reason(stage: int, size: int, mz, ds) -> str:
    """A few-byte all-reduce: which scalars each library reduces at this size."""
    norm = f'{DOCS}, "The gradient norm is fp32 at ZeRO-1/2 and fp64 at ZeRO-3"'
    said = []
    if ds is not None:
        said.append({1: "DeepSpeed's overflow vote (`has_overflow`: one uint8 per step, bf16/fp16)",
                     4: f"DeepSpeed's fp32 gradient norm (`get_grad_norm_direct`, ZeRO-1/2, twice per step; {norm})",
                     8: f"DeepSpeed's fp64 gradient norm (`get_grad_norm_direct`, ZeRO-3, twice per step; {norm})",
                     20: "DeepSpeed's checkpoint tag check (`_checkpoint_tag_validation`, one per save)"}.get(
                         size, "DeepSpeed's scalar all-reduces"))
    if mz is not None:
        said.append("minizero's fp64 squared gradient norm (once per step at ZeRO-1-3) and two checks per "
                    "checkpoint save (finite, shared)" if size == 8 else "minizero's scalar all-reduces")
    return "; ".join(said)


def _comms_cell(rec, key, kind="g"):
    if rec is None:
        return "-"
    v = rec[key]
    return f"{v:,}" if kind == "d" else f"{v:.2f}"


def comms_table(stage: int, mz: dict | None, ds: dict | None) -> str:
    """One stage's comms summaries side by side, rank 0, DeepSpeed's columns for each library."""
    lines = ["| op | message size | count mz | count DS | avg latency ms mz | avg latency ms DS | busbw Gbps mz | "
             "busbw Gbps DS | why it differs |", "|" + "---|" * 9]
    from minizero.observe.comms_logger import convert_size
    for op, size, a, b in comms_rows(mz, ds):
        why = comms_reason(stage, op, size, a, b)
        lines.append("| " + " | ".join([op, convert_size(size), _comms_cell(a, "count", "d"), _comms_cell(b, "count", "d"),
                                        _comms_cell(a, "avg_latency_ms"), _comms_cell(b, "avg_latency_ms"),
                                        _comms_cell(a, "busbw_avg_gbps"), _comms_cell(b, "busbw_avg_gbps"),
                                        why or "same op, size and count"]) + " |")
    return "\n".join(lines)


def comms_section(results) -> list:
    """report.md's collectives section: per stage, both comms summaries side by side."""
    if not any(r[lib].get("comms_summary") is not None for r in results.values() for lib in LIBS):
        return []
    out = ["## Collectives: DeepSpeed's comms summary beside minizero's", "",
           "Each library's comms logger (the `comms_logger` config section; DeepSpeed's `deepspeed.comm."
           "log_summary()`, minizero's own table from its timings, with DeepSpeed's formulas), rank 0, the whole run "
           "(init and evaluation included, sampling not). Latencies and bandwidths are timings and never agree "
           "between two runs; a row differs when its op, message size or count does, and each such row says why. "
           "Message size is the logged tensor's: all_gather's input shard, reduce_scatter's whole input. Each "
           "run's own table is in its folder (comms_summary.txt).", ""]
    for stage in sorted(results):
        out += [f"### ZeRO-{stage}", "", comms_table(stage, results[stage]["minizero"].get("comms_summary"),
                                                   results[stage]["deepspeed"].get("comms_summary")), ""]
    return out
