"""What several test files share: checkpoints built on the spot, generate.py runs, and the chi-square
machinery of the lossless-sampling tests."""
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import torch

import draftmodel
import speculate
from decode import Engine, Sampling, logits_to_probs
from model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parent.parent


def train_tokenizer(prefix: Path, vocab_size: int) -> Path:
    import sentencepiece as spm
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_prefix=str(prefix),
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def write_checkpoint(directory: Path, tokenizer_model: Path, seed: int = 0, **model_args) -> Path:
    """A checkpoint dir in the DESIGN.md layout with random weights; returns the model.pth path."""
    directory.mkdir(parents=True, exist_ok=True)
    args = ModelArgs(**model_args)
    torch.manual_seed(seed)
    model = Transformer(args)
    (directory / "config.json").write_text(json.dumps(args.to_hf_config()))
    (directory / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    torch.save(model.state_dict(), directory / "model.pth")
    return directory / "model.pth"


def copy_checkpoint(source, directory, noise=0.0, sharpen=1.0, seed=0, **config):
    """A checkpoint directory with `source`'s weights plus Gaussian noise (`noise` times each tensor's std),
    its output layer scaled by `sharpen` (more confident, same argmax), and config.json entries replaced."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(source.parent / "tokenizer.model", directory)
    hf_config = json.loads((source.parent / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(hf_config, **config)))
    generator = torch.Generator().manual_seed(seed)
    state = {name: w + noise * w.std() * torch.randn(w.shape, generator=generator)
             for name, w in torch.load(source, weights_only=True).items()}
    state["output.weight"] = state["output.weight"] * sharpen
    torch.save(state, directory / "model.pth")
    return directory / "model.pth"


# ----------------------------------------------------------------------------- generate.py runs

def load_cli():
    """The command line (generate.py) loaded from its file, so that a test runs `python generate.py ARGS` in this
    process as cli.main(ARGS). Library code never imports it; tests of the library use generation.py."""
    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = load_cli()

PROMPTS = ("def main(", "Hello, my name is")


def run(target, *extra, prompt=PROMPTS[0], n=29):
    return cli.main(["--checkpoint_path", str(target), "--prompt", prompt, "--max_new_tokens", str(n),
                          "--num_samples", "1", "--temperature", "0", *map(str, extra)])


def speculative(target, draft, k, *extra, prompt=PROMPTS[0], n=29):
    return run(target, "--draft_checkpoint_path", draft, "--speculate_k", k, *extra, prompt=prompt, n=n)


def tokens(stats: dict) -> list:
    return stats["samples"][0]["tokens"]


@functools.lru_cache(maxsize=None)
def plain_greedy(target, prompt=PROMPTS[0], n=40) -> list:
    """The target's own greedy continuation (no draft), computed once per target and prompt."""
    return tokens(run(target, "--ignore_eos", prompt=prompt, n=n))


# ----------------------------------------------------------------------------- lossless sampling: chi-square
VOCAB = 32
PREFIX, FIRST = [1, 7, 5, 9, 3], 7  # the prompt, and the token the target emitted at prefill (7 -> 5 9 recurs:
# an n-gram lookup proposes it)
PREFIX2 = [1, 2, 7, 5, 9, 4, 6, 3]  # a longer prompt: its rows sit at other positions in the same batch
DRAWS = 8_000  # every broken variant of the tables scores far below REJECT_BELOW at this size
ROWS = 250  # draws run this many rows at a time (batched speculation); each row is an independent draw
REJECT_BELOW = 1e-6  # a correct sampler fails one check with probability 1e-6; the broken ones score < 1e-15


class TableModel:
    """Stands in for a Transformer inside the speculative loop, so that DRAWS draws take seconds, not
    minutes: its forward returns, for each query, the logits the real tiny Transformer `model` gives for
    the context that query sees, read from tables filled by one batched forward over every continuation
    of prompt + [FIRST] by up to `depth` tokens, for each prompt in `prompts` (any other context: the
    real model's forward, remembered).

    Its "KV cache" holds the (token, position) written at each slot of each row. The mask the loop passes
    (or the causal default) decides which slots a query sees, and decode.move_cache_slots compacts them
    as it does real keys and values; a query that sees positions other than 0, 1, 2, ... is an error."""

    def __init__(self, model: Transformer, depth: int, prompts=(PREFIX, PREFIX2)):
        self.model, self.rows = model, {}
        tails = torch.cartesian_prod(*[torch.arange(VOCAB)] * depth).view(-1, depth)
        for prompt in prompts:
            n = len(prompt)
            sequences = torch.cat([torch.tensor(prompt + [FIRST]).expand(len(tails), -1), tails], 1)
            model.setup_caches(len(sequences), sequences.shape[1])
            with torch.no_grad():
                logits = model(sequences, torch.arange(sequences.shape[1]).expand_as(sequences))
            for i in range(1, n + 1):  # the prompt's own prefixes
                self.rows[tuple(prompt[:i])] = logits[0, i - 1].clone()
            for k in range(depth + 1):  # prompt + [FIRST] + tails of k tokens: one table row per distinct tail
                for tail, row in zip(tails[::VOCAB ** (depth - k)].tolist(), logits[::VOCAB ** (depth - k), n + k]):
                    self.rows[tuple(prompt + [FIRST] + tail[:k])] = row.clone()
        self.tok_embeddings = SimpleNamespace(weight=torch.empty(0))  # the speculator reads its .device
        self.max_batch_size, self.max_seq_length = 0, -1
        self.index_rows()

    def index_rows(self):
        """The table as tensors, so that a forward looks every query up at once: sorted context keys and their
        logits (context_keys() numbers a context of at most MAX_KEYED tokens uniquely)."""
        contexts = [c for c in self.rows if len(c) <= MAX_KEYED]
        keys = torch.tensor([sum((t + 1) * (VOCAB + 1) ** i for i, t in enumerate(c)) for c in contexts])
        self.keys, order = torch.sort(keys)
        self.table = torch.stack([self.rows[contexts[i]] for i in order.tolist()])  # [contexts, V]

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if max_batch_size <= self.max_batch_size and max_seq_length <= self.max_seq_length:
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.cache = SimpleNamespace(k_cache=torch.full((max_batch_size, 1, max_seq_length, 2), -1),
                                     v_cache=torch.zeros(max_batch_size, 1, max_seq_length))
        self.layers = [SimpleNamespace(attention=SimpleNamespace(kv_cache=self.cache))]

    def logits(self, context: tuple):
        row = self.rows.get(context)
        if row is None:  # e.g. a padding node (speculate.Tree.pad_to), or a right-padded prompt
            with torch.no_grad():
                self.model.setup_caches(1, len(context))
                row = self.model(torch.tensor([context]), torch.arange(len(context)).view(1, -1))[0, -1]
            self.rows[context] = row
        return row

    def __call__(self, idx, input_pos, slots=None, mask=None, block=None):
        slots = input_pos if slots is None else slots
        batch, width = idx.shape
        self.cache.k_cache[torch.arange(batch).unsqueeze(1), 0, slots] = torch.stack([idx, input_pos], -1)
        written = self.cache.k_cache[:batch, 0]  # [B, S, 2]: (token, position) per slot
        if mask is None:  # the model's default: causal over slots
            mask = torch.arange(self.max_seq_length).view(1, 1, 1, -1) <= slots.view(batch, 1, width, 1)
        seen = mask[:, 0]  # [B, T, S]
        rank = seen.long().cumsum(-1) - 1  # the position a visible slot must hold: 0, 1, 2, ... in slot order
        positions = written[..., 1].unsqueeze(1).expand_as(seen)  # [B, T, S]
        assert bool(((positions == rank) | ~seen).all()), "a query sees positions other than 0, 1, 2, ..."
        # each query's context: its visible slots' tokens, moved to the front in slot order (a stable sort)
        order = torch.sort((~seen).long(), dim=-1, stable=True).indices  # [B, T, S]
        tokens = written[..., 0].unsqueeze(1).expand_as(seen).gather(-1, order)  # [B, T, S]
        lengths = seen.sum(-1).flatten()  # [B * T]
        tokens = tokens.flatten(0, 1)  # [B * T, S]
        found, rows = context_keys(tokens, lengths, self.keys)
        out = self.table[rows.clamp(max=len(self.keys) - 1)]  # [B * T, V]
        for i in (~found).nonzero().flatten().tolist():  # contexts outside the table: the real model's logits
            out[i] = self.logits(tuple(tokens[i, :lengths[i]].tolist()))
        return out.view(batch, width, -1)  # [B, T, V]


MAX_KEYED = 12  # (VOCAB + 1) ** 12 < 2 ** 63: a context of at most 12 tokens has a unique int64 key


def context_keys(tokens, lengths, keys):
    """For each row of tokens [N, S] (its first lengths[n] tokens the context): whether its context is in the sorted
    keys, and where ([N] bool, [N] long)."""
    places = torch.arange(tokens.shape[1])
    powers = torch.where(places < MAX_KEYED, (VOCAB + 1) ** places.clamp(max=MAX_KEYED - 1), 0)  # [S]
    inside = places < lengths.unsqueeze(1)  # [N, S]
    key = ((tokens + 1) * inside * powers).sum(-1)  # [N]
    at = torch.searchsorted(keys, key).clamp(max=len(keys) - 1)
    return (keys[at] == key) & (lengths <= MAX_KEYED), at


TINY_ARGS = ModelArgs(dim=16, n_layer=2, n_head=2, n_local_heads=1, intermediate_size=32, vocab_size=VOCAB,
                      block_size=64)


@functools.lru_cache(maxsize=None)
def tiny_target():
    """The target's table (the same whatever the draft, so built once: it is most of tiny_tables' work), its
    weights before sharpening, and the random state the drafts' noise is drawn from."""
    torch.manual_seed(0)
    target = Transformer(TINY_ARGS).requires_grad_(False)
    Transformer(TINY_ARGS)  # the draft's initialization: advances the random state as a draft built here would
    weights = {name: w.clone() for name, w in target.state_dict().items()}
    state = torch.get_rng_state()
    target.output.weight.mul_(3.0)
    return TableModel(target, depth=3), weights, state


@functools.lru_cache(maxsize=None)
def tiny_tables(draft_noise: float = 0.5, draft_sharpen: float = 2.0):
    """(target, draft) TableModels of two tiny-vocabulary Transformers. The draft is deliberately different:
    the target's weights with heavy noise (by default it proposes the target's token about half the time);
    a noisier, more confident draft gets many first children rejected, which puts the later siblings to work."""
    target, weights, state = tiny_target()
    draft = Transformer(TINY_ARGS).requires_grad_(False)
    torch.set_rng_state(state)
    draft.load_state_dict({name: w + draft_noise * w.std() * torch.randn_like(w) for name, w in weights.items()})
    draft.output.weight.mul_(draft_sharpen)
    return target, TableModel(draft, depth=2)


def speculative_draws(tree_nodes: int, sampling: Sampling, ngram: int = 0, seed: int = 0, draft=(0.5, 2.0),
                      prompts=(PREFIX,), batch: int = ROWS, draws: int = DRAWS):
    """The two tokens after prompt + [FIRST] from the real speculative loop (depth 2), `draws` times for each
    prompt, and the summed accept_counts of its verify steps. The draws run `batch` rows at a time (rows
    take the prompts in turn: rows at different positions); each row is one independent draw.
    ngram > 0 merges an n-gram lookup's branches into the tree (it looks only at the prompt and the output
    so far: each batch starts a fresh lookup, and a row never sees another's output)."""
    target, draft_model = tiny_tables(*draft)
    speculator = speculate.Speculator(draftmodel.ModelDrafter(Engine(draft_model), 2, tree_nodes, ngram=ngram))
    rows = [list(prompts[b % len(prompts)]) for b in range(batch)]
    width = max(len(p) for p in rows)
    target.setup_caches(batch, width + 3 + speculator.lookahead + 1)
    x = torch.tensor([p + [0] * (width - len(p)) for p in rows])  # [B, T] right-padded, as generate.py prefills
    target(x, torch.arange(width).expand_as(x))  # the prefill
    engine = Engine(target)
    torch.manual_seed(seed)
    drawn, accept_counts = [[] for _ in prompts], [0, 0, 0]
    first = torch.full((batch,), FIRST)
    for _ in range(draws * len(prompts) // batch):
        if ngram:
            speculator.drafter.lookup = speculate.Lookup(ngram)
        outs, stats = speculator.generate(engine, rows, first, 3, sampling, eos_ids=[], stop_at_eos=False)
        for b, out in enumerate(outs):
            drawn[b % len(prompts)].append(out[1:3])
        accept_counts = [a + b for a, b in zip(accept_counts, stats["accept_counts"])]
    return [torch.tensor(d) for d in drawn], accept_counts


def exact_target(sampling: Sampling, prompt=PREFIX):
    """The target's p(x1) and p(x1, x2) = p(x1) p(x2 | x1) after prompt + [FIRST], by enumeration."""
    target, _ = tiny_tables()
    context = tuple(prompt + [FIRST])
    p1 = logits_to_probs(target.logits(context), sampling).double()
    p2 = torch.stack([logits_to_probs(target.logits(context + (a,)), sampling) for a in range(VOCAB)]).double()
    return p1, p1[:, None] * p2


def chi_square_pvalue(counts, probs) -> float:
    """Pearson's test of observed counts against exact probabilities (cells expecting fewer than 5 draws
    pooled); 0 if a token of probability 0 was drawn."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    chi2 = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2, dtype=torch.double), chi2 / 2))


def lossless_pvalues(tree_nodes: int, sampling: Sampling, ngram: int = 0, draft=(0.5, 2.0), prompts=(PREFIX,),
                     batch: int = ROWS, draws: int = DRAWS):
    """p-values of the first token, the second and the pair against the target's exact distribution, for each
    prompt. draft: (noise, sharpening) of the draft's weights (tiny_tables)."""
    drawn, accept_counts = speculative_draws(tree_nodes, sampling, ngram, draft=draft, prompts=prompts, batch=batch,
                                             draws=draws)
    pvalues = {}
    for i, (prompt, got) in enumerate(zip(prompts, drawn)):
        p1, joint = exact_target(sampling, prompt)
        first, second = got[:, 0], got[:, 1]
        name = f"prompt {i}: " if len(prompts) > 1 else ""
        pvalues.update({
            name + "first token": chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p1),
            name + "second token": chi_square_pvalue(torch.bincount(second, minlength=VOCAB), joint.sum(0)),
            name + "pair": chi_square_pvalue(torch.bincount(first * VOCAB + second, minlength=VOCAB ** 2),
                                             joint.flatten())})
    return pvalues, accept_counts


# ----------------------------------------------------------------------------- tokenizers built for the tests

TEXT = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text().splitlines()[:400] + [
    "Le café est très bon, déjà vu.", "日本語のテキストです", "emoji 🙂 ok 🚀", "numbers 12345 and 67890",
    "\tindented\tline"]

STRINGS = ["Hello world", "parser.add_argument('--x', type=int)", " leading space", "trailing spaces  ", "  two",
           " ", "", "café déjà", "日本語 and 🙂🚀", "12345 + 678", "a\nb\tc\n\n", "x <s> y </s>", "<s>hi</s>",
           "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>hi<|eot_id|>", "▁already", "<unk> Ω"]

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA2_CONFIG = {"add_bos_token": True, "add_eos_token": False,
                 "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False},
                 "eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "legacy": False,
                 "model_max_length": 4096, "pad_token": None, "padding_side": "right", "sp_model_kwargs": {},
                 "tokenizer_class": "LlamaTokenizer"}


def byte_level_bpe(specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_chatml_tokenizer(directory: Path) -> Path:
    """SmolLM2-like: byte-level BPE adding no BOS, <|im_start|>/<|im_end|>, a ChatML chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "add_prefix_space": False, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": SMOLLM2_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": 8192, "tokenizer_class": "GPT2Tokenizer"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def write_llama3_tokenizer(directory: Path) -> Path:
    """Llama 3-like: byte-level BPE whose post-processor adds <|begin_of_text|>, <|eot_id|> ends a turn."""
    from tokenizers import processors
    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)],
                                      pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def write_sentencepiece_model(directory: Path, config=LLAMA2_CONFIG) -> Path:
    """Llama 2-like: sentencepiece BPE with byte fallback, identity normalization, a dummy prefix."""
    import sentencepiece as spm
    directory.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_prefix=str(directory / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, num_threads=1, minloglevel=2)
    (directory / "tokenizer.vocab").unlink()
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_llama2_json_tokenizer(directory: Path, model: Path) -> Path:
    """Llama 2's tokenizer.json (Prepend/Replace normalizer) from the pieces of `model`, with merges made by
    transformers, and a config naming LlamaTokenizerFast: transformers 5 imposes its own pre-tokenization."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers.tokenization_utils_base import generate_merges
    sp = spm.SentencePieceProcessor(model_file=str(model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=generate_merges(vocab), unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = dict(LLAMA2_CONFIG, tokenizer_class="LlamaTokenizerFast")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def auto_tokenizer(directory):
    """transformers' AutoTokenizer. It reads a tokenizer.model through protobuf; where protobuf is not installed,
    the model is described to it through sentencepiece's own API instead (no user-defined pieces in ours)."""
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        import sentencepiece as spm
        convert = importlib.import_module("transformers.convert_slow_tokenizer")

        def read_with_sentencepiece(self, model):
            sp = spm.SentencePieceProcessor(model_file=str(model))
            kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else
                     6 if sp.is_byte(i) else 1 for i in range(sp.vocab_size())]
            self.proto = SimpleNamespace(
                pieces=[SimpleNamespace(piece=sp.id_to_piece(i), score=sp.get_score(i), type=kind)
                        for i, kind in enumerate(kinds)],
                trainer_spec=SimpleNamespace(model_type=2, byte_fallback=True, unk_id=sp.unk_id(), bos_id=sp.bos_id(),
                                             eos_id=sp.eos_id(), unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>"),
                normalizer_spec=SimpleNamespace(precompiled_charsmap=b"", add_dummy_prefix=True))
        convert.SentencePieceExtractor.__init__ = read_with_sentencepiece
    return transformers.AutoTokenizer.from_pretrained(str(directory))


# ----------------------------------------------------------------------------- a full disk

class SmallDisk:
    """A directory where a write of more than `room` bytes fails (within `full(room)`) as it does on a full disk,
    through the real writers (torch.save's zip writer, safetensors, tokenizers, plain Python files):
    - "tmpfs": a 16 MiB tmpfs mounted there, filled but `room` bytes (whole pages) by a filler file: ENOSPC. Needs
      mount (root, and a container that allows it): the case is skipped where mount is refused.
    - "ulimit": this process's file size limit (RLIMIT_FSIZE, `ulimit -f`) lowered to `room`, SIGXFSZ ignored (else
      it kills the process at the first write past the limit): any file written past `room` bytes fails with EFBIG.
      Runs everywhere."""

    def __init__(self, kind: str, directory: Path):
        self.kind, self.directory = kind, directory
        self.cause = {"tmpfs": "No space left on device", "ulimit": "File too large"}[kind]

    @contextlib.contextmanager
    def full(self, room: int):
        if self.kind == "tmpfs":
            filler = self.directory / "filler"
            free = os.statvfs(self.directory)
            with open(filler, "wb") as f:
                f.write(bytes(max(0, free.f_bavail * free.f_frsize - room)))
            try:
                yield
            finally:
                filler.unlink()
            return
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)


def files_of(directory: Path) -> dict:
    """Every file under directory (relative name: bytes), temp files included, the filler left out."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "filler"}
