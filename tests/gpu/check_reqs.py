"""Check that every distribution installed in TARGET (pip --target) has its
requirements met, by TARGET itself or by the running interpreter's packages
(on the GPU machine), or by a list of package names and versions
(``--machine FILE``, on a machine preparing the wheels).

    python check_reqs.py TARGET [--machine tests/gpu/machine-packages.txt]

Prints one line per requirement; exits 1 if any is unmet.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def _machine(path):
    have = {}
    with open(path) as f:
        for line in f:
            parts = line.split("#", 1)[0].split()
            if parts:
                have[canonicalize_name(parts[0])] = parts[1] if len(parts) > 1 else None
    return have


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--machine", help="name [version] lines instead of this interpreter's packages")
    args = ap.parse_args()
    mine = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=[args.target])}
    if args.machine:
        others = _machine(args.machine)
        where = "GPU machine"
    else:
        others = {}
        for d in md.distributions(path=[p for p in sys.path if p != args.target]):
            others.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
        where = "this interpreter"
    env = default_environment()
    env["extra"] = ""
    bad = 0
    for name, dist in sorted(mine.items()):
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            key = canonicalize_name(req.name)
            if key in mine:
                ver, src = mine[key].version, "carried"
            elif key in others:
                ver, src = others[key], where
            else:
                ver, src = None, None
            if src is None:
                state = "MISSING"
                bad += 1
            elif ver is None:
                state = f"present ({src}; version checked there)"
            elif req.specifier.contains(ver, prereleases=True):
                state = f"ok {ver} ({src})"
            else:
                state = f"WRONG VERSION {ver} ({src})"
                bad += 1
            print(f"  {dist.metadata['Name']} {dist.version}: {req} -> {state}")
    print(f"  {len(mine)} distributions, {'all requirements met' if not bad else f'{bad} unmet'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
