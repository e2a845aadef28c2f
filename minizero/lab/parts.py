"""The lab's parts: the pieces each removes, the runs that grade it, and what a difference means.

A part is a few functions of the core (`Hole`: file, qualified name, the task's hint) and the
scenarios that exercise them (`Scenario`: a ZeRO config on 2 ranks, the micro GPT of
`python -m minizero.selftest`, fp32, 3 steps unless it says otherwise). run.py runs each
scenario with the student's files and with minizero's, grade.py turns each pair into `Facts`; the
part's `diagnose` reads the facts and says, in the lesson's terms, what a difference means.
The checks themselves (losses, weights, bytes per collective, memory) are the same for every
part; the diagnoses are what a student needs to hear.
"""
from __future__ import annotations

import logging

import os
from dataclasses import dataclass, field

CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # minizero/


@dataclass(frozen=True)
class Hole:
    file: str        # a file of minizero/'s top level
    qualname: str    # "Zero1.reduce", "padded_numel"
    task: str        # the hint written above the removed body


@dataclass(frozen=True)
class Scenario:
    name: str
    stage: int
    zero: dict = field(default_factory=dict)   # zero_optimization overrides
    gas: int = 1                               # gradient accumulation steps
    fp16: dict | None = None                   # the fp16 section (None: fp32)
    checkpoint: bool = False                   # activation checkpointing of every block
    steps: int = 3
    deepspeed: bool = False                    # DeepSpeed runs the same config (the selftest's): compare losses

    def describe(self) -> str:
        knobs = ", ".join(f"{k} {v}" for k, v in self.zero.items())
        extra = [f"A = {self.gas}" if self.gas > 1 else "", "fp16" if self.fp16 else "fp32",
                 "activation checkpointing" if self.checkpoint else "", knobs]
        return f"stage {self.stage}, " + ", ".join(e for e in extra if e) + f", {self.steps} steps"


@dataclass
class Facts:
    """One scenario, the student's run against minizero's (grade.compare fills it)."""
    scenario: Scenario
    error: str | None = None          # the student's run raised: one line, where
    error_ops: dict = field(default_factory=dict)      # its calls per collective until it raised
    losses_equal: bool = True
    first_loss_diff: int | None = None   # 1-based step
    weights_equal: bool = True
    weights_differ: list = field(default_factory=list)
    ops: dict = field(default_factory=dict)            # op -> ((calls, bytes, wire) student, minizero), last step
    in_backward: dict = field(default_factory=dict)    # op -> (student, minizero): issued from autograd's backward, per micro-step
    calls_per_step: dict = field(default_factory=dict)  # op -> (student, minizero): calls in each step
    labels_equal: bool = True
    label_diff: str = ""
    memory: dict = field(default_factory=dict)         # moment -> (student's breakdown, minizero's)
    peak_gathered: tuple = (0, 0)                      # (student, minizero) bytes of parameters gathered, at the peak
    loss_scales: tuple = ((), ())                      # (student, minizero) after each step
    deepspeed: str | None = None                       # "equal", "differ at step k", or None (not run)

    def op_differs(self, op: str) -> bool:
        got, want = self.ops.get(op, ((0, 0, 0), (0, 0, 0)))
        return got != want

    def calls(self, op: str) -> tuple[int, int]:
        got, want = self.ops.get(op, ((0, 0, 0), (0, 0, 0)))
        return got[0], want[0]

    def wire(self, op: str) -> tuple[int, int]:
        got, want = self.ops.get(op, ((0, 0, 0), (0, 0, 0)))
        return got[2], want[2]

    @property
    def passed(self) -> bool:
        return (self.error is None and self.losses_equal and self.weights_equal and not any(
            self.op_differs(op) for op in self.ops) and self.labels_equal
            and all(a == b for a, b in self.in_backward.values())
            and all(a == b for a, b in self.memory.values()) and self.peak_gathered[0] == self.peak_gathered[1]
            and self.loss_scales[0] == self.loss_scales[1] and self.deepspeed in (None, "equal"))


@dataclass(frozen=True)
class Part:
    title: str
    task: str
    holes: tuple
    scenarios: tuple
    diagnose: object      # (Facts) -> list[str]
    unit_checks: object = None   # () -> list of (check, ok, detail), run in the grading process (no ranks)


def _bytes(n: int) -> str:
    return f"{n:,} bytes"


def _error_hints(f: Facts, hints: list[tuple[str, str]]) -> list[str]:
    """For a run that raised: the hint of the first pattern found in its error, else the error."""
    if f.error is None:
        return []
    if "NotImplementedError" in f.error:
        return [f"not written yet: {f.error.split('NotImplementedError: ', 1)[-1].split(':')[0]} still raises "
                f"NotImplementedError"]
    for pattern, hint in hints:
        if pattern in f.error:
            return [hint]
    return [f"the run raised {f.error}"]


# ----------------------------------------------------------------------------- partition

def partition_unit_checks(student, real) -> list[tuple[str, bool, str]]:
    """The arithmetic against minizero's own, on sizes that pad and sizes that do not."""
    cases = [(numel, n) for numel in (1, 7, 8, 100, 1_000_003, 15_099) for n in (1, 2, 3, 4, 8, 64)]
    out = []
    for fn, args_of in (("padded_numel", lambda c: [c]), ("shard_numel", lambda c: [c]),
                        ("shard_range", lambda c: [c + (r,) for r in range(c[1])])):
        bad = None
        for case in cases:
            for args in args_of(case):
                try:
                    got = getattr(student, fn)(*args)
                except Exception as e:   # a student's function may raise anything
                    got = f"{type(e).__name__}: {e}"
                want = getattr(real, fn)(*args)
                if got != want:
                    bad = (args, got, want)
                    break
            if bad:
                break
        detail = "" if bad is None else f"{fn}{bad[0]} = {bad[1]}, should be {bad[2]}"
        out.append((fn, bad is None, detail))
    return out


def diagnose_partition(f: Facts) -> list[str]:
    same_size = ("a collective's buffers do not fit together: a gather's output must be N slices of one size, "
                 "so each flat buffer is padded to padded_numel (a multiple of N) and every slice holds shard_numel "
                 "= padded_numel / N elements")
    msgs = _error_hints(f, [("shape", same_size), ("AssertionError", same_size), ("size", same_size)])
    if not f.error and not all(a == b for a, b in f.memory.values()):
        msgs.append("the bytes a rank holds differ from minizero's: each flat buffer is padded up to a multiple of "
                    "N (padded_numel) and rank r holds shard_numel elements of it")
    if not f.error and not f.losses_equal:
        msgs.append(f"the losses part from step {f.first_loss_diff}: a rank updated elements it does not own, or "
                    f"left some of its own out (shard_range)")
    return msgs


def partition_messages(checks: list) -> list[str]:
    msgs = []
    for name, ok, detail in checks:
        if ok:
            continue
        if name == "padded_numel":
            msgs.append(f"{detail}: the padded length is the smallest multiple of N at least numel, so that all N "
                        f"slices have one size (all_gather_into_tensor and reduce_scatter_tensor need it)")
        elif name == "shard_numel":
            msgs.append(f"{detail}: each rank holds ceil(numel / N) elements; rounding down leaves the last "
                        f"elements to no rank")
        else:
            msgs.append(f"{detail}: rank r's slice is [r * s, (r + 1) * s) with s = shard_numel, end excluded; "
                        f"the slices of the N ranks tile the padded buffer")
    return msgs


# ----------------------------------------------------------------------------- zero1

def diagnose_zero1(f: Facts) -> list[str]:
    ALL_REDUCED = ("you all-reduced where a reduce-scatter belongs: rank r needs only slice r of the summed "
                   "gradient, and an all-reduce hands it the whole bucket (Zero1.reduce: FlatParam.reduce_scatter_grad "
                   "leaves each rank the average of its own slice)")
    if f.error and f.error_ops.get("all_reduce", 0) > 1 and f.error_ops.get("reduce_scatter", 0) == 0:
        return [f"the optimizer got a gradient the size of a whole bucket, not of this rank's slice ({f.error}): "
                + ALL_REDUCED]
    msgs = _error_hints(f, [
        ("'NoneType' object", IN_FLIGHT),
        ("size", "the gradient the optimizer got is not this rank's slice: a reduce-scatter leaves each rank the "
                 "sum of its own slice only (FlatParam.reduce_scatter_grad)"),
    ])
    ar, rs, ag = f.calls("all_reduce"), f.calls("reduce_scatter"), f.calls("all_gather")
    if ar[0] > ar[1] and rs[0] < rs[1]:
        msgs.append(f"ZeRO-1 moved {_bytes(f.wire('all_reduce')[0])} in all-reduces where minizero moves "
                    f"{_bytes(f.wire('all_reduce')[1])}: " + ALL_REDUCED)
    if not f.error and ag[0] < ag[1]:
        msgs.append(f"{ag[0]} all-gathers after the step where minizero makes {ag[1]}: each rank updated only its "
                    f"own slice, so without the all-gather the other slices of its weights keep their old values"
                    + (f" (the losses part from step {f.first_loss_diff})" if f.first_loss_diff else "")
                    + ": Zero1.after_step gathers every FlatParam kept whole")
    elif not f.error and ag[0] > ag[1]:
        msgs.append(f"{ag[0]} all-gathers in a step where minizero makes {ag[1]}: one per bucket, after the step")
    if not f.error and rs[0] > rs[1]:
        msgs.append(f"{rs[0]} reduce-scatters in a step where minizero makes {rs[1]}: one per bucket per step")
    if not msgs and not f.error and not f.losses_equal:
        msgs.append(f"the same collectives, but the losses part from step {f.first_loss_diff}: " + IN_FLIGHT)
    return msgs


IN_FLIGHT = ("a reduction issued asynchronously (at the step every bucket's is, back to back; with overlap_comm "
             "from the backward hooks) is complete only once its wait() has run, and the wait is what puts the "
             "averaged slice into grad_shard: `reduce` must return what reduce_scatter_grad returns, so that "
             "GradBuckets waits for it")


# ----------------------------------------------------------------------------- zero2

def diagnose_zero2(f: Facts) -> list[str]:
    msgs = _error_hints(f, [
        ("'NoneType' object", "a reduction was still in flight when the step read its result: finish_backward must "
                              "wait for every reduction issued (GradBuckets.wait)"),
    ])
    rs = f.calls("reduce_scatter")
    inside = f.in_backward.get("reduce_scatter")
    per_step = f.calls_per_step.get("reduce_scatter")
    if not f.error and per_step and per_step[0][0] == per_step[1][0] and any(
            g < w for g, w in zip(per_step[0][1:], per_step[1][1:])):
        return msgs + [f"reduce-scatters per step {list(per_step[0])}, minizero {list(per_step[1])}: the first step's "
                       f"backward reduced every bucket, the later ones fewer. Reset every bucket's count before each "
                       f"backward (prepare_backward calls start_backward, which also clears its `reduced` mark)"]
    if not f.error and rs[0] > rs[1]:
        msgs.append(f"{rs[0]} reduce-scatters where minizero makes {rs[1]}: a bucket was reduced more than once in "
                    f"a backward. Issue it once, when its last gradient arrives; issue() marks it reduced "
                    f"(Bucket.post_backward), and finish_backward reduces only the buckets not marked")
    elif not f.error and rs[0] < rs[1]:
        msgs.append(f"{rs[0]} reduce-scatters where minizero makes {rs[1]}: every bucket is reduced in every "
                    f"micro-step's backward at ZeRO-2; finish_backward reduces those whose hook never fired")
    if inside and inside[0] != inside[1] and rs[0] == rs[1]:
        got, want = inside
        if sum(got) == 0:
            msgs.append("no bucket was reduced inside backward (every reduce-scatter ran after autograd's backward had "
                        "returned): ZeRO-2 reduce-scatters a bucket from the hook of its "
                        "last gradient (hook_for: count the arrivals with gradient_arrived, issue when it says this "
                        "was the last), so its full gradients can be dropped while backward goes on; reducing "
                        "everything after backward is ZeRO-1's order")
        elif got[0] == want[0] and any(g < w for g, w in zip(got[1:], want[1:])):
            msgs.append(f"from the second micro-step on, fewer buckets were reduced inside backward ({got} per "
                        f"micro-step, minizero {want}): reset every bucket's count before each backward "
                        f"(prepare_backward calls start_backward, which also clears its `reduced` mark)")
        else:
            msgs.append(f"reduce-scatters issued inside backward, per micro-step: {got}, minizero {want}")
    if not f.error and not f.losses_equal and rs[0] == rs[1]:
        msgs.append(f"the losses part from step {f.first_loss_diff} though the collectives are the same: a bucket "
                    f"was reduced before all its gradients had arrived, and the missing ones went in as zeros. "
                    f"gradient_arrived is True for the bucket's last parameter only")
    end = f.memory.get("end of backward")
    if end and end[0].get("grads") != end[1].get("grads"):
        msgs.append(f"at the end of backward a rank holds {_bytes(end[0]['grads'])} of gradients where minizero "
                    f"holds {_bytes(end[1]['grads'])}: ZeRO-2 keeps only its reduced slice of each bucket "
                    f"(Zero2.grad_bytes counts shard_numel elements, not numel)")
    return msgs


# ----------------------------------------------------------------------------- zero3

def diagnose_zero3(f: Facts) -> list[str]:
    msgs = _error_hints(f, [
        ("shape", "backward found a unit's parameters freed (a zero-size placeholder): post_forward must hook the "
                  "unit's outputs (on_backward(output, self.pre_backward)) so that the unit is gathered again "
                  "before its backward"),
        ("size", "backward found a unit's parameters freed (a zero-size placeholder): post_forward must hook the "
                 "unit's outputs (on_backward(output, self.pre_backward)) so that the unit is gathered again before "
                 "its backward"),
        ("KeyError", "a unit freed twice, or freed without being gathered: reshard does nothing for a SHARDED unit, "
                     "and takes itself off live.units only when it was on it"),
    ])
    ag, rs = f.calls("all_gather"), f.calls("reduce_scatter")
    if not f.error and rs[0] > rs[1]:
        msgs.append(f"{rs[0]} reduce-scatters where minizero makes {rs[1]}: a unit's gradients were reduced twice. "
                    f"post_backward must call Bucket.post_backward (super().post_backward()), which marks the unit "
                    f"reduced, so finish_backward does not reduce it again")
    if not f.error and ag[0] < ag[1]:
        msgs.append(f"{ag[0]} all-gathers where minizero makes {ag[1]}: a unit computed with parameters nobody "
                    f"gathered this time (unshard all-gathers every partitioned FlatParam: f.all_gather(label=why)), "
                    f"or one was never freed and so never gathered again")
    elif not f.error and ag[0] > ag[1]:
        msgs.append(f"{ag[0]} all-gathers where minizero makes {ag[1]}: a unit was gathered when it already was")
    got, want = f.peak_gathered
    if not f.error and got > want:
        msgs.append(f"{_bytes(got)} of parameters were gathered at once where minizero holds at most {_bytes(want)}: "
                    f"a unit is not freed after use. post_forward and post_backward release it (_release), and "
                    f"reshard frees the full buffers (FlatParam.release_full)")
    if not f.error and not f.labels_equal:
        msgs.append(f"the gathers' labels differ ({f.label_diff}): the label says why a unit is gathered, 'fwd' "
                    f"before its forward, 'bwd' before its backward, 'recompute' when activation checkpointing "
                    f"runs its forward again inside backward (checkpointing.in_recompute())")
    if not msgs and not f.error and not f.losses_equal:
        msgs.append(f"the same collectives, but the losses part from step {f.first_loss_diff}: a unit computed on "
                    f"parameters still being gathered (wait_unshard before use)")
    return msgs


# ----------------------------------------------------------------------------- fp16

SCALER_CASES = {
    # name: (scaler arguments, the overflow pattern, step by step)
    "hysteresis 2, three overflows, then clean": (dict(init_scale=2 ** 16, scale_window=4, min_scale=1, delayed_shift=2),
                                                  [True, True, True] + [False] * 12),
    "overflow after clean steps, before any doubling": (dict(init_scale=2 ** 10, scale_window=3, min_scale=1,
                                                             delayed_shift=2), [True, False, False, True] + [False] * 8),
    "hysteresis 1, window 2": (dict(init_scale=2 ** 8, scale_window=2, min_scale=1, delayed_shift=1),
                               [True, False, False, False, True, False, False, False, False, False]),
    "down to the minimum": (dict(init_scale=4, scale_window=1000, min_scale=1, delayed_shift=2), [True] * 5),
}


def scaler_trajectory(cls, error_cls, kwargs: dict, pattern: list) -> list:
    """(scale, budget) after each update; "raised <Error>" where the update raised. The
    scaler's "OVERFLOW! ... Skipping step" lines are held back (the "minizero" logger, which
    the student's copy of fp16.py logs to as well): a grade prints its verdicts, not the
    overflows it provoked on purpose."""
    log = logging.getLogger("minizero")
    was, log.disabled = log.disabled, True
    s = cls(**kwargs)
    out = []
    try:
        for overflow in pattern:
            try:
                s.update_scale(overflow)
            except Exception as e:   # the real one raises MinLossScaleError at the minimum
                out.append(f"raised {'MinLossScaleError' if isinstance(e, error_cls) else type(e).__name__}")
                break
            out.append((float(s.cur_scale), int(getattr(s, "cur_hysteresis", 0))))
    finally:
        log.disabled = was
    return out


def fp16_messages(case: str, kwargs: dict, pattern: list, got: list, want: list) -> list[str]:
    step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    g = got[step] if step < len(got) else "nothing"
    w = want[step] if step < len(want) else "nothing"
    head = (f"{case}: after update {step + 1} ({'an overflow' if pattern[step] else 'a clean step'}) the scaler holds "
            f"{g} (scale, hysteresis budget) where DeepSpeed's rules give {w}")
    if isinstance(w, str) and w.startswith("raised"):
        return [f"{head}: an overflow at min_scale must raise MinLossScaleError (DeepSpeed's "
                f"raise_error_at_min_scale): the gradients are inf even unscaled"]
    if isinstance(g, str) or isinstance(w, str):
        return [head]
    (gs, gb), (ws, wb) = g, w
    if pattern[step] and gs < ws:
        return [f"{head}: with hysteresis h the first h-1 overflows only use up the budget (cur_hysteresis -= 1) "
                f"and the scale stays; only an overflow with the budget at 1 halves it"]
    if pattern[step] and gs > ws:
        return [f"{head}: an overflow with the budget used up halves the scale (never below min_scale)"]
    if not pattern[step] and gs != ws:
        return [f"{head}: the scale doubles at the clean step that follows scale_window clean steps since the last "
                f"overflow (cur_iter - last_overflow_iter - 1 a positive multiple of scale_window), and at no other"]
    if gb != wb:
        return [f"{head}: only a doubling refills the hysteresis budget (unless consecutive_hysteresis); a clean "
                f"step alone does not"]
    return [head]


def diagnose_fp16(f: Facts) -> list[str]:
    msgs = _error_hints(f, [])
    if not f.error and f.loss_scales[0] != f.loss_scales[1]:
        msgs.append(f"the engine's loss scale after each step: {list(f.loss_scales[0])}, minizero's "
                    f"{list(f.loss_scales[1])}")
    return msgs


# ----------------------------------------------------------------------------- the parts

BASE3 = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
FP16 = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 1}

PARTS = {
    "partition": Part(
        "the padding and slice arithmetic",
        "Every flat buffer is padded to a multiple of N and cut into N equal, contiguous slices; rank r owns "
        "slice r (lesson part 1, worksheet 1.3). Write the three functions every stage's layout is computed with.",
        (Hole("partition.py", "padded_numel", "the smallest multiple of world_size that is at least numel."),
         Hole("partition.py", "shard_numel", "the elements each rank holds: the padded length over world_size."),
         Hole("partition.py", "shard_range", "[start, end) of rank's slice of the padded buffer; the slices of "
                                             "all ranks tile it, in rank order.")),
        (Scenario("ZeRO-1", 1, deepspeed=True), Scenario("ZeRO-3", 3, BASE3, deepspeed=True)),
        diagnose_partition),
    "zero1": Part(
        "ZeRO-1's reduce-scatter, and its all-gather after the step",
        "Stage 0 all-reduces each bucket's gradient; ZeRO-1 gives rank r only the average of slice r, steps on it, "
        "and gathers the new slices after the step (lesson part 2, the first projection). Write the collective on "
        "one bucket's gradient, and what happens after the optimizer step.",
        (Hole("zero1.py", "Zero1.reduce", "the collective on one bucket's gradient at ZeRO-1: rank r keeps only the "
                                          "rank-averaged slice r (FlatParam's methods do the work; with async_op, "
                                          "return what is still in flight)."),
         Hole("zero1.py", "Zero1.after_step", "every rank updated only its slice: bring every rank's new slices "
                                              "back, for the FlatParams every rank keeps whole."),
         Hole("zero1.py", "Zero1.gather_whole", "gather these FlatParams (flat_param.py has the helper).")),
        (Scenario("ZeRO-1", 1, deepspeed=True), Scenario("ZeRO-1, overlap_comm", 1, {"overlap_comm": True}),
         Scenario("ZeRO-1, accumulation", 1, gas=2)),
        diagnose_zero1),
    "zero2": Part(
        "the per-bucket hook, and what a ZeRO-2 rank holds",
        "ZeRO-2 reduce-scatters a bucket in every micro-step's backward as soon as its last gradient has arrived, "
        "and drops the bucket's full gradients (lesson part 2, the second projection; part 4 for accumulation). "
        "Write the counting, the hook, the end of backward, and the gradient bytes a rank holds.",
        (Hole("buckets.py", "Bucket.gradient_arrived", "one more of the bucket's parameters has its gradient: "
                                                       "count it, and say whether it was the last."),
         Hole("buckets.py", "GradBuckets.prepare_backward", "before each micro-step's backward: whether its hooks "
                                                            "reduce, and every bucket's count back to zero."),
         Hole("buckets.py", "GradBuckets.hook_for", "the post-accumulate-grad hook of bucket b's parameters: when "
                                                    "the hooks are active and b's last gradient arrives, issue b."),
         Hole("buckets.py", "GradBuckets.finish_backward", "after backward: issue the buckets whose hook never "
                                                           "fired, in bucket order, then wait for every reduction."),
         Hole("zero2.py", "Zero2.grad_bytes", "the gradient bytes a ZeRO-2 rank holds at the end of backward.")),
        (Scenario("ZeRO-2", 2, deepspeed=True), Scenario("ZeRO-2, overlap_comm, accumulation", 2,
                                                         {"overlap_comm": True}, gas=2)),
        diagnose_zero2),
    "zero3": Part(
        "a unit's gather and free, and its four hooks",
        "At ZeRO-3 a unit (a block, or the root) is gathered before its forward, freed after it, gathered again "
        "before its backward and freed once its gradients are issued (lesson part 2: the third projection and "
        "`Unit`'s hooks; part 7 for the recompute). Write the two moves and the four hooks.",
        (Hole("unit.py", "Unit.unshard", "all-gather the unit's partitioned FlatParams (label: why), keep the live "
                                         "count, and set the state (asynchronous: UNSHARDING, with its Pendings)."),
         Hole("unit.py", "Unit.reshard", "free the full buffers (after any gather in flight), take the unit off the "
                                         "live count, SHARDED again; nothing to do if it is SHARDED."),
         Hole("unit.py", "Unit.pre_forward", "the unit is about to run forward: fetch it (why: 'recompute' inside "
                                             "checkpointing's backward, else 'fwd')."),
         Hole("unit.py", "Unit.post_forward", "the forward is done: release the unit; hook the outputs so that "
                                              "backward reaching them calls pre_backward (an evaluation forward ends "
                                              "with nothing gathered)."),
         Hole("unit.py", "Unit.pre_backward", "backward reached the unit's outputs: fetch it."),
         Hole("unit.py", "Unit.post_backward", "the unit's gradients are issued: mark the bucket reduced, release "
                                               "the unit.")),
        (Scenario("ZeRO-3", 3, BASE3, deepspeed=True),
         Scenario("ZeRO-3, prefetch and reuse", 3, {"stage3_prefetch_bucket_size": 50_000_000,
                                                    "stage3_max_reuse_distance": 1_000_000_000, "overlap_comm": True}),
         Scenario("ZeRO-3, activation checkpointing", 3, BASE3, checkpoint=True)),
        diagnose_zero3),
    "fp16": Part(
        "the dynamic loss scaler's update",
        "After every step DeepSpeed's scaler halves the scale on an overflow (after the hysteresis budget), and "
        "doubles it after a window of clean steps (lesson part 6). Write the update.",
        (Hole("fp16.py", "DynamicLossScaler.update_scale", "one step's update of cur_scale, cur_hysteresis, "
                                                           "last_overflow_iter and cur_iter (the module docstring "
                                                           "has the rules), logging the overflow line on rank 0."),),
        (Scenario("ZeRO-2, fp16", 2, fp16=FP16, steps=8),),
        diagnose_fp16),
}
