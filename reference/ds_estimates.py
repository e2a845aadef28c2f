"""DeepSpeed's layout arithmetic and its memory estimators, beside minizero's exact bytes.

What the numbers reference/ds_memory.py measures on a live engine should be, from DeepSpeed
0.19.8's partitioning rules (pure functions of the parameter sizes, no engine, no DeepSpeed
import), and the estimators DeepSpeed publishes for planning
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) with the
multipliers they use, side by side with minizero's formula:

    python -m reference.ds_estimates --model tutorial --world-size 8 64 1024

  zero12_padded_numel          ZeRO-1/2's flat size: each param group padded to a multiple of 2N
  zero12_grad_partition_numel  the gradient partition a ZeRO-1/2 rank holds after backward
  zero3_partition_numel        ZeRO-3's partition: ceil(n/N) per parameter
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Tuple

import torch


def zero12_padded_numel(group_numels: Iterable[int], world_size: int) -> int:
    """ZeRO-1/2 (stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__) pads each param
    group's flat buffer to a multiple of 2*N elements (`align_dense_tensors` with
    `nccl_start_alignment_factor * dp_size`, factor 2) and splits it into N equal slices."""
    a = 2 * world_size
    return sum(int(math.ceil(n / a)) * a for n in group_numels)


def zero12_grad_partition_numel(group_param_numels: Iterable[Iterable[int]], world_size: int, rank: int) -> int:
    """ZeRO-1/2 without offload at gradient_accumulation_steps 1, after backward: the
    gradient partition (`averaged_gradients`) holds WHOLE parameters that overlap this
    rank's slice of each 2N-padded group buffer (a parameter straddling a boundary is held
    entirely by both ranks), plus the zero-padding tensor on the last rank (`_zero_padding`).
    `group_param_numels`: the parameters' numels, per param group, in order."""
    total = 0
    for g in group_param_numels:
        g = list(g)
        padded = zero12_padded_numel([sum(g)], world_size)
        lo, hi = rank * padded // world_size, (rank + 1) * padded // world_size
        off = 0
        for n in g:
            if off < hi and off + n > lo:
                total += n
            off += n
        if rank == world_size - 1:
            total += padded - sum(g)
    return total


def zero3_partition_numel(param_numels: Iterable[int], world_size: int) -> int:
    """ZeRO-3 (partition_parameters.py: _partition_param) gives each parameter
    ceil(n/N) elements on every rank, padding the last rank's slice."""
    return sum(int(math.ceil(n / world_size)) for n in param_numels)


def deepspeed_estimates(model: torch.nn.Module, world_size: int) -> Dict[str, int]:
    """DeepSpeed's own arithmetic estimators, in bytes per rank (no offload), for comparison
    with what deepspeed_model_state_bytes measures.

    stage_1_and_2.py: estimate_zero2_model_states_mem_needs -> 2Ψ + 18Ψ/N ("2 grads16 +
    4 grads32 + 4 params32 + 8 optimizer states", i.e. it assumes an fp32 gradient
    partition besides the 16-bit one; measured bf16 ZeRO-2 holds 2Ψ + 12Ψ/N + the bf16
    gradient partition instead). stage3.py: estimate_zero3_model_states_mem_needs ->
    4 * largest_layer + 18Ψ/N. (The *_all_live wrappers only print these rounded to GB,
    useless for a small model.)"""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = model_to_params(model)
    _, z2 = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world_size, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world_size, cpu_offload=False)
    return {"total_params": int(total), "largest_layer_params": int(largest), "zero2": int(z2), "zero3": int(z3)}


# ----------------------------------------------------------------------------- DeepSpeed's estimators beside minizero's exact bytes

ESTIMATOR_MULTIPLIERS = """\
DeepSpeed's estimators (stage_1_and_2.py: estimate_zero2_model_states_mem_needs, stage3.py:
estimate_zero3_model_states_mem_needs; the *_all_live wrappers take Ψ and L from the model
with model_to_params and print these numbers in GB of 2^30 bytes). Ψ = total parameters
(shared ones once), L = the largest module's own parameters (recurse=False), N = GPUs,
G = GPUs per node, n = nodes, 1.5 = additional_buffer_factor:
  ZeRO-2           per GPU 2Ψ + 18Ψ/N: 2 = the replicated 16-bit parameters; 18 = "2 grads16 +
                   4 grads32 + 4 params32 + 8 optimizer states" (its code's comment), all
                   partitioned. minizero makes that fp32 gradient shard (4Ψ/N) only inside
                   step() and drops it after (sharded_optimizer.py), so memory_breakdown(),
                   which counts what persists, gives 2Ψ + 14Ψ/N + padding.
                   per CPU 4ΨG x 1.5: each of the node's G processes holding an fp32 copy
                   of the model while it loads.
  ZeRO-2 offload   per GPU 2Ψ (the 16-bit parameters only: DeepSpeed sends each gradient
                   piece to the host); per CPU max(4ΨN, 16Ψ) x 1.5 (N, total_gpus, where the
                   branch above uses G): 16 = 4 params32 + 4 grads32 + 8 states for the whole
                   model. minizero puts 12Ψ/N per rank on the host and keeps the 16-bit
                   gradient shard (2Ψ/N) on the device.
  ZeRO-3           per GPU 4L + 18Ψ/N: 4L = the largest layer gathered, 16-bit parameters
                   and 16-bit gradients (2 + 2 bytes); 18Ψ/N the same 18 as ZeRO-2's.
                   minizero's breakdown counts what stays between uses, 16Ψ/N + padding
                   (2 params16 + 2 grads16 + 4 params32 + 8 states): DeepSpeed adds 2Ψ/N
                   and the 4L working set. per CPU (zero_init) 4LG x 1.5.
  ZeRO-3 offload optimizer   per GPU 4L + 2Ψ/N (the 16-bit parameter partition); per CPU
                   16Ψ/n x 1.5 (the node's share of params32 + grads32 + states).
  ZeRO-3 offload optimizer+param   per GPU 4L; per CPU 18Ψ/n x 1.5 (16 + the 16-bit
                   parameter partition).
"""


def nodes_of(world_size: int, gpus_per_node: int = 8) -> Tuple[int, int]:
    """(num_gpus_per_node, num_nodes) for N GPUs: full nodes of `gpus_per_node`, or one
    node when N is smaller."""
    g = min(world_size, gpus_per_node)
    assert world_size % g == 0, f"N = {world_size} is not a whole number of {g}-GPU nodes"
    return g, world_size // g


def estimator_rows(model: torch.nn.Module, world_size: int, gpus_per_node: int = 8) -> List[Dict[str, Any]]:
    """DeepSpeed's estimator per offload option, in bytes (per GPU, per CPU = per node), for
    the options its *_all_live printouts list (ZeRO-3 with zero_init, DeepSpeed's default)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = model_to_params(model)
    g, n = nodes_of(world_size, gpus_per_node)
    rows = []
    for off in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=g, num_nodes=n, cpu_offload=off)
        rows.append({"stage": 2, "offload": "optimizer" if off else "none", "gpu": gpu, "cpu": cpu})
    for off, off_param, name in ((False, False, "none"), (True, False, "optimizer"), (True, True, "both")):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=g, num_nodes=n,
                                                            cpu_offload=off, cpu_offload_params=off_param)
        rows.append({"stage": 3, "offload": name, "gpu": gpu, "cpu": cpu})
    for r in rows:
        r.update(total_params=int(total), largest_layer_params=int(largest), gpus_per_node=g, nodes=n)
    return rows


def side_by_side(model_name: str, worlds: Iterable[int], gpus_per_node: int = 8) -> List[Dict[str, Any]]:
    """DeepSpeed's estimate beside minizero's exact bytes per rank (bf16, computed from the
    layout plans by minizero.memory_table; ZeRO-3 with every parameter partitioned)."""
    from minizero.memory import total as state_total
    from minizero.observe.memory_table import compute
    from minizero.gpt.model import GPT, get_preset

    torch.manual_seed(0)
    model = GPT(get_preset(model_name))   # real storage: model_to_params tells parameters apart by data_ptr
    out = []
    for n in worlds:
        for r in estimator_rows(model, n, gpus_per_node):
            mz = compute(model_name, [n], "bf16", (r["stage"],), r["offload"])[n][r["stage"]][0]
            out.append({**r, "world": n, "minizero_device": state_total(mz["device"]),
                        "minizero_host": state_total(mz["host"])})
    return out


def print_side_by_side(model_name: str, worlds: Iterable[int]) -> None:
    rows = side_by_side(model_name, worlds)
    print(f"model={model_name}: Ψ = {rows[0]['total_params']:,}, largest layer L = "
          f"{rows[0]['largest_layer_params']:,}; bytes per rank (minizero) or per GPU / per CPU (DeepSpeed)\n")
    print("| N | stage | offload | DeepSpeed per GPU | minizero on device | DeepSpeed per CPU (node) | "
          "minizero on host (rank) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['stage']} | {r['offload']} | {r['gpu']:,} | {r['minizero_device']:,} | "
              f"{r['cpu']:,} | {r['minizero_host']:,} |")
    print("\n" + ESTIMATOR_MULTIPLIERS)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m reference.ds_estimates",
                                 description="DeepSpeed's model-state estimators beside minizero's exact bytes")
    ap.add_argument("--model", default="tutorial")
    ap.add_argument("--world-size", type=int, nargs="+", default=[8, 64, 1024])
    args = ap.parse_args(argv)
    from minizero.gpt.model import PRESETS
    if args.model not in PRESETS:
        ap.error(f"unknown --model {args.model!r}: choose one of {', '.join(PRESETS)}")
    bad = [n for n in args.world_size if n < 1 or n % min(n, 8)]
    if bad:
        ap.error(f"world sizes {bad}: use 1-8 or a multiple of 8 (8-GPU nodes)")
    print_side_by_side(args.model, args.world_size)


if __name__ == "__main__":
    main()
