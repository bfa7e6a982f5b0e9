#!/usr/bin/env bash
# The GPU check, one call on a machine with an NVIDIA GPU (jax with CUDA: pip install -e
# ".[test,cuda12]" or ".[test,cuda13]"). Budget: 8 minutes on one GPU, compiles included:
#   1. env      (~20 s)  the GPU, driver, jax and Triton versions
#   2. tests    (<=180 s) the kernel tests compiled through Pallas's Triton backend, not interpreted
#                         (the CPU-side lowering and cubin compile tests are skipped: CI runs them)
#   3. bench    (<=240 s) configs/kernel_bench_gpu_check.yaml: the target point (batch 32,
#                         context 2048, block 16, bf16) first, then a trimmed Fig. 18a sweep,
#                         against contiguous attention, JAX's own Pallas paged attention and a
#                         measured device-to-device copy; results written after every point
# Writes, named with the device:
#   results/kernel_bench_<device>.json         benchmark rows + summary against the GPU targets
#   results/kernel_bench_<device>_tests.log    pytest output of the compiled kernel tests
#   results/kernel_bench_<device>_stages.txt   each stage's exit code and wall time
# Every stage runs whatever the one before returned (no `set -e`); the exit code is the first
# failing stage's, so a benchmark that runs after failing tests cannot hide them.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the benchmark sizes its own arrays; leave room for them

DEVICE=$(python -c "import jax, re; d = jax.devices()[0]; print(re.sub(r'[^A-Za-z0-9]+', '_', d.device_kind).strip('_') if d.platform == 'gpu' else '')")
if [ -z "${DEVICE}" ]; then
  echo "gpu_check: no GPU (jax backend: $(python -c 'import jax; print(jax.default_backend())'))" >&2
  exit 2
fi
STAGES="results/kernel_bench_${DEVICE}_stages.txt"
: > "${STAGES}"
FIRST_FAILURE=0

stage() {  # stage NAME TIMEOUT_S COMMAND...: run, log rc and wall time, keep the first failure
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== ${name} (timeout ${limit}s) on ${DEVICE}"
  timeout --kill-after=10 "${limit}" "$@"
  rc=$?
  echo "${name} rc=${rc} wall_s=$(( $(date +%s) - start ))" | tee -a "${STAGES}"
  if [ "${rc}" -ne 0 ] && [ "${FIRST_FAILURE}" -eq 0 ]; then FIRST_FAILURE=${rc}; fi
}

stage env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python -c "import jax, jaxlib, triton; print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"triton\", triton.__version__, jax.devices())"'

# -o addopts=: one process (not the suite's two xdist workers), whether or not pytest-xdist is installed.
stage tests 180 bash -c "python -m pytest -q -p no:cacheprovider -o addopts= -m 'not slow and not compile_grid' tests/pallas_kernels \
  --ignore=tests/pallas_kernels/test_kernels_lowering.py --ignore=tests/pallas_kernels/test_kernels_compile.py \
  2>&1 | tee results/kernel_bench_${DEVICE}_tests.log; exit \${PIPESTATUS[0]}"

stage bench 240 python - "${DEVICE}" <<'PY'
import dataclasses
import logging
import sys

from experiments.kernel_bench import KernelBenchConfig, run
from jpaged.config import load_config

logging.basicConfig(level=logging.INFO)
device = sys.argv[1]
config = load_config("configs/kernel_bench_gpu_check.yaml", KernelBenchConfig)
run(dataclasses.replace(config, output=f"results/kernel_bench_{device}.json", plot=f"results/kernel_bench_{device}.png"))
PY

cat "${STAGES}"
exit "${FIRST_FAILURE}"
