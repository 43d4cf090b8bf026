#!/usr/bin/env bash
# Regenerate the committed CPU reports under docs/reports/cpu/ (see docs/reports/README.md).
# Each command writes its full output under runs/reports/NAME; the report, the raw figures and the
# plots are then copied here. The load before and after each run goes to stdout: put it in RECORD.md.
#   usage: docs/reports/regenerate-cpu.sh [ddp-misconfig] [fsdp-wrap] [strategies] [moe] [pp] [pp-tiny] [gpu-suite]
#   (default: all)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1  # one thread per process: `single` gets one core, 2-process runs one each
DISTFT=${DISTFT:-distft}
DEST=docs/reports/cpu
COMMON=(--model micro --nproc 2)

run() {  # NAME FILES... -- distft bench ARGS...
  local name=$1; shift
  local files=(); while [[ $1 != -- ]]; do files+=("$1"); shift; done; shift
  echo "== $name: $(date -u +%FT%TZ); before: $(uptime)"
  local start=$SECONDS
  $DISTFT bench "$@" --out "runs/reports/$name" || echo "!! $name: exit $? (see the report)"
  echo "== $name: $((SECONDS - start)) s; after: $(uptime)"
  mkdir -p "$DEST/$name"
  for f in "${files[@]}"; do cp runs/reports/"$name"/$f "$DEST/$name/"; done
}

set -- "${@:-ddp-misconfig fsdp-wrap strategies moe pp pp-tiny gpu-suite}"
for name in $*; do
  case $name in
    ddp-misconfig | fsdp-wrap)
      run "$name" study.md study.json "study_$name.png" -- --study "$name" "${COMMON[@]}" --repeats 3 \
        --steps 3 --warmup 1 --global-batch 8 --micro-batch 1 --seq-len 256 data.max_rows=64 ;;
    strategies)
      run strategies report.md results.json '*.png' -- \
        --strategies single,ddp,fsdp,zero2,tp,tp-sp,pp "${COMMON[@]}" --repeats 3 --steps 2 --warmup 1 \
        --global-batch 4 --micro-batch 1 --seq-len 256 --project 2xrtx4090-pcie,2xh100-nvlink \
        data.max_rows=32 train.eval_batches=1 ;;
    moe)  # the strategies that take a mixture of experts, qwen3-moe-micro's 8 experts (top-2)
      run moe report.md results.json '*.png' -- \
        --strategies single,ddp,fsdp,fsdp+ep,tp --model qwen3-moe-micro --nproc 2 --repeats 3 --steps 2 \
        --warmup 1 --global-batch 4 --micro-batch 1 --seq-len 256 --project 2xh100-nvlink \
        data.max_rows=32 train.eval_batches=1 ;;
    pp)  # every schedule at m = 2 and 4, each with the balanced and the even cut of micro's 4 layers
      run pp report.md results.json '*.png' -- \
        --strategies pp "${COMMON[@]}" --pp-sweep --pp-microbatches 2,4 --pp-splits balanced,even \
        --steps 2 --warmup 1 --global-batch 4 --micro-batch 1 --seq-len 256 data.max_rows=32 \
        train.eval_batches=1 ;;
    pp-tiny)  # tiny at 768 tokens a row: its layers weigh more against the head, the balanced cut moves
      run pp-tiny report.md results.json '*.png' -- \
        --strategies pp --model tiny --nproc 2 --pp-sweep gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv \
        --pp-microbatches 4 --pp-splits balanced,even --steps 2 --warmup 1 --global-batch 4 \
        --micro-batch 1 --seq-len 768 data.max_rows=32 train.eval_batches=1 ;;
    gpu-suite)  # the one-GPU suite on the CPU: a check that it runs, not a speed figure
      run gpu-suite report.md results.json -- --gpu --model micro --seq-len 256 --steps 2 --warmup 1 \
        --global-batch 4 ;;
    *) echo "unknown report $name (ddp-misconfig, fsdp-wrap, strategies, moe, pp, pp-tiny, gpu-suite)"; exit 2 ;;
  esac
done
