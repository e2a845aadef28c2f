#!/usr/bin/env bash
# gpu_lease.sh -- one prepared run for a briefly lent single-GPU box (nothing installed but
# PyTorch, no network): at most 8 minutes, most informative first, each part under its own
# time limit, its results in a handful of files. docs/gpu.md ("A lease of one GPU") says what
# each part shows.
# What it runs, part by part (budget in seconds: each at least 1.3x its measured time,
# docs/results/gpu_leases.md; the default parts add up to at most LIMIT):
#   wheels     15  carried wheels (.whl/, or GPU_LEASE_WHEELS) installed: DeepSpeed on a box without network
#   env        25  versions and API probes: torch / CUDA / NCCL, torch.distributed.set_timeout, DeepSpeed
#   nccl       60  launch/nccl_ws1.py under torchrun --nproc-per-node 1: every collective through NCCL, late
#                  (its parameter-offload case with every FlatParam partitioned: --plan shows what it offloads)
#   preflight  40  python -m minizero.preflight under torchrun --nproc-per-node 1: its NCCL path, one line per check
#   readme     70  the README's command under torchrun --nproc-per-node 1: ZeRO-3 bf16, save at 100, resume to 200
#   regress   110  gpu_check's one-GPU regression checks (CUDA-only tests, host syncs, a resume)
#   full       60  gpu_check's resume-1gpu-z3-bf16 at full size: the tutorial GPT at 32x32, deterministic kernels
#   ds         90  python -m minizero.compare in fp16, minizero against DeepSpeed (where its wheels are carried)
# Not in the default run (name them: bash launch/gpu_lease.sh OUT memory fp16):
#   memory     90  gpu_check's memory-overlap-z2/z3: peak with overlap_comm on against off (iGPT-S)
#   fp16      150  launch/bench_overlap.py in fp16: step / floor per stage (DeepSpeed beside it where it imports)
# Exit status: the worst part's (the highest: a timeout's 124 above a failure's 1), 0 only if
# every part exited 0.
# Node / GPU count: one node, one GPU (every part passes --gpus 1, --world-size 1, --nproc 1 or
# --nproc-per-node 1); on a box of several GPUs run launch/gpu_check.sh instead.
#
#   bash launch/gpu_lease.sh OUT [PART ...]      # default: the default parts, in the order above
#   bash launch/gpu_lease.sh --plan [PART ...]   # the plan (--dry-run too): each part, its budget, its commands
#
# Python is python3 (or $PYTHON), never `python`: the lent image may have no `python`.
# DeepSpeed on a box without a network: carry it as wheels in .whl/ (the repository root; or the
# folder GPU_LEASE_WHEELS names) and the wheels part installs them (pip --no-index --target, put
# on PYTHONPATH). For the box's Python 3.12, on a machine with pip and a network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types \
#       typing-inspection typing-extensions hjson     # the versions pydantic's metadata pins
#   pip wheel --no-deps -w .whl deepspeed              # pure Python without its ops (DS_BUILD_OPS unset)
# (einops, msgpack, ninja, psutil, py-cpuinfo, packaging and tqdm are on the box already.)
#
# OUT receives parts.log (one line per part: exit status and seconds), env.txt, nccl_ws1.json,
# preflight.txt, readme.txt, regress.md, full.md, ds.md (memory.md, fp16.md) and logs.tgz
# (every log and summary.json, no checkpoints).
set -uo pipefail
cd "$(dirname "$0")/.."
ORDER=(wheels env nccl preflight readme regress full ds)
EXTRA=(memory fp16)
declare -A BUDGET=([wheels]=15 [env]=25 [nccl]=60 [preflight]=40 [readme]=70 [regress]=110 [full]=60 [ds]=90
                   [memory]=90 [fp16]=150)
LIMIT=480   # the whole run: 8 minutes
PY=${PYTHON:-python3}
PLAN=0
case ${1:-} in
  --plan|--dry-run) PLAN=1; OUT=OUT; shift ;;
  ""|-*) echo "usage: bash launch/gpu_lease.sh OUT [PART ...]  |  bash launch/gpu_lease.sh --plan" >&2; exit 2 ;;
  *) OUT=$1; shift ;;
esac
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=("${ORDER[@]}")
[ "${PARTS[0]}" = wheels ] || PARTS=(wheels "${PARTS[@]}")   # every part may need what the wheels bring
WORK=OUT/work
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
WHEELS=${GPU_LEASE_WHEELS:-.whl}

log() { [ "$PLAN" = 1 ] || echo "gpu_lease $(date +%H:%M:%S) $*" | tee -a "$OUT/parts.log"; }
WORST=0      # the worst exit status of any command of any part: the script's own
PART_RC=0    # the worst of the running part's commands

# run LOG CMD...: one command under what is left of its part's budget: SIGTERM GRACE s before
# the part's end (gpu_check then stops its own commands and writes its table), SIGKILL at the
# end, so no part outlives its budget; its output in $WORK/LOG. With --plan: print the command.
GRACE=6
run() {
  local name=$1; shift
  if [ "$PLAN" = 1 ]; then
    local cmd="$*"
    [ "$cmd" = "${cmd%%$'\n'*}" ] || cmd="${cmd%%$'\n'*} ..."   # a Python script: its first line
    echo "       \$ $cmd"; return 0
  fi
  local left=$((DEADLINE - SECONDS - GRACE)) rc
  if [ "$left" -le 0 ]; then echo "no time left for: $*" >> "$WORK/$name"; PART_RC=124; return 124; fi
  timeout -k "$GRACE" "$left" "$@" >> "$WORK/$name" 2>&1
  rc=$?
  [ "$rc" -le "$PART_RC" ] || PART_RC=$rc
  return $rc
}

has_deepspeed() { [ "$PLAN" = 1 ] || "$PY" -c "import deepspeed" > /dev/null 2>&1; }
keep() { [ "$PLAN" = 1 ] || cp "$1" "$OUT/$2" 2>/dev/null; }

part_wheels() {   # DeepSpeed and what it needs, from carried wheels
  if [ "$PLAN" = 1 ] || compgen -G "$WHEELS/*.whl" > /dev/null; then
    run wheels.log "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WORK/site" "$WHEELS"/*.whl || return
    [ "$PLAN" = 1 ] || log "wheels: installed $(find "$WHEELS" -name '*.whl' | wc -l) from $WHEELS/"
  fi
}

part_env() {   # what this box has: the versions, and the APIs the code and the checks lean on
  run env.txt nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  PART_RC=0   # a probe: what nvidia-smi says (or that it is missing) is a finding, not a failure
  run env.txt "$PY" -c 'import sys, torch, torch.distributed as dist
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("set_timeout", "get_default_backend_for_device"):
    print(f"torch.distributed.{name}:", hasattr(dist, name))
print("torch.cuda._sleep:", hasattr(torch.cuda, "_sleep"), "set_sync_debug_mode:", hasattr(torch.cuda, "set_sync_debug_mode"))
try:
    import deepspeed; print("deepspeed", deepspeed.__version__)
except Exception as e:
    print("deepspeed: not importable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")'
  keep "$WORK/env.txt" env.txt
}

part_nccl() {   # every collective through NCCL at world size 1, issued late (launch/nccl_ws1.py)
  run nccl.log "${TORCHRUN[@]}" launch/nccl_ws1.py --out "$WORK/nccl_ws1.json"
  keep "$WORK/nccl_ws1.json" nccl_ws1.json
  if [ "$PLAN" = 1 ]; then   # what each case's engine offloads, built here on the CPU (a few seconds)
    local said
    echo "       what each case keeps where (\$ $PY launch/nccl_ws1.py --dry-run):"
    if said=$("$PY" launch/nccl_ws1.py --dry-run 2>&1); then
      printf '%s\n' "$said" | sed 's/^/         /'
    else   # no torch in this Python: the plan still stands
      echo "         (not shown: $(printf '%s\n' "$said" | tail -n 1))"
    fi
  fi
}

part_preflight() {   # the preflight on one GPU: the job's checks through NCCL, one line each
  run preflight.txt "${TORCHRUN[@]}" -m minizero.preflight --dataset synthetic --save-dir "$WORK/preflight" \
    --data-dir "$WORK/data" --timeout 30
  keep "$WORK/preflight.txt" preflight.txt
}

part_readme() {   # the README's command on one GPU: real NCCL init, barrier, destroy
  local flags=(-m minizero.train --stage 3 --dtype bf16 --dataset synthetic --eval-every 0 --num-samples 0)
  run readme.log "${TORCHRUN[@]}" "${flags[@]}" --max-steps 100 --save-every 100 --save-dir "$WORK/readme" &&
    run readme.log "${TORCHRUN[@]}" "${flags[@]}" --max-steps 200 --resume "$WORK/readme" --tag global_step100 \
      --save-dir "$WORK/readme-resumed"
  local rc=$?
  run readme.txt "$PY" -c 'import json, sys
for d in sys.argv[1:]:
    try:
        s = json.load(open(d + "/summary.json"))
        print(d.split("/")[-1], s["status"], "steps", s["steps"], "world", s["world_size"], "final loss", s["final_loss"])
    except OSError as e:
        print(d.split("/")[-1], "no summary.json:", e)' "$WORK/readme" "$WORK/readme-resumed"
  keep "$WORK/readme.txt" readme.txt
  return $rc
}

check() {   # check NAME ARGS...: launch/gpu_check.py on one GPU, its table to OUT/NAME.md
  local name=$1; shift
  run "$name.log" "$PY" launch/gpu_check.py --gpus 1 --out "$WORK/$name" "$@"
  local rc=$?
  keep "$WORK/$name/gpu_check.md" "$name.md"
  return $rc
}

part_regress() {   # the one-GPU checks that have caught or could catch a regression, quick sizes
  check regress --quick --only cuda-checkpointing cuda-offload sync-debug-z0-bf16 'sync-debug-z3-*' \
    resume-1gpu-z2-fp16
}

part_memory() { check memory --quick --only 'memory-overlap-*'; }   # --quick: 2 steps, iGPT-S still

part_fp16() {   # step / floor per stage in fp16, the tutorial GPT at 1023 tokens x 16
  local libs=minizero
  has_deepspeed && libs=minizero,deepspeed
  run fp16.log "$PY" launch/bench_overlap.py --libs "$libs" --world-size 1 --reps 1 --no-trace --knobs default \
    --dtypes fp16 --seq 1023 --micro-batch 16 --warmup 3 --steps 5 --out "$WORK/fp16.md" --json "$WORK/fp16.json"
  local rc=$?
  keep "$WORK/fp16.md" fp16.md
  return $rc
}

part_ds() {   # minizero against DeepSpeed in fp16 on the GPU
  if ! has_deepspeed; then echo "deepspeed does not import: skipped" >> "$WORK/ds.log"; return 0; fi
  run ds.log "$PY" -m minizero.compare --libs minizero deepspeed --stages 1 3 --dtype fp16 --nproc 1 --model tiny \
    --dataset synthetic --image-size 8 --max-steps 10 --synthetic-train 1024 --synthetic-test 64 --out "$WORK/ds"
  local rc=$?
  keep "$WORK/ds/report.md" ds.md
  return $rc
}

part_full() { check full --only resume-1gpu-z3-bf16; }   # full size: not --quick

total=0
for part in "${PARTS[@]}"; do total=$((total + ${BUDGET[$part]:-0})); done
if [ "$PLAN" = 1 ]; then
  echo "gpu_lease plan: ${#PARTS[@]} parts, $total s of a $LIMIT s limit, each part under its own timeout;" \
       "OUT = the folder given (also: ${EXTRA[*]}, by name)"
fi
if [ "$total" -gt "$LIMIT" ]; then echo "gpu_lease: the budgets add up to $total s > $LIMIT s" >&2; exit 2; fi
if [ "$PLAN" = 0 ]; then
  mkdir -p "$OUT"
  WORK=$(mktemp -d -t gpu_lease.XXXX)   # in $TMPDIR: checkpoints and data never reach OUT
  trap 'rm -rf "$WORK"' EXIT           # what is worth keeping is in OUT (logs.tgz: every log and summary)
  export PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHON=$PY
fi
for part in "${PARTS[@]}"; do
  if [ -z "${BUDGET[$part]:-}" ]; then
    if [ "$PLAN" = 1 ]; then echo "unknown part $part (${ORDER[*]} ${EXTRA[*]})"; else
      log "unknown part $part (${ORDER[*]} ${EXTRA[*]})"; fi
    WORST=$((WORST > 2 ? WORST : 2))
    continue
  fi
  [ "$PLAN" = 1 ] && printf '  %-9s %3d s\n' "$part" "${BUDGET[$part]}"
  t0=$SECONDS
  DEADLINE=$((SECONDS + BUDGET[$part]))
  PART_RC=0
  "part_$part"
  rc=$?
  [ "$rc" -ge "$PART_RC" ] || rc=$PART_RC   # a part is as bad as its worst command
  [ "$rc" -le "$WORST" ] || WORST=$rc
  log "$part: exit $rc in $((SECONDS - t0)) s (budget ${BUDGET[$part]} s)"
  # every log, report and summary, no checkpoints, data or installed wheels: one file the copy-back takes
  [ "$PLAN" = 1 ] || (cd "$WORK" && find . -name '*.pt' -prune -o -name data -prune -o -path ./site -prune -o -type f \
    \( -name '*.log' -o -name '*.md' -o -name '*.json' -o -name '*.csv' -o -name '*.txt' \) -size -4M -print0 |
    tar czf "$OUT/logs.tgz" --null -T -)
done
[ "$PLAN" = 1 ] || log "worst exit status: $WORST"
exit "$WORST"
