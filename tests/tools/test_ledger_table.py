"""The collectives table a traced run prints (minizero/observe/ledger_table.py).

Its rows come from rank 0's events, its totals from the ledger; a trace whose events do not
add up to the ledger says so under the table. That a real traced run prints it, with totals
equal to its rank0.json's ledger, is checked on the lesson's own runs
(tests/tools/test_lesson_numbers.py, test_each_traced_run_prints_its_collectives_table).
"""
from __future__ import annotations

import json

from minizero.observe import ledger_table


def _doc(extra_event=False):
    def ev(op, label, nbytes, wire, cat="collectives"):
        return {"ph": "X", "cat": cat, "name": f"{op} {label}", "ts": 0, "dur": 1,
                "args": {"op": op, "label": label, "bytes": nbytes, "wire_bytes": wire, "step": 2}}
    events = [ev("all_gather", "blocks.0.g0.fwd", 100, 50), ev("reduce_scatter", "blocks.0.g0.grads", 100, 50),
              ev("all_gather", "blocks.0.g0.bwd", 100, 50), ev("all_reduce", "grad_norm", 8, 8),
              ev("h2d", "blocks.0.g0", 40, 40, cat="copies")]
    if extra_event:
        events.append(ev("all_gather", "blocks.0.g0.bwd", 100, 50))
    ledger = {"all_gather": {"calls": 2, "bytes": 200, "wire_bytes": 100},
              "reduce_scatter": {"calls": 1, "bytes": 100, "wire_bytes": 50},
              "all_reduce": {"calls": 1, "bytes": 8, "wire_bytes": 8}, "broadcast": {"calls": 0, "bytes": 0, "wire_bytes": 0},
              "d2h": {"calls": 0, "bytes": 0, "wire_bytes": 0}, "h2d": {"calls": 1, "bytes": 40, "wire_bytes": 40}}
    return {"traceEvents": events, "otherData": {"stage": 3, "world_size": 2, "ledger": {"2": ledger}}}


def test_rows_by_label_then_the_ledgers_total_per_op():
    lines = ledger_table.format_table(_doc()).splitlines()
    assert lines[0] == "collectives of step 2 on rank 0 of 2, stage 3:"
    body = [ln.split() for ln in lines[2:]]
    assert body == [["all_gather", "blocks.0.g0.fwd", "1", "100", "50"],
                    ["all_gather", "blocks.0.g0.bwd", "1", "100", "50"],
                    ["all_gather", "(total)", "2", "200", "100"],
                    ["reduce_scatter", "blocks.0.g0.grads", "1", "100", "50"],
                    ["reduce_scatter", "(total)", "1", "100", "50"],
                    ["all_reduce", "grad_norm", "1", "8", "8"],
                    ["all_reduce", "(total)", "1", "8", "8"],
                    ["h2d", "blocks.0.g0", "1", "40", "40"],
                    ["h2d", "(total)", "1", "40", "40"]]


def test_events_that_do_not_add_up_to_the_ledger_are_named():
    text = ledger_table.format_table(_doc(extra_event=True))
    assert "all_gather      blocks.0.g0.bwd              2" in text
    assert text.splitlines()[-1].strip().startswith("(the events of all_gather do not add up")


def test_the_command_reads_a_trace_folder_and_refuses_one_without_in_one_line(tmp_path, capsys):
    (tmp_path / "rank0.json").write_text(json.dumps(_doc()))
    assert ledger_table.main([str(tmp_path)]) == 0
    assert "all_gather      (total)                      2             200           100" in capsys.readouterr().out
    assert ledger_table.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no readable rank0.json" in err[0] and "--trace" in err[0]
