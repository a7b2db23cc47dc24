"""Build the C extension ``ucxx._ucxx`` against UCX.

UCX is found, in order, from ``UCX_HOME``, ``pkg-config ucx`` or the
``libucx`` package of the ``libucx-cu12`` wheel (a build requirement).
``UCXX_SANITIZE=1`` builds with ASan + UBSan (debug, no optimisation);
``UCXX_WERROR=1`` (or ``CI=true``) turns warnings into errors.
"""

import glob
import os
import shlex
import subprocess

from setuptools import Extension, setup


def ucx_paths():
    home = os.environ.get("UCX_HOME")
    if home:
        return [os.path.join(home, "include")], [os.path.join(home, "lib")]
    if os.environ.get("UCXX_USE_PKG_CONFIG", "0") == "1":
        try:
            out = subprocess.check_output(
                ["pkg-config", "--cflags-only-I", "--libs-only-L", "ucx"],
                text=True,
            )
            flags = shlex.split(out)
            incs = [f[2:] for f in flags if f.startswith("-I")]
            libs = [f[2:] for f in flags if f.startswith("-L")]
            return incs, libs
        except (OSError, subprocess.CalledProcessError):
            pass
    import libucx

    root = os.path.dirname(libucx.__file__)
    return [os.path.join(root, "include")], [os.path.join(root, "lib")]


include_dirs, library_dirs = ucx_paths()
extra_compile_args = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                      "-Wno-missing-field-initializers"]
extra_link_args = []
if os.environ.get("UCXX_WERROR", "0") == "1" or os.environ.get("CI") == "true":
    extra_compile_args.append("-Werror")
if os.environ.get("UCXX_SANITIZE", "0") == "1":
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    # -UNDEBUG: the engine's assert()s (request and worker invariants, the
    # worker lock held in the thread modes) are checked in this build.
    extra_compile_args += san + ["-O1", "-g", "-fno-sanitize-recover=undefined",
                                 "-UNDEBUG"]
    extra_link_args += san
else:
    extra_compile_args += ["-O2"]

# The wheel's libraries are loaded by ucxx/__init__.py (libucx.load_library)
# before the extension; the rpath is a fallback for a system UCX.
ext = Extension(
    "ucxx._ucxx",
    sources=sorted(glob.glob("csrc/*.c")),
    depends=["csrc/ucxx.h"],
    include_dirs=include_dirs,
    library_dirs=library_dirs,
    runtime_library_dirs=library_dirs,
    libraries=["ucp", "ucs", "dl"],
    extra_compile_args=extra_compile_args,
    extra_link_args=extra_link_args,
)

setup(ext_modules=[ext])
