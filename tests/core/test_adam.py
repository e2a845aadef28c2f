"""Adam stepped in slices (minizero/adam.py, ChunkedAdam/ChunkedAdamW) is torch's Adam bit for bit.

The slicing exists for speed only (no mmap'd temporaries per step); these tests pin that
it changes no number and no state layout, so checkpoints written with torch's class load."""
import pytest
import torch

from minizero.adam import ChunkedAdam, ChunkedAdamW
from minizero.adam import build_optimizer

# the first two take adam.py's own foreach calls (AdamW; Adam only without weight decay), the rest torch's function
HYPER = [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, amsgrad=True),
         dict(betas=(0.8, 0.95), eps=1e-6, maximize=True)]


def run(cls, numel, hyper, steps=4, chunk=None, state=None):
    torch.manual_seed(0)
    master = torch.randn(numel)
    grads = [torch.randn(numel) * 10 ** -k for k in range(steps)]
    opt = cls([master], lr=1e-2, **hyper)
    if chunk is not None:
        opt.chunk_numel = chunk
    if state is not None:
        opt.load_state_dict(state)
    for g in grads:
        master.grad = g.clone()
        opt.step()
    return master, opt


@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("pair", [(torch.optim.AdamW, ChunkedAdamW), (torch.optim.Adam, ChunkedAdam)])
def test_slices_equal_one_flat_step_bitwise(pair, hyper):
    # 1000 elements in slices of 96 (not a divisor, a short last slice) and of 1000 (one slice)
    ref, ref_opt = run(pair[0], 1000, hyper)
    for chunk in (96, 1000):
        got, opt = run(pair[1], 1000, hyper, chunk=chunk)
        assert torch.equal(got, ref), f"chunk {chunk}: weights differ from torch's one flat step"
        for k, v in ref_opt.state[next(iter(ref_opt.state))].items():
            assert torch.equal(opt.state[got][k], v), f"chunk {chunk}: state {k!r} differs"
        assert float(opt.state[got]["step"]) == 4.0   # steps, not slices


def test_state_layout_is_torchs_both_ways():
    """A state saved by torch's AdamW loads into the sliced one and the other way round, and
    stepping on from it is the same: the layout (one entry per flat master) is unchanged."""
    _, plain = run(torch.optim.AdamW, 1000, {}, steps=2)
    _, sliced = run(ChunkedAdamW, 1000, {}, steps=2, chunk=96)
    assert plain.state_dict()["param_groups"] == sliced.state_dict()["param_groups"]
    a, _ = run(torch.optim.AdamW, 1000, {}, state=sliced.state_dict())
    b, _ = run(ChunkedAdamW, 1000, {}, chunk=96, state=plain.state_dict())
    assert torch.equal(a, b)


def test_the_engine_builds_the_sliced_class():
    from types import SimpleNamespace
    opt = build_optimizer([{"params": [torch.zeros(3)]}], SimpleNamespace(type="AdamW", params={"torch_adam": True}))
    assert isinstance(opt, ChunkedAdamW) and isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_gradient_converted_per_slice_is_the_whole_conversion(dtype):
    """ShardedOptimizer hands a bf16/fp16 gradient and 1/divisor to the sliced Adam: the same
    weights as converting the whole gradient first (g.float().mul_(1 / divisor)), bit for bit."""
    torch.manual_seed(0)
    lp = [torch.randn(1000).to(dtype) for _ in range(3)]
    inv = 1.0 / torch.full((), 1024.0 * 1.7)
    ref_p, got_p = torch.randn(1000), None
    got_p = ref_p.clone()
    ref, got = torch.optim.AdamW([ref_p], lr=1e-2), ChunkedAdamW([got_p], lr=1e-2)
    got.chunk_numel = 96
    for g in lp:
        ref_p.grad = g.float().mul_(inv)
        ref.step()
        assert got.steps_in_slices()
        got.set_low_precision_grad(got_p, g, inv)
        got.step()
        assert got_p.grad is None
    assert torch.equal(ref_p, got_p)
    assert all(torch.equal(ref.state[ref_p][k], got.state[got_p][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_only_host_masters_step_in_slices_before_any_gradient_is_set():
    """The engine asks steps_in_slices() while every master's .grad is still None (a
    low-precision gradient is handed over instead). Masters off the host (a GPU's; here the
    meta device stands in for one) must answer no, so they take torch's own foreach step:
    the question once looked only at parameters that had a .grad, answered yes on an H200,
    and stepped 40 slices of one-tensor foreach launches per bucket (20 ms of host time a step)."""
    host, other = torch.zeros(1000), torch.zeros(1000, device="meta")
    assert ChunkedAdamW([host], lr=1e-2).steps_in_slices()
    assert not ChunkedAdamW([other], lr=1e-2).steps_in_slices()
    assert not ChunkedAdamW([host, other], lr=1e-2).steps_in_slices()   # any one off the host
    host.grad = torch.zeros(1000)
    assert not ChunkedAdamW([other, host], lr=1e-2).steps_in_slices()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchs_foreach_step_whole_is_its_foreach_step_in_slices(dtype):
    """What changed for GPU masters when they stopped taking the sliced path: torch's foreach
    AdamW (the GPU default) on the whole master after g.float().mul_(1 / divisor) gives the
    bits the sliced path gave with foreach on one-slice lists (run here on the CPU's foreach
    kernels; the update is element-wise either way), so GPU runs keep their numbers."""
    from minizero import adam
    torch.manual_seed(0)
    lp = [torch.randn(1000).to(dtype) for _ in range(4)]
    inv = 1.0 / torch.full((), 3.7)
    sliced_p, whole_p = torch.randn(1000), None
    whole_p = sliced_p.clone()
    sliced = ChunkedAdamW([sliced_p], lr=1e-2, weight_decay=0.1, foreach=True)
    sliced.chunk_numel = 96
    whole = torch.optim.AdamW([whole_p], lr=1e-2, weight_decay=0.1, foreach=True)
    old = adam._chunkable
    adam._chunkable = lambda group: True     # the old answer for GPU masters
    try:
        for g in lp:
            sliced.low_precision_grads[sliced_p] = (g.view(-1), inv)
            sliced.step()
            whole_p.grad = g.float().mul_(inv)
            whole.step()
            whole_p.grad = None
    finally:
        adam._chunkable = old
    assert torch.equal(sliced_p, whole_p)


@pytest.mark.parametrize("pair", [(torch.optim.AdamW, ChunkedAdamW), (torch.optim.Adam, ChunkedAdam)])
def test_several_masters_and_groups_with_a_changing_lr_are_torchs_step(pair):
    """What the engine hands over: several flat masters per group (ZeRO-3 has one per unit),
    a group without weight decay, the lr moved by a schedule between steps. adam.py's own
    foreach calls (and, for Adam with weight decay, torch's function) give torch's numbers."""
    from minizero import adam
    torch.manual_seed(0)
    sizes = [(700, 33, 1), (5, 260)]
    ref_ps = [[torch.randn(n) for n in g] for g in sizes]
    got_ps = [[p.clone() for p in g] for g in ref_ps]
    groups = lambda ps: [{"params": ps[0], "weight_decay": 0.1}, {"params": ps[1], "weight_decay": 0.0}]
    ref, got = pair[0](groups(ref_ps), lr=1e-2, betas=(0.9, 0.95)), pair[1](groups(got_ps), lr=1e-2, betas=(0.9, 0.95))
    got.chunk_numel, got.batch_numel = 96, 300      # several slices, several calls per group
    if pair[0] is torch.optim.AdamW:
        assert all(adam._direct(g) for g in got.param_groups)
    for step in range(5):
        for opt in (ref, got):
            for g in opt.param_groups:
                g["lr"] = 1e-2 * (0.5 + step / 4)
        for r, g in zip(sum(ref_ps, []), sum(got_ps, [])):
            r.grad = torch.randn(r.numel()) * 10 ** -step
            g.grad = r.grad.clone()
        ref.step()
        got.step()
    for r, g in zip(sum(ref_ps, []), sum(got_ps, [])):
        assert torch.equal(r, g)
        assert all(torch.equal(ref.state[r][k], got.state[g][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
