"""Build the C extension ``ucxx._ucxx`` against UCX.

UCX is found, in order, from ``UCX_HOME``, ``pkg-config ucx`` or the
``libucx`` package of the ``libucx-cu12`` wheel (a build requirement).
``UCXX_SANITIZE=1`` builds with ASan + UBSan (debug, no optimisation);
``UCXX_WERROR=1`` (or ``CI=true``) turns warnings into errors.

The extension is always built against the limited API of Python 3.11
(``Py_LIMITED_API``): one ``cp311-abi3`` wheel serves 3.11 and later, and
the editable build tests what ships (docs/DECISIONS.md). CC and LDSHARED
from the environment pick the compiler (.ci/wheel: zig cc for glibc 2.28).
"""

import glob
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ucx_paths():
    """(include dirs, library dirs, whether they are the libucx wheel's)."""
    home = os.environ.get("UCX_HOME")
    if home:
        return [os.path.join(home, "include")], [os.path.join(home, "lib")], False
    if os.environ.get("UCXX_USE_PKG_CONFIG", "0") == "1":
        try:
            out = subprocess.check_output(
                ["pkg-config", "--cflags-only-I", "--libs-only-L", "ucx"],
                text=True,
            )
            flags = shlex.split(out)
            incs = [f[2:] for f in flags if f.startswith("-I")]
            libs = [f[2:] for f in flags if f.startswith("-L")]
            return incs, libs, False
        except (OSError, subprocess.CalledProcessError):
            pass
    import libucx

    root = os.path.dirname(libucx.__file__)
    return [os.path.join(root, "include")], [os.path.join(root, "lib")], True


include_dirs, library_dirs, ucx_from_wheel = ucx_paths()
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


class BuildExt(build_ext):
    """With the libucx wheel, the extension gets no run-time search path:
    ucxx/__init__.py loads the wheel's libraries (libucx.load_library)
    before the extension, wherever the wheel is installed, while a path
    recorded at build time (the temporary build environment's libucx, or
    the interpreter's own lib directory from its LDSHARED) means nothing
    on the machine the extension is installed on. A system UCX (UCX_HOME,
    pkg-config) is found through the rpath to its lib directory."""

    def build_extensions(self):
        # A version-specific build left in the tree by an older checkout
        # (_ucxx.cpython-311-*.so) would be imported before _ucxx.abi3.so.
        here = os.path.dirname(os.path.abspath(__file__))
        for stale in glob.glob(os.path.join(here, "ucxx", "_ucxx.cpython-*.so")):
            os.remove(stale)
        if ucx_from_wheel:
            self.compiler.linker_so = [
                a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")
            ]
        super().build_extensions()


ext = Extension(
    "ucxx._ucxx",
    sources=sorted(glob.glob("csrc/*.c")),
    depends=["csrc/ucxx.h"],
    include_dirs=include_dirs,
    library_dirs=library_dirs,
    runtime_library_dirs=[] if ucx_from_wheel else library_dirs,
    libraries=["ucp", "ucs", "dl"],
    extra_compile_args=extra_compile_args,
    extra_link_args=extra_link_args,
    define_macros=[("Py_LIMITED_API", "0x030B0000")],
    py_limited_api=True,
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt},
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
