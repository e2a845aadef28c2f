#!/usr/bin/env bash
# gpu_lease.sh -- what to run on a briefly lent single-GPU box (a few minutes, nothing installed
# but PyTorch, no network), most important first, each part under its own time limit,
# everything small enough to copy back as a handful of files.
# Node / GPU count: one node, one GPU (every part passes --gpus 1, --nproc 1 or --world-size 1);
# on a box of several GPUs run launch/gpu_check.sh instead.
#
# DeepSpeed on a box without a network: carry it as wheels in .whl/ (the repository root; or the
# folder GPU_LEASE_WHEELS names) and this script installs them first (pip --no-index --target,
# put on PYTHONPATH). For the box's
# Python 3.12, on a machine with pip and a network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types \
#       typing-inspection typing-extensions hjson     # the versions pydantic's metadata pins
#   pip wheel --no-deps -w .whl deepspeed              # pure Python without its ops (DS_BUILD_OPS unset)
# (einops, msgpack, ninja, psutil, py-cpuinfo, packaging and tqdm are on the box already.)
#
# What it runs, part by part:
#
#   1 env      nvidia-smi, Python / torch / CUDA / NCCL versions, whether DeepSpeed imports
#   2 check    launch/gpu_check.py --gpus 1 --quick: the CUDA-only tests, resume == straight at
#              ZeRO 0-3 x fp16/bf16, the tutorial's step 5, one step per stage under
#              set_sync_debug_mode("error") (the checks one GPU allows)
#   3 compare  python -m minizero.compare --libs minizero torch: samples/s and peak CUDA memory per
#              stage, bf16, the tutorial GPT at 16x16, minizero vs PyTorch DDP / FSDP2
#   4 bench    launch/bench_overlap.py --world-size 1, bf16 then fp32: step / floor per stage with
#              CUDA events, tokens/s and peak CUDA memory, the tutorial GPT on 32x32 images
#              (1023 tokens, micro-batch 16); minizero and DeepSpeed where DeepSpeed imports
#   5 ds       python -m minizero.compare --libs minizero deepspeed, bf16, ZeRO 0-3, deterministic
#              kernels: the two libraries' losses and model-state bytes side by side (the same
#              command on a CPU shows the same bf16 op-order noise; docs/gpu.md "Results")
#   6 user     the README's first command (gpu_check's user-command; its report goes in logs.tgz)
#   7 fsdp     ZeRO-2 bf16 beside FSDP2 twice with deterministic kernels (MINIZERO_DETERMINISTIC=1):
#              each library repeats itself bit for bit, and the two differ by the clipping noise
#              docs/fsdp.md explains (5.8e-5 on the second H200 lease; the tiny CPU model never clips).
#              Each library against itself says whether a gap is run-to-run noise
#              (fsdp.txt: every run's losses, and which pairs are equal)
#
#   bash launch/gpu_lease.sh OUT [PART ...]      # default: every part, in the order above
#
# OUT receives env.txt, gpu_check.md, compare.md, bench.md, ds_compare.md, fsdp.txt, lease.log and
# logs.tgz (every log and summary.json, no checkpoints): at most 8 files, so that a lease's
# copy-back takes them all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash launch/gpu_lease.sh OUT [PART ...]}; shift
PARTS=${*:-env check compare bench ds user fsdp}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHON=$PY
WORK=$(mktemp -d -t gpu_lease.XXXX)   # in $TMPDIR, else /tmp
trap 'rm -rf "$WORK"' EXIT     # what is worth keeping is in OUT (logs.tgz: every log and summary)
mkdir -p "$OUT"
log() { echo "gpu_lease $(date +%H:%M:%S) $*" | tee -a "$OUT/lease.log"; }
WHEELS=${GPU_LEASE_WHEELS:-.whl}   # carried wheels (DeepSpeed and what it needs), if any
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
       "$WHEELS"/*.whl > "$WORK/wheels.log" 2>&1; then
    export PYTHONPATH=$WORK/site:$PYTHONPATH
    log "wheels: installed $(find "$WHEELS" -name '*.whl' | wc -l) from $WHEELS/"
  else
    log "wheels: pip failed: $(tail -1 "$WORK/wheels.log")"
  fi
fi

# the tutorial GPT at 16x16, as the first lease's compare ran it: the compare and fsdp parts share it
TUTORIAL16=(--model tutorial --dataset synthetic --image-size 16 --max-steps 20 --synthetic-train 2000 --synthetic-test 64)

for part in $PARTS; do
  t0=$SECONDS; rc=0
  case $part in
    env)
      { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda,
'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))"
        $PY -c "import deepspeed" 2>&1 | tail -1; nproc; free -g | head -2; } > "$OUT/env.txt" 2>&1; rc=$? ;;
    check)
      timeout 300 $PY launch/gpu_check.py --gpus 1 --quick --skip cpu-suite user-command 'compare*' \
        --out "$WORK/check" > "$WORK/check.log" 2>&1; rc=$?
      cp "$WORK/check/gpu_check.md" "$OUT/" 2>/dev/null ;;
    compare)
      timeout 110 $PY -m minizero.compare --libs minizero torch --stages 0 2 3 --dtype bf16 --nproc 1 \
        "${TUTORIAL16[@]}" --out "$WORK/compare" > "$WORK/compare.log" 2>&1; rc=$?
      cp "$WORK/compare/report.md" "$OUT/compare.md" 2>/dev/null ;;
    bench)
      libs=minizero
      $PY -c "import deepspeed" > /dev/null 2>&1 && libs=minizero,deepspeed
      : > "$OUT/bench.md"
      for dt in bf16 fp32; do
        timeout 170 $PY launch/bench_overlap.py --libs $libs --world-size 1 --reps 1 --no-trace --knobs default \
          --dtypes $dt --seq 1023 --micro-batch 16 --warmup 3 --steps 5 --out "$WORK/bench_$dt.md" \
          --json "$WORK/bench_$dt.json" > "$WORK/bench_$dt.log" 2>&1 || rc=$?
        cat "$WORK/bench_$dt.md" >> "$OUT/bench.md" 2>/dev/null
      done ;;
    ds)
      MINIZERO_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 $PY -m minizero.compare \
        --libs minizero deepspeed --stages 0 1 2 3 --dtype bf16 --nproc 1 --model tiny --dataset synthetic \
        --image-size 8 --max-steps 20 --synthetic-train 1024 --synthetic-test 64 \
        --out "$WORK/ds" > "$WORK/ds.log" 2>&1; rc=$?
      cp "$WORK/ds/report.md" "$OUT/ds_compare.md" 2>/dev/null ;;
    user)
      timeout 100 $PY launch/gpu_check.py --gpus 1 --only user-command --out "$WORK/user" \
        > "$WORK/user.log" 2>&1; rc=$? ;;
    fsdp)
      for run in a b; do
        MINIZERO_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 70 $PY -m minizero.compare \
          --libs minizero torch --stages 2 --dtype bf16 --nproc 1 "${TUTORIAL16[@]}" \
          --out "$WORK/fsdp_$run" > "$WORK/fsdp_$run.log" 2>&1; rc=$?
      done
      $PY - "$WORK" > "$OUT/fsdp.txt" 2>&1 <<'PYEOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
losses = {}
for run in "ab":
    for lib in ("minizero", "torch"):
        f = work / f"fsdp_{run}" / f"{lib}-stage2" / "summary.json"
        if f.is_file():
            losses[(lib, run)] = json.loads(f.read_text())["losses"]
            print(lib, run, "final loss", losses[(lib, run)][-1])
        else:
            print(lib, run, "no summary.json")
pairs = [(("minizero", "a"), ("minizero", "b")), (("torch", "a"), ("torch", "b")), (("minizero", "a"), ("torch", "a"))]
for x, y in pairs:
    if x in losses and y in losses:
        gap = max(abs(p - q) for p, q in zip(losses[x], losses[y]))
        print(x, y, "equal" if losses[x] == losses[y] else f"max |dloss| {gap:.3e}")
PYEOF
      ;;
    *) log "unknown part $part (env check compare bench ds user fsdp)"; continue ;;
  esac
  log "$part: exit $rc in $((SECONDS - t0)) s"
  # every log, report and summary, no checkpoints, data or installed wheels: one file that the copy-back takes
  (cd "$WORK" && find . -name '*.pt' -prune -o -name data -prune -o -path ./site -prune -o -type f \( -name '*.log' -o -name '*.md' \
     -o -name '*.json' -o -name '*.csv' -o -name '*.txt' \) -size -4M -print0 | tar czf "$OUT/logs.tgz" --null -T -)
done
