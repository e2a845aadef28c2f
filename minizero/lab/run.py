"""The student's code, run: their files in place of minizero's, beside minizero's own, on 2 ranks.

One launch of 2 ranks runs many variants (the answer key, the student's copy, or every seeded
mistake of the tests), part after part. Before each variant the rank forgets minizero's core
modules (`use`) and an import hook (`StudentFiles`) hands out the student's file for each module
the part covers, so `minizero.engine` and everything it imports is built again on the
student's code, nothing patched. Each scenario (parts.Scenario) builds an engine, trains the
micro GPT a few steps and records what the lesson measures: every loss, digests of the final
fp32 weights, each step's collectives (op, label, bytes, and the phase they ran in, through
comm's observer seam), `engine.memory_breakdown()` at the end of the last backward and after
the step, and the parameter bytes gathered at the peak. grade.py judges what this records.

A student's mistake may raise, on every rank alike (then they stay in step and the launch
goes on), or on one rank only; the ranks tell each other how each scenario ended through the
process group's store (no collective), and a launch where they disagree stops and is started
again for the variants left, so one rank stuck in a collective its peer never joins costs the
collective timeout once (GLOO_TIMEOUT_S), never a hang.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
import traceback

from .parts import PARTS, Scenario

WORLD = 2
GLOO_TIMEOUT_S = 30.0
KEEP = ("minizero", "minizero.launcher_env", "minizero.version", "minizero.process_group")


# ----------------------------------------------------------------------------- the student's files

class StudentFiles(importlib.abc.MetaPathFinder):
    """Import minizero.<module> from the student's file, for the modules given."""

    def __init__(self, files: dict):
        self.files = files   # "minizero.zero1" -> path

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.files:
            return importlib.util.spec_from_file_location(fullname, self.files[fullname])
        return None


class CompiledOnce(importlib.machinery.SourceFileLoader):
    """minizero's own sources, compiled once per process however often `use` re-imports them.

    A rank re-imports minizero for every variant it runs (dozens per launch). Python reuses a
    compiled module only through a .pyc file, and writes none under PYTHONDONTWRITEBYTECODE
    (common in containers): then every re-import compiled each file again, a third of a rank's
    time. Code objects are immutable, so one compiled file can build many fresh modules; the
    key holds the file's size and modification time, so an edited file is compiled again."""

    compiled: dict = {}

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in self.compiled:
            self.compiled[key] = super().get_code(fullname)
        return self.compiled[key]


class MinizeroSources(importlib.abc.MetaPathFinder):
    """Find minizero.<module> where Python would, and load it with CompiledOnce."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("minizero.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = CompiledOnce(spec.loader.name, spec.loader.path)
        return spec


def use(files: dict) -> None:
    """Forget minizero's modules (but this room's, the launcher's and the process group's),
    and from now on import the student's `files` ({"minizero.zero1": path}) in their place
    (StudentFiles first), every other module from minizero's own sources (MinizeroSources)."""
    for name in list(sys.modules):
        if name.startswith("minizero.") and name not in KEEP and not name.startswith(("minizero.lab", "minizero.runtime")):
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, (StudentFiles, MinizeroSources))]
    sys.meta_path.insert(0, MinizeroSources())
    if files:
        sys.meta_path.insert(0, StudentFiles(files))
    importlib.invalidate_caches()


def student_files(part: str, folder: str | None) -> dict:
    """The modules a part takes from the student's folder ({} for minizero's own)."""
    if folder is None:
        return {}
    files = {}
    for hole in PARTS[part].holes:
        path = os.path.abspath(os.path.join(folder, hole.file))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file; `python -m minizero.lab make {folder}` writes the copy")
        files["minizero." + hole.file[:-3]] = path
    return files


# ----------------------------------------------------------------------------- inside a rank

class Watch:
    """comm's observer: each collective with the phase it ran in and the micro-step, and the
    parameter bytes gathered (ZeRO-3's partitioned FlatParams), sampled at every event."""

    def __init__(self):
        self.engine, self.phases, self.events, self.micro, self.peak = None, [], [], -1, 0

    def engine_ready(self, engine):
        self.engine = engine

    def phase_begins(self, name, engine):
        if name == "backward":
            self.micro += 1
        self.phases.append(name)
        self.sample()

    def phase_ends(self, name, engine):
        if self.phases:
            self.phases.pop()
        self.sample()

    def begin(self, op, label, tensor, nbytes, group):
        import torch
        # "backward" only while autograd's engine runs (a hook issued it), not in what the
        # engine's backward does after loss.backward() returns (finish_backward)
        phase = self.phases[0] if self.phases else ""
        if phase == "backward" and torch._C._current_graph_task_id() == -1:
            phase = "after backward"
        self.events.append((op, label, phase, self.micro))
        self.sample()

    def sample(self):
        if self.engine is not None:
            held = sum(f.full.untyped_storage().nbytes() for f in self.engine.zero.flat_params if not f.persistent)
            self.peak = max(self.peak, held)

    def start_step(self):
        self.events, self.micro, self.peak = [], -1, 0
        self.sample()


PROGRESS: dict = {}


def ops_since_start() -> dict:
    """Calls per collective since the running scenario's engine was built (for a run that raised)."""
    from minizero import comm
    now, start = comm.ledger.snapshot(), PROGRESS.get("since")
    if start is None:
        return {}
    return {op: now[op]["calls"] - start[op]["calls"] for op in ("all_gather", "reduce_scatter", "all_reduce")}


def run_scenario(sc: Scenario) -> dict:
    """Build an engine on whatever minizero/ now holds and train `sc`; what the lesson measures."""
    import torch
    import torch.distributed as dist

    import minizero
    from minizero import checkpointing, comm
    from minizero.runtime import selftest
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = selftest.config(sc.stage)
    cfg["zero_optimization"].update(sc.zero)
    cfg["gradient_accumulation_steps"] = sc.gas
    if sc.fp16:
        cfg["fp16"] = dict(sc.fp16)
    watch = Watch()
    comm.subscribe(watch)
    try:
        model, groups = selftest._built()
        if sc.checkpoint:
            cfg["activation_checkpointing"] = {}
            model.checkpoint_fn = checkpointing.checkpoint
        engine, *_ = minizero.initialize(model=model, model_parameters=groups, config=cfg)
        PROGRESS["since"] = comm.ledger.snapshot()   # what the training issued, should it raise
        out = {"losses": [], "mean_losses": [], "steps": [], "loss_scales": []}
        for step in range(sc.steps):
            last = step == sc.steps - 1
            watch.start_step()
            before = comm.ledger.snapshot()
            losses = []
            for micro in range(sc.gas):
                x, y = selftest.Batches()(step, micro, rank, world)
                loss = engine(x, y)[1]
                engine.backward(loss)
                if last and micro == sc.gas - 1:
                    out["memory_end_of_backward"] = _memory(engine)
                engine.step()
                losses.append(float(loss.detach()))
            after = comm.ledger.snapshot()
            t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
            dist.all_reduce(t)   # the mean over ranks, as DeepSpeed's runner reports it (not counted: not minizero's)
            out["losses"].append(losses)
            out["mean_losses"].append(float(t.item()) / world)
            out["loss_scales"].append(float(engine.loss_scale))
            out["steps"].append({op: [after[op][k] - before[op][k] for k in ("calls", "bytes", "wire_bytes")]
                                 for op in ("all_gather", "reduce_scatter", "all_reduce")})
            if last:
                out["events"] = list(watch.events)
                out["peak_gathered"] = watch.peak
                out["memory_after_step"] = _memory(engine)
        state = engine.full_fp32_state_dict()
        out["weights"] = {k: hashlib.sha256(v.detach().float().contiguous().numpy().tobytes()).hexdigest()
                          for k, v in state.items()}
        return out
    finally:
        comm.unsubscribe(watch)


def _memory(engine) -> dict:
    b = engine.memory_breakdown()
    return {k: int(b[k]) for k in ("params", "grads", "master_params", "optimizer_states")}


def _where(tb, files: dict) -> str:
    """The deepest frame of the traceback in one of the student's files (file:line), else ''."""
    paths = set(files.values())
    frames = [f for f in traceback.extract_tb(tb) if f.filename in paths]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno}, {f.name})"


def _agree(store, key: str, status: str, world: int) -> bool:
    """Every rank ended this scenario the same way? Through the store: no collective."""
    rank = _rank()
    store.set(f"{key}/{rank}", status)
    try:
        store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=GLOO_TIMEOUT_S + 10))
    except Exception:   # a peer is stuck: this launch ends here
        return False
    return all(store.get(f"{key}/{r}").decode() == status for r in range(world))


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def rank_main(jobs: list, launch: int) -> dict:
    """On each rank: every (variant, part, files, scenario names or None for all) job in order.
    Stops early (the parent starts the rest again) when the ranks disagree on how a scenario ended."""
    import torch
    import torch.distributed as dist

    import logging

    from minizero import process_group
    process_group.init_distributed("gloo", timeout_s=GLOO_TIMEOUT_S)
    logging.getLogger("minizero").setLevel(logging.WARNING)   # the engines' notes are not the grade
    store = dist.distributed_c10d._get_default_store()
    torch.set_num_threads(1)
    done = []
    for j, (variant, part, files, names) in enumerate(jobs):
        result = {}
        scenarios = [sc for sc in PARTS[part].scenarios if names is None or sc.name in names]
        use(files)   # minizero's modules built again on this job's files (a scenario that raised: again)
        for s, sc in enumerate(scenarios):
            if s and status != "ok":
                use(files)
            PROGRESS.clear()
            try:
                result[sc.name] = run_scenario(sc)
                status = "ok"
            except Exception as e:
                line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                result[sc.name] = {"error": line + _where(e.__traceback__, files), "error_ops": ops_since_start()}
                from minizero import comm
                status = f"error {comm.ledger.snapshot()['all_gather']['calls']} {type(e).__name__}"
            if not _agree(store, f"lab/{launch}/{j}/{s}", status, dist.get_world_size()):
                for rest in scenarios[s + 1:]:
                    result[rest.name] = {"error": "not run: the ranks disagreed on an earlier scenario"}
                done.append((variant, part, result))
                use({})
                return {"done": done, "complete": False, "cpu_s": time.process_time()}
        done.append((variant, part, result))
    use({})
    return {"done": done, "complete": True, "cpu_s": time.process_time()}


# ----------------------------------------------------------------------------- in the grading process

LAUNCHES: list = []   # (jobs asked, jobs done, each rank's CPU seconds) per launch of the last grading


def run_variants(jobs: list) -> dict:
    """{(variant, part): {scenario: result}} for every job, on 2 ranks: one launch, and one
    more after each launch the ranks had to stop."""
    from minizero.runtime import spawn
    results, left, launch = {}, list(jobs), 0
    LAUNCHES.clear()
    while left:
        per_rank = spawn.run_ranks(rank_main, WORLD, (left, launch), backend="gloo", group=False,
                                   env={"DS_ACCELERATOR": "cpu"}, timeout=600)
        merged = _merge([r["done"] for r in per_rank])
        LAUNCHES.append((len(left), len(merged), [r["cpu_s"] for r in per_rank]))
        for (variant, part), res in merged.items():
            results[(variant, part)] = res
        finished = {(v, p) for v, p in merged}
        left = [j for j in left if (j[0], j[1]) not in finished]
        launch += 1
    return results


def _merge(per_rank_done: list) -> dict:
    """The ranks' results, side by side: {(variant, part): {scenario: [rank 0's, rank 1's]}},
    for the jobs every rank reported."""
    common = min(len(d) for d in per_rank_done)
    out = {}
    for i in range(common):
        variant, part, _ = per_rank_done[0][i]
        scenarios = per_rank_done[0][i][2]
        out[(variant, part)] = {sc: [d[i][2].get(sc, {"error": "not run: the other rank stopped first"})
                                     for d in per_rank_done] for sc in scenarios}
    return out
