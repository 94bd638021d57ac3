"""Which Triton kernels compile inside a timed run on a machine with an empty Triton cache.

TRITON_CACHE_DIR=$(mktemp -d) python -m benchmarks.cold_compiles [bench.py flags]

Runs bench.py (its flags pass through) and lists every kernel variant that reached the cache
during a timed generate(), i.e. after start-up and the untimed warm-up had compiled theirs: each
one is a compile the user's first real run pays. A variant is named by its kernel and the
argument attributes of its specialisation (divisibility by 16, equal to 1, constants).
"""
import glob
import os
import re
import sys

import bench
from benchmarks import scenarios


def _variants(cache: str) -> set[str]:
    return set(glob.glob(os.path.join(cache, "*", "*.ttir")))


def _describe(path: str) -> str:
    """The kernel's name and the specialisation attributes on its signature line."""
    text = open(path).read()
    head = re.search(r"tt\.func public @(\w+)\((.*?)\)\s*attributes", text, re.S)
    if head is None:
        return os.path.basename(path)
    attrs = re.findall(r"%(\w+): [^,{]*\{([^}]*)\}", head.group(2))
    return f"{head.group(1)} " + " ".join(f"{name}[{a.strip()}]" for name, a in attrs)


def main() -> None:
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        raise SystemExit("set TRITON_CACHE_DIR to an empty directory first")
    measure = scenarios.measure

    def timed(*args, **kwargs):
        before = _variants(cache)
        result = measure(*args, **kwargs)
        new = sorted(_variants(cache) - before)
        print(f"compiled inside the timed run: {len(new)}")
        for path in new:
            print("  " + _describe(path))
        return result

    scenarios.measure = timed
    sys.argv = ["bench.py", "--random-weights", *sys.argv[1:]]
    bench.main()


if __name__ == "__main__":
    main()
