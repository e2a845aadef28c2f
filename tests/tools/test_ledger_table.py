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


def _rank_doc(rank, world=4, per_node=2):
    """Rank `rank` of a 2 x 2 run's step 2: one all-gather over all four ranks (40 wire bytes),
    which crosses to the next node from each node's last rank only (ranks 1 and 3)."""
    inter = 40 if rank % per_node == per_node - 1 else 0
    event = {"ph": "X", "cat": "collectives", "name": "all_gather u.g0.fwd", "ts": 0, "dur": 1,
             "args": {"op": "all_gather", "label": "u.g0.fwd", "bytes": 80, "wire_bytes": 40,
                      "inter_node_bytes": inter, "step": 2}}
    ledger = {"all_gather": {"calls": 1, "bytes": 80, "wire_bytes": 40, "inter_node_bytes": inter}}
    return {"traceEvents": [event], "otherData": {"stage": 3, "world_size": world, "ranks_per_node": per_node,
                                                  "ledger": {"2": ledger}}}


def test_on_two_nodes_each_row_has_its_inter_node_bytes_and_each_link_its_total(tmp_path, capsys):
    for rank in range(4):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_rank_doc(rank)))
    assert ledger_table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("collectives of step 2 on rank 0 of 4 (2 nodes of 2 ranks), stage 3")
    assert lines[1].split()[-1] == "inter-node"
    assert [ln.split() for ln in lines[2:4]] == [["all_gather", "u.g0.fwd", "1", "80", "40", "0"],
                                                 ["all_gather", "(total)", "1", "80", "40", "0"]]
    assert lines[4].strip() == "bytes each node sent to the next in step 2 (every rank's ledger): node 0 -> 1: 40, node 1 -> 0: 40"
    # one node: the table of before, no column and no line
    (tmp_path / "rank0.json").write_text(json.dumps(_rank_doc(0, world=4, per_node=4)))
    text = ledger_table.format_table(ledger_table.read(str(tmp_path)))
    assert "inter-node" not in text and ledger_table.format_links(str(tmp_path), ledger_table.read(str(tmp_path))) == ""


def test_a_rank_file_missing_on_two_nodes_is_said(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(_rank_doc(0)))
    said = ledger_table.format_links(str(tmp_path), ledger_table.read(str(tmp_path)))
    assert "rank1.json is not in" in said
