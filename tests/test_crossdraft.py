"""crossdraft.py through generate.py: speculative decoding with a draft whose tokenizer differs from the target's.

Greedy output is token-identical to the target's own greedy output whatever the draft (a random byte-level BPE
draft, a noisy copy of the target behind a reshuffled, thinner vocabulary), at every depth, on text where the
tokenizers disagree most (unicode, leading spaces, digits), and stops exactly at EOS and --max_new_tokens. At
temperature > 0 the tokens are distributed exactly as the target's (Token-Level Intersection): a chi-square test
against the target's distribution by enumeration, on a tiny pair whose two tokenizers split the same strings
differently, and the same test rejects a proposal that is not renormalized over the intersection.
"""
import functools
import json
import math
import random
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import crossdraft
import decode
import generation
import speculate
import tokenizer
from decode import Engine, Sampling, logits_to_probs
from model import ModelArgs, Transformer
from helpers import chi_square_pvalue, plain_greedy, run, speculative, tokens
from errors import UserError
from helpers import cli

PROMPTS = ["def main(", "  two leading spaces and\ttabs", "café déjà 日本語 🙂 x", "total = 12345 + 678 * 90"]


# ----------------------------------------------------------------------------- checkpoints built here

def byte_level_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE (GPT-2 / Llama 3 style, digits one by one) learnt from argparse.py, as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text().splitlines()[:600]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def write_model(directory: Path, state: dict, **model_args) -> Path:
    args = ModelArgs(**model_args)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(args.to_hf_config()))
    torch.save(state, directory / "model.pth")
    return directory / "model.pth"


@pytest.fixture(scope="module")
def byte_level_draft(tmp_path_factory) -> Path:
    """A random draft with a byte-level BPE of 300 tokens (the target: sentencepiece, 512): nearly every token
    rejected."""
    directory = byte_level_tokenizer(tmp_path_factory.mktemp("byte_level_draft"))
    size = tokenizer.get_tokenizer(directory).vocab_size
    torch.manual_seed(1)
    args = dict(dim=32, n_layer=1, n_head=2, vocab_size=size, block_size=256)
    return write_model(directory, Transformer(ModelArgs(**args)).state_dict(), **args)


@pytest.fixture(scope="module")
def noisy_draft(random_target, tmp_path_factory) -> Path:
    """The target's weights plus noise behind another tokenizer: the target's sentencepiece pieces with a third of
    the longer pieces removed (so many strings split differently) and the ids shuffled, as a tokenizer.json. Where
    both split the context alike, the draft predicts what the target does."""
    directory = tmp_path_factory.mktemp("noisy_draft")
    source = tokenizer.get_tokenizer(random_target.parent)
    spec = json.loads(source.processor.to_str())
    vocab = spec["model"]["vocab"]
    rng = random.Random(0)
    special = {0, 1, 2}
    kept = [p for p, i in sorted(vocab.items(), key=lambda kv: kv[1])
            if i in special or len(p) < 2 or p.startswith("<0x") or rng.random() > 0.35]
    order = [p for p in kept if vocab[p] not in special]
    rng.shuffle(order)
    new_vocab = {p: i for i, p in enumerate([p for p in kept if vocab[p] in special] + order)}
    spec["model"]["vocab"] = new_vocab
    spec["model"]["merges"] = [[a, b] for a, b in tokenizer.bpe_merges({p: vocab[p] for p in kept})]
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    old = torch.load(random_target, weights_only=True)
    rows = torch.tensor([vocab[p] for p in sorted(new_vocab, key=new_vocab.get)])
    generator = torch.Generator().manual_seed(0)
    state = {name: w + 0.05 * w.std() * torch.randn(w.shape, generator=generator) for name, w in old.items()}
    state["tok_embeddings.weight"], state["output.weight"] = state["tok_embeddings.weight"][rows], \
        state["output.weight"][rows] * 4.0
    config = json.loads((random_target.parent / "config.json").read_text())
    args = dict(dim=config["hidden_size"], n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
                n_local_heads=config["num_key_value_heads"], intermediate_size=config["intermediate_size"],
                vocab_size=len(new_vocab), block_size=256)
    return write_model(directory, state, **args)


def draft_path(name, request):
    return request.getfixturevalue({"byte-level": "byte_level_draft", "noisy": "noisy_draft"}[name])


# ----------------------------------------------------------------------------- tokens as bytes

def test_token_bytes_round_trip(random_target, byte_level_draft, noisy_draft):
    """Every tokenizer kind maps text mid-stream to ids whose bytes join to exactly the text's bytes; special
    tokens have no bytes; sentencepiece byte pieces are their byte."""
    strings = PROMPTS + [" leading", "trailing  ", "a\nb\n\n", "<s> x </s>", "Ω 1", "\x00\x7f"]
    for path in (random_target, byte_level_draft, noisy_draft):
        tok = tokenizer.get_tokenizer(path.parent)
        vocab = crossdraft.Vocabulary(tok, tok.vocab_size)
        for s in strings:
            assert vocab.round_trips(s), (path, s)
        assert vocab.bytes[tok.bos_id] is None
    sp = tokenizer.get_tokenizer(random_target.parent)
    assert sp.token_bytes()[sp.processor.token_to_id("<0xE6>")] == b"\xe6"
    assert sp.token_bytes()[sp.processor.token_to_id("▁the")] == b" the"
    vocab = crossdraft.Vocabulary(sp, sp.vocab_size)
    assert vocab.text(vocab.encode("日本".encode()[:4])) == "日本".encode()[:4]  # a character cut in two


# ----------------------------------------------------------------------------- greedy: token identity

@pytest.mark.parametrize("draft,k", [("byte-level", 1), ("byte-level", 4), ("byte-level", 8),
                                     ("noisy", 1), ("noisy", 2), ("noisy", 3), ("noisy", 5), ("noisy", 8)])
def test_greedy_identical_to_plain_decoding(random_target, request, draft, k):
    prompt = PROMPTS[k % len(PROMPTS)]
    got = speculative(random_target, draft_path(draft, request), k, "--ignore_eos", prompt=prompt)
    assert tokens(got) == plain_greedy(random_target, prompt)[:29]
    assert got["speculative"] == "draft-cross-tokenizer" and got["speculate_k"] == k
    if draft == "noisy" and k >= 2:
        counts = got["accept_counts"]
        assert sum(counts[1:]) > 0, counts  # the draft's text is accepted in target tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identical_on_every_prompt(random_target, noisy_draft, byte_level_draft, prompt):
    want = plain_greedy(random_target, prompt)[:29]
    assert tokens(speculative(random_target, noisy_draft, 4, "--ignore_eos", prompt=prompt)) == want
    assert tokens(speculative(random_target, byte_level_draft, 3, "--ignore_eos", prompt=prompt)) == want


@pytest.mark.slow
def test_compiled_greedy_identical(random_target, noisy_draft, monkeypatch):
    """Compiled target and draft (regional: the whole-graph chain has tests of its own below), chains padded to one
    of two verify shapes (K + 1 target tokens, or 2K + 1 when re-tokenization made the chain longer): still the
    target's greedy output. A sampled chain has one target token per draft token: always K + 1."""
    sizes, real = [], crossdraft.verify_step

    def verify_step(target, trees, *args):
        sizes.append(len(trees[0].tokens))
        return real(target, trees, *args)

    catch_ups, real_draft = [], crossdraft.CrossTokenizerSpeculator.draft

    def draft(self, *args):
        catch_ups.append(len(self.pending) - 1)
        return real_draft(self, *args)

    monkeypatch.setattr(crossdraft, "verify_step", verify_step)
    monkeypatch.setattr(crossdraft.CrossTokenizerSpeculator, "draft", draft)
    got = speculative(random_target, noisy_draft, 4, "--compile", "regional", "--ignore_eos")
    assert tokens(got) == plain_greedy(random_target)[:29] and sum(got["accept_counts"][1:]) > 0
    assert set(sizes) <= {5, 9} and 5 in sizes, sizes
    assert any(0 < n <= crossdraft.CATCH_UP_STEPS for n in catch_ups), catch_ups  # test_compiled_catch_up
    sizes.clear()
    speculative(random_target, noisy_draft, 4, "--compile", "regional", "--temperature", "0.8", "--ignore_eos")
    assert set(sizes) == {5}, sizes


def cross_drafter(random_target, noisy_draft, k: int, mode: str = "none"):
    """The cross-tokenizer speculator of the noisy draft (its engine compiled in `mode`) for the random target."""
    target_tok, draft_tok = (tokenizer.get_tokenizer(p.parent) for p in (random_target, noisy_draft))
    vocab = generation.load_model(random_target).args.vocab_size
    engine = decode.compile_engine(generation.load_model(noisy_draft), "cpu", mode)
    return generation.make_cross_speculator(generation.Speculation(k), engine, draft_tok, target_tok, vocab, 1)


def primed_drafters(random_target, noisy_draft, mode: str):
    """Two cross-tokenizer drafters (K = 3) of the same draft, the first compiled, each having read "def main(x):" in
    its own tokens but the last; returns them, that last token [1, 1], its position [1, 1] and the target's vocabulary
    size."""
    target_tok, draft_tok = (tokenizer.get_tokenizer(p.parent) for p in (random_target, noisy_draft))
    vocab = generation.load_model(random_target).args.vocab_size
    drafters = [cross_drafter(random_target, noisy_draft, 3, m) for m in (mode, "none")]
    ids = torch.tensor([draft_tok.encode_prompt("def main(x):")])  # [1, T]
    for d in drafters:
        d.draft_model.setup_caches(1, 64)
        d.draft_model(ids[:, :-1], torch.arange(ids.shape[1] - 1).view(1, -1))
    return drafters, ids[:, -1:], torch.tensor([[ids.shape[1] - 1]]), vocab


@pytest.mark.parametrize("mode", ["regional", pytest.param("whole", marks=pytest.mark.slow)])
def test_compiled_tli_step_gives_the_eager_proposal(random_target, noisy_draft, mode):
    """The sampled draft step compiled (the whole step as one graph, or the regional forward then the rest) hands
    the verifier the same q_T as the eager step, draws only tokens of the intersection, and q_T is a distribution
    over the target's vocabulary."""
    drafters, x, pos, vocab = primed_drafters(random_target, noisy_draft, mode)
    sampling = Sampling(0.8, top_k=50)
    with torch.no_grad():
        got = [d.tli_step(x, pos, sampling, d.in_both, d.shared_draft, d.shared_target, vocab)
               for d in drafters for _ in range(20)]
    (_, want), drawn = got[-1], {int(token[0]) for token, _ in got}
    for _, q_target in got[:20]:
        torch.testing.assert_close(q_target, want, atol=1e-5, rtol=1e-4)
    assert drawn <= set(drafters[0].to_target) and len(drawn) > 1
    torch.testing.assert_close(want.sum(-1), torch.ones(1))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, top_k=50)], ids=["greedy", "sampled"])
def test_chain_in_one_call_drafts_what_k_steps_draft(random_target, noisy_draft, sampling):
    """cross_chain (the K draft steps in one call) drafts the chain that K single steps draft, hands the verifier the
    same proposals (same seed: the same draws in the same order) and leaves the same tokens in the draft's cache."""
    target_tok, draft_tok = (tokenizer.get_tokenizer(p.parent) for p in (random_target, noisy_draft))
    drafters = [cross_drafter(random_target, noisy_draft, 4) for _ in range(2)]
    drafters[1].run_chain = None  # step by step
    prompt = target_tok.encode_prompt("def main(x):")
    trees = []
    with torch.no_grad():
        for d in drafters:
            torch.manual_seed(0)
            d.start(prompt, 64)
            trees.append(d.draft(prompt[-1], 4, sampling, 8)[0])  # the prompt (one forward), then the chain
    (chain, steps), (a, b) = trees, drafters
    assert chain.tokens == steps.tokens and len(chain.tokens) > 1
    assert a.cached[: len(b.cached)] == b.cached  # the chain also fed what it drafted past a stop, if any
    slots = slice(0, len(b.cached))
    for one_call, stepped in zip(a.draft_model.layers, b.draft_model.layers):
        torch.testing.assert_close(one_call.attention.kv_cache.k_cache[:, :, slots],
                                   stepped.attention.kv_cache.k_cache[:, :, slots])
    for p, q in zip(chain.proposals[1:], steps.proposals[1:]):
        if sampling.temperature:
            torch.testing.assert_close(p, q)
        else:
            assert p is None and q is None


@pytest.mark.slow
def test_compiled_chain_proposals_are_those_of_its_draws(random_target, noisy_draft):
    """The K sampled draft steps compiled as one graph: each q_T handed to the verifier is the eager step's q_T in the
    context of the graph's own earlier draws, and every draw is a token of the intersection."""
    (compiled, eager), x, pos, vocab = primed_drafters(random_target, noisy_draft, "whole")
    sampling = Sampling(0.8, top_k=50)
    shared = (compiled.in_both, compiled.shared_draft, compiled.shared_target, vocab)
    with torch.no_grad():
        drawn, proposals = compiled.run_chain(x, pos, sampling, 3, *shared)  # [1, 3], [1, 3, V]
        assert set(drawn[0].tolist()) <= set(compiled.to_target)
        for i in range(3):
            _, want = crossdraft.tli_step(eager.draft_model, x, pos + i, sampling, *shared)
            torch.testing.assert_close(proposals[:, i], want, atol=1e-5, rtol=1e-4)
            x = drawn[:, i: i + 1]


@pytest.mark.slow
def test_compiled_catch_up_writes_what_an_eager_forward_writes(random_target, noisy_draft):
    """A few accepted tokens the draft has not read go through its compiled one-token graph (CATCH_UP_STEPS), more
    through one eager forward: the draft's cache and its next chain come out the same either way."""
    target_tok, draft_tok = (tokenizer.get_tokenizer(p.parent) for p in (random_target, noisy_draft))
    drafters = [cross_drafter(random_target, noisy_draft, 3, m) for m in ("whole", "none")]
    prompt = target_tok.encode_prompt("def main(x):")
    new = draft_tok.encode_continuation(" return x + 1")[: crossdraft.CATCH_UP_STEPS + 1]
    assert len(new) == crossdraft.CATCH_UP_STEPS + 1  # the tokens to catch up on, then the next root
    chains = []
    with torch.no_grad():
        for d in drafters:
            d.start(prompt, 64)
            d.draft(prompt[-1], 3, Sampling(), 6)  # the prompt (an eager forward), then a chain
            d.cached, d.pending = d.cached[: len(d.prompt)], list(new)  # rewound; accepted text to catch up on
            chains.append(d.draft(prompt[-1], 3, Sampling(), 6)[0].tokens)
    assert chains[0] == chains[1]
    slots = slice(len(drafters[0].prompt), len(drafters[0].prompt) + len(new) - 1)
    for compiled, eager in zip(*(d.draft_model.layers for d in drafters)):
        torch.testing.assert_close(compiled.attention.kv_cache.k_cache[:, :, slots],
                                   eager.attention.kv_cache.k_cache[:, :, slots], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("draft", ["noisy", "byte-level"])
def test_auto_depth_is_greedy_identical(random_target, request, draft, monkeypatch):
    """--speculate_k auto with a draft of another tokenizer: each step's depth (or a plain step) is chosen by the
    measured costs and acceptance; the tokens are plain decoding's, also when the choice is forced to plain steps
    and every depth in turn, and at exact max-token boundaries."""
    path = draft_path(draft, request)
    for prompt in PROMPTS[:2]:
        got = speculative(random_target, path, "auto", "--ignore_eos", prompt=prompt)
        assert tokens(got) == plain_greedy(random_target, prompt)[:29], prompt
        assert got["speculative"] == "draft-cross-tokenizer" and got["speculate_k"] == "auto"
    picks = iter([None, (1, 1), (8, 8), None, (3, 3), (5, 5), None, (2, 2)] * 10)
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: next(picks))
    for n in (1, 2, 7, 29):
        got = speculative(random_target, path, "auto", "--ignore_eos", n=n)
        assert tokens(got) == plain_greedy(random_target)[:n]
    assert got["plain_steps"] > 0 and sum(got["accept_counts"][1:]) + got["plain_steps"] < got["target_forwards"]


def test_exactly_max_new_tokens(random_target, noisy_draft):
    want = plain_greedy(random_target)
    for n in (1, 2, 3, 4, 9, 10, 17):
        assert tokens(speculative(random_target, noisy_draft, 4, "--ignore_eos", n=n)) == want[:n]


def test_stops_right_after_eos(random_target, noisy_draft, byte_level_draft, tmp_path):
    """With the EOS id set to the token plain decoding emits at index j, generation stops right after index j,
    also inside an accepted run; --ignore_eos goes on."""
    want = plain_greedy(random_target)
    firsts = [j for j in range(len(want)) if want[j] not in want[:j]]
    for j in (firsts[0], firsts[4], firsts[9]):
        target = tmp_path / f"eos{j}" / "model.pth"
        target.parent.mkdir()
        for name in ("model.pth", "tokenizer.model"):
            (target.parent / name).symlink_to(random_target.parent / name)
        config = json.loads((random_target.parent / "config.json").read_text())
        (target.parent / "config.json").write_text(json.dumps(dict(config, eos_token_id=want[j])))
        for draft, k in ((noisy_draft, 5), (byte_level_draft, 2)):
            assert tokens(speculative(target, draft, k, n=30)) == want[:j + 1]
        assert tokens(speculative(target, noisy_draft, 5, "--ignore_eos", n=30)) == want[:30]


def test_stats_in_target_tokens(random_target, noisy_draft, tmp_path):
    k, n = 4, 30
    path = tmp_path / "stats.json"
    returned = speculative(random_target, noisy_draft, k, "--ignore_eos", "--stats_json", path, n=n)
    stats = json.loads(path.read_text())
    assert stats == json.loads(json.dumps(returned))
    assert stats["speculative"] == "draft-cross-tokenizer" and stats["speculate_k"] == k
    counts = stats["accept_counts"]  # steps that accepted i target tokens
    steps, accepted = sum(counts), sum(i * c for i, c in enumerate(counts))
    assert steps == stats["target_forwards"] - 1 and stats["draft_forwards"] > 0
    assert math.isclose(stats["mean_accepted"], accepted / steps)
    assert math.isclose(stats["tokens_per_target_forward"], (accepted + steps) / steps)
    assert len(tokens(stats)) == n and 1 + accepted + steps >= n


def test_sampling_through_generate(random_target, noisy_draft):
    """At temperature > 0 the run goes through TLI and emits target ids that decode."""
    got = speculative(random_target, noisy_draft, 3, "--temperature", "0.8", "--ignore_eos", n=25)
    assert len(tokens(got)) == 25 and max(tokens(got)) < 512 and got["speculative"] == "draft-cross-tokenizer"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_trained_draft_with_its_own_tokenizer(trained_pair, k):
    """train_tiny.py's draft_othertok (its own sentencepiece vocabulary, digits kept together): the target's greedy
    output on every prompt (unicode, leading spaces, digits), EOS left on (the trained target emits it) or ignored
    up to an exact max-token boundary; a sampled run emits target ids."""
    target, draft = trained_pair / "target/model.pth", trained_pair / "draft_othertok/model.pth"
    accepted = 0
    for prompt in PROMPTS + ["x = 1000000 * 2500\n"]:
        want = plain_greedy(target, prompt)
        got = speculative(target, draft, k, "--ignore_eos", prompt=prompt, n=23)
        assert tokens(got) == want[:23], prompt
        assert got["speculative"] == "draft-cross-tokenizer"
        accepted += sum(got["accept_counts"][1:])
        with_eos = tokens(run(target, prompt=prompt, n=40))
        assert tokens(speculative(target, draft, k, prompt=prompt, n=40)) == with_eos
    assert accepted > 0  # the trained draft's text is accepted in target tokens
    sampled = speculative(target, draft, k, "--temperature", "0.8", "--ignore_eos", n=20)
    assert len(tokens(sampled)) == 20 and max(tokens(sampled)) < 512


def test_clear_errors(random_target, byte_level_draft, tmp_path):
    spec = ["--checkpoint_path", random_target, "--draft_checkpoint_path", byte_level_draft]

    def error_of(*argv):
        with pytest.raises(UserError) as info:
            cli.main([*map(str, spec), *map(str, argv)])
        return str(info.value)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    assert "one prompt at a time" in error_of("--batch_size", "2")
    assert "one prompt at a time" in error_of("--prompts_file", prompts)
    for flags in (["--tree_nodes", "8"], ["--draft_ngram", "3"], ["--tree_nodes", "auto"]):
        assert "drafts chains" in error_of(*flags)


# ----------------------------------------------------------------------------- sampling is lossless
#
# A tiny pair of tokenizers over the text alphabet {a, b, space}: the target's is sentencepiece-style (Metaspace
# pieces), the draft's byte-level; they share a, b, " ", " a", " b", "ab", " ab" and each has pieces of its own
# (target: ba, bb, aab; draft: aa, abb, bab), so the same strings split differently and the draft puts real mass
# outside the intersection. Both models are stand-ins computed from the context's text, so 10,000 runs of the
# real loop (CrossTokenizerSpeculator.generate, depth 2) take seconds, not the minutes real models would.

TARGET_PIECES = ["<unk>", "</s>", "a", "b", "▁", "▁a", "ab", "ba", "▁b", "bb", "▁ab", "aab"]
TARGET_MERGES = [("▁", "a"), ("a", "b"), ("b", "a"), ("▁", "b"), ("b", "b"), ("▁a", "b"), ("a", "ab")]
DRAFT_PIECES = ["<|endoftext|>", "a", "b", "Ġ", "aa", "ab", "Ġa", "Ġb", "abb", "bab", "Ġab"]
DRAFT_MERGES = [("a", "a"), ("a", "b"), ("Ġ", "a"), ("Ġ", "b"), ("ab", "b"), ("b", "ab"), ("Ġa", "b")]
PROMPT_TEXT, FIRST = "ab ba", " b"
DRAWS = 5_000  # per temperature; the broken variant already fails with half as many
REJECT_BELOW = 1e-6


def tiny_tokenizers(root: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    target = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(TARGET_PIECES)}, merges=TARGET_MERGES,
                                  unk_token="<unk>"))
    target.add_special_tokens([AddedToken("<unk>", normalized=False), AddedToken("</s>", normalized=False)])
    target.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    target.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    draft = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(DRAFT_PIECES)}, merges=DRAFT_MERGES))
    draft.add_special_tokens([AddedToken("<|endoftext|>", normalized=False)])
    draft.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    draft.decoder = decoders.ByteLevel()
    dirs = []
    for name, tok in (("target", target), ("draft", draft)):
        (root / name).mkdir(parents=True, exist_ok=True)
        tok.save(str(root / name / "tokenizer.json"))
        dirs.append(tokenizer.get_tokenizer(root / name))
    return dirs


class TextModel:
    """Stands in for a Transformer: the logits of each query are a function of the text of the tokens it sees
    (through the mask the loop passes, or the causal default), with a KV cache of (token, position) per slot
    that decode.move_cache_slots compacts as it does real keys and values. A query must see positions
    0, 1, 2, ... A token's logit is how likely a character model makes its bytes after the text, plus a bias of
    its own; the draft's character model is the target's with noise."""

    def __init__(self, token_bytes: list, seed: int, noise: float = 0.0, scale: float = 1.5):
        generator = torch.Generator().manual_seed(0)
        table = torch.randn(4, 3, generator=generator) * 1.5  # after [start, a, b, space]: next char a, b, space
        generator = torch.Generator().manual_seed(seed)
        table = table + noise * torch.randn(4, 3, generator=generator)
        self.log_char = table.log_softmax(-1)
        self.bias = torch.randn(len(token_bytes), generator=generator) * 0.5
        self.token_bytes, self.scale, self.rows = token_bytes, scale, {}
        self.args = SimpleNamespace(vocab_size=len(token_bytes), block_size=64)
        self.tok_embeddings = SimpleNamespace(weight=torch.empty(0))
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if max_seq_length <= self.max_seq_length:
            return
        self.max_seq_length = max_seq_length
        self.cache = SimpleNamespace(k_cache=torch.full((1, 1, max_seq_length, 2), -1),
                                     v_cache=torch.zeros(1, 1, max_seq_length))
        self.layers = [SimpleNamespace(attention=SimpleNamespace(kv_cache=self.cache))]

    def logits(self, context: tuple) -> torch.Tensor:
        row = self.rows.get(context)
        if row is None:
            text = b"".join(self.token_bytes[t] or b"" for t in context)
            index = {None: 0, ord("a"): 1, ord("b"): 2, ord(" "): 3}
            row = torch.full((len(self.token_bytes),), -float("inf"))
            for t, piece in enumerate(self.token_bytes):
                if piece:
                    last, score = (text[-1] if text else None), 0.0
                    for c in piece:
                        score += float(self.log_char[index[last], index[c] - 1])
                        last = c
                    row[t] = self.scale * score + self.bias[t]
            self.rows[context] = row
        return row

    def __call__(self, idx, input_pos, slots=None, mask=None, block=None):  # block: as Transformer.forward, unused
        slots = input_pos if slots is None else slots
        self.cache.k_cache[0, 0, slots[0]] = torch.stack([idx[0], input_pos[0]], -1)
        written = self.cache.k_cache[0, 0].tolist()
        if mask is None:
            seen = [range(slot + 1) for slot in slots[0].tolist()]
        else:
            seen = [[j for j, visible in enumerate(row) if visible] for row in mask[0, 0].tolist()]
        rows = []
        for visible in seen:
            context, positions = zip(*(written[j] for j in visible))
            order = sorted(range(len(positions)), key=positions.__getitem__)
            assert [positions[i] for i in order] == list(range(len(positions))), positions
            rows.append(self.logits(tuple(context[i] for i in order)))
        return torch.stack(rows).unsqueeze(0)


@functools.lru_cache(maxsize=None)
def tiny_pair(root: Path):
    target_tok, draft_tok = tiny_tokenizers(root)
    target = TextModel(target_tok.token_bytes(), seed=1)
    draft = TextModel(draft_tok.token_bytes(), seed=2, noise=0.6)
    return target_tok, draft_tok, target, draft


def exact_target(root: Path, sampling: Sampling):
    """p(x1) and p(x1, x2) after the prompt and FIRST, by enumeration."""
    target_tok, _, target, _ = tiny_pair(root)
    context = tuple(target_tok.encode_prompt(PROMPT_TEXT) + target_tok.encode_continuation(FIRST))
    p1 = logits_to_probs(target.logits(context), sampling).double()
    p2 = torch.stack([logits_to_probs(target.logits(context + (a,)), sampling) for a in range(len(p1))]).double()
    return p1, p1[:, None] * p2


def speculative_draws(root: Path, sampling: Sampling, n: int, seed: int = 0, auto: bool = False):
    """auto: each step's depth 1 or 2, or a plain step, chosen at random (from its own generator: a choice that
    depends only on the past, as AutoChoice's does)."""
    target_tok, draft_tok, target, draft = tiny_pair(root)
    prompt = target_tok.encode_prompt(PROMPT_TEXT)
    (first,) = target_tok.encode_continuation(FIRST)
    choice = None
    if auto:
        choice = speculate.AutoChoice([(1, 1), (2, 2)])
        picks = random.Random(seed)
        choice.choose = lambda batch: picks.choice([None, (1, 1), (2, 2)])
    speculator = crossdraft.CrossTokenizerSpeculator(Engine(draft), draft_tok, target_tok, len(TARGET_PIECES), 2,
                                                     choice)
    target.setup_caches(1, len(prompt) + 3 + speculator.lookahead + 1)
    target(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1))  # the prefill
    engine = Engine(target)
    torch.manual_seed(seed)
    draws, accept_counts = [], [0] * (speculator.nodes + 1)
    for _ in range(n):
        ids, stats = speculator.generate(engine, torch.tensor(prompt), torch.tensor([first]), 3, sampling,
                                         eos_ids=[], stop_at_eos=False)
        draws.append(ids[0][1:])
        accept_counts = [a + b for a, b in zip(accept_counts, stats["accept_counts"])]
    return torch.tensor(draws), accept_counts


def unnormalized_proposal(q, in_both, shared_draft, shared_target, target_size):
    """Broken: the draft samples from q restricted to the intersection and renormalized, but the verifier is
    handed the restricted q without the renormalization."""
    q_draft, q_target, has_mass = real_proposal(q, in_both, shared_draft, shared_target, target_size)
    mass = (q * in_both[: q.shape[-1]]).sum(-1, keepdim=True)
    return q_draft, q_target * mass, has_mass


real_proposal = crossdraft.restrict_to_shared
LOSSLESS_CASES = {"temperature 1": (Sampling(1.0), False, DRAWS),
                  "temperature 0.6, top-k, top-p": (Sampling(0.6, top_k=8, top_p=0.95), False, DRAWS),
                  "auto: plain steps and depths 1 and 2 mixed": (Sampling(0.8), False, DRAWS),
                  # far from lossless: fewer draws reject it
                  "broken: q not renormalized over the intersection": (Sampling(1.0), True, 2_500)}


@pytest.mark.slow
@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_sampling_is_lossless(case, monkeypatch, tmp_path_factory):
    sampling, broken, n = LOSSLESS_CASES[case]
    root = tmp_path_factory.getbasetemp() / "tiny_pair"
    target_tok, draft_tok, _, _ = tiny_pair(root)
    assert target_tok.encode_continuation("ab ba aab") != [] and draft_tok.vocab_size != target_tok.vocab_size
    if broken:
        monkeypatch.setattr(crossdraft, "restrict_to_shared", unnormalized_proposal)
    draws, accept_counts = speculative_draws(root, sampling, n, auto=case.startswith("auto"))
    p1, joint = exact_target(root, sampling)
    size = len(p1)
    first, second = draws[:, 0], draws[:, 1]
    pvalues = {"first token": chi_square_pvalue(torch.bincount(first, minlength=size), p1),
               "second token": chi_square_pvalue(torch.bincount(second, minlength=size), joint.sum(0)),
               "pair": chi_square_pvalue(torch.bincount(first * size + second, minlength=size ** 2), joint.flatten())}
    if broken:
        assert min(pvalues.values()) < REJECT_BELOW, pvalues
    else:
        assert min(pvalues.values()) > REJECT_BELOW, pvalues
        assert accept_counts[0] > 0.05 * n and accept_counts[2] > 0.05 * n, accept_counts  # both happen
