"""The ledger: calls, payload bytes and ring wire bytes of every collective and copy minizero
issues, per op and per label, since start (or reset). comm.py's wrappers record into it (comm._issue,
the one choke point every collective and copy goes through); engine.comm_stats() reads it; what the
two byte counts mean is comm.py's docstring.
"""
from __future__ import annotations

from collections import defaultdict

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
COPIES = ("d2h", "h2d")   # offload's copies between this rank's device and host memory (offload/host.py)


class CommLedger:
    """Calls, payload bytes and ring wire bytes per collective, since start (or reset)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.stats = {op: {"calls": 0, "bytes": 0, "wire_bytes": 0, "inter_node_bytes": 0} for op in OPS + COPIES}
        self.by_label: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def record(self, op: str, nbytes: int, wire_bytes: int, label: str | None, inter_node: bool = False) -> None:
        if op not in self.stats:   # NVMe swaps (offload/nvme.py): listed from their first, so runs without show none
            self.stats[op] = {"calls": 0, "bytes": 0, "wire_bytes": 0, "inter_node_bytes": 0}
        s = self.stats[op]
        s["calls"] += 1
        s["bytes"] += int(nbytes)
        s["wire_bytes"] += int(wire_bytes)
        if inter_node:
            s["inter_node_bytes"] += int(wire_bytes)
        if label:
            b = self.by_label[f"{op}:{label}"]
            b["calls"] += 1
            b["bytes"] += int(nbytes)

    def snapshot(self) -> dict:
        return {op: dict(v) for op, v in self.stats.items()}


ledger = CommLedger()
