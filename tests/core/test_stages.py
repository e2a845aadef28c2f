"""zero0.py .. zero3.py as units: each stage derives from the one before and shows only what
it adds; ZeRO-3's layout (unit_plan) at world size 1 (no process group)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from torch import nn

from minizero import zero0, zero1, zero2, zero3
from minizero.zero3 import unit_plan

PACKAGE = Path(zero0.__file__).parent
CHAIN = [zero0.Zero0, zero1.Zero1, zero2.Zero2, zero3.Zero3]


def test_each_stage_derives_from_the_one_before():
    for parent, child in zip(CHAIN, CHAIN[1:]):
        assert child.__bases__ == (parent,), child
    assert [c.stage for c in CHAIN] == [0, 1, 2, 3]


def _methods(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, staticmethod)}


def test_each_stage_overrides_only_what_its_mechanism_changes():
    """What the ZeRO paper says each stage changes (section 5), as the methods each class
    defines itself; a method repeated from the class before would show here."""
    assert _methods(zero1.Zero1) == {"__init__", "reduce", "after_step", "gather_whole"}   # cut buckets, reduce-scatter, all-gather
    assert _methods(zero2.Zero2) == {"reduce_gradients", "grad_bytes"}  # reduced in backward, held as a shard
    assert _methods(zero3.Zero3) == {"__init__", "plan", "finish_backward", "after_step", "gather_whole"}


def test_each_stage_extends_the_one_before():
    """A stage builds its own layout and hands it to its parent's constructor (no constructor
    calls a method a subclass overrides); where a stage changes a step its parent still needs,
    it calls the parent's (ZeRO-3's after_step: ZeRO-1's gather of what is kept whole)."""
    for cls in CHAIN:
        src = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
        assert "self.plan(" not in src and "self.make_buckets(" not in src, cls
    for cls in (zero3.Zero3,):
        for name in ("__init__", "finish_backward", "after_step"):
            assert "super()." in inspect.getsource(getattr(cls, name)), (cls, name)
    assert zero2.Zero2.reduce_every_micro_step and not zero1.Zero1.reduce_every_micro_step


def _code_lines(cls) -> int:
    """Lines of code of a class, docstrings and comments left out."""
    src = inspect.getsource(cls)
    tree = ast.parse(src)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
            d = node.body[0]
            doc.update(range(d.lineno, d.end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if i not in doc and line.strip() and not line.strip().startswith("#"))


def test_what_each_stage_adds_fits_on_a_slide():
    """A slide holds about 25 lines of code: each ZeRO stage's class is under that."""
    assert all(_code_lines(c) <= 25 for c in CHAIN[1:]), [_code_lines(c) for c in CHAIN[1:]]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2)])
        self.head = nn.Linear(8, 10, bias=False)


def test_unit_plan_one_unit_per_block_then_the_root_small_parameters_persistent():
    net = Net()
    groups = [{"params": [p for n, p in net.named_parameters() if p.dim() > 1]},
              {"params": [p for n, p in net.named_parameters() if p.dim() <= 1]}]
    plan = unit_plan(net, groups, persistence_threshold=64)
    assert [name for name, _, _ in plan] == ["blocks.0", "blocks.1", "root"]
    block0 = {p.label: (p.group, p.names, p.persistent) for p in plan[0][2]}
    # the 8x8 weight (64 elements) is at the threshold: persistent; biases and norms too
    assert block0 == {"blocks.0.g0.persist": (0, ("blocks.0.0.weight",), True),
                      "blocks.0.g1.persist": (1, ("blocks.0.0.bias", "blocks.0.1.weight", "blocks.0.1.bias"), True)}
    root = {p.label: (p.names, p.persistent) for p in plan[2][2]}
    assert root == {"root.g0": (("emb.weight", "head.weight"), False)}
    every = [n for _, _, plans in plan for p in plans for n in p.names]
    assert sorted(every) == sorted(n for n, _ in net.named_parameters())     # each parameter once


def test_a_zero3_engine_at_world_size_1_gathers_and_frees_around_each_unit():
    """The stage chain working as a whole, one process: ZeRO-3 leaves nothing gathered."""
    import minizero
    torch.manual_seed(0)

    class Model(Net):
        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h).logsumexp(-1).mean()

    model = Model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = minizero.initialize(model=model, config=cfg)[0]
    for _ in range(2):
        loss = engine(torch.randint(0, 10, (2, 5)))
        engine.backward(loss)
        engine.step()
    assert all(not f.full_is_allocated() for f in engine.zero.flat_params)
    assert engine.zero.grad_bytes() == sum(f.shard_numel for f in engine.zero.flat_params) * 4
