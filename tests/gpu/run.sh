#!/usr/bin/env bash
# GPU checks on a machine with a CUDA GPU, in a few minutes: build the
# extension in place, run tests/gpu, run the GPU benchmark. Wheels the
# machine lacks (libucx-cu12, pytest-asyncio) may be carried in .whl/.
# Output goes to $OUT (default /tmp/ucxx-gpu) as gpu-tests.txt, gpu-bench.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ucxx-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi -L
    python3 --version
    python3 -c 'import cupy; print("cupy", cupy.__version__)'
} 2>&1 | tee "$OUT/env.txt"
python3 setup.py -q build_ext --inplace 2>&1 | grep -v "warnings.warn\|BetaConfiguration" | tail -5
python3 -c 'import ucxx; print("ucxx on UCX", ucxx.get_ucx_version())' || exit 1
rc=0
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu \
    2>&1 | tee "$OUT/gpu-tests.txt" || rc=1
grep -q " passed" "$OUT/gpu-tests.txt" || rc=1
for args in "-n 1 --n-iter 2000" "-n 1MiB --n-iter 200" \
            "-n 64MiB --n-iter 20" "-n 256MiB --n-iter 10" \
            "-n 64MiB --n-iter 20 --progress-mode thread"; do
    echo "== send_recv -o cupy $args"
    timeout 300 python3 -m ucxx.benchmarks.send_recv -o cupy $args \
        --no-detailed-report || rc=1
done 2>&1 | tee "$OUT/gpu-bench.txt"
exit $rc
