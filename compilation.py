"""Compilation: how an engine's graphs are built, kept and loaded. The compile modes and inductor's settings; stored
AOTInductor graphs (StoredGraph: kernels only, one per batch and cache batch for every cache length, kept beside the
checkpoint, keyed and signed by artifacts.py) and their child-process load check; the portable kernel cache of
graphs compiled in the process (CompileCache); CUDA graph replay of a stored graph's few-token calls (Replayed); the
regions' compiled block. decode.compile_engine decides which of these a model gets."""
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import shutil
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from errors import UserError, first_line, write_atomically
import kernels
from model import Transformer

COMPILE_MODES = ("none", "regional", "whole", "autotune", "auto")


# Inductor's C++ GEMM templates, untimed (one choice: nothing to benchmark): every float linear of a frozen graph runs
# its micro-kernels on weights re-packed at compile time. Quantized models keep their int8 / int4 kernels.
CPP_GEMM_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


def resolve_mode(mode: str, device: str, storable: bool = True) -> str:
    """The compile mode a model gets: "auto" and "autotune" are stored graphs (built once, kept beside the
    checkpoint; "autotune" times every matmul's candidates) for a model loaded from a file outside tensor
    parallelism, on CPU and CUDA alike. Otherwise "auto" is the whole graph on CUDA (CUDA graphs) and regional
    compilation on CPU."""
    if mode not in COMPILE_MODES:
        raise UserError(f"`compile` mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if mode in ("auto", "autotune") and storable and not distributed:
        return "stored" if mode == "auto" else "stored-autotune"
    if mode == "auto":
        return "whole" if device.startswith("cuda") else "regional"
    return mode


def graph_options(model: Transformer, device: str, mode: str) -> dict:
    """torch.compile's keyword arguments for a whole graph of `model` in a resolved mode: CUDA graphs on GPU,
    max-autotune for "autotune", on CPU the C++ GEMM templates for float32 / bf16 weights, else the defaults."""
    if mode == "autotune":
        return {"mode": "max-autotune"}
    if device.startswith("cuda"):
        return {"mode": "reduce-overhead"}
    if all(t.dtype in (torch.float32, torch.bfloat16) for t in model.state_dict().values()):
        return {"options": dict(CPP_GEMM_OPTIONS)}
    return {}


def stored_options(model: Transformer, mode: str, device: str = "cpu") -> dict:
    """Inductor's settings for a stored graph: kernels only, no weights (`package_constants_in_so` off): the graph
    reads the module's own tensors, handed to it when it is loaded (StoredGraph.open), so one copy of the weights
    serves every graph of a process and no file holds another. Nothing is frozen (freezing folds weights into new
    constants that only the build has); layouts the kernels want are made at load (kernels.use_stored_layout).
    CPU: quantized weights' products are operators with threads of their own, so inductor's kernels (norms, RoPE,
    a few tokens) run on one thread (BENCHMARKS.md, "Integer kernels"). CUDA: the kernels' binaries inside the
    library, so that one file is signed and loaded. "stored-autotune" times every candidate."""
    options = {"aot_inductor.package_constants_in_so": False}
    if mode == "stored-autotune":
        options["max_autotune"] = True
    if device.startswith("cuda"):
        return {"aot_inductor.embed_kernel_binary": True, **options}
    options["freezing"] = False
    if {t.dtype for t in model.state_dict().values()} & {torch.int8, torch.uint8}:
        options["cpp.threads"] = 1  # their fork and barriers cost more than the work
    return options


@functools.cache
def configure_compiler(device: str):
    """The process-wide inductor and dynamo settings every engine relies on, applied once per process."""
    import torch._inductor.config as inductor_config
    cuda = device.startswith("cuda")
    inductor_config.fx_graph_cache = True  # a second run of the same model reuses the compiled kernels
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and not cuda and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # that cache's key leaves this variable out: code generated for one instruction set was built for the other
        # in a later run and wrote past its buffers. A cache of its own per forced capability.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{capability}"
    if not cuda and os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None \
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # skip inductor's per-process probe build of each vector ISA: ATen already runs this CPU's kernels, and any
        # compiler that builds inductor's C++17 emits them (TORCHINDUCTOR_VEC_ISA_OK, if set, wins)
        inductor_config.cpp.vec_isa_ok = True
    # one graph per shape (decode, each tree size, target and draft): more than dynamo's default of 8 per function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # a float argument (temperature, top-p) is a constant of its graph: a symbolic float makes dynamo trace again
    torch._dynamo.config.specialize_float = True
    # whole CPU graphs fold the weights in as constants (generation runs under no_grad); regions opt out (unfrozen)
    inductor_config.freezing = not cuda
    inductor_config.coordinate_descent_tuning = cuda
    inductor_config.triton.unique_kernel_names = True
    inductor_config.autotune_num_choices_displayed = 0  # autotune quietly: no table of timings per matmul shape
    inductor_config.max_autotune_report_choices_stats = False
    # no debug line tables in the kernels and stored graphs (inductor's default, for profilers): they lengthen every
    # C++ build, which a stored graph pays once and an in-process graph in every process
    inductor_config.aot_inductor.enable_line_tables = False


class CompileCache:
    """The kernels of the graphs an engine compiles in its process (whole and autotune graphs, CUDA's included;
    regions), kept beside the checkpoint as torch's portable cache artifacts (torch.compiler.save_cache_artifacts:
    inductor's FX graphs, AOTAutograd, Triton kernels and autotuning choices). A later process loads them before
    compiling, so its compiles are cache hits: dynamo still traces, but nothing is code-generated or tuned again
    (CPU's C++ kernels travel as source: g++ builds them again where inductor's own cache directory lacks them).
    Keyed and signed like stored graphs (artifacts.py): loading deserializes code, so only artifacts this user built
    on this machine for this model, software and device are loaded. Frozen CPU graphs are not cacheable
    by inductor (they are what stored graphs are for), so on CPU this keeps the regions'."""

    def __init__(self, model: Transformer, device: str, mode: str):
        import artifacts
        self.fields = dict(model_key_fields(model, device, mode),
                           device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu")
        self.key = artifacts.key_of(self.fields)
        self.directory = artifacts.directory_for(model.checkpoint_path)
        self.name = f"{Path(model.checkpoint_path).stem}-kernels-{mode}-{self.key[:16]}"
        self.compiled = compiled_count()

    @classmethod
    def for_model(cls, model: Transformer, device: str, mode: str) -> Optional["CompileCache"]:
        """The cache of a model loaded from a file (None for one built in memory, or under tensor parallelism,
        whose ranks compile their own shards), its stored kernels loaded if there are valid ones."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if getattr(model, "checkpoint_path", None) is None or distributed:
            return None
        cache = cls(model, device, mode)
        cache.load()
        return cache

    def load(self):
        import artifacts
        path, refused = artifacts.find(self.directory, self.name, self.key, ".bin")
        if refused:
            print(f"refusing the stored kernels {self.directory / self.name}.bin: {refused}; compiling again",
                  file=sys.stderr)
        if path is not None:
            try:
                hot_load(path.read_bytes())
            except Exception as e:  # torch changed its format within a version: compile as if there were none
                print(f"refusing the stored kernels {path}: they do not load ({type(e).__name__}); compiling "
                      f"again", file=sys.stderr)

    def save_if_new(self):
        """After a call: if this process compiled something new, store everything it compiled so far."""
        count = compiled_count()
        if count == self.compiled:
            return
        self.compiled = count
        import artifacts
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None and saved[0]:
            self.directory.mkdir(parents=True, exist_ok=True)

            def write(tmp):
                Path(tmp).write_bytes(saved[0])
            artifacts.store(self.directory, self.name, self.key, self.fields, write, ".bin")


def hot_load(blob: bytes):
    """torch.compiler.load_cache_artifacts, and the loaded artifacts recorded as this process's own: torch saves only
    what a process compiled or looked up, so a process that adds one graph would otherwise store a cache without the
    graphs it loaded and did not run. Where torch's internals differ, the public load alone."""
    try:
        from torch.compiler._cache import CacheArtifactManager as manager
        artifacts = manager.deserialize(blob)
        seen, new = manager._seen_artifacts, manager._new_cache_artifacts
    except (ImportError, AttributeError):
        torch.compiler.load_cache_artifacts(blob)
        return
    if artifacts is None:
        raise ValueError("unreadable cache artifacts")
    manager.populate_caches(artifacts)
    for kind, items in artifacts.items():
        for artifact in items:
            if artifact not in seen:
                new[kind].append(artifact)
                seen.add(artifact)


# the modules whose code a stored graph holds: a change to any of them builds it again
TRACED_MODULES = ("model", "kernels", "quantize", "decode", "compilation")


def model_key_fields(model: torch.nn.Module, device: str, mode: str, sources: tuple = TRACED_MODULES) -> dict:
    """What keys every compiled artifact of a model or draft head (artifacts.py): the weights file's identity, config,
    scheme and dtypes, device and mode, torch / ISA / threads, and the source of the code traced or called."""
    import artifacts
    return {"weights": artifacts.file_identity(model.checkpoint_path), "config": dataclasses.asdict(model.args),
            "scheme": model.quantization, "dtypes": sorted({str(t.dtype) for t in model.state_dict().values()}),
            "device": device, "mode": mode, "machine": artifacts.machine(),
            "sources": artifacts.sources_digest(sources),
            "native": artifacts.file_sha256(Path(__file__).with_name("kernels_a8.cpp")),
            "native_built": kernels.A8_BUILT, "native_f32": kernels.f32_linear_allowed()}


def compiled_count() -> int:
    """Graphs inductor has code-generated in this process (cache misses: what a stored cache would have saved)."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_miss"]


def persisting(engine, cache: Optional[CompileCache]):
    """The engine, with each callable storing the compile cache after a call that compiled something."""
    if cache is None:
        return engine

    def after(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            cache.save_if_new()
            return out
        return run
    for name in ("prefill", "decode_one_token", "forward", "forward_features"):
        fn = getattr(engine, name)
        if fn is not None:
            setattr(engine, name, after(fn))
    engine.cache = cache
    return engine


class ExportedForward(torch.nn.Module):
    """The signature a stored graph is exported with: every argument explicit, so one graph serves every caller;
    with `features`, the logits and those blocks' inputs (Transformer.forward_features)."""

    def __init__(self, model: Transformer, features: tuple = ()):
        super().__init__()
        self.model, self.features = model, features

    def forward(self, idx, input_pos, slots, mask, *caches):
        caches = list(zip(caches[0::2], caches[1::2]))  # (keys, values) of each layer
        if self.features:
            return self.model.forward_features(idx, input_pos, slots, mask, self.features, caches=caches)
        return self.model(idx, input_pos, slots, mask, caches=caches)


class StoredGraph:
    """A module's forward through stored AOTInductor graphs: one per batch and cache batch, dynamic in the number of
    tokens T (dim 1 of the inputs, dim 2 of the mask) and in the cache length S (dim 3 of the mask, dim 2 of the KV
    cache), built once and kept beside the checkpoint. A graph holds kernels only: the weights are the module's own
    tensors, handed to it when it is loaded (not copied), and the KV cache is an input of every call (written in
    place), so one copy of the weights serves every graph of a process, eager code and every graph see one cache,
    and no cache length or --max_new_tokens builds another graph. Graphs are keyed and signed (artifacts.py): a
    stale or foreign one is refused with one line and rebuilt. Where a graph cannot be exported, that shape is
    compiled in this process instead (one line says so). A subclass says what is exported (`exported`, `example`),
    which tensors are its cache (`caches`), what keys it (`key_fields`) and what it is called."""
    owner = "model"  # the exported wrapper's attribute holding the module: the prefix of its buffers in the graph
    tuple_out = False  # the graph returns several tensors
    EXAMPLE_LENGTH = 64  # the cache length a graph is exported with (any other length runs the same graph)
    MAX_LENGTH = 1 << 20  # the longest cache a graph takes

    def __init__(self, module: torch.nn.Module, device: str, mode: str, checkpoint_path, n_layer: int):
        self.module, self.device, self.mode, self.path, self.n_layer = module, device, mode, checkpoint_path, n_layer
        self.options = stored_options(module, mode, device)
        self.graphs = {}  # (batch, cache batch) -> (run(*args), bind(tensors) or None where compiled in the process)

    def exported(self) -> torch.nn.Module:
        raise NotImplementedError

    def caches(self) -> list:
        """The module's KV cache tensors in the order its graph takes them: each layer's keys, then its values."""
        raise NotImplementedError

    def constants(self) -> dict:
        """The module's tensors but its KV cache, by the names the graph knows them by (their original names). A tied
        tensor under each of its names: export may name it after either module (a tied output layer)."""
        tensors = itertools.chain(self.module.named_parameters(remove_duplicate=False),
                                  self.module.named_buffers(remove_duplicate=False))
        return {f"{self.owner}.{name}": t for name, t in tensors if "kv_cache" not in name}

    def layout(self) -> str:
        """A digest of the shape, strides and dtype of every tensor the graph reads as a constant: a graph's kernels are
        built for the layout they were traced with, and read any other one wrongly."""
        specs = sorted([name, list(t.shape), list(t.stride()), str(t.dtype)] for name, t in self.constants().items())
        return hashlib.sha256(json.dumps(specs).encode()).hexdigest()

    def example(self, batch: int, cache_batch: int, tokens: int) -> tuple:
        """The graph's arguments for `tokens` tokens, a cache of EXAMPLE_LENGTH slots last: what it is exported with
        and what a child process runs."""
        raise NotImplementedError

    def example_caches(self, cache_batch: int) -> list:
        """Zeros shaped like the module's caches, EXAMPLE_LENGTH slots long."""
        return [torch.zeros(cache_batch, t.shape[1], self.EXAMPLE_LENGTH, t.shape[3], dtype=t.dtype, device=t.device)
                for t in self.caches()]

    def key_fields(self, batch: int, cache_batch: int) -> dict:
        raise NotImplementedError

    def label(self, batch: int, cache_batch: int) -> str:
        return f"{Path(self.path).stem}-b{batch}of{cache_batch}"

    def compiled_in_process(self):
        raise NotImplementedError

    def run(self, args: tuple, batch: int):
        """The graph of this batch and the module's cache batch (loaded or built at its first call) on args and the
        module's current KV cache."""
        caches = self.caches()
        shape = (batch, caches[0].shape[0])
        if shape not in self.graphs:
            self.graphs[shape] = self.load(*shape)
        run, bind = self.graphs[shape]
        args = tuple(a.contiguous() for a in args)
        return run(*args, *caches) if bind is not None else run(*args)

    def load(self, batch: int, cache_batch: int):
        """(run, bind) of the stored graph for this shape: loaded if a valid one is stored, else built and stored."""
        import artifacts
        fields = self.key_fields(batch, cache_batch)
        key = artifacts.key_of(fields)
        directory = artifacts.directory_for(self.path)
        name = f"{self.label(batch, cache_batch)}-{self.mode}-{key[:16]}"
        failed = directory / f"{name}.failed"  # a build that failed for this key: not tried again in every run
        marker = failed.read_text(errors="replace").splitlines() if failed.exists() else []
        if marker[:1] == [key]:
            print(f"the graph {name} could not be stored here ({marker[1] if len(marker) > 1 else '?'}); compiling "
                  f"it in this process (remove {failed} to try again)", file=sys.stderr)
            return self.in_process()
        library, refused = artifacts.find(directory, name, key)
        if refused:
            print(f"refusing the stored graph {directory / name}.so: {refused}; building it again", file=sys.stderr)
        if library is not None:
            try:
                return self.open(library)
            except Exception as e:  # one this machine built but can no longer load (a system library changed)
                print(f"refusing the stored graph {library}: it does not load ({type(e).__name__}); building it "
                      f"again", file=sys.stderr)
        what = f"the graph of {self.path} (batch {batch} of {cache_batch}, {self.mode})"
        if artifacts.loader_crashed(self.device):
            print(f"not storing {what}: loading a stored graph crashed or hung on this machine with this torch "
                  f"before; compiling it in this process (remove {artifacts.loader_marker(self.device)[0]} to try "
                  f"again)",
                  file=sys.stderr)
            return self.in_process()
        estimate = artifacts.build_seconds_estimate(directory, self.n_layer)

        def build(tmp):
            configure_compiler(self.device)
            table = self.export(self.example(batch, cache_batch, 4), tmp)
            if self.device.startswith("cuda"):  # the loader crashed on a GPU measured: try it where a crash is harmless
                loads_in_child(tmp, table, self.device, [self.example(batch, cache_batch, t) for t in (1, 4)],
                               constants=self.constants())
            return table
        try:
            library = artifacts.store_kept(directory, name, key, fields)
            if library is not None:
                print(f"{what}: copied from kernels this machine built before for its shape and settings (no build)",
                      file=sys.stderr)
            else:
                library = with_progress(what, estimate, lambda: artifacts.store(directory, name, key, fields, build))
                artifacts.keep(library, fields)
            return self.open(library)
        except (KeyboardInterrupt, OSError, MemoryError):
            raise
        except Exception as e:
            first = first_line(e, 200, default="")
            print(f"cannot store {what} ({type(e).__name__}: {first}); compiling it in this process instead",
                  file=sys.stderr)
            text = f"{key}\n{type(e).__name__}: {first}\n"
            write_atomically(failed, lambda tmp: tmp.write_text(text))
            if isinstance(e, LoaderCrashed):  # the loader, not this graph: every later build would fail so
                artifacts.note_loader_crash(self.device)
            return self.in_process()

    def in_process(self):
        """(run, None): this shape compiled in the process (whole graph: CUDA graphs on GPU), for a graph that
        cannot be stored or loaded here; its kernels are kept as an in-process whole graph's are (CompileCache)."""
        configure_compiler(self.device)
        compiled = self.compiled_in_process()
        # a model's kernels are kept (CompileCache keys them by the model's traced sources); a head's one layer
        # compiles in seconds
        cache = CompileCache.for_model(self.module, self.device, "whole") if isinstance(self.module, Transformer) \
            else None
        if cache is None:
            return compiled, None

        def run(*args):
            out = compiled(*args)
            cache.save_if_new()
            return out
        return run, None

    def open(self, library: Path):
        """Load a stored graph and hand it the module's weights: run(*args, *caches) and bind(tensors by name). The
        library itself: loading the package would unzip it to a temp directory first (BENCHMARKS.md). On CUDA its
        few-token calls are replayed from CUDA graphs (Replayed)."""
        runner = aoti_runner(library, self.device)
        run = (lambda *args: runner.run(list(args)))
        if self.device.startswith("cuda"):
            run = Replayed(run, len(self.caches()))
        bind, tensors = binder(runner, run), self.constants()
        # the module's own cache buffers may be listed too, unread: the graph takes the cache as inputs
        missing = sorted(n for n in bind.names - set(tensors) if "kv_cache" not in n)
        if missing:  # a graph holds no constants of its own: one the module lacks is one it would read as garbage
            raise RuntimeError(f"the graph reads {missing[0]}, which the module does not hold")
        bind(tensors)
        if self.tuple_out:
            return (lambda *args: tuple(run(*args))), bind
        return (lambda *args: run(*args)[0]), bind

    def export(self, example, tmp: Path):
        """Export the module, dynamic in the tokens and the cache length, compile it with AOTInductor, keep its one
        shared library at tmp; returns its operator table (the package's wrapper .json: what the runner needs to call
        custom operators that have no C entry point; ours have one, kernels.c_shims), or None."""
        tokens = torch.export.Dim("tokens", min=1, max=self.MAX_LENGTH)
        length = torch.export.Dim("cache", min=2, max=self.MAX_LENGTH)
        n = len(example) - len(self.caches())
        dynamic = (*({2: tokens, 3: length} if a.dtype == torch.bool else {1: tokens}  # the mask: [B, 1, T, S]
                     for a in example[:n]), tuple({2: length} for _ in example[n:]))  # *caches: [B, H, S, D] each
        with torch.no_grad():
            with buffers_as_parameters(self.module):
                program = torch.export.export(self.exported(), example, strict=False, dynamic_shapes=dynamic)
            package = Path(f"{tmp}.pt2")  # the packager wants its suffix
            try:
                configs = dict(self.options)  # a copy: the packager adds to it
                if self.device == "cpu" and kernels.A8_BUILT:
                    configs["aot_inductor.custom_ops_to_c_shims"] = kernels.c_shims()
                torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
                with zipfile.ZipFile(package) as archive:
                    libraries = [n for n in archive.namelist() if n.endswith(".so")]
                    if len(libraries) != 1:
                        raise RuntimeError(f"the package holds {len(libraries)} shared libraries, not one")
                    with archive.open(libraries[0]) as source, open(tmp, "wb") as out:
                        shutil.copyfileobj(source, out, 1 << 24)
                    tables = [n for n in archive.namelist() if n.endswith(".wrapper.json")]
                    return archive.read(tables[0]).decode() if tables else None
            finally:
                package.unlink(missing_ok=True)


class StoredForward(StoredGraph):
    """model(idx, input_pos, slots, mask) through stored graphs (StoredGraph): T is 1 for decode, the tree size for
    verification, the prompt's length for prefill, so they share one graph per batch and cache batch."""

    def __init__(self, model: Transformer, device: str, mode: str, features: tuple = ()):
        super().__init__(model, device, mode, model.checkpoint_path, model.args.n_layer)
        self.model, self.features = model, tuple(features)
        self.tuple_out = bool(self.features)
        self.held_caches = []

    def __call__(self, idx: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                 block=None) -> Tensor:
        model = self.model
        if slots is None:
            slots = input_pos
        if mask is None:  # causal over slots, as Transformer.run_layers makes it
            cache_slots = torch.arange(model.max_seq_length, device=idx.device)
            mask = cache_slots.view(1, 1, 1, -1) <= slots.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, S]
        batch = idx.shape[0]
        args = (idx.long(), input_pos.long(), slots.long(), mask.expand(batch, 1, idx.shape[1], model.max_seq_length))
        return self.run(args, batch)

    def exported(self):
        return ExportedForward(self.model, self.features)

    def caches(self) -> list:
        """Every layer's keys and values, in order: the list kept while the first layer's keys and the last's
        values are the same tensors (setup_caches and .to() replace them all; walking every layer's modules each
        step shows in a small model's decode)."""
        layers, held = self.model.layers, self.held_caches
        if not held or held[0] is not layers[0].attention.kv_cache.k_cache \
                or held[-1] is not layers[-1].attention.kv_cache.v_cache:
            self.held_caches = held = [t for layer in layers for t in (layer.attention.kv_cache.k_cache,
                                                                      layer.attention.kv_cache.v_cache)]
        return held

    def example(self, batch: int, cache_batch: int, tokens: int) -> tuple:
        return (*example_inputs(batch, self.EXAMPLE_LENGTH, self.device, tokens), *self.example_caches(cache_batch))

    def key_fields(self, batch: int, cache_batch: int) -> dict:
        """Everything that changes the code generated for this model and shape (artifacts.py)."""
        cache = self.caches()[0]
        return dict(model_key_fields(self.model, self.device, self.mode),
                    cache=[batch, cache_batch, str(cache.dtype)], options=self.options, layout=self.layout(),
                    features=list(self.features))

    def label(self, batch: int, cache_batch: int) -> str:
        features = "-f" + ".".join(map(str, self.features)) if self.features else ""
        return super().label(batch, cache_batch) + features

    def compiled_in_process(self):
        model = self.model
        fn = functools.partial(model.forward_features, layers=self.features) if self.features else model
        return torch.compile(fn, fullgraph=True, dynamic=True, **graph_options(model, self.device, "whole"))


class ExportedHead(torch.nn.Module):
    """A draft head's body (drafthead.DraftHead.body) with every argument explicit, its KV cache last, as its stored
    graphs export it."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head

    def forward(self, embedded, hidden, input_pos, slots, mask, *cache):
        return self.head.body(embedded, hidden, input_pos, slots, mask, cache)


class StoredHead(StoredGraph):
    """A draft head's body(embedded, hidden, input_pos, slots, mask) through stored graphs (StoredGraph), kept beside
    the head's weights: T is the entries caught up, one token of a chain or a tree's frontier."""
    owner = "head"

    def __init__(self, head: torch.nn.Module, device: str, mode: str):
        super().__init__(head, device, mode, head.checkpoint_path, 1)
        self.head = head

    def __call__(self, embedded: Tensor, hidden: Tensor, input_pos: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        length = self.head.attention.kv_cache.k_cache.shape[2]
        batch, tokens = hidden.shape[:2]
        args = (embedded, hidden, input_pos.long(), slots.long(), mask.expand(batch, 1, tokens, length))
        return self.run(args, batch)

    def exported(self):
        return ExportedHead(self.head)

    def caches(self) -> list:
        return [self.head.attention.kv_cache.k_cache, self.head.attention.kv_cache.v_cache]

    def example(self, batch: int, cache_batch: int, tokens: int) -> tuple:
        length = self.EXAMPLE_LENGTH
        T, dim = min(tokens, length - 1), self.head.args.dim
        dtype = self.head.norm.weight.dtype
        pos = (torch.arange(T, device=self.device) + 1).expand(batch, T).contiguous()  # slot 0 is never written
        cache_slots = torch.arange(length, device=self.device).view(1, 1, 1, -1)
        mask = (cache_slots <= pos.view(batch, 1, T, 1)) & (cache_slots > 0)
        features = torch.zeros(batch, T, dim, dtype=dtype, device=self.device)
        return features, features.clone(), pos, pos.clone(), mask, *self.example_caches(cache_batch)

    def key_fields(self, batch: int, cache_batch: int) -> dict:
        cache = self.caches()[0]
        return dict(model_key_fields(self.head, self.device, self.mode, TRACED_MODULES + ("drafthead",)),
                    cache=[batch, cache_batch, str(cache.dtype)], options=self.options, layout=self.layout())

    def label(self, batch: int, cache_batch: int) -> str:
        return f"head-b{batch}of{cache_batch}"

    def compiled_in_process(self):
        return torch.compile(self.head.body, fullgraph=True, dynamic=True,
                             **graph_options(self.head, self.device, "whole"))


def inventory(directory: Path, weights_directory: Optional[Path] = None) -> list:
    """What a compiled/ directory holds: one row per artifact (its files together: library, operator table,
    metadata, failure marker; or a checkpoint's packed copy, quantize.store_packed) with its bytes, kind, and why it
    is stale (None if this machine, software and code would still load it): built for a weights file that changed or
    is gone, other software or another machine, older source code, or something unreadable. Graphs of other batch
    sizes or modes are not stale: another run may use them; a failed build's marker is (pruning it retries the
    build). weights_directory: where the weights files are (default: the directory above compiled/)."""
    import artifacts
    here = {k: v for k, v in artifacts.machine().items() if k != "threads"}
    sources = {artifacts.sources_digest(TRACED_MODULES), artifacts.sources_digest(TRACED_MODULES + ("drafthead",))}
    packed_sources = {artifacts.sources_digest(("quantize",))}  # the layouts of a packed copy (quantize.packed_key)
    native = artifacts.file_sha256(Path(__file__).with_name("kernels_a8.cpp"))
    identities = {}
    groups = {}
    for path in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
        name = path.name
        for suffix in (".meta.json", ".failed", ".so", ".bin", ".pth", ".json"):
            if name.endswith(suffix) and not name.startswith("."):
                name = name[:-len(suffix)]
                break
        groups.setdefault(name, []).append(path)
    rows = []
    for name, paths in groups.items():
        meta = Path(directory) / f"{name}.meta.json"
        kind = ("timings" if name.startswith("auto-timings-") else "failed build" if paths[0].suffix == ".failed"
                and len(paths) == 1 else "kernels" if "-kernels-" in name else "packed copy" if "-packed-" in name
                else "graph")
        stale = None
        if kind in ("graph", "kernels", "packed copy"):
            try:
                fields = json.loads(meta.read_text())["fields"]
                # the kernels kept for any weights file (artifacts.kept_directory) have no weights to check
                weights = "weights" in fields and Path(weights_directory or Path(directory).parent) / \
                    fields["weights"]["file"]
                if weights and weights not in identities:
                    identities[weights] = artifacts.file_identity(weights) if weights.exists() else None
                if weights and identities[weights] != fields["weights"]:
                    stale = "its weights file changed or is gone"
                elif {k: v for k, v in fields["machine"].items() if k != "threads"} != here:
                    stale = "built with other software or on another machine"
                elif fields["sources"] not in (packed_sources if kind == "packed copy" else sources) \
                        or fields["native"] != native:
                    stale = "built from older code"
            except (OSError, ValueError, KeyError, TypeError):
                stale = "no readable metadata"
        elif kind == "failed build":
            stale = "a failed build's marker"
        elif name.startswith("."):  # a write in progress, or a killed one's: the next write removes the latter
            kind = "partial write"
        rows.append({"name": name, "kind": kind, "bytes": sum(p.stat().st_size for p in paths), "stale": stale,
                     "paths": [str(p) for p in paths]})
    return rows


def compile_head(head: torch.nn.Module, device: str, mode: str = "auto"):
    """A draft head (drafthead.DraftHead) compiled as its target's engine is (compile_engine's modes): its body one
    stored graph per batch and cache size for "auto" / "autotune" (beside the head's weights, keyed by them), compiled
    in this process, dynamic in the tokens, for "regional", "whole" and a head built in memory; eager for "none"."""
    mode = resolve_mode(mode, device, getattr(head, "checkpoint_path", None) is not None)
    if mode == "none":
        head.compiled = None
    elif mode.startswith("stored"):
        kernels.use_stored_layout(head)
        head.compiled = StoredHead(head, device, mode)
    else:
        configure_compiler(device)
        head.compiled = torch.compile(head.body, fullgraph=True, dynamic=True,
                                      **graph_options(head, device, "autotune" if mode == "autotune" else "whole"))
    return head


@contextlib.contextmanager
def buffers_as_parameters(module: torch.nn.Module):
    """The module's buffers as parameters on the same memory while it is exported: AOTInductor copies every buffer of
    the program it compiles (a graph may write one) and no parameter, and ours (integer weights, packed blocks,
    tables) are only read, so a build would hold a second copy of the weights."""
    moved = []
    for m in module.modules():
        for name, t in list(m._buffers.items()):
            if t is not None:
                moved.append((m, name, t, name not in m._non_persistent_buffers_set))
                del m._buffers[name]
                m._non_persistent_buffers_set.discard(name)
                m._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    try:
        yield
    finally:
        for m, name, t, persistent in moved:
            del m._parameters[name]
            m.register_buffer(name, t, persistent=persistent)


def example_inputs(batch: int, length: int, device: str, tokens: int = 4):
    """Arguments of a stored graph's forward (idx, input_pos, slots, mask) for `tokens` tokens: what it is exported
    with (not 1 token: export would specialize the token count on it) and what a child process tries it on."""
    T = min(tokens, length)
    pos = torch.arange(T, device=device).expand(batch, T).contiguous()
    mask = torch.arange(length, device=device).view(1, 1, 1, -1) <= pos.view(batch, 1, T, 1)
    return torch.zeros(batch, T, dtype=torch.long, device=device), pos, pos.clone(), mask


def binder(runner, run=None):
    """bind(tensors by original name): hand a loaded graph's runner these tensors as its constants, user-managed (the
    graph reads them in place: no copy); `run` (Replayed) forgets captured CUDA graphs, which hold old addresses."""
    internal = {fqn: name for name, fqn in runner.get_constant_names_to_original_fqns().items()}

    def bind(tensors: dict):
        runner.update_constant_buffer({internal[n]: t for n, t in tensors.items() if n in internal}, False, False,
                                      True)
        if isinstance(run, Replayed):
            run.reset()
    bind.names, bind.runner = set(internal), runner
    return bind


def aoti_runner(library, device: str):
    """AOTInductor's runner of a stored library on this device."""
    if device.startswith("cuda"):
        return torch._C._aoti.AOTIModelContainerRunnerCuda(str(library), 1, device)
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)


# a child process loads the library, hands it zeros in the place of each constant (the weights' and cache's shapes,
# strides and dtypes) and runs it on each saved list of example arguments (a one-token call, a four-token call);
# exit 0 when all give finite outputs of the right batch and token count
CHILD_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, compilation, kernels
library, device, saved = sys.argv[2], sys.argv[3], torch.load(sys.argv[4], weights_only=True)
examples, constants = saved["examples"], saved["constants"]
if device == "cpu":
    kernels.a8_kernels()  # the operators a CPU graph may call
runner = compilation.aoti_runner(library, device)
zeros = {name: torch.empty_strided(shape, stride, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
         .zero_() for name, (shape, stride, dtype) in constants.items()}
compilation.binder(runner)(zeros)
with torch.no_grad():
    for args in examples:
        out = runner.run([a.to(device).contiguous() for a in args])[0]
        assert out.shape[:2] == args[0].shape[:2] and bool(torch.isfinite(out).all()), "a wrong output"
"""


def loads_in_child(library, table, device: str, examples: list, timeout: Optional[float] = None,
                   constants: Optional[dict] = None):
    """Load and run a freshly built graph (its library and operator table's text, or None) in a child process first,
    on each of `examples` (lists of its arguments), zeros in the place of `constants` (the tensors it reads, by
    name: only their shapes, strides and dtypes go to the child):
    AOTInductor's loader crashed (a segmentation fault, which no exception handler catches) on a GPU measured, and
    hung on another (BENCHMARKS.md). Raises LoaderCrashed if the child dies of a signal or has not finished after
    `timeout` seconds (default: a minute, and a second per 100 MB of library: it was just written, so it loads from
    memory), RuntimeError if it fails otherwise."""
    import subprocess
    import tempfile
    library = Path(library)
    if timeout is None:
        timeout = 60 + library.stat().st_size / 100e6
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".check-") as check:
        linked = Path(check) / "graph.so"  # the runner finds the operator table by the library's name
        try:
            os.link(library, linked)
        except OSError:  # a file system without hard links
            shutil.copyfile(library, linked)
        if table is not None:
            linked.with_suffix(".json").write_text(table)
        arguments = Path(check) / "examples.pt"
        specs = {name: [list(t.shape), list(t.stride()), str(t.dtype)] for name, t in (constants or {}).items()}
        torch.save({"examples": [[a.cpu() for a in args] for args in examples], "constants": specs}, arguments)
        try:
            done = subprocess.run([sys.executable, "-c", CHILD_CHECK, str(Path(__file__).resolve().parent),
                                   str(linked), device, str(arguments)],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:  # the child is killed: the loader hung, which no later build escapes
            raise LoaderCrashed(f"loading it in a child process hung (stopped after {timeout:.0f} s)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][:160]
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        error = LoaderCrashed if done.returncode < 0 else RuntimeError
        raise error(f"loading it in a child process failed ({how}{': ' + last if last else ''})")


class LoaderCrashed(RuntimeError):
    """The child process that loaded a stored graph died of a signal (AOTInductor's loader segfaulted) or hung."""


class Replayed:
    """A stored CUDA graph's run(*args) -> [tensors], its calls of up to MAX_TOKENS tokens (decode, verification)
    replayed from CUDA graphs: an AOTInductor graph launches each kernel from the host, and a small batch's step is
    bound by those launches. A shape is captured at its second call (the first warms up) and kept only if its replay
    equals the direct run of the same inputs (writing the same tokens into the cache twice changes nothing);
    otherwise that shape keeps launching directly. The last `in_place` arguments (the KV cache) are not copied: the
    captured graphs read and write them where they are, so new cache tensors drop every capture."""
    MAX_TOKENS = 16

    def __init__(self, run, in_place: int = 0):
        self.run, self.graphs, self.seen, self.in_place, self.addresses = run, {}, set(), in_place, None

    def reset(self):
        self.graphs.clear()
        self.seen.clear()

    def __call__(self, *args):
        copied = len(args) - self.in_place
        addresses = [a.data_ptr() for a in args[copied:]]
        if addresses != self.addresses:  # captured graphs hold the old cache's addresses
            self.reset()
            self.addresses = addresses
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        if args[0].shape[1] > self.MAX_TOKENS:
            return self.run(*args)
        entry = self.graphs.get(key)
        if entry is None:
            expected = self.run(*args)
            if key in self.seen:
                self.graphs[key] = self.capture(args, expected)
            self.seen.add(key)
            return expected
        if entry is False:
            return self.run(*args)
        graph, inputs, outputs = entry
        for static, a in zip(inputs, args[:copied]):
            static.copy_(a)
        graph.replay()
        return [o.clone() for o in outputs]

    def capture(self, args, expected):
        copied = len(args) - self.in_place
        inputs = [a.clone() for a in args[:copied]]
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                outputs = self.run(*inputs, *args[copied:])
            graph.replay()
            same = len(outputs) == len(expected) and all(torch.equal(o, e) for o, e in zip(outputs, expected))
        except RuntimeError as e:
            same, why = False, first_line(e)
        else:
            why = "its replay differs from the direct run"
        if not same:
            print(f"a stored graph's {args[0].shape[1]}-token call is not replayed from a CUDA graph ({why}); its "
                  f"kernels are launched one by one", file=sys.stderr)
            return False
        return graph, inputs, outputs


def with_progress(what: str, estimate, build):
    """build() with a line on stderr now and every 15 s: what is compiling, the time so far, the estimate."""
    start = time.perf_counter()
    about = f", about {estimate:.0f} s" if estimate else ""
    print(f"compiling {what} once; later runs load it{about}", file=sys.stderr, flush=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(15):
            print(f"  compiling: {time.perf_counter() - start:.0f} s{about}", file=sys.stderr, flush=True)
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        return build()
    finally:
        stop.set()
        thread.join()
        print(f"  compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


@functools.cache
def compiled_region(fn, dynamic: bool):
    """One compiled callable per function for the whole process: every engine looks up the same graphs."""
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, options={"freezing": False})


def unfrozen(fn):
    """fn with inductor's freezing off: a region's weights must stay graph inputs (one graph serves every layer and
    model); frozen, every weight would be guarded by identity and the block compiled once per layer."""
    import torch._inductor.config as inductor_config

    @functools.wraps(fn)
    def run(*args, **kwargs):
        frozen = inductor_config.freezing
        inductor_config.freezing = False
        try:
            return fn(*args, **kwargs)
        finally:
            inductor_config.freezing = frozen
    return run
