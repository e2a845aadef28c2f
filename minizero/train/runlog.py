"""What both training scripts (minizero/train/train.py and reference/train.py) share besides
the model and the data: memory readout, the metrics line and files, comm-byte windows,
the test loss, minGPT's image sampling, and the files written at the end of a run.

Everything here is library-neutral: it never imports deepspeed, so the DeepSpeed
reference can use it as it is. Ranks come from minizero.comm, which reads the default
process group whoever started it; the two collectives on metrics (a loss, a test loss)
call torch.distributed directly, see mean_across_ranks.

Files a run writes (rank 0, into its save dir):

    metrics.csv   one row per logged step, columns METRICS_COLUMNS
    summary.json  one JSON object, keys SUMMARY_KEYS (see minizero/train/train.py); memory_moments
                  is MemoryMoments.result(): each rank's model states at the end of the
                  last step's backward and after that step, measured alike in both libraries
    samples.png   a grid of images sampled from the model
    comms_summary.json, comms_summary.txt   with a comms_logger section: DeepSpeed's
                  log_summary numbers and table (write_comms_summary)
"""
from __future__ import annotations

import csv
import json
import math
import os
import resource
import statistics
import sys

import torch
import torch.distributed as dist

from minizero import comm

METRICS_COLUMNS = ["step", "epoch", "loss", "lr", "loss_scale", "samples_per_s", "tokens_per_s",
                   "mem_mb", "peak_mem_mb", "elapsed_s"]

SUMMARY_KEYS = ["library", "status", "stage", "dtype", "world_size", "model", "params", "steps", "losses",
                "final_loss", "test_loss", "model_state_bytes", "peak_mem_mb", "samples_per_s",
                "comm_wire_bytes_per_step", "comm_inter_node_bytes_per_step", "ranks_per_node", "skipped_steps",
                "memory_moments", "config"]


# ----------------------------------------------------------------------------- process group
# The metrics' collectives call torch.distributed, not minizero.comm's wrappers: those
# record into the ledger behind engine.comm_stats() and name a profiler range
# minizero::<op>, which are for the engine's (ZeRO's) traffic only. The trainer's
# bookkeeping stays out of both, under DeepSpeed as under minizero.

def mean_across_ranks(value: float, device) -> float:
    """The average of a Python float over all ranks (a float64 all-reduce; 1 rank: itself)."""
    world = comm.get_world_size()
    if world == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world


def mean_across_ranks_many(values: list, device) -> list[float]:
    """The rank average of each of several scalar tensors, with one collective and one host sync.

    All-gather, then sum in rank order on the host: the same float64 numbers as an
    all-reduce of each value at 2 ranks, and the same result whatever the batch length
    (an all-reduce's order of additions may depend on the message size)."""
    local = torch.stack([v.detach().double().reshape(()) for v in values]).to(device)
    world = comm.get_world_size()
    if world == 1:
        return local.tolist()
    gathered = torch.empty(world * len(values), dtype=torch.float64, device=device)
    comm.torch_all_gather()(gathered, local)
    rows = gathered.view(world, len(values)).tolist()
    return [sum(r[i] for r in rows) / world for i in range(len(values))]


def log0(*a, **k) -> None:
    """print, on rank 0 only: one line per run, not one per rank."""
    if comm.get_rank() == 0:
        print(*a, **k)


# ----------------------------------------------------------------------------- memory

def memory_mb(device) -> tuple[float, float]:
    """(current, peak) memory of this process in MB.

    GPU: CUDA memory allocated by tensors and its peak (torch.cuda.max_memory_allocated).
    CPU: the process's resident set size (RSS, /proc/self/statm) and the peak RSS
    (getrusage ru_maxrss: kilobytes on Linux, bytes on macOS). RSS counts everything the
    process touched (the Python interpreter, torch's libraries, the dataset), so on CPU
    it is an upper bound on the model's memory, not the model states alone: for those see
    summary.json's model_state_bytes.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return (torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:   # no /proc (macOS): the peak is the best we have
        rss = peak
    return rss, peak


MOMENTS = ("after_backward", "after_step")


class MemoryMoments:
    """This rank's model states at two moments of one optimizer step, read the same way
    under either library, so the two compare like for like:

        after_backward   after engine.backward of the step's last micro-batch, before engine.step
        after_step       after engine.step at the accumulation boundary

    `measure(engine)` reads what the engine really holds at that moment, by category
    (params, grads, master_params, optimizer_states, and their "device" / "host" split):
    minizero's memory.held_bytes, DeepSpeed's reference.ds_memory walker. The training
    loop calls take() at both moments of every step; only `step` (the run's last) is read,
    so nothing else pays for the walk. summary.json's model_state_bytes stays what it was
    (minizero's layout formula, DeepSpeed's walk at the end of the run); these are the two
    numbers to set side by side.

    `peaks(engine)`, when given, makes a recorder of the same step's fullest moments
    (PhasePeaks' result: MinizeroPeaks, reference.ds_memory.track_peaks,
    reference.torch_engine.track_peaks); it is made and armed at the previous step's
    after_step moment, so a run of one step (or resumed at its last) has none."""

    def __init__(self, measure, step: int, peaks=None):
        self.measure, self.step, self.peaks = measure, step, peaks
        self.readings: dict[str, dict] = {}
        self.recorder, self.peak = None, None

    def take(self, moment: str, engine, step: int) -> None:
        assert moment in MOMENTS, moment
        if step == self.step and self.measure is not None:
            self.readings[moment] = self.measure(engine)
        if moment != "after_step" or self.peaks is None:
            return
        if step == self.step - 1 and self.recorder is None:
            self.recorder = self.peaks(engine)
            self.recorder.arm()
        elif step == self.step and self.recorder is not None:
            self.peak = {k: v for k, v in self.recorder.result().items() if k != "readings"}

    def result(self, together: bool) -> dict | None:
        """{"step", "after_backward": [per rank], "after_step": [per rank]} and, with a peak
        recorder, "peaks": [per rank], or None when the run never reached the step.
        Collective when `together` (every rank calls it)."""
        mine = {**{m: self.readings.get(m) for m in MOMENTS}, "peaks": self.peak}
        ranks = comm.all_gather_object(mine) if together else [mine]
        if any(r[m] is None for r in ranks for m in MOMENTS):
            return None
        out = {"step": self.step, **{m: [r[m] for r in ranks] for m in MOMENTS}}
        if all(r["peaks"] for r in ranks):
            out["peaks"] = [r["peaks"] for r in ranks]
        return out


PEAK_PHASES = ("backward", "step")


class PhasePeaks:
    """Each rank's fullest moment in each phase of one optimizer step, read the same way
    under every library, so the peaks compare like for like (MemoryMoments has two chosen
    moments; memory peaks between them, where a bucket is being reduced or a unit is
    gathered):

        backward   inside engine.backward (every micro-step of the step), its epilogue included
        step       inside engine.step (the boundary one: reduction at ZeRO-1/stage 0 where it
                   runs there, the update, the parameter all-gather after it)

    `read()` returns what the engine holds right now, {"total": bytes on the device,
    "by_category": {params, grads, master_params, optimizer_states, buffers: device bytes},
    "host": bytes on the host, "detail": {name: bytes}}: the engine's own buffers (gathered
    parameters, shards, gradient buckets and partitions, flat gradients, masters, Adam's
    moments, offload staging), not activations. The library's recorder calls `enter`/`leave`
    around its phases and `sample(where)` at each event inside them that can change those
    buffers (a collective, a unit's gather or release, the optimizer's step); only samples
    between `arm()` and `result()` count, so a run reads its last step only. A peak is read
    at the samples: a buffer made and freed between two of them is not seen (each
    recorder's docstring says where it samples)."""

    def __init__(self, read):
        self.read, self.armed, self.phase, self.peaks, self.readings = read, False, None, {}, []

    def arm(self) -> None:
        self.armed, self.peaks, self.readings = True, {}, []

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.sample(f"{phase} begins")

    def leave(self, phase: str) -> None:
        self.sample(f"{phase} ends")
        self.phase = None

    def sample(self, where: str) -> None:
        if not self.armed or self.phase not in PEAK_PHASES:
            return
        reading = dict(self.read(), at=where)
        self.readings.append({"phase": self.phase, "at": where, "total": reading["total"],
                              "by_category": dict(reading["by_category"]), "detail": dict(reading["detail"])})
        best = self.peaks.get(self.phase)
        if best is None or reading["total"] > best["total"]:
            self.peaks[self.phase] = reading

    def result(self) -> dict:
        """{phase: the reading at its fullest sample, "readings": every sample in order, as
        {"phase", "at", "total", "by_category", "detail"}}; disarms."""
        self.armed = False
        return {**self.peaks, "readings": list(self.readings)}


def wrap_phase(obj, method: str, peaks: PhasePeaks, phase: str) -> None:
    """obj.<method> (an instance attribute from now on) runs inside `phase` of `peaks`."""
    inner = getattr(obj, method)

    def in_phase(*a, **k):
        peaks.enter(phase)
        try:
            return inner(*a, **k)
        finally:
            peaks.leave(phase)
    setattr(obj, method, in_phase)


def wrap_sample(obj, method: str, peaks: PhasePeaks, where: str, before: bool = True, after: bool = True) -> None:
    """A sample of `peaks` before and/or after each call of obj.<method> (an instance attribute from now on)."""
    inner = getattr(obj, method)

    def sampled(*a, **k):
        if before:
            peaks.sample(f"{where} (before)")
        out = inner(*a, **k)
        if after:
            peaks.sample(f"{where} (after)")
        return out
    setattr(obj, method, sampled)


class MinizeroPeaks:
    """PhasePeaks' result for a minizero engine, from minizero.observe.memory_track: its
    MemoryTrack samples the engine's buffers at every event the engine and comm announce
    (each phase's begin and end, each unit's forward/recompute/backward, the begin, blocking
    wait and end of every collective and host copy); the fullest device sample of each phase
    is the peak. memory_track reads the FlatParams' buffers (gathered, shard, hpZ secondary,
    reduced gradient shard, flat gradient buffer, p.grad), the masters and Adam's moments:
    the fp32 gradient the step makes for Adam is not among them (on a CPU the step converts
    the bf16 shard slice by slice, so there is none), nor is a buffer freed between two
    announced events (memory_track's docstring)."""

    def __init__(self, engine):
        self.engine, self.track = engine, None

    def arm(self) -> None:
        from minizero.observe.memory_track import MemoryTrack
        self.track = MemoryTrack(self.engine)

    def result(self) -> dict:
        from minizero.observe.memory_track import category, total
        track, self.track = self.track, None
        if track is None:
            return {}
        track.close()

        def reading(s):
            device = s["held"].get("device", {})
            by_category = dict.fromkeys(("params", "grads", "master_params", "optimizer_states", "buffers"), 0)
            for kind, nbytes in device.items():
                by_category[category(kind)] += nbytes
            where = " ".join(str(s[k]) for k in ("event", "phase", "op", "label", "unit", "kind") if s.get(k))
            return {"total": total(s["held"], "device"), "by_category": by_category,
                    "host": total(s["held"], "host"), "detail": dict(device), "at": where}
        out = {"readings": []}
        for phase in PEAK_PHASES:
            samples = track.within(phase)
            if not samples:
                continue
            out[phase] = reading(max(samples, key=lambda s: total(s["held"], "device")))
            out["readings"] += [{"phase": phase, **{k: r[k] for k in ("at", "total", "by_category", "detail")}}
                                for r in map(reading, samples)]
        return out


# ----------------------------------------------------------------------------- the metrics line

def metrics_line(row: dict) -> str:
    """One line per logged step, in the spirit of DeepSpeed's timer line."""
    return (f"step={row['step']:>4d} loss={row['loss']:.4f} lr={row['lr']:.1e} "
            f"scale={row['loss_scale']:g} samples/s={row['samples_per_s']:.1f} "
            f"tokens/s={row['tokens_per_s']:.0f} mem={row['mem_mb']:.1f}MB peak={row['peak_mem_mb']:.1f}MB")


def write_metrics_csv(path: str, rows: list[dict]) -> None:
    """Rewritten whole at every logged step, atomically (a crash mid-write keeps the old file)."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRICS_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in METRICS_COLUMNS})
    os.replace(tmp, path)


def median_throughput(rows: list[dict]) -> float | None:
    """Median samples/s over the logged intervals after the first (which pays for warm-up)."""
    vals = [r["samples_per_s"] for r in rows[1:]] or [r["samples_per_s"] for r in rows]
    return statistics.median(vals) if vals else None


def write_summary(path: str, summary: dict) -> None:
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    assert not missing, f"summary is missing {missing}"

    def clean(x):   # NaN/inf are not JSON: write null
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(clean(summary), f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- comm bytes

class StepCommWindow:
    """Per-op wire bytes per optimizer step, and the part of them sent to another node, from
    a cumulative counter.

    `snapshot` is a callable returning {op: {"wire_bytes": int, "inter_node_bytes": int, ...}}
    since start (minizero: engine.comm_stats(); DeepSpeed and PyTorch: reference/comm_counter.py,
    which splits by the same ring rule). Only the traffic *inside* a training step is added up
    (open() before the step's first forward, close() after engine.step()), so the init
    broadcasts, the codebook, the metrics all-reduce, evaluation, sampling and checkpointing
    stay out. The first step is skipped too (steady state only: hpZ's first forward gathers
    inside the node, later ones do not), unless it is the only one.
    """

    KEYS = ("wire_bytes", "inter_node_bytes")

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self.total: dict[str, dict[str, int]] = {k: {} for k in self.KEYS}
        self.first: dict[str, dict[str, int]] = {k: {} for k in self.KEYS}
        self.steps = 0
        self._start = None
        self._seen_first = False

    def open(self) -> None:
        self._start = self.snapshot()

    def close(self) -> None:
        end = self.snapshot()
        delta = {k: {op: end[op].get(k, 0) - self._start.get(op, {}).get(k, 0) for op in end} for k in self.KEYS}
        if not self._seen_first:
            self._seen_first, self.first = True, delta
            return
        for k in self.KEYS:
            for op, b in delta[k].items():
                self.total[k][op] = self.total[k].get(op, 0) + b
        self.steps += 1

    def per_step(self, key: str = "wire_bytes") -> dict:
        """{op: bytes per step, ..., "total": their sum} of `key` (wire_bytes or inter_node_bytes)."""
        total, steps = (self.total, self.steps) if self.steps else (self.first, 1 if self._seen_first else 0)
        out = {op: b / steps for op, b in sorted(total[key].items())} if steps else {}
        out["total"] = sum(out.values())
        return out


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(engine, loader, device) -> float:
    """Mean test loss over this rank's slice of the held-out split, averaged over ranks.
    Collective (ZeRO-3 gathers parameters in forward): every rank runs len(loader) forwards."""
    engine.eval()
    # Summed on the device in float64, read once at the end: no host sync per batch. The
    # same float64 additions, in the same order, as summing the Python floats of each loss.
    total, n = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in loader:
        _, loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        total += loss.detach().float().double()
        n += 1
    engine.train()
    return mean_across_ranks(float(total) / max(n, 1), device)


# ----------------------------------------------------------------------------- sampling

def first_token_probs(train_ds, ncluster: int, nest: int = 5000, seed: int = 0) -> torch.Tensor:
    """minGPT play_image: the distribution of the first pixel's token, estimated from `nest`
    random training images, counts starting at 1 ("smoothing")."""
    counts = torch.ones(ncluster)
    g = torch.Generator().manual_seed(seed)
    rp = torch.randperm(len(train_ds), generator=g)[:nest]
    first = train_ds.tokens[rp, 0].long() if hasattr(train_ds, "tokens") else \
        torch.stack([train_ds[int(i)][0][0] for i in rp])
    counts += torch.bincount(first, minlength=ncluster).float()
    return counts / counts.sum()


@torch.no_grad()
def sample_tokens(model, probs: torch.Tensor, n: int, image_size: int, device, top_k: int | None = 100,
                  seed: int = 0) -> torch.Tensor:
    """n images' worth of tokens: first pixel from `probs`, the rest from the model.

    Collective under ZeRO-3 (either library): the module's forward hooks gather each
    block's parameters, so every rank must call this, with the same n and image_size
    (the same number of forwards). The same seed on every rank gives the same images.
    """
    from minizero.gpt.model import sample

    # Sampling must not disturb the training RNG (dropout masks; exact resume): fork the
    # CPU generator and the device's. torch.manual_seed reseeds every CUDA generator too,
    # so restoring the CPU state alone would restart the GPU's dropout stream.
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                               device_type=device.type if device.type == "cuda" else "cuda"):
        torch.manual_seed(seed)
        start = torch.multinomial(probs, n, replacement=True)[:, None].to(device)
        return sample(model, start, image_size * image_size - 1, temperature=1.0, top_k=top_k)


def save_image_grid(tokens: torch.Tensor, codebook: torch.Tensor, image_size: int, path: str,
                    nrow: int = 8) -> None:
    """Decode tokens through the colour codebook and save them as one PNG grid."""
    import torchvision.utils as vutils
    from minizero.gpt.codebook import decode

    imgs = decode(tokens.cpu(), codebook, image_size)                 # (B, H, W, 3) uint8
    imgs = imgs.permute(0, 3, 1, 2).float() / 255.0                   # (B, 3, H, W) in [0, 1]
    # Tiny images are upscaled (nearest) so the grid is visible without zooming.
    scale = max(1, 64 // image_size)
    if scale > 1:
        imgs = torch.nn.functional.interpolate(imgs, scale_factor=scale, mode="nearest")
    vutils.save_image(imgs, path, nrow=nrow, padding=2, pad_value=1.0)


def write_samples(engine, probs, args, codebook, device, path) -> None:
    """minGPT play_image sampling; collective (all ranks sample, rank 0 writes)."""
    try:
        tokens = sample_tokens(engine.module, probs, args.num_samples, args.image_size, device,
                               top_k=args.top_k, seed=args.seed)
    except RuntimeError as e:
        # e.g. torch.multinomial on inf/NaN probabilities. Every rank holds the same weights
        # and seed, so every rank fails at the same forward: no collective is left waiting.
        if comm.get_rank() == 0:
            print(f"warning: {os.path.basename(path)} not written: sampling failed ({str(e).splitlines()[0]})",
                  file=sys.stderr)
        return
    if comm.get_rank() == 0:
        save_image_grid(tokens, codebook, args.image_size, path)


# ----------------------------------------------------------------------------- the end of a run

def finish(run, status: str) -> None:
    """Write metrics.csv and summary.json whatever happened; samples and the test loss only
    after a completed run. `status` is "completed", "diverged" (every rank stops at the same
    step, so collectives are safe) or anything else (an error: rank 0 writes what it has,
    without collectives, which could hang if another rank is gone). `run` is train.py's Run."""
    engine, state, device = run.engine, run.state, comm.get_device()
    together = status in ("completed", "diverged")
    comms_summary = run.lib.comms_summary   # Library.comms_summary: either library's comms logger table
    if together and comms_summary is not None:
        # before the final evaluation and sampling: their collectives are not training's
        report = comms_summary(run)
        if report is not None and comm.get_rank() == 0:
            write_comms_summary(run.save_dir, *report)
    # Model-state bytes first: evaluation and sampling call the module outside a training
    # step, after which DeepSpeed's ZeRO-3 leaves parameters gathered and would over-report.
    mine = run.lib.model_state_bytes(engine)
    model_state = comm.all_gather_object(mine) if together else [mine]
    moments = run.moments.result(together) if run.moments is not None else None
    test_loss = state["test_loss"]
    if status == "completed":
        if test_loss is None or state.get("eval_step") != state["step"]:   # e.g. resumed at the very end
            test_loss = evaluate(engine, run.test_loader, device)
        if run.args.num_samples:    # --num-samples 0: no grid (minizero.compare's runs: nothing compares it)
            write_samples(engine, run.probs, run.args, run.codebook, device,
                          os.path.join(run.save_dir, "samples.png"))
    peak = memory_mb(device)[1]
    peaks = comm.all_gather_object(peak) if together else [peak]
    # every rank's bytes sent to another node: on a ring rank 0 sends to rank 1, on its own node
    inter = run.window.per_step("inter_node_bytes")
    inters = comm.all_gather_object(inter) if together else [inter]
    if comm.get_rank() == 0:
        write_results(run, status, test_loss, model_state, peaks, moments, inters)
    if together and status != "completed":
        # The run stops with an error on every rank; the first rank to exit makes torchrun
        # kill the others, so nobody leaves before rank 0 has written the files.
        comm.barrier()


def write_comms_summary(save_dir: str, summary: dict, table: str) -> None:
    """Rank 0: the comms logger's numbers (comms_summary.json: {op name: {message bytes:
    {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps, msg_size_bytes,
    msg_size_str}}}, the "summary" of DeepSpeed's log_summary(return_dict=True)) and the
    table it prints (comms_summary.txt)."""
    with open(os.path.join(save_dir, "comms_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(save_dir, "comms_summary.txt"), "w") as f:
        f.write(table.rstrip("\n") + "\n")


def write_results(run, status: str, test_loss, model_state: list, peaks: list, moments: dict | None = None,
                  inters: list | None = None) -> None:
    """Rank 0: metrics.csv and summary.json, and the run's last line."""
    state, losses = run.state, run.state["losses"]
    write_metrics_csv(os.path.join(run.save_dir, "metrics.csv"), state["rows"])
    summary = {
        "library": run.lib.name, "status": status, "stage": run.stage, "dtype": run.dtype,
        "world_size": comm.get_world_size(), "model": run.args.model, "params": run.n_params,
        "steps": state["step"], "losses": losses, "final_loss": losses[-1] if losses else None,
        "test_loss": test_loss, "model_state_bytes": model_state, "peak_mem_mb": peaks,
        "samples_per_s": median_throughput(state["rows"]),
        "comm_wire_bytes_per_step": run.window.per_step(),
        "comm_inter_node_bytes_per_step": inters if inters is not None else [run.window.per_step("inter_node_bytes")],
        "ranks_per_node": comm.ranks_per_node(), "skipped_steps": int(run.engine.skipped_steps),
        "memory_moments": moments, "config": run.cfg,
    }
    write_summary(os.path.join(run.save_dir, "summary.json"), summary)
    wrote = "metrics.csv, summary.json" + (", samples.png" if status == "completed" and run.args.num_samples else "")
    if status == "completed":
        print(f"{run.lib.name}: {state['step']} steps, final loss {summary['final_loss']:.4f}, test loss "
              f"{test_loss:.4f}, {summary['samples_per_s'] or 0:.1f} samples/s; wrote {wrote} to {run.save_dir}")
    else:
        print(f"{run.lib.name}: stopped at step {state['step']} ({status}); wrote {wrote} to {run.save_dir}",
              file=sys.stderr)
