"""``attnfuse cache``: the on-disk kernel cache's directory, size and cap (``--info``), or empty it (``--clear``)."""

from __future__ import annotations

import argparse
from typing import TextIO

from .common import CLIError


def _size(n: int) -> str:
    """``n`` bytes, readable: "512 B", "3.4 KiB", "64.0 MiB"."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def cmd_cache(args: argparse.Namespace, out: TextIO) -> int:
    from ..errors import KernelCacheError
    from ..runtime.source_cache import (
        CACHE_ENV,
        MAX_BYTES_ENV,
        cache_dir,
        check_directory,
        clear,
        kernel_files,
        max_bytes,
    )

    directory = cache_dir()
    if directory.exists() and not directory.is_dir():
        raise CLIError(
            f"the kernel cache path {directory} (${CACHE_ENV}) is not a directory; set ${CACHE_ENV} to a "
            f"directory of your own, or remove the file"
        )
    try:
        if args.clear:
            count, size = clear(directory)
            print(f"removed {count} kernel file(s), {_size(size)}, from {directory}", file=out)
            return 0
        files = kernel_files(directory)
    except OSError as exc:
        raise CLIError(
            f"cannot {'clear' if args.clear else 'read'} the kernel cache directory {directory} "
            f"(${CACHE_ENV}): {exc.strerror or exc}"
        ) from None
    total = sum(f.size for f in files)
    cap = max_bytes()
    try:
        check_directory(directory)
        trusted = "yes"
    except FileNotFoundError:
        trusted = "yes (not made yet)"
    except KernelCacheError as exc:
        trusted = f"no: {exc}"
    print(f"directory  {directory}  (${CACHE_ENV})", file=out)
    print(f"trusted    {trusted}", file=out)
    print(f"files      {len(files)}", file=out)
    print(f"size       {_size(total)} ({total} bytes)", file=out)
    print(f"cap        {_size(cap)} ({cap} bytes; ${MAX_BYTES_ENV})", file=out)
    return 0


def add_parser(sub) -> None:
    """Add ``cache`` to the command's subparsers."""
    p = sub.add_parser(
        "cache",
        help="show the on-disk kernel cache (directory, files, size, cap) or empty it",
        description="The generated kernels' readable copies on disk: where they are, how many, "
        "their size and its cap (--info), or remove them (--clear). Nothing is run "
        "from these files; Triton's compiled binaries are in Triton's own cache.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--info", action="store_true", help="the directory, file count, total size and cap")
    what.add_argument("--clear", action="store_true", help="remove every kernel file")
    p.set_defaults(func=cmd_cache)
