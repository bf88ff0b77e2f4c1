"""Draft heads: one transformer layer that drafts the target's next tokens from the target's own hidden states
(EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025), stored in EAGLE-3's published checkpoint format.

The head's entry at cache slot p reads the target's features at p - 1 (the inputs of a low, a middle and a high block,
fused by `fc`) and the embedding of token p, and predicts token p + 1. While drafting, a drafted token's entry reads
the head's own output at the slot before in place of the target's features, as EAGLE-3 trains it ("training-time
test": scripts/train_draft_head.py). Its output layer covers only the draft vocabulary, the tokens the target uses
most (FR-Spec, Zhao et al. 2025); `token_ids` maps them to the target's ids. The loop and the verifier are
speculate.py's: a head is one more Drafter, lossless like the others.
"""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from decode import Sampling, logits_to_probs, sample_from, sdpa_context
from draftmodel import sampled_candidates, tree_width
from errors import UserError
from model import (Attention, FeedForward, KVCache, Linear, RMSNorm, Transformer, check_rope_scaling, halves_to_pairs,
                   pairs_to_halves, precompute_rope)
from speculate import Tree

WEIGHTS, CONFIG = "model.safetensors", "config.json"


@dataclass
class HeadArgs:
    dim: int  # the target's width: the head reads the target's token embeddings
    n_head: int
    n_local_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layers: tuple = ()  # blocks whose inputs are the features (EAGLE-3: 2, n // 2, n - 3)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    trained_for: dict = field(default_factory=dict)  # what trained it (target file, data, steps): for the reader

    @classmethod
    def for_target(cls, target: Transformer, draft_vocab_size: int) -> "HeadArgs":
        """A head shaped like one of the target's blocks (EAGLE-3's choice), reading its low, middle and high layers."""
        a = target.args
        n = a.n_layer
        layers = tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))
        return cls(a.dim, a.n_head, a.n_local_heads, a.head_dim, a.intermediate_size, a.vocab_size,
                   draft_vocab_size, layers, a.norm_eps, a.rope_base, dict(a.rope_scaling) if a.rope_scaling else None)

    def to_config(self) -> dict:
        """EAGLE-3's config.json keys (what vLLM, SGLang and the EAGLE repository read), plus our own."""
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": self.dim,
                "num_attention_heads": self.n_head, "num_key_value_heads": self.n_local_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_base, "rope_scaling": self.rope_scaling,
                "hidden_act": "silu", "torch_dtype": "float32",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layers)},
                "trained_for": self.trained_for}

    @classmethod
    def from_config(cls, cfg: dict, target: Transformer, source) -> "HeadArgs":
        """The head's shape from its config.json, checked against the target it drafts for."""
        if not isinstance(cfg, dict):
            raise UserError(f"{source} is not a JSON object: use a draft head's config.json")
        a = target.args
        values = {}
        for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**20:
                raise UserError(f"{source}: '{key}' is {value!r}, not a positive integer: use a draft head's "
                                f"config.json")
            values[key] = value
        dim, n_head = values["hidden_size"], values["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_head
        head_dim = cfg.get("head_dim") or dim // n_head
        vocab = cfg.get("vocab_size", a.vocab_size)
        draft_vocab = cfg.get("draft_vocab_size") or vocab
        if dim != a.dim:
            raise UserError(f"{source}: the head's hidden_size {dim} is not the target's {a.dim}: this head was "
                            f"trained for another model; train one with scripts/train_draft_head.py")
        if vocab != a.vocab_size:
            raise UserError(f"{source}: the head's vocab_size {vocab} is not the target's {a.vocab_size}: this head "
                            f"was trained for another model")
        for key, value in (("num_key_value_heads", n_kv), ("head_dim", head_dim), ("draft_vocab_size", draft_vocab)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**24:
                raise UserError(f"{source}: '{key}' is {value!r}, not a positive integer")
        if n_head % n_kv or draft_vocab > vocab:
            raise UserError(f"{source}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}, "
                            f"or draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
        eagle = cfg.get("eagle_config") or {}
        n = a.n_layer
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        layers = layers or sorted({min(2, n - 1), n // 2, max(n - 3, 0)})  # EAGLE-3's default
        if not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < n for i in layers):
            raise UserError(f"{source}: eagle_aux_hidden_state_layer_ids {layers!r} are not layers of the target "
                            f"(0..{n - 1})")
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None:
            if not isinstance(rope_scaling, dict):
                raise UserError(f"{source}: 'rope_scaling' is {rope_scaling!r}, not an object")
            if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
                rope_scaling = None
            else:
                check_rope_scaling(rope_scaling, source)
        eps, base = cfg.get("rms_norm_eps", a.norm_eps), cfg.get("rope_theta", a.rope_base)
        for key, value in (("rms_norm_eps", eps), ("rope_theta", base)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise UserError(f"{source}: '{key}' is {value!r}, not a positive number")
        trained = cfg.get("trained_for") if isinstance(cfg.get("trained_for"), dict) else {}
        return cls(dim, n_head, n_kv, head_dim, values["intermediate_size"], vocab, draft_vocab, tuple(layers),
                   float(eps), float(base), rope_scaling, trained)


class DraftHead(nn.Module):
    """EAGLE-3's draft layer: h = fc(features) (or the head's own previous output), x = [norm(embedding(token)),
    norm(h)] (2 * dim), h + attention(x), then the block's MLP; logits over the draft vocabulary from norm(output)."""

    def __init__(self, args: HeadArgs):
        super().__init__()
        self.args = args
        self.fc = Linear(len(args.target_layers) * args.dim, args.dim, bias=False)
        self.input_norm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        # a target block's attention, reading the 2 * dim concatenation, writing dim
        self.attention = Attention(SimpleNamespace(n_head=args.n_head, n_local_heads=args.n_local_heads,
                                                   head_dim=args.head_dim, dim=2 * args.dim))
        self.attention.wo = Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.post_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(SimpleNamespace(dim=args.dim, intermediate_size=args.intermediate_size))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.draft_vocab_size, bias=False)
        self.register_buffer("token_ids", torch.arange(args.draft_vocab_size))  # draft id -> target id
        self.embeddings: Optional[nn.Embedding] = None  # the target's (attach()): not the head's to store
        self.max_batch_size = self.max_seq_length = -1
        self.positions = 0
        self.compiled = None  # body() compiled or stored (compilation.compile_head); None: eager
        self.checkpoint_path, self.quantization = None, None  # its weights file and scheme (load_head)

    def attach(self, target: Transformer) -> "DraftHead":
        self.__dict__["embeddings"] = target.tok_embeddings  # a plain attribute: not in the head's state dict
        self.positions = target.args.block_size  # its RoPE table's length (longer if a cache asks for more)
        return self

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if self.max_batch_size >= max_batch_size and self.max_seq_length >= max_seq_length:
            return
        weight = self.norm.weight  # float even where the linear layers are int8
        self.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.args.n_local_heads,
                                          self.args.head_dim, weight.dtype).to(weight.device)
        table, positions = getattr(self, "rope_table", None), max(max_seq_length, self.positions)
        if table is None or table.shape[0] < positions or table.device != weight.device:  # kept otherwise: a new
            # table object makes a graph compiled in the process (its guards check the object) compile again
            self.register_buffer("rope_table", precompute_rope(self.args, positions).to(weight.device),
                                 persistent=False)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def fuse(self, features: Tensor) -> Tensor:
        """The target's features [..., len(target_layers) * dim] -> the head's input [..., dim]."""
        return self.fc(features)

    def forward(self, hidden: Tensor, tokens: Tensor, input_pos: Tensor, slots: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        """hidden [B, T, dim] (fuse()d features, or the head's outputs at the slots before), tokens, input_pos [B, T]:
        the head's outputs [B, T, dim] (logits() of them predict the next tokens). Writes the head's cache at `slots`
        (default input_pos); mask [B, 1, T, S] (default: slots 1 ..  the query's own; slot 0 is never written)."""
        if slots is None:
            slots = input_pos
        if mask is None:
            cache_slots = torch.arange(self.max_seq_length, device=tokens.device).view(1, 1, 1, -1)
            mask = (cache_slots <= slots.unsqueeze(1).unsqueeze(-1)) & (cache_slots > 0)  # [B, 1, T, S]
        embedded = self.embeddings(tokens).to(hidden.dtype)
        return (self.compiled or self.body)(embedded, hidden, input_pos, slots, mask)

    def body(self, embedded: Tensor, hidden: Tensor, input_pos: Tensor, slots: Tensor, mask: Tensor,
             cache: Optional[tuple] = None) -> Tensor:
        """forward() from the tokens' embeddings on: what compilation.compile_head compiles (the target's embedding table
        stays outside the head's graphs); cache: (keys, values) in place of the head's own (a stored graph's inputs)."""
        x = torch.cat([self.input_norm(embedded), self.hidden_norm(hidden)], -1)
        h = hidden + self.attention(x, self.rope_table[input_pos], mask, slots, cache)
        return h + self.feed_forward(self.post_norm(h))

    def logits(self, h: Tensor) -> Tensor:
        """Logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.output(self.norm(h))


# ----------------------------------------------------------------------------- EAGLE-3's checkpoint format

NAMES = {"fc.weight": "fc.weight", "midlayer.input_layernorm.weight": "input_norm.weight",
         "midlayer.hidden_norm.weight": "hidden_norm.weight", "midlayer.self_attn.o_proj.weight": "attention.wo.weight",
         "midlayer.post_attention_layernorm.weight": "post_norm.weight",
         "midlayer.mlp.gate_proj.weight": "feed_forward.w1.weight",
         "midlayer.mlp.up_proj.weight": "feed_forward.w3.weight",
         "midlayer.mlp.down_proj.weight": "feed_forward.w2.weight", "norm.weight": "norm.weight",
         "lm_head.weight": "output.weight"}
QKV = ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight")


def to_eagle3(head: DraftHead) -> dict:
    """The head's tensors under EAGLE-3's names and RoPE layout; d2t / t2d as EAGLE-3 maps vocabularies."""
    a, ours = head.args, head.state_dict()
    out = {theirs: ours[name].contiguous() for theirs, name in NAMES.items()}
    q, k, v = ours["attention.wqkv.weight"].split([a.n_head * a.head_dim, a.n_local_heads * a.head_dim,
                                                   a.n_local_heads * a.head_dim])
    out[QKV[0]] = pairs_to_halves(q, a.n_head, a.head_dim).contiguous()
    out[QKV[1]] = pairs_to_halves(k, a.n_local_heads, a.head_dim).contiguous()
    out[QKV[2]] = v.contiguous()
    ids = head.token_ids.long()
    out["d2t"] = ids - torch.arange(len(ids))  # target id = draft id + d2t[draft id]
    out["t2d"] = torch.zeros(a.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def from_eagle3(tensors: dict, args: HeadArgs, source) -> dict:
    """EAGLE-3's tensors -> this head's state dict; a missing or misshapen tensor is one line naming it."""
    missing = [name for name in list(NAMES) + list(QKV) if name not in tensors]
    if missing:
        raise UserError(f"{source} has no tensor {missing[0]}: not an EAGLE-3 draft head")
    a = args
    shapes = {"fc.weight": (a.dim, len(a.target_layers) * a.dim), "lm_head.weight": (a.draft_vocab_size, a.dim),
              QKV[0]: (a.n_head * a.head_dim, 2 * a.dim), QKV[1]: (a.n_local_heads * a.head_dim, 2 * a.dim),
              QKV[2]: (a.n_local_heads * a.head_dim, 2 * a.dim), "midlayer.mlp.down_proj.weight":
                  (a.dim, a.intermediate_size), "midlayer.self_attn.o_proj.weight": (a.dim, a.n_head * a.head_dim)}
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, not {shape} (its config.json "
                            f"and the target's {len(a.target_layers)} feature layers)")
    for name, t in tensors.items():
        if name != "d2t" and name != "t2d" and not t.dtype.is_floating_point:
            raise UserError(f"{source}: {name} is {t.dtype}, not a float tensor")
    state = {ours: tensors[theirs].float() for theirs, ours in NAMES.items()}
    state["attention.wqkv.weight"] = torch.cat([halves_to_pairs(tensors[QKV[0]].float(), a.n_head, a.head_dim),
                                                halves_to_pairs(tensors[QKV[1]].float(), a.n_local_heads, a.head_dim),
                                                tensors[QKV[2]].float()])
    ids = torch.arange(a.draft_vocab_size)
    if "d2t" in tensors:
        d2t = tensors["d2t"]
        if tuple(d2t.shape) != (a.draft_vocab_size,) or d2t.dtype.is_floating_point:
            raise UserError(f"{source}: d2t must be {a.draft_vocab_size} integers")
        ids = ids + d2t.long()
    elif a.draft_vocab_size != a.vocab_size:
        raise UserError(f"{source} has no d2t, which a draft vocabulary smaller than the target's needs")
    if ids.min() < 0 or ids.max() >= a.vocab_size or len(set(ids.tolist())) != len(ids):
        raise UserError(f"{source}: d2t maps draft tokens outside the target's {a.vocab_size} ids (or twice onto one)")
    state["token_ids"] = ids
    return state


def save_head(head: DraftHead, directory: Path):
    """model.safetensors and config.json into `directory`, as one set: a failure leaves the directory as it was."""
    from safetensors.torch import save_file
    from errors import write_files_atomically
    tensors = to_eagle3(head)
    write_files_atomically(directory, {
        WEIGHTS: lambda tmp: save_file(tensors, str(tmp)),
        CONFIG: lambda tmp: tmp.write_text(json.dumps(head.args.to_config(), indent=1) + "\n")})


def load_head(path, target: Transformer, int8: bool = True) -> DraftHead:
    """A draft head for `target` from a directory holding config.json and model.safetensors (EAGLE-3's format; our
    trained heads are written in it), on the target's device and dtype. On the CPU its linear layers run int8
    (int8=True, where kernels_a8.cpp builds): a head step reads its weights once per drafted token, and at a quarter
    of the bytes it costs a fraction of a target step (BENCHMARKS.md); the drafts change a little, the output not at
    all (speculation is lossless for any draft)."""
    from safetensors import SafetensorError, safe_open
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config, weights = directory / CONFIG, (path if path.is_file() else directory / WEIGHTS)
    if not config.is_file() or not weights.is_file():
        raise UserError(f"`draft_head` {path}: needs {CONFIG} and {WEIGHTS} (a directory written by "
                        f"scripts/train_draft_head.py, or an EAGLE-3 head)")
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"cannot read {config} ({e}): re-download or re-train the head") from None
    args = HeadArgs.from_config(cfg, target, config)
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"cannot read {weights} ({e}): re-download or re-train the head") from None
    state = from_eagle3(tensors, args, weights)
    head = DraftHead(args)
    head.load_state_dict(state)
    weight = target.tok_embeddings.weight
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    head = head.to(device=weight.device, dtype=dtype).attach(target).requires_grad_(False)
    if int8 and weight.device.type == "cpu":
        quantize_head(head)
    head.checkpoint_path = weights  # what keys its stored graphs (compilation.compile_head)
    return head


def quantize_head(head: DraftHead):
    """The head's linear layers as weight-only int8 (quantize.py's scheme and CPU kernel), where that kernel builds."""
    import kernels
    import quantize
    if not kernels.a8_kernels():
        return
    for name, linear in [(n, m) for n, m in head.named_modules() if isinstance(m, nn.Linear)]:
        layer = quantize.Int8Linear(linear.in_features, linear.out_features)
        layer.weight, layer.scales = quantize.quantize_int8(linear.weight.detach())
        parent, _, child = name.rpartition(".")
        setattr(head.get_submodule(parent) if parent else head, child, layer)
    head.quantization = "int8"
    quantize.pack_for_device(head)  # the target's layout: w1 and w3 stacked, the CPU kernel's weight layout


# ----------------------------------------------------------------------------- the head as a drafter

def draft_distribution(logits: Tensor, ids: Tensor, vocab_size: int, sampling: Sampling):
    """Draft tokens [rows] (target ids) from head logits [rows, Vd] and, at temperature > 0, the distribution they were
    drawn from over the target's vocabulary [rows, V] (zero outside the draft vocabulary)."""
    if sampling.temperature == 0:
        return ids[logits.argmax(-1)], None
    q = logits_to_probs(logits, sampling)  # [rows, Vd]
    drawn = sample_from(q)
    full = q.new_zeros(q.shape[0], vocab_size).scatter_(1, ids.expand(q.shape[0], -1), q)
    return ids[drawn], full


class HeadDrafter:
    """Drafts with a DraftHead: first the entries of the tokens the target accepted since the last step (their features
    came with the verification), then one head forward per depth. A chain feeds back its one token; a tree (tree_nodes
    > depth) is EAGLE-2's dynamic tree (Li et al. 2024): every depth expands the `width` newest nodes of highest path
    score by their `width` best children (sampled: drawn without replacement), and the tree_nodes best are kept."""

    def __init__(self, head: DraftHead, depth: int, tree_nodes: Optional[int] = None):
        self.head, self.depth, self.tree_nodes = head, depth, tree_nodes or depth
        self.width = tree_width(depth, self.tree_nodes)
        self.features = head.args.target_layers
        # verification writes tree_nodes + 1 target slots; the head's padded catch-up reaches depth + 1 past the
        # last root, its chain or tree (depth - 1) * width past the new one
        self.lookahead = max(self.tree_nodes, (depth - 1) * self.width) + depth + 3
        self.device = head.norm.weight.device
        self.pending = []  # per row: pieces of target features [n, F] of the n positions before its current token

    @property
    def kind(self) -> str:
        return "head" if self.width == 1 else "head-tree"

    def start(self, prompts: list, max_seq_length: int, features: Optional[Tensor] = None) -> int:
        self.head.setup_caches(len(prompts), max_seq_length)
        self.pending = [[features[b, :len(p)]] for b, p in enumerate(prompts)]
        return 0

    def finish(self, outs: list):
        pass

    def catch_up(self, pos: list, contexts: list) -> Tensor:
        """Write each row's pending entries (slots up to its root) in one forward; the head's output at the root
        [B, dim]. The padding after a shorter row's entries lands on slots that drafting writes before reading."""
        head, device, batch = self.head, self.device, len(pos)
        some = next(p for p in self.pending if p)[0]
        self.pending = [torch.cat(p) if p else some[:0] for p in self.pending]  # a finished row: nothing (it idles)
        n = [len(p) for p in self.pending]
        width = max(n)
        features = torch.zeros(batch, width, some.shape[-1], dtype=some.dtype, device=device)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        for b, (pending, p, context) in enumerate(zip(self.pending, pos, contexts)):
            features[b, :len(pending)] = pending
            tokens[b, :len(pending)] = torch.tensor(context[p - len(pending) + 1:p + 1])
        slots = (torch.tensor(pos).view(-1, 1) - torch.tensor(n).view(-1, 1) + 1 + torch.arange(width)).to(device)
        h = head(head.fuse(features), tokens.to(device), slots)  # [B, width, dim]
        self.pending = [[] for _ in range(batch)]
        return h[torch.arange(batch, device=device), torch.tensor(n, device=device) - 1]

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling, nodes=None):
        nodes = nodes or self.tree_nodes
        with sdpa_context():
            h = self.catch_up(pos, contexts)
            if nodes > depth:
                return self.draft_tree(roots, pos, depth, h, sampling, tree_width(depth, nodes), nodes), depth
            head, drafted, proposals = self.head, [], []
            at = torch.tensor(pos, device=self.device)
            for d in range(1, depth + 1):
                token, q = draft_distribution(head.logits(h), head.token_ids, head.args.vocab_size, sampling)
                drafted.append(token)
                proposals.append(q)
                if d < depth:
                    h = head(h.unsqueeze(1), token.view(-1, 1), (at + d).view(-1, 1))[:, 0]
        trees = []
        for b, (root, p, row) in enumerate(zip(roots, pos, torch.stack(drafted, 1).tolist())):
            tree = Tree.rooted_at(root, p)
            for d, token in enumerate(row, 1):
                tree.add(token, d - 1, proposals[d - 1][b] if proposals[d - 1] is not None else None)
            trees.append(tree)
        return trees, depth

    def children(self, h: Tensor, sampling: Sampling, width: int):
        """The `width` children of each row of h [R, dim]: target ids and log-scores [R, width] (sampled: draws
        without replacement in draw order, scored by q's sorted probabilities only, so never by what was drawn),
        whether each is usable, and q over the target's vocabulary [R, V] (None if greedy)."""
        head = self.head
        logits = head.logits(h).float()  # [R, Vd]
        if sampling.temperature == 0:
            top = torch.topk(torch.log_softmax(logits, -1), width, dim=-1)
            return head.token_ids[top.indices], top.values, top.values > -math.inf, None
        q = logits_to_probs(logits, sampling)
        drawn, log_top, _ = sampled_candidates(q, width)
        full = q.new_zeros(q.shape[0], head.args.vocab_size).scatter_(1, head.token_ids.expand(q.shape[0], -1), q)
        return head.token_ids[drawn], log_top.cummin(-1).values, log_top > -math.inf, full

    def draft_tree(self, roots: list, pos: list, depth: int, h: Tensor, sampling: Sampling, width: int,
                   nodes: int) -> list:
        head, device, batch = self.head, self.device, len(roots)
        trees = [Tree.rooted_at(root, p) for root, p in zip(roots, pos)]
        scores = [[0.0] for _ in roots]
        outputs = [{0: h[b]} for b in range(batch)]  # node -> its entry's output, which its children's entries read
        frontiers, per_row = [[0] for _ in roots], 1  # the nodes whose children come next; rows of kids per batch row
        kids = self.children(h, sampling, width)
        for d in range(1, depth + 1):
            tokens, logs, usable, q = kids[0].tolist(), kids[1].tolist(), kids[2].tolist(), kids[3]
            newest = [[] for _ in roots]
            for b, frontier in enumerate(frontiers):
                for j, parent in enumerate(frontier):
                    r = b * per_row + j
                    for token, score, ok in zip(tokens[r], logs[r], usable[r]):
                        if ok:
                            newest[b].append(trees[b].add(token, parent, q[r] if q is not None else None))
                            scores[b].append(scores[b][parent] + score)
            if d == depth:
                break
            # the next frontier: the `width` best newest nodes; rows padded with copies of their last (the root if none)
            frontiers = [sorted(nodes, key=lambda i: -s[i])[:width] for nodes, s in zip(newest, scores)]
            rows = [nodes + (nodes[-1:] or [0]) * (width - len(nodes)) for nodes in frontiers]
            base = [p + 1 + (d - 1) * width for p in pos]
            for b, row in enumerate(rows):
                for j, n in enumerate(row):
                    trees[b].draft_slots[n] = base[b] + j
            x = torch.tensor([[trees[b].tokens[n] for n in row] for b, row in enumerate(rows)], device=device)
            hidden = torch.stack([torch.stack([outputs[b][max(trees[b].parents[n], 0)] for n in row])
                                  for b, row in enumerate(rows)])  # [B, width, dim]
            slots = torch.tensor(base, device=device).view(-1, 1) + torch.arange(width, device=device)
            mask = torch.cat([self.frontier_mask(trees[b], row, pos[b], base[b]) for b, row in enumerate(rows)])
            input_pos = torch.tensor(pos, device=device).view(-1, 1).expand(batch, width) + d  # the nodes' depth d
            out = head(hidden, x, input_pos, slots, mask.to(device))  # [B, width, dim]
            for b, frontier in enumerate(frontiers):
                outputs[b].update({n: out[b, j] for j, n in enumerate(frontier)})
            kids, per_row = self.children(out.flatten(0, 1), sampling, width), width
        return [self.select(tree, s, nodes) for tree, s in zip(trees, scores)]

    def frontier_mask(self, tree: Tree, frontier: list, pos: int, base: int) -> Tensor:
        """[1, 1, width, S]: node j's entry (slot base + j) sees the real entries 1 .. pos, its ancestors' and its
        own."""
        mask = torch.zeros(len(frontier), self.head.max_seq_length, dtype=torch.bool)
        mask[:, 1:pos + 1] = True
        for j, node in enumerate(frontier):
            mask[j, base + j] = True
            node = tree.parents[node]
            while node > 0:
                mask[j, tree.draft_slots[node]] = True
                node = tree.parents[node]
        return mask.view(1, 1, *mask.shape)

    def select(self, tree: Tree, scores: list, nodes: int) -> Tree:
        """The `nodes` best nodes; ties go to the shallower, then earlier node, so the result is a tree and a node
        keeps a prefix of its draws."""
        keep = sorted(range(1, len(tree.tokens)), key=lambda i: (-scores[i], tree.depths[i], i))[:nodes]
        return tree.subtree(sorted(keep, key=lambda i: (tree.depths[i], i)))

    def accepted(self, paths: list, trees: list, pos: list, features: Optional[Tensor] = None):
        """The target's features at the root and the accepted nodes become the next step's entries."""
        for b, path in enumerate(paths):
            if path is not None:  # after plain steps (no draft since) the entries not yet written add up
                self.pending[b].append(features[b, [0] + path])
