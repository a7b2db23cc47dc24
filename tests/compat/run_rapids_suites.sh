#!/usr/bin/env bash
# Run RAPIDS ucxx's own test suites, unmodified, against two installed
# builds, back to back, and print the pass counts:
#   - python/ucxx/ucxx/_lib_async/tests             (the async API)
#   - python/distributed-ucxx/distributed_ucxx/tests (the Dask backend)
#
# usage: tests/compat/run_rapids_suites.sh RAPIDS_SRC [OURS_VENV] [BASE_VENV]
#   RAPIDS_SRC  a checkout/extract of rapidsai/ucxx (0.52 line); nothing is
#               fetched, nothing of it is kept
#   OURS_VENV   venv with this ucxx installed, plus distributed-ucxx-cu12
#               (--no-deps), pytest-asyncio, pytest-timeout, distributed,
#               pandas (default: the active venv, $VIRTUAL_ENV)
#   BASE_VENV   venv with ucxx-cu12 and the same test packages (default:
#               /work/rapids-venv); "-" skips the baseline
# env: SUITES="async dask" (default both), PYTEST_ARGS (extra arguments),
#      UCX_TLS (default tcp: CPU-only), OUT (directory for logs/junit).
#
# The helpers the async tests import from ucxx._lib_async (utils_test,
# pytest_stash_keys) are this package's own: nothing of RAPIDS_SRC but the
# test directories is used.
set -uo pipefail

src=${1:?usage: $0 RAPIDS_SRC [OURS_VENV] [BASE_VENV]}
src=$(cd "$src" && pwd)
ours=${2:-${VIRTUAL_ENV:?no venv given and none active}}
base=${3:-/work/rapids-venv}
suites=${SUITES:-async dask}
export UCX_TLS=${UCX_TLS:-tcp}
async_src=$src/python/ucxx/ucxx/_lib_async
dask_src=$src/python/distributed-ucxx/distributed_ucxx
for d in "$async_src/tests" "$dask_src/tests"; do
    [ -d "$d" ] || { echo "missing $d" >&2; exit 2; }
done

work=$(mktemp -d /tmp/ucxx-rapids-suites.XXXXXX)
out=${OUT:-$work/out}
mkdir -p "$out"
trap 'rm -rf "$work/async" "$work/dask"' EXIT

# Copies outside any checkout (pytest must not find a project's conftest,
# pyproject or ucxx package above them).
cp -r "$async_src/tests" "$work/async"
cp -r "$dask_src/tests" "$work/dask"
rm -rf "$work/async/__pycache__" "$work/dask/__pycache__"

# RAPIDS' own pytest settings (python/*/pyproject.toml): asyncio_mode=auto
# for the async suite, its markers for distributed-ucxx.
async_opts=(-o asyncio_mode=auto -p no:cacheprovider)
dask_opts=(-o "markers=ignore_alive_references gpu slow workerstate" -p no:cacheprovider)

run_one() {  # name venv suite
    local name=$1 venv=$2 suite=$3 dir opts log
    if [ "$suite" = async ]; then dir=$work/async; opts=("${async_opts[@]}")
    else dir=$work/dask; opts=("${dask_opts[@]}"); fi
    log=$out/$name-$suite.log
    (
        cd "$work" &&
        timeout 5400 "$venv/bin/python" -m pytest \
            --import-mode=append --rootdir="$dir" -q -rfE --timeout=300 \
            --junitxml="$out/$name-$suite.xml" "${opts[@]}" \
            ${PYTEST_ARGS:-} "$dir"
    ) > "$log" 2>&1
    echo "$name $suite: $(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|(passed|failed|errors?|skipped).* in [0-9.]+s' "$log" | tail -1)"
}

echo "UCX_TLS=$UCX_TLS  logs: $out"
for suite in $suites; do
    run_one ours "$ours" "$suite"
    [ "$base" = "-" ] || run_one rapids "$base" "$suite"
done
