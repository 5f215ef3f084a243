"""The bundle's __main__.py (see gcwrap/bundle.py): unpack the bundle once
into a cache, for imports from files are quicker than zipimport, else run
from the zip itself. It runs before anything else is imported, on any
Python: the standard library only, and lazily.
"""

from __future__ import annotations

import os
import sys

if sys.version_info < (3, 11):  # noqa: UP036 - the bundle may meet an older python3
    sys.exit("gcwrap needs Python 3.11 or newer; this is " + sys.version.split()[0])


def cache_base() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return os.path.join(xdg, "gcwrap") if os.path.isabs(xdg) else f"/tmp/gcwrap-{os.getuid()}-cache"


def bundle_key(archive: str) -> str:
    """A hash of the zip's central directory: every member's name and CRC."""
    import hashlib

    with open(archive, "rb") as f:
        size = f.seek(0, 2)
        f.seek(size - 22)
        end = f.read(22)
        cd_size = int.from_bytes(end[12:16], "little")
        f.seek(size - 22 - cd_size)
        return hashlib.sha256(f.read()).hexdigest()[:20]


def unpack(archive: str, base: str, key: str) -> None:
    """Unpack into a new directory, renamed into place whole: many jobs may start at once."""
    import shutil
    import tempfile
    import zipfile
    from importlib.util import MAGIC_NUMBER

    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=base)
    made: list[str] = []
    try:
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if name.startswith("__main__.") or name.endswith("/"):
                    continue  # (directories are made for the files in them)
                data = z.read(name)
                head, _, tail = name.rpartition("/")
                if name.endswith(".pyc"):  # compiled for the Python that built it: kept if that is this one
                    if data[:4] != MAGIC_NUMBER:
                        continue
                    name = os.path.join(head, "__pycache__", f"{tail[:-4]}.{sys.implementation.cache_tag}.pyc")
                path = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as out:
                    out.write(data)
                made.append(name)
        with open(os.path.join(tmp, MANIFEST), "w") as out:
            out.write("\n".join(made))
        os.rename(tmp, os.path.join(base, key))
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # (another job's rename came first, or no room)


MANIFEST = ".complete"  # the files unpacked, written last: a copy without it, or short of one, is not used


def complete(where: str) -> bool:
    """Whether every file unpacked is still there (a cleaner of /tmp may take
    files unused for a while, and an import would fail mid-run)."""
    try:
        with open(os.path.join(where, MANIFEST)) as f:
            names = f.read().split("\n")
    except OSError:
        return False
    return all(os.path.isfile(os.path.join(where, n)) for n in names if n)


def unpacked(archive: str) -> str | None:
    """The cache's copy of this bundle, or None where there can be none."""
    base = cache_base()
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not os.path.isdir(base) or os.path.islink(base) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None  # not this user's alone: nothing of it is imported
    key = bundle_key(archive)
    where = os.path.join(base, key)
    if os.path.isdir(where) and not complete(where):
        # (files taken from it: moved aside whole, a new copy made; a job importing from it may fail anyway)
        import shutil

        aside = f"{where}.stale.{os.getpid()}"
        try:
            os.rename(where, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            return None
    if not os.path.isdir(where):
        unpack(archive, base, key)
    return where if os.path.isdir(where) and complete(where) else None


def main() -> None:
    try:
        where = unpacked(sys.path[0])
    except Exception:  # noqa: BLE001 - any failure: the zip itself still runs, only slower to start
        where = None
    if where is not None:
        sys.path[0] = where
    from gcwrap.entry import gcwrap

    gcwrap()


if __name__ == "__main__":
    main()
