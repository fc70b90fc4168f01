#!/usr/bin/env bash
# Everything the GPU verification needs, one step after another, each step's output in
# its own log and a short table at the end (also written to LOG_DIR/summary.md):
#
#   pytest                 the test suite on compiled kernels
#   notebooks              every notebook of the book, executed on the GPU (tests/run_notebooks.py)
#   memcheck               compute-sanitizer memcheck over tests/sanitizer_workload.py (every
#                          public function at tiny shapes, --quick, PyTorch's caching allocator
#                          off so that an access past a tensor's end is seen)
#   initcheck              the same workload under initcheck (reads of memory never written)
#   racecheck-SECTION      racecheck and synccheck over the kernels whose programs share
#   synccheck-SECTION      memory or wait on each other, at small shapes (--small): the LSTM
#                          exchange, the Sinkhorn tile kernels, the segment kernels, the CTC
#                          recursion (SANITIZE_SECTIONS="lstm sinkhorn_tile segment ctc")
#   bench-CHAPTER          python -m packed_kernels.bench CHAPTER --out BENCH_OUT, one run per
#                          chapter (BENCH_CHAPTERS="ctc sinkhorn segment_ops lstm models"), only
#                          with BENCH=1: the rest fits in about ten minutes on one H100
#
# Two-GPU mode (a machine with two GPUs): tests/test_devices.py (kernels on the GPU that
# holds their inputs) and examples/ddp_training.py under torchrun, one GPU per rank:
#
#   devices, ddp
#
# Usage: bash tests/gpu_check.sh [LOG_DIR]              (default: $OUT, else /tmp/gpu_check)
#        bash tests/gpu_check.sh --two-gpu [LOG_DIR]
# Environment:
#   STEPS="pytest memcheck racecheck"   run only these steps (a name, or a name's prefix before
#                                       "-": racecheck runs every racecheck-SECTION); default all
#   STEP_TIMEOUT=540                    seconds each step may run (then it is stopped: TIMEOUT);
#   TIMEOUT_<STEP>=...                  one step's own limit, e.g. TIMEOUT_PYTEST=900,
#                                       TIMEOUT_RACECHECK_LSTM=300 (upper case, "-" as "_")
#   SANITIZE=0                          leave compute-sanitizer out
#   MEMCHECK_SIZE=--small               the workload's size under memcheck and initcheck (default --quick;
#                                       "" for every case),
#   MEMCHECK_SECTIONS="ctc segment"     the workload sections under memcheck (default: all but sinkhorn_tile)
#   RACECHECK_SIZE=--small              and under racecheck and synccheck (default --quick)
#   BENCH=1                             run the benchmarks too (default 0); BENCH_CHAPTERS chooses chapters,
#   BENCH_OUT=DIR                       where they write (default LOG_DIR/bench; book/results
#                                       updates the book's recorded results)
#   WORKERS=4                           pytest processes (with pytest-xdist installed)
#   PYTEST_ARGS="--durations=20"        more arguments for pytest
#   PYTHON=python3                      the interpreter
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=single
if [ "${1:-}" = "--two-gpu" ]; then
  mode=two-gpu
  shift
fi
logs=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}

rows=()
failed=0

# selected NAME: whether STEPS (default: every step) names the step or its prefix before "-"
selected() {
  [ -z "${STEPS:-}" ] && return 0
  local wanted
  for wanted in $STEPS; do
    if [ "$wanted" = "$1" ] || [ "$wanted" = "${1%%-*}" ]; then return 0; fi
  done
  return 1
}

# limit NAME: the step's timeout in seconds (TIMEOUT_<NAME>, else STEP_TIMEOUT)
limit() {
  local var
  var="TIMEOUT_$(echo "$1" | tr '[:lower:]-' '[:upper:]_')"
  echo "${!var:-$STEP_TIMEOUT}"
}

# summarise NAME LOG: the lines of the log that say how the step went (else its last line)
summarise() {
  local name=$1 log=$2 found=
  case $name in
    notebooks) found="$(grep -c '^ok ' "$log") ok, $(grep -c '^FAILED' "$log") failed" ;;
    memcheck|initcheck|racecheck-*|synccheck-*)
      found=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^all checks passed|^[0-9]+ failed in' "$log" \
              | sed 's/^========= //' | paste -sd ';' -) ;;
    bench-*) found=$(grep -E '^wrote ' "$log" | tail -n 1) ;;
  esac
  if [ -n "$found" ]; then echo "$found"; else tail -n 1 "$log" | cut -c1-200; fi
}

# step NAME COMMAND...: run COMMAND under the step's timeout, output in LOG_DIR/NAME.log
# (SIGINT first, so that pytest still prints its summary of failures)
step() {
  local name=$1
  shift
  selected "$name" || return 0
  local log="$logs/$name.log" seconds rc result start
  seconds=$(limit "$name")
  start=$(date +%s)
  echo "== $name (at most ${seconds} s): $*" >&2
  timeout -s INT --kill-after=30 "$seconds" "$@" > "$log" 2>&1
  rc=$?
  case $rc in
    0) result=pass ;;
    124|137) result="TIMEOUT (${seconds} s)"; failed=1 ;;
    *) result="FAIL ($rc)"; failed=1 ;;
  esac
  rows+=("| $name | $result | $(( $(date +%s) - start )) | $(summarise "$name" "$log" | tr '|' '/') |")
}

# skipped NAME WHY: a row for a step that cannot run here
skipped() {
  selected "$1" || return 0
  echo "$2" > "$logs/$1.log"
  rows+=("| $1 | not run | 0 | $2 |")
}

sanitize() {  # tool, step name, workload arguments
  local tool=$1 name=$2
  shift 2
  if [ "${SANITIZE:-1}" = 0 ]; then skipped "$name" "SANITIZE=0"; return; fi
  if ! command -v compute-sanitizer > /dev/null 2>&1; then skipped "$name" "no compute-sanitizer on PATH"; return; fi
  local extra=()
  # one allocation per tensor: memcheck sees accesses past a tensor's end, which would
  # land inside a larger block of the caching allocator
  case $tool in memcheck|initcheck) extra=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;; esac
  step "$name" "${extra[@]}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
    "$PY" tests/sanitizer_workload.py --progress "$@"
}

environment=$("$PY" -c "import torch, triton; n = torch.cuda.device_count(); \
print(f'{n} x {torch.cuda.get_device_name()}' if n else 'no CUDA GPU', 'torch', torch.__version__, 'triton', triton.__version__)" 2>&1)
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "$environment" | tee "$logs/environment.log" >&2

if [ "$mode" = single ]; then
  workers=()
  if "$PY" -c "import xdist" > /dev/null 2>&1; then workers=(-n "${WORKERS:-4}"); fi
  step pytest "$PY" -m pytest tests -q -p no:cacheprovider "${workers[@]}" -o addopts="" -rfE ${PYTEST_ARGS:-}
  step notebooks "$PY" tests/run_notebooks.py book/*.ipynb
  sanitize memcheck memcheck ${MEMCHECK_SIZE---quick} ${MEMCHECK_SECTIONS:-}
  sanitize initcheck initcheck ${MEMCHECK_SIZE---quick} ${MEMCHECK_SECTIONS:-}
  for section in ${SANITIZE_SECTIONS:-lstm sinkhorn_tile segment ctc}; do
    sanitize racecheck "racecheck-$section" "${RACECHECK_SIZE:---quick}" "$section"
    sanitize synccheck "synccheck-$section" "${RACECHECK_SIZE:---quick}" "$section"
  done
  mkdir -p "${BENCH_OUT:=$logs/bench}"
  for chapter in ${BENCH_CHAPTERS:-ctc sinkhorn segment_ops lstm models}; do
    if [ "${BENCH:-0}" = 0 ]; then
      skipped "bench-$chapter" "BENCH=0"
    else
      step "bench-$chapter" "$PY" -m packed_kernels.bench "$chapter" --out "$BENCH_OUT"
    fi
  done
else
  if [ "$gpus" -lt 2 ]; then
    skipped devices "needs two GPUs; $gpus visible"
    skipped ddp "needs two GPUs; $gpus visible"
    failed=1
  else
    step devices "$PY" -m pytest tests/test_devices.py -q -p no:cacheprovider -o addopts="" -rfE ${PYTEST_ARGS:-}
    step ddp "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 examples/ddp_training.py
  fi
fi

{
  echo "$environment"
  echo
  echo "| step | result | seconds | summary |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
  echo
  echo "logs: $logs"
} | tee "$logs/summary.md"
exit $failed
