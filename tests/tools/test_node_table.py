"""`python -m minizero.memory_table --nodes M --ranks-per-node L` (minizero/observe/node_table.py):
ZeRO-3, hpZ and HSDP per rank and per link between nodes, by the papers' formulas and exactly
from the layout.

- A hand computation: two FlatParams of 10 and 7 elements on 2 nodes x 2 ranks, bf16, every
  byte worked out below; and the formulas at Ψ = 1000.
- A real run: the micro GPT on 4 gloo ranks pretending to be 2 nodes x 2
  (MINIZERO_RANKS_PER_NODE=2), two steps of each scheme: each rank's
  engine.memory_breakdown() is the table's model states, the second step's ledger
  (engine.comm_stats()) is its wire bytes per rank, and the inter-node bytes of node 0's two
  ranks add up to its bytes per link; the printed table carries those numbers.

Cost: one launch of 4 ranks (three engines of the micro GPT, two steps each), 5-10 s on 2
shared cores; the rest computes in this process.
"""
import contextlib
import io

import pytest

from minizero.observe.node_costs import paper_costs
from minizero.observe import memory_table, node_table
from tests.support.launcher import run_ranks

PER_NODE, NODES = 2, 2
ZERO = {"zero3": {}, "hpz": {"zero_hpz_partition_size": PER_NODE}, "hsdp": {"hsdp_shard_size": PER_NODE}}


def test_a_hand_computation_at_2_x_2():
    """FlatParams of 10 and 7 elements, N = 4, bf16 (2 bytes), k = S = 2.

    ZeRO-3: padded to 4: 12 + 8 = 20 elements, 40 bytes gathered. States per rank: 20/4 = 5
    elements x (2 + 2 + 4 + 8) = 80. Wire: two all-gathers 2 x 40 x 3/4 = 60, the
    reduce-scatter 30, the fp64 norm's all-reduce 2 x 8 x 3/4 = 12: 102. Ring 0-1-2-3: of node
    0's ranks only rank 1 sends across (to rank 2), all of its 102.
    hpZ: states 80 + the secondary, 20/2 elements x 2 = 20: 100. Wire: forward's all-gather over
    all 4, 30; backward's over the node (2 ranks), 40 x 1/2 = 20; reduce-scatter 30, norm 12:
    92. Across: rank 1's world-ring bytes 30 + 30 + 12 = 72 (its node ring sends to rank 0).
    HSDP: padded to 2: 10 + 8 = 18 elements, 36 bytes. States 9 x 16 = 144. Wire: two
    all-gathers 2 x 36 x 1/2 = 36, reduce-scatter 18, the shard's all-reduce across the replicas
    (9 elements, 18 bytes, 2 ranks) 2 x 18 x 1/2 = 18, the norm over the node 2 x 8 x 1/2 = 8:
    80. Across: ranks 0 and 1 each send their replica all-reduce to node 1: 2 x 18 = 36."""
    assert node_table.layout_costs([10, 7], NODES, PER_NODE, "bf16") == {
        "zero3": {"states": 80, "wire": 102, "link": 102},
        "hpz": {"states": 100, "wire": 92, "link": 72},
        "hsdp": {"states": 144, "wire": 80, "link": 36}}
    # Ψ = 1000: ZeRO-3 16Ψ/4, 3·2Ψ·3/4 twice; hpZ + 2Ψ/2, 2Ψ(2·3/4 + 1/2), 2·2Ψ·3/4;
    # HSDP 16Ψ/2, 2Ψ(3·1/2 + 2·(1/2)/2), 2·2Ψ·1/2
    paper = paper_costs(1000, NODES, PER_NODE)
    assert paper == {"zero3": {"states": 4000, "wire": 4500, "link": 4500},
                     "hpz": {"states": 5000, "wire": 4000, "link": 3000},
                     "hsdp": {"states": 8000, "wire": 4000, "link": 2000}}


def test_the_arguments_are_one_line_errors(capsys):
    for argv, needle in ((["--nodes", "2"], "together"), (["--nodes", "1", "--ranks-per-node", "4"], "at least 2"),
                         (["--nodes", "2", "8", "--ranks-per-node", "4", "8", "8"], "one per --nodes value"),
                         (["--nodes", "2", "--ranks-per-node", "4", "--world-size", "8"], "drop --world-size"),
                         (["--nodes", "2", "--ranks-per-node", "4", "--psi", "1e9", "--model", "tiny"], "not both")):
        with pytest.raises(SystemExit):
            memory_table.main(argv)
        assert needle in capsys.readouterr().err.strip().splitlines()[-1], argv


def _two_steps(scheme):
    """On each rank: the micro GPT under `scheme`, two steps; its memory_breakdown() and the
    second step's ledger {op: (wire, inter-node)}."""
    import torch

    import minizero
    from minizero import comm
    from minizero.gpt.model import GPT, get_preset
    from minizero.memory import total
    torch.manual_seed(0)
    model = GPT(get_preset("micro"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                                 "stage3_max_reuse_distance": 0, **ZERO[scheme]}}
    engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1), config=cfg)
    for step in range(2):
        before = engine.comm_stats()
        x = torch.randint(0, 62, (2, 16), generator=torch.Generator().manual_seed(comm.get_rank() * 10 + step))
        engine.backward(engine(x[:, :-1], x[:, 1:])[1])
        engine.step()
    after = engine.comm_stats()
    ledger = {op: (v["wire_bytes"] - before[op]["wire_bytes"], v["inter_node_bytes"] - before[op]["inter_node_bytes"])
              for op, v in after.items()}
    out = total(engine.memory_breakdown()), ledger
    engine.destroy()
    return out


def _every_scheme():
    return {scheme: _two_steps(scheme) for scheme in ZERO}


def test_the_table_is_a_real_runs_memory_and_ledger():
    per_rank = run_ranks(_every_scheme, NODES * PER_NODE, env={"MINIZERO_RANKS_PER_NODE": str(PER_NODE)})
    model, groups = memory_table.meta_model("micro")
    numels = [p.numel for p in memory_table.layout(model, groups, 3)]
    want = node_table.layout_costs(numels, NODES, PER_NODE, "bf16")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        memory_table.main(["--model", "micro", "--nodes", str(NODES), "--ranks-per-node", str(PER_NODE)])
    printed = out.getvalue()
    for scheme in ZERO:
        for rank, got in enumerate(per_rank):
            states, ledger = got[scheme]
            assert states == want[scheme]["states"], (scheme, rank)
            assert sum(w for w, _ in ledger.values()) == want[scheme]["wire"], (scheme, rank, ledger)
        node0 = sum(x for r in range(PER_NODE) for _, x in per_rank[r][scheme][1].values())
        assert node0 == want[scheme]["link"], scheme
        node1 = sum(x for r in range(PER_NODE, 2 * PER_NODE) for _, x in per_rank[r][scheme][1].values())
        assert node1 == node0   # the link back carries as much
        row = (f"| {NODES} x {PER_NODE} | {node_table.scheme_name(scheme, PER_NODE)} | layout | "
               + " | ".join(f"{want[scheme][q]:,}" for q in node_table.QUANTITIES) + " |")
        assert row in printed, row
    # what the node-aware forms are for: less across the link than ZeRO-3, more memory per rank
    assert want["hsdp"]["link"] < want["hpz"]["link"] < want["zero3"]["link"]
    assert want["zero3"]["states"] < want["hpz"]["states"] < want["hsdp"]["states"]


@pytest.mark.parametrize("argv", [["--model", "tutorial", "--nodes", "2", "64", "--ranks-per-node", "4", "8"],
                                  ["--psi", "7.5e9", "--nodes", "2", "64", "--ranks-per-node", "4", "8"]])
def test_docs_two_nodes_quotes_the_tables_its_commands_print(argv):
    """docs/two_nodes.md shows the command and its table, row for row (computed: no process)."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "two_nodes.md").read_text()
    assert "python -m minizero.memory_table " + " ".join(argv) in page
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        memory_table.main(argv)
    table = "\n".join(line for line in out.getvalue().splitlines() if line.startswith("|"))
    assert table in page
