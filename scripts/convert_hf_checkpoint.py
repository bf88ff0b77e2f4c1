"""Convert a Hugging Face Llama-family checkpoint into our layout: DIR/model.pth.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf

Reads config.json and the weights (`*.safetensors` shards, with or without their index, or
`pytorch_model*.bin` shards), fuses q/k/v into one `wqkv` per layer, and writes model.pth atomically.
`hf_to_ours` / `ours_to_hf` are exact inverses; `export_hf` writes one of our checkpoints back out
in Hugging Face form (benchmarks run transformers on our weights through it).
"""
import argparse
import functools
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
import errors  # noqa: E402
from errors import UserError, check_tensors, load_weights, run_cli, write_files_atomically  # noqa: E402

errors.interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

from model import ModelArgs, Transformer, halves_to_pairs, pairs_to_halves  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# ours <- Hugging Face, per layer ("{i}" is the layer index); q/k/v are fused separately
_LAYER_MAP = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
# buffers some old checkpoints saved; recomputed by model.py, so dropped here
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _progress(iterable, total, desc):
    """tqdm when there is enough work to watch, plain iteration otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, disable=total < 4 or not sys.stderr.isatty())


# ----------------------------------------------------------------------------- the mapping

def hf_to_ours(hf_state_dict: dict, args: ModelArgs) -> dict:
    """Hugging Face LlamaForCausalLM names and RoPE layout -> ours. Raises UserError on missing keys."""
    sd = dict(hf_state_dict)
    if "model.embed_tokens.weight" not in sd and "embed_tokens.weight" in sd:  # a bare LlamaModel
        sd = {k if k.startswith("lm_head.") else "model." + k: v for k, v in sd.items()}
    wanted = list(_TOP_MAP.values())
    for i in range(args.n_layer):
        wanted += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        wanted += [f"model.layers.{i}.{name}" for name in _LAYER_MAP.values()]
    missing = [k for k in wanted if k not in sd]
    if missing:
        raise UserError(
            f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}: it does not match "
            f"config.json (n_layer={args.n_layer}) or is not a Llama-family checkpoint; re-download it "
            f"with scripts/download.py or fix config.json")
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied embeddings

    ours = {ours_key: sd.pop(hf_key) for ours_key, hf_key in _TOP_MAP.items()}
    ours["output.weight"] = sd.pop("lm_head.weight")
    for i in _progress(range(args.n_layer), args.n_layer, "layers"):
        prefix = f"model.layers.{i}."
        q, k, v = (sd.pop(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv")
        ours[f"layers.{i}.attention.wqkv.weight"] = torch.cat([
            halves_to_pairs(q, args.n_head, args.head_dim),
            halves_to_pairs(k, args.n_local_heads, args.head_dim), v])
        for ours_name, hf_name in _LAYER_MAP.items():
            ours[f"layers.{i}.{ours_name}"] = sd.pop(prefix + hf_name)
    unused = [k for k in sd if not _IGNORED.match(k)]
    if unused:
        raise UserError(
            f"checkpoint has {len(unused)} weight(s) our Llama model has no place for, e.g. {unused[:3]}: "
            f"biases and other architectures are not supported (is config.json's n_layer right?)")
    return ours


def ours_to_hf(our_state_dict: dict, args: ModelArgs) -> dict:
    """Exact inverse of hf_to_ours. With tied embeddings lm_head.weight is left out, as
    transformers' save_pretrained leaves it out."""
    sd = our_state_dict
    hf = {hf_key: sd[ours_key] for ours_key, hf_key in _TOP_MAP.items()}
    if not args.tie_word_embeddings:
        hf["lm_head.weight"] = sd["output.weight"]
    q_size, kv_size = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    for i in range(args.n_layer):
        prefix = f"model.layers.{i}."
        q, k, v = sd[f"layers.{i}.attention.wqkv.weight"].split([q_size, kv_size, kv_size])
        hf[f"{prefix}self_attn.q_proj.weight"] = pairs_to_halves(q, args.n_head, args.head_dim)
        hf[f"{prefix}self_attn.k_proj.weight"] = pairs_to_halves(k, args.n_local_heads, args.head_dim)
        hf[f"{prefix}self_attn.v_proj.weight"] = v
        for ours_name, hf_name in _LAYER_MAP.items():
            hf[prefix + hf_name] = sd[f"layers.{i}.{ours_name}"]
    return hf


# ----------------------------------------------------------------------------- reading and writing

def weight_files(checkpoint_dir: Path) -> list:
    """The shards to read: those an index names (each a file inside checkpoint_dir, checked before any is read),
    else every model shard present."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint_dir / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
                reason = f"no {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
                raise UserError(f"cannot read {index} ({reason}): the download is incomplete or damaged; "
                                f"run scripts/download.py again") from None
            if not all(isinstance(n, str) for n in names):
                raise UserError(f"{index}: its weight_map does not name shard files: run scripts/download.py again")
            outside = [n for n in names if not inside(checkpoint_dir, n)]
            if outside:  # a downloaded index must not make us read (and copy into model.pth) any file we can reach
                raise UserError(f"{index} names a shard outside {checkpoint_dir}: {outside[0]!r}; shards must be "
                                f"files in the checkpoint directory: run scripts/download.py again")
            absent = [n for n in names if not (checkpoint_dir / n).is_file()]
            if absent:
                raise UserError(f"{index} names shards that are not in {checkpoint_dir}, e.g. {absent[0]}: "
                                 f"the download is incomplete; run scripts/download.py again")
            return [checkpoint_dir / n for n in names]
    # consolidated*.safetensors (Mistral's own format) duplicates the HF shards under other names
    files = sorted(p for p in checkpoint_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    return files or sorted(checkpoint_dir.glob("pytorch_model*.bin"))


def inside(directory: Path, name: str) -> bool:
    """`name` is a relative path to a file within directory: no absolute path, no `..`, no symbolic link (of the
    file or a folder on the way) that leads out of it."""
    if not name or "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    root = directory.resolve()
    return (directory / name).resolve().is_relative_to(root)


def load_hf_weights(files: list) -> dict:
    from safetensors.torch import load_file
    state_dict = {}
    for path in _progress(files, len(files), "shards"):
        try:
            if path.suffix == ".safetensors":
                shard = load_file(str(path))
            else:
                try:
                    shard = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # pre-zipfile torch.save format cannot be memory-mapped
                    shard = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, empty, random bytes (SafetensorError, UnpicklingError, ...)
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot read {path} ({reason}): the download is incomplete or damaged; "
                            f"run scripts/download.py again") from None
        if not isinstance(shard, dict) or not all(isinstance(v, torch.Tensor) for v in shard.values()):
            raise UserError(f"{path} does not hold a state dict of tensors: run scripts/download.py again")
        check_tensors(shard, path, fix="run scripts/download.py again")
        state_dict.update(shard)
    return state_dict


def check_fits(state_dict: dict, args: ModelArgs, checkpoint_dir: Path):
    """The converted weights load into config.json's model exactly (names and shapes), as generation.load_model
    will require: nothing is written for a checkpoint that could not load."""
    with torch.device("meta"):
        model = Transformer(args)
    load_weights(model, state_dict, checkpoint_dir / "model.pth")


def resolve_args(checkpoint_dir: Path, model_name=None) -> ModelArgs:
    """From config.json; without one, from the known-config table."""
    if (checkpoint_dir / "config.json").is_file():
        return ModelArgs.from_checkpoint_dir(checkpoint_dir)
    try:
        return ModelArgs.from_name(model_name or checkpoint_dir.name)
    except UserError as e:
        raise UserError(f"no config.json in {checkpoint_dir} and {e}") from None


def convert_hf_checkpoint(checkpoint_dir, model_name=None, dtype=None) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint directory {checkpoint_dir} does not exist: "
                         f"run scripts/download.py --repo_id ORG/NAME first")
    files = weight_files(checkpoint_dir)
    if not files:
        raise UserError(f"no weights found in {checkpoint_dir} (expected *.safetensors or pytorch_model*.bin): "
                         f"run scripts/download.py --repo_id ORG/NAME first")
    has_config = (checkpoint_dir / "config.json").is_file()
    args = resolve_args(checkpoint_dir, model_name)
    weights = load_hf_weights(files)
    try:
        ours = hf_to_ours(weights, args)
    except RuntimeError as e:  # q/k/v of a size the config's heads cannot reshape
        raise UserError(f"the weights in {checkpoint_dir} do not match its config ({str(e)[:200]}): fix "
                        f"config.json or re-download the checkpoint") from None
    except UserError as e:
        raise UserError(f"{checkpoint_dir}: {e}") from None
    check_fits(ours, args, checkpoint_dir)
    if dtype is not None:
        converted = {}  # one conversion per storage, so tied weights stay shared
        ours = {k: converted.setdefault(id(v), v.to(dtype)) for k, v in ours.items()}
    files = {"model.pth": lambda tmp: torch.save(ours, tmp)}
    if not has_config:  # the checkpoint carries its own config from now on; both appear, or neither
        config = json.dumps(args.to_hf_config(), indent=2) + "\n"
        files = {"config.json": lambda tmp: tmp.write_text(config), **files}
    write_files_atomically(checkpoint_dir, files)
    return checkpoint_dir / "model.pth"


def export_hf(checkpoint_dir, out_dir) -> Path:
    """One of our checkpoint dirs (or its model.pth) -> a Hugging Face dir transformers can load:
    config.json + model.safetensors, plus the tokenizer files found beside the checkpoint."""
    from safetensors.torch import save_file
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    weights = checkpoint_dir if checkpoint_dir.is_file() else checkpoint_dir / "model.pth"
    checkpoint_dir = weights.parent
    if not weights.is_file():
        raise UserError(f"no model.pth in {checkpoint_dir}: convert it first with scripts/convert_hf_checkpoint.py")
    args = ModelArgs.from_checkpoint_dir(checkpoint_dir)
    ours = torch.load(str(weights), map_location="cpu", weights_only=True, mmap=True)
    if isinstance(ours.get("quantization"), dict):
        raise UserError(f"{weights} is quantized; export the unquantized model.pth instead")
    hf = {k: v.contiguous().clone() for k, v in ours_to_hf(ours, args).items()}  # safetensors wants owned tensors
    config = args.to_hf_config()
    config["torch_dtype"] = config["dtype"] = str(hf["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    files = {"config.json": lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"),
             "model.safetensors": lambda tmp: save_file(hf, str(tmp), metadata={"format": "pt"})}
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (checkpoint_dir / name).is_file() and checkpoint_dir.resolve() != out_dir.resolve():
            files[name] = functools.partial(shutil.copyfile, checkpoint_dir / name)
    write_files_atomically(out_dir, files)
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--model_name", default=None,
                   help="known-config name to use when the directory has no config.json (default: its name)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the weights (default: keep the checkpoint's dtype)")
    args = p.parse_args(argv)
    out = convert_hf_checkpoint(args.checkpoint_dir, args.model_name, DTYPES.get(args.dtype))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
