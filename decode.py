"""Decoding with one model: sampling (temperature, top-k, top-p), prefill, one-token decode, the compiled engine.

    engine = compile_engine(model, "cpu", mode="auto", compile_prefill=True)   # or Engine(model) for eager
    first, finite = engine.prefill(model, prompt_ids, positions, Sampling(0.7, top_k=200))
    tokens = decode_n_tokens(engine, first, pos, 100, Sampling(0.7, top_k=200), eos_ids, stop_at_eos=True)
"""
import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from compilation import CompileCache, StoredForward, compiled_region, configure_compiler, graph_options, persisting, \
    resolve_mode, unfrozen
import kernels
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
    """A token of each row of logits [..., V] and the distribution it was drawn from; greedy: the argmax and None
    (no caller needs its one-hot, and building it cost a decode step more than the argmax did)."""
    if sampling.temperature == 0:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, sampling)
    return sample_from(probs), probs


def chosen_is_finite(values: Tensor, tokens: Tensor) -> Tensor:
    """[B] bool: each row's entry at its chosen token (values [B, V]: logits, or probabilities) is finite. Enough to
    catch broken weights: argmax picks a NaN or +inf where a row has one, and NaN logits make every probability NaN
    (a look at every logit costs more than the argmax)."""
    return values.gather(-1, tokens.view(-1, 1)).squeeze(-1) < float("inf")


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
    """x, input_pos: [B, 1]; returns the next token [B] and the distribution it came from [B, V] (greedy: None)."""
    logits = model(x, input_pos)
    return sample(logits[:, -1], sampling)


def move_cache_slots(model: Transformer, src: list, dst: list, rows: Optional[list] = None,
                     from_rows: Optional[list] = None):
    """Copy keys/values of cache slots src -> dst (every layer), slot src[i] of batch row from_rows[i] to slot dst[i]
    of row rows[i] (rows default to row 0, from_rows to rows); all reads happen before any write, so a path can move
    onto slots it is leaving, and two rows can trade their slots in one call."""
    rows = rows if rows is not None else [0] * len(src)
    from_rows = from_rows if from_rows is not None else rows
    moves = [(a, s, b, d) for a, s, b, d in zip(from_rows, src, rows, dst) if (a, s) != (b, d)]
    if not moves:
        return
    device = model.tok_embeddings.weight.device
    from_t, src_t, row_t, dst_t = torch.tensor(moves, device=device).unbind(1)
    for layer in model.layers:
        cache = layer.attention.kv_cache
        cache.k_cache[row_t, :, dst_t] = cache.k_cache[from_t, :, src_t]  # [moves, H, D] per side
        cache.v_cache[row_t, :, dst_t] = cache.v_cache[from_t, :, src_t]


# ----------------------------------------------------------------------------- the engine: how a model runs


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
    features: tuple = ()  # blocks whose inputs forward_features returns beside the logits (a draft head's features)
    forward_features: callable = None  # forward() that also returns those features (Transformer.forward_features)
    cache: object = None  # the CompileCache its callables store their kernels in (modes compiled in the process)
    stored: object = None  # the StoredForward of a stored engine
    # every change to the model's cache outside a forward goes through this (move_cache_slots on the model): with the
    # forwards, the whole of what a tensor-parallel server mirrors on its other ranks (tp.Lockstep)
    move_cache_slots: callable = None

    @property
    def ran_as(self) -> str:
        """The mode that ran: a stored engine none of whose graphs could be stored or loaded here ran them compiled
        in the process ("whole"); stats say so rather than "stored"."""
        graphs = self.stored.graphs.values() if self.stored is not None else ()
        if graphs and all(graph[1] is None for graph in graphs):  # no bind: StoredGraph.in_process
            return "whole"
        return self.mode

    def __post_init__(self):
        if self.forward is None:
            self.forward = self.model
        if self.move_cache_slots is None:
            self.move_cache_slots = functools.partial(move_cache_slots, self.model)
        if self.forward_features is None and self.features:
            self.forward_features = functools.partial(self.model.forward_features, layers=self.features)

    def compile(self, fn):
        """fn(model, ...) as one static-shape graph compiled like this engine's own, the model bound first; eager for
        "none"; None for "regional" (only the block and head are graphs) and stored graphs (one graph of the model):
        step through forward / decode_one_token."""
        if self.mode == "none":
            return functools.partial(fn, self.model)
        if self.mode == "regional" or self.mode.startswith("stored"):
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


def compile_engine(model: Transformer, device: str, mode: str = "auto", compile_prefill: bool = False,
                   features: tuple = ()) -> Engine:
    """The engine for `model` in compile `mode`.
    stored (`auto`, `autotune`): one AOTInductor graph of the whole model per batch and cache batch, dynamic in the
    tokens per call and the cache length, so decode, verification and prefill share it; kernels only (it reads the
    model's own weights); built once, stored beside the checkpoint (StoredForward), loaded by later runs instead of
    compiled.
    regional: one compiled TransformerBlock runs every layer (weights and cache are graph inputs), shared by all
    models of its shape.
    whole: torch.compile in this process: the one-token decode (static shape [B, 1]), the verification forward (one
    static shape per tree size) and, with compile_prefill, the prefill (dynamic in the prompt length); weights frozen
    in on CPU, CUDA graphs on GPU. docs/compilation.md explains the choice.
    features: the blocks whose inputs a draft head reads; forward_features returns them with the logits (stored: the
    one graph returns both, so plain decoding and verification still share it)."""
    mode = resolve_mode(mode, device, getattr(model, "checkpoint_path", None) is not None)
    if mode.startswith("stored"):  # the graphs read the model's own tensors, in the layout their kernels want
        kernels.use_stored_layout(model)
    else:  # eager products and regions run on the model's weights as they are
        kernels.use_fast_weight_layout(model)
    features = tuple(features)
    if mode == "none":
        return Engine(model, features=features)
    if mode.startswith("stored"):  # loading a stored graph imports no compiler (inductor alone takes seconds)
        stored = StoredForward(model, device, mode, features)
        forward = (lambda *args, **kwargs: stored(*args, **kwargs)[0]) if features else stored
        return Engine(model, mode, prefill=dropping_model(prefill, forward),
                      decode_one_token=dropping_model(decode_one_token, forward), forward=forward, features=features,
                      forward_features=stored if features else None, stored=stored)
    configure_compiler(device)
    cache = CompileCache.for_model(model, device, mode)
    if mode == "regional":
        return persisting(compile_regions(model, compile_prefill, features), cache)
    options = graph_options(model, device, mode)
    engine = Engine(model, mode, options=options, features=features)
    if features:  # verification at one width, prefill at many: automatic dynamic shapes
        engine.forward_features = torch.compile(functools.partial(model.forward_features, layers=features),
                                                fullgraph=True, **options)
    engine.decode_one_token = torch.compile(decode_one_token, fullgraph=True, dynamic=False, **options)
    engine.forward = torch.compile(model, fullgraph=True, dynamic=False, **options)
    if compile_prefill:
        engine.prefill = torch.compile(prefill, fullgraph=True, dynamic=True, **options)
    return persisting(engine, cache)


def dropping_model(fn, forward):
    """fn(model, ...) run with `forward` in the model's place (it takes the model's arguments)."""
    return lambda _model, *args, **kwargs: fn(forward, *args, **kwargs)


def compile_regions(model: Transformer, compile_prefill: bool, features: tuple = ()) -> Engine:
    """compile_engine(mode="regional"): one compiled block shared by all layers, a compiled sampling head."""
    block, head = compiled_region(run_block, False), compiled_region(sample_last, False)

    def decode_step(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling):
        return head(model, model.hidden_states(x, input_pos, block=block), sampling)

    prompt_block = compiled_region(run_block, True) if compile_prefill else None  # dynamic in the prompt's length

    def forward_features(x: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None, mask: Optional[Tensor] = None):
        # a prompt (no mask) runs as the prefill does: the static block would compile again for every prompt length
        return model.forward_features(x, input_pos, slots, mask, features, block if mask is not None else prompt_block)

    engine = Engine(model, "regional", decode_one_token=unfrozen(decode_step),
                    forward=unfrozen(functools.partial(model, block=block)), features=features,
                    forward_features=unfrozen(forward_features))
    if compile_prefill:
        engine.prefill = unfrozen(functools.partial(prefill, block=prompt_block))
    return engine


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
