"""Decoding with one model: sampling (temperature, top-k, top-p), prefill, one-token decode, the compiled engine.

    engine = compile_engine(model, "cpu", compile_prefill=True)   # or Engine(model) for eager
    first, finite = engine.prefill(model, prompt_ids, positions, Sampling(0.7, top_k=200))
    tokens = decode_n_tokens(engine, first, pos, 100, Sampling(0.7, top_k=200), eos_ids, stop_at_eos=True)
"""
import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from model import Transformer

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 means exact argmax
    top_k: Optional[int] = None
    top_p: Optional[float] = None


# ----------------------------------------------------------------------------- sampling

def logits_to_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """The warped distribution actually sampled from: temperature, then top-k, then top-p.
    Temperature 0 gives the one-hot argmax, so greedy decoding is the same code as sampling."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    top_p = sampling.top_p is not None and sampling.top_p < 1.0
    ranked = None  # the largest logits, sorted descending, when top-k already found them
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        ranked = torch.topk(logits, sampling.top_k, dim=-1).values  # [..., k]
        logits = logits.masked_fill(logits < ranked[..., -1:], -float("inf"))  # ties with the k-th stay
    if top_p:
        # keep the smallest set of the largest logits whose mass reaches top_p (a logit tied with the last one kept
        # stays too); after top-k only its k sorted values need looking at, not a sort of the whole vocabulary
        if ranked is None:
            ranked = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
        mass = (ranked - torch.logsumexp(logits, -1, keepdim=True)).exp()  # [..., k or V]
        kept = (mass.cumsum(-1) - mass < sampling.top_p).sum(-1, keepdim=True)  # the first is always kept
        # (NaN logits, from broken weights, keep none: clamped, so that the caller's NaN check still speaks)
        logits = logits.masked_fill(logits < ranked.gather(-1, kept.clamp_min(1) - 1), -float("inf"))
    return torch.softmax(logits, dim=-1)


def exponential_like(x: Tensor) -> Tensor:
    """Exp(1) noise shaped like x, as -log(U) with U ~ Uniform[0, 1): on CPU 3-4x faster than exponential_()
    (1.2 ms against 0.27 ms for a 49152-token row on this project's 2-core machine). U = 0, a 2^-24 event per
    element, gives +inf: that element scores -inf as a Gumbel key."""
    return torch.rand_like(x, dtype=torch.float32).log_().neg_()


def sample_from(probs: Tensor) -> Tensor:
    """One draw from each row of probs [..., V] ([...] long), without a host sync, by inverse CDF: the first token
    whose cumulative mass exceeds u * total, u ~ U[0, 1) (as torch.multinomial does). One uniform per row, where
    the exponential race argmax(p / E) of gpt-fast needs V of them: 1.5-2.3x cheaper compiled on CPU at V = 49152,
    the same at 4096 (scripts/bench_sampling.py). Sums in float64, so rounding moves no probability a float32 sum
    would. A token of mass 0 adds nothing to the sum, so it is never the first to exceed u * total (kept below the
    total even where rounding would reach it; the clamp only matters for NaN rows, which callers check)."""
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    u = torch.rand(total.shape, dtype=torch.double, device=probs.device)
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, below, right=True).clamp_max(probs.shape[-1] - 1).squeeze(-1)


def sample(logits: Tensor, sampling: Sampling):
    probs = logits_to_probs(logits, sampling)
    if sampling.temperature == 0:  # the argmax itself: no noise to draw for a one-hot
        return probs.argmax(-1), probs
    return sample_from(probs), probs


# ----------------------------------------------------------------------------- prefill and one-token decode

def prefill(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling, last: Optional[Tensor] = None,
            block=None):
    """Run the prompts [B, T] through the model, fill the cache; return the first new token [B] and whether
    the logits it came from are all finite (a bool tensor: broken weights give NaN, which sampling cannot see).
    last: [B] index of each row's last prompt token (rows of different lengths, right-padded); default T - 1.
    Padding after a row's prompt is never seen: a query sees only slots up to its own, and decoding
    overwrites the padding's slots in order before any query can see them. block: see Transformer.forward."""
    logits = model(x, input_pos, block=block)
    logits = logits[:, -1] if last is None else logits[torch.arange(x.shape[0], device=x.device), last]  # [B, V]
    return sample(logits, sampling)[0], torch.isfinite(logits).all()


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling):
    """x, input_pos: [B, 1]; returns the next token [B] and the distribution it came from [B, V]."""
    logits = model(x, input_pos)
    return sample(logits[:, -1], sampling)


@dataclass
class Engine:
    """A model with the callables that run it; compiled ones when asked."""
    model: Transformer
    prefill: callable = prefill
    decode_one_token: callable = decode_one_token
    forward: callable = None  # multi-token scoring with an explicit mask (speculative verification)
    graph_kwargs: Optional[dict] = None  # torch.compile's keyword arguments of its whole graphs (None: not whole)

    def __post_init__(self):
        if self.forward is None:
            self.forward = self.model

    def write_cache(self, x: Tensor, input_pos: Tensor):
        """Tokens x [B, L] into the model's cache at input_pos [B, L] (any L) through the prefill (compiled for any
        length with --compile_prefill, else eager); the token it samples is not used."""
        with sdpa_context():
            self.prefill(self.model, x, input_pos, Sampling())


def run_block(layer, x: Tensor, rope: Tensor, mask: Tensor, slots: Tensor) -> Tensor:
    """One transformer block: the region compile_engine compiles once and runs for every layer."""
    return layer(x, rope, mask, slots)


def sample_last(model: Transformer, h: Tensor, sampling: Sampling):
    """The final norm, the output layer and sampling on the last position of h [B, T, dim]."""
    return sample(model.output(model.norm(h[:, -1])), sampling)


def compile_engine(model: Transformer, device: str, compile_prefill: bool,
                   whole_graph: Optional[bool] = None, autotune: bool = False) -> Engine:
    """Compiled decode (one static shape, [B, 1]), verification forward (one static shape per tree size) and,
    with compile_prefill, prefill (dynamic in the prompt length, so prompts of any length reuse it).

    whole_graph=False (the CPU default for models deeper than WHOLE_GRAPH_MAX_LAYERS): regional compilation. One
    TransformerBlock is compiled and the same compiled code runs every layer: the layer's weights and KV cache are
    inputs of the graph, not constants, so 30 layers cost the compile time of one, and every model of the same
    shape (a target and a draft) shares it. The embedding lookup and the loop over layers stay in Python; the
    final norm, output layer and sampling of a decode step are one more small graph.
    whole_graph=True (the default on CUDA, and on CPU for shallower models): the whole model in one graph,
    replayed as one CUDA graph on GPU (mode="reduce-overhead"). On CPU inductor's freezing then folds the
    weights into the graph as constants and pre-packs them for its own C++ GEMM kernels (graph_options: no
    timing, 1.4-1.9x faster than MKL's on the tiny pair; quantized models keep their int8 / int4 kernels); it
    applies only to graphs traced without autograd, which is why every generation runs under torch.no_grad(),
    and such graphs are specialized on the model object, so a target and a draft of the same shape get graphs
    of their own (tests/test_decode.py checks both modes).
    The price is compile time: a 30-layer model takes a minute or more on a small CPU.
    autotune=True (implies the whole graph): mode="max-autotune". On CPU inductor then times its own C++ GEMM
    templates (weights frozen and pre-packed into its micro-kernels' blocked layout) against ATen's for every
    matmul shape of the graph and keeps the fastest: on a 2-core AVX-512 CPU the one-token decode of
    SmolLM2-135M ran 2-2.6x faster and a 6-token verify forward 2.7x faster than the regional graphs, whose
    small-M matmuls go through MKL (BENCHMARKS.md). Compiling takes minutes (every shape is benchmarked);
    inductor's caches keep the choices for the next run. On CUDA it picks Triton configurations and still
    replays CUDA graphs."""
    import torch._inductor.config as inductor_config
    cuda = device.startswith("cuda")
    inductor_config.fx_graph_cache = True  # a second run of the same model reuses the compiled kernels
    if not cuda and os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None \
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # inductor otherwise proves in every process that its C++ compiler builds each vector instruction set the
        # CPU lists (a build per set into the cache, then a subprocess that loads it): 8-9 s of a cold compile on
        # 2 cores, about 1 s warm (BENCHMARKS.md). ATen already runs this CPU's AVX2 / AVX-512 kernels, and any
        # compiler that builds inductor's C++17 emits them. Setting TORCHINDUCTOR_VEC_ISA_OK yourself overrides this.
        inductor_config.cpp.vec_isa_ok = True
    # one shape per graph: decode [B, 1], each tree size of the target and the draft, a shared block for all
    # models of one width; past the default of 8 graphs per function a fullgraph compile would raise
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # a Python float argument (the temperature, top-p) is a constant of its graph: traced as a symbolic float, it
    # makes inductor give up and dynamo trace the whole function again (seconds per graph)
    torch._dynamo.config.specialize_float = True
    whole_graph, options = graph_options(model, device, whole_graph, autotune)
    if not whole_graph:
        return compile_regions(model, compile_prefill)
    if device == "cpu":
        inductor_config.freezing = True  # and so the graphs multiply with inductor's kernels, not our copy (Linear)
    inductor_config.coordinate_descent_tuning = cuda
    inductor_config.triton.unique_kernel_names = True
    if autotune:  # the choices are made quietly: no table of timings per matmul shape on stderr
        inductor_config.autotune_num_choices_displayed = 0
        inductor_config.max_autotune_report_choices_stats = False
    engine = Engine(model, graph_kwargs=options)
    engine.decode_one_token = torch.compile(decode_one_token, fullgraph=True, dynamic=False, **options)
    engine.forward = torch.compile(model, fullgraph=True, dynamic=False, **options)
    if compile_prefill:
        engine.prefill = torch.compile(prefill, fullgraph=True, dynamic=True, **options)
    return engine


# On CPU, models of at most this many layers compile as one whole graph by default: the regional graphs' per-layer
# calls cost more than such a model's compute per token (a 2-layer draft's one-token step 0.6 against 1.0 ms, the
# 5-layer tiny target decodes 1.06-1.3x faster whole), and their whole graph compiles in seconds (BENCHMARKS.md).
WHOLE_GRAPH_MAX_LAYERS = 8


def whole_graph_mode(device: str, whole_graph: Optional[bool] = None, autotune: bool = False, *, n_layer: int):
    """(whether compile_engine compiles the whole model, the torch.compile mode of its graphs): autotune implies
    the whole graph; None chooses the default for the device and model depth (CUDA graphs on GPU; on CPU the
    whole graph for models of up to WHOLE_GRAPH_MAX_LAYERS layers, regional compilation for deeper ones)."""
    cuda = device.startswith("cuda")
    if whole_graph is None:
        whole_graph = cuda or n_layer <= WHOLE_GRAPH_MAX_LAYERS
    return autotune or whole_graph, "max-autotune" if autotune else "reduce-overhead" if cuda else None


# Inductor's C++ GEMM templates without the timing: with only "CPP" to choose from, max-autotune has nothing to
# benchmark and multiplies every linear of a frozen graph with its own micro-kernels, on weights it re-packs into
# their blocked layout at compile time. On the 2-core AVX2 EPYC of BENCHMARKS.md, in one process against the
# default (MKL's packed GEMM): the tiny target's one-token decode 1.76x faster, a 6-token verify forward 1.72x,
# 17 tokens 1.41x, a 4-row decode step 1.78x; the draft's 1.44-1.87x; in bf16 1.2-2.85x. The price: a cold
# compile takes about 1.4x as long. The template needs constant weights (freezing: whole graphs only) and applies
# to float weights; quantized models keep the default lowering of their int8 / int4 kernels.
CPP_GEMM_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


def graph_options(model: Transformer, device: str, whole_graph: Optional[bool] = None, autotune: bool = False):
    """(whether `model` compiles as one whole graph, torch.compile's keyword arguments for its whole graphs): the
    choice and mode of whole_graph_mode; the keyword arguments are the mode when there is one (CUDA graphs,
    --compile_autotune), on CPU for a model of float32 / bf16 weights only CPP_GEMM_OPTIONS, else nothing (the
    defaults: quantized models, whose int8 / int4 products lower as before)."""
    whole_graph, mode = whole_graph_mode(device, whole_graph, autotune, n_layer=model.args.n_layer)
    if mode is not None:
        return whole_graph, {"mode": mode}
    if device == "cpu" and all(t.dtype in (torch.float32, torch.bfloat16) for t in model.state_dict().values()):
        return whole_graph, {"options": dict(CPP_GEMM_OPTIONS)}
    return whole_graph, {}


def compile_regions(model: Transformer, compile_prefill: bool) -> Engine:
    """compile_engine(whole_graph=False): one compiled block shared by all layers, a compiled sampling head."""
    block, head = compiled_region(run_block, False), compiled_region(sample_last, False)

    def decode_step(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling):
        return head(model, model.hidden_states(x, input_pos, block=block), sampling)

    engine = Engine(model, decode_one_token=unfrozen(decode_step),
                    forward=unfrozen(functools.partial(model, block=block)))
    if compile_prefill:
        engine.prefill = unfrozen(functools.partial(prefill, block=compiled_region(run_block, True)))
    return engine


@functools.cache
def compiled_region(fn, dynamic: bool):
    """One compiled callable per function for the whole process, so that every engine (a target and its
    draft, a model loaded twice) looks its shapes up in the same graphs instead of compiling its own."""
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, options={"freezing": False})


def unfrozen(fn):
    """fn run with inductor's freezing off, whatever a whole-graph engine set: the regions' weights must stay
    inputs of their graphs (one graph serves every layer and model), and while freezing is on, torch.compile
    guards every weight by identity, which would compile the block once per layer."""
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


EOS_CHECK_EVERY = 8  # plain decode looks at the host for EOS this often (a device->host sync each time)


def decode_n_tokens(engine: Engine, token: Tensor, pos, n: int, sampling: Sampling,
                    eos_ids: list, stop_at_eos: bool, callback=None) -> list:
    """Plain autoregressive decoding of up to n tokens after `token` ([B], already sampled, at position pos:
    an int, or a [B] tensor when rows have prompts of different lengths). Returns the new tokens, a list of
    [B] tensors. Rows are checked for EOS every EOS_CHECK_EVERY tokens (and every token when a callback
    streams them), so the loop does not wait on the device each token; the caller truncates each row after
    its first EOS. One static shape [B, 1] throughout: positions are data, so no row length recompiles."""
    batch = token.shape[0]
    out = []
    eos = torch.tensor(eos_ids or [-1], device=token.device)
    done = torch.zeros(batch, dtype=torch.bool, device=token.device)
    pos = torch.as_tensor(pos, device=token.device).expand(batch).reshape(batch, 1)  # [B, 1]
    for i in range(n):
        input_pos = pos + i  # [B, 1]
        with sdpa_context():
            token, _ = engine.decode_one_token(engine.model, token.view(batch, 1), input_pos, sampling)
        token = token.clone()
        out.append(token)
        if callback:
            callback(token)
        if stop_at_eos:
            done |= torch.isin(token, eos)
            if (callback or (i + 1) % EOS_CHECK_EVERY == 0) and bool(done.all()):
                break
    return out


def sdpa_context():
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()
