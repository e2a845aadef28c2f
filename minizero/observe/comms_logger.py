"""DeepSpeed's comms logger, from minizero's own timings: latency and bandwidth per collective.

DeepSpeed users turn on a `comms_logger` config section and call
`deepspeed.comm.log_summary()`; it prints, per op and message size, the count, the total and
average latency and two bandwidths. minizero accepts the same section with the same keys and
prints the same table (`minizero.comm_log_summary()`, or `log_summary()` here), so a
side-by-side run can be read row by row. `python -m minizero.train` writes it to
comms_summary.txt (and the numbers to comms_summary.json) in the run folder.

The keys mean what they mean in DeepSpeed (deepspeed/comm/comm.py, utils/comms_logging.py):

    enabled   time every collective (DeepSpeed: the section being present is enough, even
              with "enabled": false; minizero reads the key: docs/deepspeed.md,
              "comms_logger is on whenever the section is present")
    prof_all  log every op (default true); otherwise only the ops named in
    prof_ops  e.g. ["all_reduce"]  (op names as DeepSpeed's: OP_NAMES below)
    verbose   also print one line per op as it happens (rank 0)
    debug     add the caller to the op name: DeepSpeed the calling function, minizero the
              FlatParam or bucket label ("all_gather_into_tensor | [Caller Func: blocks.3.g0.fwd]")

Latency: host wall time from the call to its end; on a GPU the device is synchronized
after each op first (DeepSpeed does the same: an asynchronous op's call returns before it ran).
That sync is why the logger is a measurement switch, not something to leave on.

Bandwidths, as DeepSpeed's calc_bw_log (from nccl-tests' PERFORMANCE.md), in Gbps (1e9 bit/s),
with S the logged message size, t the latency and N the world size:

    all_gather_into_tensor, reduce_scatter_tensor:  algbw = N*S/t, busbw = algbw*(N-1)/N
    all_reduce:                                     algbw = 2*S/t, busbw = (S/t)*2(N-1)/N
    broadcast:                                      algbw = busbw = S/t

S is the tensor DeepSpeed's wrapper reads: the input, which is the shard for all_gather but
the whole N-shard buffer for reduce_scatter, so reduce_scatter's algbw and busbw come out N
times what moved (docs/deepspeed.md, "comms_logger counts reduce_scatter's input N times").
We print DeepSpeed's numbers so the two tables compare; comm_stats() has the true bytes.
The averages are DeepSpeed's trim_mean (drop 10% at each end), the totals plain sums.
"""
from __future__ import annotations

import math
import sys
import time

import torch

from .. import comm

# minizero's op -> the name DeepSpeed's logger gives the same collective
OP_NAMES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
            "all_reduce": "all_reduce", "broadcast": "broadcast"}

HEADER = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
          "busbw_avg (Gbps)")


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's human size: powers of 1024, two decimals ("1.5 MB")."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def calc_bw(op_name: str, size: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps, DeepSpeed's formulas (module docstring); latency in ms."""
    n, duration = world_size, latency_ms
    if op_name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        algbw = size * n / duration
        busbw = algbw * ((n - 1) / n)
    elif op_name == "all_reduce":
        algbw = size * 2 / duration
        busbw = (size / duration) * (2 * (n - 1) / n)
    elif op_name == "broadcast":
        algbw = busbw = size / duration
    else:
        raise ValueError(f"comms_logger: no bandwidth formula for {op_name!r}")
    # bytes/ms -> Gbit/s: *8 bits, *1e3 ms/s, /1e9  ==  *8 / 1e6 (DeepSpeed's order of operations)
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(data: list[float], trim_percent: float = 0.1) -> float:
    """DeepSpeed's trim_mean: sort, drop round(n*trim) values at each end, average the rest."""
    n = len(data)
    if n == 0:
        return 0
    data = sorted(data)
    k = int(round(n * trim_percent))
    kept = data[k:n - k]
    return sum(kept) / len(kept)


current: "CommsLogger | None" = None   # this process's logger, while an engine's config enables it


def start(engine) -> None:
    """DeepSpeed's comms logger when the engine's config enables it: every collective timed,
    the table printed by comm.log_summary(). One per process, as DeepSpeed's: the newest
    engine's config decides. Called as the engine starts, before the weights' broadcast,
    which DeepSpeed's logger times too."""
    global current
    if current in comm.observers:
        comm.unsubscribe(current)
    current = None
    if engine.config.comms_logger.enabled:
        current = CommsLogger(engine.config.comms_logger, engine.world_size, engine.global_rank, engine.device)
        comm.subscribe(current)


class CommsLogger:
    """A comm.py observer: one record per (op name, message size): count and the latencies."""

    def __init__(self, section, world_size: int, rank: int, device: torch.device):
        self.prof_all, self.prof_ops = section.prof_all, list(section.prof_ops)
        self.verbose, self.debug = section.verbose, section.debug
        self.world_size, self.rank, self.device = world_size, rank, device
        self.records: dict[str, dict[int, list]] = {}   # name -> {msg bytes: [count, [ms], [algbw], [busbw]]}

    def _name(self, op: str, label: str | None) -> str | None:
        name = OP_NAMES.get(op)   # offload's d2h/h2d copies are not collectives: DeepSpeed does not log them
        if name is None or not (self.prof_all or name in self.prof_ops):
            return None
        return f"{name} | [Caller Func: {label}]" if self.debug and label else name

    # ---------------------------------------------------------------- comm.py's observer hook
    def begin(self, op: str, label: str | None, tensor, nbytes: int, group):
        if self._name(op, label) is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # time this op, not the work queued before it
        return time.perf_counter()

    def blocking(self, token) -> None:
        """An asynchronous op's wait begins: its latency still runs from the call to its end."""

    def end(self, token, op: str, label: str | None, nbytes: int, wire_bytes: int, msg_bytes: int) -> None:
        if token is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        latency_ms = (time.perf_counter() - token) * 1e3
        name = self._name(op, label)
        algbw, busbw = calc_bw(OP_NAMES[op], msg_bytes, max(latency_ms, 1e-9), self.world_size)
        rec = self.records.setdefault(name, {}).setdefault(msg_bytes, [0, [], [], []])
        rec[0] += 1
        rec[1].append(latency_ms)
        rec[2].append(algbw)
        rec[3].append(busbw)
        if self.verbose and self.rank == 0:
            print(f"comm op: {name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_bytes)} | "
                  f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", file=sys.stderr)

    # ---------------------------------------------------------------- the summary
    def summary(self) -> dict:
        """{op name: {msg bytes: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps,
        busbw_avg_gbps, msg_size_bytes, msg_size_str}}}: the "summary" part of DeepSpeed's
        log_summary(return_dict=True), for this rank."""
        out = {}
        for name, sizes in self.records.items():
            out[name] = {size: {"count": c, "total_latency_ms": sum(lat), "avg_latency_ms": trim_mean(lat),
                                "tput_avg_gbps": trim_mean(alg), "busbw_avg_gbps": trim_mean(bus),
                                "msg_size_bytes": size, "msg_size_str": convert_size(size)}
                         for size, (c, lat, alg, bus) in sorted(sizes.items())}
        return out

    def table(self) -> str:
        return format_table(self.summary())

    def log_summary(self, show_straggler: bool = False, return_dict: bool = False):
        """comm.log_summary (deepspeed.comm.log_summary): rank 0 prints the table; with
        return_dict, every rank gets {"summary", "straggler_analysis", "metadata"} as DeepSpeed
        returns it. A collective when show_straggler is set."""
        summary = self.summary()
        straggler = self.straggler() if show_straggler else None
        if self.rank == 0:
            print(format_table(summary))
            if straggler is not None:
                print(format_straggler_table(straggler))
        if return_dict:
            return {"summary": summary, "straggler_analysis": straggler,
                    "metadata": {"world_size": self.world_size, "rank": self.rank}}
        return None

    def straggler(self) -> dict:
        """DeepSpeed's show_straggler breakdown: per op and size, the latencies' MIN over ranks
        (the time the collective itself took) and what this rank spent beyond it (waiting for
        the slowest rank). A collective: every rank must have logged the same ops."""
        import torch.distributed as dist
        out = {}
        for name, sizes in self.records.items():
            out[name] = {}
            for size, (count, lat, _, _) in sorted(sizes.items()):
                lats = torch.tensor(lat, dtype=torch.float64, device=self.device)
                mins = lats.clone()
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
                strag = (lats - mins).tolist()
                out[name][size] = {"count": count, "total_comm_lat_ms": mins.sum().item(),
                                   "total_straggler_ms": sum(strag), "avg_comm_lat_ms": trim_mean(mins.tolist()),
                                   "avg_straggler_ms": trim_mean(strag), "msg_size_bytes": size,
                                   "msg_size_str": convert_size(size)}
        return out


def _table(head: tuple, data: dict, columns: tuple) -> list[str]:
    """DeepSpeed's layout: 20-character columns, one line per op name, then one line per
    message size under it (size, count, then `columns` of each record, two decimals)."""
    lines = ["".join(f"{h: <20}" for h in head)]
    for name, sizes in data.items():
        lines.append(name)
        for size, r in sorted(sizes.items(), key=lambda kv: int(kv[0])):
            lines.append(f"{' ': <20}{convert_size(int(size)): <20}{r['count']: <20}"
                         + "".join(f"{r[c]: <20.2f}" for c in columns))
    return lines


def format_straggler_table(straggler: dict) -> str:
    """DeepSpeed's "Breakdown with straggler effect" table."""
    head = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)", "Avg comm lat(ms)",
            "Avg straggler(ms)")
    return "\n".join(["_______________________________", "Breakdown with straggler effect",
                      "-------------------------------"]
                     + _table(head, straggler, ("total_comm_lat_ms", "total_straggler_ms", "avg_comm_lat_ms",
                                                "avg_straggler_ms")))


def format_table(summary: dict) -> str:
    """The table DeepSpeed's log_summary prints."""
    return "\n".join(_table(HEADER, summary, ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps")))
