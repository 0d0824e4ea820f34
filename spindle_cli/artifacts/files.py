"""Writing files as one step: artifacts (`-` writes YAML to stdout) and other outputs through a
temp file beside the target and `os.replace`, and the checks that refuse an output before
anything is written (a directory, a read-only file, a directory one cannot create files in).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.canonical import rendered_for
from spindle_cli.errors import ArtifactError, SpindleError


def write_artifact(obj: Artifact, path: str) -> None:
    """Write atomically (temp file in the target directory + rename); `-` writes YAML to stdout."""
    write_rendered(rendered_for(obj, path), path)


def write_rendered(text: str, path: str) -> None:
    """`write_artifact` for an artifact already rendered for `path` (`rendered_for`)."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise ArtifactError(path, "", f"output directory {str(parent)!r} does not exist")
    write_text_atomic(path, text)


def check_can_create(name: str, directory: Path) -> None:
    """SpindleError ('<name>: cannot write in <directory>: <why>') unless a file can be created
    in `directory`: one is made there and removed at once, as `write_text_atomic` makes its
    temp file. os.access cannot tell: it says yes to root where the file system refuses every
    new file (/proc, /sys, a root-squashed NFS export)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".spindle-probe-")
    except OSError as e:
        raise SpindleError(f"{name}: cannot write in {str(directory)!r}: {e.strerror or e}"
                           ) from None
    os.close(fd)
    os.unlink(probe)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` as one step (`replace_atomic`)."""
    replace_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def replace_atomic(path: str | Path, write: Callable[[str], object], suffix: str = ".tmp"
                   ) -> None:
    """Make the file `path` names as one step: `write` fills a temp file (named to end in
    `suffix`) beside it, which is on disk before it is renamed over the file, so a failure or a
    kill leaves the old file whole. The file is the one `output_file` finds: through a
    symlink, its target (the link stays a link); a file it replaces keeps its permission bits
    (a 0600 file stays private), a new one gets the mode open() would give it (0666 less the
    umask). ArtifactError ('cannot write: ...') where `output_file` refuses, or the directory
    or the disk does."""
    target = output_file(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    except OSError as e:
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror}") from None
    try:
        try:
            write(tmp)
            os.fsync(fd)  # the file's data, whichever descriptor `write` wrote it through
        finally:
            os.close(fd)
        try:
            mode = stat.S_IMODE(target.stat().st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def output_file(path: str | Path) -> Path:
    """The file that writing `path` makes or replaces: `path`, or the file its symlinks lead
    to (made where a link dangles), so that the link stays a link, as with a shell's `>`.
    ArtifactError ('cannot write: ...') where that is a symlink loop, a directory, no regular
    file (a link to /dev/null must not replace the device) or a read-only file: one without
    its owner's write bit (which binds root too, whom os.access lets write anything) or one
    this user may not write (os.access, as open() sees it). A read-only file is refused, not
    replaced: `cp` and a recipe's `>` refuse it too, someone made it so on purpose (a measured
    profile cannot be made again), and `chmod u+w` is a deliberate step before `make`
    regenerates it."""
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops at a loop
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.ELOOP)}")
    try:
        info = target.stat()
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.EISDIR)}")
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(str(path), "", "cannot write: not a regular file")
    if os.statvfs(target.parent).f_flag & os.ST_RDONLY:
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.EROFS)}")
    if not info.st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
        raise ArtifactError(str(path), "", "cannot write: read-only file",
                            hint=f"make it writable (chmod u+w {target}) to replace it")
    return target


def names_directory(path: str) -> bool:
    """Whether an output name ends in a path separator: Path drops it, and the file was
    written where a shell would refuse (`-o x.yaml/`)."""
    return path.endswith(("/", os.sep))
