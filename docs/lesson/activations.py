"""Activation checkpointing, measured: the bytes it saves and the compute it repeats.

    python docs/lesson/activations.py --model tutorial-24 --n-embd 32 --image-size 8 --micro-batch 8

One forward and backward of the GPT on one process, twice: with every activation kept, and
with each block checkpointed (`minizero.checkpointing.checkpoint`, the function the engine
installs for an `activation_checkpointing` section). For each it measures

- the bytes saved for backward: the distinct tensors autograd keeps between forward and
  backward, parameters left out (minizero/observe/saved_bytes.py, saved_tensors_hooks);
- the floating-point operations of forward and backward (torch.utils.flop_counter). The
  counter has no formula for the fused attention kernel a CPU runs
  (`_scaled_dot_product_flash_attention_for_cpu` and its backward), so it would leave out
  QKᵀ and AV; they are counted here with torch's own formulas for the fused kernels
  (`sdpa_flop_count`, `sdpa_backward_flop_count`: every (query, key) pair, the causal mask
  not discounted, as torch counts its GPU kernels).

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") predict both: a
checkpointed block keeps only its input (batch x tokens x n_embd elements) and runs its
forward once more in backward, so memory falls by about the number of tensors a block
keeps and compute grows by the blocks' share of one forward (about a third of a step,
since backward costs about two forwards). ZeRO's data parallelism (stages 1-3) leaves these
bytes alone: it partitions the model states (parameters, gradients, optimizer states). The
paper's ZeRO-R (section 6.1, DeepSpeed's `partition_activations`) cuts each checkpointed
input across the *model-parallel* ranks, which under tensor parallelism hold copies of it;
with data parallelism alone that group is one rank, and there is nothing to cut.
Numbers are the same on every machine: bytes are tensor sizes, FLOPs are formulas.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def attention_flops() -> dict:
    """torch's formulas for the fused attention kernels (flop_counter's sdpa_flop_count and
    sdpa_backward_flop_count), for the CPU's kernel, which the counter does not know."""
    import torch
    from torch.utils import flop_counter

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def measure(model_name: str, micro_batch: int, **sizes) -> dict:
    """{"kept"|"checkpointed": (bytes saved for backward, forward FLOPs, forward+backward FLOPs)},
    the model's config and the bytes of one block input."""
    import torch
    from torch.utils import flop_counter

    from minizero import checkpointing
    from minizero.gpt.model import GPT
    from minizero.gpt.presets import get_preset
    from minizero.observe.saved_bytes import count_saved_bytes

    torch.manual_seed(0)
    model = GPT(get_preset(model_name, **sizes)).train()
    cfg = model.config
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size))
    out = {}
    for name, fn in (("kept", None), ("checkpointed", checkpointing.checkpoint)):
        model.checkpoint_fn = fn
        flops = flop_counter.FlopCounterMode(display=False, custom_mapping=attention_flops())
        with flops:
            with count_saved_bytes(exclude=model.parameters()) as saved:
                _, loss = model(x, x)
            forward = flops.get_total_flops()
            loss.backward()
        out[name] = (saved.bytes, forward, flops.get_total_flops())
        model.zero_grad(set_to_none=True)
    block_input = micro_batch * cfg.block_size * cfg.n_embd * 4   # fp32
    return {**out, "config": cfg, "block_input": block_input}


def report(m: dict, model_name: str, micro_batch: int) -> str:
    cfg = m["config"]
    (kept_b, fwd, kept_f), (ck_b, _, ck_f) = m["kept"], m["checkpointed"]
    inputs = cfg.n_layer * m["block_input"]
    lines = [
        f"model {model_name}: {cfg.n_layer} blocks, n_embd {cfg.n_embd}, {cfg.block_size} tokens; "
        f"micro-batch {micro_batch}; fp32; one forward and backward",
        f"  {'':<28}{'saved for backward':>20}{'FLOPs, forward + backward':>28}",
        f"  {'every activation kept':<28}{kept_b:>14,} bytes{kept_f:>28,}",
        f"  {'each block checkpointed':<28}{ck_b:>14,} bytes{ck_f:>28,}",
        f"saved: {kept_b - ck_b:,} bytes ({kept_b / ck_b:.1f}x less); repeated: {ck_f - kept_f:,} FLOPs "
        f"(+{100 * (ck_f - kept_f) / kept_f:.1f}% of the step; the forward alone is {fwd:,})",
        f"kept with checkpointing: each block's input, {micro_batch} x {cfg.block_size} x {cfg.n_embd} x 4 bytes "
        f"= {m['block_input']:,} per block, {inputs:,} for {cfg.n_layer} blocks; "
        f"the other {ck_b - inputs:,} are outside the blocks (embeddings, final norm, head, loss)",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/lesson/activations.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="GPT preset (minizero/gpt/presets.py)")
    ap.add_argument("--n-embd", type=int, help="the preset's width, overridden (as python -m minizero.train)")
    ap.add_argument("--image-size", type=int, default=8, choices=[8, 16, 32],
                    help="tokens = image-size squared, less one")
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args(argv)
    from minizero.gpt.presets import PRESETS, ModelConfigError
    if args.model not in PRESETS:
        ap.error(f"--model {args.model}: choose one of {', '.join(PRESETS)}")
    sizes = {"block_size": args.image_size ** 2 - 1}
    if args.n_embd is not None:
        sizes["n_embd"] = args.n_embd
    if args.micro_batch < 1:
        ap.error("--micro-batch must be >= 1")
    try:
        m = measure(args.model, args.micro_batch, **sizes)
    except ModelConfigError as e:
        ap.error(str(e))
    print(report(m, args.model, args.micro_batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
