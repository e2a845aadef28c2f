"""minizero vs DeepSpeed: model states at the same moments, every byte of difference named.

Both training loops record each rank's model states at two moments of the last step, the
end of backward and after the step (runlog.MemoryMoments; on DeepSpeed's side the walker
in reference/ds_memory.py), category by category and, with ZeRO-Offload, by place. This
file reads those records and cuts DeepSpeed's bytes minus minizero's into DeepSpeed's
documented overheads (padding, the fp32 master copy, kept gradient partitions, offload's
host buffers), each naming its docs/deepspeed.md section; a byte no rule explains is
"unexplained", which the tests assert never happens. `python -m minizero.compare` puts the
table in its report.
"""
from __future__ import annotations

LIBS = ("minizero", "deepspeed")
CATEGORIES = ("params", "grads", "master_params", "optimizer_states")
PLACES = ("device", "host")
MOMENTS = ("after_backward", "after_step")
MOMENT_TITLES = {"after_backward": "end of backward", "after_step": "after the step"}
DOCS = "docs/deepspeed.md"
HOLDS = f'{DOCS}, "Memory DeepSpeed holds per rank"'
OFFLOAD = f"{DOCS}, \"ZeRO-Offload's extra host buffers\""
FP32_MASTER = f'{DOCS}, "fp32 ZeRO keeps a second fp32 master copy"'
# DeepSpeed buffers that have no minizero counterpart at a moment: (details source, when) -> why.
# "after_step": only after the step (minizero has dropped its gradients by then); "host": only
# in host memory (offload); "always".
DS_OVERHEADS = {
    "grads:grad_partitions_flat_buffer": {
        "after_step": f"ZeRO-3 keeps its gradient partition `grad_partitions_flat_buffer` from init to the end ({HOLDS})",
        "host": f"offload: the reduced gradient partition `grad_partitions_flat_buffer` lives on the host ({OFFLOAD})"},
    "grads:single_partition_of_fp32_groups[i].grad": {
        "always": f"offload: the fp32 master's `.grad` on the host, filled in backward, kept ({OFFLOAD})"},
    "grads:fp32_partitioned_groups_flat[i].grad": {
        "always": f"offload: each sub-group's fp32 `.grad` on the host, kept ({OFFLOAD})"},
    "grads:temp_grad_buffer_for_cpu_offload": {
        "always": f"offload: a host staging buffer of the largest parameter's size ({OFFLOAD})"},
    "grads:temp_grad_buffer_for_gpu_offload": {
        "always": f"offload: a device staging buffer of the largest parameter's size ({OFFLOAD})"},
    "grads:accumulated_grads_in_cpu": {
        "always": f"offload: gradients accumulated on the host across micro-steps ({OFFLOAD})"},
    "params:param_buffer_of_bit16_for_cpu_offload_groups": {
        "always": f"offload: a low-precision copy of the updated slice on the host ({OFFLOAD})"},
}
# bytes per element of each category; "lp": the training dtype's
ELEMENT_BYTES = {"params": "lp", "grads": "lp", "master_params": 4, "optimizer_states": 8}


def _details(entry, place) -> dict:
    """DeepSpeed's {"category:source": bytes} at `place` (None: everywhere)."""
    if place is None:
        return entry.get("details") or {}
    return (entry.get("details_by_place") or {}).get(place) or {}


def padding_bytes(stage, dtype, category, mz, ds) -> int:
    """DeepSpeed minus minizero in `category` that layout padding alone makes, from the
    two layouts' element counts ("elements": full = kept whole, shard = this rank's
    partition). DeepSpeed pads each param group to 2N elements (ZeRO-1/2) or each parameter
    to N (ZeRO-3), minizero each FlatParam to N (docs/deepspeed.md, "Memory DeepSpeed holds
    per rank"). None without the counts."""
    a, b = mz.get("elements"), ds.get("elements")
    if not a or not b:
        return None
    per = ELEMENT_BYTES[category]
    per = (4 if dtype == "fp32" else 2) if per == "lp" else per
    if category == "params":
        which = "shard" if stage == 3 else "full"
    else:
        which = "shard" if stage >= 1 else "full"
    return per * (b[which] - a[which])


def memory_differences(stage, dtype, moment, category, place, mz, ds) -> list:
    """DeepSpeed's bytes minus minizero's for one rank, category and place (None: both places
    together) at one moment, cut into named parts: [(bytes, why)], summing exactly to the
    difference. Every why names the docs/deepspeed.md section of that DeepSpeed overhead; a
    part no rule explains is returned as "unexplained" (the tests assert there is none)."""
    mz_b, ds_b = category_bytes(mz, category, place), category_bytes(ds, category, place)
    parts, left = [], ds_b - mz_b
    if not left:
        return parts
    host = place == "host"
    for source, b in sorted(_details(ds, place).items()):
        rule = DS_OVERHEADS.get(source)
        if not b or not source.startswith(category + ":") or rule is None:
            continue
        why = rule.get("always") or (rule.get("after_step") if moment == "after_step" else None) \
            or (rule.get("host") if host else None)
        if place is None and rule.get("host") and not rule.get("always") and moment != "after_step":
            b = _details(ds, "host").get(source, 0)   # both places together: only its host part
            why = rule["host"] if b else None
        if why:
            parts.append((b, why))
            left -= b
    secondary = _details(ds, place).get("params:ds_secondary_tensor") if category == "params" and not host else None
    if secondary:   # hpZ: both hold a secondary partition from forward to the step (reference/hpz.py)
        lp = 4 if dtype == "fp32" else 2
        el = mz.get("elements") or {}
        mine = max(mz_b - lp * (el.get("shard", 0) + el.get("full", 0)), 0) if el else 0
        parts.append((secondary - mine, f"hpZ's secondary partition: DeepSpeed's ds_secondary_tensor ({secondary:,} B, "
                                        f"each parameter's padded/k) less minizero's FlatParam.secondary ({mine:,} B, "
                                        f"each FlatParam's padded/k) (reference/hpz.py)"))
        left -= secondary - mine
    if category == "master_params" and dtype == "fp32" and stage >= 1 and mz_b == 0 and ds_b > 0:
        parts.append((left, f"fp32: DeepSpeed's ZeRO keeps an fp32 master beside the fp32 parameters, minizero's "
                            f"shard is its master ({FP32_MASTER})"))
        return parts
    if category == "grads" and moment == "after_backward" and left:
        ds_offloads = category_bytes(ds, "grads", "host") > 0
        if place == "device" and ds_offloads and left == -mz_b:
            parts.append((left, "offload: DeepSpeed keeps no gradient partition on the device after backward (each "
                                f"piece went to the host), minizero its reduced shard until the step ({OFFLOAD})"))
            return parts
        if stage in (1, 2) and not ds_offloads:
            parts.append((left, "ZeRO-1/2's gradient partition holds the whole parameters that straddle its slice "
                                "(and DeepSpeed's ZeRO-1 reduces at the end of engine.backward, in reduce_gradients "
                                "after loss.backward, where minizero's ZeRO-1 reduces at the start of engine.step: "
                                f"until then both hold the full gradient) ({HOLDS})"))
            return parts
    pad = padding_bytes(stage, dtype, category, mz, ds)
    if left and pad and left == pad:
        parts.append((left, f"padding: DeepSpeed pads each param group to 2N elements (ZeRO-1/2) or each "
                            f"parameter to N (ZeRO-3), minizero each FlatParam to N ({HOLDS})"))
        left = 0
    if left:
        parts.append((left, "unexplained"))
    return parts


def moments_table(results, dtype) -> str:
    """Rank 0's model states at both moments of the last step, category by category (and
    place by place with offload): minizero, DeepSpeed, and every byte of the difference named."""
    places = PLACES if offloaded(results) else (None,)
    lines = ["| stage | moment | category" + (" | place" if places != (None,) else "")
             + " | minizero B | DeepSpeed B | DS - mz | named difference (DeepSpeed's overhead) |"]
    lines.append("|" + "---|" * (8 if places != (None,) else 7))
    for stage in sorted(results):
        mz_run, ds_run = results[stage]["minizero"], results[stage]["deepspeed"]
        for moment in MOMENTS:
            mz, ds = moment_entries(mz_run, moment), moment_entries(ds_run, moment)
            if not mz or not ds:
                continue
            for c in CATEGORIES:
                for place in places:
                    a, b = category_bytes(mz[0], c, place), category_bytes(ds[0], c, place)
                    parts = memory_differences(stage, dtype, moment, c, place, mz[0], ds[0])
                    why = "; ".join(f"{n:+,} B {w}" for n, w in parts) if parts else "same"
                    cells = [str(stage), MOMENT_TITLES[moment], c] + ([place] if place else []) + \
                        [f"{a:,}", f"{b:,}", f"{b - a:+,}", why]
                    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def moments_step(results, libs=LIBS):
    steps = {r[lib]["memory_moments"]["step"] for r in results.values() for lib in libs
             if r[lib].get("memory_moments")}
    return min(steps) if steps else None


def moment_entries(summary, moment) -> list | None:
    """Per-rank model states at `moment` of the run's last step (runlog.MemoryMoments), or None."""
    moments = summary.get("memory_moments")
    return moments[moment] if moments else None


def state_entries(summary) -> list:
    """Per-rank entries the table's state columns read: the end of the last step's backward,
    measured alike in both libraries (runlog.MemoryMoments); summary.json's model_state_bytes
    for a summary without moments (one from before them)."""
    return moment_entries(summary, "after_backward") or summary["model_state_bytes"]


def state_bytes(summary) -> list:
    """Per-rank model-state bytes: the sum of the four categories."""
    return [sum(int(r.get(c) or 0) for c in CATEGORIES) for r in state_entries(summary)]


def category_bytes(entry, category, place=None) -> int:
    """One rank's bytes of `category`: in all (place None) or on the "device" / "host".
    An entry without the split (a summary from before it, or reference/train.py without
    its walker) holds everything on the device."""
    if place is None or "device" not in entry:
        return int(entry.get(category) or 0) if place in (None, "device") else 0
    return int((entry.get(place) or {}).get(category) or 0)


def placed_bytes(entry) -> dict:
    """{"device": bytes, "host": bytes} of one rank's model states; and "nvme" when the run
    swapped states to files ("device": "nvme", minizero/offload/nvme.py)."""
    out = {w: sum(category_bytes(entry, c, w) for c in CATEGORIES) for w in PLACES}
    if "nvme" in entry:
        out["nvme"] = sum(int(entry["nvme"].get(c) or 0) for c in CATEGORIES)
    return out


def offloaded(results) -> bool:
    """Whether any run of either library holds model states in host memory (ZeRO-Offload)."""
    return any(placed_bytes(e)["host"] for runs in results.values() for s in runs.values()
               for e in state_entries(s))


# ----------------------------------------------------------------------------- peaks

PEAK_PHASES = ("backward", "step")
PEAK_TITLES = {"backward": "during backward", "step": "during the step"}
PEAKS = f'{DOCS}, "Memory at its peak"'
# minizero's memory_track kinds, as the report names them
KIND_NAMES = {"params.gathered": "full parameters", "params.shard": "parameter shards",
              "params.secondary": "hpZ secondary shards", "master_params": "fp32 masters",
              "optimizer_states": "Adam's moments", "grads.shard": "reduced gradient shards",
              "grads.buffer": "flat gradients being reduced", "grads.param": "p.grad"}
# Why the libraries' peaks differ, by stage and phase (both measured on the device, at the
# events each recorder samples: minizero.train.runlog.PhasePeaks).
PEAK_WHY = {
    (0, "backward"): "both hold every gradient at the end of backward; neither reduces in it without overlap_comm",
    (0, "step"): "DeepSpeed's stage 0 (FP16_UnfusedOptimizer) makes an fp32 .grad for every parameter "
                 "before Adam (4Ψ) beside the bf16 p.grad; minizero all-reduces its buckets' flat "
                 "gradients and steps its fp32 masters from them",
    (1, "backward"): "both hold every gradient (2Ψ) until they reduce: DeepSpeed inside engine.backward "
                     "(reduce_gradients, after loss.backward: its peak, the partition filling and a bucket beside "
                     "the gradients not yet reduced), minizero inside engine.step",
    (1, "step"): "minizero reduce-scatters in the step (every bucket's flat gradient issued at once beside the p.grad "
                 "not yet copied); DeepSpeed's step makes the fp32 gradient of one param group's partition for Adam "
                 "(single_partition_of_fp32_groups[i].grad) beside its bf16 partition",
    (2, "backward"): "both reduce from the gradient hooks as each bucket fills: DeepSpeed's partition holds whole "
                     "straddling parameters and its reduce_bucket_size bucket, minizero its shard and the bucket's "
                     "flat gradient being reduced",
    (2, "step"): "DeepSpeed's step makes the fp32 gradient of one param group's partition for Adam beside its bf16 "
                 "partition; minizero's CPU Adam converts its bf16 shard 1 MB at a time (adam.ChunkedAdamW)",
    (3, "backward"): "both gather one unit at a time (prefetch off) and reduce-scatter a bucket (DeepSpeed: "
                     "reduce_bucket_size, persistent) or a unit's flat gradient (minizero); DeepSpeed pads each "
                     "parameter, minizero each unit",
    (3, "step"): "DeepSpeed makes each sub-group's fp32 gradient for Adam, keeps its bf16 gradient partition and its "
                 "reduce bucket; minizero steps from its reduced shards",
}


def peak_entries(summary) -> list | None:
    """Per-rank peaks of the run's last step (runlog.MemoryMoments' "peaks"), or None."""
    moments = summary.get("memory_moments") or {}
    return moments.get("peaks")


def peak_pieces(peak) -> list:
    """[(name, bytes)] of what a rank held at a peak, largest first: minizero's kinds by
    KIND_NAMES, DeepSpeed's and PyTorch's buffers by their own names."""
    pieces = {}
    for key, nbytes in (peak.get("detail") or {}).items():
        name = KIND_NAMES.get(key) or key.split(":", 1)[-1]
        pieces[name] = pieces.get(name, 0) + int(nbytes)
    return sorted(((n, b) for n, b in pieces.items() if b), key=lambda nb: -nb[1])


def peaks_table(results, libs=LIBS) -> str:
    """Rank 0's fullest moment during backward and during the step of the last step, each
    library's buffers at that moment, and the difference to minizero's peak."""
    lines = ["| stage | phase | library | peak B | - minizero | held at the peak (B) | read at |",
             "|---|---|---|---|---|---|---|"]
    for stage in sorted(results):
        entries = {lib: peak_entries(results[stage][lib]) for lib in libs if lib in results[stage]}
        for phase in PEAK_PHASES:
            base = (entries.get("minizero") or [{}])[0].get(phase)
            for lib, per_rank in entries.items():
                peak = (per_rank or [{}])[0].get(phase)
                if not peak:
                    continue
                held = ", ".join(f"{name} {b:,}" for name, b in peak_pieces(peak))
                diff = "" if lib == "minizero" or not base else f"{peak['total'] - base['total']:+,}"
                lines.append(f"| {stage} | {PEAK_TITLES[phase]} | {lib} | {peak['total']:,} | {diff} | {held} | "
                             f"{peak.get('at', '')} |")
    return "\n".join(lines)


def peaks_section(results, libs=LIBS) -> list:
    """report.md's section on each rank's peak: the table, then why the peaks differ."""
    if not any(peak_entries(r[lib]) for r in results.values() for lib in libs if lib in r):
        return []
    why = [f"- stage {stage}, {PEAK_TITLES[phase]}: {PEAK_WHY[(stage, phase)]}."
           for stage in sorted(results) for phase in PEAK_PHASES if (stage, phase) in PEAK_WHY]
    return [f"## Model states at their peak (rank 0, the last step)", "",
            "Each library's own buffers (parameters gathered or not, gradients, gradient buckets and partitions, "
            "fp32 masters, Adam's moments) read at every event inside `engine.backward` and inside `engine.step` "
            "that can change them (a collective, a unit's gather or release, the optimizer's step), on the "
            f"device; the fullest reading of each phase ({PEAKS}). Activations are not counted.", "",
            peaks_table(results, libs), "", *why, ""]


def moments_section(results, dtype) -> list:
    """report.md's memory section: both moments, category by category, differences named."""
    step = moments_step(results)
    if step is None:
        return []
    return [f"## Model states at the same moments (rank 0, step {step})", "",
            "Both libraries read at the end of the step's backward (after `engine.backward` of its last "
            "micro-batch, before `engine.step`) and after the step (after `engine.step`), the bytes each really "
            "holds. Every difference is cut into DeepSpeed's documented overheads, to the byte.", "",
            moments_table(results, dtype), ""]
