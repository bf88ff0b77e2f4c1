"""CPU kernel choice: which memory layout and which library multiplies a weight fastest on this machine. A runtime
choice made before the first forward: the same products, summed in another order (float32 rounding apart, the same
results); state dict keys, shapes and tied weights are unchanged. Measurements: BENCHMARKS.md. Also the loader of
kernels_a8.cpp, the integer kernels of the int8-a8 / int4-a8 schemes (quantize.py)."""
import ctypes
import functools
import hashlib
import itertools
import mmap
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from errors import first_line


def _packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    """x [..., in] times a weight that oneDNN packed for its own kernels: [..., out]."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, None, "none", [], "")  # [rows, out]
    return y.view(*x.shape[:-1], packed.shape[0])  # [..., out]


# An operator of its own, so that compiled graphs call oneDNN's kernel on the packed weight as it is (inductor cannot
# lower mkldnn._linear_pointwise on a weight it did not pack itself). Defined through torch.library's low-level API,
# whose dispatch is far cheaper per call than torch.library.custom_op's Python wrapper.
_LIBRARY = torch.library.Library("fastgen", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")  # the packed weight is an MkldnnCPU tensor


@torch.library.register_fake("fastgen::packed_linear")
def _(x: Tensor, packed: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


packed_linear = torch.ops.fastgen.packed_linear
PACK_ROWS = 8  # the row count oneDNN tunes a packed weight for, and onednn_is_faster measures at


def pack_weight(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


@functools.cache
def onednn_is_faster(out_features: int, in_features: int) -> bool:
    """Whether a float32 CPU product of PACK_ROWS rows with a weight [out, in] runs at least 10% faster on a
    oneDNN-packed weight than through F.linear (MKL), on this machine. Timed once per shape and process (a few
    milliseconds): the best of 7 turns of 5 calls each, the two taking turns."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    generator = torch.Generator().manual_seed(0)  # not the global one: timing must not change what a seed samples
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(PACK_ROWS, in_features, generator=generator)
    packed = pack_weight(weight)
    candidates = {"packed": lambda: packed_linear(x, packed), "baseline": lambda: F.linear(x, weight)}
    best = dict.fromkeys(candidates, float("inf"))
    with torch.no_grad():
        for fn in candidates.values():
            fn()  # warm-up
        for _ in range(7):  # taking turns, so that a busy moment of a shared machine slows both alike
            for name, fn in candidates.items():
                start = time.perf_counter()
                for _ in range(5):
                    fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["packed"] < 0.9 * best["baseline"]


def column_major_is_faster(weight: Tensor) -> bool:
    """Whether x @ W^T for one token runs faster with the weight W [out, in] stored column-major (as a contiguous
    W^T): float32 mat-vecs on the CPU read it faster that way; bfloat16 ones do not, and products of several
    tokens are about even (BENCHMARKS.md, history)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def use_fast_weight_layout(model: torch.nn.Module):
    """Store each linear weight in the layout its device multiplies fastest (column_major_is_faster), and give
    float32 CPU linears that can use one (a `pack` method) a oneDNN-packed copy for products of several rows where
    that measures faster. An output layer tied to the embeddings still shares its tensor (a lookup reads one row
    either way). Quantized layers keep the layout of their kernels."""
    for module in model.modules():
        weight = module.weight if isinstance(module, torch.nn.Linear) else None
        if weight is not None and column_major_is_faster(weight) and weight.stride() != (1, weight.shape[0]):
            weight.data = weight.data.t().contiguous().t()  # [out, in] with strides (1, out)
        if hasattr(module, "pack") and weight is not None and weight.device.type == "cpu" \
                and weight.dtype == torch.float32 and onednn_is_faster(*weight.shape):
            module.pack()
    onto_huge_pages(model)


# ----------------------------------------------------------------------------- int8 / int4 times 8-bit activations

# kernels_a8.cpp implements these for the CPU; defined here so that graphs trace them whether or not it builds
_LIBRARY.define("a8_int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor")
_LIBRARY.define("a8_int4_linear(Tensor x, Tensor weight, Tensor scales_and_zeros, int groupsize) -> Tensor")
_LIBRARY.define("a8_quantize(Tensor x, int padded) -> (Tensor, Tensor)")
_LIBRARY.define("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor")  # float32 x, int8-a8's weight layout
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor")  # kernels_a8.cpp
_LIBRARY.define("f32_linear(Tensor x, Tensor packed, int N) -> Tensor")  # float32, the weight in pack_f32's layout


@torch.library.register_fake("fastgen::a8_int8_linear")
def _(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("fastgen::int8_linear")
def _(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("fastgen::f32_linear")
def _(x: Tensor, packed: Tensor, N: int) -> Tensor:
    return x.new_empty(x.shape[0], N)


@torch.library.register_fake("fastgen::attention")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("fastgen::a8_int4_linear")
def _(x: Tensor, weight: Tensor, scales_and_zeros: Tensor, groupsize: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


A8_SOURCE = Path(__file__).with_name("kernels_a8.cpp")


def build_directory(source: Path) -> Path:
    """Where kernels_a8.cpp at `source` is built: one directory per source text, torch version and path (ninja's
    build file names the source by its path, so two checkouts sharing a directory would rebuild it in turn)."""
    digest = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + str(source.resolve()).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastgen" / "ext"
    return Path(root) / f"fastgen_a8_{digest.hexdigest()[:16]}"


@functools.cache
def a8_kernels() -> bool:
    """Whether the a8 operators run here: kernels_a8.cpp built at first use (seconds, once per source, torch version,
    checkout and user) into $TORCH_EXTENSIONS_DIR or ~/.cache/fastgen/ext, then loaded. Without a working C++
    compiler, one line on stderr, and the a8 layers use the weight-only kernels."""
    from torch.utils import cpp_extension
    directory = build_directory(A8_SOURCE)
    name = directory.name  # the extension's name too: one library per directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name, [str(A8_SOURCE)], build_directory=str(directory),
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
        # stored graphs call the operators' C entry points (c_shims) by name: visible to libraries loaded later
        ctypes.CDLL(str(directory / f"{name}.so"), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        reason = first_line(e)
        print(f"cannot build {A8_SOURCE.name} ({reason}): int8-a8 / int4-a8 layers use the weight-only kernels and "
              f"attention ATen's; install a C++ compiler and ninja (the ones torch.compile uses) for ours",
              file=sys.stderr)
        return False
    global A8_BUILT
    A8_BUILT = True
    return True


def c_shims() -> dict:
    """AOTInductor's `custom_ops_to_c_shims` for our operators (kernels_a8.cpp's extern "C" functions): a stored
    graph calls them directly instead of boxing every call's arguments through its proxy executor."""
    ops = torch.ops.fastgen

    def tensors(*names):
        return ", ".join(f"AtenTensorHandle {n}" for n in names)
    signatures = {ops.int8_linear.default: tensors("x", "weight", "scales"),
                  ops.a8_int8_linear.default: tensors("x", "weight", "scales"),
                  ops.a8_int4_linear.default: tensors("x", "weight", "scales_and_zeros") + ", int64_t groupsize",
                  ops.attention.default: tensors("q", "k", "v", "mask"),
                  ops.f32_linear.default: tensors("x", "packed") + ", int64_t N",
                  torch.ops.quantized.int4mm_packed_weight_cpu.default:
                      tensors("x", "weight", "groupsize", "scales_and_zeros")}
    return {op: [f"AOTITorchError aoti_torch_cpu_{op._opname}({args}, AtenTensorHandle* ret0)"]
            for op, args in signatures.items()}


F32_BLOCK = 64  # outputs per block of pack_f32's layout (kernels_a8.cpp's BLOCK_F32)


def native_f32_linear(weight: Tensor) -> bool:
    """Whether a float32 CPU weight is multiplied with kernels_a8.cpp's f32_linear (AVX-512) in stored graphs: one
    read of the weights for all of a verification's rows, where inductor's GEMM templates slow down at those widths
    (BENCHMARKS.md, "Float32 products"). The graph's key records it."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and A8_BUILT \
        and f32_linear_allowed() and torch.ops.fastgen.a8_isa() == "avx512_vnni"


def f32_linear_allowed() -> bool:
    """FASTGEN_F32_LINEAR=0 keeps inductor's GEMM templates in stored graphs (comparisons); part of their key."""
    return os.environ.get("FASTGEN_F32_LINEAR", "1") != "0"


def pack_f32(weight: Tensor) -> Tensor:
    """W [N, K] -> [ceil(N / 64), K, 64]: each block of 64 outputs one contiguous stream (rows past N zero)."""
    N, K = weight.shape
    blocks = -(-N // F32_BLOCK)
    padded = F.pad(weight.detach(), (0, 0, 0, blocks * F32_BLOCK - N))
    return padded.view(blocks, F32_BLOCK, K).transpose(1, 2).contiguous()


def f32_linear(x: Tensor, blocks: Tensor, N: int) -> Tensor:
    """x [..., K] times a weight [N, K] in pack_f32's layout: [..., N]."""
    y = torch.ops.fastgen.f32_linear(x.reshape(-1, x.shape[-1]).contiguous(), blocks, N)
    return y.view(*x.shape[:-1], N)


def use_stored_layout(model: torch.nn.Module):
    """The weight layout of stored graphs, made once at load: the graphs hold no weights and read the module's own
    tensors, so a layout they need is a tensor of the module. Float32 CPU linears that f32_linear multiplies
    (native_f32_linear) get pack_f32's blocks in place of their weight (one copy of the weights in memory; a weight
    tied to the embeddings stays the embeddings' table); quantized layers already hold their kernels' layout
    (quantize.pack_for_device); other float32 CPU weights are stored column-major (column_major_is_faster).
    Deterministic, unlike use_fast_weight_layout's timed choice: the same model and machine get the same layout."""
    if any(t.device.type == "cpu" for t in model.parameters()):
        a8_kernels()  # built (once per source) before native_f32_linear reads whether it is
    mappings = file_mappings()  # read once: every weight below was made before
    for module in model.modules():
        weight = module.weight if isinstance(module, torch.nn.Linear) else None
        if weight is None:
            continue
        if hasattr(module, "use_blocks") and native_f32_linear(weight):
            module.use_blocks(pack_f32(weight))
            # weight by weight: the file's pages and the blocks never all at once
            drop_file_pages([weight], mappings, model)
        elif column_major_is_faster(weight) and weight.stride() != (1, weight.shape[0]):
            weight.data = weight.data.t().contiguous().t()
    onto_huge_pages(model, mappings)
    release_file_pages(model)


MADV_HUGEPAGE = 14  # Linux: back this range with 2 MB pages where the kernel can (transparent huge pages)
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range's pages in, writable, now
HUGE_PAGE = 1 << 21
_ARENAS = []  # [(start, end)] of the weight arenas made here, while their memory lives


def huge_pages_available() -> bool:
    """Linux with transparent huge pages not switched off."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def huge_pages_allowed() -> bool:
    """Whether weights are moved onto transparent huge pages (onto_huge_pages): FASTGEN_HUGE_PAGES=1 (the server
    sets it unless given) where they are available. Off by default elsewhere: on a VM the first touch of fresh
    2 MB pages can lengthen the launch by more than a short run wins back (docs/compilation.md)."""
    return os.environ.get("FASTGEN_HUGE_PAGES", "0") == "1" and huge_pages_available()


def onto_huge_pages(model: torch.nn.Module, mappings: Optional[list] = None):
    """Move the model's CPU weights (every parameter and buffer but the KV caches) into one anonymous mapping backed
    by 2 MB pages. Decode streams every weight once a token: with 4 KB pages that is a TLB miss every 4 KB, and in a
    virtual machine each miss walks two page tables (the guest's and the host's); 2 MB pages take far fewer. The
    values, shapes, strides and sharing of tensors are unchanged: storage by storage, a tensor's whole storage is
    copied once and every tensor on it (a tied table, views) reads the copy; file pages read are dropped as it goes
    (one copy of the weights in memory). Called where the layouts are final (use_stored_layout,
    use_fast_weight_layout), before graphs bind the tensors; weights already on such pages stay. mappings: as
    drop_file_pages'."""
    if not huge_pages_allowed():
        return
    caches = {id(t) for m in model.modules() if hasattr(m, "k_cache") for t in m.buffers(recurse=False)}
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers())
               if t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
               and id(t) not in caches and t.untyped_storage().nbytes()]
    storages = {}  # storage address -> (nbytes, [tensors on it])
    for t in tensors:
        a, b = storage_range(t)
        if not any(start <= a and b <= end for start, end in _ARENAS):
            storages.setdefault(a, (b - a, []))[1].append(t)
    if not storages:
        return
    offsets, size = {}, 0
    for address, (nbytes, _) in storages.items():
        offsets[address], size = size, size + -(-nbytes // 64) * 64  # 64-byte aligned, as torch's allocator
    # a page more than the weights take: they start at its first 2 MB boundary (kernels before 6.7 do not align
    # large anonymous mappings to one), so that every page they cover can be a huge page
    arena_map = mmap.mmap(-1, (-(-size // HUGE_PAGE) + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena_map.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so that it faults in whole 2 MB pages
    try:  # and fault them all in now, in one call: faulting them one by one in the copies is far slower
        arena_map.madvise(MADV_POPULATE_WRITE)
    except OSError:  # Linux before 5.14: the copies fault them in
        pass
    whole = memoryview(arena_map)
    start = torch.frombuffer(whole, dtype=torch.uint8).data_ptr()
    _ARENAS.append((start, start + len(arena_map)))
    skip = -start % HUGE_PAGE
    weakref.finalize(arena_map, _ARENAS.remove, _ARENAS[-1])  # when the last storage on it goes
    mappings = file_mappings() if mappings is None else mappings
    moved = {}  # id(buffer) -> its tensor on the arena
    for address, (nbytes, on_it) in storages.items():
        # a storage of its own on the arena (each holds the mapping): compilers take tensors on one storage as
        # aliases of each other
        copy = torch.frombuffer(whole[skip + offsets[address]:skip + offsets[address] + nbytes], dtype=torch.uint8)
        old = torch.empty(0, dtype=torch.uint8).set_(on_it[0].untyped_storage())
        copy.copy_(old)
        for t in on_it:
            new = torch.empty(0, dtype=t.dtype).set_(copy.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            if isinstance(t, torch.nn.Parameter):
                t.data = new  # the same Parameter (tied layers share it)
            else:  # a buffer is replaced: one made as a view would keep its base, and the old memory, alive
                moved[id(t)] = new
        drop_file_pages([old], mappings)  # no tensor of the model reads a moved storage any more
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if id(buffer) in moved:
                setattr(module, name, moved[id(buffer)])


MADV_DONTNEED = 4  # Linux: a private file mapping's pages are dropped, and read from the file again if touched


def file_mappings() -> list:
    """[(start, end)] of this process's private mappings of files (/proc/self/maps), [] where there is none to read."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1].endswith("p") and fields[5].startswith("/") and "(deleted)" not in fields[5]:
            found.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return found


def drop_pages(ranges: list):
    """madvise(MADV_DONTNEED) on the whole pages inside each [a, b): a private file mapping's unmodified pages go
    from the process's memory and come back from the file, as they were, if read again."""
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for a, b in ranges:
        a, b = -(-a // page) * page, b // page * page  # whole pages only: a neighbour's edge stays
        if b > a:
            libc.madvise(a, b - a, MADV_DONTNEED)


def storage_range(t: Tensor) -> tuple:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def used_ranges(model: torch.nn.Module) -> list:
    """[(start, end)] of the CPU memory the model's parameters and buffers read, sorted."""
    return sorted(storage_range(t) for t in itertools.chain(model.parameters(), model.buffers())
                  if t.device.type == "cpu" and t.untyped_storage().nbytes())


def drop_file_pages(tensors, mappings: Optional[list] = None, model: Optional[torch.nn.Module] = None):
    """Drop the resident file pages of these tensors (read once from a memory-mapped checkpoint and done with; the
    tensors stay valid and read the file again if used), except where a tensor of `model` still reads them (a tied
    table). mappings: file_mappings() read once for many calls (weight by weight), after these tensors were made:
    one inside a file's range then is inside it still, while held (default: read now)."""
    mappings = file_mappings() if mappings is None else mappings
    used = used_ranges(model) if model is not None else []
    drop_pages([(a, b) for a, b in map(storage_range, tensors)
                if any(start <= a and b <= end for start, end in mappings)
                and not any(c < b and d > a for c, d in used)])


def release_file_pages(model: torch.nn.Module):
    """Drop this process's resident pages of memory-mapped files (a checkpoint loaded with mmap=True) that no tensor
    of the model reads any more: weights packed, stacked or converted into memory of their own were read once, and
    their file pages would count in the process's memory beside the copy until the file is unmapped. Only private
    file mappings the model reads from, outside every range a tensor of the model still uses."""
    used = used_ranges(model)
    for start, end in file_mappings():
        if not any(a < end and b > start for a, b in used):
            continue  # a file the model does not read from (a library, or a checkpoint it no longer uses at all)
        gaps, at = [], start
        for a, b in used:
            if b <= start or a >= end:
                continue
            gaps.append((at, a))
            at = max(at, b)
        drop_pages(gaps + [(at, end)])


A8_BUILT = False  # a8_kernels() succeeded: what a graph being traced reads (dynamo would trace a8_kernels' build)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D), where mask) v for grouped queries: q [B, H, G * T, D] (row g * T + t: query head g of
    kv head h's group, token t), k and v [B, H, S, D], mask [B or 1, 1, T, S] bool. On the CPU in float32,
    kernels_a8.cpp's operator (a few tokens: its own kernel, reading only the keys the mask allows; more: ATen's on the
    keys up to the last allowed); elsewhere scaled_dot_product_attention on the mask repeated per query head. A graph
    traced before any eager call to a8_kernels() takes the latter (Transformer.setup_caches makes that call)."""
    if q.device.type == "cpu" and q.dtype == torch.float32 \
            and (A8_BUILT if torch.compiler.is_compiling() else a8_kernels()):
        return torch.ops.fastgen.attention(q, k, v, mask)
    B, _, rows, _ = q.shape
    T = mask.shape[2]
    if rows > T:
        mask = mask.unsqueeze(2).expand(B, 1, rows // T, T, mask.shape[-1]).reshape(B, 1, rows, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
