#!/bin/sh
# Build the reference UCX ping-pong: benchmarks/ref/pingpong.
#
# UCX is taken from $UCX_HOME (include/ and lib/ below it) when set,
# otherwise from the installed libucx wheel (libucx-cu12). The binary gets
# an rpath to that lib directory, so it runs without LD_LIBRARY_PATH.
#
#   benchmarks/ref/build.sh            build if out of date, print the path
#   benchmarks/ref/build.sh --force    rebuild
#
# Environment: CC (default cc), PYTHON (default python3), UCX_HOME, CFLAGS
# (appended).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src="$here/pingpong.c"
bin="$here/pingpong"
cc=${CC:-cc}
python=${PYTHON:-python3}

force=0
case "${1:-}" in
    --force) force=1 ;;
    "") ;;
    *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

if [ -n "${UCX_HOME:-}" ]; then
    ucx_home=$UCX_HOME
else
    find_ucx='import libucx, os; print(os.path.dirname(libucx.__file__))'
    ucx_home=$("$python" -c "$find_ucx" 2>/dev/null) || {
        echo "build.sh: cannot find UCX:" \
             "set UCX_HOME or pip install libucx-cu12" >&2
        exit 1
    }
fi
inc="$ucx_home/include"
lib="$ucx_home/lib"
if [ ! -f "$inc/ucp/api/ucp.h" ]; then
    echo "build.sh: no ucp/api/ucp.h under $inc" >&2
    exit 1
fi
if [ ! -e "$lib/libucp.so" ]; then
    echo "build.sh: no libucp.so under $lib" >&2
    exit 1
fi

# Rebuild when the source, this script or the UCX location changed.
stamp="$here/.pingpong.stamp"
want="$cc|$inc|$lib|${CFLAGS:-}"
if [ "$force" = 0 ] && [ -x "$bin" ] && [ -f "$stamp" ] &&
   [ "$(cat "$stamp")" = "$want" ] &&
   [ "$bin" -nt "$src" ] && [ "$bin" -nt "$0" ]; then
    echo "$bin"
    exit 0
fi

tmp="$bin.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086
"$cc" -std=c99 -O2 -Wall -Wextra -Werror -isystem "$inc" -o "$tmp" "$src" \
    -L"$lib" -Wl,-rpath,"$lib" -lucp -lucs ${CFLAGS:-}
mv -f "$tmp" "$bin"
printf '%s\n' "$want" > "$stamp"
echo "$bin"
