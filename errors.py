"""Errors a user can fix, and the file handling every command shares: one line per mistake, checkpoints read
without running code, files written whole or not at all."""
import errno
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

import torch


class UserError(Exception):
    """A mistake the user can fix (a setting, a missing or inconsistent file). Every CLI prints it as one
    line, `error: <what is wrong>: <what to do>`, and exits with status 1; never a traceback. Library code
    quotes settings by name (`tree_nodes`); a command shows them as its flags (flag_names)."""


def run_cli(main, explain=None, finish=None) -> int:
    """Run a command's main() and return its exit status: a UserError is one line `error: ...` (1), Ctrl-C
    `error: interrupted` (130); SIGTERM raises SystemExit(143), so it runs the same clean-up as Ctrl-C (the temp
    files of an interrupted write are removed on the way out).
    explain(e): the line for another exception the command expects (None: not expected, re-raised);
    finish(error, status): last words (tensor parallelism)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        main()
        sys.stdout.flush()
        error, status = None, 0
    except UserError as e:
        error, status = f"error: {flag_names(str(e), {})}", 1
    except KeyboardInterrupt:
        error, status = "error: interrupted", 130
    except BrokenPipeError:  # the reader of stdout went away (`... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        error = (explain(e) if explain else None) or expected_failure(e)
        if error is None or os.environ.get("FASTGEN_TRACEBACK"):
            raise
        status = 1
    if finish is not None:
        finish(error, status)
    if error:
        print(error, file=sys.stderr)
    return status


def expected_failure(e: Exception):
    """The one line for a failure of the machine rather than of the code: a file system error (permission, full
    disk, name too long, not a directory), memory running out, JSON nested too deeply; None for anything else
    (a bug: its traceback is shown). FASTGEN_TRACEBACK=1 shows the traceback of these too."""
    if isinstance(e, OSError) and e.errno is not None:
        where = f": {e.filename}" if e.filename else ""
        return f"error: {e.strerror or errno.errorcode.get(e.errno, e)}{where}: fix the path or its permissions, or " \
               f"free some space"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "alloc" in str(e).lower()
                                      and ("memory" in str(e).lower() or "bytes" in str(e).lower())):
        return "error: out of memory: lower batch_size, max_new_tokens or the model's size"
    if isinstance(e, RecursionError):
        return "error: an input nests too deeply to read (a JSON file?): re-download or fix it"
    return None


def flag_names(message: str, flags: dict) -> str:
    """The message with each `setting` (library messages quote setting names so) shown as its flag."""
    return re.sub(r"`(\w+)`", lambda m: flags.get(m.group(1), m.group(1)), message)


def read_checkpoint(path) -> dict:
    """torch.load a checkpoint file safely (weights_only: tensors and plain containers, no code; memory-mapped).
    A file that is truncated, empty, random or not a dict is a UserError naming it."""
    try:
        checkpoint = torch.load(str(path), mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated, empty, random bytes, a pickle that needs more than tensors
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read checkpoint {path} ({reason}): re-convert or re-download it") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path} does not hold a state dict: re-convert it")
    return checkpoint


def load_weights(model: torch.nn.Module, state_dict: dict, path) -> None:
    """load_state_dict(strict, assign) on a model built from config.json; a missing or unexpected key, or a
    shape that disagrees, is a UserError naming the file and its config."""
    try:
        model.load_state_dict(state_dict, assign=True, strict=True)
    except RuntimeError as e:
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:3])[:300]
        raise UserError(f"{path} does not match {Path(path).parent / 'config.json'}: {detail}: use the config.json "
                        f"the checkpoint came with") from None


def write_atomically(path, write):
    """Create or replace the file `path` so that a half-written file never appears under its name:
    `write(tmp)` fills a temp file beside it (`.NAME.partial-PID`), which is fsynced and renamed over
    `path`; on any failure (or KeyboardInterrupt) the temp file is removed. A leftover from a killed
    process (SIGKILL runs no clean-up) carries a dead PID in its name and is removed by the next write."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.partial-{os.getpid()}-")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the permissions a plain open() would give, not mkstemp's 0600
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def remove_stale_partials(path: Path):
    """Remove `.NAME.partial-PID-*` files beside path whose process is gone."""
    for leftover in path.parent.glob(f".{path.name}.partial-*"):
        try:
            pid = int(leftover.name[len(f".{path.name}.partial-"):].split("-")[0])
            os.kill(pid, 0)  # raises if no such process
        except ProcessLookupError:
            leftover.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            pass


# what marks a file as one this project wrote (stats of generate.py and eval.py, a torch.profiler trace), and so one
# that may be replaced
OWN_OUTPUT_KEYS = (b'"tokens_per_sec"', b'"perplexity"', b'"traceEvents"')


def check_output_file(path: Path, setting: str):
    """An output file (stats, a trace): a new or empty file, or one this program wrote, in a writable directory.
    Anything else (a checkpoint, a directory, a device) is refused before the run, not clobbered after it."""
    what = f"`{setting}` {path}"
    if path.is_dir():
        raise UserError(f"{what} is a directory: name a file in it")
    if path.exists():
        if not path.is_file():
            raise UserError(f"{what} exists and is not a regular file: name a new .json file")
        try:
            with open(path, "rb") as f:
                head = f.read(1 << 20)
        except OSError as e:
            raise UserError(f"{what} cannot be read ({e.strerror}): name a new .json file") from None
        if head.strip() and not any(key in head for key in OWN_OUTPUT_KEYS):  # config.json is JSON too
            raise UserError(f"{what} exists and is not a stats or trace file this program wrote: name a new file")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{what}: the directory {parent} does not exist: create it first")
    try:  # a file created and removed: os.access says yes to root, and to /sys or /proc
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.partial-{os.getpid()}-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{what}: cannot write in {parent} ({e.strerror}): pick a writable directory") from None


def write_output(path: Path, setting: str, write):
    """write_atomically, a failure (the disk filled up during the run, the directory went away) one line."""
    try:
        write_atomically(path, write)
    except OSError as e:
        raise UserError(f"`{setting}` {path}: cannot write it ({e.strerror or e}): free some space or pick another "
                        f"file") from None
