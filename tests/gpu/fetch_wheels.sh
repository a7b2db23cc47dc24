#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels tests/gpu/run.sh needs on the GPU
# machine (which reaches no network), and split them into carry sets that
# each fit, with the working tree, in what one device command may carry.
#
#   tests/gpu/fetch_wheels.sh            # download + split + verify
#   tests/gpu/fetch_wheels.sh --verify   # verify what is already there
#
# Wheels: tests/gpu/wheels.txt (side, exact requirement), for CPython
# $GPU_PY (default 3.12, the GPU machine's python3, docs/gpu/env.txt) on
# manylinux x86_64, each with --no-deps (the list names every one).
# Output: .whl/gpu/N/ (git-ignored), N = 1, 2, ... in carry order; each set
# holds manifest.tsv (wheel, bytes, sha256, side, set) for all sets, so the
# device script can tell which set it is missing.  Carry set N in device
# command N (docs/gpu/README.md, "Running it").
#
# Verification: every wheel installs with --no-index --no-deps into a
# scratch --target for $GPU_PY, and each side's requirements resolve
# against the carried wheels plus the packages the GPU machine has
# (tests/gpu/machine-packages.txt, read from that machine's image).
# GPU_PYTHON names the interpreter for that (default: python$GPU_PY, or
# pyenv's $GPU_PY.x).
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU_PY=${GPU_PY:-3.12}
DEST=.whl/gpu
LIST=tests/gpu/wheels.txt
# What one device command carries: 64 MiB for the working tree and the
# carried paths together; the tree's share is measured below, plus margin.
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((4 * 1024 * 1024))

PLAT=(--only-binary=:all: --implementation cp --python-version "$GPU_PY"
      --abi "cp${GPU_PY/./}")
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 linux_x86_64; do
    PLAT+=(--platform "$p")
done

reqs() { grep -v '^\s*#' "$LIST" | awk 'NF >= 2 {print $1, $2}'; }

tree_bytes() {
    # tracked + untracked-not-ignored files: what every device command sends
    git ls-files -z --cached --others --exclude-standard \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

download() {
    local all="$DEST/all"
    rm -rf "$DEST" && mkdir -p "$all"
    # shellcheck disable=SC2046
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$all" \
        $(reqs | awk '{print $2}') 2>&1 | grep -v "^WARNING: Location" || true
    local n_want n_got
    n_want=$(reqs | wc -l)
    n_got=$(find "$all" -name '*.whl' | wc -l)
    if [ "$n_want" != "$n_got" ]; then
        echo "fetch_wheels: expected $n_want wheels, got $n_got" >&2
        exit 1
    fi
}

# wheel file -> side, by its distribution name
side_of() {
    local f=$1 dist name
    dist=$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    while read -r side req; do
        name=$(echo "$req" | sed 's/[=<>!~].*//' | tr 'A-Z_.' 'a-z--')
        if [ "$name" = "$dist" ]; then echo "$side"; return; fi
    done < <(reqs)
    echo "unknown"
}

split_sets() {
    local budget tree used=0 set=1 f size
    tree=$(tree_bytes)
    budget=$((LIMIT - tree - MARGIN))
    : > "$DEST/manifest.tsv"
    # largest first, first fit
    while read -r size f; do
        if [ "$size" -gt "$budget" ]; then
            echo "fetch_wheels: $f ($size B) alone exceeds the budget" >&2
            exit 1
        fi
        if [ $((used + size)) -gt "$budget" ]; then
            set=$((set + 1)); used=0
        fi
        used=$((used + size))
        mkdir -p "$DEST/$set"
        mv "$f" "$DEST/$set/"
        printf '%s\t%s\t%s\t%s\t%s\n' "$(basename "$f")" "$size" \
            "$(sha256sum "$DEST/$set/$(basename "$f")" | cut -d' ' -f1)" \
            "$(side_of "$f")" "$set" >> "$DEST/manifest.tsv"
    done < <(find "$DEST/all" -name '*.whl' -printf '%s %p\n' | sort -rn)
    rmdir "$DEST/all"
    for d in "$DEST"/[0-9]*/; do cp "$DEST/manifest.tsv" "$d"; done
    rm "$DEST/manifest.tsv"
    echo "working tree: $tree B; budget per set: $budget B"
}

verify() {
    local py scratch tree
    py=${GPU_PYTHON:-}
    for c in "python$GPU_PY" "$HOME"/.pyenv/versions/"$GPU_PY".*/bin/python; do
        [ -n "$py" ] && break
        if "$c" -c pass 2>/dev/null; then py=$c; fi
    done
    [ -n "$py" ] || { echo "fetch_wheels: no python$GPU_PY here (set GPU_PYTHON)" >&2; exit 1; }
    tree=$(tree_bytes)
    echo "== sets (working tree $tree B travels with each)"
    local total=0
    for d in "$DEST"/[0-9]*/; do
        local b
        b=$(du -cb "$d"*.whl | tail -1 | cut -f1)
        total=$((total + b))
        printf '%s  %s B wheels, %s B with the tree (limit %s)\n' \
            "$d" "$b" "$((b + tree))" "$LIMIT"
        [ $((b + tree)) -le "$LIMIT" ] || { echo "over the limit" >&2; exit 1; }
        (cd "$d" && awk -F'\t' -v s="$(basename "$d")" '$5 == s {print $3 "  " $1}' \
            manifest.tsv | sha256sum -c --quiet) || exit 1
    done
    echo "all wheels: $total B"
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' RETURN
    for side in ours rapids; do
        local files=()
        while IFS=$'\t' read -r whl _ _ s set; do
            if [ "$s" = "$side" ] || [ "$s" = both ]; then
                files+=("$DEST/$set/$whl")
            fi
        done < "$(ls "$DEST"/1/manifest.tsv)"
        echo "== $side: ${#files[@]} wheels install with --no-index --no-deps (python$GPU_PY)"
        "$py" -m pip install -q --no-index --no-deps --no-compile \
            --target "$scratch/$side" "${files[@]}"
        echo "== $side: requirements resolve (carried wheels + GPU machine packages)"
        "$py" tests/gpu/check_reqs.py --machine tests/gpu/machine-packages.txt \
            "$scratch/$side"
    done
}

case "${1:-}" in
    --verify) verify ;;
    "") download; split_sets; verify ;;
    *) echo "usage: $0 [--verify]" >&2; exit 2 ;;
esac
