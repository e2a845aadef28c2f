"""The DeepSpeed tutorial's step 5, as written, in both libraries: loss per step, bit for bit.

launch/ds_config_step5.json is the tutorial's file value for value: ZeRO-3, fp16 (dynamic
loss scale from 2^16), micro-batch 128, gradient accumulation 4, Adam lr 3e-4, clip 1.0,
activation checkpointing, offload_optimizer and offload_param on the CPU, persistence
threshold 1e6. Both libraries get it with ONE addition, `"torch_adam": true` inside
optimizer.params (reference/ds_run.prepare_ds_config with zero3_exact=False): DeepSpeed on
a CPU cannot build its own CPU Adam without compiling it, and torch's Adam is what both
then run.

The model is the step's 24-layer GPT (`tutorial-24`) shrunk only where a 2-core CPU
needs it: n_embd 256 -> 16 (n_head stays 8) and sequences of 3 tokens (block_size 1023 ->
3, a 2x2 image); 24 layers, dropout 0, vocabulary 512, micro-batch 128 and accumulation 4
as in the tutorial. World size 2, 2 optimizer steps: 2 x 4 x 2 x 128 = 2,048 sequences
through 24 layers per library.

What this test is about, the tutorial's config value for value at the tutorial's depth,
bitwise, needs neither width nor length; three tokens still give causal attention a mask
and a softmax over more than one position. fp16 attention and matmuls, whose cost grows
with the sequence, are most of minizero's half of the time; width barely matters. The
file's time at each length, width and number of steps is measured in
docs/results/test-suite-step5-tokens.md and docs/results/test-suite-cuts-avx2.md.

Why 2 steps show what more would: every step takes the same path in both libraries (no
overflow, so no skipped step and no scale change: the scale grows only after 1000 clean
steps; no clipping: `test_clip_never_fires`), and a step is bitwise equal when its inputs
are, so a further step repeats the same operations on equal state. The first step starts
from the initial weights and empty Adam moments; the second is the first to start from
updated weights (the fp32 masters rounded back to fp16) and Adam's moments, the state every
later step starts from; two already show the loss falling (6.238497 to 6.231308). The
file's time at 4 and 2 steps, with and without DeepSpeed's memory recording, is measured in
docs/results/test-suite-cuts-avx512.md.

Why bitwise is the right expectation, operation by operation:
- DeepSpeed's ZeRO-3 replaces F.linear by `LinearFunctionForZeroStage3` (matmul, then
  `+= bias`: docs/deepspeed.md, "ZeRO-3 replaces F.linear (memory_efficient_linear)"), since
  the tutorial's config does not turn memory_efficient_linear off. minizero runs torch's
  F.linear. So this test runs minizero with `ds_linear` below, the same operations as
  DeepSpeed's Function (forward and backward), installed the same way (process-wide); the
  rest of minizero is untouched. `test_ds_linear_is_deepspeeds_and_not_torchs` pins that
  it computes exactly what DeepSpeed's Function computes, forward and backward, and not
  what torch's F.linear computes in fp16.
- every parameter of this GPT has at most 1e6 elements, so both keep all of them gathered
  (persistent); the gradients are averaged, reduce-scattered and accumulated in fp16 in the
  same order; the step is unscale-by-(clip * scale), torch AdamW (for-loop) on the fp32
  master, round to fp16, in both.
- DeepSpeed's ZeRO-3 offload path sums the squared norm in fp32 across ranks (see
  `_clip_never_fires`): that changes the clip factor only when clipping fires. Here the
  norm stays below 1.0 on every step, which the test asserts, so the factor is exactly 1.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from reference.ds_run import prepare_ds_config  # noqa: E402
from tests.support import harness  # noqa: E402
from tests.support.launcher import run_ranks  # noqa: E402

N, STEPS = 2, 2   # see the docstring: every step is the same path, 2 show what 4 or 20 would
STEP5 = json.loads((Path(__file__).parents[2] / "launch" / "ds_config_step5.json").read_text())
SHRINK = {"n_embd": 16, "block_size": 3}          # the CPU's overrides; n_layer 24 and the rest as the tutorial
MODEL_FN = functools.partial(harness.make_model, "tutorial-24", "gpt", **SHRINK)
GAS, MICRO = STEP5["gradient_accumulation_steps"], STEP5["train_micro_batch_size_per_gpu"]
BATCHES = harness.PatternBatches(512, SHRINK["block_size"], MICRO * GAS * N, gas=GAS)   # learnable: the loss falls
ENV = {"DS_ACCELERATOR": "cpu"}


def config() -> dict:
    # + torch_adam inside optimizer.params, nothing else (zero3_exact=False keeps DeepSpeed's
    # memory_efficient_linear on, as the tutorial runs it)
    return prepare_ds_config(STEP5, zero3_exact=False)


class _DSLinear(torch.autograd.Function):
    """The operations of DeepSpeed's LinearFunctionForZeroStage3 (runtime/zero/linear.py),
    for a weight that is already gathered: forward addmm (2-D input with bias) or matmul
    then `+= bias`; backward grad_output @ weight, grad_output^T @ input over flattened
    leading dims, grad_bias = sum over leading dims."""

    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        out = input.matmul(weight.t())
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        dim = grad_output.dim()
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(list(range(dim - 1))) if dim > 1 else grad_output
        return grad_input, grad_weight, grad_bias


def ds_linear(input, weight, bias=None):
    return _DSLinear.apply(input, weight, bias)


def _minizero(linear: str):
    """run_minizero on this rank, with F.linear as DeepSpeed's ZeRO-3 installs it ("ds") or torch's."""
    real = torch.nn.functional.linear
    if linear == "ds":
        torch.nn.functional.linear = ds_linear
    try:
        return harness.run_minizero(MODEL_FN, config(), BATCHES, STEPS, capture_memory=True)
    finally:
        torch.nn.functional.linear = real


@pytest.fixture(scope="module")
def runs():
    import time
    from reference.ds_run import run_deepspeed
    t0 = time.perf_counter()
    # DeepSpeed's memory is not read here (test_agreement_memory_offload.py places its
    # offloaded bytes): its peak recorder reads every buffer at each of the 5,444 submodule
    # fetches and releases of a step of this 24-layer GPT, two thirds of DeepSpeed's time
    ds = run_ranks(run_deepspeed, N, args=(MODEL_FN, STEP5, BATCHES, STEPS),
                   kwargs={"zero3_exact": False}, env=ENV, timeout=900)
    t1 = time.perf_counter()
    mz = run_ranks(_minizero, N, args=("ds",), env=ENV, timeout=900)
    print(f"\nstep 5, {STEPS} steps on {N} ranks: DeepSpeed {t1 - t0:.0f} s, minizero {time.perf_counter() - t1:.0f} s")
    return ds, mz


def test_the_config_is_the_tutorials_plus_torch_adam():
    cfg = config()
    assert cfg["optimizer"]["params"].pop("torch_adam") is True
    assert cfg == STEP5


def test_model_is_tutorial_24_shrunk_in_width_and_sequence_only():
    from minizero.gpt.model import get_preset
    full, used = get_preset("tutorial-24"), get_preset("tutorial-24", **SHRINK)
    assert (used.n_layer, used.n_head, used.vocab_size) == (full.n_layer, full.n_head, full.vocab_size) == (24, 8, 512)
    assert used.embd_pdrop == used.resid_pdrop == used.attn_pdrop == 0.0


def test_step5_loss_per_step_is_bitwise_deepspeeds(runs):
    ds, mz = runs
    print(f"\nstep 5, {STEPS} steps: DeepSpeed losses {ds[0]['losses'][:3]} ... {ds[0]['losses'][-1]}")
    for r in range(N):
        assert len(mz[r]["losses"]) == STEPS
        assert mz[r]["losses"] == ds[r]["losses"], r
        assert mz[r]["loss_scales"] == ds[r]["loss_scales"]
        assert mz[r]["skipped_steps"] == ds[r]["skipped_steps"]
    assert harness.max_abs_diff(mz[0]["final_state"], ds[0]["final_state"]) == 0.0
    assert ds[0]["losses"][-1] < ds[0]["losses"][0]          # it trains
    # every step the same path (the docstring's reason 4 steps suffice): none skipped,
    # the scale never moved from DeepSpeed's initial 2^16
    assert ds[0]["skipped_steps"] == 0 and set(ds[0]["loss_scales"]) == {2.0 ** 16}, ds[0]["loss_scales"]


def test_clip_never_fires(runs):
    """The condition for bitwise above: DeepSpeed's ZeRO-3 offload path
    (stage3.py: complete_grad_norm_calculation_for_cpu_offload) all-reduces the squared
    norm in fp32, minizero in fp64, so a clip factor that is not exactly 1 could differ in
    its last bits. Clipping fires when norm + 1e-6 > gradient_clipping (1.0); here it never
    does (this test asserts the largest norm stays below it), so the factor is exactly 1 in both."""
    ds, mz = runs
    norms = [n for n in mz[0]["grad_norms"] if n is not None and n == n and n != float("inf")]
    assert len(norms) == STEPS and max(norms) + 1e-6 < STEP5["gradient_clipping"], norms


def test_both_offload_what_the_config_says(runs):
    """minizero: optimizer state on the host; offload_param has nothing to move, because the
    persistence threshold (1e6) keeps every parameter of this GPT gathered on the device.
    DeepSpeed's offloaded bytes, placed from its config (on a CPU every tensor is a CPU
    tensor), are tested in tests/agreement/test_agreement_memory_offload.py."""
    ds, mz = runs
    m = mz[0]["memory"]["after_step"][-1]
    assert m["host"]["optimizer_states"] == m["optimizer_states"] > 0
    assert m["host"]["master_params"] == m["master_params"] > 0
    assert m["host"]["params"] == 0 and all(f["persistent"] for f in mz[0]["layout"])
    assert m["device"]["master_params"] == m["device"]["optimizer_states"] == 0


def test_ds_linear_is_deepspeeds_and_not_torchs():
    """The test-only `ds_linear` equals DeepSpeed's zero3_linear_wrap bit for bit (output and
    the three gradients) on this test's fp16 shapes, and torch's F.linear differs from both."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(MICRO, SHRINK["block_size"], SHRINK["n_embd"], generator=g).half()
    w0 = torch.randn(4 * SHRINK["n_embd"], SHRINK["n_embd"], generator=g).half()
    b0 = torch.randn(4 * SHRINK["n_embd"], generator=g).half()
    outs = {}
    for name, fn in (("ours", ds_linear), ("deepspeed", zero3_linear_wrap), ("torch", torch.nn.functional.linear)):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = fn(x, w, b)
        y.float().pow(2).sum().backward()
        outs[name] = (y.detach(), x.grad, w.grad, b.grad)
    assert all(torch.equal(a, b) for a, b in zip(outs["ours"], outs["deepspeed"]))
    assert not all(torch.equal(a, b) for a, b in zip(outs["ours"], outs["torch"]))
