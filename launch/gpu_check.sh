#!/usr/bin/env bash
# gpu_check.sh -- the one-command GPU check: every check this machine's GPUs allow, then one
# PASS / FAIL / SKIP table. What it runs and what each check asserts: docs/gpu.md (the one
# place that describes it); this runs launch/gpu_check.py "$@" with python3 (or $PYTHON).
# Node / GPU counts: one machine; it uses every GPU torch sees. Choose them with
#   CUDA_VISIBLE_DEVICES=0,1 bash launch/gpu_check.sh, or --gpus N.
#
#   bash launch/gpu_check.sh --plan           # the plan: every check and command, nothing run (any machine)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" launch/gpu_check.py "$@"
