"""`python -m minizero.preflight [FLAGS] torchrun <the job's line>`: the job's torchrun line run
under a watch, with `minizero.preflight` in place of the program, so that torchrun's own
rendezvous, which no rank's code can see, ends in one line too.

torchrun's agents meet (`--rdzv-backend c10d`: in a store at --rdzv-endpoint, hosted by the node
whose name it is) before they start a single rank, and they wait for the other nodes for
`join_timeout` (600 s) before failing with a traceback; a wrong endpoint that names a host
where nothing listens fails after `read_timeout` (60 s), also as a traceback. Here, before
torchrun starts: the endpoint's name must resolve, and something must answer there unless
this node is the one that hosts it; then torchrun runs with `join_timeout` (static rendezvous:
`timeout`) set to --timeout unless the line sets it, its lines that start with "preflight:"
(the ranks' report) passed through and the rest kept in a log, and when the nodes have not
met by then, one line says what to make the same on every node.

Standard library, and torch's own torchrun parser (to read the line exactly as torchrun will).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from minizero.preflight.rendezvous import check_endpoint, resolve, say

STARTED_ENV = "MINIZERO_PREFLIGHT_STARTED"   # a file the ranks touch: torchrun's rendezvous is over
RENDEZVOUS_ERRORS = ("RendezvousTimeoutError", "RendezvousConnectionError", "RendezvousClosedError",
                     "RendezvousError")
START_GRACE_S = 30     # torchrun's import of torch and its rendezvous' own teardown, past --timeout
DROPPED = ("-m", "--module", "--no-python", "--no_python")


def launcher_at(argv: list) -> int | None:
    """Where the torchrun line starts in argv: `torchrun` (or a path to it), or
    `python -m torch.distributed.run`; None when argv is the ranks' own command line."""
    for i, a in enumerate(argv):
        if os.path.basename(a) == "torchrun":
            return i
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] == "torch.distributed.run" and i > 0:
            return i - 1
    return None


def wraps(argv: list) -> bool:
    return launcher_at(argv) is not None


def own_flags(argv: list):
    p = argparse.ArgumentParser(prog="python -m minizero.preflight", add_help=False)
    p.add_argument("--timeout", type=float, default=60.0)
    known, _ = p.parse_known_args(argv)
    return known


def this_machine(host: str) -> bool:
    """Is `host` this machine (torchrun then hosts the rendezvous store here)?"""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    mine = {resolve(socket.gethostname()), resolve(socket.getfqdn())}
    return resolve(host) in mine - {None}


def split_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:
        host, port = endpoint, str(default_port)
    return host.strip("[]"), int(port)


def rebuilt(flags: list, tr, timeout: float, program_args: list, before: list) -> list:
    """The torchrun line again: its flags, the rendezvous' wait set to `timeout` unless given,
    the preflight as the program, the job's flags and the preflight's own."""
    key = "timeout" if tr.rdzv_backend == "static" else "join_timeout"
    flags = [f for f in flags if f not in DROPPED]
    if not tr.standalone and key not in (tr.rdzv_conf or ""):
        conf = ",".join(filter(None, [tr.rdzv_conf, f"{key}={int(timeout)}"]))
        for i, f in enumerate(flags):
            if f in ("--rdzv-conf", "--rdzv_conf") and i + 1 < len(flags):
                flags = flags[:i] + flags[i + 2:]
                break
            if f.startswith(("--rdzv-conf=", "--rdzv_conf=")):
                flags = flags[:i] + flags[i + 1:]
                break
        flags += ["--rdzv-conf", conf]
    return [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "minizero.preflight", *before, *program_args]


def main(argv: list) -> int:
    at = launcher_at(argv)
    before, line = argv[:at], argv[at:]
    line = line[1:] if os.path.basename(line[0]) == "torchrun" else line[3:]
    timeout = own_flags(before).timeout
    from torch.distributed.run import get_args_parser, get_rdzv_endpoint, parse_min_max_nnodes
    tr = get_args_parser().parse_args(line)
    tail = [tr.training_script, *tr.training_script_args]
    flags = line[:len(line) - len(tail)]
    _, nodes = parse_min_max_nnodes(tr.nnodes)
    if tr.standalone or nodes == 1:
        endpoint = None
    else:
        if tr.rdzv_backend == "static" and not tr.rdzv_endpoint and tr.master_addr in ("127.0.0.1", "localhost") \
                and "--master-addr" not in " ".join(flags) and "--master_addr" not in " ".join(flags):
            say(f"FAIL rendezvous: --nnodes {tr.nnodes} without --rdzv-endpoint or --master-addr: each node's torchrun "
                f"would wait on its own localhost for the others; add --rdzv-backend c10d --rdzv-endpoint HEAD:29500 "
                f"--rdzv-id JOB, the same on every node (HEAD: the first node's name)")
            return 1
        if tr.rdzv_backend == "static" and tr.master_port is None:
            tr.master_port = 29500
        endpoint = get_rdzv_endpoint(tr)
        host, port = split_endpoint(endpoint)
        if not this_machine(host):
            why = check_endpoint(host, port, timeout, "--rdzv-endpoint",
                                 "give every node's line the first node's name and port as --rdzv-endpoint")
            if why:
                say(f"FAIL {why}")
                return 1
    with tempfile.NamedTemporaryFile(prefix="minizero-preflight-", suffix=".started", delete=False) as f:
        started = f.name
    os.remove(started)
    log_path = os.path.join(tempfile.gettempdir(), f"minizero-preflight-{os.getpid()}.log")
    cmd = rebuilt(flags, tr, timeout, tr.training_script_args, before)
    env = dict(os.environ, **{STARTED_ENV: started, "PYTHONUNBUFFERED": "1"})
    rc, fails = run(cmd, env, log_path, started, timeout, nodes)
    if rc is None or (rc != 0 and not fails):
        ran = os.path.exists(started)
        say(f"FAIL {why_stopped(rc, ran, log_path, tr, endpoint, nodes, timeout)}")
        rc = 1
    elif rc == 0:
        os.remove(log_path)
    if os.path.exists(started):
        os.remove(started)
    return rc


def run(cmd: list, env: dict, log_path: str, started: str, timeout: float, nodes: int):
    """Run torchrun; the ranks' "preflight:" lines to stdout, everything to the log. Returns
    (its exit status, or None when it was stopped for taking too long; how many lines the ranks said)."""
    fails = [0]
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def copy():
            for text in proc.stdout:
                log.write(text)
                log.flush()
                if text.startswith("preflight:"):
                    fails[0] += 1
                    print(text, end="", flush=True)
        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        t0 = time.monotonic()
        began = None
        while proc.poll() is None:
            now = time.monotonic()
            if began is None and os.path.exists(started):
                began = now
            limit = t0 + timeout + START_GRACE_S if began is None else began + 3 * timeout + 60
            if now > limit:
                stop(proc)
                reader.join(5)
                return None, fails[0]
            time.sleep(0.2)
        reader.join(5)
    return proc.returncode, fails[0]


def stop(proc) -> None:
    import signal
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def why_stopped(rc, ran: bool, log_path: str, tr, endpoint, nodes: int, timeout: float) -> str:
    with open(log_path, errors="replace") as f:
        text = f.read()
    if not ran and (rc is None or any(e in text for e in RENDEZVOUS_ERRORS)):
        host = split_endpoint(endpoint)[0] if endpoint else "localhost"
        loop = ""
        try:
            if nodes > 1 and (host == "localhost" or ipaddress.ip_address(host).is_loopback):
                loop = f"; {host} is each node's own machine: give the first node's name"
        except ValueError:
            pass
        return (f"rendezvous: the {nodes} nodes did not all join at {endpoint} (--rdzv-id {tr.rdzv_id}) within "
                f"{timeout:g} s: run this same line on every node, with the same --rdzv-endpoint (the first node's "
                f"name and port, as every node resolves it), --rdzv-id and --nnodes, and the port open between the "
                f"nodes{loop} (torchrun's log: {log_path})")
    if rc is None:
        return (f"the preflight's ranks did not finish within {3 * timeout + 60:g} s after they started "
                f"(torchrun's log: {log_path})")
    errors = [ln.strip() for ln in text.splitlines() if "Error" in ln and "ChildFailedError" not in ln]
    last = errors[-1][:240] if errors else (text.strip().splitlines() or ["(no output)"])[-1][:240]
    where = "after its ranks started" if ran else "before starting the preflight's ranks"
    return f"torchrun: exit {rc} {where}: {last} (torchrun's log: {log_path})"
