"""Train the offline models: a small Llama *target*, a *draft* distilled from it, and a draft with its own vocabulary.

    python scripts/train_tiny.py                       # -> checkpoints/tiny/{target,draft,draft_othertok}, ~5-8 min
    python scripts/train_tiny.py --preset test         # ~15 s; a small but really trained set (tests, CI)
    python scripts/train_tiny.py --text_dir DIR --out_dir OUT --seed 1

Text: this Python's standard-library sources (no test/, idlelib, site-packages), or every UTF-8 text
file under --text_dir, in sorted order. Every 20th file is held out; the list goes to OUT/heldout_files.txt
(benchmarks take code prompts from there). Steps:
  1. a sentencepiece BPE tokenizer with byte fallback that keeps whitespace, so code round-trips exactly
  2. the target, trained from scratch (AdamW, warmup + cosine decay, bf16 autocast where the device has native bf16)
  3. the draft, distilled from the finished target: KL to the target's next-token distribution plus
     cross-entropy on the text (Hinton et al. 2015); a draft that imitates the target is what makes
     speculative decoding accept its tokens
  4. a draft with a tokenizer of its own (3/4 of the vocabulary, digits kept together), trained as a language
     model on the same text and, for most windows, on the target's own continuations of training text
     (sequence-level distillation, Kim & Rush 2016: across vocabularies the target's text can be imitated, its
     next-token distribution cannot): OUT/draft_othertok, for cross-tokenizer speculation (crossdraft.py)
  5. evaluation from the written checkpoints: held-out loss of all three, and greedy agreement (how often the
     draft's argmax equals the target's along the target's greedy continuation of held-out prompts)
Each OUT/{target,draft,draft_othertok} holds config.json (Hugging Face schema), tokenizer.model (the same
file in target and draft) and model.pth; OUT/train_stats.json holds the figures. Same --seed, same machine:
same weights.
"""
import argparse
import io
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli, write_atomically, write_files_atomically  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import sentencepiece  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import ModelArgs, Transformer  # noqa: E402

BOS_ID, EOS_ID = 1, 2
HELDOUT_EVERY = 20  # file i is held out when i % 20 == 10
STDLIB_EXCLUDED = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Preset:
    target: dict  # ModelArgs fields besides the vocabulary
    draft: dict
    vocab_size: int
    batch_size: int
    seq_len: int  # most steps; the last `long_fraction` of each run uses batch/2 x 2*seq_len
    long_fraction: float
    target_steps: int
    draft_steps: int
    target_lr: float
    draft_lr: float
    distill_weight: float  # loss = w * KL(target || draft) + (1 - w) * cross-entropy
    tokenizer_chars: int  # text sample sentencepiece learns from
    max_chars: int  # 0: all the text
    eval_windows: int
    prompts: int  # greedy agreement: prompts x new tokens
    prompt_len: int
    new_tokens: int
    imitate_rows: int  # draft_othertok's sequence-level distillation: the target's continuations of this many
    imitate_tokens: int  # training-text windows of prompt_len tokens, this many tokens each
    threads: int  # 0: torch's default; tiny models run fastest on one


PRESETS = {
    # ~12M-parameter target, ~1.6M draft (2 layers, ~10x fewer FLOPs per token), 4096 tokens
    "default": Preset(
        target=dict(dim=384, n_layer=5, n_head=6), draft=dict(dim=128, n_layer=2, n_head=2),
        vocab_size=4096, batch_size=8, seq_len=256, long_fraction=0.2, target_steps=360, draft_steps=260,
        target_lr=2e-3, draft_lr=3e-3, distill_weight=0.8, tokenizer_chars=3_000_000, max_chars=0,
        eval_windows=32, prompts=8, prompt_len=64, new_tokens=64, imitate_rows=512, imitate_tokens=192, threads=0),
    "test": Preset(
        target=dict(dim=64, n_layer=2, n_head=2), draft=dict(dim=32, n_layer=1, n_head=1),
        vocab_size=512, batch_size=8, seq_len=64, long_fraction=0.25, target_steps=300, draft_steps=200,
        target_lr=3e-3, draft_lr=3e-3, distill_weight=0.8, tokenizer_chars=200_000, max_chars=600_000,
        eval_windows=8, prompts=8, prompt_len=16, new_tokens=32, imitate_rows=32, imitate_tokens=64, threads=1),
}


def log(msg: str):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------- text

def read_text_file(path: Path):
    """The file's text, or None for binary, non-UTF-8 or blank files."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def load_corpus(text_dir, max_chars: int):
    """[(path, text)] in a deterministic order: sorted by path relative to the root."""
    if text_dir is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = [p for p in root.rglob("*.py") if not STDLIB_EXCLUDED & set(p.relative_to(root).parts[:-1])]
    else:
        root = Path(text_dir)
        if not root.is_dir():
            raise UserError(f"--text_dir {root} is not a directory: pass a directory of text files")
        paths = [p for p in root.rglob("*")
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    corpus, chars = [], 0
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        text = read_text_file(path)
        if text is not None:
            corpus.append((path, text))
            chars += len(text)
            if max_chars and chars >= max_chars:
                break
    if not corpus:
        raise UserError(f"no text files under {root}: --text_dir needs a directory with UTF-8 text files "
                        f"(e.g. .py, .txt)")
    if len(corpus) < 2:
        raise UserError(f"only one text file under {root}: need at least two (one is held out for evaluation)")
    return root, corpus


def split_heldout(corpus):
    """Every 20th file (index 10, 30, ...) is held out; with fewer than 11 files, the last one."""
    heldout = [i for i in range(len(corpus)) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2] or [len(corpus) - 1]
    train = [c for i, c in enumerate(corpus) if i not in set(heldout)]
    return train, [corpus[i] for i in heldout]


def train_tokenizer(train_corpus, vocab_size: int, sample_chars: int, split_digits: bool = True) -> bytes:
    """Sentencepiece BPE that round-trips code exactly: identity normalization, whitespace kept as
    pieces (runs of indentation become single tokens), "\\n" as its own symbol (sentencepiece learns
    from lines, so newlines only exist as a user-defined symbol), unknown characters as UTF-8 bytes;
    digits one by one unless split_digits is False."""
    total = sum(len(text) for _, text in train_corpus)
    stride = max(1, total // max(sample_chars, 1))  # spread the sample over the whole corpus
    lines, chars = [], 0
    for _, text in train_corpus[::stride]:
        lines.extend(line for line in text.split("\n") if line)
        chars += len(text)
        if chars >= sample_chars:
            break
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, split_by_whitespace=False,
            allow_whitespace_only_pieces=True, split_digits=split_digits, user_defined_symbols=["\n"],
            unk_id=0, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1, num_threads=1,
            shuffle_input_sentence=False, input_sentence_size=0, max_sentence_length=8192, minloglevel=2)
    except RuntimeError as e:
        raise UserError(f"sentencepiece could not learn {vocab_size} tokens from {chars} characters "
                         f"of text ({e}): give --text_dir more text") from e
    return model.getvalue()


def token_stream(tokenizer, corpus) -> torch.Tensor:
    """All files as one stream of ids, each file framed as BOS ... EOS."""
    ids = []
    for piece in tokenizer.encode([text for _, text in corpus]):
        ids += [BOS_ID, *piece, EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


# -------------------------------------------------------------------------------------------- models

def build_model(args: ModelArgs, seed: int) -> Transformer:
    """GPT-2-style init: N(0, 0.02), residual output projections scaled down by sqrt(2 * layers)."""
    torch.manual_seed(seed)
    model = Transformer(args)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            residual = name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
            torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * args.n_layer) if residual else 0.02)
    return model


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def use_shape(model: Transformer, batch: int, seq: int, dtype):
    """(Re)allocate the KV cache for exactly batch x seq: training runs one full causal forward per step,
    so the cache is scratch space of the sequence's length (a larger one would widen attention)."""
    if (model.max_batch_size, model.max_seq_length) != (batch, seq):
        model.max_batch_size = model.max_seq_length = -1
        model.setup_caches(batch, seq, dtype=dtype)


def detach_caches(model: Transformer):
    # the cache is written in place inside the autograd graph; cut it loose before the next step
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.detach_()
        layer.attention.kv_cache.v_cache.detach_()


def forward_full(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return model(x, pos)


def batch_shape(preset: Preset, step: int, steps: int):
    long = step >= round(steps * (1 - preset.long_fraction))  # teach positions up to 2 * seq_len
    return (max(1, preset.batch_size // 2), 2 * preset.seq_len) if long else (preset.batch_size, preset.seq_len)


def train(model, stream, preset: Preset, steps: int, lr: float, seed: int, settings, name: str, teacher=None,
          imitate=None):
    """AdamW with linear warmup and cosine decay to 10%; with a teacher, distillation (KL + CE). imitate: a second
    stream (the teacher's own text, target_continuations) each window comes from with probability
    preset.distill_weight."""
    device, dtype = settings.device, settings.autocast_dtype
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, steps // 20)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0, report_every, running = time.perf_counter(), max(1, steps // 10), []
    for step in range(steps):
        B, T = batch_shape(preset, step, steps)
        if imitate is None:
            sources, starts = [stream] * B, torch.randint(0, len(stream) - T - 1, (B,), generator=gen).tolist()
        else:
            sources = [imitate if torch.rand((), generator=gen) < preset.distill_weight else stream for _ in range(B)]
            starts = [int(torch.randint(0, len(source) - T - 1, (), generator=gen)) for source in sources]
        chunk = torch.stack([source[s:s + T + 1] for source, s in zip(sources, starts)]).to(device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        use_shape(model, B, T, dtype)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = forward_full(model, x).float()
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
            loss = ce
            if teacher is not None:
                use_shape(teacher, B, T, dtype)
                with torch.no_grad():
                    target_logp = F.log_softmax(forward_full(teacher, x).float(), dim=-1)
                kl = F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True,
                              reduction="none").sum(-1).mean()
                loss = preset.distill_weight * kl + (1 - preset.distill_weight) * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        detach_caches(model)
        running.append(ce.item())
        if (step + 1) % report_every == 0 or step + 1 == steps:
            log(f"  {name} step {step + 1}/{steps}  loss {loss.item():.3f}  ce {sum(running) / len(running):.3f}"
                f"  {time.perf_counter() - t0:.0f}s")
            running = []
    return time.perf_counter() - t0


IMITATE_BATCH = 64  # rows the target continues at once


@torch.no_grad()
def target_continuations(target, stream, preset: Preset, device, seed: int) -> list:
    """The target's own text, for the sequence-level distillation (Kim & Rush 2016) of a draft that cannot be taught
    the target's next-token distribution because its vocabulary differs: the target continues preset.imitate_rows
    windows of the training stream (prompt_len tokens each) by imitate_tokens tokens, even rows greedily (what
    verification at temperature 0 accepts), odd rows drawn at temperature 1 (the target's distribution). Returns each
    row's ids, prompt and continuation (target ids)."""
    P = preset.prompt_len
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - P, (preset.imitate_rows,), generator=gen)
    rows = []
    for batch in starts.split(IMITATE_BATCH):
        x = torch.stack([stream[s:s + P] for s in batch.tolist()]).to(device)  # [b, P]
        greedy = torch.arange(len(batch), device=device) % 2 == 0  # [b]
        rows += torch.cat([x, continue_rows(target, x, preset.imitate_tokens, greedy, gen)], 1).tolist()  # [b, P + N]
    return rows


@torch.no_grad()
def continue_rows(model, x, n: int, greedy, gen=None) -> torch.Tensor:
    """n tokens after each row of x [b, P], one at a time through the KV cache: the argmax in rows where greedy [b]
    is True, elsewhere a draw at temperature 1 from gen (drawn for every row while any samples). Returns [b, n]."""
    B, P = x.shape
    sampling = not bool(greedy.all())
    use_shape(model, B, P + n, None)
    logits, tokens = forward_full(model, x)[:, -1], []
    for i in range(n):
        token = logits.argmax(-1)  # [b]
        if sampling:
            drawn = torch.multinomial(logits.float().softmax(-1).cpu(), 1, generator=gen).view(-1).to(x.device)
            token = torch.where(greedy, token, drawn)
        tokens.append(token)
        if i + 1 < n:
            logits = model(token.view(-1, 1), torch.full((B, 1), P + i, device=x.device))[:, -1]
    return torch.stack(tokens, 1)


def retokenize(rows: list, source, dest) -> torch.Tensor:
    """Rows of `source` ids as one stream of `dest` ids, the same text: the pieces between BOS / EOS (which both
    tokenizers number alike) decoded and encoded again; each row ends with EOS."""
    ids = []
    for row in rows:
        piece = []
        for t in row + [EOS_ID]:
            if t in (BOS_ID, EOS_ID):
                ids += dest.encode(source.decode(piece)) + [t]
                piece = []
            else:
                piece.append(t)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------- evaluation

def load_checkpoint(directory: Path, device) -> Transformer:
    model = Transformer(ModelArgs.from_checkpoint_dir(directory))
    model.load_state_dict(torch.load(directory / "model.pth", weights_only=True), strict=True)
    return model.to(device).eval()


@torch.no_grad()
def heldout_loss(model, stream, preset: Preset, device):
    """Held-out cross-entropy on evenly spread windows of the stream, and the model's argmaxes there."""
    T = min(preset.seq_len, len(stream) - 1)
    n = min(preset.eval_windows, (len(stream) - 1) // T)
    starts = torch.linspace(0, len(stream) - T - 1, n).long().tolist()
    chunk = torch.stack([stream[s:s + T + 1] for s in starts]).to(device)
    total, argmax = 0.0, []
    for rows in chunk.split(preset.batch_size):
        use_shape(model, rows.shape[0], T, None)
        logits = forward_full(model, rows[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        argmax.append(logits.argmax(-1))
    return total / (n * T), torch.cat(argmax)


def heldout_eval(target, draft, stream, preset: Preset, device):
    """Held-out cross-entropy of both models, and how often their argmaxes agree on that text (teacher-forced
    agreement)."""
    (target_loss, target_argmax), (draft_loss, draft_argmax) = (heldout_loss(model, stream, preset, device)
                                                                for model in (target, draft))
    return {"target": target_loss, "draft": draft_loss}, (target_argmax == draft_argmax).float().mean().item()


@torch.no_grad()
def greedy_agreement(target, draft, stream, newline_id: int, preset: Preset, device):
    """Fraction of positions, along the target's greedy continuation of held-out prompts, where the draft's
    argmax equals the target's: the per-token acceptance rate of greedy speculative decoding."""
    P, N = preset.prompt_len, preset.new_tokens
    prompts = []
    for i in range(preset.prompts):  # prompts end right after a newline, spread over the held-out text
        end = P + (len(stream) - 2 * P) * i // max(1, preset.prompts)
        while end < len(stream) - 1 and stream[end - 1].item() != newline_id:
            end += 1
        prompts.append(torch.cat([torch.tensor([BOS_ID]), stream[end - P + 1:end]]))
    prompts = torch.stack(prompts).to(device)
    B = prompts.shape[0]
    continuation = continue_rows(target, prompts, N, torch.ones(B, dtype=torch.bool, device=device))  # [B, N]
    use_shape(draft, B, P + N, None)
    draft_logits = forward_full(draft, torch.cat([prompts, continuation[:, :-1]], dim=1))
    return (draft_logits[:, P - 1:].argmax(-1) == continuation).float().mean().item()


# ---------------------------------------------------------------------------------------------- main

def save_checkpoint(directory: Path, args: ModelArgs, model: Transformer, tokenizer_bytes: bytes):
    config = json.dumps(args.to_hf_config(), indent=2) + "\n"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    write_files_atomically(directory, {  # one set: a new tokenizer beside old weights would be garbage
        "config.json": lambda tmp: tmp.write_text(config),
        "tokenizer.model": lambda tmp: tmp.write_bytes(tokenizer_bytes),
        "model.pth": lambda tmp: torch.save(state, tmp)})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="default: the real pair (~5-8 min on 2 CPU cores); test: ~15 s, for tests")
    parser.add_argument("--out_dir", type=Path, default=Path("checkpoints/tiny"),
                        help="writes OUT/target, OUT/draft, OUT/draft_othertok, OUT/heldout_files.txt, "
                             "OUT/train_stats.json")
    parser.add_argument("--text_dir", default=None,
                        help="directory of UTF-8 text files to learn from (default: the Python standard library)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="training compute (bf16 autocast keeps fp32 weights; ~2x faster on CPUs with native "
                             "bf16, ~10x slower on those without); auto: bf16 where the device has it natively")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the preset's choice)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on device (CUDA with bf16; a CPU with AVX-512 BF16 or AMX): elsewhere
    autocast emulates them, a training step then took 30 s instead of 1 s in float32 on a 2-core AVX2 CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def main(argv=None) -> dict:
    settings = parse_args(argv)
    preset = PRESETS[settings.preset]
    settings.device = torch.device(settings.device)
    if settings.precision == "auto":
        settings.precision = "bf16" if native_bf16(settings.device) else "fp32"
    settings.autocast_dtype = torch.bfloat16 if settings.precision == "bf16" else None
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads or preset.threads or threads)
    try:
        return run(settings, preset)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside test sessions


def run(settings, preset: Preset) -> dict:
    t_start = time.perf_counter()
    out = settings.out_dir
    text = prepare_text(settings.text_dir, preset, out, t_start)
    configs = {name: ModelArgs(**getattr(preset, name), vocab_size=text.tokenizer.vocab_size(),
                               block_size=2 * preset.seq_len, bos_token_id=BOS_ID, eos_token_ids=[EOS_ID])
               for name in ("target", "draft")}
    seconds, continuations = train_pair(settings, preset, text, configs, out)
    other_tokenizer, configs["draft_othertok"], seconds["draft_othertok"] = train_othertok(
        settings, preset, text, continuations, out)
    stats = evaluate(settings, preset, text, other_tokenizer, configs, seconds, out)
    stats["seconds"] = time.perf_counter() - t_start
    write_atomically(out / "train_stats.json", lambda tmp: tmp.write_text(json.dumps(stats, indent=2) + "\n"))
    report(stats, preset, out)
    return stats


@dataclass
class Text:
    """The text the models learn from, its held-out files apart, and the target's tokenizer over both."""
    root: Path
    train_corpus: list
    heldout_corpus: list
    tokenizer_bytes: bytes
    tokenizer: sentencepiece.SentencePieceProcessor
    train_stream: list
    heldout_stream: list


def prepare_text(text_dir, preset: Preset, out: Path, t_start: float) -> Text:
    """The corpus read and split, the tokenizer trained on its training part, the held-out files listed in
    out/heldout_files.txt; too little text is refused."""
    root, corpus = load_corpus(text_dir, preset.max_chars)
    train_corpus, heldout_corpus = split_heldout(corpus)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_bytes = train_tokenizer(train_corpus, preset.vocab_size, preset.tokenizer_chars)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_bytes)
    train_stream, heldout_stream = token_stream(tokenizer, train_corpus), token_stream(tokenizer, heldout_corpus)
    if len(train_stream) < 2 * preset.seq_len + 2 or len(heldout_stream) < 2 * preset.prompt_len + 2:
        raise UserError(f"too little text under {root} ({len(train_stream)} training tokens): "
                         f"give --text_dir more text")
    heldout_list = "".join(f"{path}\n" for path, _ in heldout_corpus)
    write_atomically(out / "heldout_files.txt", lambda tmp: tmp.write_text(heldout_list))
    log(f"text: {len(train_corpus)} files ({len(train_stream)} tokens) for training, {len(heldout_corpus)} "
        f"held out ({len(heldout_stream)} tokens) from {root}; vocab {tokenizer.vocab_size()}; "
        f"{time.perf_counter() - t_start:.1f}s")
    return Text(root, train_corpus, heldout_corpus, tokenizer_bytes, tokenizer, train_stream, heldout_stream)


def train_pair(settings, preset: Preset, text: Text, configs: dict, out: Path) -> tuple:
    """The target trained, then the draft distilled from it, each saved; then the target's continuations of
    training windows (the text draft_othertok imitates). Returns ({name: train seconds}, the continuations)."""
    seconds = {}
    target = build_model(configs["target"], settings.seed).to(settings.device)
    log(f"target: {param_count(target) / 1e6:.2f}M parameters, {preset.target_steps} steps")
    seconds["target"] = train(target, text.train_stream, preset, preset.target_steps, preset.target_lr,
                              settings.seed, settings, "target")
    save_checkpoint(out / "target", configs["target"], target, text.tokenizer_bytes)

    draft = build_model(configs["draft"], settings.seed + 1).to(settings.device)
    log(f"draft: {param_count(draft) / 1e6:.2f}M parameters, {preset.draft_steps} steps distilled from the target")
    target.eval()
    seconds["draft"] = train(draft, text.train_stream, preset, preset.draft_steps, preset.draft_lr,
                             settings.seed + 1, settings, "draft", teacher=target)
    save_checkpoint(out / "draft", configs["draft"], draft, text.tokenizer_bytes)
    started = time.perf_counter()
    continuations = target_continuations(target, text.train_stream, preset, settings.device, settings.seed + 3)
    seconds["target_continuations"] = time.perf_counter() - started
    log(f"target: continued {len(continuations)} training-text windows by {preset.imitate_tokens} tokens each "
        f"(for draft_othertok) in {seconds['target_continuations']:.0f}s")
    return seconds, continuations


def train_othertok(settings, preset: Preset, text: Text, continuations: list, out: Path) -> tuple:
    """A draft with a tokenizer of its own, for cross-tokenizer speculation (crossdraft.py): 3/4 of the target's
    vocabulary, learned from the same text with digits kept together, so many strings split differently; a
    language model on its own token stream and on the target's continuations (its distribution cannot be
    distilled token by token across vocabularies, its text can). Returns (its tokenizer, config, train seconds)."""
    other_bytes = train_tokenizer(text.train_corpus, preset.vocab_size * 3 // 4, preset.tokenizer_chars,
                                  split_digits=False)
    other_tokenizer = sentencepiece.SentencePieceProcessor(model_proto=other_bytes)
    other_stream = token_stream(other_tokenizer, text.train_corpus)
    config = ModelArgs(**preset.draft, vocab_size=other_tokenizer.vocab_size(), block_size=2 * preset.seq_len,
                       bos_token_id=BOS_ID, eos_token_ids=[EOS_ID])
    other = build_model(config, settings.seed + 2).to(settings.device)
    log(f"draft_othertok: {param_count(other) / 1e6:.2f}M parameters, its own {other_tokenizer.vocab_size()}-token "
        f"vocabulary, {preset.draft_steps} steps, {preset.distill_weight:.0%} of the windows from the target's text")
    imitate = retokenize(continuations, text.tokenizer, other_tokenizer)
    seconds = train(other, other_stream, preset, preset.draft_steps, preset.draft_lr, settings.seed + 2, settings,
                    "draft_othertok", imitate=imitate)
    save_checkpoint(out / "draft_othertok", config, other, other_bytes)
    return other_tokenizer, config, seconds


def evaluate(settings, preset: Preset, text: Text, other_tokenizer, configs: dict, seconds: dict, out: Path) -> dict:
    """What was written, evaluated in fp32 as generate.py will load it: held-out losses, the draft's agreement
    with the target (greedy and teacher-forced). Returns the run's stats (train_stats.json)."""
    target, draft = load_checkpoint(out / "target", settings.device), load_checkpoint(out / "draft", settings.device)
    losses, forced_agreement = heldout_eval(target, draft, text.heldout_stream, preset, settings.device)
    newline_id = text.tokenizer.piece_to_id("\n")
    agreement = greedy_agreement(target, draft, text.heldout_stream, newline_id, preset, settings.device)
    vocab_size = text.tokenizer.vocab_size()
    stats = {
        "preset": settings.preset, "seed": settings.seed, "precision": settings.precision,
        "text_dir": str(text.root), "train_files": len(text.train_corpus), "heldout_files": len(text.heldout_corpus),
        "train_tokens": len(text.train_stream), "heldout_tokens": len(text.heldout_stream),
        "vocab_size": vocab_size, "uniform_loss": math.log(vocab_size),
        "greedy_agreement": agreement, "teacher_forced_agreement": forced_agreement,
        "agreement_prompts": preset.prompts, "agreement_new_tokens": preset.new_tokens,
        "preset_settings": asdict(preset),
    }
    other = load_checkpoint(out / "draft_othertok", settings.device)
    losses["draft_othertok"] = heldout_loss(other, token_stream(other_tokenizer, text.heldout_corpus), preset,
                                            settings.device)[0]
    stats["draft_othertok_vocab_size"] = other_tokenizer.vocab_size()
    stats["draft_othertok_uniform_loss"] = math.log(other_tokenizer.vocab_size())
    for name, model in (("target", target), ("draft", draft), ("draft_othertok", other)):
        stats[name] = {"params": param_count(model), "heldout_loss": losses[name],
                       "heldout_ppl": math.exp(losses[name]), "train_seconds": seconds[name],
                       "config": configs[name].to_hf_config()}
    return stats


def report(stats: dict, preset: Preset, out: Path):
    for name in ("target", "draft", "draft_othertok"):
        s = stats[name]
        log(f"{name}: {s['params'] / 1e6:.2f}M params, held-out loss {s['heldout_loss']:.3f} "
            f"(ppl {s['heldout_ppl']:.1f}; uniform {math.log(s['config']['vocab_size']):.2f}), "
            f"trained {s['train_seconds']:.0f}s")
    log(f"greedy agreement {stats['greedy_agreement']:.1%} ({preset.prompts} held-out prompts x {preset.new_tokens} "
        f"target greedy tokens); teacher-forced agreement on held-out text {stats['teacher_forced_agreement']:.1%}")
    log(f"wrote {out}/target, {out}/draft, {out}/draft_othertok, {out}/heldout_files.txt, {out}/train_stats.json "
        f"in {stats['seconds']:.0f}s")


if __name__ == "__main__":
    sys.exit(run_cli(main))
