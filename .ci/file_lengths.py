"""Product files over the line limit (`make check`): each Python file under python/kvduplex and
each Rust file under rust/src longer than `--max` lines (600) is listed, longest first. Only a
warning unless `--strict`, which fails the check when any file is listed.

    python .ci/file_lengths.py [--max N] [--strict] [DIR ...]   (default: python/kvduplex rust/src)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUFFIXES = (".py", ".rs")


def long_files(roots: list[Path], limit: int) -> list[tuple[int, Path]]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in SUFFIXES and path.is_file():
                with path.open("rb") as f:
                    lines = sum(1 for _ in f)
                if lines > limit:
                    found.append((lines, path))
    return sorted(found, key=lambda item: (-item[0], str(item[1])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "roots", nargs="*", type=Path, default=[Path("python/kvduplex"), Path("rust/src")]
    )
    parser.add_argument("--max", type=int, default=600, help="most lines a file may have")
    parser.add_argument("--strict", action="store_true", help="fail when a file is over")
    args = parser.parse_args()
    found = long_files(args.roots, args.max)
    label = "error" if args.strict else "warning"
    for lines, path in found:
        print(f"{label}: {path}: {lines} lines (over {args.max}: split it along its seams)")
    roots = " ".join(str(r) for r in args.roots)
    print(f"{roots}: {len(found)} file{'' if len(found) == 1 else 's'} over {args.max} lines")
    return 1 if found and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
