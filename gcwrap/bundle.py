"""`gcwrap bundle`: the agent as one executable file to ship with a job.

The machines a job lands on may have nothing installed and no login, but
they have a Python and they take files (`transfer_input_files`, `sbcast`).
The bundle is a zip application (the standard library's `zipapp`, so
building it needs nothing, and running it needs no unpacking: shiv unpacks
into ~/.shiv and so needs a writable HOME, pex carries a runtime of its
own). Inside: gcwrap's agent side (not the shadow's) and the pure-Python
packages it imports. zstandard is native, so it stays out: a machine whose
Python has it installed compresses as usual.

Imports from a zip are slow to start (zipimport compiles source at every
start, and inflates every module), so the bundle's __main__ unpacks it once
into a cache of the user's ($XDG_CACHE_HOME/gcwrap, else
/tmp/gcwrap-UID-cache; a directory only that user can write, or it is not
used), keyed by a hash of the zip's directory and renamed into place whole,
so twenty jobs starting at once on one machine are safe; it then imports
from there. Where no cache can be made (no writable /tmp), it runs from the
zip. Either way each module is there compiled for the Python that built
the bundle (unchecked-hash .pyc: beside its .py for zipimport, in
__pycache__ once unpacked), used when that Python's magic number is the
running one's; another Python compiles the source (into the cache, once).
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import shutil
import tempfile
import zipapp
import zipfile
import zipimport
from dataclasses import dataclass
from pathlib import Path

MAX_SIZE = 5 << 20  # what the bundle must stay under
SHEBANG = "/usr/bin/env python3"

# The agent's own modules: the package but the shadow's side (gcshadow is not shipped).
LEFT_OUT = ("shadow", "shadow_cli.py", "shadow_listen.py", "render_jobs.py")
# The pure-Python packages the agent imports (trio's and rich's own, found
# with `python -X importtime` and by running the bundle under `python -I`);
# sqlite-utils and its own for `gcwrap status` and `resume`'s reads.
DEPENDENCIES = ("trio", "attr", "attrs", "outcome", "sniffio", "sortedcontainers", "idna", "click", "rich",
                "sqlite_utils", "sqlite_fts4", "dateutil", "six", "pluggy")
# Parts of them no agent path imports.
SKIPPED_DIRS = ("__pycache__", "_tests", "tests")

MAIN = Path(__file__).with_name("bundlemain.py")  # the bundle's __main__.py


class BundleError(Exception):
    """The bundle cannot be built (a dependency missing, the target not writable, too large)."""


@dataclass(frozen=True)
class Built:
    """A bundle written: where, its size in bytes, and how many modules it holds."""

    path: Path
    size: int
    modules: int


def package_dir(name: str) -> Path:
    """Where the package `name` is (or the file, for a module alone like six.py)."""
    spec = importlib.util.find_spec(name)
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise BundleError(f"the package {name} is not installed for this Python: pip install {name}")
    where = Path(next(iter(spec.submodule_search_locations)) if spec.submodule_search_locations else str(spec.origin))
    if not where.exists():
        raise BundleError(f"{name} is not on disk ({where}): run `gcwrap bundle` from an installed gcwrap")
    return where


def _copy_tree(src: Path, dst: Path, left_out: tuple[str, ...] = ()) -> None:
    """Copy the .py files of a package."""
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not (rel == Path() and d in left_out))
        for name in sorted(files):
            if rel == Path() and name in left_out:
                continue
            if name.endswith(".py"):
                target = dst / rel / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(root) / name, target)


def running_archive() -> Path | None:
    """The bundle this gcwrap runs from, if it runs from one."""
    spec = importlib.util.find_spec("gcwrap")
    loader = spec.loader if spec is not None else None
    return Path(loader.archive) if isinstance(loader, zipimport.zipimporter) else None


def _compile(stage: Path) -> int:
    """Compile every module in `stage` for this Python; the number of modules."""
    count = 0
    for source in sorted(stage.rglob("*.py")):
        # zipimport's legacy layout: the .pyc beside its .py, not in __pycache__
        py_compile.compile(str(source), cfile=str(source) + "c", dfile=str(source.relative_to(stage)), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        count += 1
    return count


def _stage(stage: Path) -> int:
    """Lay out the bundle's files in `stage`; the number of modules. Run from
    a bundle, that bundle's files, compiled anew for this Python."""
    itself = running_archive()
    if itself is not None:
        with zipfile.ZipFile(itself) as archive:
            archive.extractall(stage, [n for n in archive.namelist() if not n.endswith(".pyc")])
    else:
        _copy_tree(package_dir("gcwrap"), stage / "gcwrap", LEFT_OUT)
        for name in DEPENDENCIES:
            where = package_dir(name)
            if where.is_dir():
                _copy_tree(where, stage / name)
            else:
                shutil.copyfile(where, stage / where.name)
        shutil.copyfile(MAIN, stage / "__main__.py")
    return _compile(stage)


def build(target: Path) -> Built:
    """Write the bundle to `target`, atomically (a temporary file renamed).
    Run from a bundle, that bundle is rebuilt for this Python."""
    target = target.absolute()
    with tempfile.TemporaryDirectory(prefix="gcwrap-bundle-") as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        modules = _stage(stage)
        try:
            fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        except OSError as e:
            raise BundleError(f"cannot write in {target.parent}: {e.strerror}") from None
        try:
            with os.fdopen(fd, "wb") as out:
                zipapp.create_archive(stage, out, interpreter=SHEBANG, compressed=True)
            os.chmod(partial, 0o755)
            size = os.path.getsize(partial)
            if size > MAX_SIZE:
                raise BundleError(f"the bundle would be {size} bytes, more than {MAX_SIZE}")
            os.replace(partial, target)
        except OSError as e:
            Path(partial).unlink(missing_ok=True)
            raise BundleError(f"cannot write {target}: {e.strerror}") from None
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    return Built(target, size, modules)
