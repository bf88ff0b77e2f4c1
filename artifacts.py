"""Stored compiled graphs: where they live, what keys them, and why loading one is safe.

A stored graph is the shared library AOTInductor compiles (its kernels; the weights are the checkpoint's, handed to
it at load), so loading one runs native code; stored kernels (compilation.CompileCache, NAME.bin: torch's cache
artifacts) hold compiled code as well.
Two rules keep that safe and correct:
- Keyed: its name and its metadata carry a hash of everything that changes the code generated (the weights file's
  identity, the config, the dtypes and quantization scheme, the shapes, the compile options, the torch version, the
  CPU's vector ISA and thread count, and the source of the modules traced). Any difference means another key: the
  old artifact is never used and the new one replaces it.
- Signed: the metadata (NAME.meta.json) holds an HMAC of the library's SHA-256 (and of its operator table NAME.json,
  which AOTInductor's runner reads beside the library to call custom operators) under a random key kept in the user's
  own cache directory (0600). An artifact this user's machine did not build (copied in with a checkpoint, or written by
  someone else into a shared directory) has no valid signature and is rebuilt, never loaded.
A graph's kernels do not depend on the weights' values, so a copy of each is also kept in the user's cache under
every field but the weights file's identity (kept_directory): a graph for another weights file of the same shape is
that copy, signed anew under its own key, instead of a build.
"""
import hashlib
import importlib
import hmac
import json
import os
import platform
import secrets
import shutil
import time
from pathlib import Path

import torch

from errors import flush_to_disk, partial_file, write_atomically, write_failure

SAMPLE_BYTES, SAMPLES = 1 << 16, 16  # a weights file's content hash reads this many evenly spaced chunks
KEPT_GRAPHS, KEPT_BYTES = 64, 1 << 30  # the kernels kept for other weights files (kept_directory): at most
KEY_BYTES = 32


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastgen"


def signing_key() -> bytes:
    """This user's artifact key, created on first use (readable by the user only). Written whole or not at all: a
    key cut short by a full disk would sign with fewer secret bytes; one of another length is made anew."""
    path = cache_home() / "artifact.key"
    if path.exists() and path.stat().st_size != KEY_BYTES and path.stat().st_uid == os.getuid():
        path.unlink(missing_ok=True)  # its graphs no longer verify: they are rebuilt
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = partial_file(path)
        try:
            os.chmod(tmp, 0o600)
            tmp.write_bytes(secrets.token_bytes(KEY_BYTES))
            flush_to_disk(tmp)
            try:
                os.link(tmp, path)  # never replaces: a key another process made first (and signed with) stays
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not path.exists():
                    os.replace(tmp, path)
        except BaseException as e:
            failure = write_failure(e, tmp, path)
            if failure is e:
                raise
            raise failure from e
        finally:
            tmp.unlink(missing_ok=True)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} must belong to this user and be readable by it alone (chmod 600)")
    return path.read_bytes()


def file_identity(path) -> dict:
    """Size, modification time and a hash of evenly spaced chunks of a weights file: another model of the same
    shape, or a re-converted one, gets another identity without reading all of it."""
    path = Path(path)
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(SAMPLES + 1):
            f.seek(max(0, stat.st_size - SAMPLE_BYTES) * i // SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))
    return {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sample_sha256": digest.hexdigest()}


def sources_digest(modules) -> str:
    """The source of the modules whose code is traced into a graph: a change to any of them is another graph."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(importlib.import_module(module).__file__).read_bytes())
    return digest.hexdigest()


def machine() -> dict:
    """What the generated code depends on besides the model: torch, the CPU's vector ISA, threads."""
    return {"torch": torch.__version__, "python": platform.python_version(), "arch": platform.machine(),
            "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def key_of(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def file_stamp(path) -> str:
    """What the kernel records of a file's last change: device, inode, size, mtime and ctime (set by the kernel on
    every write, truncation, rename, chmod or utime, and by no call to any value asked for), with the sampled hash
    of file_identity."""
    stat = os.stat(path)
    return json.dumps([stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                       file_identity(path)["sample_sha256"]])


def signature(library, key: str, content: bool = True) -> str:
    """The HMAC of the library and of its operator table (if it has one). content=False (a large data file, read
    in place, whose whole hash would take as long as making it): of its file_stamp instead, so that a file changed
    or replaced since it was signed, copied in or written by hand no longer verifies; it must belong to this user
    and be writable by no one else (store writes it so), or no other user's change would show in its stamp."""
    if not content:
        stat = os.stat(library)
        if stat.st_uid != os.getuid() or stat.st_mode & 0o022:
            return "-"
        return sign(key, file_stamp(library), "-")
    table = Path(library).with_suffix(".json")
    return sign(key, file_sha256(library), file_sha256(table) if table.exists() else "-")


def sign(key: str, library: str, table: str) -> str:
    """The HMAC under this user's key of what identifies an artifact: its key, its library's (or data file's)
    digest or stamp, its operator table's digest ("-": none)."""
    return hmac.new(signing_key(), f"{key}:{library}:{table}".encode(), hashlib.sha256).hexdigest()


def directory_for(checkpoint_path) -> Path:
    """compiled/ beside the checkpoint, or (a read-only checkpoint directory) a per-checkpoint directory in the
    user's cache."""
    beside = Path(checkpoint_path).parent / "compiled"
    if os.access(beside if beside.exists() else beside.parent, os.W_OK):
        return beside
    name = hashlib.sha256(str(Path(checkpoint_path).resolve()).encode()).hexdigest()[:16]
    return cache_home() / "compiled" / name


def find(directory: Path, name: str, key: str, suffix: str = ".so", content: bool = True):
    """The stored library `name` (or another artifact: `suffix`) if it exists, was built for `key` and carries this
    user's signature (`content`: of signature): (path, None); else (None, why it cannot be used, or None when there
    is none)."""
    library, meta_path = directory / f"{name}{suffix}", directory / f"{name}.meta.json"
    if not library.exists() or not meta_path.exists():
        return None, None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None, "its metadata is unreadable"
    if not isinstance(meta, dict) or meta.get("key") != key:
        return None, "it was built for other weights, options or software"
    if not hmac.compare_digest(str(meta.get("signature", "")), signature(library, key, content)):
        return None, "it was not built on this machine by this user, or it was changed since"
    return library, None


def store(directory: Path, name: str, key: str, fields: dict, build, suffix: str = ".so", content: bool = True) \
        -> Path:
    """Build the library (or another artifact: `suffix`) into a temp file beside its final name (`build(path)`,
    which returns its operator table's text or None), then publish them and the signed metadata (`content`: of
    signature); other artifacts of the same name stem (older keys) are removed. Returns the artifact's path."""
    library, meta_path = directory / f"{name}{suffix}", directory / f"{name}.meta.json"
    table = directory / f"{name}.json"
    start = time.perf_counter()
    built = {}
    table.unlink(missing_ok=True)
    write_atomically(library, lambda tmp: built.update(table=build(tmp)))
    if built["table"] is not None:
        write_atomically(table, lambda tmp: tmp.write_text(built["table"]))
    meta = {"key": key, "fields": fields, "build_seconds": round(time.perf_counter() - start, 1),
            "bytes": library.stat().st_size, "signature": signature(library, key, content)}
    write_atomically(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1, default=str)))
    stem = name.rsplit("-", 1)[0]
    for old in directory.glob(f"{stem}-*.meta.json"):
        old_name = old.name[:-len(".meta.json")]
        if old_name != name:
            for old_suffix in (".so", ".bin", ".pth", ".json", ".meta.json", ".failed"):
                (directory / f"{old_name}{old_suffix}").unlink(missing_ok=True)
    return library


def kept_directory() -> Path:
    """Kernels kept on this machine under everything they were built for but the weights file: a stored graph holds
    kernels only, so another weights file of the same shape, scheme, options and software (a fine-tune, a file
    converted again, random weights of the same shape) takes a copy of them instead of a build."""
    return cache_home() / "kernels"


def kernels_key(fields: dict) -> str:
    """The key of a graph's kernels: its fields but the weights file's identity."""
    return key_of({k: v for k, v in fields.items() if k != "weights"})


def store_kept(directory: Path, name: str, key: str, fields: dict):
    """Store the graph `name` (as store() does: keyed by `key`, signed) as a copy of the kernels kept for its fields
    (keep), if a copy this user signed is kept; returns its path, or None (none kept, or it does not verify: then
    the caller builds). The kept bytes are read once, verified and written from memory: what is checked is what is
    copied."""
    kept = kernels_key(fields)
    library, table, meta_path = (kept_directory() / f"{kept[:32]}{suffix}" for suffix in (".so", ".json", ".meta.json"))
    try:
        meta = json.loads(meta_path.read_text())
        data = library.read_bytes()
        text = table.read_bytes() if table.exists() else None
        signed = sign(kept, hashlib.sha256(data).hexdigest(), hashlib.sha256(text).hexdigest() if text else "-")
        if not isinstance(meta, dict) or meta.get("key") != kept \
                or not hmac.compare_digest(str(meta.get("signature", "")), signed):
            return None
        os.utime(meta_path)  # recently used: evicted last
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return store(directory, name, key, fields, lambda tmp: (tmp.write_bytes(data), text and text.decode())[1])


def keep(library: Path, fields: dict, count: int = KEPT_GRAPHS, budget: int = KEPT_BYTES):
    """Keep a copy of a graph just built (library, with its operator table beside it) for other weights files of
    its shape (store_kept); the least recently used beyond `count` graphs or `budget` bytes are removed. A cache:
    a disk that cannot take the copy loses nothing but the copy."""
    kept = kernels_key(fields)
    table = Path(library).with_suffix(".json")
    directory = kept_directory()
    try:
        store(directory, kept[:32], kept, {k: v for k, v in fields.items() if k != "weights"},
              lambda tmp: (shutil.copyfile(library, tmp), table.read_text() if table.exists() else None)[1])
        metas = sorted(directory.glob("*.meta.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for i, meta_path in enumerate(metas):
            stem = meta_path.name[:-len(".meta.json")]
            files = [directory / f"{stem}{suffix}" for suffix in (".so", ".json", ".meta.json")]
            total += sum(f.stat().st_size for f in files if f.exists())
            if i >= count or total > budget:
                for f in files:
                    f.unlink(missing_ok=True)
    except OSError:
        pass


def loader_marker(device: str) -> tuple:
    """(the file that says AOTInductor's loader crashed on this machine, this software and device's line in it)."""
    name = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})" if device.startswith("cuda") \
        else f"the CPU ({torch.backends.cpu.get_cpu_capability()})"
    return cache_home() / "loader-crashed", f"torch {torch.__version__} on {name}"


def loader_crashed(device: str) -> bool:
    """Whether a stored graph's loader crashed here before, with this torch and device: then no graph is built to be
    stored (a build takes minutes, and every one crashed; a trivial graph's did too on a GPU measured,
    BENCHMARKS.md)."""
    path, line = loader_marker(device)
    try:
        return line in path.read_text(errors="replace").splitlines()
    except OSError:
        return False


def note_loader_crash(device: str):
    path, line = loader_marker(device)
    if not loader_crashed(device):
        old = path.read_text(errors="replace") if path.exists() else ""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: tmp.write_text(old + line + "\n"))


def build_seconds_estimate(directory: Path, n_layer: int):
    """Seconds a build will take, from earlier builds here (per layer), or None."""
    rates = []
    for meta_path in directory.glob("*.meta.json") if directory.exists() else []:
        try:
            meta = json.loads(meta_path.read_text())
            rates.append(meta["build_seconds"] / meta["fields"]["config"]["n_layer"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
    return max(rates) * n_layer if rates else None
