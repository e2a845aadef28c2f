"""launch/bench_two_nodes.py: bad flags give one line; a machine that cannot make namespaces
gets one line and exit 0; where it can (root, iproute2), the link is made, slowed and removed,
and one training run goes through it (torch ZeRO-3, micro GPT, 4 steps, 2 nodes x 1 rank:
a torchrun per namespace and one rank each, about 15 s of CPU). Timing itself is not tested."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_two_nodes.py"


def bench():
    return load_script(SCRIPT)


@pytest.mark.parametrize("argv, says", [
    (["--max-steps", "3"], "--max-steps must be >= 4"),
    (["--libs", "jax"], "invalid choice"),
    (["--settings", "MiCS"], "invalid choice"),
])
def test_bad_flags_give_one_line(argv, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("bench_two_nodes: error:") and says in err[0], err


def test_without_root_it_skips_in_one_line(monkeypatch, capsys):
    b = bench()
    monkeypatch.setattr(b.os, "geteuid", lambda: 1000)
    b.main([])
    assert capsys.readouterr().out.splitlines() == ["bench_two_nodes: skipped: making network namespaces needs root"]


def test_plan_runs_minizero_once_its_config_has_the_key():
    from minizero.compare.compare import minizero_knows
    b = bench()
    runs, left_out = b.plan(SimpleNamespace(settings=list(b.SETTINGS), libs=list(b.SCRIPTS)))
    ran = {(name, lib) for name, lib, _ in runs}
    assert {("ZeRO-3", lib) for lib in b.SCRIPTS} | {("hpZ", "deepspeed"), ("hpZ", "torch"), ("HSDP", "torch")} <= ran
    assert ("HSDP", "deepspeed") not in ran and "HSDP deepspeed: deepspeed has no HSDP" in left_out
    for name, key in (("hpZ", "zero_hpz_partition_size"), ("HSDP", "hsdp_shard_size")):
        assert ((name, "minizero") in ran) == minizero_knows(key)
        assert any(line.startswith(f"{name} minizero: minizero's config has no {key}") for line in left_out) \
            != minizero_knows(key)


@pytest.fixture
def nodes():
    b = bench()
    two = b.TwoNodes()
    if why := two.why_not():
        pytest.skip(why)
    with two:
        yield b, two
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in two.ns)   # removed on exit


def test_the_link_is_made_slowed_and_counted(nodes):
    b, two = nodes
    two.limit("20mbit")
    shown = b.sh("tc", "qdisc", "show", "dev", b.LINK, ns=two.ns[1]).stdout
    assert "tbf" in shown and "20Mbit" in shown
    two.limit(None)
    assert "tbf" not in b.sh("tc", "qdisc", "show", "dev", b.LINK, ns=two.ns[1]).stdout
    assert isinstance(two.link_bytes(), int)


def test_one_run_crosses_the_link(nodes, tmp_path):
    """torch's ZeRO-3 on 2 namespaces x 1 rank: it trains, its per-step times are read, and
    the veth carried bytes (the parameters' all-gathers cross it every step). One rank per
    namespace, not the bench's 2: what is tested is the link and the two torchruns across it,
    the same for any number of ranks behind each; two more ranks would cost two more
    interpreters importing torch."""
    b, two = nodes
    b.PER_NODE = 1
    from minizero.comm import free_port
    args = SimpleNamespace(model="micro", max_steps=4, dtype="fp32")
    ms, link = b.run(two, "torch", b.config({}, "fp32"), args, tmp_path / "run", free_port())
    assert ms > 0 and link > 100_000
