"""The library: a checkpoint (and its draft) loaded into engines, and generation with it. Scripts, tests and servers
import this; generate.py is its command line.

    generator = Generator.build("checkpoints/tiny/target/model.pth", draft_checkpoint_path="checkpoints/tiny/draft/"
                                "model.pth", speculation=Speculation(speculate_k=5), compile="auto")
    rows, stats = generator.generate(generator.encode("def main("), 100, Sampling(temperature=0))

Where a token comes from: generate() prefills the prompt (decode.prefill), then either decodes one token per target
forward (decode.decode_n_tokens) or lets a speculator draft a token tree, verify it in one target forward and rewind
the KV cache to the accepted path (speculate.Speculator; crossdraft for a draft of another tokenizer).
"""
import contextlib
import functools
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

import torch

import artifacts
from compilation import COMPILE_MODES, compile_head, model_key_fields
from decode import EOS_CHECK_EVERY, PRECISIONS, Engine, Sampling, chosen_is_finite, compile_engine, decode_n_tokens, \
    sample, sdpa_context
from draftmodel import ModelDrafter
from errors import (UserError, check_output_file, load_weights, quiet_stderr, read_checkpoint, read_user_text,
                    write_output)
from grammar import Constraint, Grammars, SchemaError, check_schema
from model import ModelArgs, Transformer
from speculate import MAX_AUTO_NODES, MAX_TREE_NODES, AutoChoice, NgramDrafter, Speculator, StoredCosts, auto_arms, \
    combine_stats, format_stats, non_finite_logits, same_vocabulary
from tokenizer import get_tokenizer


# ----------------------------------------------------------------------------- loading

def load_model(checkpoint_path, device="cpu", precision=torch.float32, shard=None) -> Transformer:
    """A checkpoint file (model.pth, or a quantized file written by quantize.py) and the config.json
    beside it. The file records its own quantization scheme. `shard(model)` (tensor parallelism) runs
    on the memory-mapped weights, so each rank reads and moves to its device only its own slice."""
    path = Path(checkpoint_path)
    if not path.is_file():
        hint = " (pass the model.pth file, not its directory)" if path.is_dir() else \
            ("; download and convert one with scripts/prepare.sh ORG/MODEL, or train the tiny pair with "
             "scripts/train_tiny.py")
        raise UserError(f"checkpoint not found: {path}{hint}")
    args = ModelArgs.from_checkpoint_dir(path.parent)
    checkpoint = read_checkpoint(path)
    scheme = checkpoint.get("quantization") if isinstance(checkpoint.get("quantization"), dict) else None
    state_dict = checkpoint.get("model") if scheme else checkpoint
    with torch.device("meta"), no_weight_init():
        model = Transformer(args)
    if scheme:
        import quantize
        try:
            quantize.apply_quantization_scheme(model, scheme)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UserError(f"{path} does not hold a state dict of tensors: re-convert it")
    if args.tie_word_embeddings and "output.weight" not in state_dict:  # the output reads the table's own tensors
        state_dict = dict(state_dict, **{f"output.{name}": state_dict[f"tok_embeddings.{name}"]
                                         for name in ("weight", "scales") if f"tok_embeddings.{name}" in state_dict})
    load_weights(model, state_dict, path)
    if args.tie_word_embeddings and not scheme:
        model.output.weight = model.tok_embeddings.weight
    if shard is not None:
        shard(model)
    on_cpu = torch.device(device).type == "cpu"
    check_memory(weight_bytes(model, device, precision), device, f"loading {path}",
                 "give `precision` as the checkpoint's own dtype (its weights are then read in place), quantize it "
                 "(quantize.py), or free memory" if on_cpu else
                 "pick a lower `precision`, quantize it (quantize.py), or use a device with more memory")
    # each tensor converted where it is read, then moved: a GPU holds only the converted weights (weight_bytes)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        convert = tensor.is_floating_point() and tensor.dtype != precision and "scales" not in name
        tensor.data = tensor.data.to(dtype=precision if convert else tensor.dtype).to(device)
    if scheme:
        import quantize
        if on_cpu and shard is None:  # the kernels' layouts, from the checkpoint's stored packed copy where valid
            quantize.pack_or_load(model, path, scheme)
        else:
            quantize.pack_for_device(model)  # made after sharding
    model.quantization = scheme
    model.checkpoint_path = path  # named by errors found while running it (NaN logits)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- memory, checked before allocating

def available_memory(device, cgroup_root="/sys/fs/cgroup") -> Optional[int]:
    """Bytes that new tensors on `device` can take: free GPU memory plus what torch's allocator holds unused on
    CUDA; on the CPU the smaller of MemAvailable (psutil, else /proc/meminfo) and what the process's memory cgroup
    leaves (a container's limit: the kernel kills the process there, whatever the host has free); None where
    unknown (nothing is refused then)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    known = [n for n in (host_available_memory(), cgroup_available_memory(Path(cgroup_root))) if n is not None]
    return min(known, default=None)


def host_available_memory() -> Optional[int]:
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def cgroup_available_memory(root: Path, self_cgroup: Path = Path("/proc/self/cgroup")) -> Optional[int]:
    """Limit minus usage of the memory cgroup this process is in and of each cgroup above it (the tightest wins),
    cgroup v2 (ROOT/PATH/memory.max, memory.current) or v1 (ROOT/memory/PATH/memory.limit_in_bytes,
    memory.usage_in_bytes), PATH read from /proc/self/cgroup; file cache counts as free, as MemAvailable counts it
    (the kernel reclaims it before it kills). None where no limit is set or none can be read."""
    hierarchies = {"": (root, "memory.max", "memory.current"),
                   "memory": (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}
    paths = dict.fromkeys(hierarchies, "")  # inside a container's own cgroup namespace: its root
    try:  # "0::/user.slice/..." (v2), "4:memory:/docker/..." (v1)
        for line in self_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            name = "" if not controllers else "memory" if "memory" in controllers.split(",") else None
            if name is not None:
                paths[name] = path.strip().lstrip("/")
    except (OSError, ValueError):
        pass
    free = []
    for name, (base, limit_name, usage_name) in hierarchies.items():
        level = base / paths[name]
        while True:
            try:
                limit, usage = (level / limit_name).read_text().strip(), int((level / usage_name).read_text())
                if limit.isdigit() and int(limit) < 1 << 60:  # v2 writes "max", v1 a huge number, when unlimited
                    free.append(max(int(limit) - usage + file_cache(level / "memory.stat"), 0))
            except (OSError, ValueError):
                pass
            if level == base or base not in level.parents:
                break
            level = level.parent
    return min(free, default=None)


def file_cache(stat: Path) -> int:
    """Bytes of file cache in a cgroup's memory.stat (v1's hierarchical total_ fields where present)."""
    try:
        fields = dict(line.split(maxsplit=1) for line in stat.read_text().splitlines() if " " in line)
        return sum(int(fields.get(f"total_{name}", fields.get(name, 0))) for name in ("active_file", "inactive_file"))
    except (OSError, ValueError):
        return 0


def check_memory(needed: int, device, what: str, fix: str):
    """Refuse an allocation the device cannot hold before trying it: a failed allocation of terabytes takes the
    machine into swap or gets the process killed, with no word on which setting asked for it."""
    free = available_memory(device)
    if free is not None and needed > free:
        raise UserError(f"{what} needs {size_text(needed)} but {device} has {size_text(free)} available: {fix}")


def size_text(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / (1 << 20):.1f} MiB"


def weight_bytes(model: Transformer, device: str, precision) -> int:
    """Bytes load_model allocates for the weights: every tensor on a GPU; on the CPU only those converted to
    `precision` (the others stay memory-mapped from the file, in the page cache)."""
    total = 0
    for name, t in {id(t): (n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())}.values():
        converted = t.is_floating_point() and t.dtype != precision and "scales" not in name
        if torch.device(device).type != "cpu" or converted:
            total += t.numel() * (precision.itemsize if converted else t.element_size())
    return total


def cache_bytes(model: Transformer, batch_size: int, length: int) -> tuple:
    """(KV cache bytes, RoPE table bytes) that model.setup_caches(batch_size, length) allocates (0 where what it
    has is big enough): keys and values [B, kv heads, S, head_dim] per layer; the table [max(S, context),
    head_dim / 2, 2] float32, counted twice (building it holds its angles too)."""
    if model.max_batch_size >= batch_size and model.max_seq_length >= length:
        return 0, 0
    size = model.norm.weight.dtype.itemsize  # the cache holds the activations' dtype (model.setup_caches)
    kv = sum(2 * batch_size * layer.attention.n_local_heads * layer.attention.head_dim * length * size
             for layer in model.layers)
    positions = max(length, model.args.block_size)
    table = getattr(model, "rope_table", None)
    rope = 0 if table is not None and table.shape[0] >= positions else 2 * positions * model.args.head_dim * 4
    return kv, rope


def forward_bytes(model: Transformer, batch_size: int, tokens: int) -> int:
    """About the most one forward of `tokens` per row holds at once: its float32 logits [B, T, vocab] and a block's
    widest activations (the feed-forward's two [B, T, hidden] halves and the attention's [B, T, 4 * dim])."""
    a = model.args
    return batch_size * tokens * (a.vocab_size + 2 * a.intermediate_size + 4 * a.dim) * 4


def reserve_caches(model: Transformer, batch_size: int, length: int, draft: Optional[Transformer] = None,
                   fix: str = "lower `batch_size` or `max_new_tokens`", tokens: int = 0):
    """model.setup_caches(batch_size, length), refused with one line naming the setting to lower where the caches
    (the draft's too, which the drafter allocates later at the same size) and the first forward over `tokens` per
    row (the prompt's) would not fit in memory."""
    kv, rope = cache_bytes(model, batch_size, length)
    if draft is not None:
        kv, rope = (a + b for a, b in zip((kv, rope), cache_bytes(draft, batch_size, length)))
    work = forward_bytes(model, batch_size, tokens)
    what = f"the KV cache of {batch_size} rows x {length} positions"
    if work:
        what += f" and the first forward over {batch_size} x {tokens} tokens"
    if rope > kv + work:  # the context the config claims, not the run's settings
        config = Path(getattr(model, "checkpoint_path", "model.pth")).parent / "config.json"
        what = f"the RoPE table of {model.args.block_size} positions (max_position_embeddings in {config})"
        fix = f"lower max_position_embeddings in {config} to the context the model was trained for"
    device = model.tok_embeddings.weight.device
    check_memory(kv + rope + work, device, what, fix)
    model.setup_caches(batch_size, length)


@contextlib.contextmanager
def no_weight_init():
    """Module constructors skip their random initialisation: every weight comes from the checkpoint (and the first
    random op on the meta device costs seconds of one-time set-up)."""
    saved = {name: getattr(torch.nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    for name in saved:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


@dataclass
class Speculation:
    """How to speculate: draft depth (`speculate_k`, an int >= 1, or "auto": up to 8), tokens verified per step
    (`tree_nodes`: an int, None for a chain, or "auto": chains and trees of 2, 4 and 8 times the depth, up to
    MAX_AUTO_NODES), and an n-gram lookup (`draft_ngram`: n, 0 for none). With an "auto", each step runs the depth and
    size, or the plain step, with the most expected tokens per second (speculate.AutoChoice). Checked in check()."""
    speculate_k: Union[int, str] = 5
    tree_nodes: Union[int, str, None] = None
    draft_ngram: int = 0

    @property
    def depth(self) -> int:
        return 8 if self.speculate_k == "auto" else self.speculate_k

    @property
    def nodes(self) -> int:
        """The most nodes a step verifies."""
        if self.tree_nodes == "auto":
            return max(self.depth, min(8 * self.depth, MAX_AUTO_NODES))
        return self.tree_nodes if self.tree_nodes is not None else self.depth

    @property
    def auto(self) -> bool:
        return "auto" in (self.speculate_k, self.tree_nodes)

    def arms(self) -> list:
        """The (depth, tree size) pairs `auto` chooses among."""
        fixed = self.tree_nodes if isinstance(self.tree_nodes, int) else None
        return auto_arms(self.depth, fixed, self.speculate_k == "auto", self.tree_nodes == "auto", self.nodes)

    def check(self, has_draft: bool, max_seq_length: int = None):
        """Settings that cannot work, refused before anything is loaded (and, given the model's context,
        tree sizes it cannot hold)."""
        auto = self.speculate_k == "auto"
        if not auto and (isinstance(self.speculate_k, bool) or not isinstance(self.speculate_k, int)):
            raise UserError(f"`speculate_k` must be an integer >= 1 or 'auto', got {self.speculate_k!r}")
        if not auto and self.speculate_k < 1:
            raise UserError(f"`speculate_k` must be >= 1 (the number of draft tokens per step), got {self.speculate_k}")
        if self.tree_nodes not in (None, "auto") and (isinstance(self.tree_nodes, bool)
                                                      or not isinstance(self.tree_nodes, int)):
            raise UserError(f"`tree_nodes` must be an integer or 'auto', got {self.tree_nodes!r}")
        if not has_draft and not self.draft_ngram and (self.tree_nodes is not None or auto):
            what = "`tree_nodes`" if self.tree_nodes is not None else "`speculate_k` auto"
            raise UserError(f"{what} needs a draft: add `draft_checkpoint_path`, `draft_head` or `draft_ngram` N")
        if self.nodes < self.depth:
            raise UserError(f"`tree_nodes` ({self.nodes}) must be >= `speculate_k` ({self.depth}): a tree holds at "
                            f"least one chain")
        if self.draft_ngram and self.draft_ngram < 2:
            raise UserError("`draft_ngram` N needs N >= 2 (N - 1 tokens of context find the continuation)")
        if self.draft_ngram > 16:
            raise UserError(f"`draft_ngram` {self.draft_ngram}: use N between 2 and 16 (longer contexts rarely recur)")
        limit = min(MAX_TREE_NODES, max(1, (max_seq_length or 4 * MAX_TREE_NODES) // 4))
        if self.nodes > limit:
            why = f"{MAX_TREE_NODES}, and a quarter of its {max_seq_length}-token context" if max_seq_length else \
                "the most a step verifies"
            raise UserError(f"`tree_nodes` / `speculate_k` of {self.nodes} is more than this model can use (at most "
                            f"{limit}: {why}): lower it")


def make_speculator(speculation: Speculation, draft: Optional[Engine], max_seq_length: int, head=None):
    """The speculator for these settings with a draft of the target's tokenizer, a draft head (drafthead.DraftHead)
    or neither, or None for plain decoding."""
    speculation.check(draft is not None or head is not None, max_seq_length)
    depth, nodes = speculation.depth, speculation.nodes
    auto = AutoChoice(speculation.arms()) if speculation.auto else None
    if head is not None:
        from drafthead import HeadDrafter
        if draft is not None or speculation.draft_ngram:
            raise UserError("a draft head drafts on its own: drop `draft_checkpoint_path` and `draft_ngram`")
        return Speculator(HeadDrafter(head, depth, nodes), auto)
    if draft is not None and speculation.tree_nodes == "auto":
        raise UserError("`tree_nodes` auto sizes the trees of a draft head or n-gram drafts: give a draft model a "
                        "number of `tree_nodes`")
    if speculation.draft_ngram and draft is not None and nodes == depth:
        raise UserError("`draft_ngram` with a draft model merges lookups into the draft's tree: add `tree_nodes` N > "
                        "`speculate_k`")
    if draft is not None:
        return Speculator(ModelDrafter(draft, depth, nodes, speculation.speculate_k == "auto",
                                       speculation.draft_ngram), auto)
    if speculation.draft_ngram:
        return Speculator(NgramDrafter(speculation.draft_ngram, depth, nodes), auto)
    return None


def keep_timings(speculator, target: Engine, device: str, speculation: Speculation, drafter=dict):
    """With `auto` and a target running stored graphs: the choice's timings kept beside those graphs
    (speculate.StoredCosts), keyed by the target's graph key, the drafter's identity (`drafter()`) and the settings;
    the timings stored by an earlier run of the same configuration are loaded."""
    auto = getattr(speculator, "auto", None)
    if auto is None or not target.mode.startswith("stored"):
        return
    model = target.model
    fields = {"target": model_key_fields(model, device, target.mode), "drafter": drafter(),
              "speculation": asdict(speculation)}
    key = artifacts.key_of(fields)
    name = f"auto-timings-{Path(model.checkpoint_path).stem}-{speculator.kind}-{key[:16]}.json"
    auto.store = StoredCosts(artifacts.directory_for(model.checkpoint_path) / name, key)
    costs = auto.store.load()
    if costs is not None:
        auto.seed(costs)


def make_cross_speculator(speculation: Speculation, draft: Engine, draft_tokenizer, target_tokenizer,
                          target_vocab_size: int, batch_size: int = 1, several_prompts: bool = False):
    """The speculator for a draft whose tokenizer is not the target's; settings it cannot serve are refused."""
    import crossdraft
    draft_model = draft.model
    if draft_tokenizer.vocab_size > draft_model.args.vocab_size:
        raise UserError(f"the draft's tokenizer ({draft_tokenizer.directory}) has {draft_tokenizer.vocab_size} tokens, "
                        f"more than the draft model's {draft_model.args.vocab_size}: use the tokenizer the draft came "
                        f"with, or pick a draft from the same model family")
    if batch_size > 1 or several_prompts:
        raise UserError("a draft with another tokenizer speculates one prompt at a time: drop `batch_size` and "
                        "`prompts_file`, or use a draft with the target's tokenizer")
    if speculation.tree_nodes not in (None, speculation.speculate_k) or speculation.draft_ngram:
        raise UserError("a draft with another tokenizer drafts chains: give `speculate_k` N or auto and drop "
                        "`tree_nodes` and `draft_ngram`")
    auto = None
    if speculation.speculate_k == "auto":  # chains of K target tokens (crossdraft)
        auto = AutoChoice([(k, k) for k in range(1, speculation.depth + 1)])
    speculator = crossdraft.CrossTokenizerSpeculator(draft, draft_tokenizer, target_tokenizer, target_vocab_size,
                                                     speculation.depth, auto)
    for name, vocab in (("draft", speculator.draft_vocab), ("target", speculator.target_vocab)):
        if not vocab.round_trips(crossdraft.PROBE):
            raise UserError(f"cannot map the {name}'s tokens to text ({vocab.tokenizer.directory}: its pieces are "
                            f"neither byte-level nor sentencepiece-style): pick a draft with the target's tokenizer")
    if len(speculator.to_target) == 0:
        raise UserError("the draft's and the target's tokenizers share no token: pick another draft")
    return speculator


class Generator:
    """A checkpoint (and its drafter) loaded into engines, ready to generate."""

    def __init__(self, model: Transformer, tokenizer, target: Engine, speculator=None):
        self.model, self.tokenizer, self.target, self.speculator = model, tokenizer, target, speculator
        self.device = model.tok_embeddings.weight.device
        self.eos_ids = sorted(set(model.args.eos_token_ids) | set(tokenizer.eos_ids))

    @classmethod
    def build(cls, checkpoint_path, device: str = "cpu", precision=torch.float32, draft_checkpoint_path=None,
              speculation: Speculation = None, compile: str = "none", compile_prefill: bool = False,
              batch_size: int = 1, several_prompts: bool = False, shard=None, draft_head=None) -> "Generator":
        """Load the target (sharded by `shard` under tensor parallelism) and its draft (replicated: it is small) or
        draft head, pick the speculator (a draft of another tokenizer drafts through text), compile both in `compile`
        mode."""
        speculation = speculation or Speculation()
        speculation.check(draft_checkpoint_path is not None or draft_head is not None)
        if compile not in COMPILE_MODES:
            raise UserError(f"`compile` mode {compile!r} is not one of {', '.join(COMPILE_MODES)}")
        checkpoint_path = Path(checkpoint_path)
        model = load_model(checkpoint_path, device, precision, shard=shard)
        tokenizer = get_tokenizer(checkpoint_path.parent)
        if tokenizer.vocab_size > model.args.vocab_size:
            raise UserError(f"the tokenizer beside {checkpoint_path} has {tokenizer.vocab_size} tokens, more than the "
                            f"model's {model.args.vocab_size}: use the tokenizer the checkpoint came with")
        if draft_head is not None:
            if draft_checkpoint_path is not None:
                raise UserError("give one drafter: `draft_head` or `draft_checkpoint_path`, not both")
            if shard is not None:
                raise UserError("a draft head does not run under tensor parallelism yet: drop `draft_head` or run one "
                                "process")
            from drafthead import load_head
            head = compile_head(load_head(draft_head, model), device, compile)
            target = compile_engine(model, device, compile, compile_prefill, features=head.args.target_layers)
            speculator = make_speculator(speculation, None, model.args.block_size, head)
            keep_timings(speculator, target, device, speculation,
                         lambda: {"head": artifacts.file_identity(head.checkpoint_path), "scheme": head.quantization})
            return cls(model, tokenizer, target, speculator)
        target = compile_engine(model, device, compile, compile_prefill)
        if draft_checkpoint_path is None:
            speculator = make_speculator(speculation, None, model.args.block_size)
            keep_timings(speculator, target, device, speculation)
            return cls(model, tokenizer, target, speculator)
        draft_model = load_model(draft_checkpoint_path, device, precision)
        draft_tokenizer = get_tokenizer(Path(draft_checkpoint_path).parent)
        draft = compile_engine(draft_model, device, compile, compile_prefill)
        if same_vocabulary(tokenizer, draft_tokenizer, model.args.vocab_size, draft_model.args.vocab_size):
            speculator = make_speculator(speculation, draft, model.args.block_size)
            keep_timings(speculator, target, device, speculation,
                         lambda: model_key_fields(draft_model, device, draft.mode))
            return cls(model, tokenizer, target, speculator)
        speculator = make_cross_speculator(speculation, draft, draft_tokenizer, tokenizer, model.args.vocab_size,
                                           batch_size, several_prompts)
        keep_timings(speculator, target, device, speculation, lambda: model_key_fields(draft_model, device, draft.mode))
        return cls(model, tokenizer, target, speculator)

    @property
    def lookahead(self) -> int:
        return self.speculator.lookahead if self.speculator else 0

    def reserve(self, batch_size: int, max_tokens: int, fix: str = "lower `batch_size` or `max_new_tokens`",
                tokens: int = 0):
        """Allocate the caches for `batch_size` rows of up to max_tokens (prompt + new) once: a cache that grew
        later would change the compiled graphs' shapes and compile them again. `fix`: what to lower where they
        (and a forward over `tokens` per row) would not fit in memory, in the caller's terms."""
        drafter = getattr(self.speculator, "drafter", None)
        reserve_caches(self.model, batch_size, max_tokens + 1 + self.lookahead, getattr(drafter, "draft_model", None),
                       fix, tokens)

    def encode(self, prompt: str, chat: bool = False, seed: int = 0) -> list:
        return encode_prompt(prompt, self.tokenizer, self.model.args.vocab_size, seed, chat)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """This tokenizer's grammar compiler and compiled grammars (grammar.py), made at first use."""
        return Grammars(self.tokenizer, self.model.args.vocab_size, self.eos_ids)

    def generate(self, prompt, max_new_tokens: int, sampling: Sampling, stop_at_eos: bool = True,
                 batch_size: int = 1, callback=None, json_schema=None):
        """generate() with this generator's engine, speculator and end-of-sequence tokens. prompt: ids (a list of
        ints, copied on batch_size rows), or a list of prompts (lists of ids), one row each. json_schema (a dict or
        its JSON text): every row's answer is a JSON value valid under it, ended by the grammar (grammar.py)."""
        if prompt and isinstance(prompt[0], int):
            prompt = torch.tensor(prompt, device=self.device, dtype=torch.long)
        constraints = None
        if json_schema is not None:
            compiled = self.grammars.json_schema(json_schema)
            rows = len(prompt) if isinstance(prompt, list) else batch_size
            constraints = [Constraint(compiled, self.model.args.vocab_size) for _ in range(rows)]
        return generate(self.target, prompt, max_new_tokens, sampling, self.eos_ids, stop_at_eos, batch_size,
                        self.speculator, callback, constraints)


# ----------------------------------------------------------------------------- one generation

@torch.no_grad()  # also lets inductor freeze the weights into the compiled graphs (decode.compile_engine)
def generate(target: Engine, prompt, max_new_tokens: int, sampling: Sampling, eos_ids: list,
             stop_at_eos: bool = True, batch_size: int = 1, speculator=None, callback=None, constraints=None):
    """Generate up to max_new_tokens after `prompt`: 1-D ids (repeated on batch_size rows), or a list of
    prompts (lists of ids, of any lengths), one row each. Returns (new ids, one list per row; stats).
    With a speculator every step drafts a token tree and the target verifies it in one forward; without one,
    tokens come one per target forward. constraints: a grammar.Constraint per row, which masks the row's logits at
    every token and ends it where the grammar ends (generate_constrained)."""
    model = target.model
    device = model.tok_embeddings.weight.device
    prompts = [list(p) for p in prompt] if isinstance(prompt, list) else [prompt.tolist()] * batch_size
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = max(len(p) for p in prompts)
    reserve_caches(model, len(prompts), T + max_new_tokens + (speculator.lookahead if speculator else 0) + 1,
                   tokens=T)
    x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # [B, T], right-padded
    input_pos = torch.arange(T, device=device).expand(len(prompts), T)  # [B, T]
    features = None
    with sdpa_context():
        if getattr(speculator, "features", ()):  # a draft head reads the prompt's features too
            logits, features = target.forward_features(x, input_pos)  # [B, T, V], [B, T, F]
            logits = logits[torch.arange(len(prompts), device=device), lengths - 1]  # [B, V]
            first, finite, features = sample(logits, sampling)[0], torch.isfinite(logits).all(), features.clone()
        else:
            first, finite = target.prefill(model, x, input_pos, sampling, lengths - 1)
    if not bool(finite):  # one look at the host per generation: NaN weights would otherwise decode token 0 forever
        raise non_finite_logits(model, "for the prompt")
    if constraints is not None:
        return generate_constrained(target, prompts, max_new_tokens, sampling, eos_ids, stop_at_eos, speculator,
                                    callback, constraints, features)
    first = first.clone()
    watch = FiniteWatch(target.decode_one_token, model)
    target = replace(target, decode_one_token=watch)
    if speculator is not None:  # verification looks at its own logits (speculate.verify_step)
        result = speculator.generate(target, prompts, first, max_new_tokens, sampling, eos_ids, stop_at_eos,
                                     callback, **({"features": features} if features is not None else {}))
        watch.check()
        return result
    if callback:
        callback(first)
    eos = set(eos_ids)
    rest = []
    if max_new_tokens > 1 and not (stop_at_eos and all(t in eos for t in first.tolist())):
        rest = decode_n_tokens(target, first, lengths, max_new_tokens - 1, sampling, eos_ids, stop_at_eos, callback)
    watch.check()
    rows = torch.stack([first] + rest, dim=1).tolist()  # [B, n]
    if stop_at_eos:
        rows = [truncate_at_eos(row, eos) for row in rows]
    return rows, {"target_forwards": len(rest) + 1}


def generate_constrained(target: Engine, prompts: list, max_new_tokens: int, sampling: Sampling, eos_ids: list,
                         stop_at_eos: bool, speculator, callback, constraints: list, features=None):
    """generate() with a grammar per row, after the prefill (whose own token is not used: it was drawn unmasked).
    The first token comes from a step over each prompt's last token at its own slot (it rewrites the keys and
    values the prefill wrote there), masked; then the speculator (drafts the grammar forbids cut, every verified
    node masked), or one masked token per target forward. A draft of another tokenizer does not speculate here."""
    pos = [len(p) - 1 for p in prompts]
    first = constrained_step(target, [p[-1] for p in prompts], pos, sampling, constraints)
    if isinstance(speculator, Speculator) and None not in first:
        device = target.model.tok_embeddings.weight.device
        extra = {"features": features} if features is not None else {}
        rows, stats = speculator.generate(target, prompts, torch.tensor(first, device=device), max_new_tokens,
                                          sampling, eos_ids, stop_at_eos, callback, constraints=constraints, **extra)
        return rows, dict(stats, grammar_notes=[c.note for c in constraints])
    eos, outs, forwards = set(eos_ids), [[] for _ in prompts], 1
    done = [False] * len(prompts)
    tokens = first
    while True:
        for b, token in enumerate(tokens):
            if done[b]:
                continue
            if token is not None:
                outs[b].append(token)
                if callback and b == 0:
                    callback(torch.tensor([token]))
            out = outs[b]
            done[b] = token is None or constraints[b].ended or len(out) >= max_new_tokens or \
                (stop_at_eos and out[-1] in eos)
        if all(done):
            break
        tokens = constrained_step(target, [out[-1] if out else p[-1] for out, p in zip(outs, prompts)],
                                  [len(p) + len(out) - 1 for p, out in zip(prompts, outs)], sampling,
                                  [None if d else c for d, c in zip(done, constraints)])
        forwards += 1
    return outs, {"target_forwards": forwards + 1, "grammar_notes": [c.note for c in constraints]}


def constrained_step(target: Engine, tokens: list, pos: list, sampling: Sampling, constraints: list) -> list:
    """One [B, 1] forward of each row's token at its slot (causal, as plain decoding), each row's logits masked by
    its grammar, one draw for the batch; each row's token, taken by its grammar; None for a row without a
    constraint (not stepped: it feeds its token at its own slot again) or at a dead end."""
    model = target.model
    device = model.tok_embeddings.weight.device
    x = torch.tensor(tokens, device=device).view(-1, 1)
    at = torch.tensor(pos, device=device).view(-1, 1)  # [B, 1]
    mask = torch.arange(model.max_seq_length, device=device).view(1, 1, 1, -1) <= at.view(-1, 1, 1, 1)
    with sdpa_context():
        logits = target.forward(x, at, at, mask)[:, -1].float()  # [B, V]
    live = [c is not None and c.mask(row) for c, row in zip(constraints, logits)]
    token, probs = sample(logits, sampling)
    if not bool(chosen_is_finite(logits if probs is None else probs, token)[torch.tensor(live)].all()):
        raise non_finite_logits(model, "for a generated token")
    return [t if ok and c.accept(t) else None for t, ok, c in zip(token.tolist(), live, constraints)]


class FiniteWatch:
    """An engine's decode_one_token that stops weights going NaN or infinite mid-run with one line, not decoding
    garbage, without a host sync per token: it looks every EOS_CHECK_EVERY steps (when decode_n_tokens looks for
    EOS) and in check(), at the keys the steps wrote in the last layer (NaN risen in any layer below shows there)
    and at whether every distribution sampled from was finite (noted on the device at each step; greedy steps
    return none)."""

    def __init__(self, decode_one_token, model: Transformer):
        self.decode_one_token, self.model = decode_one_token, model
        self.slots, self.finite = [], None  # since the last look: each step's input_pos [B, 1]; probs all finite

    def __call__(self, model: Transformer, x, input_pos, sampling: Sampling):
        token, probs = self.decode_one_token(model, x, input_pos, sampling)
        if probs is not None:  # sampled (greedy has none: a NaN shows in the keys)
            finite = torch.isfinite(probs).all()
            self.finite = finite if self.finite is None else self.finite & finite
        self.slots.append(input_pos)
        if len(self.slots) == EOS_CHECK_EVERY:
            self.check()
        return token, probs

    def check(self):
        if not self.slots:
            return
        slots = torch.cat(self.slots, 1)  # [B, n]
        rows = torch.arange(slots.shape[0], device=slots.device).unsqueeze(1)  # [B, 1]
        keys = self.model.layers[-1].attention.kv_cache.k_cache[rows, :, slots]  # [B, n, H, D]
        finite = bool(torch.isfinite(keys).all()) and (self.finite is None or bool(self.finite))
        self.slots, self.finite = [], None
        if not finite:
            raise non_finite_logits(self.model, "for a generated token")


def truncate_at_eos(ids: list, eos: set) -> list:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def encode_prompt(prompt: str, tokenizer, vocab_size: int, seed: int, chat: bool = False) -> list:
    """The ids the model sees: the tokenizer's own (BOS added exactly as its Hugging Face tokenizer does), the
    chat template's rendering of one user turn (chat), or for a synthetic prompt "N" the tokenizer's special
    tokens and N random ids."""
    if chat:
        return tokenizer.chat_ids([{"role": "user", "content": prompt}])
    if is_synthetic(prompt):
        n = int(prompt)
        if n > 10**7:
            raise UserError(f"`prompt` {n}: a synthetic prompt of more than 10^7 tokens fits no model's context")
        generator = torch.Generator().manual_seed(seed)
        return tokenizer.encode_prompt("") + torch.randint(3, vocab_size, (n,), generator=generator).tolist()
    return tokenizer.encode_prompt(prompt)


def is_synthetic(prompt: str) -> bool:
    """A prompt of ASCII digits only ("100") asks for that many synthetic tokens ("²" is a digit to str.isdigit)."""
    return re.fullmatch(r"\s*[0-9]+\s*", prompt) is not None


def check_fits(prompt_tokens: int, max_new_tokens: int, block_size: int):
    needed = prompt_tokens + max_new_tokens
    if needed > block_size:
        raise UserError(f"prompt ({prompt_tokens} tokens) + `max_new_tokens` ({max_new_tokens}) = {needed} exceeds "
                        f"the model's context of {block_size} tokens: shorten the prompt or lower `max_new_tokens`")


def read_prompts_file(path: Path) -> list:
    """One prompt per non-empty line, plain text or a JSON object with a "prompt" string."""
    lines = read_user_text(path, "prompts_file", "pass a UTF-8 text file", limit=1 << 26).splitlines()
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"`prompts_file` {path}, line {number}: a JSON line needs a \"prompt\" field") from None
            if not isinstance(line, str):
                raise UserError(f"`prompts_file` {path}, line {number}: \"prompt\" must be a string")
        prompts.append(line)
    if not prompts:
        raise UserError(f"`prompts_file` {path} holds no prompt: write one prompt per line")
    return prompts


# ----------------------------------------------------------------------------- a whole run: samples and stats

@dataclass
class Settings:
    """One run's configuration (generate.py's flags, by the same names), checked once in check()."""
    checkpoint_path: Path = Path("checkpoints/tiny/target/model.pth")
    draft_checkpoint_path: Optional[Path] = None
    prompt: str = "Hello, my name is"
    chat: bool = False  # the checkpoint's chat template around the prompt (one user turn)
    num_samples: int = 5
    max_new_tokens: int = 200
    batch_size: int = 1
    prompts_file: Optional[Path] = None
    temperature: float = 0.8
    top_k: Optional[int] = 200
    top_p: Optional[float] = None
    seed: int = 1234
    speculation: Speculation = field(default_factory=Speculation)
    compile: str = "none"
    compile_prefill: bool = False
    device: str = "cpu"
    precision: Optional[str] = None  # None: bf16 on CUDA, fp32 on CPU
    profile: Optional[Path] = None
    stats_json: Optional[Path] = None
    stop_at_eos: bool = True
    draft_head: Optional[Path] = None  # a draft head's directory (drafthead.py)
    json_schema: Optional[Path] = None  # a JSON Schema file every answer follows (grammar.py)

    def check(self):
        """Settings that cannot work, refused before anything is loaded."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise UserError(f"`{name}` must be a finite number, got {value}")
        if self.temperature < 0:
            raise UserError(f"`temperature` must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"`top_k` must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"`top_p` must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UserError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        if self.num_samples < 1 or self.batch_size < 1:
            raise UserError("`num_samples` and `batch_size` must be >= 1")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"`seed` must be in [0, 2^63), got {self.seed}")
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError("`prompt` is not valid UTF-8 text: pass the prompt in UTF-8") from None
        if self.compile_prefill and self.compile == "none":
            raise UserError("`compile_prefill` compiles the prefill beside the decode graph: add `compile`")
        check_engine_settings(self.compile, self.precision, self.device)
        for name in ("stats_json", "profile"):
            if getattr(self, name) is not None:
                check_output_file(Path(getattr(self, name)), name)
        if self.profile is not None and self.stats_json is not None and \
                Path(self.profile).resolve() == Path(self.stats_json).resolve():
            raise UserError(f"`profile` and `stats_json` name the same file {self.profile}: the stats would overwrite "
                            f"the trace; name two files")
        self.speculation.check(self.draft_checkpoint_path is not None or self.draft_head is not None)
        if self.json_schema is not None:
            in_file(self.json_schema, check_schema, read_json_schema(self.json_schema), "$")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision or ("bf16" if self.device.startswith("cuda") else "fp32")]


def read_json_schema(path: Path):
    """The JSON Schema in a file (`json_schema`), or one line saying why it cannot be read."""
    text = read_user_text(path, "json_schema", "pass a JSON Schema file", limit=1 << 24)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, an integer too long to convert, nested too deeply
        raise UserError(f"`json_schema` {path} is not JSON ({e}): pass a JSON Schema file") from None


def in_file(path: Path, function, *args):
    """function(*args), its SchemaError said as one about the `json_schema` file (its field as a path from `$`)."""
    try:
        return function(*args)
    except SchemaError as e:
        raise UserError(f"`json_schema` {path}: {e}") from None


def check_engine_settings(compile: str, precision: Optional[str], device: str):
    """The compile mode, precision and device of any command that builds an engine."""
    if compile not in COMPILE_MODES:
        raise UserError(f"`compile` must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    if precision is not None and precision not in PRECISIONS:
        raise UserError(f"`precision` must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"`device` {device}: use cpu or cuda (cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("`device` cuda asked for, but torch sees no CUDA device; use `device` cpu")


def export_trace(prof, path: Path):
    """torch.profiler's chrome trace, written whole or not at all: kineto reports a failed write (a full disk) only
    on stderr and leaves the file cut short, so a trace that does not parse is a failed write (write_output's one
    line says why)."""
    def write(tmp):
        try:
            with quiet_stderr():
                prof.export_chrome_trace(str(tmp))  # kineto fills TMP.tmp, then renames it to TMP
            json.loads(tmp.read_bytes())
        except ValueError:
            raise RuntimeError("the profiler wrote its trace only in part") from None
        finally:
            Path(f"{tmp}.tmp").unlink(missing_ok=True)
    write_output(path, "profile", write)


def setup_distributed(device: str, settings: Optional[Settings] = None):
    """Tensor parallelism when launched by torchrun with more than one process (see tp.py): every rank runs
    the same generation on the same tokens from the same seed; only rank 0 prints and writes files. `settings`
    must agree on every rank (tp.check_same_settings), all but the files only rank 0 writes.
    Returns (rank, world_size, shard function or None)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise UserError(f"WORLD_SIZE={world!r} is not a positive integer: launch with torchrun --nproc_per_node=N")
    if int(world) == 1:
        return 0, 1, None
    import tp
    rank, world_size = tp.init_distributed(device)
    if settings is not None:
        values = asdict(settings)
        values.update(values.pop("speculation"))  # by the names of their flags
        tp.check_same_settings({name: str(value) for name, value in values.items()
                                if name not in ("stats_json", "profile")})
    return rank, world_size, functools.partial(tp.apply_tp, rank=rank, world_size=world_size)


def run(settings: Settings, say=print, questions=None) -> dict:
    """A whole run: load, compile (a warm-up sample, timed apart), then num_samples samples of the prompt, the
    prompts of prompts_file batch_size at a time, or, given `questions` (an iterator of user turns), a conversation
    in the checkpoint's chat template with streamed answers. Returns the stats (the --stats_json object)."""
    settings.check()
    torch.manual_seed(settings.seed)
    rank, world_size, shard = setup_distributed(settings.device, settings)
    say = say if rank == 0 else (lambda *a, **k: None)
    t0 = time.perf_counter()
    generator = Generator.build(settings.checkpoint_path, settings.device, settings.dtype,
                                settings.draft_checkpoint_path, settings.speculation, settings.compile,
                                settings.compile_prefill, settings.batch_size, settings.prompts_file is not None,
                                shard, settings.draft_head)
    load_seconds = time.perf_counter() - t0
    model = generator.model
    sampling = Sampling(settings.temperature, settings.top_k, settings.top_p)
    prompt_ids, batches, texts = read_prompts(settings, generator)
    schema = read_json_schema(settings.json_schema) if settings.json_schema is not None else None
    if schema is not None:  # compiled once, before the warm-up (a schema the grammar cannot enforce: one line)
        in_file(settings.json_schema, generator.grammars.json_schema, schema, "$")
    quantization = f" (quantization: {model.quantization['mode']})" if model.quantization else ""
    say(f"Loaded {settings.checkpoint_path} in {load_seconds:.2f} s{quantization}"
        f"{f' (tensor parallel over {world_size} ranks)' if world_size > 1 else ''}")

    def timed(ids: list, callback=None, profile=False):
        """One generation (ids of one prompt, or a list of prompts' ids), timed: (rows of new ids, stats, seconds)."""
        sync = torch.cuda.synchronize if settings.device.startswith("cuda") else (lambda: None)
        sync()
        t = time.perf_counter()
        with torch.profiler.profile() if profile else contextlib.nullcontext() as prof:
            rows, stats = generator.generate(ids, settings.max_new_tokens, sampling, settings.stop_at_eos,
                                             settings.batch_size, callback, schema)
            sync()
        if profile:
            export_trace(prof, Path(settings.profile))
        return rows, stats, time.perf_counter() - t

    generator.reserve(settings.batch_size, len(prompt_ids) + settings.max_new_tokens)
    compile_seconds = 0.0
    if settings.compile != "none":  # a warm-up sample compiles the graphs; its time is reported, not counted
        compile_seconds = timed(batches[0] if batches else prompt_ids)[2]
        say(f"Compilation (warm-up sample) took {compile_seconds:.2f} s")
    rows = None
    if questions is not None:
        samples, stats = converse(timed, generator, questions, rank, say)
    elif batches:
        samples, stats, rows = run_prompts_file(timed, batches, texts, generator, say)
    else:
        samples, stats = run_samples(timed, settings, generator, prompt_ids, rank, say)

    result = summarize(settings, generator, prompt_ids, samples, stats, compile_seconds, world_size)
    if rows is not None:
        result["rows"] = rows
    say(f"Average: {result['tokens_per_sec']:.2f} tokens/s, {result['bandwidth_gbs']:.2f} GB/s")
    say(f"Peak memory: {result['peak_memory_gb']:.2f} GB")
    if settings.stats_json and rank == 0:
        write_output(Path(settings.stats_json), "stats_json",
                     lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))
    return result


def read_prompts(settings: Settings, generator: Generator) -> tuple:
    """The prompt's ids (with a prompts file: its longest prompt's), the prompts file's ids batch_size at a time and
    its texts (None without one); refused when empty or too long for the model."""
    prompt_ids = generator.encode(settings.prompt, settings.chat, settings.seed)
    batches = texts = None
    if settings.prompts_file:
        texts = read_prompts_file(Path(settings.prompts_file))
        ids = [generator.encode(text, settings.chat, settings.seed) for text in texts]
        batches = [ids[i:i + settings.batch_size] for i in range(0, len(ids), settings.batch_size)]
        prompt_ids = max(ids, key=len)
    if not prompt_ids or (batches and not all(map(len, ids))):
        raise UserError("the `prompt` is empty and this tokenizer adds no BOS token: give a prompt with text")
    try:
        check_fits(len(prompt_ids), settings.max_new_tokens, generator.model.args.block_size)
    except UserError as e:
        if not batches:
            raise
        longest = ids.index(prompt_ids) + 1
        raise UserError(f"`prompts_file` {settings.prompts_file}, its prompt {longest} (the longest; blank lines not "
                        f"counted): {e}") from None
    return prompt_ids, batches, texts


def run_samples(timed, settings: Settings, generator: Generator, prompt_ids: list, rank: int, say):
    """num_samples samples of the prompt, each printed after it (the last one profiled where asked). Returns (timed
    samples, the last one's stats)."""
    samples, stats = [], {}
    for i in range(settings.num_samples):
        last = i == settings.num_samples - 1
        new, stats, seconds = timed(prompt_ids, profile=settings.profile is not None and last and rank == 0)
        samples.append(sample_record(new, seconds, generator.tokenizer))
        synthetic = is_synthetic(settings.prompt) or settings.chat
        say((generator.tokenizer.decode(prompt_ids) if synthetic else settings.prompt) + samples[-1]["text"])
        say(f"\nSample {i + 1}: " + report(samples[-1], generator.model, settings.batch_size))
        for note in {note for note in stats.get("grammar_notes", ()) if note}:
            say(f"Note: {note}")
        if generator.speculator is not None:
            say(format_stats(stats))
    return samples, stats


def run_prompts_file(timed, batches: list, texts: list, generator: Generator, say):
    """The prompts of a prompts file, batch_size rows at a time. Returns (timed samples, stats, rows)."""
    samples, stats, rows = [], [], []
    for batch in batches:
        new, batch_stats, seconds = timed(batch)
        stats.append(batch_stats)
        n = sum(len(r) for r in new)
        samples.append({"rows": len(batch), "seconds": seconds, "tokens_per_sec": n / seconds})
        for ids, tokens in zip(batch, new):
            text = texts[len(rows)]
            rows.append({"prompt": text, "prompt_tokens": ids, "tokens": tokens,
                         "text": generator.tokenizer.decode(tokens)})
            say(text + rows[-1]["text"] + "\n")
        say(f"Batch {len(samples)}: " + report(samples[-1], generator.model, len(batch)))
    if "accept_counts" in stats[0]:  # speculative: acceptance over every batch
        say(format_stats(combine_stats(stats)))
        return samples, combine_stats(stats), rows
    return samples, {"target_forwards": sum(s["target_forwards"] for s in stats)}, rows


def converse(timed, generator: Generator, questions, rank: int, say):
    """A conversation: each question answered in the checkpoint's own chat template (streamed), the conversation
    kept, until the questions end."""
    tokenizer, model = generator.tokenizer, generator.model
    messages, samples, stats = [], [], {}
    stop = set(generator.eos_ids)
    for text in questions:
        messages.append({"role": "user", "content": text})
        ids = tokenizer.chat_ids(messages)
        if len(ids) >= model.args.block_size:  # no room for one answer token; `max_new_tokens` is not the cause
            raise UserError(f"the conversation with this turn is {len(ids)} tokens, the model's context "
                            f"{model.args.block_size}: ask a shorter question, or start a new conversation")
        streamed, shown = [], [""]

        def stream(token):
            if rank == 0 and int(token[0]) not in stop:  # the end-of-turn token ends the answer, unprinted
                streamed.append(int(token[0]))
                text = tokenizer.decode(streamed)
                if not text.endswith("\ufffd"):  # print whole characters only (a token may end mid-UTF-8)
                    say(text[len(shown[0]):], end="", flush=True)
                    shown[0] = text

        rows, stats, seconds = timed(ids, callback=stream)
        samples.append(sample_record(rows, seconds, tokenizer))
        say(f"\nSample {len(samples)}: " + report(samples[-1], model, 1))
        answer = [t for t in rows[0] if t not in stop]
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        say()
    return samples, stats


def sample_record(rows: list, seconds: float, tokenizer) -> dict:
    n = sum(len(row) for row in rows)
    record = {"tokens": rows[0], "text": tokenizer.decode(rows[0]), "seconds": seconds, "tokens_per_sec": n / seconds}
    if len(rows) > 1:
        record["batch_tokens"] = rows
    return record


def report(sample: dict, model: Transformer, batch_size: int) -> str:
    n, seconds = round(sample["tokens_per_sec"] * sample["seconds"]), sample["seconds"]
    return (f"{n} tokens in {seconds:.2f} s, {n / seconds:.2f} tokens/s, "
            f"{model.model_bytes() * n / batch_size / seconds / 1e9:.2f} GB/s")


def summarize(settings: Settings, generator: Generator, prompt_ids, samples, stats, compile_seconds, world_size):
    model = generator.model
    tokens_per_sec = sum(s["tokens_per_sec"] for s in samples) / max(len(samples), 1)
    nbytes = model.model_bytes()  # per rank under tensor parallelism: each rank reads its shard
    result = {
        "device": settings.device, "precision": {v: k for k, v in PRECISIONS.items()}[settings.dtype],
        "compile": settings.compile != "none", "speculative": generator.speculator.kind if generator.speculator
        else "none", "compile_mode": generator.target.ran_as,
        "quantization": (model.quantization or {}).get("mode", "none"),
        "world_size": world_size, "batch_size": settings.batch_size,
        "prompt_tokens": prompt_ids, "samples": samples, "tokens_per_sec": tokens_per_sec,
        "bandwidth_gbs": nbytes * tokens_per_sec / settings.batch_size / 1e9, "model_bytes": nbytes,
        "compile_seconds": compile_seconds,
    }
    if generator.speculator is not None:
        result.update(stats)
    if any(stats.get("grammar_notes") or ()):  # --json_schema: rows its grammar ended at a dead end
        result["grammar_notes"] = stats["grammar_notes"]
    if settings.device.startswith("cuda"):
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:
        import resource
        result["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return result
