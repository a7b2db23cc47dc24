#!/usr/bin/env bash
# The GPU checks, in one device command of at most ~8 minutes:
#   1. install the carried wheels (.whl/gpu/N/, from tests/gpu/fetch_wheels.sh)
#      into one --target per side: SITE/ours (UCX) and SITE/rapids (UCX,
#      RAPIDS ucxx, rmm, ...); check both sides' requirements;
#   2. build the extension in place against SITE/ours' UCX;
#   3. run tests/gpu;
#   4. profile: tests/gpu/probe.py for both packages, with UCX_PROTO_INFO=y
#      and UCX_LOG_LEVEL=info, then for this package under variants
#      (UCX's own RNDV_THRESH, RAPIDS' UCX defaults, no stream in the
#      interface, thread mode, no cuda_ipc);
#   5. RAPIDS' benchmark command for both packages, interleaved (ab.py):
#      1 B / 1 MiB / 64 MiB / 256 MiB x fresh / --reuse-alloc x blocking /
#      thread, until the deadline.
# Everything goes to $OUT (at most 8 files come back from a device command):
#   run.log env.txt gpu-tests.txt profile.txt bench-summary.md bench.json
#   bench-raw.txt
#
#   OUT=/tmp/x tests/gpu/run.sh                  # everything
#   OUT=/tmp/x tests/gpu/run.sh --install-only   # step 1 (carry sets 1..N-1)
#
# Environment: UCXX_GPU_BUDGET_S (whole run, default 450), UCXX_GPU_PROFILE_S
# (step 4's share, default 90), UCXX_GPU_ROUNDS (default 2),
# UCXX_GPU_RUN_TIMEOUT (one benchmark run, default 45 s; a failed run is
# retried once), UCXX_GPU_PYTHON (default python3), UCXX_GPU_SITE (default
# /tmp/ucxx-gpu-site), UCXX_GPU_OBJECT (default cupy; numpy runs steps 4-5
# on host memory, a dry run of the pipeline without a GPU), UCXX_GPU_QUICK=1
# (short runs), UCXX_GPU_SIZES / UCXX_GPU_MODES (a subset for step 5, e.g.
# 1B,64MiB / blocking).  Exit: 0 all done and passed, 1 a step failed, 3 no usable
# CUDA device (steps 3-5 not run).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
T0=$(date +%s)
OUT=${OUT:-/tmp/ucxx-gpu}
PY=${UCXX_GPU_PYTHON:-python3}
SITE=${UCXX_GPU_SITE:-/tmp/ucxx-gpu-site}
OBJ=${UCXX_GPU_OBJECT:-cupy}
BUDGET=${UCXX_GPU_BUDGET_S:-450}
PROFILE_S=${UCXX_GPU_PROFILE_S:-90}
ROUNDS=${UCXX_GPU_ROUNDS:-2}
QUICK=${UCXX_GPU_QUICK:-0}
RUN_TIMEOUT=${UCXX_GPU_RUN_TIMEOUT:-45}
DEADLINE=$((T0 + BUDGET))
RCWD=${TMPDIR:-/tmp}/ucxx-gpu-rapids-cwd
mkdir -p "$OUT" "$SITE/ours" "$SITE/rapids" "$RCWD"
export PYTHONUNBUFFERED=1
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
exec > >(tee -a "$OUT/run.log") 2>&1
rc=0
declare -A STEP_S
step() { echo; echo "=== $* ($(($(date +%s) - T0)) s)"; }
timed() { local name=$1 t=$(date +%s); shift; "$@"; local r=$?; STEP_S[$name]=$(($(date +%s) - t)); return $r; }
OURS_EXTRA=()  # environment for this package's runs alone (none at present)
ours_env() { env -u PYTHONPATH PYTHONPATH="$SITE/ours:$REPO" "${OURS_EXTRA[@]}" "$@"; }
rapids_env() { (cd "$RCWD" && env -u PYTHONPATH PYTHONPATH="$SITE/rapids" "$@"); }

# ------------------------------------------------------------------ 1. install
install_wheels() {
    local manifest="" set d missing=0 side
    for d in .whl/gpu/[0-9]*/; do
        [ -f "$d/manifest.tsv" ] && manifest="$d/manifest.tsv" && break
    done
    if [ -z "$manifest" ]; then
        echo "no .whl/gpu/N/manifest.tsv here: run tests/gpu/fetch_wheels.sh and carry .whl/gpu/N"
        return 1
    fi
    for side in ours rapids; do
        local files=()
        while IFS=$'\t' read -r whl _ sha s set; do
            [ "$s" = "$side" ] || [ "$s" = both ] || continue
            if [ -f "$SITE/$side/.ok-$sha" ]; then
                continue  # installed by an earlier command on this machine
            fi
            if [ ! -f ".whl/gpu/$set/$whl" ]; then
                echo "missing: $whl (carry set $set; not installed earlier on this machine)"
                missing=1
                continue
            fi
            echo "$sha  .whl/gpu/$set/$whl" | sha256sum -c --quiet || return 1
            files+=(".whl/gpu/$set/$whl")
        done < "$manifest"
        if [ ${#files[@]} -gt 0 ]; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target "$SITE/$side" "${files[@]}" || return 1
            for f in "${files[@]}"; do
                touch "$SITE/$side/.ok-$(sha256sum "$f" | cut -d' ' -f1)"
            done
        fi
        echo "$side: $(ls "$SITE/$side" | grep -c dist-info) distributions in $SITE/$side"
    done
    [ $missing = 0 ] || return 2
}
check_requirements() {
    local side r=0
    for side in ours rapids; do
        echo "requirements of $side:"
        (cd "$RCWD" && "$PY" "$REPO/tests/gpu/check_reqs.py" "$SITE/$side") || r=1
    done
    return $r
}
step "1. install the carried wheels into $SITE/{ours,rapids}"
timed install install_wheels
irc=$?
if [ $irc = 2 ] && [ "${1:-}" = --install-only ]; then
    echo "install-only: some sets still to come"; exit 0
fi
[ $irc = 0 ] || { echo "install failed"; exit 1; }
[ "${1:-}" = --install-only ] && { echo "install-only: done"; exit 0; }
# unmet requirements are reported and fail the run, but the steps that can
# still run do (each side's runs then fail on their own)
check_requirements || { echo "UNMET REQUIREMENTS (above)"; rc=1; }

# ------------------------------------------------------------------ environment
step "environment -> env.txt"
{
    echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "kernel: $(uname -r)  cpus: $(nproc)"
    nvidia-smi -L 2>&1 | head -4
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
    "$PY" --version 2>&1
    for m in numpy cupy-cuda13x cuda-bindings cuda-core nvidia-ml-py pytest setuptools; do
        printf '%s %s\n' "$m" "$("$PY" -c "import importlib.metadata as m; print(m.version('$m'))" 2>/dev/null || echo absent)"
    done
    "$PY" -c 'import cupy; print("cupy CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())' 2>&1 | tail -1
    ucxlib=$(ours_env "$PY" -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')
    echo "UCX (both sides): $(LD_LIBRARY_PATH=$ucxlib/lib "$ucxlib/bin/ucx_info" -v 2>&1 | head -1)"
    echo "UCX transports:"
    LD_LIBRARY_PATH=$ucxlib/lib timeout 60 "$ucxlib/bin/ucx_info" -d 2>&1 \
        | awk '/Transport:/ {t = $3} /Device:/ {printf "  %s/%s", t, $3} END {print ""}'
    echo
    echo "UCX_* in the environment: $(env | grep '^UCX_' | paste -sd' ')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ------------------------------------------------------------------ 2. build
build() {
    ours_env "$PY" setup.py -q build_ext --inplace -j "$(nproc)" 2>&1 \
        | grep -E "(error|warning):" | tail -20
    ours_env "$PY" -c 'import ucxx; print("ours:", ucxx.__file__, "UCX", ucxx.get_ucx_version())' || return 1
    # The package leaves out its UCX defaults that the loaded UCX lacks
    # (TCP_USER_TIMEOUT before UCX 1.22), so init needs nothing from the
    # environment with RAPIDS' UCX 1.21. Its RNDV_THRESH default
    # (intra:8m,inter:auto) applies to device buffers too: within a host,
    # device messages below 8 MiB go eagerly (profile.txt has UCX's own
    # threshold beside it; RAPIDS sets 8192).
    local init
    init=$(ours_env "$PY" -c 'import ucxx; ucxx.init(); print("init ok, UCX_RNDV_THRESH in effect:", ucxx.get_config().get("RNDV_THRESH")); ucxx.reset()' 2>&1)
    echo "$init" | grep -q "init ok" || { echo "$init" | tail -5; return 1; }
    echo "ours: ${init##*init ok, }" | tee -a "$OUT/env.txt"
    local where
    where=$(rapids_env "$PY" -c 'import ucxx; print(ucxx.__file__, "UCX", ucxx.get_ucx_version())' 2>&1 | tail -1)
    echo "RAPIDS: $where"
    case "$where" in "$SITE/rapids/"*) ;; *) echo "RAPIDS ucxx does not come from $SITE/rapids"; return 1 ;; esac
}
step "2. build against $SITE/ours' UCX"
timed build build || { echo "build failed"; exit 1; }
echo "environment for this package's runs alone: ${OURS_EXTRA[*]:-none}" | tee -a "$OUT/env.txt"

# ------------------------------------------------------------------ GPU?
step "CUDA device"
gpu_err=$(timeout 90 "$PY" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
assert int(cupy.arange(4).sum()) == 6
print(n, "device(s):", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())' 2>&1)
gpu_rc=$?
echo "$gpu_err" | tail -3
if [ $gpu_rc != 0 ]; then
    echo "no usable CUDA device (rc $gpu_rc): $(echo "$gpu_err" | tail -1)"
    if [ "$OBJ" = cupy ]; then
        {
            echo "# Not run: no usable CUDA device"
            echo
            echo "\`$PY -c 'import cupy; cupy.cuda.runtime.getDeviceCount()'\` failed (rc $gpu_rc):"
            echo
            echo '```'; echo "$gpu_err" | tail -5; echo '```'
            echo
            echo "Steps done: install ${STEP_S[install]} s, build ${STEP_S[build]} s."
        } > "$OUT/bench-summary.md"
        echo "steps: install ${STEP_S[install]} s, build ${STEP_S[build]} s; tests, profile, benchmark not run"
        exit 3
    fi
fi

# ------------------------------------------------------------------ 3. tests/gpu
step "3. tests/gpu -> gpu-tests.txt"
tests() {
    ours_env timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
    local r=${PIPESTATUS[0]}
    if [ "$OBJ" = cupy ]; then
        [ "$r" = 0 ] && grep -q " passed" "$OUT/gpu-tests.txt"
    else
        [ "$r" = 0 ] || [ "$r" = 5 ]  # a dry run without a GPU: all skipped
    fi
}
timed tests tests || rc=1

# ------------------------------------------------------------------ 4. profile
step "4. profile -> profile.txt"
profile() {
    local end=$(($(date +%s) + PROFILE_S)) q=() v name side envs
    [ "$QUICK" = 1 ] && q=(--quick)
    # name | side | environment
    local variants=(
        "defaults + UCX_PROTO_INFO, log info|ours|UCX_PROTO_INFO=y UCX_LOG_LEVEL=info"
        "defaults + UCX_PROTO_INFO, log info|rapids|UCX_PROTO_INFO=y UCX_LOG_LEVEL=info"
        "UCX's own RNDV_THRESH (the package's sends device messages < 8 MiB eagerly)|ours|UCX_RNDV_THRESH=auto"
        "RAPIDS' UCX defaults|ours|UCX_MEMTYPE_CACHE=n UCX_RNDV_THRESH=8192 UCX_RNDV_FRAG_MEM_TYPE=cuda"
        "no stream in the interface (CAI v2)|ours|CUPY_CUDA_ARRAY_INTERFACE_EXPORT_VERSION=2"
        "thread mode|ours|MODE=thread"
        "without cuda_ipc|ours|UCX_TLS=^cuda_ipc"
        "thread mode|rapids|MODE=thread"
    )
    for v in "${variants[@]}"; do
        IFS='|' read -r name side envs <<< "$v"
        if [ "$(date +%s)" -ge "$end" ]; then
            echo "### not run (profile time used up): $side, $name"
            continue
        fi
        local mode=blocking e=()
        for kv in $envs; do
            case $kv in MODE=*) mode=${kv#MODE=} ;; *) e+=("$kv") ;; esac
        done
        echo
        echo "### $side: $name"
        echo "\$ ${e[*]} $PY tests/gpu/probe.py --mode $mode --object $OBJ ${q[*]}"
        "${side}_env" env "${e[@]}" timeout 75 "$PY" "$REPO/tests/gpu/probe.py" \
            --mode "$mode" --object "$OBJ" "${q[@]}" 2>&1 | head -c 4000000
        echo "### rc ${PIPESTATUS[0]}"
    done > "$OUT/profile.txt"
    grep -E "^###|round trip|^  [a-z0-9]" "$OUT/profile.txt" | grep -v "^###.*rc 0" | head -120
}
timed profile profile

# ------------------------------------------------------------------ 5. benchmark
step "5. RAPIDS' benchmark command, ours and RAPIDS interleaved -> bench-summary.md"
bq=()
[ "$QUICK" = 1 ] && bq=(--quick)
[ -n "${UCXX_GPU_SIZES:-}" ] && bq+=(--sizes "$UCXX_GPU_SIZES")
[ -n "${UCXX_GPU_MODES:-}" ] && bq+=(--modes "$UCXX_GPU_MODES")
timed bench "$PY" tests/gpu/ab.py --site "$SITE" --out "$OUT" --python "$PY" \
    --object "$OBJ" --rounds "$ROUNDS" --deadline $((DEADLINE - 10)) "${bq[@]}" \
    --run-timeout "$RUN_TIMEOUT" \
    "${OURS_EXTRA[@]/#/--ours-env=}" || rc=1

step "done"
{
    echo
    echo "## This run"
    echo
    echo "- \`OUT=\$OUT tests/gpu/run.sh\` at $(git rev-parse --short HEAD 2>/dev/null), object $OBJ, budget $BUDGET s, rounds $ROUNDS"
    echo "- steps (s): install ${STEP_S[install]}, build ${STEP_S[build]}, tests/gpu ${STEP_S[tests]:-}, profile ${STEP_S[profile]:-}, benchmark ${STEP_S[bench]:-}; total $(($(date +%s) - T0))"
    echo "- tests/gpu: $(tail -1 "$OUT/gpu-tests.txt" 2>/dev/null)"
} | tee -a "$OUT/bench-summary.md"
exit $rc
