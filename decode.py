"""Decoding with one model: sampling (temperature, top-k, top-p), prefill, one-token decode, the compiled engine.

    engine = compile_engine(model, "cpu", mode="auto", compile_prefill=True)   # or Engine(model) for eager
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

from errors import UserError
from model import Transformer

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Temperatures below this sample as greedy decoding: dividing logits by a tinier one overflows to inf / NaN, and the
# distribution it approximates is the argmax anyway.
MIN_TEMPERATURE = 1e-5


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 means exact argmax
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0


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
    if top_p:  # the smallest set of the largest logits whose mass reaches top_p (ties with the last kept stay)
        if ranked is None:
            ranked = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
        mass = (ranked - torch.logsumexp(logits, -1, keepdim=True)).exp()  # [..., k or V]
        kept = (mass.cumsum(-1) - mass < sampling.top_p).sum(-1, keepdim=True)  # the first is always kept (NaN: 0)
        logits = logits.masked_fill(logits < ranked.gather(-1, kept.clamp_min(1) - 1), -float("inf"))
    return torch.softmax(logits, dim=-1)


def exponential_like(x: Tensor) -> Tensor:
    """Exp(1) noise shaped like x, as -log(U), U ~ Uniform[0, 1) (cheaper than exponential_() on CPU); U = 0 gives
    +inf, which scores -inf as a Gumbel key."""
    return torch.rand_like(x, dtype=torch.float32).log_().neg_()


def sample_from(probs: Tensor) -> Tensor:
    """One draw from each row of probs [..., V] ([...] long) by inverse CDF, without a host sync: the first token whose
    cumulative mass exceeds u * total, u ~ U[0, 1), one uniform per row. Sums in float64; a token of mass 0 never
    exceeds the threshold (kept below the total), so it is never drawn."""
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
    """Run the prompts [B, T] through the model and fill the cache; returns the first new token [B] and whether its
    logits are all finite (broken weights give NaN). last [B]: each right-padded row's last prompt index (default
    T - 1); padding is never seen, since decoding overwrites its slots before any query can reach them."""
    logits = model(x, input_pos, block=block)
    logits = logits[:, -1] if last is None else logits[torch.arange(x.shape[0], device=x.device), last]  # [B, V]
    return sample(logits, sampling)[0], torch.isfinite(logits).all()


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling):
    """x, input_pos: [B, 1]; returns the next token [B] and the distribution it came from [B, V]."""
    logits = model(x, input_pos)
    return sample(logits[:, -1], sampling)


# ----------------------------------------------------------------------------- the engine: the one home of compilation

COMPILE_MODES = ("none", "regional", "whole", "autotune", "auto")
# "auto" compiles CPU models of at most this many layers whole: their per-layer calls would cost more than their
# compute, and their whole graph compiles quickly (BENCHMARKS.md).
WHOLE_GRAPH_MAX_LAYERS = 8
# Inductor's C++ GEMM templates, untimed (one choice: nothing to benchmark): every float linear of a frozen graph runs
# its micro-kernels on weights re-packed at compile time. Quantized models keep their int8 / int4 kernels.
CPP_GEMM_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


def resolve_mode(mode: str, device: str, n_layer: int) -> str:
    """The compile mode a model gets: "auto" is the whole graph on CUDA (replayed as a CUDA graph) and on CPU for
    models of at most WHOLE_GRAPH_MAX_LAYERS layers, regional compilation for deeper CPU models."""
    if mode not in COMPILE_MODES:
        raise UserError(f"`compile` mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "auto":
        return "whole" if device.startswith("cuda") or n_layer <= WHOLE_GRAPH_MAX_LAYERS else "regional"
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


@dataclass
class Engine:
    """A model with the callables that run it, and the one decision of how they are compiled (`mode`: none,
    regional, whole or autotune). compile_engine builds it; compile() gives any other function the same treatment."""
    model: Transformer
    mode: str = "none"
    prefill: callable = prefill
    decode_one_token: callable = decode_one_token
    forward: callable = None  # multi-token scoring with an explicit mask (speculative verification)
    options: dict = None  # torch.compile's keyword arguments of this engine's whole graphs

    def __post_init__(self):
        if self.forward is None:
            self.forward = self.model

    def compile(self, fn):
        """fn(model, ...) as one static-shape graph compiled like this engine's own, the model bound first; eager for
        "none"; None for "regional" (only the block and head are graphs: step through forward / decode_one_token)."""
        if self.mode == "none":
            return functools.partial(fn, self.model)
        if self.mode == "regional":
            return None
        return functools.partial(torch.compile(fn, fullgraph=True, dynamic=False, **self.options), self.model)

    def write_cache(self, x: Tensor, input_pos: Tensor):
        """Tokens x [B, L] into the model's cache at input_pos [B, L], through the prefill (its token is unused)."""
        with sdpa_context():
            self.prefill(self.model, x, input_pos, Sampling())


def run_block(layer, x: Tensor, rope: Tensor, mask: Tensor, slots: Tensor) -> Tensor:
    """One transformer block: the region compile_engine compiles once and runs for every layer."""
    return layer(x, rope, mask, slots)


def sample_last(model: Transformer, h: Tensor, sampling: Sampling):
    """The final norm, the output layer and sampling on the last position of h [B, T, dim]."""
    return sample(model.output(model.norm(h[:, -1])), sampling)


@functools.cache
def configure_compiler(device: str):
    """The process-wide inductor and dynamo settings every engine relies on, applied once per process."""
    import torch._inductor.config as inductor_config
    cuda = device.startswith("cuda")
    inductor_config.fx_graph_cache = True  # a second run of the same model reuses the compiled kernels
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


def compile_engine(model: Transformer, device: str, mode: str = "auto", compile_prefill: bool = False) -> Engine:
    """The engine for `model` in compile `mode`: the one-token decode (static shape [B, 1]), the verification forward
    (one static shape per tree size) and, with compile_prefill, the prefill (dynamic in the prompt length).
    regional: one compiled TransformerBlock runs every layer (weights and cache are graph inputs), shared by all
    models of its shape; whole: the model as one graph, weights frozen in on CPU (a graph per model), CUDA graphs on
    GPU; autotune: whole, every matmul shape timed by max-autotune. docs/compilation.md explains the choice."""
    mode = resolve_mode(mode, device, model.args.n_layer)
    if mode == "none":
        return Engine(model)
    configure_compiler(device)
    if mode == "regional":
        return compile_regions(model, compile_prefill)
    options = graph_options(model, device, mode)
    engine = Engine(model, mode, options=options)
    engine.decode_one_token = torch.compile(decode_one_token, fullgraph=True, dynamic=False, **options)
    engine.forward = torch.compile(model, fullgraph=True, dynamic=False, **options)
    if compile_prefill:
        engine.prefill = torch.compile(prefill, fullgraph=True, dynamic=True, **options)
    return engine


def compile_regions(model: Transformer, compile_prefill: bool) -> Engine:
    """compile_engine(mode="regional"): one compiled block shared by all layers, a compiled sampling head."""
    block, head = compiled_region(run_block, False), compiled_region(sample_last, False)

    def decode_step(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling):
        return head(model, model.hidden_states(x, input_pos, block=block), sampling)

    engine = Engine(model, "regional", decode_one_token=unfrozen(decode_step),
                    forward=unfrozen(functools.partial(model, block=block)))
    if compile_prefill:
        engine.prefill = unfrozen(functools.partial(prefill, block=compiled_region(run_block, True)))
    return engine


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


EOS_CHECK_EVERY = 8  # plain decode looks at the host for EOS this often (a device->host sync each time)


def decode_n_tokens(engine: Engine, token: Tensor, pos, n: int, sampling: Sampling,
                    eos_ids: list, stop_at_eos: bool, callback=None) -> list:
    """Plain decoding of up to n tokens after `token` ([B], at position pos: an int or [B]); returns a list of [B]
    tensors. EOS is checked every EOS_CHECK_EVERY tokens (every token when streaming), so the loop rarely waits on
    the device; the caller truncates each row after its first EOS. One static shape [B, 1]: positions are data."""
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
