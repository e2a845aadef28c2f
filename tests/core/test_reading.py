"""docs/reading.md tells the truth: the modules one ZeRO-3 micro-step visits are the ones the
page lists.

`sys.setprofile` follows one fp32 ZeRO-3 optimizer step (one micro-step: forward, backward,
step) of a two-block model, at world size 1 and 2, after a first step has run (so nothing
is built or imported inside the measured one). A module is visited when one of its Python
functions runs; a file switch is a change of the innermost minizero file on the stack, at a
call or a return (reported, not asserted: the page names the modules).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.launcher import run_ranks

ROOT = Path(__file__).resolve().parents[2]


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _TwoBlocks(nn.Module):
    """Two ZeRO-3 units (the ModuleList's blocks) and the root (the head)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def visits() -> tuple[list[str], int]:
    """(the minizero modules one micro-step visits, paths relative to minizero/; file switches)."""
    import minizero
    package = os.path.dirname(os.path.abspath(minizero.__file__)) + os.sep

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = minizero.initialize(model=_TwoBlocks(), config=cfg)
    x, y = torch.randn(4, 8), torch.randn(4)

    def micro_step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    micro_step()   # the first step builds what it needs once
    switches = []

    def innermost(frame):
        # Up the stack no further than micro_step: what called the test (the rank launcher,
        # minizero/runtime/spawn.py) is not part of the step.
        while frame is not None and frame.f_code is not micro_step.__code__:
            if frame.f_code.co_filename.startswith(package):
                return frame.f_code.co_filename[len(package):]
            frame = frame.f_back
        return None

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            here = innermost(frame)
        elif event == "return" and frame.f_code.co_filename.startswith(package):
            here = innermost(frame.f_back)
        else:
            return
        if here is not None and (not switches or switches[-1] != here):
            switches.append(here)

    sys.setprofile(profile)
    try:
        micro_step()
    finally:
        sys.setprofile(None)
    return sorted(set(switches)), len(switches) - 1


def listed_on_the_page() -> list[str]:
    """The modules docs/reading.md says one micro-step visits: the backticked names on its
    line "**One micro-step visits N modules:** ...", and N."""
    text = (ROOT / "docs" / "reading.md").read_text()
    m = re.search(r"\*\*One micro-step visits (\d+) modules:\*\*(.*?)\.\n", text, re.S)
    assert m, "docs/reading.md has no line \"**One micro-step visits N modules:** `...`, ...\""
    names = re.findall(r"`minizero/([\w/]+\.py)`", m.group(2))
    assert int(m.group(1)) == len(names), f"the line says {m.group(1)} modules and lists {len(names)}"
    return sorted(names)


@pytest.mark.parametrize("world_size", [1, 2])
def test_reading_md_lists_the_modules_a_zero3_step_visits(world_size):
    results = run_ranks(visits, world_size=world_size, timeout=180)
    page = listed_on_the_page()
    for rank, (modules, switches) in enumerate(results):
        assert modules == page, (f"rank {rank} of {world_size}: one ZeRO-3 micro-step visits {modules} "
                                 f"({switches} file switches); docs/reading.md lists {page}")
