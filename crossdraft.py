"""Speculative decoding with a draft model whose tokenizer differs from the target's.

The draft drafts in its own token space from its own context; what it drafts reaches the target as text, and
the target's accepted tokens come back to the draft as text. Tokens of both sides are compared by their exact
bytes (Tokenizer.token_bytes: byte-level BPE pieces through the byte alphabet, sentencepiece pieces with "▁" as a
space and <0xNN> as a byte; special tokens have none). Each step:

  1. draft: K tokens from the draft's own context (greedy: its argmax; sampling: see 2b)
  2. map them to a chain of target tokens, which the target verifies in one forward (speculate.verify_step):
     a. temperature 0, string-level exact match (Universal Assisted Generation, Hugging Face 2024; Timor et al.
        2025, "SLEM" in its greedy form): the drafted bytes are re-tokenized with the target's tokenizer and the
        longest prefix equal to the target's argmax is accepted, plus the target's own next token. Whatever the
        draft proposes, every emitted token is the target's argmax: the output is the target's greedy output.
     b. temperature > 0, Token-Level Intersection (TLI; Timor et al., ICML 2025, "Accelerating LLM Inference with
        Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", algorithm 4): the draft samples
        from its warped distribution restricted to the intersection I (draft tokens whose bytes are exactly one
        target token's bytes) and renormalized; each draft token maps to one target token, and that distribution,
        mapped to the target's vocabulary, is the proposal q of the standard rejection rule (proof in
        restrict_to_shared).
  3. keep the draft in step: the accepted text is re-encoded with the draft's tokenizer from a few tokens back
     (a look-behind: re-tokenization does not round-trip at boundaries, e.g. " in" + "put" is " input"), the new
     token stream is compared with what the draft's cache holds, and the cache is rewound to the longest common
     prefix (the slots after it are simply overwritten by the next forwards: the KV cache is static).
Correctness never depends on 3 (only acceptance does): 2a emits only target argmaxes, 2b only tokens the
rejection rule passes.
"""
import re
from typing import Optional

import torch
from torch import Tensor

from decode import Engine, Sampling, compile_engine, decode_one_token, logits_to_probs, sample_from, sdpa_context
from model import UserError
from speculate import MAX_TREE_NODES, Stats, Tree, verify_step

LOOK_BEHIND = 4  # draft tokens re-encoded together with the newly accepted text
# accepted tokens the draft catches up on one at a time through its compiled one-token graph (about 0.4 ms each for
# the tiny draft) rather than in one eager forward (0.7-1.2 ms for 1-3 tokens)
CATCH_UP_STEPS = 2
SURROGATE = re.compile("([\udc80-\udcff])")  # a byte outside valid UTF-8, as errors="surrogateescape" decodes it


class Vocabulary:
    """A tokenizer seen as byte strings: each id's bytes, and bytes back to ids."""

    def __init__(self, tokenizer, model_vocab_size: int):
        self.tokenizer = tokenizer
        self.bytes = tokenizer.token_bytes() + [None] * max(0, model_vocab_size - tokenizer.vocab_size)
        self.byte_token = {}  # byte value -> an id of that single byte (for bytes outside valid UTF-8)
        for i, b in enumerate(self.bytes):
            if b is not None and len(b) == 1:
                self.byte_token.setdefault(b[0], i)

    def text(self, ids) -> bytes:
        return b"".join(self.bytes[i] or b"" for i in ids)

    def encode(self, data: bytes) -> list:
        """Ids whose bytes join to `data` (mid-stream: no prefix space; invalid UTF-8 as single-byte tokens)."""
        ids = []
        for part in SURROGATE.split(data.decode("utf-8", errors="surrogateescape")):
            if len(part) == 1 and "\udc80" <= part <= "\udcff":
                token = self.byte_token.get(ord(part) - 0xDC00)
                ids += [token] if token is not None else []
            elif part:
                ids += self.tokenizer.encode_continuation(part)
        return ids

    def round_trips(self, text: str) -> bool:
        return self.text(self.encode(text.encode("utf-8"))) == text.encode("utf-8")


PROBE = "def main():\n    return x[1:] + 42  # The quick brown fox, naïve café"


class CrossTokenizerSpeculator:
    """The generation loop with a draft of another tokenizer: draft K tokens, map them to a chain of target tokens,
    verify the chain in one target forward, re-sync the draft's cache with the accepted text. One prompt at a time.
    Stats count target tokens (accept_counts[i]: steps that accepted i target tokens)."""
    kind = "draft-cross-tokenizer"

    def __init__(self, draft_model, draft_tokenizer, target_tokenizer, target_vocab_size: int, depth: int):
        self.draft_model, self.depth = draft_model, depth
        self.draft_vocab = Vocabulary(draft_tokenizer, draft_model.args.vocab_size)
        self.target_vocab = Vocabulary(target_tokenizer, target_vocab_size)
        # target tokens verified per step: K draft tokens can re-tokenize into more target tokens; the rest is cut
        self.nodes = min(2 * depth, MAX_TREE_NODES)
        self.lookahead = self.nodes + 2  # target cache slots a step may write past the accepted tokens
        self.engine = Engine(draft_model)  # its prefill is also the catch-up forward over several tokens (any length)
        self.compiled = False
        # the intersection I: draft id -> the target id of the same bytes (the target's own token for those bytes
        # where it has several, e.g. sentencepiece's "a" and "<0x61>")
        target_of = {}
        for i, b in enumerate(self.target_vocab.bytes):
            if b is not None and (b not in target_of or self.target_vocab.encode(b) == [i]):
                target_of[b] = i
        pairs = [(d, target_of[b]) for d, b in enumerate(self.draft_vocab.bytes) if b in target_of]
        self.device = device = draft_model.tok_embeddings.weight.device
        self.shared_draft = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=device)
        self.shared_target = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)
        self.in_both = torch.zeros(draft_model.args.vocab_size, device=device)
        self.in_both[self.shared_draft] = 1.0
        self.to_target = dict(pairs)
        self.target_size = target_vocab_size
        self.tli_step, self.tli_forward = tli_step, draft_model  # a sampled draft step; compile() compiles it
        # the K draft steps of a chain in one call (cross_chain), one graph where the draft compiles whole; None: step
        # by step (a regionally compiled draft)
        self.chain = cross_chain

    def compile(self, device: str, compile_prefill: bool = False, whole_graph: Optional[bool] = None,
                autotune: bool = False):
        """Static graphs for the draft's one-token forward (the catch-up) and its K-step chain (cross_chain: one call
        and one host sync per step, one graph where the draft compiles whole). The target's verify forward (compiled
        by the caller) gets two shapes: chains are padded to K + 1 or, when re-tokenization made them longer,
        `nodes` + 1 target tokens (on a CPU a verify forward costs more for every token it carries, padding
        included)."""
        self.engine = compile_engine(self.draft_model, device, compile_prefill, whole_graph, autotune)
        options = self.engine.graph_kwargs
        if options is not None:  # the draft compiled whole: the sampled step (forward, warping, TLI's restriction, the
            # draw) as one graph
            self.tli_step = torch.compile(tli_step, fullgraph=True, dynamic=False, **options)
            self.chain = torch.compile(cross_chain, fullgraph=True, dynamic=False, **options)  # K steps, one graph
        else:  # the draft's regional forward, then the rest
            self.tli_forward = self.engine.forward
            self.chain = None
        self.compiled = True

    # ------------------------------------------------------------------------- the loop

    def generate(self, target: Engine, prompt, first: Tensor, max_new_tokens: int, sampling: Sampling,
                 eos_ids: list, stop_at_eos: bool, callback=None):
        """Tokens after `prompt` (1-D ids, or a list holding one prompt's ids; the target's cache holds it) and
        `first` (the prefill's token). Returns ([new ids], acceptance stats counted in target tokens)."""
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise UserError("a draft with another tokenizer speculates one prompt at a time: drop --batch_size")
            prompt = prompt[0]
        prompt = prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
        stats = Stats(self.nodes, self.nodes)
        eos = set(eos_ids)
        pos = len(prompt)  # target cache slot of the current token (the last one emitted, not yet cached)
        out = [int(first.view(-1)[0])]
        if callback:
            callback(first)
        stats.draft_forwards += self.start(prompt, target.model.max_seq_length)
        text = self.target_vocab.text(out)  # the generated text, as both sides must see it
        self.sync(text)
        while len(out) < max_new_tokens and not (stop_at_eos and out[-1] in eos):
            last = len(out) == max_new_tokens - 1  # only the target's own token can still be emitted
            tree, forwards = self.draft(out[-1], 0 if last else self.nodes, sampling)
            proposed = len(tree.tokens) - 1
            if self.compiled:  # two verify shapes: K + 1 target tokens (every sampled chain, most greedy ones), 2K + 1
                tree.pad_to((self.depth if proposed <= self.depth else self.nodes) + 1)
            path, next_token = verify_chain(target, tree, pos, sampling)
            stats.draft_forwards += forwards
            stats.target_forwards += 1
            stats.accept_counts[len(path)] += 1
            stats.drafted += proposed
            new = [tree.tokens[node] for node in path] + [next_token]
            pos += len(new)
            for t in new:
                if len(out) >= max_new_tokens or (stop_at_eos and out[-1] in eos):
                    break
                out.append(t)
                if callback:
                    callback(torch.tensor([t]))
            text += self.target_vocab.text(new)
            self.sync(text)
        summary = stats.summary()
        summary["speculate_k"] = self.depth  # draft tokens per step; accept_counts go up to `nodes` target tokens
        return [out], summary

    def start(self, prompt: list, max_seq_length: int) -> int:
        """The draft's own prompt: the target's prompt as text (its leading BOS replaced by the draft's own
        special tokens), encoded by the draft's tokenizer. Nothing is run yet: the first draft() feeds it."""
        target_tok, draft_tok = self.target_vocab.tokenizer, self.draft_vocab.tokenizer
        lead = target_tok.encode_prompt("")
        body = prompt[len(lead):] if prompt[:len(lead)] == lead else prompt
        self.prompt = draft_tok.encode_prompt(target_tok.decode(body))
        # the draft's positions count its own tokens: room for the prompt and up to 4 draft tokens per target token
        capacity = min(self.draft_model.args.block_size, len(self.prompt) + 4 * (max_seq_length - len(prompt)))
        self.draft_model.setup_caches(1, max(capacity, 1))
        self.capacity = capacity
        self.generated, self.cached, self.pending = [], [], list(self.prompt)  # cached: ids the cache holds
        return 0

    def draft(self, root: int, limit: int, sampling: Sampling):
        """A chain of at most `limit` target tokens rooted at `root` (K draft tokens, each one target token at
        temperature > 0, re-tokenized at 0), and the draft forwards it took."""
        tree = Tree.rooted_at(root)
        if limit <= 0 or not self.pending or len(self.cached) + len(self.pending) + self.depth > self.capacity:
            return tree, 0  # nothing to gain, or the draft's context is full: a plain target step
        forwards, device = 0, self.device
        catch_up = self.pending[:-1]  # accepted text the draft has not read yet
        if 0 < len(catch_up) <= CATCH_UP_STEPS and self.compiled:  # through the compiled one-token graph
            for token in catch_up:
                self.step(token, sampling)
            forwards += len(catch_up)
        elif catch_up:  # one forward over them all
            start = len(self.cached)
            x = torch.tensor([catch_up], device=device)
            self.engine.write_cache(x, torch.arange(start, start + x.shape[1], device=device).view(1, -1))  # [1, L]
            self.cached += catch_up
            forwards += 1
        token, drafted = self.pending[-1], []
        self.pending = []
        if self.chain is not None:  # the K steps in one call
            drafted, proposals = self.draft_chain(token, sampling)
            forwards += self.depth
            for t, q_target in zip(drafted, proposals if sampling.temperature else []):
                tree.add(self.to_target[t], len(tree.tokens) - 1, q_target)
        else:
            for _ in range(self.depth):
                drawn, q_target = self.step(token, sampling)
                forwards += 1
                token = int(drawn[0])
                if sampling.temperature == 0:
                    if self.draft_vocab.bytes[token] is None:  # a special token ends what the draft can say as text
                        break
                else:
                    if token < 0:  # q put no mass on tokens both vocabularies share
                        break
                    tree.add(self.to_target[token], len(tree.tokens) - 1, q_target[0].clone())  # kept past the next
                drafted.append(token)
        if sampling.temperature == 0:  # the drafted text, re-tokenized for the target
            for t in self.target_vocab.encode(self.draft_vocab.text(drafted))[:limit]:
                tree.add(t, len(tree.tokens) - 1)
        return tree, forwards

    def step(self, token: int, sampling: Sampling):
        """Feed `token` to the draft at the next slot of its cache: at temperature 0 its one-token decode graph
        (returns its argmax, None), else tli_step (a draw from q_I, q_T: the proposal the verifier gets)."""
        x = torch.tensor([[token]], device=self.device)
        input_pos = torch.tensor([[len(self.cached)]], device=self.device)
        self.cached.append(token)
        with sdpa_context():
            if sampling.temperature == 0:
                return self.engine.decode_one_token(self.draft_model, x, input_pos, sampling)[0], None
            return self.tli_step(self.tli_forward, x, input_pos, sampling, self.in_both, self.shared_draft,
                                 self.shared_target, self.target_size)

    def draft_chain(self, token: int, sampling: Sampling):
        """The K draft steps after `token` in one call (cross_chain): the drafted draft tokens up to the first that
        ends the chain (greedy: a special token, which has no text; sampled: none drawn, where q had no mass on the
        tokens both vocabularies share), and their proposals q_T over the target's vocabulary [K, V_target] (None
        at temperature 0). The cache then holds every token fed, including those past the end (sync() rewinds it)."""
        x = torch.tensor([[token]], device=self.device)
        input_pos = torch.tensor([[len(self.cached)]], device=self.device)
        with sdpa_context():
            tokens, proposals = self.chain(self.tli_forward, x, input_pos, sampling, self.depth, self.in_both,
                                           self.shared_draft, self.shared_target, self.target_size)  # [1, K] ...
        tokens = tokens[0].tolist()
        self.cached += [token] + [max(t, 0) for t in tokens[:-1]]  # what the graph fed (a -1 as 0)
        greedy = sampling.temperature == 0
        end = next((i for i, t in enumerate(tokens) if (self.draft_vocab.bytes[t] is None if greedy else t < 0)),
                   len(tokens))
        # out of the graph's output (a CUDA graph's replay overwrites it): [K, V_target]
        return tokens[:end], None if greedy else proposals[0].clone()

    def sync(self, text: bytes):
        """Bring the draft's token stream to the generated text `text` (the target's accepted bytes): re-encode
        it from LOOK_BEHIND draft tokens back, keep the cache up to the longest common prefix with what it holds,
        and leave the rest (at least one token, whose logits the next draft step needs) pending."""
        keep = max(0, len(self.generated) - LOOK_BEHIND)
        done = len(self.draft_vocab.text(self.generated[:keep]))
        self.generated = self.generated[:keep] + self.draft_vocab.encode(text[done:])
        stream = self.prompt + self.generated
        common = 0
        for a, b in zip(stream, self.cached):
            if a != b:
                break
            common += 1
        common = max(0, min(common, len(stream) - 1))
        self.cached, self.pending = self.cached[:common], stream[common:]


def restrict_to_shared(q: Tensor, in_both: Tensor, shared_draft: Tensor, shared_target: Tensor, target_size: int):
    """TLI's proposal: q_I = q, the draft's warped distribution [B, V_draft] (same temperature / top-k / top-p as
    the target's: decode.logits_to_probs), restricted to I and renormalized, and q_T [B, V_target], q_I pushed to
    the target's vocabulary (q_T(y) = sum of q_I(d) over the d in I that map to y); and whether q put any mass on
    I [B] (where it put none, q_I is 0 and the step drafts nothing).

    Why it is lossless: the drafted draft token d is drawn from q_I and the target sees y = map(d), so given
    everything that decided the chain so far (the accepted text, the draft's own earlier draws), y is
    distributed exactly as q_T. The verifier (speculate.verify) accepts y with probability min(1, p(y) / q_T(y))
    and otherwise samples from norm(max(0, p - q_T)); for ANY proposal distribution q_T over the target's
    vocabulary with y ~ q_T, this outputs exactly p (Leviathan et al. 2023, appendix A.1; Chen et al. 2023),
    and p depends only on the target's tokens, so the output is target-distributed whatever the draft's
    hidden state holds. Two conditions make it so, and both hold here: q_T must be the distribution y was
    really drawn from (renormalized over I: handing the verifier q restricted to I but not renormalized
    overstates p/q and accepts too often; the tests' broken variant does that and is rejected), and every
    drawn d must have a target token (q_I is 0 outside I, so the draft never samples outside it)."""
    q = q * in_both[: q.shape[-1]]  # [B, V_draft]
    mass = q.sum(-1, keepdim=True)  # [B, 1]
    q_draft = q / mass.clamp_min(torch.finfo(q.dtype).tiny)
    q_target = q.new_zeros(q.shape[0], target_size).index_add_(1, shared_target, q_draft[:, shared_draft])
    return q_draft, q_target, mass[:, 0] > 0


def tli_step(forward, x: Tensor, input_pos: Tensor, sampling: Sampling, in_both: Tensor, shared_draft: Tensor,
             shared_target: Tensor, target_size: int):
    """One sampled draft step of TLI: the draft's forward over x [B, 1], its warped distribution q, a draft token
    drawn from q_I (-1 in a row where q has no mass on I) [B], and q_T [B, V_target] (restrict_to_shared)."""
    q = logits_to_probs(forward(x, input_pos)[:, -1], sampling)  # [B, V_draft]
    q_draft, q_target, has_mass = restrict_to_shared(q, in_both, shared_draft, shared_target, target_size)
    return torch.where(has_mass, sample_from(q_draft), -1), q_target


def cross_chain(forward, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, in_both: Tensor,
                shared_draft: Tensor, shared_target: Tensor, target_size: int):
    """`depth` draft steps, each drawn token fed back as the next query, in one graph (CrossTokenizerSpeculator.
    compile): x, input_pos [B, 1]. Returns the draft tokens [B, depth] (temperature 0: the draft's argmax; else
    tli_step's draws, -1 where q had no mass on I, fed on as token 0) and at temperature > 0 their proposals q_T
    [B, depth, V_target] (else None). The same draws, in the same order, as `depth` calls of tli_step."""
    tokens, proposals = [], []
    for _ in range(depth):
        if sampling.temperature == 0:
            token, q_target = decode_one_token(forward, x, input_pos, sampling)[0], None
        else:
            token, q_target = tli_step(forward, x, input_pos, sampling, in_both, shared_draft, shared_target,
                                       target_size)
        tokens.append(token)
        proposals.append(q_target)
        x, input_pos = token.clamp_min(0).view(-1, 1), input_pos + 1  # [B, 1] each
    return torch.stack(tokens, 1), torch.stack(proposals, 1) if sampling.temperature > 0 else None


def verify_chain(target: Engine, tree: Tree, pos: int, sampling: Sampling):
    """speculate.verify_step on one tree (batch row 0): (accepted path, next token)."""
    return verify_step(target, [tree], [pos], sampling)[0]


def make_drafter(draft_model, draft_tokenizer, target_tokenizer, target_vocab_size: int, depth, tree_nodes,
                 ngram: int, batch_size: int, prompts_file: bool) -> CrossTokenizerSpeculator:
    """The drafter for a draft whose tokenizer is not the target's; settings it cannot serve raise UserError."""
    if draft_tokenizer.vocab_size > draft_model.args.vocab_size:
        raise UserError(f"the draft's tokenizer ({draft_tokenizer.directory}) has {draft_tokenizer.vocab_size} tokens, "
                        f"more than the draft model's {draft_model.args.vocab_size}: use the tokenizer the draft came "
                        f"with, or pick a draft from the same model family")
    if batch_size > 1 or prompts_file:
        raise UserError("a draft with another tokenizer speculates one prompt at a time: drop --batch_size and "
                        "--prompts_file, or use a draft with the target's tokenizer")
    if depth == "auto" or tree_nodes not in (None, depth) or ngram:
        raise UserError("a draft with another tokenizer drafts a chain of a fixed depth: give --speculate_k N and "
                        "drop --tree_nodes, --draft_ngram and 'auto'")
    drafter = CrossTokenizerSpeculator(draft_model, draft_tokenizer, target_tokenizer, target_vocab_size, depth)
    for name, vocab in (("draft", drafter.draft_vocab), ("target", drafter.target_vocab)):
        if not vocab.round_trips(PROBE):
            raise UserError(f"cannot map the {name}'s tokens to text ({vocab.tokenizer.directory}: its pieces are "
                            f"neither byte-level nor sentencepiece-style): pick a draft with the target's tokenizer")
    if len(drafter.to_target) == 0:
        raise UserError("the draft's and the target's tokenizers share no token: pick another draft")
    return drafter
