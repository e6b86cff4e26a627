#!/usr/bin/env bash
# The standing CUDA check, as one command on a GPU machine from the repository root:
#   tests/test_api_device.py (API == server npz, graph replay == eager, predict_many == single calls, latencies)
#   perf/runners/bench_cuda.py (ours beside upstream MoGe-2 infer(use_fp16=True) on the same GPU)
# Logs and the benchmark's JSON go to $OUT (default /tmp/cuda-check). A GPU machine without network can carry
# the missing Python packages as wheels in .whl/ (installed into /tmp/site first); see docs/devices-and-precision.md.
#   bash scripts/device/cuda_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/code:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nproc
    command -v g++ || echo "no g++: the host steps run on the torch path"
    python3 -c "import torch, tt_moge; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tt_moge', tt_moge.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
(cd code && timeout "${TEST_TIMEOUT:-330}" python3 -m pytest tests/test_api_device.py -q -s -rs -p no:cacheprovider) 2>&1 \
    | tee "$OUT/test_api_device.log"
TEST_STATUS=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-200}" python3 -m perf.runners.bench_cuda --calls "${CALLS:-30}" --json "$OUT/bench_cuda.json" 2>&1 \
    | tee "$OUT/bench_cuda.log"
BENCH_STATUS=${PIPESTATUS[0]}
echo "test_api_device exit $TEST_STATUS, bench_cuda exit $BENCH_STATUS"
[ "$TEST_STATUS" = 0 ] && [ "$BENCH_STATUS" = 0 ]
