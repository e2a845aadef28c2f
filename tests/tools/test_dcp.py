"""PyTorch Distributed Checkpoint (DCP) in and out: minizero/checkpoint_files/dcp_checkpoint.py,
dcp_files.py, python -m minizero.export_dcp, and the PyTorch reference's save/resume
(reference/torch_checkpoint.py).

fp32 on gloo, the micro GPT without dropout, AdamW, no gradient clipping (FSDP2's norm is a
norm of per-tensor norms, minizero's one sum of squares: equal up to ulps, so clipping that
fires would part them; tests/agreement/test_agreement_torch.py). Three launches:

  2 ranks  minizero ZeRO-3 trains 2 steps, saves its own folder (`mz`) and DCP (`mzdcp`, every
           rank writing its pieces), goes on 2 steps; FSDP2 does the same from the same
           weights and saves DCP (`pt`). The two runs are the same arithmetic at N = 2, so the
           two DCP folders hold the same numbers, cut differently.
  1 rank   FSDP2 loads `mzdcp`, minizero ZeRO-3 resumes `mz` (resharded), FSDP2 resumes `pt`,
           minizero stage 1 resumes `pt`: each goes on 2 steps. Bitwise equal: at N = 1 no
           gradient is summed, and every other operation is the same in the same order.
  4 ranks  the same at N = 4, minizero at stage 3. Not the same order: gloo's reduce-scatter is
           an all-reduce whose ring adds the four ranks' gradients in an order that depends on
           which rank's chunk an element falls in (measured first thing in this launch:
           test_gloo_sums_four_ranks_in_an_order_set_by_the_owner),
           and minizero's flat shards and FSDP2's dim-0 shards give an element different
           owners. So: the first continued loss bitwise (the weights are), each library
           bitwise against itself, and after one step each weight within the bound derived
           in `_adamw_bound` from the gradient sums' rounding.

Costs 14-21 s of the suite's two-worker run (its launches of 1, 2 and 4 ranks, the rest in-process).
"""
from __future__ import annotations

import functools
import math
import os
import pickle
import shutil

import pytest
import torch

from minizero.checkpoint_files.checkpoint_folder import CheckpointError, UnsafeCheckpointError
from minizero.checkpoint_files.dcp_checkpoint import boxes
from minizero.checkpoint_files.dcp_source import DcpSource
from minizero.checkpoint_files.dcp_files import METADATA_GLOBALS, read_metadata
from tests.support import harness
from tests.support.launcher import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")

K = 2   # steps before the save, and after it
MODEL_FN = functools.partial(harness.make_model, "micro", **harness.NO_DROPOUT)
BATCHES = harness.PatternBatches(62, 63, 4)   # 4 rows per step: 4, 2 or 1 per rank at N = 1, 2, 4
FORCE_PG = {"MINIZERO_FORCE_PG": "1"}


# ----------------------------------------------------------------------------- the rectangles

def test_boxes_cover_a_flat_range_exactly_in_at_most_three_rectangles_in_2d():
    g = torch.Generator().manual_seed(0)
    for shape in [(21, 21), (62, 21), (7,), (1, 63, 21), (3, 4, 5)]:
        n = math.prod(shape)
        for _ in range(50):
            lo, hi = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            mark = torch.zeros(shape, dtype=torch.int32)
            bs = boxes(shape, lo, hi)
            for offsets, sizes in bs:
                mark[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
            want = torch.zeros(n, dtype=torch.int32)
            want[lo:hi] = 1
            assert torch.equal(mark.view(-1), want), (shape, lo, hi, bs)
            assert len(bs) <= 2 * len(shape) - 1
    # docs/checkpoints.md's example: the last 210 elements of a 21 x 21 weight start inside row 10
    assert boxes((21, 21), 231, 441) == [((11, 0), (10, 21))]
    assert boxes((21, 21), 220, 441) == [((10, 10), (1, 11)), ((11, 0), (10, 21))]
    assert boxes((21, 21), 5, 300) == [((0, 5), (1, 16)), ((1, 0), (13, 21)), ((14, 0), (1, 6))]


# ----------------------------------------------------------------------------- the runs

def _cfg(stage: int, world: int) -> dict:
    return harness.make_config(stage, micro_batch=4 // world, lr=1e-3, clip=0.0)


def _loop(engine, start: int, steps: int) -> list[float]:
    return harness.mean_losses(engine, BATCHES, start, steps)


def _minizero(stage: int, world: int, fp16_schedule: bool = False):
    import minizero
    from reference.ds_run import build_model, prepare_ds_config
    cfg = _cfg(stage, world)
    if fp16_schedule:
        cfg = dict(harness.make_config(stage, "fp16", micro_batch=4 // world, lr=1e-3, clip=0.0),
                   scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-3}})
    cfg = prepare_ds_config(cfg)
    model, params = build_model(MODEL_FN, cfg, 0)
    return minizero.initialize(model=model, model_parameters=params, config=cfg)[0]


def _fsdp2(world: int, model_fn=MODEL_FN):
    from reference.ds_run import build_model, prepare_ds_config
    from reference.torch_engine import TorchEngine
    cfg = prepare_ds_config(_cfg(3, world))
    model, params = build_model(model_fn, cfg, 0)
    return TorchEngine(model, list(params), cfg)


def _state(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.full_fp32_state_dict().items()}


def _save_both(root: str) -> dict:
    from minizero.checkpoint_files import dcp_checkpoint
    out = {}
    e = _minizero(3, 2)
    out["mz"] = _loop(e, 0, K)
    e.save_checkpoint(f"{root}/mzdcp", client_state={"note": "minizero"}, format="dcp")   # the engine's method
    e.save_checkpoint(f"{root}/mz")
    out["mz_cont"] = _loop(e, K, K)
    e = _fsdp2(2)
    out["pt"] = _loop(e, 0, K)
    e.save_checkpoint(f"{root}/pt", client_state={"note": "fsdp2"})
    out["pt_cont"] = _loop(e, K, K)
    # fp16 with a schedule: the loss scale, the schedule and each rank's RNG ride along
    e = _minizero(2, 2, fp16_schedule=True)
    torch.manual_seed(100 + torch.distributed.get_rank())   # the ranks' RNG states differ
    _loop(e, 0, K)
    out["fp16_saved"] = (e.loss_scaler.state_dict(), e.lr_scheduler.state_dict(), torch.get_rng_state())
    dcp_checkpoint.save(e, f"{root}/fp16dcp")
    return out


def _one_step_with_gradients(engine, rank: int, world: int):
    """FSDP2's first continued step, with what the bound needs: the averaged gradient it
    stepped with, and sum over ranks of |each rank's own gradient| (a plain copy of the model
    on the rank's rows: the terms of the all-reduce)."""
    import torch.distributed as dist
    full = engine.full_fp32_state_dict()
    plain = MODEL_FN()
    plain.load_state_dict(full)
    x, y = BATCHES(K, 0, rank, world)
    plain(x, y)[1].backward()
    abs_sum = {n: p.grad.abs() for n, p in plain.named_parameters()}
    for t in abs_sum.values():
        dist.all_reduce(t)
    loss = engine(x, y)[1]
    engine.backward(loss)
    grad = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in engine.module.named_parameters()}
    engine.step()
    t = torch.tensor([float(loss.detach().float().item())], dtype=torch.float64)
    dist.all_reduce(t)
    return grad, abs_sum, float(t.item()) / world


def _resume_everywhere(root: str) -> dict:
    """At this world size: FSDP2 from minizero's DCP, minizero from its own folder, FSDP2
    from its own DCP, minizero (stage 1 at N = 1, 3 at N = 4) from FSDP2's DCP."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"gloo_sums": _gloo_sums()} if world == 4 else {}
    for name, make, folder in (("pt_from_mzdcp", lambda: _fsdp2(world), "mzdcp"),
                               ("mz_from_mz", lambda: _minizero(3, world), "mz"),
                               ("pt_from_pt", lambda: _fsdp2(world), "pt"),
                               ("mz_from_pt", lambda: _minizero(1 if world == 1 else 3, world), "pt")):
        e = make()
        e.load_checkpoint(f"{root}/{folder}")
        if name == "pt_from_mzdcp" and world > 1:
            out["grad"], out["abs_sum"], first = _one_step_with_gradients(e, rank, world)
            out["after_one"] = _state(e)
            out[name] = [first] + _loop(e, K + 1, K - 1)
        else:
            out[name] = _loop(e, K, 1)
            out[f"{name}_after_one"] = _state(e)
            out[name] += _loop(e, K + 1, K - 1)
        out[f"{name}_final"] = _state(e)
    if world == 1:
        out["refusals"] = _refusals(root)
        e = _minizero(2, 1, fp16_schedule=True)
        e.load_checkpoint(f"{root}/fp16dcp")
        out["fp16_loaded"] = (e.loss_scaler.state_dict(), e.lr_scheduler.state_dict(), torch.get_rng_state())
    return out


def _refusals(root: str) -> dict:
    """On one rank: what each engine says about a DCP folder it cannot continue from."""
    out = {}
    other = functools.partial(harness.make_model, "micro", n_layer=3, **harness.NO_DROPOUT)
    for lib in ("minizero", "fsdp2"):
        for case, folder in (("other_model", "mzdcp"), ("truncated", "bad_truncated"),
                             ("no_optimizer", "bad_no_optimizer"), ("planted", "bad_planted")):
            if lib == "fsdp2":
                e = _fsdp2(1, other if case == "other_model" else MODEL_FN)
            else:
                import minizero
                from reference.ds_run import build_model, prepare_ds_config
                cfg = prepare_ds_config(_cfg(3, 1))
                model, params = build_model(other if case == "other_model" else MODEL_FN, cfg, 0)
                e = minizero.initialize(model=model, model_parameters=params, config=cfg)[0]
            before = _state(e)
            try:
                e.load_checkpoint(f"{root}/{folder}")
                out[(lib, case)] = None
            except CheckpointError as err:
                out[(lib, case)] = (str(err), all(torch.equal(before[k], v) for k, v in _state(e).items()))
    return out


def _make_bad_folders(root: str) -> None:
    """Three folders a resume must refuse, from `mzdcp`: a chunk file cut short, a model-only
    save, and a non-tensor value whose pickle calls os.system."""
    import torch.distributed.checkpoint as dcp
    src = os.path.join(root, "mzdcp", open(os.path.join(root, "mzdcp", "latest")).read())
    bad = os.path.join(root, "bad_truncated", "t")
    shutil.copytree(src, bad)
    with open(os.path.join(bad, "__1_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(bad, "__1_0.distcp")) // 2)
    model = MODEL_FN()
    for name, sd in (("bad_no_optimizer", {n: p.detach() for n, p in model.named_parameters()}),
                     ("bad_planted", {**{n: p.detach() for n, p in model.named_parameters()},
                                      "client_state": {"x": _Planted()}})):
        folder = os.path.join(root, name, "t")
        dcp.save(sd, checkpoint_id=folder, no_dist=True)
    for name in ("bad_truncated", "bad_no_optimizer", "bad_planted"):
        with open(os.path.join(root, name, "latest"), "w") as f:
            f.write("t")


MARKER = "/tmp/minizero-test-dcp-planted"


class _Planted:
    def __reduce__(self):
        return os.system, (f"touch {MARKER}",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    first = run_ranks(_save_both, world_size=2, args=(root,), timeout=600)[0]
    _make_bad_folders(root)
    one = run_ranks(_resume_everywhere, world_size=1, args=(root,), env=FORCE_PG, timeout=600)[0]
    four = run_ranks(_resume_everywhere, world_size=4, args=(root,), timeout=600)[0]
    return root, first, one, four


def _tag_folder(root, name):
    return os.path.join(root, name, open(os.path.join(root, name, "latest")).read())


def test_minizero_writes_the_numbers_fsdp2_writes_cut_into_rectangles(runs):
    root, first, _, _ = runs
    # the two runs are the same arithmetic at N = 2 (test_agreement_torch.py): same losses
    assert first["mz"] == first["pt"] and first["mz_cont"] == first["pt_cont"]
    mz, pt = DcpSource(_tag_folder(root, "mzdcp")), DcpSource(_tag_folder(root, "pt"))
    assert mz.names == pt.names and mz.shapes == pt.shapes
    for name in mz.names:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mz.read(kind, name), pt.read(kind, name)), (kind, name)
    assert [g["step"] for g in mz.groups] == [K, K] and mz.counters == pt.counters
    assert mz.client_state == {"note": "minizero"} and pt.client_state == {"note": "fsdp2"}
    # minizero's pieces are not FSDP2's rows: some chunk starts inside a row (the trap a writer must declare)
    md = read_metadata(mz.folder)
    mid_row = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and
               any(len(c.offsets) == 2 and c.offsets[1] != 0 for c in v.chunks)]
    assert mid_row, "every chunk starts a row: the test no longer covers a cut inside a row"
    fsdp_rows = read_metadata(pt.folder).state_dict_metadata[mid_row[0]].chunks
    assert all(c.offsets[1] == 0 for c in fsdp_rows)


def test_the_loss_scale_schedule_and_rng_ride_along(runs):
    """fp16 ZeRO-2 with WarmupLR on 2 ranks saved as DCP (loss_scaler.*, lr_scheduler.*,
    rng.rank_<r>), resumed on 1 rank: the scaler and the schedule as saved, rank 0's RNG."""
    _, first, one, _ = runs
    scaler, sched, rng = first["fp16_saved"]
    assert scaler["cur_iter"] == K and sched["last_batch_iteration"] == K - 1
    got_scaler, got_sched, got_rng = one["fp16_loaded"]
    assert got_scaler == scaler and got_sched == sched and torch.equal(got_rng, rng)


def test_one_rank_continues_bitwise_either_way(runs):
    _, _, one, _ = runs
    assert one["pt_from_mzdcp"] == one["mz_from_mz"]
    assert harness.max_abs_diff(one["pt_from_mzdcp_final"], one["mz_from_mz_final"]) == 0.0
    assert one["mz_from_pt"] == one["pt_from_pt"]              # minizero ZeRO-1 from FSDP2's folder
    assert harness.max_abs_diff(one["mz_from_pt_final"], one["pt_from_pt_final"]) == 0.0
    assert one["pt_from_pt"] == one["mz_from_mz"]


def _adamw_bound(m0, v0, step0, g, abs_sum, w, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, world=4):
    """|w_a - w_b| after one AdamW step from the same state (m0, v0, Adam step0, weights w)
    when the two averaged gradients differ only by how the `world` ranks' terms were summed.

    A sum of n fp32 terms in any order is within gamma_{n-1} * sum |terms| of the exact sum
    (gamma_k = k u / (1 - k u), u = 2^-24; Higham, Accuracy and Stability, 4.2), so two orders
    differ by at most 2 gamma_{n-1} sum|g_r|, and dividing by n (a power of two) is exact:
    delta = 2 gamma_{n-1} sum|g_r| / n. The update u(g) = lr m_hat / (sqrt(v_hat) + eps),
    m = b1 m0 + (1 - b1) g, v = b2 v0 + (1 - b2) g^2, hats divided by 1 - b^t, changes by at
    most |du/dg| delta with
        |du/dg| <= lr / (sqrt(v_hat) + eps) * ((1 - b1) / c1 + |m_hat| (1 - b2) |g| / (c2 sqrt(v_hat) (sqrt(v_hat) + eps)))
    taken at the worst g in [g - delta, g + delta] (bounded by its largest |g| and smallest
    v_hat). Weight decay multiplies the same w in both. The fp32 evaluation adds its own
    rounding where the inputs differ: 4 ulps of the update and 2 of the weight."""
    t = step0 + 1
    b1, b2 = betas
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    n1 = world - 1
    u = 2.0 ** -24
    delta = 2 * (n1 * u / (1 - n1 * u)) * abs_sum.double() / world
    g = g.double()
    g_hi = g.abs() + delta
    m_hat = (b1 * m0.double() + (1 - b1) * g_hi) / c1
    v_lo = (b2 * v0.double() + (1 - b2) * torch.clamp(g.abs() - delta, min=0) ** 2) / c2
    s = v_lo.sqrt()
    lip = lr / (s + eps) * ((1 - b1) / c1 + m_hat.abs() * (1 - b2) * g_hi / (c2 * torch.clamp(s, min=1e-30) * (s + eps)))
    upd = lr * m_hat.abs() / (s + eps)
    ulp = lambda x: torch.nextafter(x.float().abs(), torch.tensor(float("inf"))).double() - x.float().abs().double()
    differs = delta > 0
    return torch.where(differs, lip * delta + 4 * ulp(upd) + 2 * ulp(w), torch.zeros_like(g))


def test_four_ranks_within_the_bound_of_the_gradient_sums_order(runs):
    root, _, _, four = runs
    # each library against itself: bitwise (the same order of operations from the same state)
    assert four["pt_from_mzdcp"] == four["pt_from_pt"]
    assert harness.max_abs_diff(four["pt_from_mzdcp_final"], four["pt_from_pt_final"]) == 0.0
    assert four["mz_from_mz"] == four["mz_from_pt"]            # minizero ZeRO-3 from its folder and from FSDP2's
    assert harness.max_abs_diff(four["mz_from_mz_after_one"], four["mz_from_pt_after_one"]) == 0.0
    assert harness.max_abs_diff(four["mz_from_mz_final"], four["mz_from_pt_final"]) == 0.0
    # across: the first continued loss is computed on equal weights
    assert four["pt_from_mzdcp"][0] == four["mz_from_mz"][0]
    # after one step, every weight within the derived bound of the other library's
    saved = DcpSource(_tag_folder(root, "mzdcp"))
    hp = saved.groups[0]["hparams"]
    worst, differing = 0.0, 0
    for name in saved.names:
        a, b = four["after_one"][name], four["mz_from_mz_after_one"][name]
        group = next(g for g in saved.groups if name in g["names"])
        bound = _adamw_bound(saved.read("exp_avg", name).view_as(a), saved.read("exp_avg_sq", name).view_as(a),
                             group["step"], four["grad"][name], four["abs_sum"][name], a, lr=hp["lr"],
                             betas=hp["betas"], eps=hp["eps"])
        diff = (a.double() - b.double()).abs()
        assert bool((diff <= bound).all()), (name, float((diff - bound).max()))
        worst = max(worst, float(diff.max()))
        differing += int((diff > 0).sum())
    assert differing > 0, "the orders agree now: make this test bitwise (and say why in docs/checkpoints.md)"


def test_gloo_sums_four_ranks_in_an_order_set_by_the_owner(runs):
    """The premise of the 4-rank bound: gloo's reduce-scatter adds the same four numbers to
    different results in different ranks' chunks. Measured first thing in the fixture's
    4-rank launch, on its process group (a launch of its own cost 4 ranks x 0.23 s of CPU)."""
    got = runs[3]["gloo_sums"]
    assert len(set(got)) > 1, got


def _gloo_sums() -> list[float]:
    """The distinct values the four ranks' reduce-scatter chunks hold, each the sum of the
    same four numbers."""
    import torch.distributed as dist
    vals = [1.0, 2.0 ** -24, -1.0, 3 * 2.0 ** -24]   # a sum whose rounding depends on the order
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, torch.full((16,), vals[dist.get_rank()]))
    every = [torch.empty(4) for _ in range(4)]
    dist.all_gather(every, out)
    return sorted({float(t[0]) for t in every})


# ----------------------------------------------------------------------------- bad input

def test_a_folder_it_cannot_continue_from_is_one_line_and_the_engine_unchanged(runs):
    _, _, one, _ = runs
    r = one["refusals"]
    for lib in ("minizero", "fsdp2"):
        for case in ("other_model", "truncated", "no_optimizer", "planted"):
            got = r[(lib, case)]
            assert got is not None, (lib, case)
            line, unchanged = got
            assert "\n" not in line and "Traceback" not in line and unchanged, (lib, case, line)
        assert "only in this model: blocks.2." in r[(lib, "other_model")][0], r[(lib, "other_model")]
        assert "only in the checkpoint" not in r[(lib, "other_model")][0]
        assert "__1_0.distcp" in r[(lib, "truncated")][0] and "truncated" in r[(lib, "truncated")][0]
        assert "no optimizer state" in r[(lib, "no_optimizer")][0]
        assert "refused to load" in r[(lib, "planted")][0] and "posix.system" in r[(lib, "planted")][0]
    assert not os.path.exists(MARKER)


@pytest.mark.parametrize("case", ["bad_truncated", "bad_no_optimizer", "bad_planted"])
@pytest.mark.parametrize("command", ["minizero.reshard", "minizero.export_deepspeed", "minizero.export_dcp"])
def test_the_commands_refuse_a_bad_dcp_folder_in_one_line_writing_nothing(runs, tmp_path, capsys, command, case):
    import importlib
    root = runs[0]
    main = importlib.import_module({"minizero.reshard": "minizero.checkpoint_files.reshard",
                                    "minizero.export_deepspeed": "minizero.checkpoint_files.export_deepspeed",
                                    "minizero.export_dcp": "minizero.export_dcp.command"}[command]).main
    dst = tmp_path / "out"
    extra = ["--world-size", "2"] if command == "minizero.reshard" else []
    assert main([f"{root}/{case}", str(dst), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m {command}: error: "), err
    assert {"bad_truncated": "truncated", "bad_no_optimizer": "no optimizer state",
            "bad_planted": "refused to load"}[case] in err[0]
    assert not dst.exists() and not os.path.exists(MARKER)


def test_a_planted_metadata_file_is_refused_before_anything_runs(runs, tmp_path):
    root = runs[0]
    folder = tmp_path / "planted"
    shutil.copytree(_tag_folder(root, "mzdcp"), folder)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(_Planted(), f)
    with pytest.raises(UnsafeCheckpointError) as e:
        read_metadata(str(folder))
    assert "posix.system (os.system)" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(MARKER)


def test_metadata_globals_are_what_real_folders_hold(runs, tmp_path):
    """METADATA_GLOBALS is every global torch 2.14's DCP pickles into `.metadata`: the folders
    FSDP2, minizero's parallel writer and export_dcp wrote name nothing else, and every
    class of the table but pathlib's other spellings is named by one of them."""
    root = runs[0]
    from minizero.export_dcp import export
    export(f"{root}/mz", str(tmp_path / "exported"))
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)
    for folder in (_tag_folder(root, "mzdcp"), _tag_folder(root, "pt"), _tag_folder(str(tmp_path), "exported")):
        with open(os.path.join(folder, ".metadata"), "rb") as f:
            Recording(f).load()
    listed = {(m, n) for m, names in METADATA_GLOBALS.items() for n in names}
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n, None), torch.dtype)}
    assert seen - dtypes <= listed, sorted(seen - dtypes - listed)
    assert {(m, n) for m, n in listed if not m.startswith("pathlib")} <= seen


def test_export_dcp_of_minizero_loads_in_fsdp2_equal_to_the_parallel_writer(runs, tmp_path):
    """One process writing whole tensors and every rank writing its rectangles: the same numbers."""
    root = runs[0]
    from minizero.export_dcp import export
    source, out = export(f"{root}/mz", str(tmp_path / "ex"))
    a, b = DcpSource(out), DcpSource(_tag_folder(root, "mzdcp"))
    assert a.names == b.names and a.counters == b.counters and a.groups == b.groups
    for name in a.names:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.read(kind, name), b.read(kind, name))
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]   # one process: one chunk file


def test_the_dcp_tutorial_layout_reads_too(tmp_path):
    """The DCP tutorial's {"model": ..., "optim": ...} with get_state_dict's nested optimizer
    state (param_groups a list, each naming its parameters) reads as the same state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = MODEL_FN()
    opt = torch.optim.AdamW(harness.param_groups(model, 0.1), lr=1e-3)
    x, y = BATCHES(0, 0, 0, 1)
    model(x, y)[1].backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "app"), no_dist=True)
    src = DcpSource(str(tmp_path / "app"))
    names = [n for n, _ in model.named_parameters()]
    assert src.names == names and src.counters["global_steps"] == 1
    decay = [n for n in names if n in osd["param_groups"][0]["params"]]
    assert [g["names"] for g in src.groups] == [decay, [n for n in names if n not in decay]]
    assert [g["hparams"]["weight_decay"] for g in src.groups] == [0.1, 0.0] and [g["step"] for g in src.groups] == [1, 1]
    for n, p in model.named_parameters():
        assert torch.equal(src.read("master", n), p.detach().reshape(-1))
        assert torch.equal(src.read("exp_avg_sq", n, 3, 7), opt.state[p]["exp_avg_sq"].reshape(-1)[3:7])


def test_dcp_rewritten_offline_as_minizero_and_deepspeed_holds_the_same_numbers(runs, tmp_path):
    """python -m minizero.reshard and export_deepspeed take FSDP2's DCP folder as SRC: every
    master and moment, Adam's step and the counters come out as saved."""
    from minizero.checkpoint_files.checkpoint_io import open_checkpoint
    from minizero.checkpoint_files.deepspeed_checkpoint import open_source as deepspeed_source
    from minizero.checkpoint_files.export_deepspeed import export, open_checkpoint as export_source
    from minizero.checkpoint_files.reshard import reshard
    root = runs[0]
    saved = DcpSource(_tag_folder(root, "pt"))
    _, mz_out = reshard(f"{root}/pt", str(tmp_path / "mz"), world_size=3, stage=2)
    ds_out = export(export_source(f"{root}/pt"), str(tmp_path / "ds"), world_size=3)
    for got in (open_checkpoint(mz_out), deepspeed_source(ds_out)):
        assert got.names == saved.names and got.counters == saved.counters
        assert [g["step"] for g in got.groups] == [g["step"] for g in saved.groups] == [K, K]
        for name in saved.names:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got.read(kind, name), saved.read(kind, name)), (got.library, kind, name)
