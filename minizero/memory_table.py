"""`python -m minizero.memory_table --model tutorial --nproc 2 4 8 --dtype bf16 [--offload both]`

Build the real engine at every ZeRO stage on N gloo ranks (CPU is fine: nothing is
trained, only laid out) and print each rank's `engine.memory_breakdown()` next to the
ZeRO paper's formula, with the device/host split. This is where the per-stage tables in
docs/zero.md come from. `--offload optimizer` adds offload_optimizer at stages 1-3, `both`
also offload_param at stage 3 (docs/offload.md).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.multiprocessing as mp

from .comm import free_port
from .memory import human, paper_bytes, total


def offload_section(stage: int, offload: str) -> dict:
    """The zero_optimization keys `--offload` adds at this stage (stage 0 offloads nothing,
    offload_param exists at stage 3 only)."""
    out = {}
    if offload in ("optimizer", "both") and stage >= 1:
        out["offload_optimizer"] = {"device": "cpu"}
    if offload == "both" and stage == 3:
        out["offload_param"] = {"device": "cpu"}
    return out


def _rank(rank, world, port, model_name, dtype, stages, queue, offload="none"):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import minizero
    from minizero import comm
    from minizero.model import GPT, get_preset

    comm.init_distributed("gloo")
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = GPT(get_preset(model_name))
        psi = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties the parameters
        cfg = {"train_micro_batch_size_per_gpu": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                     **offload_section(stage, offload)}}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1),
                                         config=cfg)
        out[stage] = (engine.memory_breakdown(), psi)
        del engine, model
    queue.put((rank, out))
    comm.destroy()


def measure(model_name: str, world: int, dtype: str, stages=(0, 1, 2, 3), offload: str = "none") -> dict:
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_name, dtype, list(stages), q, offload))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minizero.memory_table", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--offload", default="none", choices=["none", "optimizer", "both"],
                    help="offload_optimizer at stages 1-3; both: also offload_param at stage 3")
    args = ap.parse_args(argv)
    print(f"model={args.model} dtype={args.dtype} offload={args.offload}; bytes per rank "
          f"(rank 0; max over ranks if different)\n")
    print("| N | stage | params | grads | master | optimizer | total | on device | on host | paper formula | "
          "total (human) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.nproc:
        res = measure(args.model, n, args.dtype, offload=args.offload)
        for stage in (0, 1, 2, 3):
            b0, psi = res[0][stage]
            tmax = max(total(res[r][stage][0]) for r in res)
            paper = total(paper_bytes(psi, n, stage, mixed=args.dtype != "fp32"))
            t0 = total(b0)
            tot = f"{t0:,}" + (f" (max {tmax:,})" if tmax != t0 else "")
            print(f"| {n} | {stage} | {b0['params']:,} | {b0['grads']:,} | {b0['master_params']:,} | "
                  f"{b0['optimizer_states']:,} | {tot} | {total(b0['device']):,} | {total(b0['host']):,} | "
                  f"{paper:,.0f} | {human(t0)} |")


if __name__ == "__main__":
    main()
