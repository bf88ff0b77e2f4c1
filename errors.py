"""Errors a user can fix, and the file handling every command shares: one line per mistake, checkpoints read
without running code, files written whole or not at all. Imports no torch at load time, so that a command can
import it first and be interrupted with one line while torch loads (interruptible_imports)."""
import contextlib
import errno
import os
import re
import signal
import sys
import tempfile
from pathlib import Path


def interruptible_imports(name: str):
    """Called by a command as `interruptible_imports(__name__)` before its heavy imports (torch takes seconds): Ctrl-C
    until run_cli starts is `error: interrupted` and exit status 130, not a traceback from inside an import.
    Imported as a module (tests, other scripts), nothing changes."""
    if name == "__main__":
        signal.signal(signal.SIGINT, interrupted_while_starting)


def interrupted_while_starting(*_):
    print("error: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


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
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting:  # from here on Ctrl-C is ours to handle
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
    (a bug: its traceback is shown). A full disk met by a library that wraps the OSError in its own exception
    (torch.compile's inductor writing its cache) is one line too. FASTGEN_TRACEBACK=1 shows the traceback of these."""
    if not (isinstance(e, OSError) and e.errno is not None):
        e = next((c for c in causes(e) if isinstance(c, OSError) and c.errno in NO_ROOM), e)
    if isinstance(e, OSError) and e.errno is not None:
        where = f": {e.filename}" if e.filename else ""
        fix = WRITE_FIXES.get(e.errno, "fix the path or its permissions, or free some space")
        return f"error: {e.strerror or errno.errorcode.get(e.errno, e)}{where}: {fix}"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "alloc" in str(e).lower()
                                      and ("memory" in str(e).lower() or "bytes" in str(e).lower())):
        return "error: out of memory: lower batch_size, max_new_tokens or the model's size"
    if isinstance(e, RecursionError):
        return "error: an input nests too deeply to read (a JSON file?): re-download or fix it"
    return None


# no room for a file (disk, quota, file size limit): whatever exception carries one of these, it is the reason
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
WRITE_FIXES = {errno.ENOSPC: "free some space or write elsewhere",
               errno.EDQUOT: "free some of your disk quota or write elsewhere",
               errno.EFBIG: "raise the file size limit (ulimit -f) or write to another file system",
               errno.EROFS: "write to another file system",
               errno.EACCES: "fix its permissions or write elsewhere",
               errno.EPERM: "fix its permissions or write elsewhere"}


def first_line(e: BaseException, limit: int = 160, default: str = None) -> str:
    """An exception's message as one line a user reads: its first line, at most `limit` characters (its type's name,
    or `default`, where it says nothing)."""
    return (str(e).strip().splitlines() or [type(e).__name__ if default is None else default])[0][:limit]


def causes(e: BaseException, depth: int = 8) -> list:
    """The exceptions behind e (its __cause__ or, failing that, __context__), nearest first."""
    chain = []
    while len(chain) < depth:
        e = e.__cause__ or e.__context__
        if e is None or e in chain:
            return chain
        chain.append(e)
    return chain


@contextlib.contextmanager
def quiet_stderr(unless: str = ""):
    """Standard error at the file descriptor (where C++ libraries write: torch's c10d log, kineto) sent to /dev/null
    within the block, for a step whose failure this program reports in its own line; unless FASTGEN_TRACEBACK (or
    the environment variable `unless`) asks for everything."""
    if os.environ.get("FASTGEN_TRACEBACK") or (unless and os.environ.get(unless)):
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def flag_names(message: str, flags: dict) -> str:
    """The message with each `setting` (library messages quote setting names so) shown as its flag."""
    return re.sub(r"`(\w+)`", lambda m: flags.get(m.group(1), m.group(1)), message)


def read_checkpoint(path) -> dict:
    """torch.load a checkpoint file safely (weights_only: tensors and plain containers, no code; memory-mapped).
    A file that is truncated, empty, random or not a dict is a UserError naming it."""
    import torch
    try:
        checkpoint = torch.load(str(path), mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated, empty, random bytes, a pickle that needs more than tensors
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read checkpoint {path} ({reason}): re-convert or re-download it") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path} does not hold a state dict: re-convert it")
    check_tensors(checkpoint, path)
    return checkpoint


def check_tensors(state_dict: dict, path, fix="re-convert it") -> None:
    """Every key a string and every tensor a dense, real, non-quantized one with data (nested dicts too: a quantized
    file's "model"). A complex, sparse, meta or torch.qint8 tensor loads without complaint and fails mid-run, far
    from the file; here it is a UserError naming the file and the key."""
    import torch
    for key, value in state_dict.items():
        if not isinstance(key, str):
            shown = " ".join(repr(key).split())[:60]  # one line, however odd the key
            raise UserError(f"{path}: its state dict has a key that is not a string ({type(key).__name__} {shown}): "
                            f"{fix}")
        if isinstance(value, dict):
            check_tensors(value, path, fix)
        elif isinstance(value, torch.Tensor):
            what = (f"a {str(value.layout).removeprefix('torch.')} (not dense)" if value.layout != torch.strided
                    else f"a complex ({value.dtype})" if value.is_complex()
                    else "a meta (data-less)" if value.is_meta
                    else f"a quantized ({value.dtype})" if value.is_quantized else None)
            if what:
                raise UserError(f"{path}: {key!r} holds {what} tensor where plain float or integer weights belong: "
                                f"{fix}")


def load_weights(model, state_dict: dict, path) -> None:
    """load_state_dict(strict, assign) on a model built from config.json; a key that is not a string, a tensor
    check_tensors refuses, integers where the model holds floats (or the reverse), a missing or unexpected key, or
    a shape that disagrees is a UserError naming the file (and its config)."""
    import torch
    check_tensors(state_dict, path)
    expected = model.state_dict()
    for key, value in state_dict.items():  # assign=True takes the file's dtypes: an int8 matmul fails mid-run
        if isinstance(value, torch.Tensor) and key in expected and \
                value.is_floating_point() != expected[key].is_floating_point():
            raise UserError(f"{path}: {key!r} holds {value.dtype} values where the model needs "
                            f"{expected[key].dtype}: re-convert it")
    try:
        model.load_state_dict(state_dict, assign=True, strict=True)
    except RuntimeError as e:
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:3])[:300]
        raise UserError(f"{path} does not match {Path(path).parent / 'config.json'}: {detail}: use the config.json "
                        f"the checkpoint came with") from None


def write_atomically(path, write):
    """Create or replace the file `path` so that a half-written file never appears under its name:
    `write(tmp)` fills a temp file beside it (`.NAME.partial-PID`), which is fsynced and renamed over
    `path`; on any failure (or KeyboardInterrupt) the temp file is removed, and a failure of the file system (a full
    disk, whatever layer reports it: write_failure) is an OSError naming `path`. A leftover from a killed
    process (SIGKILL runs no clean-up) carries a dead PID in its name and is removed by the next write."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(directory)
    try:
        tmp = partial_file(path)
    except OSError as e:  # it names the temp file
        raise write_failure(e, None, path) from None
    try:
        write(tmp)
        flush_to_disk(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        failure = write_failure(e, tmp, path)
        tmp.unlink(missing_ok=True)
        if failure is e:
            raise
        raise failure from e
    flush_to_disk(directory)  # make the rename itself durable


def write_files_atomically(directory, writers: dict):
    """Create or replace several files of `directory` as one set (a checkpoint): `writers[name](tmp)` fills a temp
    file for each, as write_atomically does, and only once all are written are they renamed into place, in the
    dict's order (put the file that marks the set complete last). On any failure (KeyboardInterrupt and SIGTERM
    too) the directory is as it was: temp files removed, replaced files put back, directories made here removed;
    a failure of the file system is an OSError naming the file (write_failure)."""
    directory = Path(directory)
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # deepest first
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(directory)
    new, spare, old, placed = {}, [], {}, []
    name = None
    try:
        for name, write in writers.items():
            new[name] = partial_file(directory / name)
            write(new[name])
            flush_to_disk(new[name])
        for name in writers:  # the old set out of the way first, so old and new files never mix under the names
            if os.path.lexists(directory / name):
                spare.append(partial_file(directory / name))
                old[name] = spare[-1]
                os.replace(directory / name, old[name])
        for name in writers:
            placed.append(name)
            os.replace(new[name], directory / name)
    except BaseException as e:
        failure = write_failure(e, new.get(name), directory / name) if name is not None else e
        for name in placed:
            (directory / name).unlink(missing_ok=True)
        for name, kept in old.items():
            if not os.path.lexists(directory / name):  # else it was never moved aside
                os.replace(kept, directory / name)
        for tmp in [*new.values(), *spare]:
            tmp.unlink(missing_ok=True)
        for made in created:
            try:
                made.rmdir()
            except OSError:  # not empty: something else wrote there meanwhile
                break
        if failure is e:
            raise
        raise failure from e
    for tmp in spare:
        tmp.unlink(missing_ok=True)
    flush_to_disk(directory)


def write_failure(e: BaseException, tmp, path: Path) -> BaseException:
    """What a failed write of `path` (into its temp file `tmp`) raises: the OSError behind it, naming `path`, where the
    file system failed; else e itself (an interruption, a bug).
    Libraries report a full disk in their own words: torch.save's zip writer as a RuntimeError without an errno
    ("basic_ios::clear: iostream error", then "[enforce fail at inline_container.cc] unexpected pos"), safetensors
    and tokenizers as "... (os error 28)", torch.save into a Python file and inductor with the OSError as its
    cause. In that order: an OSError behind e, an `os error N` in its text, else a probe that appends to the temp
    file while it still fills the disk; the probe gets the real errno back for any cause (a full disk, a quota, the
    file size limit, an I/O error) instead of guessing it from free space, which a quota or ulimit does not show."""
    if not isinstance(e, Exception) or isinstance(e, UserError):
        return e
    behind = [c for c in (e, *causes(e)) if isinstance(c, OSError) and c.errno is not None]
    number = re.search(r"\(os error (\d+)\)", str(e))
    failure = behind[0] if behind else OSError(int(number[1]), os.strerror(int(number[1]))) if number \
        else probe_write(tmp) if tmp is not None else None
    if failure is None:
        return e
    ours = failure.filename is None or PARTIAL_NAME.fullmatch(Path(str(failure.filename)).name)
    if failure is e and not ours:
        return e
    return OSError(failure.errno, failure.strerror, str(path) if ours else failure.filename)


def probe_write(tmp, size: int = 1 << 20):
    """The OSError that appending `size` bytes to the file tmp meets now, or None if they fit."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as e:
        return e
    block, written = bytes(size), 0
    try:
        while written < size:
            written += os.write(fd, block[written:])  # a short write first, then the error
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


def partial_file(path: Path) -> Path:
    """A new empty temp file beside path (`.NAME.partial-PID-*`) with the permissions a plain open() would give,
    not mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.partial-{os.getpid()}-")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return Path(tmp)


def flush_to_disk(path: Path):
    """Flush a file, or a directory's entries (a rename), to disk; a file system that cannot is let be."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not path.is_dir():
            raise


# partial_file's names (+ the AOTInductor package's, and the profiler's own temp file)
PARTIAL_NAME = re.compile(r"\..+\.partial-(\d+)-\w+(\.pt2|\.tmp)?")


def remove_stale_partials(directory: Path):
    """Remove the temp files (`.NAME.partial-PID-*`, any NAME) in directory whose process is gone: a writer killed
    by SIGKILL runs no clean-up, and the next write of any writer there (another file name, another quantization,
    a newer compiled graph's) removes its leftovers."""
    for leftover in directory.glob(".*.partial-*"):
        match = PARTIAL_NAME.fullmatch(leftover.name)
        if not match:
            continue
        try:
            os.kill(int(match[1]), 0)  # raises if no such process
        except ProcessLookupError:
            leftover.unlink(missing_ok=True)
        except (ValueError, OverflowError, OSError):  # PermissionError: it runs, as another user
            pass


# what marks a file as one this project wrote (stats of generate.py and eval.py, a torch.profiler trace), and so one
# that may be replaced
OWN_OUTPUT_KEYS = (b'"tokens_per_sec"', b'"perplexity"', b'"traceEvents"')


def read_user_text(path, setting: str, fix: str, limit: int = 1 << 30) -> str:
    """A UTF-8 text file a setting names, or one line saying why not. At most `limit` bytes are read: a device that
    never ends (/dev/zero) or a file far beyond any use is refused, not read until memory runs out."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) <= limit:
            return data.decode("utf-8")
        reason = f"more than {limit >> 20} MB"
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8"
    raise UserError(f"`{setting}` {path}: cannot read it ({reason}): {fix}")


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
