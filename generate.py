"""Text generation: prefill, one-token decode, speculative / tree / n-gram decoding, sampling, stats.

    python generate.py --checkpoint_path checkpoints/tiny/target/model.pth --prompt "def main(" --compile
    python generate.py ... --draft_checkpoint_path checkpoints/tiny/draft/model.pth --speculate_k 5
"""
import argparse
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from model import ModelArgs, Transformer
from tokenizer import get_tokenizer

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UserError(Exception):
    """Bad input from the command line; printed as one line, no traceback."""


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
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= sampling.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -float("inf"))
    return torch.softmax(logits, dim=-1)


def sample_from(probs: Tensor) -> Tensor:
    # exponential race: argmax(p / E), E ~ Exp(1), draws index i with probability p_i, without a host sync
    noise = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / noise, dim=-1)


def sample(logits: Tensor, sampling: Sampling):
    probs = logits_to_probs(logits, sampling)
    return sample_from(probs), probs


# ----------------------------------------------------------------------------- plain decoding

def prefill(model: Transformer, x: Tensor, input_pos: Tensor, sampling: Sampling) -> Tensor:
    """Run the prompt [B, T] through the model, fill the cache, return the first new token [B]."""
    logits = model(x, input_pos)
    return sample(logits[:, -1], sampling)[0]


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

    def __post_init__(self):
        if self.forward is None:
            self.forward = self.model


def compile_engine(model: Transformer, device: str, compile_prefill: bool) -> Engine:
    """Decode: one static-shape graph (CUDA graphs on GPU). Prefill: one dynamic-shape graph.
    On CPU, inductor's freezing (weights folded in as constants) measured fastest; see BENCHMARKS.md."""
    import torch._inductor.config as inductor_config
    if device == "cpu":
        inductor_config.freezing = True
    inductor_config.coordinate_descent_tuning = device != "cpu"
    inductor_config.triton.unique_kernel_names = True
    mode = "reduce-overhead" if device.startswith("cuda") else None
    engine = Engine(model)
    engine.decode_one_token = torch.compile(decode_one_token, mode=mode, fullgraph=True, dynamic=False)
    engine.forward = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
    if compile_prefill:
        engine.prefill = torch.compile(prefill, fullgraph=True, dynamic=True)
    return engine


def decode_n_tokens(engine: Engine, token: Tensor, pos: int, n: int, sampling: Sampling,
                    eos_ids: list, stop_at_eos: bool, callback=None) -> list:
    """Plain autoregressive decoding of up to n tokens after `token` (already sampled, at position pos)."""
    batch = token.shape[0]
    out = []
    eos = torch.tensor(eos_ids or [-1], device=token.device)
    for i in range(n):
        input_pos = torch.full((batch, 1), pos + i, device=token.device, dtype=torch.long)
        with sdpa_context():
            token, _ = engine.decode_one_token(engine.model, token.view(batch, 1), input_pos, sampling)
        token = token.clone()
        out.append(token)
        if callback:
            callback(token)
        if stop_at_eos and bool(torch.isin(token, eos).all()):
            break
    return out


def sdpa_context():
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- loading

def load_model(checkpoint_path, device="cpu", precision=torch.float32, shard=None) -> Transformer:
    """A checkpoint file (model.pth, or a quantized file written by quantize.py) and the config.json
    beside it. The file records its own quantization scheme. `shard(model)` (tensor parallelism) runs
    on the memory-mapped weights, so each rank reads and moves to its device only its own slice."""
    path = Path(checkpoint_path)
    if not path.is_file():
        hint = " (pass the model.pth file, not its directory)" if path.is_dir() else \
            "; download and convert one with scripts/prepare.sh ORG/MODEL, or train the tiny pair with scripts/train_tiny.py"
        raise UserError(f"checkpoint not found: {path}{hint}")
    args = ModelArgs.from_checkpoint_dir(path.parent)
    checkpoint = torch.load(str(path), mmap=True, weights_only=True, map_location="cpu")
    scheme = checkpoint.get("quantization") if isinstance(checkpoint.get("quantization"), dict) else None
    state_dict = checkpoint["model"] if scheme else checkpoint
    with torch.device("meta"):
        model = Transformer(args)
    if scheme:
        import quantize
        quantize.apply_quantization_scheme(model, scheme)
    if args.tie_word_embeddings and "output.weight" not in state_dict:
        state_dict = dict(state_dict, **{"output.weight": state_dict["tok_embeddings.weight"]})
    model.load_state_dict(state_dict, assign=True, strict=True)
    if args.tie_word_embeddings and not scheme:
        model.output.weight = model.tok_embeddings.weight
    if shard is not None:
        shard(model)
    model = model.to(device=device)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != precision and "scales" not in name:
            tensor.data = tensor.data.to(precision)
    if scheme:
        quantize.pack_for_device(model)  # int4 on the CPU: the kernel's weight layout, made after sharding
    model.quantization = scheme
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- one generation

def generate(target: Engine, prompt: Tensor, max_new_tokens: int, sampling: Sampling, eos_ids: list,
             stop_at_eos: bool = True, batch_size: int = 1, drafter=None, callback=None):
    """Generate up to max_new_tokens after `prompt` (1-D ids). Returns (new ids [B, n], stats dict).
    With a drafter (see speculate.py) every step drafts a token tree and the target verifies it in
    one forward; without one, tokens come one per target forward."""
    device = prompt.device
    T = prompt.numel()
    max_seq_length = T + max_new_tokens + (drafter.lookahead if drafter else 0) + 1
    model = target.model
    model.setup_caches(batch_size, max_seq_length)
    x = prompt.view(1, -1).repeat(batch_size, 1)
    input_pos = torch.arange(T, device=device).view(1, -1).repeat(batch_size, 1)
    with sdpa_context():
        first = target.prefill(model, x, input_pos, sampling).clone()
    if drafter is not None:
        tokens, stats = drafter.generate(target, prompt, first, max_new_tokens, sampling, eos_ids, stop_at_eos, callback)
        return tokens, stats
    if callback:
        callback(first)
    eos = set(eos_ids)
    rest = []
    if max_new_tokens > 1 and not (stop_at_eos and all(t in eos for t in first.tolist())):
        rest = decode_n_tokens(target, first, T, max_new_tokens - 1, sampling, eos_ids, stop_at_eos, callback)
    tokens = torch.stack([first] + rest, dim=1)
    if stop_at_eos:
        tokens = [truncate_at_eos(row, eos) for row in tokens.tolist()]
    else:
        tokens = tokens.tolist()
    return tokens, {"target_forwards": len(rest) + 1}


def truncate_at_eos(ids: list, eos: set) -> list:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Low-latency Llama generation (plain, speculative, tree, n-gram)")
    p.add_argument("--prompt", default="Hello, my name is",
                   help="text, or an integer N for a synthetic prompt of N tokens")
    p.add_argument("--interactive", action="store_true", help="chat in a loop, streaming tokens")
    p.add_argument("--num_samples", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means exact argmax (greedy)")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"))
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--speculate_k", default="5", help="draft depth K (>= 1), or 'auto' for an adaptive depth")
    p.add_argument("--tree_nodes", type=int, default=None,
                   help="draft tokens verified per target forward; equal to speculate_k means a chain")
    p.add_argument("--draft_ngram", type=int, default=0, metavar="N",
                   help="draft from an N-gram trie of the prompt and output (e.g. 3): alone, or with a draft model "
                        "and --tree_nodes, merged into the draft's tree")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile_prefill", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU (bf16 mat-vec is slower than fp32 on many CPUs)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace of the last sample")
    p.add_argument("--stats_json", type=Path, default=None)
    return p.parse_args(argv)


def check_args(args):
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top_k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_samples < 1 or args.batch_size < 1:
        raise UserError("--num_samples and --batch_size must be >= 1")
    if args.speculate_k != "auto":
        try:
            k = int(args.speculate_k)
        except ValueError:
            raise UserError(f"--speculate_k must be an integer >= 1 or 'auto', got {args.speculate_k!r}")
        if k < 1:
            raise UserError(f"--speculate_k must be >= 1 (the number of draft tokens per step), got {k}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")


def encode_prompt(args, tokenizer, vocab_size: int, bos_id, device) -> list:
    if args.prompt.strip().isdigit():
        n = int(args.prompt)
        generator = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, vocab_size, (n,), generator=generator).tolist()
    else:
        ids = tokenizer.encode(args.prompt)
    if bos_id is not None:
        ids = [bos_id] + ids
    return ids


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_args(args)
    import speculate
    torch.manual_seed(args.seed)
    device = args.device
    precision = PRECISIONS[args.precision or ("bf16" if device.startswith("cuda") else "fp32")]
    # tensor parallelism when launched by torchrun with more than one process (see tp.py): every rank
    # runs this same program on the same tokens from the same seed; only rank 0 prints and writes files
    rank, world_size, shard = 0, 1, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import tp
        rank, world_size = tp.init_distributed(device)
        shard = functools.partial(tp.apply_tp, rank=rank, world_size=world_size)

    t0 = time.perf_counter()
    model = load_model(args.checkpoint_path, device, precision, shard=shard)
    tokenizer = get_tokenizer(args.checkpoint_path.parent)
    draft_model = None
    if args.draft_checkpoint_path is not None:  # the draft is small: replicated on every rank (see tp.py)
        draft_model = load_model(args.draft_checkpoint_path, device, precision)
        speculate.check_same_vocabulary(model, draft_model, tokenizer, args)
    load_seconds = time.perf_counter() - t0

    bos_id = model.args.bos_token_id if model.args.bos_token_id is not None else tokenizer.bos_id
    eos_ids = sorted(set(model.args.eos_token_ids) | set(tokenizer.eos_ids))
    prompt_ids = encode_prompt(args, tokenizer, model.args.vocab_size, bos_id, device)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)

    drafter = speculate.make_drafter(args, draft_model, device)
    needed = len(prompt_ids) + args.max_new_tokens
    if needed > model.args.block_size:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) + --max_new_tokens ({args.max_new_tokens})"
            f" = {needed} exceeds the model's context of "
            f"{model.args.block_size} tokens: shorten the prompt or lower --max_new_tokens")
    if drafter is not None and args.batch_size > 1:
        raise UserError("speculative decoding runs at --batch_size 1 (it is a latency tool); drop --batch_size")

    target = Engine(model)
    compile_seconds = 0.0
    if args.compile:
        target = compile_engine(model, device, args.compile_prefill)
        if drafter is not None:
            drafter.compile(device)

    is_chat = args.interactive
    printer = (lambda *a, **k: print(*a, **k)) if rank == 0 else (lambda *a, **k: None)
    printer(f"Loaded {args.checkpoint_path} in {load_seconds:.2f} s"
            f"{' (quantization: ' + model.quantization['mode'] + ')' if model.quantization else ''}"
            f"{f' (tensor parallel over {world_size} ranks)' if world_size > 1 else ''}")
    read_prompt = tp.read_prompt if world_size > 1 else input  # under TP rank 0 reads, every rank gets the text
    prompt = torch.tensor(prompt_ids, device=device, dtype=torch.long)
    samples, stats = [], {}
    # sample 0 is a warm-up when compiling (its time includes compilation) and is not counted
    counted_from = 1 if args.compile else 0
    total = args.num_samples + counted_from if not is_chat else 10**9
    i = 0
    while i < total:
        if is_chat:
            try:
                text = read_prompt("What is your prompt? ")
            except EOFError:
                break
            ids = chat_format(tokenizer, text, bos_id)
            prompt = torch.tensor(ids, device=device, dtype=torch.long)
        profile = args.profile is not None and i == total - 1 and rank == 0
        streamed = []

        def stream(token):
            if is_chat and rank == 0:
                streamed.append(int(token[0]))
                print(tokenizer.decode(streamed[-1:]), end="", flush=True)

        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        prof = torch.profiler.profile() if profile else contextlib.nullcontext()
        with prof:
            tokens, stats = generate(target, prompt, args.max_new_tokens, sampling, eos_ids,
                                     stop_at_eos=not args.ignore_eos, batch_size=args.batch_size,
                                     drafter=drafter, callback=stream if is_chat else None)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        if profile:
            prof.export_chrome_trace(str(args.profile))
        if i < counted_from:
            compile_seconds = seconds
            printer(f"Compilation (warm-up sample) took {seconds:.2f} s")
            i += 1
            continue
        n = sum(len(row) for row in tokens)
        sample = {"tokens": tokens[0], "text": tokenizer.decode(tokens[0]), "seconds": seconds,
                  "tokens_per_sec": n / seconds}
        if args.batch_size > 1:
            sample["batch_tokens"] = tokens
        samples.append(sample)
        if not is_chat:
            printer(tokenizer.decode(prompt_ids[1:] if bos_id is not None else prompt_ids) + sample["text"])
        printer(f"\nSample {len(samples)}: {n} tokens in {seconds:.2f} s, {n / seconds:.2f} tokens/s, "
                f"{model_bytes(model, world_size) * n / args.batch_size / seconds / 1e9:.2f} GB/s")
        if drafter is not None:
            printer(speculate.format_stats(stats))
        i += 1

    result = summarize(args, model, device, precision, prompt_ids, samples, stats, compile_seconds,
                       drafter, world_size)
    printer(f"Average: {result['tokens_per_sec']:.2f} tokens/s, {result['bandwidth_gbs']:.2f} GB/s")
    if "peak_memory_gb" in result:
        printer(f"Peak memory: {result['peak_memory_gb']:.2f} GB")
    if args.stats_json and rank == 0:
        write_json_atomically(args.stats_json, result)
    return result


def model_bytes(model: Transformer, world_size: int) -> int:
    return model.model_bytes()  # per rank under tensor parallelism: each rank reads its shard


def summarize(args, model, device, precision, prompt_ids, samples, stats, compile_seconds, drafter, world_size):
    tokens_per_sec = sum(s["tokens_per_sec"] for s in samples) / max(len(samples), 1)
    nbytes = model_bytes(model, world_size)
    result = {
        "device": device, "precision": {v: k for k, v in PRECISIONS.items()}[precision],
        "compile": bool(args.compile), "speculative": drafter.kind if drafter else "none",
        "quantization": (model.quantization or {}).get("mode", "none"),
        "world_size": world_size, "batch_size": args.batch_size,
        "prompt_tokens": prompt_ids, "samples": samples, "tokens_per_sec": tokens_per_sec,
        "bandwidth_gbs": nbytes * tokens_per_sec / args.batch_size / 1e9, "model_bytes": nbytes,
        "compile_seconds": compile_seconds,
    }
    if drafter is not None:
        result.update(drafter.summary())
    if device.startswith("cuda"):
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:
        import resource
        result["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return result


def chat_format(tokenizer, text: str, bos_id) -> list:
    """Llama 3 header format when the tokenizer knows its special tokens, else Llama 2 [INST]."""
    processor = getattr(tokenizer, "processor", None)
    if hasattr(processor, "token_to_id") and processor.token_to_id("<|start_header_id|>") is not None:
        text = (f"<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"
                f"<|start_header_id|>assistant<|end_header_id|>\n\n")
        ids = processor.encode(text, add_special_tokens=False).ids
    else:
        ids = tokenizer.encode(f"[INST] {text.strip()} [/INST]")
    return ([bos_id] if bos_id is not None else []) + ids


def write_json_atomically(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    # run main() from the module that speculate.py, tp.py and quantize.py import (`import generate`),
    # so that the UserError they raise is the class caught here, not a second copy made for __main__
    import generate
    try:
        generate.main()
        error = None
    except (generate.UserError, FileNotFoundError, ValueError) as e:
        error = f"error: {e}"  # one line, no traceback (under torchrun: from every rank)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import tp
        tp.end_process(error)
    sys.exit(error)
