"""Speculative decoding with a draft whose tokenizer differs from the target's; tokens of both sides are compared
by their exact bytes (Tokenizer.token_bytes). Each step:
  1. the draft drafts K tokens from its own context;
  2. the target verifies them as a chain in one forward. Greedy: the drafted text is re-tokenized for the target.
     Sampled: Token-Level Intersection (TLI, Timor et al. 2025), proof in restrict_to_shared;
  3. the accepted text is re-encoded for the draft from a few tokens back, and its cache rewound to the common prefix.
Correctness never depends on 3, only acceptance does."""
import functools
import re
import time
from typing import Optional

import torch
from torch import Tensor

from decode import Engine, Sampling, decode_n_tokens, decode_one_token, logits_to_probs, sample_from, \
    sdpa_context
from errors import UserError
from speculate import MAX_TREE_NODES, AutoChoice, Stats, Tree, plain_step_seconds, synchronize, verify_step

LOOK_BEHIND = 4  # draft tokens re-encoded with newly accepted text
CATCH_UP_STEPS = 2  # this few unread tokens: the one-token graph, cheaper than a forward
SURROGATE = re.compile("([\udc80-\udcff])")  # a byte outside valid UTF-8, as errors="surrogateescape" decodes it


class Vocabulary:
    """A tokenizer seen as byte strings: each id's bytes, and bytes back to ids."""

    def __init__(self, tokenizer, model_vocab_size: int):
        self.tokenizer = tokenizer
        self.bytes = tokenizer.token_bytes() + [None] * max(0, model_vocab_size - tokenizer.vocab_size)
        self.byte_token = {}  # byte -> an id of that one byte
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
    """The generation loop with a draft of another tokenizer, one prompt at a time; stats count target tokens.
    With `auto` (speculate.AutoChoice) each step verifies a chain of K target tokens (up to `depth`; the draft drafts
    K tokens, whose text gives at most K target tokens, or a plain step, with the most expected tokens per second:
    measured in target tokens, a chain of any K tells the acceptance of every shorter one, as for other drafts."""
    kind = "draft-cross-tokenizer"
    features = ()  # the target features it reads (none: as Speculator.features for a draft model)

    def __init__(self, engine: Engine, draft_tokenizer, target_tokenizer, target_vocab_size: int, depth: int,
                 auto: Optional[AutoChoice] = None):
        draft_model = engine.model
        self.engine, self.draft_model, self.depth, self.auto = engine, draft_model, depth, auto
        self.draft_vocab = Vocabulary(draft_tokenizer, draft_model.args.vocab_size)
        self.target_vocab = Vocabulary(target_tokenizer, target_vocab_size)
        # K draft tokens can re-tokenize into more target tokens
        self.nodes = min(2 * depth, MAX_TREE_NODES)
        self.lookahead = self.nodes + 2  # target cache slots a step may write past the accepted tokens
        self.compiled = engine.mode != "none"
        self.caught_up = None  # draft(): when the draft had read the accepted text
        # the intersection I: draft id -> target id of the same bytes (the one the target encodes them as)
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
        # single graphs where the engine compiles whole, else step by step
        self.tli_step = engine.compile(tli_step) or functools.partial(tli_step, engine.forward)
        self.run_chain = engine.compile(cross_chain)

    def forget(self):
        """As Speculator.forget: nothing of an earlier generation's text is kept here (start() resets the draft)."""

    def generate(self, target: Engine, prompt, first: Tensor, max_new_tokens: int, sampling: Sampling,
                 eos_ids: list, stop_at_eos: bool, callback=None):
        """Tokens after `prompt` (in the target's cache) and `first`: ([new ids], stats)."""
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise UserError("a draft with another tokenizer speculates one prompt at a time: drop `batch_size`")
            prompt = prompt[0]
        prompt = prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
        stats = Stats(self.nodes, self.nodes)
        eos = set(eos_ids)
        pos = len(prompt)  # target cache slot of the last emitted token, not yet cached
        out = [int(first.view(-1)[0])]
        if callback:
            callback(first)
        stats.draft_forwards += self.start(prompt, target.model.max_seq_length)
        text = self.target_vocab.text(out)  # the text both sides follow
        self.sync(text)
        synced, after_plain = len(text), False
        auto = self.auto
        if auto and (1, 1) not in auto.verify_seconds and len(out) < max_new_tokens:
            auto.timed(auto.verify_seconds, (1, 1), plain_step_seconds(target, [prompt + out], [pos], sampling),
                       warm=True)
        while len(out) < max_new_tokens and not (stop_at_eos and out[-1] in eos):
            last = len(out) == max_new_tokens - 1  # only the target's own token still fits
            if auto:  # the last token: a plain step (a root-only tree would be verified at a padded width)
                arm = None if last else auto.choose(1)
            else:
                arm = (self.depth, self.nodes)
            started = time.perf_counter()
            steps = 1
            if arm is None:  # plain steps, as many as the choice takes in a row, through plain decoding's own loop
                steps = auto.plain_run(max_new_tokens - len(out))  # (the draft catches up at its next step)
                tree = Tree.rooted_at(out[-1])
                drafted = started
                tokens = decode_n_tokens(target, torch.tensor([out[-1]], device=self.device), pos, steps, sampling,
                                         eos_ids, stop_at_eos)
                path, next_token, extra = [], int(tokens[0][0]), [int(t[0]) for t in tokens[1:]]
                steps = len(tokens)
                stats.plain_steps += steps
                stats.target_forwards += steps - 1
            else:
                if synced < len(text):  # the draft follows the text accepted since its last step (plain steps
                    self.sync(text)     # leave it be: correctness never depends on it)
                    synced = len(text)
                self.caught_up = None
                tree, forwards = self.draft(out[-1], 0 if last else arm[0], sampling, arm[1])
                if after_plain and self.caught_up is not None:  # reading the plain steps' tokens is the cost of
                    started = self.caught_up                     # switching, not of this depth: not priced in it
                proposed = len(tree.tokens) - 1
                if self.compiled:  # at most two verify shapes per arm: K + 1 and N + 1
                    tree.pad_to((arm[0] if proposed <= arm[0] else arm[1]) + 1)
                if auto:  # the draft's own seconds (a sync on CUDA)
                    synchronize(target.model)
                drafted = time.perf_counter()
                path, next_token = verify_chain(target, tree, pos, sampling)
                stats.draft_forwards += forwards
                stats.accept_counts[len(path)] += 1
                stats.drafted += proposed
            if auto and not last:
                synchronize(target.model)
                auto.observe(arm, [tree], [path], drafted - started, time.perf_counter() - drafted, 1,
                             width=len(tree.tokens), steps=steps)
            stats.target_forwards += 1
            after_plain = arm is None
            new = [tree.tokens[node] for node in path] + [next_token] + (extra if arm is None else [])
            pos += len(new)
            for t in new:
                if len(out) >= max_new_tokens or (stop_at_eos and out[-1] in eos):
                    break
                out.append(t)
                if callback:
                    callback(torch.tensor([t]))
            text += self.target_vocab.text(new)
        if auto:
            auto.finished()
        summary = stats.summary()
        summary["speculate_k"] = "auto" if auto else self.depth  # draft tokens per step
        return [out], summary

    def start(self, prompt: list, max_seq_length: int) -> int:
        """Encode the target's prompt for the draft (its own BOS); the first draft() feeds it."""
        target_tok, draft_tok = self.target_vocab.tokenizer, self.draft_vocab.tokenizer
        lead = target_tok.encode_prompt("")
        body = prompt[len(lead):] if prompt[:len(lead)] == lead else prompt
        self.prompt = draft_tok.encode_prompt(target_tok.decode(body))
        # room for the prompt and up to 4 draft tokens per target token
        capacity = min(self.draft_model.args.block_size, len(self.prompt) + 4 * (max_seq_length - len(prompt)))
        self.draft_model.setup_caches(1, max(capacity, 1))
        self.capacity = capacity
        self.generated, self.cached, self.pending = [], [], list(self.prompt)  # cached: ids the cache holds
        return 0

    def draft(self, root: int, depth: int, sampling: Sampling, limit: int):
        """A chain rooted at `root` of the target tokens (at most `limit`) that `depth` draft tokens make, and the
        draft forwards it took."""
        tree = Tree.rooted_at(root)
        if depth <= 0 or limit <= 0 or not self.pending or len(self.cached) + len(self.pending) + depth > self.capacity:
            return tree, 0  # nothing to gain, or the draft's context is full
        forwards, device = 0, self.device
        catch_up = self.pending[:-1]  # accepted tokens the draft has not read
        if 0 < len(catch_up) <= CATCH_UP_STEPS and self.compiled:
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
        self.caught_up = time.perf_counter()  # when the draft had read the accepted text (`auto`)
        if self.run_chain is not None and depth == self.depth:  # one graph of this depth (`auto`: step by step)
            drafted, proposals = self.draft_chain(token, sampling)
            forwards += self.depth
            for t, q_target in zip(drafted, proposals if sampling.temperature else []):
                tree.add(self.to_target[t], len(tree.tokens) - 1, q_target)
        else:
            for _ in range(depth):
                drawn, q_target = self.step(token, sampling)
                forwards += 1
                token = int(drawn[0])
                if sampling.temperature == 0:
                    if self.draft_vocab.bytes[token] is None:  # a special token has no text
                        break
                else:
                    if token < 0:  # q had no mass on I
                        break
                    tree.add(self.to_target[token], len(tree.tokens) - 1, q_target[0].clone())  # outlives the graph
                drafted.append(token)
        if sampling.temperature == 0:  # the drafted text, re-tokenized for the target
            for t in self.target_vocab.encode(self.draft_vocab.text(drafted))[:limit]:
                tree.add(t, len(tree.tokens) - 1)
        return tree, forwards

    def step(self, token: int, sampling: Sampling):
        """Feed `token` at the draft's next cache slot: (argmax, None) when greedy, else tli_step's (draw, q_T)."""
        x = torch.tensor([[token]], device=self.device)
        input_pos = torch.tensor([[len(self.cached)]], device=self.device)
        self.cached.append(token)
        with sdpa_context():
            if sampling.temperature == 0:
                return self.engine.decode_one_token(self.draft_model, x, input_pos, sampling)[0], None
            return self.tli_step(x, input_pos, sampling, self.in_both, self.shared_draft,
                                 self.shared_target, self.target_size)

    def draft_chain(self, token: int, sampling: Sampling):
        """The K draft steps after `token` in one call: the tokens before the first special token (greedy) or
        failed draw (sampled), and their q_T [K, V_target] (None if greedy)."""
        x = torch.tensor([[token]], device=self.device)
        input_pos = torch.tensor([[len(self.cached)]], device=self.device)
        with sdpa_context():
            tokens, proposals = self.run_chain(x, input_pos, sampling, self.depth, self.in_both,
                                               self.shared_draft, self.shared_target, self.target_size)  # [1, K] ...
        tokens = tokens[0].tolist()
        self.cached += [token] + [max(t, 0) for t in tokens[:-1]]  # what the graph fed (a -1 as 0)
        greedy = sampling.temperature == 0
        end = next((i for i, t in enumerate(tokens) if (self.draft_vocab.bytes[t] is None if greedy else t < 0)),
                   len(tokens))
        # copy: a CUDA graph's next replay overwrites its outputs
        return tokens[:end], None if greedy else proposals[0].clone()

    def sync(self, text: bytes):
        """Re-encode `text` from LOOK_BEHIND draft tokens back, keep the cache up to the common prefix, and leave
        the rest (at least one token, whose logits the next step needs) pending."""
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
    """TLI's proposal: q_I [B, V_draft], the draft's warped q restricted to I and renormalized; q_T [B, V_target],
    q_I mapped to the target's vocabulary; and whether q had mass on I [B].
    Lossless: y = map(d) with d ~ q_I is distributed as q_T, and the rejection rule (Leviathan et al. 2023; Chen et
    al. 2023) outputs exactly p for any proposal y truly comes from (hence the renormalization; q_I is 0 outside I)."""
    q = q * in_both[: q.shape[-1]]  # [B, V_draft]
    mass = q.sum(-1, keepdim=True)  # [B, 1]
    q_draft = q / mass.clamp_min(torch.finfo(q.dtype).tiny)
    q_target = q.new_zeros(q.shape[0], target_size).index_add_(1, shared_target, q_draft[:, shared_draft])
    return q_draft, q_target, mass[:, 0] > 0


def tli_step(forward, x: Tensor, input_pos: Tensor, sampling: Sampling, in_both: Tensor, shared_draft: Tensor,
             shared_target: Tensor, target_size: int):
    """One sampled TLI step over x [B, 1]: a draw from q_I [B] (-1 where q has no mass on I) and q_T [B, V_target]."""
    q = logits_to_probs(forward(x, input_pos)[:, -1], sampling)  # [B, V_draft]
    q_draft, q_target, has_mass = restrict_to_shared(q, in_both, shared_draft, shared_target, target_size)
    return torch.where(has_mass, sample_from(q_draft), -1), q_target


def cross_chain(forward, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, in_both: Tensor,
                shared_draft: Tensor, shared_target: Tensor, target_size: int):
    """`depth` draft steps, each token fed back, in one graph (Engine.compile); x, input_pos [B, 1]. Returns the
    tokens [B, depth] (-1: no mass on I, fed on as 0) and their q_T [B, depth, V_target] (None if greedy)."""
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
