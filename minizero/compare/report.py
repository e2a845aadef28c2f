"""report.md's words: the header (command, machine, versions, config), the notes on what
differs between the libraries and why, and the sections in the order the page reads them.
The numbers come from compare.py's runs; the tables and pictures are render.py's, the memory
moments compare_memory.py's, the comms summaries compare_comms.py's, the bytes between
pretended nodes compare_nodes.py's."""
from __future__ import annotations

import json
import os

from minizero.compare import REPO
from minizero.compare.compare_comms import comms_section
from minizero.compare.compare_memory import LIBS, moments_section, peaks_section
from minizero.compare.compare_nodes import hierarchy_keys, nodes_section, ranks_per_node, scheme_of
from minizero.compare.render import NAMES, SHORT, moments_by_lib, table
from minizero.runtime.about import machine, versions  # noqa: F401  (compare.py reads them from here)


def doc_link(page: str, out: str) -> str:
    """A link from the report in `out` to docs/<page>: relative when the report is inside the
    repository, so the link survives a move of the whole checkout."""
    path = os.path.join(REPO, "docs", page)
    return os.path.relpath(path, out) if out.startswith(REPO + os.sep) else path


def note(args, pinned: dict, offload: bool = False) -> str:
    agreement = doc_link("agreement.md", args.out)
    lines = [
        f"Known differences (details and sources: [docs/agreement.md]({agreement})):", "",
        "- Wire bytes: DeepSpeed's ZeRO-1/2 \"reduce-scatter\" is an all-reduce (`average_tensor` pre-divides "
        "the bucket and calls `all_reduce`; each rank keeps its slice): 2Ψ for gradients plus Ψ for the "
        "parameter all-gather, 1.5x the paper's 2Ψ that minizero moves. "
        + ("At ZeRO-3 both libraries run the config's own prefetch and reuse knobs (--own-knobs): with "
           "DeepSpeed's defaults each keeps every unit gathered from forward into backward and gathers once "
           "per step (2Ψ), and minizero moves DeepSpeed's bytes (docs/zero.md, \"Hiding communication\")."
           if getattr(args, "own_knobs", False) else
           "At ZeRO-3 minizero all-gathers in forward and again in backward (the paper's 3Ψ); so does "
           "DeepSpeed with the settings below (with its defaults both keep a small model gathered from forward "
           "into backward and gather once: --own-knobs)."),
        "- Memory: both libraries are measured at the same two moments of the last step, from the buffers they "
        "really hold (minizero's `memory.held_bytes`, DeepSpeed's `reference/ds_memory.py` walker): the state "
        "columns above are the end of backward; the section below has both moments, and names every byte "
        "that differs. Memory peaks between those moments (a bucket being reduced, a unit gathered, the fp32 "
        "gradient a step makes for Adam): the peaks section reads each library at every such event of the last "
        "step. On CPU, peak MB is the process RSS.",
        f"- This comparison adds {json.dumps(pinned)} "
        "to `zero_optimization` unless the config sets "
        "them: DeepSpeed's ZeRO-3 defaults replace `F.linear` (matmul then `+= bias`, which rounds differently "
        "in bf16/fp16), keep parameters under 1e5 elements unpartitioned (a small model would show no ZeRO-3 "
        "saving) and allocate a 5e8-element reduce bucket at init.",
        "- samples/s: median over logged intervals after the first; noisy (+-30%) on a shared CPU."
        + (" With the comms logger on, both libraries time every collective; DeepSpeed's wrapper costs 0.3-1 ms "
           "per collective on a CPU (measured on 2 gloo ranks: an 8 B all-reduce 0.4 -> 0.7-1.4 ms, a 200 KB one "
           "1.0-1.7 -> 1.9-2.2 ms), so its samples/s drop most at ZeRO-3, which issues the most collectives "
           "(`--no-comms-logger` for speed)." if getattr(args, "comms_logger", False) else "")]
    if offload:
        lines.append("- Offload (host B > 0): minizero moves exactly the optimizer shard (fp32 master + Adam "
                     "moments, 12 bytes per element of the rank's shard in mixed precision) to the host and, with "
                     "`offload_param`, ZeRO-3's partitioned low-precision parameters. DeepSpeed also keeps an fp32 "
                     "gradient partition on the host (4 bytes per element), at ZeRO-3 its low-precision gradient "
                     "partition there too, and at ZeRO-1/2 a low-precision staging copy of the shard plus two "
                     "staging buffers of the largest parameter's size, one on each side ("
                     """docs/deepspeed.md, "ZeRO-Offload's extra host buffers"). On a CPU-only machine """
                     "the device and the host are the same memory: the split says where the bytes would live "
                     "beside a GPU.")
    if args.dtype != "fp32" and 0 in args.stages:
        lines.append("- Stage 0 in fp16/bf16: DeepSpeed's stage-0 wrappers take one Adam step with zero gradients "
                     "at init (losses drift, bf16 up to ~6e-3 in 20 steps); its stage-0 fp16 never multiplies "
                     "the loss by the scale but divides the gradients by it (1/65536 too small), and since an "
                     "unscaled backward never overflows, the scale doubles every `loss_scale_window` clean steps "
                     "without bound (1/131072 after 1,000 steps, 1/262144 after 2,000: docs/deepspeed.md, \"Stage 0 "
                     "fp16 never scales the loss\"); its loss scaler has no hysteresis. minizero does not copy these "
                     "quirks: its scaled backward overflows when the scale is too large, and the scale comes down.")
    if args.dtype != "fp32":
        lines.append("- Expected loss agreement in low precision is op-order noise (bf16 ~2e-4, fp16 ~3e-5 "
                     "over 20 steps); fp32 agrees to ~1e-6.")
    return "\n".join(lines)


def torch_note(args) -> str:
    fsdp, keys = doc_link("fsdp.md", args.out), hierarchy_keys(args)
    return ("- PT = PyTorch itself (reference/torch_train.py, docs/fsdp.md): stage 0 is DistributedDataParallel, "
            "stage 3 FSDP2 `fully_shard` per block then the root (`reshard_after_forward=True`), stage 2 the same "
            "with `reshard_after_forward=False` (ZeRO-3's sharded states, ZeRO-2's bytes on the wire). FSDP2 pads "
            "each parameter's dim 0 to a multiple of N (minizero pads each flat unit), frees gradients at "
            "`zero_grad`, and its optimizer steps the fp32 shard itself (no separate master). Its gradient-norm "
            "all-reduce goes through DTensor's functional collectives and is not counted. "
            f"Details: [docs/fsdp.md]({fsdp})."
            + (" hsdp_shard_size S: the same on a 2-D mesh (N/S replicas, S shard ranks): gathers and the "
               "reduce-scatter inside a row of S ranks, then the gradient shard all-reduced across the rows."
               if "hsdp_shard_size" in keys else "")
            + (" zero_hpz_partition_size k: `reshard_after_forward=k`, FSDP2's hpZ: after forward each block keeps "
               "a copy sharded over k ranks, which backward all-gathers from (freed after backward; DeepSpeed's "
               "secondary partition lives until the step)."
               if "zero_hpz_partition_size" in keys else ""))


def report_md(info, args, rows, pinned: dict, offload: bool = False, results=None) -> str:
    placed = (" device B / host B = the same split by where it lives: host memory with ZeRO-Offload."
              if offload else "")
    results = results or {}
    libs = getattr(args, "libs", list(LIBS))
    pair = all(lib in libs for lib in LIBS)   # minizero and deepspeed: the sections that name every byte
    ds_results = {s: {lib: r[lib] for lib in LIBS} for s, r in results.items()} if pair else {}
    per_node = ranks_per_node(args)   # the ranks of one pretended node; None on one node
    return "\n".join([
        f"# {' vs '.join(NAMES[lib] for lib in libs)}: ZeRO stage(s) {', '.join(map(str, args.stages))}, {args.dtype}, "
        f"{args.nproc} rank(s)" + "".join(f", {key} {size}" for key, size in hierarchy_keys(args).items()), "",
        f"- command: `{info['command']}`", f"- machine: {info['machine']}",
        f"- date: {info['date']}", "- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
        f"- config: [config.json](config.json), each run with `--stage N --dtype {args.dtype}`", "",
        table(rows), "",
        ", ".join(f"{SHORT[lib]} = {NAMES[lib]}" for lib in libs) + ". state B = model-state bytes per rank at the end of the last step's "
        "backward (params + grads + master params + optimizer states); max abs dloss/step = max over optimizer steps of "
        f"|loss_{SHORT[libs[0]]} - loss_other|; "
        "wire B/step = ring-algorithm bytes per rank per optimizer step."
        + (" link B/step = the bytes node 0's ranks sent to another node per step (the section below)."
           if per_node else "") + placed, "",
        *([note(args, pinned, offload)] if pair else []), *([torch_note(args)] if "torch" in libs else []), "",
        "![loss curves](loss_curves.png)", "",
        *(moments_section(ds_results, args.dtype) if pair else []),
        *(moments_by_lib(results, libs) if libs != list(LIBS) else []),
        *peaks_section(results, [lib for lib in libs]),
        "![memory](memory.png)", "",
        *(nodes_section(results, args, libs, per_node, scheme_of(args)) if per_node else []),
        *(comms_section(ds_results) if pair else [])])
