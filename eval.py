"""What quantization, conversion, compilation and precision cost in quality: perplexity over a text file, computed as
llama.cpp's llama-perplexity computes it, the KL divergence from a base model in the same pass, and
lm-evaluation-harness tasks run on a checkpoint (docs/eval.md).

    python eval.py --checkpoint_path checkpoints/tiny/target/model_int8.pth --text FILE \
        --base checkpoints/tiny/target/model.pth --stats_json quality.json
    python eval.py --checkpoint_path checkpoints/tiny/target/model.pth --tasks NAME --include_path TASK_DIR

Where a number comes from: make_chunks() cuts the text's tokens into chunks, scored_span() picks the half of each
chunk that is scored, perplexity() runs the chunks batch by batch through the model (and the base) and Tally adds up
the scored tokens. The library part takes plain values; only main() reads flags; nothing imports this file.
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from errors import (UserError, check_output_file, flag_names, interruptible_imports, read_user_text, run_cli,
                    write_output)

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from compilation import COMPILE_MODES  # noqa: E402
from decode import PRECISIONS, Engine, Sampling, compile_engine, sdpa_context  # noqa: E402
from generation import Generator, check_engine_settings, load_model, reserve_caches  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


# ----------------------------------------------------------------------------- chunks: what is scored

def bos_of(tokenizer) -> Optional[int]:
    """The BOS id where the tokenizer adds one to a text (as its Hugging Face tokenizer does), else None."""
    ids = tokenizer.encode_prompt("a")
    return ids[0] if ids and tokenizer.bos_id is not None and ids[0] == tokenizer.bos_id else None


def make_chunks(tokens: list, ctx: int, bos_id: Optional[int] = None) -> torch.Tensor:
    """The text's ids cut as llama-perplexity cuts them: the stream (BOS, then the text, where the tokenizer adds BOS)
    in consecutive pieces of ctx tokens, the remainder dropped, and each piece's first token replaced by BOS, so that
    every chunk reads like the start of a document. Returns [n_chunks, ctx]."""
    stream = ([bos_id] if bos_id is not None else []) + list(tokens)
    n = len(stream) // ctx
    chunks = torch.tensor(stream[: n * ctx], dtype=torch.long).view(n, ctx)
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def scored_span(ctx: int):
    """(positions whose logits are scored, positions of the tokens they predict) in a chunk of ctx tokens. As
    llama-perplexity: the logits from position ctx/2 on, each predicting the next token from every earlier token of
    its chunk (so no scored token has fewer than ctx/2 tokens of context); the last position predicts nothing."""
    first = ctx // 2
    return slice(first, ctx - 1), slice(first + 1, ctx)


def chunk_logits(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The logits [B, stop - start, V] (float32) of positions start..stop-1 of the chunks x [B, ctx]: the output layer
    runs on those positions only."""
    h = model.hidden_states(x, input_pos)  # [B, ctx, dim]
    return model.output(model.norm(h[:, start:stop])).float()


# ----------------------------------------------------------------------------- the measures

@dataclass
class Tally:
    """Running sums over every scored token, in float64 on the host; result() turns them into the measures."""
    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    base_nll: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0
    same_top: int = 0
    dp2: float = 0.0
    compared: bool = False

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base_logits: Optional[torch.Tensor] = None):
        """logits, base_logits [T, V] float32 at the scored positions; targets [T]: the tokens they predict."""
        logp = torch.log_softmax(logits, -1)  # [T, V]
        nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()  # [T]
        self.count += nll.numel()
        self.nll += nll.sum().item()
        self.nll2 += (nll * nll).sum().item()
        if base_logits is None:
            return
        self.compared = True
        base_logp = torch.log_softmax(base_logits, -1)  # [T, V]
        base_nll = -base_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()  # [T]
        kl = (base_logp.exp() * (base_logp - logp)).sum(-1).double()  # [T]: KL(base || this) at each position
        dp = (-nll).exp() - (-base_nll).exp()  # [T]: p_this(next token) - p_base(next token)
        self.base_nll += base_nll.sum().item()
        self.kl += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.same_top += (logits.argmax(-1) == base_logits.argmax(-1)).sum().item()
        self.dp2 += (dp * dp).sum().item()

    def result(self) -> dict:
        """perplexity = exp(mean NLL); its standard error is llama-perplexity's: the standard error of the mean NLL
        (sample variance over the scored tokens), times the perplexity (d exp(x) = exp(x) dx)."""
        mean = self.nll / self.count
        variance = max(self.nll2 / self.count - mean * mean, 0.0)
        stderr = math.sqrt(variance / (self.count - 1)) if self.count > 1 else float("nan")
        result = {"perplexity": math.exp(mean), "perplexity_stderr": math.exp(mean) * stderr,
                  "tokens_scored": self.count}
        if self.compared:
            result.update(kl_mean=self.kl / self.count, kl_max=self.kl_max, same_top_token=self.same_top / self.count,
                          rms_dp=math.sqrt(self.dp2 / self.count))
        return result

    @property
    def base_perplexity(self) -> float:
        return math.exp(self.base_nll / self.count)


# ----------------------------------------------------------------------------- perplexity (and KL) over a text

@torch.no_grad()
def perplexity(model: Transformer, tokens: list, ctx: int, batch_size: int = 1, base: Optional[Transformer] = None,
               bos_id: Optional[int] = None, limit_chunks: Optional[int] = None, engine: Optional[Engine] = None,
               progress: bool = False) -> dict:
    """Perplexity of `model` over the text's ids `tokens` (no BOS: bos_id starts each chunk where the tokenizer adds
    one), chunks of ctx tokens, batch_size chunks per forward; with `base`, a model of the same vocabulary, the KL
    divergence KL(base || model) and the agreement of the two at the same positions, in the same pass. `engine`:
    model's compiled engine (decode.compile_engine). Returns the --stats_json measures, plus "compile_seconds" (the
    first compiled call, not counted in tokens_per_sec) and, with a base, "base_perplexity"."""
    chunks = make_chunks(tokens, ctx, bos_id)[:limit_chunks]
    if len(chunks) == 0:
        raise UserError(f"the text holds fewer than `ctx` = {ctx} tokens: use a longer text or a smaller `ctx`")
    if base is not None and base.args.vocab_size != model.args.vocab_size:
        raise UserError(f"the base has {base.args.vocab_size} tokens, the model {model.args.vocab_size}: compare "
                        f"two checkpoints of the same model")
    engine = engine or compile_engine(model, model.tok_embeddings.weight.device.type, "none")
    logits_at, targets_at = scored_span(ctx)
    # one static-shape graph where the engine compiles whole graphs; regional engines run their compiled forward
    scored = engine.compile(chunk_logits)
    forward = (lambda x, pos: scored(x, pos, logits_at.start, logits_at.stop)) if scored is not None else \
        (lambda x, pos: engine.forward(x, pos)[:, logits_at].float())
    device = model.tok_embeddings.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batch_size = min(batch_size, len(chunks))  # more rows than chunks would only hold memory
    reserve_caches(model, batch_size, ctx, base, "lower `batch_size` or `ctx`", tokens=ctx)
    if base is not None:
        compile_engine(base, base.tok_embeddings.weight.device.type, "none")  # its eager weight layout
        reserve_caches(base, batch_size, ctx, None, "lower `batch_size` or `ctx`", tokens=ctx)
    positions = torch.arange(ctx, device=device).expand(batch_size, ctx)  # [B, ctx]

    def batch(i: int) -> torch.Tensor:
        x = chunks[i: i + batch_size].to(device)
        if engine.mode != "none" and len(x) < batch_size:  # a compiled graph has one shape: pad the last batch
            x = torch.cat([x, x[:1].expand(batch_size - len(x), ctx)])
        return x

    compile_seconds = 0.0
    if engine.mode != "none":  # the first call compiles: timed apart
        t = time.perf_counter()
        with sdpa_context():
            forward(batch(0), positions)
        sync()
        compile_seconds = time.perf_counter() - t
    tally, seconds = Tally(), 0.0
    bar = tqdm(total=len(chunks), unit="chunk", desc="perplexity", disable=not progress, file=sys.stderr)
    for i in range(0, len(chunks), batch_size):
        x = batch(i)
        n = min(batch_size, len(chunks) - i)
        sync()
        t = time.perf_counter()
        with sdpa_context():
            logits = forward(x, positions[: len(x)])[:n]  # [n, ctx/2 - 1, V]
        sync()
        seconds += time.perf_counter() - t
        base_logits = None
        if base is not None:
            with sdpa_context():
                base_logits = chunk_logits(base, x[:n], positions[:n], logits_at.start, logits_at.stop)
        if not bool(torch.isfinite(logits).all()):
            source = getattr(model, "checkpoint_path", "the checkpoint")
            raise UserError(f"the model's logits are NaN or infinite: the weights in {source} are broken; re-convert "
                            f"or re-download it (or try `precision` fp32)")
        for row in range(n):  # one chunk at a time: [T, V] temporaries, not [B, T, V]
            tally.add(logits[row], x[row, targets_at], None if base_logits is None else base_logits[row])
        bar.update(n)
        bar.set_postfix(ppl=f"{math.exp(tally.nll / tally.count):.4f}")
    bar.close()
    result = tally.result()
    result.update(chunks=len(chunks), ctx=ctx, tokens_per_sec=len(chunks) * ctx / max(seconds, 1e-9),
                  compile_seconds=compile_seconds)
    if base is not None:
        result["base_perplexity"] = tally.base_perplexity
    return result


# ----------------------------------------------------------------------------- lm-evaluation-harness

class HarnessAdapter:
    """The three requests lm-evaluation-harness makes of a model, answered by a Generator: the log-likelihood of a
    continuation, of a whole text (rolling windows of max_length tokens), and greedy generation until a stop string.
    Plain methods over the requests' plain arguments, testable without lm-eval; harness_model() gives lm-eval its LM.
    Ids are the checkpoint's own: BOS first where the tokenizer adds one (lm-eval's Hugging Face model adds none by
    default), and an empty context is the BOS token (else EOS), as lm-eval's prefix token."""

    def __init__(self, generator: Generator, max_length: int, batch_size: int = 1, progress: bool = False):
        self.generator, self.model, self.tokenizer = generator, generator.model, generator.tokenizer
        self.max_length, self.batch_size, self.progress = max_length, batch_size, progress
        self.bos = bos_of(self.tokenizer)
        self.prefix = self.bos if self.bos is not None else (generator.eos_ids or [0])[0]
        self.device = self.model.tok_embeddings.weight.device
        # one cache for every request: scoring inputs and prompt + generated tokens are at most max_length long
        generator.reserve(batch_size, max_length, "lower `batch_size` or `ctx`", tokens=max_length)

    def encode(self, text: str) -> list:
        return ([self.bos] if self.bos is not None else []) + self.tokenizer.encode(text)

    def encode_pair(self, context: str, continuation: str):
        """(context ids, continuation ids) as lm-eval splits them: the context's trailing spaces belong to the
        continuation; the continuation's ids are the whole text's after the context's, so a word is tokenized as it
        would be in running text."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix], self.tokenizer.encode(continuation)
        context_ids = self.encode(context)
        return context_ids, self.encode(context + continuation)[len(context_ids):]

    @torch.no_grad()
    def score(self, pairs: list) -> list:
        """(log-probability of the continuation, whether greedy decoding gives it) for each (context ids, continuation
        ids); the input is cut from the left to max_length tokens. Rows run batch_size at a time, longest first,
        right-padded: a causal model's logits never see the padding after them."""
        rows = []
        for context, continuation in pairs:
            full = (context + continuation)[-(self.max_length + 1):]
            rows.append((full[:-1], continuation[-self.max_length:]))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results = [None] * len(rows)
        for start in tqdm(range(0, len(order), self.batch_size), desc="loglikelihood", disable=not self.progress,
                          file=sys.stderr):
            group = order[start: start + self.batch_size]
            width = len(rows[group[0]][0])
            x = torch.tensor([rows[i][0] + [0] * (width - len(rows[i][0])) for i in group], device=self.device)
            with sdpa_context():
                logits = self.model(x, torch.arange(width, device=self.device).expand_as(x)).float()  # [B, T, V]
            for row, i in enumerate(group):
                inputs, continuation = rows[i]
                if not continuation:
                    results[i] = (0.0, True)
                    continue
                end = len(inputs)
                logp = torch.log_softmax(logits[row, end - len(continuation): end], -1)  # [n, V]
                target = torch.tensor(continuation, device=self.device)
                total = logp.gather(-1, target.unsqueeze(-1)).sum().item()
                results[i] = (total, bool((logp.argmax(-1) == target).all()))
        return results

    def loglikelihood(self, requests: list) -> list:
        """requests: (context, continuation) strings; returns (log-likelihood, is greedy) for each."""
        return self.score([self.encode_pair(context, continuation) for context, continuation in requests])

    def loglikelihood_rolling(self, texts: list) -> list:
        """The log-likelihood of each whole text after the prefix token, every token predicted exactly once: windows
        of up to max_length predictions, each with as much earlier text as fits (lm-eval's rolling windows with
        context_len 1)."""
        pairs, owner = [], []
        for n, text in enumerate(texts):
            stream = [self.prefix] + self.tokenizer.encode(text)
            done = 0  # stream[1:] are the tokens to predict; stream[k] is predicted from stream[:k]
            while done < len(stream) - 1:
                end = min(done + self.max_length, len(stream) - 1)
                first = max(0, end - self.max_length)
                pairs.append((stream[first: done + 1], stream[done + 1: end + 1]))
                owner.append(n)
                done = end
        totals = [0.0] * len(texts)
        for n, (logprob, _) in zip(owner, self.score(pairs)):
            totals[n] += logprob
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list) -> list:
        """requests: (context, gen_kwargs) with gen_kwargs' "until" (stop strings) and "max_gen_toks"; greedy
        decoding (sampling settings are ignored) through the Generator, the text cut before the first stop string.
        The context is cut from the left so that it and the new tokens fit max_length."""
        outputs = []
        eos = set(self.generator.eos_ids)
        for context, kwargs in tqdm(requests, desc="generate_until", disable=not self.progress, file=sys.stderr):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1))
            ids = self.encode(context)[-(self.max_length - max_new):] or [self.prefix]
            rows, _ = self.generator.generate(ids, max_new, Sampling(temperature=0))
            text = self.tokenizer.decode([t for t in rows[0] if t not in eos])
            cuts = [text.find(stop) for stop in until if stop and stop in text]
            outputs.append(text[: min(cuts)] if cuts else text)
        return outputs


def import_lm_eval():
    """lm-eval, imported only when tasks are asked for: it is optional."""
    try:
        import lm_eval
        import lm_eval.api.model
        import lm_eval.tasks
    except ImportError:
        raise UserError("`tasks` needs lm-evaluation-harness: pip install lm-eval") from None
    return lm_eval


def harness_model(adapter: HarnessAdapter):
    """The adapter as lm-eval's LM: lm-eval hands it Instances, whose .args are the plain tuples it answers."""
    base = import_lm_eval().api.model.LM

    class FastgenLM(base):
        def loglikelihood(self, requests):
            return adapter.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests):
            return adapter.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests):
            return adapter.generate_until([r.args for r in requests])

    return FastgenLM()


def task_manager(tasks: list, include_path: Optional[Path] = None):
    """lm-eval's task manager, with every name in `tasks` known to it (checked before any long work starts)."""
    lm_eval = import_lm_eval()
    manager = lm_eval.tasks.TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under `include_path` {include_path}" if include_path else " (add `include_path` DIR for yours)"
        raise UserError(f"unknown `tasks`: {', '.join(unknown)}: name tasks lm-eval knows{where}")
    return manager


def run_tasks(adapter: HarnessAdapter, tasks: list, include_path: Optional[Path] = None, manager=None) -> dict:
    """lm_eval.simple_evaluate of `tasks` (names, from lm-eval's own tasks or the YAML files under include_path)
    on the adapter's model (`manager`: task_manager's, where the caller checked the names already). Returns
    lm-eval's results: {task: {metric: value}}, and prints its table."""
    lm_eval, manager = import_lm_eval(), manager or task_manager(tasks, include_path)
    results = lm_eval.simple_evaluate(model=harness_model(adapter), tasks=tasks, task_manager=manager,
                                      log_samples=False)
    from lm_eval.utils import make_table
    print(make_table(results))
    return results["results"]


# ----------------------------------------------------------------------------- a whole run

@dataclass
class Settings:
    """One run's configuration (eval.py's flags, by the same names), checked in check() before any model work."""
    checkpoint_path: Path = Path("checkpoints/tiny/target/model.pth")
    text: Optional[Path] = None
    ctx: int = 512
    batch_size: int = 1
    base: Optional[Path] = None
    limit_chunks: Optional[int] = None
    stats_json: Optional[Path] = None
    compile: str = "none"
    device: str = "cpu"
    precision: Optional[str] = None  # None: bf16 on CUDA, fp32 on CPU (as generate.py)
    tasks: Optional[list] = None
    include_path: Optional[Path] = None

    def check(self):
        if self.base is not None and self.text is None:
            raise UserError("`base` is compared on a text: add `text` FILE")
        if self.text is None and not self.tasks:
            raise UserError("nothing to evaluate: give `text` FILE (perplexity) and/or `tasks` NAME (lm-eval)")
        if self.ctx < 4 or self.ctx % 2:
            raise UserError(f"`ctx` must be an even number >= 4 (the second half of each chunk is scored), "
                            f"got {self.ctx}")
        if self.batch_size < 1:
            raise UserError(f"`batch_size` must be >= 1, got {self.batch_size}")
        if self.limit_chunks is not None and self.limit_chunks < 1:
            raise UserError(f"`limit_chunks` must be >= 1, got {self.limit_chunks}")
        if self.include_path is not None and not self.tasks:
            raise UserError("`include_path` holds task files for `tasks`: add `tasks` NAME")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise UserError(f"`include_path` {self.include_path} is not a directory: pass the directory of your task "
                            f"YAML files")
        check_engine_settings(self.compile, self.precision, self.device)
        for name in ("checkpoint_path", "base"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                hint = "pass the model.pth file, not its directory" if Path(path).is_dir() else \
                    "pass a model.pth (or a file quantize.py wrote)"
                raise UserError(f"`{name}` {path}: checkpoint not found: {hint}")
        if self.stats_json is not None:
            check_output_file(Path(self.stats_json), "stats_json")
        if self.tasks:
            import_lm_eval()

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision or ("bf16" if self.device.startswith("cuda") else "fp32")]


def read_text(path: Path) -> str:
    return read_user_text(path, "text", "pass a UTF-8 text file")


def run(settings: Settings, say=print) -> dict:
    """A whole run: every check, then load, perplexity (and KL from the base) over the text, lm-eval tasks. Returns
    the --stats_json object. The base is the reference: fp32 and eager, whatever the model's precision and
    compilation, so that the KL measures what those cost."""
    settings.check()
    checkpoint = Path(settings.checkpoint_path)
    args = ModelArgs.from_checkpoint_dir(checkpoint.parent)
    if settings.ctx > args.block_size:
        raise UserError(f"`ctx` {settings.ctx} exceeds the model's context of {args.block_size} tokens: lower `ctx`")
    tokenizer = get_tokenizer(checkpoint.parent)
    tokens, bos_id = None, bos_of(tokenizer)
    if settings.text is not None:
        tokens = tokenizer.encode(read_text(settings.text))
        available = (len(tokens) + (bos_id is not None)) // settings.ctx
        if available < 2:  # as llama-perplexity: a single chunk measures too little to be worth a number
            raise UserError(f"`text` {settings.text} is {len(tokens)} tokens, fewer than two chunks of `ctx` "
                            f"{settings.ctx}: use a longer text or a smaller `ctx`")
    if settings.base is not None:
        base_args = ModelArgs.from_checkpoint_dir(Path(settings.base).parent)
        base_tokens = get_tokenizer(Path(settings.base).parent).encode(read_text(settings.text))
        if base_args.vocab_size != args.vocab_size or base_tokens != tokens:
            raise UserError(f"`base` {settings.base} does not share the tokenizer and vocabulary of "
                            f"{checkpoint}: compare two checkpoints of the same model")

    # an unknown task name is refused before the perplexity run (indexing lm-eval's tasks takes seconds: once)
    manager = task_manager(settings.tasks, settings.include_path) if settings.tasks else None
    t0 = time.perf_counter()
    generator = Generator.build(checkpoint, settings.device, settings.dtype, compile=settings.compile)
    base = load_model(settings.base, settings.device, torch.float32) if settings.base is not None else None
    say(f"Loaded {checkpoint}{' and the base ' + str(settings.base) if base is not None else ''} in "
        f"{time.perf_counter() - t0:.2f} s")
    result = {}
    if tokens is not None:
        measures = perplexity(generator.model, tokens, settings.ctx, settings.batch_size, base, bos_id,
                              settings.limit_chunks, generator.target, progress=True)
        base_perplexity = measures.pop("base_perplexity", None)
        compile_seconds = measures.pop("compile_seconds")
        say(format_result(measures, base_perplexity, compile_seconds))
        result.update(measures)
    if settings.tasks:
        adapter = HarnessAdapter(generator, settings.ctx, settings.batch_size, progress=True)
        result["tasks"] = run_tasks(adapter, settings.tasks, settings.include_path, manager)
    if settings.stats_json is not None:
        write_output(Path(settings.stats_json), "stats_json",
                     lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))
    return result


def format_result(r: dict, base_perplexity=None, compile_seconds=0.0) -> str:
    lines = [f"Perplexity: {r['perplexity']:.4f} +/- {r['perplexity_stderr']:.4f} over {r['chunks']} chunks of "
             f"{r['ctx']} tokens ({r['tokens_scored']} tokens scored), {r['tokens_per_sec']:.1f} tokens/s"
             + (f" (compilation {compile_seconds:.2f} s)" if compile_seconds else "")]
    if base_perplexity is not None:
        lines.append(f"Base perplexity: {base_perplexity:.4f}")
        lines.append(f"KL(base || this): mean {r['kl_mean']:.4g}, max {r['kl_max']:.4g}; same top token "
                     f"{100 * r['same_top_token']:.2f}%; RMS dp {100 * r['rms_dp']:.3f}%")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command line

def parse_args(argv=None) -> argparse.Namespace:
    defaults = Settings()
    p = argparse.ArgumentParser(description="Perplexity over a text (llama-perplexity's chunks), KL divergence from a "
                                            "base checkpoint, lm-evaluation-harness tasks")
    p.add_argument("--checkpoint_path", type=Path, default=defaults.checkpoint_path)
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text the model never trained on (docs/eval.md)")
    p.add_argument("--ctx", type=int, default=defaults.ctx,
                   help="tokens per chunk (even); the second half of each is scored. With --tasks: the longest input")
    p.add_argument("--batch_size", type=int, default=defaults.batch_size, help="chunks (or requests) per forward")
    p.add_argument("--base", type=Path, default=None,
                   help="a checkpoint of the same model to compare with (e.g. the fp32 model.pth), run in fp32 and "
                        "eager: KL(base || this), same top token, RMS of the change in p(next token)")
    p.add_argument("--limit_chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--stats_json", type=Path, default=None)
    p.add_argument("--compile", nargs="?", const="auto", default="none", choices=COMPILE_MODES, metavar="MODE",
                   help="run the model compiled, as generate.py --compile [MODE] would")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tasks", default=None, help="lm-evaluation-harness tasks, comma-separated (pip install lm-eval)")
    p.add_argument("--include_path", type=Path, default=None, help="a directory of your own task YAML files")
    return p.parse_args(argv)


FLAGS = {name: f"--{name}" for name in vars(parse_args([]))}


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None else None
        if args.tasks is not None and not tasks:
            raise UserError("`tasks` is empty: name one or more tasks, comma-separated")
        settings = Settings(args.checkpoint_path, args.text, args.ctx, args.batch_size, args.base, args.limit_chunks,
                            args.stats_json, args.compile, args.device, args.precision, tasks, args.include_path)
        return run(settings)
    except UserError as e:
        raise UserError(flag_names(str(e), FLAGS)) from None


def cli(argv=None) -> int:
    return run_cli(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(cli())
