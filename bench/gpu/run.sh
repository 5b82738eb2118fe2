#!/usr/bin/env bash
# The GPU check in one command (bench/gpu/README.md): the environment, the gpu-marked tests and
# the device-parametric suite on cuda:0, then tokens/s and peak memory of the training arms on a
# 1B Llama (bench/gpu/gpu_bench.py). At most about 8 minutes on one H100/H200.
#
#   bench/gpu/run.sh [--dry-run] [OUT_DIR]     (OUT_DIR defaults to $OUT, else bench/gpu/out)
#
# --dry-run runs the same steps on CPU in seconds (tiny model, a handful of device tests): CI
# runs it, so this script cannot rot between GPU runs. Wheels in bench/gpu/wheels/ (torchao for
# the GPU machine's Python; see the README) are installed with --no-index into a folder put on
# PYTHONPATH, as is this checkout: nothing is fetched and nothing needs a registry.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:-${OUT:-bench/gpu/out}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
command -v "$py" >/dev/null || py=python
start=$SECONDS
status=0

wheels=("${RETARGET_GPU_WHEELS:-bench/gpu/wheels}"/*.whl)
if [ -e "${wheels[0]}" ]; then
  site="${RETARGET_GPU_SITE:-/tmp/retarget-gpu-site}"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}" || { echo "run.sh: installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "== installed from ${wheels[0]%/*} into $site (--no-index): $(cd "$site" && ls -d ./*.dist-info | sed 's|./||; s|.dist-info||' | tr '\n' ' ')"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

echo "== environment"
"$py" bench/gpu/gpu_bench.py env | tee "$out/environment.json" || status=1

echo "== tests"
timeout_flag=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then timeout_flag=(--timeout 180); fi
if [ "$dry" = 1 ]; then
  # A few device-parametric tests on CPU: the switch, the fixture and the selection work.
  RETARGET_TEST_DEVICE=cpu "$py" -m pytest -x -q -p no:cacheprovider "${timeout_flag[@]}" \
    -m "not distributed" tests/test_device_switch.py 2>&1 | tee "$out/tests.log"
else
  # Under a cuda device every test that does not take the `device` fixture skips itself
  # (tests/conftest.py), so this runs the device-parametric suite and the gpu-marked tests. A test
  # module that cannot be imported there (a package the GPU machine lacks) is reported, and the
  # other modules still run; pytest counts such an error as a failure, so instead of -x the run
  # stops after 10 failures.
  RETARGET_TEST_DEVICE=cuda "$py" -m pytest --maxfail=10 -q -p no:cacheprovider "${timeout_flag[@]}" \
    --continue-on-collection-errors -m "not distributed and not slow" -rs tests 2>&1 |
    tee "$out/tests.log"
fi
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== training arms"
if [ "$dry" = 1 ]; then
  "$py" bench/gpu/gpu_bench.py measure --dry-run --out "$out" || status=1
else
  # RETARGET_GPU_ARMS="bf16 by hand,retarget bf16" measures only those arms (a shorter rerun).
  "$py" bench/gpu/gpu_bench.py measure --out "$out" ${RETARGET_GPU_ARMS:+--arms "$RETARGET_GPU_ARMS"} ||
    status=1
fi
echo "== quantized loading (ours and Accelerate's load_and_quantize_model, one checkpoint)"
if [ "$dry" = 1 ]; then
  "$py" bench/quant/load_compare.py --dry-run --out "$out" || status=1
else
  "$py" bench/quant/load_compare.py --out "$out" || status=1
fi
echo "== run.sh done in $((SECONDS - start)) s, status $status; results in $out"
exit "$status"
