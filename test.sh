#!/usr/bin/env bash
# Install minizero into .venv and run its tests: the README's test command, and what CI runs.
#
#   ./test.sh                  # install (first run), build DeepSpeed's C++ ops (first run), run the suite
#   ./test.sh -k agreement -x  # any arguments go to pytest
#   ./test.sh --selftest       # install, then only `python -m minizero.selftest` (under a minute)
#
# The venv is .venv beside this file, made with python3 (or $PYTHON). `pip install -e ".[dev]"`
# runs when the venv has not had it yet or pyproject.toml changed since; a torch you put into
# .venv before (the CPU-only wheel, README) is kept. DeepSpeed compiles two C++ ops the first
# time a test needs them (minutes for async_io): reference/build_ops.py builds them here instead,
# once, into the folder the tests load them from, so the suite's time is the tests' own.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
installed=$venv/.minizero-dev-installed
if [ ! -x "$venv/bin/python" ]; then
    echo "test.sh: creating $venv with ${PYTHON:-python3}"
    "${PYTHON:-python3}" -m venv "$venv"
fi
if [ ! -e "$installed" ] || [ pyproject.toml -nt "$installed" ]; then
    echo "test.sh: installing minizero and its test dependencies into $venv (the first time: torch's download, minutes)"
    t0=$(date +%s)
    "$venv/bin/pip" install -q -e ".[dev]"
    touch "$installed"
    echo "test.sh: installed in $(( $(date +%s) - t0 )) s"
fi

if [ "${1:-}" = "--selftest" ]; then
    exec "$venv/bin/python" -m minizero.selftest
fi

ops=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
if [ ! -e "$ops/deepspeed_shm_comm/deepspeed_shm_comm.so" ] || [ ! -e "$ops/async_io/async_io.so" ]; then
    # one line per op: ready, cannot be built here (its tests skip), or FAILED (its tests try again)
    "$venv/bin/python" reference/build_ops.py || echo "test.sh: an op did not build (its line above says why); going on"
fi

exec "$venv/bin/python" -m pytest -q -n 2 "$@"
