"""Convert a llama.cpp GGUF file (architecture "llama": Llama 1-3, TinyLlama, SmolLM, ...) into our
checkpoint layout.

    python scripts/convert_gguf_checkpoint.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/convert_gguf_checkpoint.py --gguf llama-2-7b.Q4_K_M.gguf --out_dir checkpoints/llama2 --dtype fp32

Writes OUT_DIR (default checkpoints/<file stem>) with config.json (Hugging Face schema), tokenizer.json and
tokenizer_config.json (built from the GGUF vocabulary the way transformers builds them, so both give the
same ids) and model.pth: the weights dequantized to --dtype under our names. Every tensor type the
`gguf` package can dequantize converts: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ
types. The file is read and checked completely before anything is written, and the four files appear together
or not at all (an earlier conversion in OUT_DIR stays as it was if this one fails or is interrupted).

Q and K need no reordering: llama.cpp's converter permutes Hugging Face's rotate-halves rows into
rotate-interleaved-pairs rows, which is our RoPE layout (transformers un-permutes them when it loads a GGUF).
"""
import argparse
import json
import math
import numbers
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli, write_files_atomically  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
from model import ModelArgs  # noqa: E402

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ours <- GGUF, per layer; q/k/v are fused into one wqkv
_LAYER_MAP = {
    "attention.wo.weight": "attn_output.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}

# byte-level BPE pre-tokenizers, by `tokenizer.ggml.pre`, as transformers builds them (None: GPT-2's regex,
# which transformers also uses for "smollm", though llama.cpp isolates each digit there first)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BPE_SPLITS = {"default": None, "gpt2": None, "smollm": None,
               "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values


# ----------------------------------------------------------------------------- reading and checking

def read_gguf(path: Path):
    """(metadata dict, {name: tensor}) of a GGUF file."""
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}: pass the path of a .gguf file with --gguf")
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, IndexError) as e:
        raise UserError(f"{path} is not a readable GGUF file ({e}): pass a .gguf file written by llama.cpp") from None
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except UnicodeDecodeError:
            raise UserError(f"{path}: metadata '{key}' is not UTF-8 text: the file is damaged; download it "
                            f"again") from None
    return meta, {t.name: t for t in reader.tensors}


def require(path: Path, meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        raise UserError(f"{path} has no '{key}' metadata: the file is incomplete; download it again")
    return value


def count(path: Path, meta: dict, key: str, default=None, limit=2**24) -> int:
    """A size in the metadata: an integer in [1, limit] (config.json's limits, so the config written reads back)."""
    value = require(path, meta, key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= limit:
        raise UserError(f"{path}: metadata '{key}' is {str(value)[:40]}, not an integer in [1, {limit}]: the file is "
                        f"damaged or not a usable model; download it again")
    return int(value)


def listing(path: Path, meta: dict, key: str, kind, length=None) -> list:
    """A list in the metadata whose items are all `kind` (str, int or float: numbers not NaN), of `length` items
    where given (token types and scores: one per token)."""
    value = require(path, meta, key)
    what = {str: "strings", int: "integers", float: "numbers"}[kind]
    ok = isinstance(value, list) and all(
        isinstance(v, str) if kind is str else
        isinstance(v, numbers.Integral) and not isinstance(v, bool) if kind is int else
        isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v for v in value)
    if not ok:
        raise UserError(f"{path}: metadata '{key}' is not a list of {what}: the file is damaged; download it again")
    if length is not None and len(value) != length:
        raise UserError(f"{path}: metadata '{key}' has {len(value)} entries for {length} tokens: the file is "
                        f"damaged; download it again")
    return value


def merge_pairs(path: Path, meta: dict, vocab: dict) -> list:
    """tokenizer.ggml.merges, "LEFT RIGHT" strings, as (LEFT, RIGHT) pairs split where llama.cpp splits them (the
    first space after the first character); both parts and their merge must be tokens of the vocabulary."""
    pairs = []
    for i, merge in enumerate(listing(path, meta, "tokenizer.ggml.merges", str)):
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1:]
        if cut < 0 or not right or not {left, right, left + right} <= vocab.keys():
            raise UserError(f"{path}: metadata 'tokenizer.ggml.merges' entry {i} ({merge[:40]!r}) is not two tokens "
                            f"of the vocabulary separated by a space: the file is damaged; download it again")
        pairs.append((left, right))
    return pairs


def positive(path: Path, meta: dict, key: str, default: float) -> float:
    """A positive, finite number in the metadata (an RMS epsilon, a RoPE base)."""
    value = require(path, meta, key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:  # NaN fails too
        shown = decimal(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else str(value)[:40]
        raise UserError(f"{path}: metadata '{key}' is {shown}, not a positive finite number: the file is "
                        f"damaged or not a usable model; download it again")
    return decimal(value)


def model_args(meta: dict, tensors: dict, path: Path) -> ModelArgs:
    """The model's shape from the metadata; a size that is zero, negative, not finite or inconsistent (heads that do
    not divide the width) is a UserError naming its GGUF key, before anything is written."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UserError(f"{path} holds a '{arch}' model: only GGUF architecture 'llama' converts "
                        f"(for others, convert the Hugging Face checkpoint with scripts/convert_hf_checkpoint.py)")
    size = partial(count, path, meta)
    dim, n_head = size("llama.embedding_length", limit=2**17), size("llama.attention.head_count", limit=4096)
    n_kv = size("llama.attention.head_count_kv", n_head, limit=4096)
    if "llama.attention.key_length" not in meta and dim % n_head:  # llama.cpp's head width: dim / heads
        raise UserError(f"{path}: metadata 'llama.attention.head_count' ({n_head}) does not divide "
                        f"'llama.embedding_length' ({dim}): the file is damaged; download it again")
    if n_head % n_kv:
        raise UserError(f"{path}: metadata 'llama.attention.head_count_kv' ({n_kv}) does not divide "
                        f"'llama.attention.head_count' ({n_head}): the file is damaged; download it again")
    head_dim = size("llama.attention.key_length", size("llama.rope.dimension_count", dim // n_head, limit=2**14),
                    limit=2**14)
    if {head_dim} != {meta.get(f"llama.{key}", head_dim) for key in ("rope.dimension_count", "attention.value_length")}:
        raise UserError(f"{path}: RoPE over part of a head, or values of another width than keys, is not supported")
    if head_dim % 2:  # RoPE turns pairs of dimensions (the converted config.json would be refused at load)
        raise UserError(f"{path}: the head width is {head_dim} (metadata 'llama.attention.key_length', else "
                        f"'llama.embedding_length' / 'llama.attention.head_count'), not an even number: the file is damaged; "
                        f"download it again")
    tokens = require(path, meta, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not 0 < len(tokens) <= 2**24:
        raise UserError(f"{path}: metadata 'tokenizer.ggml.tokens' is {'empty' if tokens == [] else 'not a list'}, "
                        f"not a vocabulary: the file is damaged; download it again")
    listing(path, meta, "tokenizer.ggml.tokens", str)
    args = ModelArgs(
        dim=dim, n_layer=size("llama.block_count", limit=4096), n_head=n_head, n_local_heads=n_kv, head_dim=head_dim,
        intermediate_size=size("llama.feed_forward_length", limit=2**20), vocab_size=len(tokens),
        block_size=size("llama.context_length"), rope_base=positive(path, meta, "llama.rope.freq_base", 10000.0),
        norm_eps=positive(path, meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings="output.weight" not in tensors, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else [])
    scaling, divisors = meta.get("llama.rope.scaling.type", "none"), tensors.get("rope_freqs.weight")
    if scaling == "linear" and divisors is None:
        args.rope_scaling = {"rope_type": "linear", "factor": positive(path, meta, "llama.rope.scaling.factor", None)}
    elif scaling in ("none", "llama3") and divisors is not None:
        args.rope_scaling = llama3_scaling(args, divisors, meta, path)
    elif scaling != "none":
        raise UserError(f"{path} uses RoPE scaling '{scaling}'{' with rope_freqs' if divisors is not None else ''}: "
                        f"only linear and Llama 3 scaling are supported")
    return args


def decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def llama3_scaling(args: ModelArgs, rope_freqs, meta: dict, path: Path) -> dict:
    """llama.cpp stores Llama 3.1's RoPE rescaling as one divisor per frequency (`rope_freqs`); recover the
    Hugging Face parameters, which are Meta's (low 1, high 4, 8192 positions) but for the factor."""
    divisors = dequantize(rope_freqs, torch.float32)  # [head_dim // 2]
    scaling = {"rope_type": "llama3", "factor": divisors.max().item(), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": count(path, meta, "llama.rope.scaling.original_context_length",
                                                         8192)}
    # the divisors these parameters give: 1 for short wavelengths, `factor` for long ones, a blend between
    inv_freq = 1.0 / args.rope_base ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim)
    smooth = (scaling["original_max_position_embeddings"] * inv_freq / (2 * torch.pi) - 1.0) / (4.0 - 1.0)
    expected = 1 / ((1 - smooth.clamp(0, 1)) / scaling["factor"] + smooth.clamp(0, 1))
    if divisors.shape != expected.shape or not torch.allclose(divisors, expected, rtol=1e-3):
        raise UserError(f"{path}: its rope_freqs tensor is not Llama 3 RoPE scaling with Meta's parameters, "
                        f"the only per-frequency scaling supported")
    return scaling


def tensor_plan(args: ModelArgs, tensors: dict, path: Path) -> dict:
    """Our state-dict key -> the GGUF tensors whose rows it concatenates; checks names, shapes and types."""
    plan = {"tok_embeddings.weight": ["token_embd.weight"], "norm.weight": ["output_norm.weight"]}
    if not args.tie_word_embeddings:
        plan["output.weight"] = ["output.weight"]
    for i in range(args.n_layer):
        plan[f"layers.{i}.attention.wqkv.weight"] = [f"blk.{i}.attn_{p}.weight" for p in "qkv"]
        plan.update({f"layers.{i}.{ours}": [f"blk.{i}.{theirs}"] for ours, theirs in _LAYER_MAP.items()})
    wanted = {name for names in plan.values() for name in names}
    missing, unused = sorted(wanted - tensors.keys()), sorted(tensors.keys() - wanted - {"rope_freqs.weight"})
    if missing or unused:
        raise UserError(f"{path} does not hold a plain Llama model: missing tensors {missing[:3]}, tensors our model "
                        f"has no place for {unused[:3]} (biases, experts and extra layers are not supported)")

    d, q, kv, ffn = args.dim, args.n_head * args.head_dim, args.n_local_heads * args.head_dim, args.intermediate_size
    shapes = {"tok_embeddings.weight": (args.vocab_size, d), "output.weight": (args.vocab_size, d),
              "norm.weight": (d,), "attention.wqkv.weight": (q + 2 * kv, d), "attention.wo.weight": (d, q),
              "feed_forward.w1.weight": (ffn, d), "feed_forward.w3.weight": (ffn, d),
              "feed_forward.w2.weight": (d, ffn), "attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    for ours, names in plan.items():
        parts = [tuple(int(n) for n in reversed(tensors[name].shape)) for name in names]  # GGUF lists columns first
        shape = (sum(p[0] for p in parts), *parts[0][1:])  # [rows of all parts, columns]
        expected = shapes[ours.split(".", 2)[-1] if ours.startswith("layers.") else ours]
        if shape != expected:
            raise UserError(f"{path}: {names[0]} has shape {shape} where the metadata implies {expected}: "
                            f"the file is inconsistent")
        for name in names:
            try:  # dequantize one row: does the gguf package know this type?
                gguf.quants.dequantize(tensors[name].data[:1], tensors[name].tensor_type)
            except NotImplementedError:
                raise UserError(f"{path}: tensor {name} has type {tensors[name].tensor_type.name}, which the gguf "
                                f"package cannot dequantize: upgrade gguf (pip install -U gguf) or use another "
                                f"quantization of the model") from None
    return plan


def dequantize(tensor, dtype) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # a copy, not the mmap
    return torch.from_numpy(values).reshape(tuple(int(n) for n in reversed(tensor.shape))).to(dtype)  # [rows, cols]


# ----------------------------------------------------------------------------- the tokenizer

def build_tokenizer(meta: dict, path: Path):
    """(tokenizers.Tokenizer, tokenizer_config dict) as transformers builds them from the same metadata; token types,
    scores, merges, flags and the chat template of the wrong type or length are a UserError naming their key."""
    kind, tokens = meta.get("tokenizer.ggml.model"), list(meta["tokenizer.ggml.tokens"])
    types = listing(path, meta, "tokenizer.ggml.token_type", int, len(tokens)) \
        if "tokenizer.ggml.token_type" in meta else [1] * len(tokens)
    scores = listing(path, meta, "tokenizer.ggml.scores", float, len(tokens)) \
        if "tokenizer.ggml.scores" in meta else None
    for key, want in (("add_bos_token", bool), ("add_eos_token", bool), ("chat_template", str), ("model", str),
                      ("pre", str)):
        key = f"tokenizer.{key}" if key == "chat_template" else f"tokenizer.ggml.{key}"
        if key in meta and not isinstance(meta[key], want):
            raise UserError(f"{path}: metadata '{key}' is {str(meta[key])[:40]!r}, not a "
                            f"{'boolean' if want is bool else 'string'}: the file is damaged; download it again")
    if kind == "gpt2":  # byte-level BPE (Llama 3, SmolLM)
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _BPE_SPLITS:
            raise UserError(f"{path}: pre-tokenizer '{pre}' is not supported (supported: {', '.join(_BPE_SPLITS)}): "
                            f"convert the Hugging Face checkpoint with scripts/convert_hf_checkpoint.py instead")
        # the vocabulary is spelled in GPT-2's byte alphabet; respell a token written with other characters
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        spelled = [t if set(t) <= alphabet else "".join(p for p, _ in to_bytes.pre_tokenize_str(t)) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        tokenizer = Tokenizer(models.BPE(vocab, merge_pairs(path, meta, vocab), fuse_unk=False,
                                         continuing_subword_prefix="", end_of_word_suffix=""))
        split = _BPE_SPLITS[pre]
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        whole = {t for t in tokens if set(t) <= alphabet}  # tokens that can be matched whole: not respelled ones
    elif kind == "llama":  # sentencepiece BPE with byte fallback (Llama 2, TinyLlama, Mistral)
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = merge_pairs(path, meta, vocab) if "tokenizer.ggml.merges" in meta \
            else merges_from_scores(vocab, dict(zip(tokens, scores or require(path, meta, "tokenizer.ggml.scores"))))
        tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(content=" ", left=1, right=0)])
        whole = set(tokens)
    else:
        raise UserError(f"{path}: tokenizer type '{kind}' is not supported (supported: gpt2, llama)")

    # unknown, control and named tokens are special tokens, matched whole; so are user-defined ones, unspecial
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}
    ids = {name: meta[f"tokenizer.ggml.{key}"] for name, key in keys.items() if f"tokenizer.ggml.{key}" in meta}
    for name, i in ids.items():
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(tokens):
            raise UserError(f"{path}: metadata 'tokenizer.ggml.{keys[name]}' is {repr(i)[:40]}, not a token id below "
                            f"{len(tokens)}: the file is damaged; download it again")
    named = {name: tokens[i] for name, i in ids.items()}
    special = [t for t, type_ in zip(tokens, types) if type_ in (_UNKNOWN, _CONTROL) and t in whole]
    special += [t for t in dict.fromkeys(named.values()) if t not in special and t in whole]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, type_ in zip(tokens, types) if type_ == _USER_DEFINED and t in whole])

    config = {"tokenizer_class": "PreTrainedTokenizerFast", **named,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    # BOS / EOS around every encoding, as transformers' TemplateProcessing adds them
    bos = ["bos_token"] if config["add_bos_token"] and "bos_token" in ids else []
    eos = ["eos_token"] if config["add_eos_token"] and "eos_token" in ids else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[f"{named[n]}:0" for n in bos] + ["$A:0"] + [f"{named[n]}:0" for n in eos],
        special_tokens=[(named[n], ids[n]) for n in bos + eos])
    return tokenizer, config


def merges_from_scores(vocab: dict, scores: dict) -> list:
    """A sentencepiece file lists no merges: every split of a token into two tokens is one, ranked by the
    merged token's score (as transformers' generate_merges ranks them)."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


# ----------------------------------------------------------------------------- converting

def check_out_dir(out: Path):
    """--out_dir: a directory, or one that can be made (no regular file on the way), refused before any work."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--out_dir {out}: {existing} is not a directory: name a directory for the checkpoint")


def convert(gguf_path, out_dir=None, dtype=torch.bfloat16) -> Path:
    path = Path(gguf_path)
    out = Path(out_dir) if out_dir else Path("checkpoints") / path.stem
    check_out_dir(out)
    meta, tensors = read_gguf(path)
    args = model_args(meta, tensors, path)
    plan = tensor_plan(args, tensors, path)
    tokenizer, tokenizer_config = build_tokenizer(meta, path)
    state_dict = {ours: torch.cat([dequantize(tensors[name], dtype) for name in names]) for ours, names in plan.items()}

    # all four or none; model.pth renamed in last: config.json without it never loads, it without config.json might
    # (with a config guessed from the directory's name)
    write_files_atomically(out, {
        "config.json": lambda tmp: tmp.write_text(json.dumps(args.to_hf_config(), indent=2) + "\n"),
        "tokenizer.json": lambda tmp: tokenizer.save(str(tmp)),
        "tokenizer_config.json": lambda tmp: tmp.write_text(json.dumps(tokenizer_config, indent=2) + "\n"),
        "model.pth": lambda tmp: torch.save(state_dict, tmp)})
    return out


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="the .gguf file to convert")
    p.add_argument("--out_dir", type=Path, default=None, help="checkpoint directory (default: checkpoints/<file stem>)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the dequantized weights (default bf16; fp32 keeps them exactly)")
    args = p.parse_args(argv)
    out = convert(args.gguf, args.out_dir, DTYPES[args.dtype])
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
