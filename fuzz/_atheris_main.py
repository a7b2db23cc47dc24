"""The command-line entry point shared by the harnesses in this folder."""

from __future__ import annotations

import os
import sys
import tempfile


def run(argv, test_one_input, seeds, name: str) -> None:
    """Fuzz ``test_one_input`` with atheris (libFuzzer arguments in argv).
    Without a corpus directory among the arguments, ``seeds()`` is written
    to a temporary one and used."""
    try:
        import atheris
    except ImportError:
        sys.exit("atheris is not installed: pip install atheris")
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = tempfile.mkdtemp(prefix=f"ucxx-fuzz-{name}-")
        for i, s in enumerate(seeds()):
            with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
                f.write(s)
        argv = argv + [corpus]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
