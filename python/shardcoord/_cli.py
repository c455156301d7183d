"""The daemon and the operator CLI as the Python distribution installs them: ``pip install`` puts
``shardcoordd`` and ``shardctl`` on the environment's PATH (console entry points, pyproject.toml)
that run the binaries shipped in the package (``shardcoord/_bin/``, built with the binding by
setup.py). The libraries they need beyond the system's sit beside the binding (a wheel built from
a prebuilt bundle), so that folder is added to the loader's path."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

PACKAGE = Path(__file__).resolve().parent


def binary(name: str) -> Optional[str]:
    """The path of ``name`` (``shardcoordd``, ``shardctl``): the package's own, else one on PATH that
    is not this entry point (a .deb's /usr/bin, a CMake build's), else None."""
    shipped = PACKAGE / "_bin" / name
    if shipped.is_file() and os.access(shipped, os.X_OK):
        return str(shipped)
    found = shutil.which(name)
    if found and not _is_entry_point(found):
        return found
    return None


def _is_entry_point(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"shardcoord._cli" in f.read(4096)
    except OSError:
        return False


def environment() -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(PACKAGE), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def _exec(name: str, argv: List[str]) -> None:
    path = binary(name)
    if path is None:
        sys.exit(f"{name}: this installation of shardcoord has no {name} ({PACKAGE / '_bin' / name} is missing: the "
                 f"package was built without the daemon, SHARDCOORD_NO_DAEMON=1); reinstall with pip install "
                 f"--no-build-isolation . from a checkout, or install the .deb")
    os.execve(path, [name, *argv], environment())


def shardcoordd() -> None:
    _exec("shardcoordd", sys.argv[1:])


def shardctl() -> None:
    _exec("shardctl", sys.argv[1:])
