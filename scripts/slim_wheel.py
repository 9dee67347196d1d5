"""Rewrite a wheel without the files a runtime never opens (static libraries, headers, tools).

    python scripts/slim_wheel.py WHEEL PATTERN [PATTERN ...]

PATTERNs are fnmatch patterns on paths inside the wheel (``libucx/lib/*.a``). The wheel is
rewritten in place under the same name, its RECORD listing only what is left, so pip
installs it like the original. Used by scripts/gpu_wheels.sh to fit the GPU wheel set into
one device call (libucx alone is 42 MB as published, mostly static archives and a
benchmark tool).
"""

from __future__ import annotations

import fnmatch
import os
import sys
import zipfile


def slim(wheel: str, patterns: list[str]) -> tuple[int, int, int]:
    """Drop members matching ``patterns``; returns (files dropped, bytes before, bytes after)."""
    before = os.path.getsize(wheel)
    tmp = wheel + ".slim"
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        names = src.namelist()
        keep = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in patterns)]
        dropped = len(names) - len(keep)
        gone = set(names) - set(keep)
        for name in keep:
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(ln for ln in lines if ln.split(",", 1)[0] not in gone) + "\n").encode()
            info = src.getinfo(name)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, wheel)
    return dropped, before, os.path.getsize(wheel)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dropped, before, after = slim(argv[0], argv[1:])
    print(f"{os.path.basename(argv[0])}: dropped {dropped} files, {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
