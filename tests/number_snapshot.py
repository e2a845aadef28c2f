"""Fingerprint every number minizero produces, to check that a refactor changes none of them.

    python -m tests.number_snapshot OUT.json          # before the change (e.g. on a worktree)
    python -m tests.number_snapshot OUT2.json         # after
    python -m tests.number_snapshot --compare OUT.json OUT2.json

Not a test: the numbers are bitwise only on one machine (another CPU rounds differently),
so the two snapshots must come from the same machine. It records, per run and rank: each
micro-step's loss and each step's grad norm (as hex floats), loss scale, skipped steps,
memory_breakdown, comm_stats, the ledger per label, and hashes of the full fp32 state and
of every optimizer-state tensor. Runs: a matrix of engine configurations on gloo ranks
(stages 0-3 x fp32/bf16/fp16 x gradient accumulation 1/2, clipping off, fp16 overflows,
activation checkpointing, a model with unused parameters, small ZeRO-2 buckets, ZeRO-3
persistence thresholds, prefetch and live limits, an evaluation forward, overlap_comm, offload
to host memory and to NVMe files, world sizes 1/2/4), plus every minizero run of the agreement tests
(tests/support/agreement.py ALL_MZ_KEYS).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

from tests.support.harness import PatternBatches, checkpoint_blocks, make_model
from tests.support.launcher import run_ranks

STEPS, GLOBAL_BATCH, SEQ = 6, 8, 16
# The agreement configurations run here at the length snapshots have always used; the tests'
# cache trains them for fewer steps (tests/support/agreement.py STEPS), and a snapshot must stay
# comparable with one made before that changed.
AGREEMENT_STEPS = 20


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def cases() -> list[dict]:
    out = []
    for st in range(4):
        for dt in ("fp32", "bf16", "fp16"):
            for gas in (1, 2):
                out.append(dict(stage=st, dtype=dt, gas=gas, world=2))
        out.append(dict(stage=st, dtype="bf16", gas=1, world=2, ckpt=True))
        out.append(dict(stage=st, dtype="fp16", gas=1, world=2, fp16=dict(initial_scale_power=30)))   # overflows
        out.append(dict(stage=st, dtype="fp32", gas=1, world=2, clip=0.0))
        out.append(dict(stage=st, dtype="bf16", gas=1, world=4))
        out.append(dict(stage=st, dtype="fp16", gas=2, world=1))
    out.append(dict(stage=2, dtype="bf16", gas=2, world=2, zero=dict(reduce_bucket_size=3000)))
    out.append(dict(stage=3, dtype="bf16", gas=2, world=2, zero=dict(stage3_param_persistence_threshold=0)))
    out.append(dict(stage=3, dtype="fp16", gas=1, world=2, zero=dict(stage3_param_persistence_threshold=10**9)))
    out.append(dict(stage=3, dtype="bf16", gas=1, world=2, ckpt=True, plain=True))
    # when data moves: overlap at stages 0/1, the paper's on-demand ZeRO-3, a tight live limit,
    # and an evaluation forward between steps (the prefetcher's reset)
    for st in (0, 1):
        out.append(dict(stage=st, dtype="bf16", gas=2, world=2, zero=dict(overlap_comm=True)))
    out.append(dict(stage=3, dtype="bf16", gas=2, world=2, zero=dict(
        stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)))
    out.append(dict(stage=3, dtype="fp32", gas=2, world=2, evaluate=True, zero=dict(
        stage3_param_persistence_threshold=0, stage3_max_live_parameters=30000)))
    # where shards live: host memory and NVMe files
    for st in (1, 2, 3):
        for dt in ("fp32", "bf16"):
            out.append(dict(stage=st, dtype=dt, gas=2, world=2, zero=dict(offload_optimizer={"device": "cpu"})))
    for dt in ("fp32", "bf16"):
        out.append(dict(stage=3, dtype=dt, gas=2, world=2, zero=dict(
            stage3_param_persistence_threshold=0, offload_param={"device": "cpu"})))
        out.append(dict(stage=3, dtype=dt, gas=2, world=2, zero=dict(
            stage3_param_persistence_threshold=0, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})))
    out.append(dict(stage=3, dtype="bf16", gas=2, world=2, nvme=True, zero=dict(
        stage3_param_persistence_threshold=0, offload_param={"device": "nvme"}, offload_optimizer={"device": "nvme"})))
    out.append(dict(stage=2, dtype="fp32", gas=1, world=2, nvme=True, zero=dict(offload_optimizer={"device": "nvme"})))
    return out


def _with_nvme_paths(zero: dict, folder: str) -> dict:
    """The case's offload sections, with their nvme_path under `folder`."""
    return {k: dict(v, nvme_path=folder) if isinstance(v, dict) and v.get("device") == "nvme" else v
            for k, v in zero.items()}


def _run_case(c: dict, rank: int, world: int) -> dict:
    import minizero
    from minizero import comm

    torch.manual_seed(0)
    model = make_model("micro", "gpt" if c.get("plain") else "unused", embd_pdrop=0.0, resid_pdrop=0.0,
                       attn_pdrop=0.0)
    mb = GLOBAL_BATCH // c["gas"] // world
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": c["gas"],
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
           "gradient_clipping": c.get("clip", 1.0), "zero_optimization": {"stage": c["stage"], **c.get("zero", {})}}
    if c.get("nvme"):
        import tempfile
        cfg["zero_optimization"] = _with_nvme_paths(cfg["zero_optimization"], tempfile.mkdtemp(prefix="snap_nvme_"))
    if c["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if c["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, **c.get("fp16", {})}
    if c.get("ckpt"):
        cfg["activation_checkpointing"] = {"partition_activations": False}
    labels0 = {k: dict(v) for k, v in comm.ledger.by_label.items()}
    engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1), config=cfg)
    checkpoint_blocks(model, cfg)
    vocab = (model.gpt if hasattr(model, "gpt") else model).tok_emb.num_embeddings
    batches = PatternBatches(vocab, SEQ, GLOBAL_BATCH, c["gas"])
    rec = {"steps": []}
    for step in range(STEPS):
        if hasattr(model, "use_side"):
            model.use_side = step % 2 == 0   # unused on odd steps: missing gradients must count as zero
        x, y = batches.step_batch(step)
        losses = []
        for m in range(c["gas"]):
            lo = m * (GLOBAL_BATCH // c["gas"]) + rank * mb
            _, loss = engine(x[lo:lo + mb], y[lo:lo + mb])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()).hex())
        if c.get("evaluate"):   # a forward without backward between steps
            engine.eval()
            with torch.no_grad():
                _, eval_loss = engine(x[:mb], y[:mb])
            engine.train()
            losses.append(float(eval_loss).hex())
        norm = engine.get_global_grad_norm()
        rec["steps"].append(dict(loss=losses, norm=None if norm is None else float(norm).hex(),
                                 scale=engine.loss_scale, skipped=engine.skipped_steps))
    rec["memory"] = engine.memory_breakdown()
    rec["comm"] = engine.comm_stats()
    rec["labels"] = {k: {kk: v[kk] - labels0.get(k, {}).get(kk, 0) for kk in v}
                     for k, v in comm.ledger.by_label.items() if v != labels0.get(k)}
    rec["fp32"] = {k: _hash(v) for k, v in sorted(engine.full_fp32_state_dict().items())}
    with engine._states_in_memory():   # "device": "nvme": the states are in their files between steps
        rec["optimizer"] = [_hash(t) for st in engine.optimizer.state.values() for _, t in sorted(st.items())
                            if torch.is_tensor(t)]
    return rec


def _selected(only: str | None) -> list[dict]:
    return [c for c in cases() if only is None or only in json.dumps(c, sort_keys=True)]


def _run_world(world: int, only: str | None = None) -> dict:
    from minizero import comm
    rank = comm.get_rank()
    return {json.dumps(c, sort_keys=True): _run_case(c, rank, world) for c in _selected(only) if c["world"] == world}


def _plain(v):
    if isinstance(v, float):
        return v.hex()
    if torch.is_tensor(v):
        return _hash(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def snapshot(only: str | None = None) -> dict:
    out = {}
    for world in sorted({c["world"] for c in _selected(only)}):
        for rank, runs in enumerate(run_ranks(_run_world, world_size=world, args=(world, only), timeout=900)):
            for key, rec in runs.items():
                out[f"engine {key} rank {rank}"] = rec
    if only is not None:   # a quick look at some engine runs: the agreement runs are left out
        return out
    import tests.support.agreement as A
    A.STEPS = AGREEMENT_STEPS      # this process trains its own runs: the tests' cache is not shared
    A.prefetch_mz(A.ALL_MZ_KEYS)
    for k in A.ALL_MZ_KEYS:
        for rank, res in enumerate(A.cached_mz(*k)):
            keep = {kk: vv for kk, vv in res.items() if kk not in ("init_seconds", "step_seconds", "config")}
            out[f"agreement {k!r} rank {rank}"] = _plain(keep)
    return out


def added_keys(old, new, path: str = "") -> list[str]:
    """Where `new` holds a key `old` lacks (a measurement added since), as dotted paths."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return []
    out = [f"{path}{k}" for k in new if k not in old]
    for k in old:
        if k in new:
            out += added_keys(old[k], new[k], f"{path}{k}.")
    return out


def without(new, old):
    """`new` with the keys `old` lacks left out: what the two snapshots have in common."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {k: without(v, old[k]) for k, v in new.items() if k in old}


def compare(a: dict, b: dict) -> tuple[list[str], dict]:
    """The fields that differ (a run-rank only in one snapshot counts), and what the second adds:
    {dotted key: run-ranks}, a new measurement beside the old numbers, which is no difference."""
    diffs = [f"only in {'first' if k in a else 'second'}: {k}" for k in sorted(set(a) ^ set(b))]
    added: dict = {}
    for k in sorted(set(a) & set(b)):
        for key in added_keys(a[k], b[k]):
            added[key] = added.get(key, 0) + 1
        common = without(b[k], a[k])
        for field in sorted(set(a[k]) | set(common)):
            if a[k].get(field) != common.get(field):
                diffs.append(f"{k}: {field} differs")
    return diffs, added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.number_snapshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="write the snapshot here (JSON)")
    ap.add_argument("--only", metavar="TEXT", help="only the engine cases whose JSON contains TEXT "
                    "(e.g. '\"nvme\": true'), no agreement runs: a quick check while working")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two snapshots; exit 1 if any differs")
    args = ap.parse_args(argv)
    if args.compare:
        for p in args.compare:
            if not os.path.isfile(p):
                ap.error(f"{p}: no such file (make it with: python -m tests.number_snapshot {p})")
        a, b = (json.load(open(p)) for p in args.compare)
        diffs, added = compare(a, b)
        adds = "; the second adds " + ", ".join(f"{k} ({n} run-ranks)" for k, n in sorted(added.items())) if added else ""
        print("\n".join(diffs[:50]) or f"identical: {len(a)} run-ranks{adds}")
        return 1 if diffs else 0
    if not args.out:
        ap.error("give OUT.json, or --compare A B")
    snap = snapshot(args.only)
    with open(args.out, "w") as fh:
        json.dump(snap, fh, indent=0, sort_keys=True)
    print(f"wrote {len(snap)} run-ranks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
