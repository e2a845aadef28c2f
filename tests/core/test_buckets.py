"""buckets.py as a unit: the layout of gradient buckets and when each is reduced, with a
recording `reduce` in place of a collective, at world size 1 (no process group).

GradBuckets promises: a bucket's reduction is issued by the hook of its last gradient to
arrive (when hooks are on for this micro-step); buckets that never complete are reduced
after backward, in bucket order; with hooks off, everything is reduced at the boundary;
reductions in flight are waited for in issue order.
"""
from __future__ import annotations

import torch
from torch import nn

from minizero.buckets import GradBuckets, bucket_plan, build_buckets
from minizero.sharding import replicated


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).sum()


def test_bucket_plan_is_backward_order_within_the_size_limit():
    m = Chain()
    groups = [{"params": list(m.parameters())}]
    plans = bucket_plan(m, groups, bucket_numel=25)
    # filled greedily in backward order (unused, c, b, a: the reverse of registration), each
    # bucket's parameters then put back in forward order; a Linear(4, 4) is 16 + 4 elements
    assert [p.names for p in plans] == [("c.weight", "c.bias", "unused.weight", "unused.bias"),
                                        ("a.bias", "b.weight", "b.bias"), ("a.weight",)]
    assert [p.numel for p in plans] == [25, 24, 16]
    assert all(p.persistent for p in plans)


class Recorder:
    """A stage's `reduce`, recording which bucket label it got, synchronously or not."""

    def __init__(self):
        self.log, self.waited = [], []

    def reduce(self, flat, async_op):
        self.log.append((flat.label, async_op))
        flat.clear_param_grads()
        if async_op:
            rec = self

            class Pending:
                def wait(self_inner):
                    rec.waited.append(flat.label)
            return Pending()
        return None


def _setup(overlap, every_micro_step, bucket_numel=25):
    torch.manual_seed(0)
    m = Chain()
    groups = [{"params": list(m.parameters())}]
    buckets = build_buckets(m, bucket_plan(m, groups, bucket_numel), replicated())
    r = Recorder()
    return m, buckets, r, GradBuckets(buckets, r.reduce, every_micro_step=every_micro_step, overlap=overlap)


def test_every_micro_step_reduces_each_bucket_from_its_last_gradient_then_the_incomplete_ones():
    m, buckets, r, gb = _setup(overlap=False, every_micro_step=True)
    gb.prepare_backward(boundary=False)
    m(torch.randn(2, 4)).backward()
    issued_in_backward = list(r.log)
    gb.finish_backward()
    labels = [b.name for b in buckets]
    # the unused layer's bucket (with c) never completes: reduced after backward, last
    assert [x for x, _ in issued_in_backward] == labels[1:]
    assert r.log[-1] == (labels[0], False)
    assert all(p.grad is None for p in m.parameters())


def test_overlap_issues_asynchronously_and_waits_in_issue_order():
    m, buckets, r, gb = _setup(overlap=True, every_micro_step=True)
    gb.prepare_backward(boundary=True)
    m(torch.randn(2, 4)).backward()
    # one reduction in flight at a time (MAX_IN_FLIGHT): each issue first waited for the one before
    assert all(a for _, a in r.log) and r.waited == [label for label, _ in r.log][:-1]
    gb.finish_backward()
    assert r.waited == [label for label, _ in r.log]


def test_hooks_off_until_the_boundary_then_everything_at_once():
    m, buckets, r, gb = _setup(overlap=False, every_micro_step=False)
    gb.prepare_backward(boundary=True)
    m(torch.randn(2, 4)).backward()
    gb.finish_backward()
    assert r.log == []                                   # stage 0 / ZeRO-1 without overlap
    assert m.a.weight.grad is not None                   # accumulating in p.grad
    gb.reduce_all()
    assert [label for label, _ in r.log] == [b.name for b in buckets] and r.waited == [b.name for b in buckets]


def test_with_overlap_the_last_micro_step_reduces_in_backward_and_the_boundary_does_nothing():
    m, buckets, r, gb = _setup(overlap=True, every_micro_step=False)
    gb.prepare_backward(boundary=False)                  # a first micro-step: accumulate
    m(torch.randn(2, 4)).backward()
    gb.finish_backward()
    assert r.log == []
    gb.prepare_backward(boundary=True)
    m(torch.randn(2, 4)).backward()
    gb.finish_backward()
    n = len(r.log)
    assert n == len(buckets)
    gb.reduce_all()
    assert len(r.log) == n
