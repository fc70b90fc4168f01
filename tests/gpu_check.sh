#!/usr/bin/env bash
# Everything that needs the GPU, in one run, with a short table at the end: the test
# suite on compiled kernels, every notebook executed on the GPU, and compute-sanitizer
# (memcheck over every kernel; racecheck and synccheck over the LSTM exchange).
# Usage: bash tests/gpu_check.sh [LOG_DIR]   (from anywhere; needs a CUDA GPU)
#        SANITIZE=0 leaves compute-sanitizer out; WORKERS sets pytest's processes (4).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$logs"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
PY=${PYTHON:-python3}
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
status() { if [ "$1" = 0 ]; then echo pass; else echo "FAIL ($1)"; fi; }

$PY -m pytest tests -q -p no:cacheprovider -n "${WORKERS:-4}" -o addopts="" -rfE > "$logs/pytest.log" 2>&1
pytest_rc=$?
$PY tests/run_notebooks.py book/*.ipynb > "$logs/notebooks.log" 2>&1
notebooks_rc=$?
sanitize() {  # tool, log name, workload arguments
  if [ "${SANITIZE:-1}" = 0 ]; then echo "not run (SANITIZE=0)" > "$logs/$2"; return 125; fi
  if ! command -v compute-sanitizer >/dev/null 2>&1; then echo "no compute-sanitizer" > "$logs/$2"; return 127; fi
  compute-sanitizer --tool "$1" --error-exitcode 9 --print-limit 20 $PY tests/sanitizer_workload.py "${@:3}" \
    > "$logs/$2" 2>&1
}
sanitize memcheck memcheck.log; memcheck_rc=$?
sanitize racecheck racecheck.log lstm; racecheck_rc=$?
sanitize synccheck synccheck.log lstm; synccheck_rc=$?

echo
echo "| check | result | summary |"
echo "| --- | --- | --- |"
echo "| pytest (compiled kernels) | $(status $pytest_rc) | $(tail -1 "$logs/pytest.log") |"
echo "| notebooks on the GPU | $(status $notebooks_rc) | $(grep -c '^ok ' "$logs/notebooks.log") ok, $(grep -c '^FAILED' "$logs/notebooks.log") failed |"
for tool in memcheck racecheck synccheck; do
  rc_name=${tool}_rc
  echo "| compute-sanitizer $tool | $(status ${!rc_name}) | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|no compute|not run' "$logs/$tool.log" | tail -1) |"
done
