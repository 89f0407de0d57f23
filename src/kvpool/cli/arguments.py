"""Argument types and checks of the `kvpool` command: sizes, ranges, paths. Each bad value is a
one-line error naming the flag and the allowed range, raised before any work is done."""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence

BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
SIZE_FLAGS = ("--gpu", "--host", "--disk", "--gpu-quota", "--host-quota")
PLOT_FORMATS = (".png", ".pdf", ".svg")


def parse_bytes(text: str) -> int:
    """A size: `4096`, `512MiB`/`512M` (binary, 2**20) or `512MB` (decimal, 10**6); `k`, `m`,
    `g`, `t` prefixes, any case."""
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match or (match.group(3) == "i"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 4096, 512MiB (binary), 8GB (decimal))"
        )
    number, prefix, suffix = float(match.group(1)), match.group(2), match.group(3)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: a size must be >= 0")
    unit = DECIMAL[prefix] if suffix == "b" and prefix else BINARY[prefix]
    return int(number * unit)


def describe_size(text: str) -> str:
    """How a size flag was read: `8GB = 8,000,000,000 bytes (7.45 GiB, decimal)`."""
    value = parse_bytes(text)
    kind = "decimal" if re.search(r"[kmgt]b\s*$", text.lower()) else "binary"
    return f"{text} = {value:,} bytes ({value / 2**30:.2f} GiB, {kind})"


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is invalid: must be an integer >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be a finite number >= 0")
    return value


def joined_negative_sizes(argv: Sequence[str]) -> list[str]:
    """`--gpu -1GiB` reaches the size check (argparse would take `-1GiB` for a flag)."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        if items[i] in SIZE_FLAGS and i + 1 < len(items) and re.match(r"-\d", items[i + 1]):
            out.append(f"{items[i]}={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


def check_output_file(flag: str, path: str | None, suffixes: Sequence[str] = ()) -> None:
    """An output file must go into an existing, writable directory (checked before any work)."""
    if path is None:
        return
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        raise argparse.ArgumentTypeError(
            f"{flag} {path!r}: the file name must end in one of {', '.join(suffixes)}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{flag} {path!r} is a directory, not a file name")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"{flag} {path!r}: no such directory {directory!r}")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{flag} {path!r}: the directory is not writable")


def check_disk_directory(path: str) -> None:
    """The disk level's directory must take a file (a test file is created and removed)."""
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"--disk-path {path!r}: no such directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        reason = os.strerror(error.errno or errno.EACCES)
        raise argparse.ArgumentTypeError(
            f"--disk-path {path!r}: cannot create a file there ({reason})"
        ) from None


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write a file through a temporary name in its directory, renamed when complete: an
    interrupted write leaves neither a partial file nor the temporary one."""
    directory = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".kvpool-", suffix=suffix)
    os.close(fd)
    try:
        write(temporary)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # as an ordinary new file (mkstemp makes it 0600)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
