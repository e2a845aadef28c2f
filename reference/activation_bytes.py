"""Activation bytes held for backward per sample, minizero vs DeepSpeed checkpointing.

    DS_ACCELERATOR=cpu python -m reference.activation_bytes            # tutorial + igpt-s
    DS_ACCELERATOR=cpu python -m reference.activation_bytes --presets tiny --batch 2

Counts, for one forward of the GPT in training mode (dropout on), the distinct storages
autograd keeps for backward, parameters excluded (they live anyway), via
`torch.autograd.graph.saved_tensors_hooks` (minizero.observe.saved_bytes.count_saved_bytes).

DeepSpeed's `CheckpointFunction.forward` keeps the block inputs as
`ctx.deepspeed_saved_tensors`, an attribute, not through `ctx.save_for_backward`, so the
hooks never see them (deepspeed/runtime/activation_checkpointing/checkpointing.py). We
wrap that forward and add the tensors it leaves on ctx to the same deduplicating counter;
the table shows DeepSpeed both ways so the difference is visible.

This file imports DeepSpeed; minizero itself never does.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from minizero.checkpointing import checkpoint as mz_checkpoint  # noqa: E402
from minizero.observe.saved_bytes import count_saved_bytes  # noqa: E402
from minizero.gpt.model import GPT, get_preset  # noqa: E402


def ds_init_single_process() -> None:
    """deepspeed.checkpointing.configure calls dist.get_rank(), so it needs a process group:
    a 1-rank gloo group on a free port, unless one is already up."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing group
        return
    from minizero.comm import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo")


@contextlib.contextmanager
def ds_ctx_inputs_counted(counter):
    """Make DeepSpeed's checkpoint add what it stores on ctx to `counter` (a SavedBytes)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as dsc

    original = dsc.CheckpointFunction.forward

    def forward(ctx, run_function, all_outputs, *args):
        out = original(ctx, run_function, all_outputs, *args)
        for t in ctx.deepspeed_saved_tensors:
            # partition_activations / cpu_checkpointing empty the tensor and park the data
            # in t.saved_data until backward
            counter.add(t.saved_data if getattr(t, "saved_data", None) is not None else t)
        return out

    dsc.CheckpointFunction.forward = staticmethod(forward)
    try:
        yield
    finally:
        dsc.CheckpointFunction.forward = staticmethod(original)


def saved_bytes(model, idx, targets, mode: str) -> int:
    """mode: 'none' | 'minizero' | 'ds_hooks' (what saved_tensors_hooks see) | 'ds' (+ ctx inputs)."""
    m = copy.deepcopy(model).train()
    if mode == "none":
        m.checkpoint_fn = None
    elif mode == "minizero":
        m.checkpoint_fn = mz_checkpoint
    else:
        import deepspeed

        m.checkpoint_fn = deepspeed.checkpointing.checkpoint
    torch.manual_seed(0)
    with count_saved_bytes(exclude=m.parameters()) as c:
        with ds_ctx_inputs_counted(c) if mode == "ds" else contextlib.nullcontext():
            _, loss = m(idx, targets)
    del loss
    return c.bytes


def measure(preset: str, batch: int = 1) -> dict:
    cfg = get_preset(preset)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    row = {"preset": preset, "layers": cfg.n_layer, "width": cfg.n_embd, "tokens": cfg.block_size}
    for mode in ("none", "minizero", "ds_hooks", "ds"):
        row[mode] = saved_bytes(model, idx, targets, mode) / batch
    # fp32 block inputs, one per block: what checkpointing keeps of each block
    row["block_inputs"] = cfg.n_layer * cfg.block_size * cfg.n_embd * 4
    return row


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def table(rows) -> str:
    out = ["| model | no checkpointing | minizero checkpoint | DeepSpeed checkpoint (saved_tensors_hooks only) "
           "| DeepSpeed checkpoint (+ inputs on ctx) | of which block inputs (L·T·C·4) | reduction |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['preset']} ({r['layers']}L, {r['width']} wide, {r['tokens']} tokens) | {_mib(r['none'])} "
                   f"| {_mib(r['minizero'])} | {_mib(r['ds_hooks'])} | {_mib(r['ds'])} | {_mib(r['block_inputs'])} "
                   f"| {r['none'] / r['minizero']:.1f}x |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tutorial", "igpt-s"])
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    import deepspeed
    import torch.distributed as dist

    ds_init_single_process()
    deepspeed.checkpointing.configure(None, deepspeed_config={"train_batch_size": args.batch,
                                                              "activation_checkpointing": {}})
    rows = [measure(p, args.batch) for p in args.presets]
    print(f"Activation bytes held for backward per sample (batch {args.batch}, fp32, train mode, "
          f"parameters excluded), torch {torch.__version__}, deepspeed {deepspeed.__version__}\n")
    print(table(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
