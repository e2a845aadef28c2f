"""`python -m MODULE ARGS`, one command line per process, on processes forked from the tests'
preloaded forkserver, for launchers that a test starts side by side (two "nodes"):

    p = run_command("tests.support.python_m", [json.dumps(lines)], nproc=2, launcher=False,
                    rank_env=[{python_m.INDEX_ENV: "0", ...}, {python_m.INDEX_ENV: "1", ...}])
    # lines: [["torch.distributed.run", "--nnodes", "2", ...], ["minizero.preflight", ...]]
    # p.rank_stdout[i], p.rank_stderr[i], p.rank_returncodes[i]: what command line i printed, its exit status

Process i runs lines[i] as `python -m` runs a module: as `__main__` (runpy), with sys.argv
[MODULE's path, *ARGS], so the module's own `if __name__ == "__main__"` (torchrun's main(),
minizero.preflight's __main__.py) reads its command line as it would from a shell. What a
fresh interpreter adds is the import of torch before it, 2-4 s of CPU per launcher on this
machine; forked, that import was paid once by the forkserver. The processes a launcher
starts itself (torchrun's ranks, the preflight's torchrun) are its own fresh subprocesses,
as a user's are, unless forked_interpreters() is open.

python_m.forked_interpreters() goes one level further, for tests where the launcher's own
children are not what is tested: while it is open, the `python -m MODULE ...` processes that
a launcher starts with sys.executable (torchrun's workers, a preflight's torchrun) are forked
from a server process that imported torch once, through a stand-in for `python` that passes
on the command line, environment, working folder and stdin/stdout/stderr and exits with the
forked process's status. A fresh rank costs 3-4 s of CPU (torch's import, 2.2 s, and more);
a forked one a fraction of that.

Each process's exit status is the module's SystemExit code, or 1 with the traceback printed
for an uncaught exception (tests/support/command_runs.py), as the interpreter does.
"""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time

INDEX_ENV = "TESTS_PYTHON_M_INDEX"   # which of the command lines this process runs (its rank_env)


def main(argv: list[str]) -> int:
    lines = json.loads(argv[0])
    module, *args = lines[int(os.environ.pop(INDEX_ENV, "0"))]
    sys.executable = os.environ.get(SHIM_ENV, sys.executable)   # forked_interpreters(), when open
    sys.argv = [module, *args]      # runpy's alter_sys puts the module's file in sys.argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


# ------------------------------------------------------------------ forked interpreters

SERVER_ENV = "TESTS_FORKED_PYTHON"          # the unix socket the interpreter server listens on
SHIM_ENV = "TESTS_FORKED_PYTHON_SHIM"       # the executable that stands in for sys.executable

# The stand-in for `python`: a fresh interpreter without site (a few tens of ms) that hands
# `[-u] -m MODULE ARGS`, its environment, its working folder and its fds 0-2 to the server,
# which forks a process with torch already imported to run it; it then waits for that
# process's exit status and exits with it. Any other command line (-c, a script) runs in
# the real interpreter (exec), as does everything when the server is not named.
_SHIM = '''#!{python} -S
import os, socket, sys
argv = sys.argv[1:]
i = 0
while i < len(argv) and argv[i] == "-u":
    i += 1
addr = os.environ.get({server!r})
if not addr or i + 1 >= len(argv) or argv[i] != "-m":
    os.execv({python!r}, [{python!r}, *argv])
s = socket.socket(socket.AF_UNIX)
s.connect(addr)
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
msg = repr({{"argv": argv[i + 1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}}).encode()
socket.send_fds(s, [len(msg).to_bytes(8, "big")], fds)
s.sendall(msg)
got = b""
while len(got) < 8:
    part = s.recv(8 - len(got))
    if not part:
        sys.exit(1)
    got += part
rc = int.from_bytes(got, "big", signed=True)
if rc < 0:
    os.kill(os.getpid(), -rc)
sys.exit(rc)
'''


def _recv_exact(conn, n: int) -> bytes:
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            raise EOFError
        got += part
    return got


def _run_forked(request: dict, fds: list) -> None:
    """In the forked process: become `python -u -m MODULE ARGS` as the shim's request says;
    never returns."""
    import io
    import signal
    import traceback
    rc = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for target, fd in zip(request["fds"], fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # unbuffered, as torchrun's `python -u` is: each line reaches the pipe as it is printed
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
        if "torch" in sys.modules:   # the thread count torchrun gives its ranks (OMP_NUM_THREADS)
            sys.modules["torch"].set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        module, *args = request["argv"]
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                rc = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(rc)


def _serve(path: str, shim: str, session: int) -> None:
    """The interpreter server (a process forked from the preloaded forkserver, one thread):
    one fork per shim that connects; its exit status back when it ends; SIGTERM to it when
    its shim is gone first (a launcher stopping its workers)."""
    import ast
    import gc
    import selectors
    import signal
    import socket
    gc.freeze()
    sys.executable = shim
    live: dict = {}

    def stop(*_):
        for pid in list(live):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    checked = time.monotonic()
    while True:
        if time.monotonic() - checked > 1:   # the test session gone without closing the server: end too
            checked = time.monotonic()
            try:
                os.kill(session, 0)
            except ProcessLookupError:
                stop()
        for key, _ in sel.select(0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
                    request = ast.literal_eval(_recv_exact(conn, int.from_bytes(head, "big")).decode())
                except (EOFError, ValueError, SyntaxError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for k in list(sel.get_map().values()):
                        k.fileobj.close()
                    conn.close()
                    _run_forked(request, fds)
                for fd in fds:
                    os.close(fd)
                live[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            else:                    # the shim hung up before its process ended
                sel.unregister(key.fileobj)
                key.fileobj.close()
                live[key.data] = None
                try:
                    os.kill(key.data, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = live.pop(pid, None)
            if conn is not None:
                sel.unregister(conn)
                try:
                    conn.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))
                except OSError:
                    pass
                conn.close()


@contextlib.contextmanager
def forked_interpreters():
    """While open, `python -m MODULE ...` started by a process that has the yielded variables
    in its environment, and by python_m's processes (main() makes the shim their
    sys.executable), runs on a process forked from an interpreter that imported torch and the
    forkserver's preloads once: torchrun's workers (`python -u -m minizero.train ...`), a
    preflight's own torchrun. Everything else about the launch is the launcher's own: its
    arguments, environment, working folder, stdin/stdout/stderr (passed as fds), exit status,
    and its SIGTERM reaching the process (the shim's death ends it)."""
    import tempfile

    from minizero.runtime import spawn
    from tests.support import command_runs  # noqa: F401  (its preloads, before the forkserver starts)
    with tempfile.TemporaryDirectory(prefix="forked-python-") as folder:
        path, shim = os.path.join(folder, "server"), os.path.join(folder, "python")
        with open(shim, "w") as f:
            f.write(_SHIM.format(python=sys.executable, server=SERVER_ENV))
        os.chmod(shim, 0o755)
        server = spawn.context().Process(target=_serve, args=(path, shim, os.getpid()), daemon=True)
        server.start()
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if not server.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the forked-interpreter server did not start")
                time.sleep(0.02)
            yield {SERVER_ENV: path, SHIM_ENV: shim}
        finally:
            server.terminate()
            server.join(10)
