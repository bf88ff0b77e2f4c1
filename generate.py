"""Generate text with a Llama-family checkpoint: load, check the flags, run the samples, report the stats.

    python generate.py --checkpoint_path checkpoints/tiny/target/model.pth --prompt "def main(" --compile
    python generate.py ... --draft_checkpoint_path checkpoints/tiny/draft/model.pth --speculate_k 5

Where a token comes from: generate() prefills the prompt (decode.prefill), then either decodes one
token per target forward (decode.decode_n_tokens) or, with a drafter, lets speculate.py draft a token
tree, verify it in one target forward and rewind the KV cache to the accepted path.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

import draftmodel
import speculate
from decode import PRECISIONS, Engine, Sampling, compile_engine, decode_n_tokens, sdpa_context, whole_graph_mode
from model import ModelArgs, Transformer, UserError, load_weights, read_checkpoint, write_atomically
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
    with torch.device("meta"):
        model = Transformer(args)
    if scheme:
        import quantize
        try:
            quantize.apply_quantization_scheme(model, scheme)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UserError(f"{path} does not hold a state dict of tensors: re-convert it")
    if args.tie_word_embeddings and "output.weight" not in state_dict:
        state_dict = dict(state_dict, **{"output.weight": state_dict["tok_embeddings.weight"]})
    load_weights(model, state_dict, path)
    wrong = [name for name, t in model.state_dict().items()
             if t.is_floating_point() != state_dict.get(name, t).is_floating_point()]
    if wrong:  # assign=True takes the file's dtypes: integer weights where floats belong would fail mid-run
        raise UserError(f"{path}: {wrong[0]} holds {state_dict[wrong[0]].dtype} values where the model needs "
                        f"floating point (or the reverse): re-convert the checkpoint")
    if args.tie_word_embeddings and not scheme:
        model.output.weight = model.tok_embeddings.weight
    if shard is not None:
        shard(model)
    model = model.to(device=device)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != precision and "scales" not in name:
            tensor.data = tensor.data.to(precision)
    if scheme:
        import quantize
        quantize.pack_for_device(model)  # int4 on the CPU: the kernel's weight layout, made after sharding
    model.use_fast_weight_layout()  # e.g. fp32 on the CPU: column-major weights (model.column_major_is_faster)
    model.quantization = scheme
    model.checkpoint_path = path  # named by errors found while running it (NaN logits)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- one generation

@torch.no_grad()  # also lets inductor freeze the weights into the compiled graphs (decode.compile_engine)
def generate(target: Engine, prompt, max_new_tokens: int, sampling: Sampling, eos_ids: list,
             stop_at_eos: bool = True, batch_size: int = 1, drafter=None, callback=None):
    """Generate up to max_new_tokens after `prompt`: 1-D ids (repeated on batch_size rows), or a list of
    prompts (lists of ids, of any lengths), one row each. Returns (new ids, one list per row; stats).
    With a drafter (speculate.py) every step drafts a token tree and the target verifies it in one
    forward; without one, tokens come one per target forward."""
    model = target.model
    device = model.tok_embeddings.weight.device
    prompts = [list(p) for p in prompt] if isinstance(prompt, list) else [prompt.tolist()] * batch_size
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = max(len(p) for p in prompts)
    model.setup_caches(len(prompts), T + max_new_tokens + (drafter.lookahead if drafter else 0) + 1)
    x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # [B, T], right-padded
    input_pos = torch.arange(T, device=device).expand(len(prompts), T)  # [B, T]
    with sdpa_context():
        first, finite = target.prefill(model, x, input_pos, sampling, lengths - 1)
    if not bool(finite):  # one look at the host per generation: NaN weights would otherwise decode token 0 forever
        source = getattr(model, "checkpoint_path", "the checkpoint")
        raise UserError(f"the model's logits for the prompt are NaN or infinite: the weights in {source} are broken; "
                        f"re-convert or re-download it (or try --precision fp32)")
    first = first.clone()
    if drafter is not None:
        return drafter.generate(target, prompts, first, max_new_tokens, sampling, eos_ids, stop_at_eos, callback)
    if callback:
        callback(first)
    eos = set(eos_ids)
    rest = []
    if max_new_tokens > 1 and not (stop_at_eos and all(t in eos for t in first.tolist())):
        rest = decode_n_tokens(target, first, lengths, max_new_tokens - 1, sampling, eos_ids, stop_at_eos, callback)
    rows = torch.stack([first] + rest, dim=1).tolist()  # [B, n]
    if stop_at_eos:
        rows = [truncate_at_eos(row, eos) for row in rows]
    return rows, {"target_forwards": len(rest) + 1}


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
    p.add_argument("--interactive", action="store_true",
                   help="chat in a loop in the checkpoint's own chat template, streaming tokens")
    p.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the checkpoint's chat template (one user turn)")
    p.add_argument("--num_samples", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=1,
                   help="rows decoded together: copies of --prompt, or the next B prompts of --prompts_file")
    p.add_argument("--prompts_file", type=Path, default=None,
                   help="one prompt per line (plain text, or JSON lines with a \"prompt\" field), run --batch_size "
                        "at a time; each row's text and ids go to --stats_json 'rows'")
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
    p.add_argument("--compile_prefill", action="store_true", help="with --compile: a dynamic-shape prefill graph")
    p.add_argument("--compile_whole_graph", action="store_true",
                   help="with --compile on CPU: the whole model as one frozen graph (minutes to compile for a deep "
                        "model) instead of one compiled block reused by every layer (the CPU default above "
                        "decode.WHOLE_GRAPH_MAX_LAYERS layers; CUDA always compiles the whole graph, replayed as a "
                        "CUDA graph)")
    p.add_argument("--compile_autotune", action="store_true",
                   help="with --compile: the whole graph, with every matmul shape timed against inductor's own "
                        "kernels (C++ GEMM templates on CPU) and the fastest kept: the fastest decode, minutes to "
                        "compile the first time (inductor's caches keep the choices)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU (bf16 mat-vec is slower than fp32 on many CPUs)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace of the last sample")
    p.add_argument("--stats_json", type=Path, default=None)
    return p.parse_args(argv)


def check_args(args):
    """Flags that cannot work, refused before anything is loaded. Returns the draft depth (int or "auto")."""
    for name in ("temperature", "top_p"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise UserError(f"--{name} must be a finite number, got {value}")
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
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in [0, 2^63), got {args.seed}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError("--prompt is not valid UTF-8 text: pass the prompt in UTF-8") from None
    if args.compile_prefill and not args.compile:
        raise UserError("--compile_prefill compiles the prefill beside the decode graph: add --compile")
    for flag in ("compile_whole_graph", "compile_autotune"):
        if getattr(args, flag) and not args.compile:
            raise UserError(f"--{flag} chooses how --compile compiles: add --compile")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise UserError(f"--device {args.device}: use cpu or cuda (cuda:N)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    for flag, path in (("--stats_json", args.stats_json), ("--profile", args.profile)):
        if path is not None:
            check_output_file(path, flag)
    if args.speculate_k == "auto":
        return "auto"
    try:
        depth = int(args.speculate_k)
    except ValueError:
        raise UserError(f"--speculate_k must be an integer >= 1 or 'auto', got {args.speculate_k!r}") from None
    if depth < 1:
        raise UserError(f"--speculate_k must be >= 1 (the number of draft tokens per step), got {depth}")
    return depth


def check_output_file(path: Path, flag: str):
    """--stats_json / --profile: a new file, or one this program wrote (JSON), in a writable directory.
    Anything else (a checkpoint, a directory, a device) is refused before the run, not clobbered after it."""
    flag = f"{flag} {path}"
    if path.is_dir():
        raise UserError(f"{flag} is a directory: name a file in it")
    if path.exists():
        if not path.is_file():
            raise UserError(f"{flag} exists and is not a regular file: name a new .json file")
        try:
            with open(path, "rb") as f:
                head = f.read(1).strip()
        except OSError as e:
            raise UserError(f"{flag} cannot be read ({e.strerror}): name a new .json file") from None
        if head not in (b"{", b"[", b""):
            raise UserError(f"{flag} exists and is not a JSON file this program wrote: name a new file")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{flag}: the directory {parent} does not exist: create it first")
    try:  # a file created and removed: os.access says yes to root, and to /sys or /proc
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.partial-{os.getpid()}-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag}: cannot write in {parent} ({e.strerror}): pick a writable directory") from None


def write_output(path: Path, flag: str, write):
    """write_atomically, a failure (the disk filled up during the run, the directory went away) one line."""
    try:
        write_atomically(path, write)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e}): free some space or pick another "
                        f"file") from None


def encode_prompt(prompt: str, tokenizer, vocab_size: int, seed: int, chat: bool = False) -> list:
    """The ids the model sees: the tokenizer's own (BOS added exactly as its Hugging Face tokenizer does), the
    chat template's rendering of one user turn (chat), or for a synthetic prompt "N" the tokenizer's special
    tokens and N random ids."""
    if chat:
        return tokenizer.chat_ids([{"role": "user", "content": prompt}])
    if prompt.strip().isdigit():
        n = int(prompt)
        if n > 10**7:
            raise UserError(f"--prompt {n}: a synthetic prompt of more than 10^7 tokens fits no model's context")
        generator = torch.Generator().manual_seed(seed)
        return tokenizer.encode_prompt("") + torch.randint(3, vocab_size, (n,), generator=generator).tolist()
    return tokenizer.encode_prompt(prompt)


def setup_distributed(device: str):
    """Tensor parallelism when launched by torchrun with more than one process (see tp.py): every rank runs
    this program on the same tokens from the same seed; only rank 0 prints and writes files.
    Returns (rank, world_size, shard function or None)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise UserError(f"WORLD_SIZE={world!r} is not a positive integer: launch with torchrun --nproc_per_node=N")
    if int(world) == 1:
        return 0, 1, None
    import tp
    rank, world_size = tp.init_distributed(device)
    return rank, world_size, functools.partial(tp.apply_tp, rank=rank, world_size=world_size)


def main(argv=None) -> dict:
    args = parse_args(argv)
    depth = check_args(args)
    torch.manual_seed(args.seed)
    device = args.device
    precision = PRECISIONS[args.precision or ("bf16" if device.startswith("cuda") else "fp32")]
    rank, world_size, shard = setup_distributed(device)
    say = print if rank == 0 else (lambda *a, **k: None)

    t0 = time.perf_counter()
    model = load_model(args.checkpoint_path, device, precision, shard=shard)
    tokenizer = get_tokenizer(args.checkpoint_path.parent)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise UserError(f"the tokenizer beside {args.checkpoint_path} has {tokenizer.vocab_size} tokens, more than the "
                        f"model's {model.args.vocab_size}: use the tokenizer the checkpoint came with")
    draft_model, drafter = None, None
    if args.draft_checkpoint_path is not None:  # the draft is small: replicated on every rank (see tp.py)
        draft_model = load_model(args.draft_checkpoint_path, device, precision)
        draft_tokenizer = get_tokenizer(args.draft_checkpoint_path.parent)
        if not speculate.same_vocabulary(tokenizer, draft_tokenizer, model.args.vocab_size,
                                         draft_model.args.vocab_size):
            import crossdraft  # another tokenizer: drafts travel as text, re-tokenized on each side
            drafter = crossdraft.make_drafter(draft_model, draft_tokenizer, tokenizer, model.args.vocab_size, depth,
                                              args.tree_nodes, args.draft_ngram, args.batch_size,
                                              args.prompts_file is not None)
    load_seconds = time.perf_counter() - t0
    if drafter is None:
        drafter = draftmodel.make_drafter(draft_model, depth, args.tree_nodes, args.draft_ngram, model.args.block_size)
    eos_ids = sorted(set(model.args.eos_token_ids) | set(tokenizer.eos_ids))
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    prompt_ids = encode_prompt(args.prompt, tokenizer, model.args.vocab_size, args.seed, chat=args.chat)
    if args.prompts_file:
        texts = read_prompts_file(args.prompts_file)
        ids = [encode_prompt(text, tokenizer, model.args.vocab_size, args.seed, chat=args.chat) for text in texts]
        batches = [ids[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
        prompt_ids = max(ids, key=len)
    check_fits(len(prompt_ids), args.max_new_tokens, model.args.block_size)

    target = Engine(model)
    if args.compile:
        whole_graph = True if args.compile_whole_graph else None  # None: compile_engine's default for the device
        target = compile_engine(model, device, args.compile_prefill, whole_graph, args.compile_autotune)
        if drafter is not None:
            drafter.compile(device, whole_graph=whole_graph, autotune=args.compile_autotune)
    say(f"Loaded {args.checkpoint_path} in {load_seconds:.2f} s"
        f"{' (quantization: ' + model.quantization['mode'] + ')' if model.quantization else ''}"
        f"{f' (tensor parallel over {world_size} ranks)' if world_size > 1 else ''}")

    def run(ids: list, callback=None, profile=False):
        """One generation (ids of one prompt, or a list of prompts' ids), timed: (rows of new ids, stats, seconds)."""
        prompt = ids if isinstance(ids[0], list) else torch.tensor(ids, device=device, dtype=torch.long)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        t = time.perf_counter()
        with torch.profiler.profile() if profile else contextlib.nullcontext() as prof:
            rows, stats = generate(target, prompt, args.max_new_tokens, sampling, eos_ids,
                                   stop_at_eos=not args.ignore_eos, batch_size=args.batch_size,
                                   drafter=drafter, callback=callback)
            sync()
        if profile:
            write_output(args.profile, "--profile", lambda tmp: prof.export_chrome_trace(str(tmp)))
        return rows, stats, time.perf_counter() - t

    # the cache for the longest prompt of the run, allocated once: a cache that grew later would change the
    # compiled graphs' shapes and compile them again (minutes with --compile_autotune)
    lookahead = drafter.lookahead if drafter else 0
    model.setup_caches(args.batch_size, len(prompt_ids) + args.max_new_tokens + 1 + lookahead)
    compile_seconds = 0.0
    if args.compile:  # a warm-up sample compiles the graphs; its time is reported, not counted
        compile_seconds = run(batches[0] if args.prompts_file else prompt_ids)[2]
        say(f"Compilation (warm-up sample) took {compile_seconds:.2f} s")
    rows = None
    if args.interactive:
        samples, stats = chat(run, tokenizer, model, rank, world_size, say)
    elif args.prompts_file:
        samples, stats, rows = run_prompts_file(run, batches, texts, tokenizer, model, say)
    else:
        samples, stats = [], {}
        for i in range(args.num_samples):
            rows, stats, seconds = run(prompt_ids, profile=args.profile is not None and i == args.num_samples - 1
                                       and rank == 0)
            samples.append(sample_record(rows, seconds, tokenizer))
            shown = tokenizer.decode(prompt_ids) if args.prompt.strip().isdigit() or args.chat else args.prompt
            say(shown + samples[-1]["text"])
            say(f"\nSample {i + 1}: " + report(samples[-1], model, args.batch_size))
            if drafter is not None:
                say(speculate.format_stats(stats))

    result = summarize(args, model, device, precision, prompt_ids, samples, stats, compile_seconds, drafter,
                       world_size)
    if rows is not None:
        result["rows"] = rows
    say(f"Average: {result['tokens_per_sec']:.2f} tokens/s, {result['bandwidth_gbs']:.2f} GB/s")
    say(f"Peak memory: {result['peak_memory_gb']:.2f} GB")
    if args.stats_json and rank == 0:
        write_output(args.stats_json, "--stats_json", lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))
    return result


def read_prompts_file(path: Path) -> list:
    """--prompts_file: one prompt per non-empty line, plain text or a JSON object with a "prompt" string."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts_file {path}: cannot read it ({e}): pass a UTF-8 text file") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"--prompts_file {path}, line {number}: a JSON line needs a \"prompt\" field") from None
            if not isinstance(line, str):
                raise UserError(f"--prompts_file {path}, line {number}: \"prompt\" must be a string")
        prompts.append(line)
    if not prompts:
        raise UserError(f"--prompts_file {path} holds no prompt: write one prompt per line")
    return prompts


def run_prompts_file(run, batches: list, texts: list, tokenizer, model, say):
    """--prompts_file: the prompts, --batch_size rows at a time. Returns (timed samples, stats, rows)."""
    samples, stats, rows = [], [], []
    for batch in batches:
        new, batch_stats, seconds = run(batch)
        stats.append(batch_stats)
        n = sum(len(r) for r in new)
        samples.append({"rows": len(batch), "seconds": seconds, "tokens_per_sec": n / seconds})
        for ids, tokens in zip(batch, new):
            text = texts[len(rows)]
            rows.append({"prompt": text, "prompt_tokens": ids, "tokens": tokens, "text": tokenizer.decode(tokens)})
            say(text + rows[-1]["text"] + "\n")
        say(f"Batch {len(samples)}: " + report(samples[-1], model, len(batch)))
    if "accept_counts" in stats[0]:  # speculative: acceptance over every batch
        say(speculate.format_stats(speculate.combine_stats(stats)))
        return samples, speculate.combine_stats(stats), rows
    return samples, {"target_forwards": sum(s["target_forwards"] for s in stats)}, rows


def check_fits(prompt_tokens: int, max_new_tokens: int, block_size: int):
    needed = prompt_tokens + max_new_tokens
    if needed > block_size:
        raise UserError(f"prompt ({prompt_tokens} tokens) + --max_new_tokens ({max_new_tokens}) = {needed} exceeds "
                        f"the model's context of {block_size} tokens: shorten the prompt or lower --max_new_tokens")


def chat(run, tokenizer, model, rank: int, world_size: int, say):
    """--interactive: read a question, answer it in the checkpoint's own chat template (streamed), keep the
    conversation, until end of input. Under tensor parallelism rank 0 reads and every rank gets the text."""
    import tp
    read = tp.read_prompt if world_size > 1 else read_line
    messages, samples, stats = [], [], {}
    stop = set(tokenizer.eos_ids) | set(model.args.eos_token_ids)
    while True:
        try:
            text = read("What is your prompt? ")
        except EOFError:
            return samples, stats
        messages.append({"role": "user", "content": text})
        ids = tokenizer.chat_ids(messages)
        check_fits(len(ids), 1, model.args.block_size)
        streamed, shown = [], [""]

        def stream(token):
            if rank == 0 and int(token[0]) not in stop:  # the end-of-turn token ends the answer, unprinted
                streamed.append(int(token[0]))
                text = tokenizer.decode(streamed)
                if not text.endswith("\ufffd"):  # print whole characters only (a token may end mid-UTF-8)
                    say(text[len(shown[0]):], end="", flush=True)
                    shown[0] = text

        rows, stats, seconds = run(ids, callback=stream)
        samples.append(sample_record(rows, seconds, tokenizer))
        say(f"\nSample {len(samples)}: " + report(samples[-1], model, 1))
        answer = [t for t in rows[0] if t not in stop]
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        say()


def read_line(question: str) -> str:
    """input(), with a closed stdin (no file descriptor 0 at all) read as the end of the input."""
    if sys.stdin is None:
        raise EOFError
    return input(question)


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


def summarize(args, model, device, precision, prompt_ids, samples, stats, compile_seconds, drafter, world_size):
    tokens_per_sec = sum(s["tokens_per_sec"] for s in samples) / max(len(samples), 1)
    nbytes = model.model_bytes()  # per rank under tensor parallelism: each rank reads its shard
    result = {
        "device": device, "precision": {v: k for k, v in PRECISIONS.items()}[precision],
        "compile": bool(args.compile), "speculative": drafter.kind if drafter else "none",
        "compile_mode": compile_mode(args, device, model.args.n_layer),
        "quantization": (model.quantization or {}).get("mode", "none"),
        "world_size": world_size, "batch_size": args.batch_size,
        "prompt_tokens": prompt_ids, "samples": samples, "tokens_per_sec": tokens_per_sec,
        "bandwidth_gbs": nbytes * tokens_per_sec / args.batch_size / 1e9, "model_bytes": nbytes,
        "compile_seconds": compile_seconds,
    }
    if drafter is not None:
        result.update(stats)
    if device.startswith("cuda"):
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:
        import resource
        result["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return result


def compile_mode(args, device: str, n_layer: int) -> str:
    """How --compile compiled the target (decode.compile_engine): none, regional, whole_graph or autotune."""
    if not args.compile:
        return "none"
    if args.compile_autotune:
        return "autotune"
    whole_graph = whole_graph_mode(device, args.compile_whole_graph or None, n_layer=n_layer)[0]
    return "whole_graph" if whole_graph else "regional"


def cli(argv=None) -> int:
    """main() for the command line: a user mistake is one line on stderr and status 1, Ctrl-C status 130."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up of temp files, as Ctrl-C does
    try:
        main(argv)
        error, status = None, 0
    except UserError as e:
        error, status = f"error: {e}", 1
    except KeyboardInterrupt:
        error, status = "error: interrupted", 130
    except RuntimeError as e:  # under torchrun: a collective whose peer is gone (it failed and printed why)
        if not lost_peer(e):
            raise
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        reason = reason.split("] ", 1)[-1].split(". ")[0][:160]  # "[.../pair.cc:537] Read error ...: reset by peer"
        error, status = (f"error: rank {torch.distributed.get_rank()} lost the other ranks ({reason}): another "
                         f"rank failed; its error is above"), 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import tp
        tp.end_process(error, status)
    if error:
        print(error, file=sys.stderr)
    return status


def lost_peer(e: RuntimeError) -> bool:
    """A collective failed because another rank went away (gloo: "Connection closed by peer"; NCCL)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or any(w in text for w in ("gloo", "NCCL", "closed by peer"))


if __name__ == "__main__":
    sys.exit(cli())
