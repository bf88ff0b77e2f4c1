"""A minimal Llama-family transformer with a static, preallocated KV cache.

Every forward takes explicit per-row RoPE positions and explicit cache slots, so the same
code runs prefill, one-token decode, batched rows at different positions, and token-tree
verification (positions = prefix length + depth, a mask that shows each node its ancestors).
"""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from errors import UserError
from kernels import a8_kernels, attention, f32_linear, pack_weight, packed_linear


LLAMA_FAMILY = ("llama", "mistral")  # the model types whose layers are ours: others differ in norms or attention


def check_llama_family(cfg: dict, source):
    """A config whose model computes what this Llama computes: another architecture (Gemma's norms and embedding
    scale), another activation or a sliding attention window would load into our shapes and give wrong logits."""
    kind = cfg.get("model_type")
    if kind is not None and kind not in LLAMA_FAMILY:
        raise UserError(f"{source}: model_type {kind!r} is not one this Llama runs ({', '.join(LLAMA_FAMILY)}): "
                        f"its layers compute something else; use a Llama-family checkpoint")
    act = cfg.get("hidden_act", cfg.get("hidden_activation"))
    if act is not None and act not in ("silu", "swish"):
        raise UserError(f"{source}: hidden_act {act!r}: this Llama's feed-forward is SwiGLU (silu); use a checkpoint "
                        f"trained with it")
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if isinstance(window, int) and not isinstance(window, bool) and cfg.get("use_sliding_window", True) \
            and (context is None or window < context):
        raise UserError(f"{source}: attention slides over {window} tokens, this Llama attends to the whole context: "
                        f"set max_position_embeddings to {window} (exact within the window) or remove "
                        f"sliding_window")


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1  # key/value heads (grouped-query attention); -1 means n_head
    head_dim: int = 0  # 0 means dim // n_head
    intermediate_size: int = 0  # 0 means the Llama rule from dim
    vocab_size: int = 32000
    block_size: int = 2048  # max positions the model was trained for
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None  # Hugging Face form, e.g. {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = 1
    eos_token_ids: list = field(default_factory=lambda: [2])

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head
        if not self.intermediate_size:
            hidden = int(2 * 4 * self.dim / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.n_head % self.n_local_heads:
            raise UserError(f"config: num_attention_heads={self.n_head} is not a multiple of "
                            f"num_key_value_heads={self.n_local_heads}: fix config.json")

    @classmethod
    def from_hf_config(cls, cfg: dict, source="config.json") -> "ModelArgs":
        """The shape from a Hugging Face config; a missing key or an impossible value is a UserError naming it."""
        if not isinstance(cfg, dict):
            raise UserError(f"{source} is not a JSON object: re-download or re-convert the checkpoint")
        sizes = {"hidden_size": 2**17, "num_hidden_layers": 4096, "num_attention_heads": 4096,
                 "intermediate_size": 2**20, "vocab_size": 2**24}
        optional = {"num_key_value_heads": 4096, "head_dim": 2**14, "max_position_embeddings": 2**24}
        for key, limit in list(sizes.items()) + list(optional.items()):
            value = cfg.get(key)
            if value is None and key in optional:
                continue
            if value is None:
                raise UserError(f"{source} has no '{key}': copy the model's own config.json beside the checkpoint")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise UserError(f"{source}: '{key}' is {value!r}, not an integer in [1, {limit}]: fix config.json")
        n_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if cfg["num_attention_heads"] % n_kv:
            raise UserError(f"{source}: num_attention_heads={cfg['num_attention_heads']} is not a multiple of "
                            f"num_key_value_heads={n_kv}: fix config.json")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if head_dim % 2 or not head_dim:  # RoPE turns pairs of dimensions: an odd width fails at the first forward
            raise UserError(f"{source}: the head width is {head_dim} ('head_dim', else hidden_size / "
                            f"num_attention_heads), not a positive even number: fix config.json")
        tied = cfg.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):  # "false" would be true to bool(): the file's output layer silently dropped
            raise UserError(f"{source}: 'tie_word_embeddings' is {tied!r}, not true or false: fix config.json")
        check_llama_family(cfg, source)
        # transformers >= 5 writes `rope_parameters` (holding rope_theta too) instead of rope_scaling
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise UserError(f"{source}: 'rope_scaling' is {rope!r}, not an object: fix config.json")
        rope = dict(rope)
        rope_base = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        for key, value in (("rope_theta", rope_base), ("rms_norm_eps", cfg.get("rms_norm_eps", 1e-5))):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise UserError(f"{source}: '{key}' is {value!r}, not a positive number: fix config.json")
        kind = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if kind == "default" else rope
        if rope_scaling is not None:
            check_rope_scaling(rope_scaling, source)
        eos = cfg.get("eos_token_id", 2)
        for key, ids in (("bos_token_id", [cfg.get("bos_token_id")]),
                         ("eos_token_id", eos if isinstance(eos, (list, tuple)) else [eos])):
            # bounded as vocab_size is: a larger id matches no token, and past 2^63 no tensor holds it
            if not all(i is None or (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**24) for i in ids):
                raise UserError(f"{source}: '{key}' is {cfg.get(key)!r}, not a token id (an integer in [0, 2^24)) or "
                                f"a list of them: fix config.json")
        return cls(
            dim=cfg["hidden_size"],
            n_layer=cfg["num_hidden_layers"],
            n_head=cfg["num_attention_heads"],
            n_local_heads=n_kv,
            head_dim=cfg.get("head_dim") or 0,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            block_size=cfg.get("max_position_embeddings", 2048),
            rope_base=float(rope_base),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=tied,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []),
        )

    def to_hf_config(self) -> dict:
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.dim, "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head, "num_key_value_heads": self.n_local_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.block_size,
            "rope_theta": self.rope_base, "rms_norm_eps": self.norm_eps,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        }

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """Known shapes, matched by the longest table key contained in `name` (case-insensitive)."""
        lowered = name.lower()
        matches = [key for key in KNOWN_CONFIGS if key.lower() in lowered]
        if not matches:
            raise UserError(
                f"unknown model '{name}': add a Hugging Face config.json beside the checkpoint, "
                f"or use one of: {', '.join(KNOWN_CONFIGS)}")
        config = dict(KNOWN_CONFIGS[max(matches, key=len)])
        if config.get("rope_scaling"):
            config["rope_scaling"] = dict(config["rope_scaling"])
        return cls(**config)

    @classmethod
    def from_checkpoint_dir(cls, directory) -> "ModelArgs":
        directory = Path(directory)
        config = directory / "config.json"
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise UserError(f"cannot read {config} ({e}): re-download or re-convert the checkpoint") from None
            return cls.from_hf_config(cfg, source=config)
        return cls.from_name(directory.name)


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA32_SCALING = dict(_LLAMA3_SCALING, factor=32.0)
_LLAMA3_TOKENS = dict(vocab_size=128256, bos_token_id=128000, eos_token_ids=[128001, 128008, 128009])

KNOWN_CONFIGS = {
    "stories15M": dict(n_layer=6, n_head=6, dim=288, intermediate_size=768, block_size=256),
    "stories110M": dict(n_layer=12, n_head=12, dim=768, intermediate_size=2048, block_size=1024),
    "TinyLlama-1.1B": dict(n_layer=22, n_head=32, n_local_heads=4, dim=2048, intermediate_size=5632),
    "Llama-2-7b": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=11008, block_size=4096),
    "Llama-2-13b": dict(n_layer=40, n_head=40, dim=5120, intermediate_size=13824, block_size=4096),
    "Llama-2-70b": dict(n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                        block_size=4096),
    "CodeLlama-7b": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=11008, vocab_size=32016,
                         rope_base=1e6, block_size=16384),
    "CodeLlama-34b": dict(n_layer=48, n_head=64, n_local_heads=8, dim=8192, intermediate_size=22016,
                          rope_base=1e6, block_size=16384),
    "Mistral-7B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                       block_size=32768),
    "Meta-Llama-3-8B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                            rope_base=500000.0, block_size=8192, **_LLAMA3_TOKENS),
    "Meta-Llama-3-70B": dict(n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                             rope_base=500000.0, block_size=8192, **_LLAMA3_TOKENS),
    "Llama-3.1-8B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                         rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA3_SCALING,
                         **_LLAMA3_TOKENS),
    "Llama-3.1-70B": dict(n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                          rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA3_SCALING,
                          **_LLAMA3_TOKENS),
    "Llama-3.1-405B": dict(n_layer=126, n_head=128, n_local_heads=8, dim=16384, intermediate_size=53248,
                           rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA3_SCALING,
                           **_LLAMA3_TOKENS),
    "Llama-3.2-1B": dict(n_layer=16, n_head=32, n_local_heads=8, dim=2048, intermediate_size=8192,
                         head_dim=64, rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA32_SCALING,
                         tie_word_embeddings=True, **_LLAMA3_TOKENS),
    "Llama-3.2-3B": dict(n_layer=28, n_head=24, n_local_heads=8, dim=3072, intermediate_size=8192,
                         head_dim=128, rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA32_SCALING,
                         tie_word_embeddings=True, **_LLAMA3_TOKENS),
}


class KVCache(nn.Module):
    """Preallocated keys/values, [batch, kv_heads, max_seq_length, head_dim]; written in place."""

    def __init__(self, batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, slots: Tensor, k: Tensor, v: Tensor):
        return write_cache(self.k_cache, self.v_cache, slots, k, v)


def write_cache(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor):
    """Row b of k, v [B, T, H, D] into the caches [B', H, S, D] at slots[b] ([B, T]); the caches' first B rows."""
    rows = torch.arange(slots.shape[0], device=slots.device).unsqueeze(1)
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v
    return k_cache[:slots.shape[0]], v_cache[:slots.shape[0]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class Linear(nn.Linear):
    """nn.Linear (no bias) whose products of several rows (verification, prefill, batches) can run on a copy of
    the weight packed by oneDNN (kernels.use_fast_weight_layout decides per weight shape); one row keeps F.linear.
    The weight stays the parameter: state dicts, tied weights and sharding see nothing else. For stored graphs
    (kernels.use_stored_layout) the weight is replaced by pack_f32's blocks, which every product then reads."""
    packed: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None:  # use_blocks: the blocks are the weight
            return f32_linear(x, self.blocks, self.out_features)
        # a frozen graph (decode's whole graphs on CPU) multiplies with inductor's own kernels on weights it packs
        # itself, so it traces F.linear (inductor's config is read only once compiling has imported it)
        if self.packed is not None and x.numel() > x.shape[-1] \
                and not (torch.compiler.is_compiling() and torch._inductor.config.freezing):
            return packed_linear(x, self.packed)
        return F.linear(x, self.weight)

    def pack(self):
        self.packed = pack_weight(self.weight)

    def use_blocks(self, blocks: Tensor):
        """Multiply with kernels_a8.cpp's f32_linear on `blocks` (kernels.pack_f32 of the weight) from now on; the
        weight itself is let go (a tied one lives on in the module it is tied to)."""
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_parameter("weight", None)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        q_size, kv_size = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=False)
        self.wo = Linear(q_size, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, slots: Tensor, cache: Optional[tuple] = None) -> Tensor:
        """cache: (keys, values) tensors to use instead of the layer's own KV cache (a stored graph's inputs)."""
        B, T, _ = x.shape
        n_q, n_kv = self.n_head, self.n_local_heads  # per-shard counts under tensor parallelism
        q, k, v = self.wqkv(x).split([n_q * self.head_dim, n_kv * self.head_dim, n_kv * self.head_dim], dim=-1)
        q = apply_rope(q.view(B, T, n_q, self.head_dim), rope)
        k = apply_rope(k.view(B, T, n_kv, self.head_dim), rope)
        v = v.view(B, T, n_kv, self.head_dim)
        keys, values = self.kv_cache.update(slots, k, v) if cache is None else write_cache(*cache, slots, k, v)
        # grouped-query attention without copying the cache: fold the query heads of a group into
        # the sequence dimension, [B, n_kv, group * T, D] (the mask rows are shared within a group)
        group = n_q // n_kv
        q = q.view(B, T, n_kv, group, self.head_dim).permute(0, 2, 3, 1, 4).reshape(B, n_kv, group * T, -1)
        y = attention(q, keys, values, mask)
        y = y.view(B, n_kv, group, T, self.head_dim).permute(0, 3, 1, 2, 4).reshape(B, T, n_q * self.head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = Linear(args.dim, args.intermediate_size, bias=False)
        self.w3 = Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)
        self.w13 = None  # w1 and w3 stacked as one product (quantize.fuse_gate_up, made at load time)

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, mask, slots, cache=None):
        h = x + self.attention(self.attention_norm(x), rope, mask, slots, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None):
        """Allocate the KV cache and RoPE table once; nothing is reallocated per token."""
        if self.max_batch_size >= max_batch_size and self.max_seq_length >= max_seq_length:
            return
        if self.tok_embeddings.weight.device.type == "cpu":
            a8_kernels()  # built (once per source) before a graph traces attention, which cannot build it
        dtype = dtype or self.norm.weight.dtype  # the activations' (an int8 embedding table is cast to it)
        device = self.tok_embeddings.weight.device
        for layer in self.layers:
            attn = layer.attention
            attn.kv_cache = KVCache(max_batch_size, max_seq_length, attn.n_local_heads, attn.head_dim, dtype).to(device)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        positions = max(max_seq_length, self.args.block_size)
        table = getattr(self, "rope_table", None)
        if table is None or table.shape[0] < positions or table.device != device:  # kept otherwise: a new table
            # object would make every compiled graph that reads it (its guards check the object) compile again
            self.register_buffer("rope_table", precompute_rope(self.args, positions).to(device), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, block=None, caches: Optional[list] = None) -> Tensor:
        """idx, input_pos: [B, T] token ids and their RoPE positions.
        slots: [B, T] cache slots to write (default: input_pos).
        mask: [B, 1, T, max_seq_length] bool, True where a query may attend to a cache slot
        (default: causal over slots, i.e. every slot <= the query's own).
        block(layer, x, rope, mask, slots) runs one layer (default: the layer itself); decode.compile_engine
        passes one compiled function that serves every layer. caches: one (keys, values) per layer in place of the
        layers' own KV caches (a stored graph takes them as inputs, so one graph serves every cache length).
        Returns the logits [B, T, V]."""
        return self.output(self.norm(self.run_layers(idx, input_pos, slots, mask, block, caches=caches)[0]))

    def hidden_states(self, idx: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None,
                      mask: Optional[Tensor] = None, block=None) -> Tensor:
        """The last block's output [B, T, dim], before the final norm and the output layer."""
        return self.run_layers(idx, input_pos, slots, mask, block)[0]

    def forward_features(self, idx: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None,
                         mask: Optional[Tensor] = None, layers: tuple = (), block=None, caches: Optional[list] = None):
        """forward()'s logits [B, T, V] and the inputs of the blocks `layers`, concatenated [B, T, len(layers) * dim]:
        the features a draft head reads (EAGLE-3, Li et al. 2025: low, middle and high layers)."""
        h, features = self.run_layers(idx, input_pos, slots, mask, block, layers, caches)
        return self.output(self.norm(h)), features

    def run_layers(self, idx: Tensor, input_pos: Tensor, slots: Optional[Tensor], mask: Optional[Tensor], block,
                   capture: tuple = (), caches: Optional[list] = None):
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        if slots is None:
            slots = input_pos
        if mask is None:
            cache_slots = torch.arange(self.max_seq_length, device=idx.device)
            mask = (cache_slots.view(1, 1, 1, -1) <= slots.unsqueeze(1).unsqueeze(-1))  # [B, 1, T, S]
        rope = self.rope_table[input_pos]  # [B, T, head_dim / 2, 2]
        x = self.tok_embeddings(idx).to(self.norm.weight.dtype)  # [B, T, dim] (an int8 table gives float32 rows)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(x)
            if caches is not None:
                x = layer(x, rope, mask, slots, caches[i])
            else:
                x = layer(x, rope, mask, slots) if block is None else block(layer, x, rope, mask, slots)
        return x, (torch.cat(captured, -1) if captured else None)

    def model_bytes(self) -> int:
        """Bytes of weights read per decoded token (parameters and quantization buffers)."""
        tensors = {id(t): t for t in list(self.parameters()) + [b for n, b in self.named_buffers()
                                                                if "cache" not in n and "rope" not in n]}
        return sum(t.numel() * t.element_size() for t in tensors.values())


ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: dict, source="config.json"):
    """A RoPE scaling this model implements, with every number it reads."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:  # a list or object cannot even be looked up
        raise UserError(f"{source}: rope_scaling type {kind!r} is not supported (supported: default, "
                        f"{', '.join(ROPE_SCALING_KEYS)})")
    for key in ROPE_SCALING_KEYS[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise UserError(f"{source}: rope_scaling '{key}' is {value!r}, not a positive number "
                            f"({kind} scaling needs {', '.join(ROPE_SCALING_KEYS[kind])}): fix config.json")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise UserError(f"{source}: rope_scaling 'high_freq_factor' must be larger than 'low_freq_factor': "
                        f"fix config.json")


def rope_inverse_frequencies(args: ModelArgs) -> Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1 frequency rescaling: long wavelengths slowed by `factor`, short ones kept,
        # a smooth blend between low_freq_factor and high_freq_factor
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    raise UserError(f"rope_scaling type '{kind}' is not supported (supported: default, linear, llama3)")


def precompute_rope(args: ModelArgs, positions: int) -> Tensor:
    """cos/sin table [positions, head_dim // 2, 2], float32, as Hugging Face computes it."""
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), rope_inverse_frequencies(args))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def halves_to_pairs(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """q/k projection rows from Hugging Face's RoPE layout (rotates (i, i + head_dim/2)) to this model's (rotates
    interleaved pairs (2i, 2i+1)): each head's rows reordered."""
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(n_heads * head_dim, -1)


def pairs_to_halves(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """halves_to_pairs() undone."""
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(n_heads * head_dim, -1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # rotate each pair (x[2i], x[2i+1]) by the angle of position * frequency_i (RoFormer, Su et al.)
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    rope = rope.unsqueeze(2)  # [B, T, 1, D/2, 2]
    out = torch.stack([xf[..., 0] * rope[..., 0] - xf[..., 1] * rope[..., 1],
                       xf[..., 1] * rope[..., 0] + xf[..., 0] * rope[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)
