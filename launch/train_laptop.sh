#!/usr/bin/env bash
# train_laptop.sh -- a CPU laptop run of minizero (ZeRO-3, 2 processes, synthetic data),
# then the same run under real DeepSpeed (reference/train.py) for comparison.
#
# What it runs: `torchrun --standalone --nproc-per-node $NPROC -m minizero.train --stage 3
#   --dataset synthetic ...` on the gloo backend, then the DeepSpeed reference the same way.
# Node / GPU counts: one node only (--standalone). Change the number of processes with
#   NPROC=4 bash launch/train_laptop.sh. On a single GPU machine set NPROC to the number of
#   GPUs (NCCL is picked automatically when CUDA is visible); for several nodes use
#   launch/slurm_minizero.sbatch instead.
# Other knobs (environment): STAGE (0-3), DTYPE (fp32|bf16|fp16), MODEL (tiny|micro|tutorial|
#   igpt-s), STEPS, OUT (the save-dir root), REFERENCE=0 to skip the DeepSpeed run.
# Extra arguments are passed to both training scripts, e.g. `bash launch/train_laptop.sh --seed 1`.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
STAGE=${STAGE:-3}
DTYPE=${DTYPE:-fp32}
MODEL=${MODEL:-tiny}
STEPS=${STEPS:-50}
OUT=${OUT:-runs/laptop}
REFERENCE=${REFERENCE:-1}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}   # DeepSpeed on CPU (gloo)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

COMMON=(--stage "$STAGE" --dtype "$DTYPE" --model "$MODEL" --dataset synthetic --image-size 8
        --micro-batch 8 --grad-accum 1 --max-steps "$STEPS" --seed 0 --eval-every 0 "$@")

# minizero: plain torchrun (a rendezvous on localhost, a free port picked by --standalone).
torchrun --standalone --nproc-per-node "$NPROC" -m minizero.train "${COMMON[@]}" --save-dir "$OUT/minizero"

# The same run under real DeepSpeed. Either torchrun (the script reads the torchrun env) ...
if [ "$REFERENCE" = 1 ]; then
  torchrun --standalone --nproc-per-node "$NPROC" reference/train.py "${COMMON[@]}" --save-dir "$OUT/deepspeed"
  # ... or DeepSpeed's own launcher, equivalently:
  #   deepspeed --num_gpus "$NPROC" reference/train.py "${COMMON[@]}" --save-dir "$OUT/deepspeed"
  # (on CPU the DeepSpeed launcher counts CPU "devices"; torchrun is the simpler choice.)
  echo "compare: python -m minizero.compare --stages $STAGE --dtype $DTYPE --nproc $NPROC --model $MODEL"
fi
