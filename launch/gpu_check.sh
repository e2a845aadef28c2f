#!/usr/bin/env bash
# gpu_check.sh -- the one-command GPU check: every check this machine's GPUs allow, then one
# table (check, PASS / FAIL / SKIP with the reason, the numbers), also written to
# <out>/gpu_check.md with every log in <out>/logs/. Exit status 0 iff nothing FAILed.
#
# What it runs: python launch/gpu_check.py "$@", which runs as subprocesses: the CPU suite with
#   CUDA hidden; the CUDA activation-checkpointing and offload tests; train + resume == straight at
#   ZeRO 0-3 x fp16/bf16 on 1 GPU and x fp16/bf16/fp32 on all GPUs (torchrun,
#   TORCH_DISTRIBUTED_DEBUG=DETAIL); the tutorial's step 5 and each offload alone; overlap on == off;
#   the fp16 overflow vote with an inf on one rank; peak memory per stage (iGPT-S) against the ZeRO
#   formula; full_fp32_state_dict with offload; one step under set_sync_debug_mode("error"); the
#   trace, comms logger and desync check; cpu_checkpointing; the README's first command; a
#   two-"node" job on one box; minizero vs DeepSpeed. What each asserts: docs/gpu.md.
# Node / GPU counts: one machine; it uses every GPU torch sees. Choose them with
#   CUDA_VISIBLE_DEVICES=0,1 bash launch/gpu_check.sh, or --gpus N; the two-"node" checks give
#   each "node" half of them. Checks that need more GPUs than there are say SKIP.
#
#   bash launch/gpu_check.sh --plan           # the plan: every check and command, nothing run (any machine)
#   bash launch/gpu_check.sh --quick          # tiny model, few steps
#   bash launch/gpu_check.sh --only 'resume-*' --out reports/my-check
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" launch/gpu_check.py "$@"
