"""Typical wrong answers to each part, and what the autograder must say to each.

Each mistake is minizero's own file with one edit a student plausibly makes (the old text,
which must appear exactly once, and the new), and a phrase the grade's messages must hold.
`python -m minizero.lab check PART --mistake K` grades mistake K of a part (an instructor sees
what a student would be told); tests/tools/test_lab.py grades them all, in one launch, and
holds every message.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .parts import CORE, PARTS


@dataclass(frozen=True)
class Mistake:
    what: str
    file: str
    old: str
    new: str
    says: str     # a phrase of the message the grade must give
    scenario: str | None = None   # the scenario that shows it (None: the part's first)


MISTAKES = {
    "partition": [
        Mistake("no padding", "partition.py", "return math.ceil(numel / world_size) * world_size", "return numel",
                "the smallest multiple of N"),
        Mistake("slices rounded down", "partition.py", "return padded_numel(numel, world_size) // world_size",
                "return numel // world_size", "rounding down leaves the last"),
        Mistake("the end counted in", "partition.py", "return rank * n, (rank + 1) * n", "return rank * n, (rank + 1) * n - 1",
                "end excluded"),
    ],
    "zero1": [
        Mistake("all-reduce kept from stage 0", "zero1.py", "return flat.reduce_scatter_grad(async_op=async_op)",
                "return flat.all_reduce_grad(async_op=async_op)", "you all-reduced where a reduce-scatter belongs"),
        Mistake("no all-gather after the step", "zero1.py",
                "self.gather_whole([f for f in self.flat_params if f.persistent])", "pass",
                "without the all-gather the other slices of its weights keep their old values"),
        Mistake("the reduction in flight dropped", "zero1.py", "return flat.reduce_scatter_grad(async_op=async_op)",
                "flat.reduce_scatter_grad(async_op=async_op)", "must return what reduce_scatter_grad returns",
                "ZeRO-1, overlap_comm"),
    ],
    "zero2": [
        Mistake("issued at every gradient", "buckets.py", "if self.active and b.gradient_arrived():",
                "if self.active:", "a bucket was reduced more than once"),
        Mistake("issued at the first gradient", "buckets.py", "return self.arrived == len(self.params)",
                "return self.arrived == 1", "reduced before all its gradients had arrived"),
        Mistake("nothing reduced in backward", "buckets.py",
                "            if self.active and b.gradient_arrived():\n                self.issue(b)",
                "            b.gradient_arrived()", "no bucket was reduced inside backward"),
        Mistake("counts never reset", "buckets.py", "        for b in self.buckets:\n            b.start_backward()\n",
                "", "every bucket's count before each backward"),
        Mistake("the whole gradient counted", "zero2.py", "return sum(f.shard_numel for f in self.flat_params)",
                "return sum(f.numel for f in self.flat_params)", "keeps only its reduced slice"),
    ],
    "zero3": [
        Mistake("outputs not hooked", "unit.py", "return on_backward(output, self.pre_backward)", "return output",
                "post_forward must hook the unit's outputs"),
        Mistake("not freed after backward", "unit.py", "        super().post_backward()\n        self._release()",
                "        super().post_backward()", "a unit is not freed after use"),
        Mistake("not marked reduced", "unit.py", "        super().post_backward()\n        self._release()",
                "        self._release()", "reduced twice"),
        Mistake("freed in name only", "unit.py", "        for f in self.partitioned:\n            f.release_full()\n",
                "", "reshard frees the full buffers"),
        Mistake("every gather labelled fwd", "unit.py",
                'self._fetch("recompute" if checkpointing.in_recompute() else "fwd")', 'self._fetch("fwd")',
                "the label says why a unit is gathered", "ZeRO-3, activation checkpointing"),
    ],
    "fp16": [
        Mistake("no hysteresis", "fp16.py", "if self.delayed_shift == 1 or self.cur_hysteresis == 1:", "if True:",
                "the first h-1 overflows only use up the budget"),
        Mistake("doubles a step early", "fp16.py", "stable_interval = (self.cur_iter - self.last_overflow_iter) - 1",
                "stable_interval = self.cur_iter - self.last_overflow_iter",
                "the scale doubles at the clean step that follows scale_window clean steps"),
        Mistake("every clean step refills the budget", "fp16.py",
                "            if self.consecutive_hysteresis:\n                self.cur_hysteresis = self.delayed_shift",
                "            self.cur_hysteresis = self.delayed_shift", "only a doubling refills the hysteresis budget"),
        Mistake("clamped at the minimum", "fp16.py",
                "if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:", "if False:",
                "must raise MinLossScaleError"),
    ],
}


def scenario_of(part: str, k: int) -> str:
    """The name of the scenario that shows mistake k of `part`."""
    return MISTAKES[part][k - 1].scenario or PARTS[part].scenarios[0].name


def write(part: str, k: int, folder: str) -> str:
    """A student's folder holding mistake k of `part` (1-based): minizero's files of the part,
    the mistake's one edit made. Returns the folder."""
    m = MISTAKES[part][k - 1]
    os.makedirs(folder, exist_ok=True)
    for file in {h.file for h in PARTS[part].holes}:
        with open(os.path.join(CORE, file)) as f:
            text = f.read()
        if file == m.file:
            if text.count(m.old) != 1:
                raise ValueError(f"lab mistake {part} {k} ({m.what}): {file} holds {text.count(m.old)} copies of the "
                                 f"text it edits, not 1: minizero changed; update minizero/lab/mistakes.py")
            text = text.replace(m.old, m.new)
        with open(os.path.join(folder, file), "w") as f:
            f.write(text)
    return folder
