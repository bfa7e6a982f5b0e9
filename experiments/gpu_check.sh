#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (jax with CUDA installed, `pip install -e ".[test]"` done): run the
# kernel tests compiled through Pallas's Triton backend (not interpreted), then the Fig. 18a kernel
# benchmark, writing results named with the device:
#   results/kernel_bench_<device>.json / .png   benchmark rows + summary vs the issue's GPU targets
#   results/kernel_bench_<device>_tests.log     pytest output of the compiled kernel tests
# Budget: under 8 minutes in all (each stage has its own timeout). Commit what it writes.
set -euo pipefail
cd "$(dirname "$0")/.."

python -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 'no GPU: jax backend is ' + jax.default_backend())"
DEVICE=$(python -c "import jax, re; print(re.sub(r'[^A-Za-z0-9]+', '_', jax.devices()[0].device_kind).strip('_'))")
mkdir -p results
echo "== kernel tests, compiled, on ${DEVICE}"
set +e
timeout 180 python -m pytest -q -p no:cacheprovider tests/pallas_kernels 2>&1 | tee "results/kernel_bench_${DEVICE}_tests.log"
TESTS_RC=${PIPESTATUS[0]}
set -e
echo "== kernel benchmark on ${DEVICE}"
timeout 270 python - "${DEVICE}" <<'PY'
import dataclasses
import logging
import sys

from experiments.kernel_bench import KernelBenchConfig, run
from jpaged.config import load_config

logging.basicConfig(level=logging.INFO)
device = sys.argv[1]
config = load_config("configs/kernel_bench.yaml", KernelBenchConfig)
run(dataclasses.replace(config, output=f"results/kernel_bench_{device}.json", plot=f"results/kernel_bench_{device}.png"))
PY
exit "${TESTS_RC}"
