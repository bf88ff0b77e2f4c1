"""An OpenAI-compatible server over generation.py: continuous batching, speculative decoding inside the batch, a
chat page. docs/serve.md explains the design.

    python serve.py --checkpoint_path checkpoints/tiny/target/model.pth --max_batch_size 8
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Where a token comes from: the HTTP handlers check a request and queue it; one scheduler thread owns the model. At
each step boundary it gives waiting requests free rows of a fixed batch, then runs a step (Scheduler.step): the
next prompt chunk of one prefilling request, alone on cache row 0 ([1, width]), then one [n, 1] forward over the
first n cache rows, where the decoding rows lie (n: the smallest of DECODE_BATCHES holding them), each feeding its
current token. Padding and idle rows write only a scratch cache slot past every real position, which no real query
sees, and see only one slot themselves. Each row's token is drawn from its own logits with its own settings
and torch.Generator (accept_row). With a drafter (n-gram lookups, a draft model) a decode step may instead be
speculative (Scheduler.speculative_step): every drafting row drafts a token tree, one [n, N + 1] target forward
verifies all rows' trees, and each row accepts its own path (accept_row again); `auto` decides per step and batch
size whether drafting pays. A draft head or a draft of another tokenizer speculates for a request alone, through the
library's loop (Scheduler.speculate). A cache row keeps the keys and values of its last request when it
ends (its prompt and answer): a newcomer whose prompt starts with some row's ids starts its prefill after them
(the prefix cache, Scheduler.place). Under torchrun (tensor parallelism) rank 0 serves and every other rank runs rank
0's engine calls on its shard of the model (tp.Lockstep, main).
"""
import argparse
import asyncio
import codecs
import collections
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from errors import UserError, flag_names, interruptible_imports

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

from compilation import COMPILE_MODES  # noqa: E402
from decode import PRECISIONS, Sampling, chosen_is_finite, logits_to_probs, sdpa_context  # noqa: E402
from decode import move_cache_slots  # noqa: E402
from draftmodel import ModelDrafter  # noqa: E402
from generation import FiniteWatch, Generator, Speculation, setup_distributed  # noqa: E402
from grammar import DEAD_END, Constraint, SchemaError, apply_bitmask, check_schema  # noqa: E402
from speculate import NO_PARENT, AutoChoice, NgramDrafter, Speculator, Tree, constrain, keep_paths, tree_inputs, \
    verify, verify_greedy  # noqa: E402
from tp import RanksFailed  # noqa: E402

log = logging.getLogger("serve")
STATIC = Path(__file__).resolve().parent / "static"
# prompt tokens of one prefill forward: a long prompt stalls the decoding rows for one such forward at a time; a
# shorter piece is padded to the next of these widths only, each a graph compiled at warm-up (docs/serve.md)
PREFILL_WIDTHS = (16, 32, 64, 128)
# a decode step computes only the rows in use: n decoding rows, moved to the lowest cache rows, run as a forward of
# the smallest of these batches (or of --max_batch_size) that holds them, each a graph built at warm-up
DECODE_BATCHES = (1, 2, 4)
MAX_STOP_STRINGS = 4
# a request body larger than this (a context of 100k+ tokens is well under it) or slower to arrive is refused before
# it is read whole: a huge or endless body never fills the memory or holds a connection
MAX_BODY_BYTES, BODY_SECONDS = 4 << 20, 30.0


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------- a request: its settings, tokens, text

@dataclass
class Request:
    """One completion. The scheduler thread appends its tokens and text; `push` hands events to the HTTP side:
    ("text", str), ("done", finish_reason), ("error", ApiError)."""
    prompt_ids: list
    max_tokens: int
    sampling: Sampling
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    push: callable = lambda event: None
    tokens: list = field(default_factory=list)  # generated ids, an end-of-sequence id included
    text: str = ""  # the text emitted so far
    cut: int = 0  # the answer's first `cut` ids decode to cut_text, whatever follows them (answer_text)
    cut_text: str = ""
    prefilled: int = 0  # prompt tokens in the cache
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache, not computed
    slot: Optional[int] = None
    cancelled: bool = False
    finish_reason: Optional[str] = None
    error: Optional[ApiError] = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    spec_tokens: int = 0  # tokens made by speculative steps, and the target forwards they took
    spec_forwards: int = 0
    logprobs: Optional[int] = None  # each token's log-probability and this many alternatives' (None: not asked)
    echo: Optional[str] = None  # the prompt's text, which the answer repeats before its own (completions' `echo`)
    offset: int = 0  # where the next token's text starts in the answer's text (logprobs' text_offset)
    # the tokens' bytes so far as text: a character split over tokens counts once, when whole
    offset_decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(
        errors="replace"))
    prompt_scores: list = field(default_factory=list)  # the prompt's records, where it is scored
    constraint: Optional[Constraint] = None  # the grammar its answer follows (response_format, tools)
    note: Optional[str] = None  # why the answer ended early (a grammar's dead end), in `fastgen`
    calls: bool = False  # the answer may be a tool call, parsed back into message.tool_calls
    lookup: object = None  # its own n-gram table (speculate.Lookup), when the drafter looks tokens up

    def __post_init__(self):
        # each request draws from its own generator, so a seeded one samples the same alone or in any batch
        self.generator = torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own tokens are scored (echo with logprobs): every prompt position is computed."""
        return self.echo is not None and self.logprobs is not None

    @property
    def position(self) -> int:
        """The cache slot (and RoPE position) of the current token: the last generated one, not yet cached."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    def stats(self) -> dict:
        """Per-answer figures (the chat page shows them): decode tokens/s after the first token, time to it."""
        end = self.finished_at or time.perf_counter()
        ttft = (self.first_token_at or end) - self.submitted
        decode_seconds = end - (self.first_token_at or end)
        out = {"time_to_first_token": round(ttft, 4), "completion_tokens": len(self.tokens),
               # none for an answer of one token: no token came after the first to time
               "tokens_per_second": round((len(self.tokens) - 1) / decode_seconds, 2)
               if len(self.tokens) > 1 and decode_seconds > 0 else None}
        if self.spec_forwards:
            out["tokens_per_target_forward"] = round(self.spec_tokens / self.spec_forwards, 3)
        if self.note:
            out["note"] = self.note
        return out


def stable_text(text: str) -> str:
    """Text that may be shown: never cut inside a UTF-8 character (an incomplete one decodes to U+FFFD)."""
    return text.rstrip("\ufffd")


def add_token(r: Request, token: int, tokenizer, eos: set, byte_ids: frozenset = frozenset()) -> bool:
    """The scheduler's one entry for a new token of r: stops at end of sequence, a stop string or max_tokens,
    emits the text that can no longer change. Returns whether r is finished.
    Text that may still change is held back: an incomplete UTF-8 character (it decodes to U+FFFD), a trailing run
    of byte tokens (`byte_ids`, sentencepiece's <0xNN>: the decoder replaces a whole invalid run by U+FFFDs, so the
    run's text is final only once another token follows), and a possible start of a stop string."""
    r.tokens.append(token)
    ended, length = token in eos, len(r.tokens) >= r.max_tokens
    n = len(r.tokens) - ended  # the answer's ids: an end of sequence is only ever the last
    while not (ended or length) and n and r.tokens[n - 1] in byte_ids:
        n -= 1
    text = answer_text(r, n, tokenizer)
    for stop in r.stop:
        at = text.find(stop, max(0, len(r.text) - len(stop) + 1))
        if at >= 0:
            text, ended = text[:at], True
    if ended or length:
        emit(r, stable_text(text))
        r.finish_reason = "stop" if ended else "length"
        return True
    if text.endswith("\ufffd"):
        return False
    held = max((k for stop in r.stop for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    emit(r, text[:len(text) - held])
    return False


def byte_tokens(tokenizer) -> frozenset:
    """Ids of byte-fallback pieces (<0xNN>), whose decoded text depends on the byte tokens that follow."""
    processor = tokenizer.processor
    return frozenset(i for i in range(processor.get_vocab_size())
                     if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", processor.id_to_token(i) or ""))


CONTEXT, MARGIN = 4, 16  # answer_text: ids decoded before a piece for its context; ids kept after the cut


def decode_after(tokenizer, ids: list, c: int, n: int) -> str:
    """The text that ids[c:n] add after ids[:c]: decoded with up to CONTEXT ids before them and that context's own
    text taken off (alone, a piece can decode differently: sentencepiece drops a leading space)."""
    p = max(c - CONTEXT, 0)
    return tokenizer.decode(ids[p:n])[len(tokenizer.decode(ids[p:c])):] if c else tokenizer.decode(ids[:n])


def answer_text(r: Request, n: int, tokenizer) -> str:
    """tokenizer.decode(r.tokens[:n]) without decoding the whole answer at every token (a cost per token that grew
    with the answer's length, docs/serve.md). The text of the first r.cut ids is kept; only the ids after it decode
    again. The cut moves MARGIN ids behind the end where the text it would fix is whole (no character or byte run
    split by it) and decoding in two pieces there gives the text decoding in one gives: a decoder looks only a few
    ids around a token, and the ids still to come lie beyond the margin."""
    ids, c = r.tokens, r.cut
    text = r.cut_text + decode_after(tokenizer, ids, c, n)
    a = n - MARGIN
    if a - c >= MARGIN:
        fixed = r.cut_text + decode_after(tokenizer, ids, c, a)
        if not fixed.endswith("\ufffd") and fixed + decode_after(tokenizer, ids, a, n) == text:
            r.cut, r.cut_text = a, fixed
    return text


def emit(r: Request, text: str):
    if len(text) > len(r.text) and text.startswith(r.text):
        r.push(("text", text[len(r.text):]))
        r.text = text


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by inverse CDF as decode.sample_from draws it, its uniform from the request's own
    generator."""
    cdf = probs.double().cumsum(-1)
    total = cdf[-1:]
    u = torch.rand(1, dtype=torch.double, generator=generator).to(probs.device)
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, below, right=True).clamp_max(probs.shape[-1] - 1))


def token_texts(tokenizer, token_bytes: list, byte_ids: frozenset, context: list):
    """text_of(token) -> (text, bytes) of a token after the ids `context` (a few of the last: the streaming text's
    rule, decode_after), for the chosen token and its alternatives. A token that holds part of a UTF-8 character (a
    byte-fallback <0xNN>, a byte-level piece) has no text of its own: its exact bytes, and as text those bytes with
    the incomplete ones escaped (as OpenAI shows them)."""
    before = tokenizer.decode(context) if context else ""

    def text_of(token: int) -> tuple:
        text = tokenizer.decode(context + [token])[len(before):]
        raw = token_bytes[token] if token < len(token_bytes) else None
        if raw is not None and (token in byte_ids or "\ufffd" in text or before.endswith("\ufffd")):
            return raw.decode("utf-8", "backslashreplace"), list(raw)
        return text, list(text.encode("utf-8"))
    return text_of


LOGPROB_FLOOR = -9999.0  # OpenAI's value for a token ruled out (JSON has no -Infinity)


def logprob_values(scores: torch.Tensor, tokens: list, top: int, rows: int = 256) -> list:
    """Per row of the target's logits (or log-probabilities) [n, V]: (the logprob of tokens[i], the `top` likeliest
    (id, logprob) pairs). The distribution is the target's own at temperature 1 (log_softmax of its logits; of
    log-probabilities, the same), whatever the request's sampling settings: what a client scoring text needs. One
    transfer to the host per `rows` rows (a prompt's thousands of positions are not scored one by one)."""
    out = []
    for at in range(0, scores.shape[0], rows):
        part = scores[at:at + rows].float().log_softmax(-1).nan_to_num(LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR)
        part = part.clamp_min(LOGPROB_FLOOR)
        chosen = part.gather(-1, torch.tensor(tokens[at:at + rows], device=part.device).view(-1, 1)).view(-1)
        values, ids = part.topk(top, -1) if top else (part[:, :0], part[:, :0].long())
        # one transfer for the three, each made float64 first (the ids exact, whatever the scores' dtype)
        for row in torch.cat([chosen.unsqueeze(1).double(), values.double(), ids.double()], 1).tolist():
            out.append((row[0], [(int(i), v) for i, v in zip(row[1 + top:], row[1:1 + top])]))
    return out


def logprob_entry(value: tuple, token: int, text_of) -> dict:
    """OpenAI's logprobs record of `token` from its logprob_values: {"token", "logprob", "bytes", "top_logprobs"}."""
    logprob, top = value
    out = dict(zip(("token", "bytes"), text_of(token)), logprob=logprob)
    out["top_logprobs"] = [dict(zip(("token", "bytes"), text_of(i)), logprob=v) for i, v in top]
    return {key: out[key] for key in ("token", "logprob", "bytes", "top_logprobs")}


def checked_argmax(logits: torch.Tensor) -> list:
    """The argmax of each row of logits [..., V] on the host (one transfer), -1 where the logit it picks is NaN or
    +inf (broken weights: argmax picks such a value, so the chosen logit tells)."""
    argmax = logits.argmax(-1)  # [...]
    finite = chosen_is_finite(logits.reshape(-1, logits.shape[-1]), argmax.flatten()).view(argmax.shape)
    return torch.where(finite, argmax, -1).tolist()


def accept_row(r: Request, tree: Tree, logits: torch.Tensor, argmax: list,
               bitmask: Optional[torch.Tensor] = None) -> tuple:
    """Request r's verdict on one step: (its accepted path, node indices of `tree` from the root down, and the next
    token) from the target's logits at each node of the tree, [nodes, V], and their checked_argmax (which a step
    takes for all its rows at once: a greedy row without a grammar needs no more); (None, None) where the logits of
    a node it reads are NaN or +inf (broken weights). A plain step is a tree of its root alone. Every token a
    request gets is decided here, plain or speculative.
    Greedy: the longest path the target's argmax agrees with, then its argmax (speculate.verify_greedy: exactly
    plain greedy decoding's tokens). Sampled: speculative sampling with r's own settings (speculate.verify, lossless
    for any proposal; a deterministic child is a point mass); with nothing drafted, one draw from r's own generator,
    as a plain step draws it, so a row that does not draft samples as it would alone.
    bitmask: r's grammar's [m, words] at the tree's first m nodes (Constraint.prune): their logits masked first, on a
    copy (the raw ones are the logprobs'); a node where the grammar allows nothing keeps its own (whatever it picks
    there, the grammar refuses it and the answer ends: Scheduler.take)."""
    real = [i for i, parent in enumerate(tree.parents) if parent != NO_PARENT]
    if any(argmax[i] < 0 for i in real):
        return None, None
    if bitmask is not None:
        alive = bitmask.any(-1).nonzero().flatten().tolist()
        logits = logits.to(torch.float32, copy=True)
        masked = logits[alive].contiguous()
        apply_bitmask(masked, bitmask[alive], r.constraint.vocab_size)
        logits[alive] = masked
        argmax = logits.argmax(-1).tolist()
    if r.sampling.temperature == 0:
        return verify_greedy(tree, argmax)
    if len(real) == 1:
        return [], draw(logits_to_probs(logits[0], r.sampling), r.generator)
    return verify(tree, logits_to_probs(logits, r.sampling))


def broken_weights() -> ApiError:
    return ApiError(500, "the model's logits are NaN or infinite: its weights are broken", kind="server_error")


class NoLookup:
    """The n-gram table of a cache row that does not draft: it finds nothing."""

    @staticmethod
    def trie(context: list, depth: int) -> dict:
        return {}


def copy_rows(move, source: int, target: int, n: int):
    """Cache row `source`'s first n slots (keys and values of every layer) into row `target`, by `move` (an engine's
    move_cache_slots, mirrored under tensor parallelism, or decode.move_cache_slots of a model)."""
    if n:
        move(list(range(n)), list(range(n)), [target] * n, [source] * n)


def swap_rows(move, a: int, b: int, na: int, nb: int):
    """Cache rows a and b trade their first na and nb slots, by `move` in one call (every read before any write)."""
    slots = list(range(na)) + list(range(nb))
    if slots:
        move(slots, slots, [b] * na + [a] * nb, [a] * na + [b] * nb)


def common_prefix(a: list, b: list) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # one comparison in C: the common case of a chat's next turn
        return n
    return next(i for i in range(n) if a[i] != b[i])


# ----------------------------------------------------------------------------- metrics

class Metrics:
    """Counters and gauges for GET /metrics (Prometheus text format), updated by the scheduler thread."""
    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
    WINDOW = 10.0  # seconds over which tokens/s is measured

    def __init__(self, slots: int):
        self.slots = slots
        self.outcomes = collections.Counter()
        self.tokens = self.prompt_tokens = self.steps = self.rows_stepped = self.prefill_steps = 0
        self.spec_tokens = self.spec_forwards = 0
        self.prefix_hits = self.prefix_tokens = 0
        self.ttft = [0] * (len(self.TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.recent = collections.deque()  # (time, tokens) of the last WINDOW seconds
        self.active = self.queued = 0

    def produced(self, n: int):
        now = time.perf_counter()
        self.tokens += n
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - self.WINDOW:
            self.recent.popleft()

    def first_token(self, seconds: float):
        self.ttft_sum += seconds
        self.ttft[next((i for i, b in enumerate(self.TTFT_BUCKETS) if seconds <= b), len(self.TTFT_BUCKETS))] += 1

    def text(self) -> str:
        now = time.perf_counter()
        recent = sum(n for t, n in self.recent if t >= now - self.WINDOW)
        lines = ["# TYPE fastgen_requests_total counter"]
        for outcome in ("stop", "length", "cancelled", "error", "rejected"):
            lines.append(f'fastgen_requests_total{{outcome="{outcome}"}} {self.outcomes[outcome]}')
        lines += ["# TYPE fastgen_generated_tokens_total counter", f"fastgen_generated_tokens_total {self.tokens}",
                  "# TYPE fastgen_prompt_tokens_total counter", f"fastgen_prompt_tokens_total {self.prompt_tokens}",
                  f"# HELP fastgen_tokens_per_second generated tokens per second over the last {self.WINDOW:g} s",
                  "# TYPE fastgen_tokens_per_second gauge", f"fastgen_tokens_per_second {recent / self.WINDOW:.3f}",
                  "# TYPE fastgen_time_to_first_token_seconds histogram"]
        cumulative = 0
        for bound, count in zip(list(self.TTFT_BUCKETS) + ["+Inf"], self.ttft):
            cumulative += count
            lines.append(f'fastgen_time_to_first_token_seconds_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"fastgen_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                  f"fastgen_time_to_first_token_seconds_count {cumulative}",
                  "# HELP fastgen_speculative_tokens_total tokens of the target forwards of requests that may draft",
                  "# TYPE fastgen_speculative_tokens_total counter",
                  f"fastgen_speculative_tokens_total {self.spec_tokens}",
                  "# TYPE fastgen_speculative_target_forwards_total counter",
                  f"fastgen_speculative_target_forwards_total {self.spec_forwards}",
                  "# HELP fastgen_speculative_tokens_per_forward accepted draft tokens + 1, per target forward",
                  "# TYPE fastgen_speculative_tokens_per_forward gauge",
                  f"fastgen_speculative_tokens_per_forward {self.spec_tokens / max(self.spec_forwards, 1):.4f}",
                  "# HELP fastgen_prefix_cache_hits_total requests whose prefill started after a cached prefix",
                  "# TYPE fastgen_prefix_cache_hits_total counter",
                  f"fastgen_prefix_cache_hits_total {self.prefix_hits}",
                  "# HELP fastgen_prefix_cache_reused_tokens_total prompt tokens whose keys and values were reused",
                  "# TYPE fastgen_prefix_cache_reused_tokens_total counter",
                  f"fastgen_prefix_cache_reused_tokens_total {self.prefix_tokens}",
                  "# TYPE fastgen_batch_slots gauge", f"fastgen_batch_slots {self.slots}",
                  "# TYPE fastgen_batch_rows_active gauge", f"fastgen_batch_rows_active {self.active}",
                  "# HELP fastgen_batch_occupancy mean fraction of the batch's rows decoding per batched step",
                  "# TYPE fastgen_batch_occupancy gauge",
                  f"fastgen_batch_occupancy {self.rows_stepped / max(self.steps, 1) / self.slots:.4f}",
                  "# TYPE fastgen_batched_steps_total counter", f"fastgen_batched_steps_total {self.steps}",
                  "# HELP fastgen_prefill_steps_total prompt-chunk forwards (one row each)",
                  "# TYPE fastgen_prefill_steps_total counter", f"fastgen_prefill_steps_total {self.prefill_steps}",
                  "# TYPE fastgen_queue_depth gauge", f"fastgen_queue_depth {self.queued}",
                  "# HELP fastgen_compiled_graphs graphs torch.compile built in this process (constant after warm-up)",
                  "# TYPE fastgen_compiled_graphs gauge", f"fastgen_compiled_graphs {compiled_graphs()}"]
        return "\n".join(lines) + "\n"


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------- the scheduler: one thread owns the model

class Yield(Exception):
    """Raised from the token callback to end a speculative run early (the request finished or was cancelled, or
    another request waits): the tokens it streamed are kept, and the cache holds every one but the last."""


class Scheduler:
    """A fixed batch of `max_batch_size` rows over one model; requests join at step boundaries and leave when done.
    Shapes come from a fixed set ([n, 1] decode and [n, N + 1] verification for n in decode_batches, [1, w] prefill
    for w in PREFILL_WIDTHS, the drafter's own), so compiled graphs are built once, by warm_up()."""

    def __init__(self, generator: Generator, max_batch_size: int, max_queue: int, max_seq_length: int,
                 prefix_cache: bool = True, stream_interval: float = 0.0):
        self.generator, self.engine, self.model = generator, generator.target, generator.model
        self.tokenizer, self.eos = generator.tokenizer, set(generator.eos_ids)
        self.byte_ids = byte_tokens(self.tokenizer)
        self.batch, self.max_queue = max_batch_size, max_queue
        self.context = max_seq_length  # prompt + completion tokens a request may use
        # the last slot is scratch: padding and idle rows write it; every real position is below it
        generator.reserve(max_batch_size, max_seq_length + 1, "lower --max_batch_size or --max_seq_length")
        self.scratch = self.model.max_seq_length - 1
        # drafters that draft for every row of a batch: n-gram lookups, a draft model of the target's tokenizer (a
        # draft head or a draft of another tokenizer speculates for a lone request, through Scheduler.speculate)
        drafter = getattr(generator.speculator, "drafter", None)
        self.drafter = drafter if isinstance(drafter, (NgramDrafter, ModelDrafter)) else None
        self.draft_model = getattr(self.drafter, "draft_model", None)
        # the draft's cache moves stay on this process (it is replicated under tensor parallelism)
        self.draft_move = None if self.draft_model is None else functools.partial(move_cache_slots, self.draft_model)
        if self.draft_model is not None:  # its cache rows are the target's: prefill, swaps and copies move both
            self.draft_model.setup_caches(max_batch_size, self.model.max_seq_length)
        self.draft_held = [0] * max_batch_size  # leading slots of each draft cache row holding its ids' draft keys
        self.autos = {}  # decode batch -> its AutoChoice (`auto`: whether drafting pays at that batch size)
        self.warming = False
        self.widths = sorted({min(w, max_seq_length) for w in PREFILL_WIDTHS})
        self.chunk = self.widths[-1]
        self.decode_batches = sorted({b for b in DECODE_BATCHES if b < max_batch_size} | {max_batch_size})
        self.device = generator.device
        self.rows = [None] * max_batch_size
        # the prefix cache: a free row's entry (the ids whose keys and values its first slots hold, left by the
        # request that ended there) and when it was last used (a tick), for evicting the least recently used
        self.prefix_cache = prefix_cache
        self.kept, self.used, self.clock = [None] * max_batch_size, [0] * max_batch_size, 0
        self.waiting = collections.deque()
        self.wake = threading.Condition()
        self.stopping = False
        self.failure = None  # why the server cannot go on (tensor parallelism: a rank lost), once it cannot
        self.idle = lambda: None  # called every half second while no request runs (tensor parallelism: a ping)
        self.metrics = Metrics(max_batch_size)
        self.mailboxes = []  # where requests' events wait for flush() (Mailbox)
        self.stream_interval, self.flushed_at, self.urgent = stream_interval, 0.0, False
        self.thread = threading.Thread(target=self.loop, name="scheduler", daemon=True)

    @property
    def grammars(self):
        """The generator's grammar.Grammars, made by the first request that needs one (off the event loop: it imports
        xgrammar and reads the vocabulary); a 400 where xgrammar is not installed."""
        try:
            return self.generator.grammars
        except ImportError:
            raise ApiError(400, "structured output needs the xgrammar package on the server: pip install xgrammar",
                           "response_format", "unsupported_value") from None

    # --- called from the HTTP side

    def submit(self, r: Request):
        with self.wake:
            if self.stopping:
                raise self.ending()
            if len(self.waiting) >= self.max_queue:
                self.metrics.outcomes["rejected"] += 1
                raise ApiError(429, f"the queue is full ({self.max_queue} requests wait): retry later",
                               kind="rate_limit_error", code="queue_full")
            self.waiting.append(r)
            self.metrics.queued = len(self.waiting)
            self.wake.notify()

    def cancel(self, r: Request):
        """Ends r at the next step boundary (its client went away)."""
        with self.wake:
            r.cancelled = True
            self.wake.notify()

    def stop(self):
        """Stop accepting; in-flight and waiting requests end with an error event; the thread exits."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    # --- the thread

    def loop(self):
        while True:
            with self.wake:
                if not self.stopping and not self.waiting and not any(self.rows):
                    self.wake.wait(0.5)  # a timeout, so that a signal handler in this thread runs promptly
                if self.stopping:
                    break
                self.admit()
            live = [r for r in self.rows if r is not None]
            try:
                if not live:
                    self.idle()
                    continue
                lone = live[0] if len(live) == 1 else None
                if lone is not None and self.can_speculate(lone):
                    self.speculate(lone)
                else:
                    self.step()
            except RanksFailed as e:  # tensor parallelism: the ranks cannot go on together; nor can the server
                with self.wake:
                    self.failure, self.stopping = str(e), True
                break
            except Exception as e:  # a failed forward fails the requests in it, never the server
                log.exception("a step failed")
                for r in [r for r in self.rows if r is not None]:
                    self.fail(r, ApiError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error"))
                self.forget()  # a step that failed part way (a copy between rows) may have left any row's entries
            self.flush()
        ending = self.ending()
        with self.wake:
            for r in [r for r in self.rows if r is not None] + list(self.waiting):
                r.error = ending
                r.push(("error", ending))
            self.rows, self.waiting = [None] * self.batch, collections.deque()
        self.flush(force=True)

    def ending(self) -> ApiError:
        """The 503 of a server that stops: shutting down, or the ranks of tensor parallelism lost (self.failure)."""
        if self.failure:
            return ApiError(503, self.failure, kind="server_error", code="tensor_parallel_failed")
        return ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")

    def flush(self, force: bool = False):
        """Hand the events so far to the HTTP side: at once where a request got its first token, ended or failed,
        otherwise at most every `stream_interval` seconds. Each hand-over wakes the event loop, whose thread then
        takes a core from the model's threads mid-step where none is spare (OpenMP's threads wait for each other)."""
        if not (force or self.urgent or time.perf_counter() - self.flushed_at >= self.stream_interval):
            return
        # a hand-over of nothing (a first token with no text yet) leaves the next text urgent
        if any([mailbox.flush() for mailbox in self.mailboxes]):
            self.urgent, self.flushed_at = False, time.perf_counter()

    def admit(self):
        """Waiting requests into free rows (lowest first); cancelled ones leave (called holding self.wake)."""
        for r in [r for r in self.rows if r is not None and r.cancelled]:
            self.release(r, "cancelled")
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self.metrics.outcomes["cancelled"] += 1
        while self.waiting and None in self.rows:
            r = self.waiting.popleft()
            self.place(r)
            self.metrics.prompt_tokens += len(r.prompt_ids)
        self.metrics.queued = len(self.waiting)
        self.metrics.active = sum(r is not None for r in self.rows)

    def release(self, r: Request, outcome: str):
        # its row keeps r's cached ids as an entry of the prefix cache (a failed request's entries may be broken)
        keep = self.prefix_cache and outcome != "error"
        self.kept[r.slot], self.used[r.slot] = (self.entry(r.slot) or None) if keep else None, self.tick()
        self.rows[r.slot] = None
        if r.lookup is not None and outcome != "error":  # later requests' n-gram lookups draw on its answer too
            self.drafter.lookup.finish(r.tokens)
        if 1 in self.autos:
            self.autos[1].finished()  # kept for the next run (at most every StoredCosts.SAVE_EVERY seconds)
        self.metrics.active = sum(r is not None for r in self.rows)
        r.finished_at = time.perf_counter()  # last: warm_up waits for it
        self.metrics.outcomes[outcome] += 1
        if outcome in ("stop", "length"):
            r.push(("done", r.finish_reason))
        self.urgent = True

    def fail(self, r: Request, error: ApiError):
        r.error, self.urgent = error, True
        if r.slot is not None and self.rows[r.slot] is r:
            self.release(r, "error")
        r.push(("error", error))

    def accept(self, r: Request, token: int, scores: Optional[torch.Tensor] = None) -> bool:
        """A new token of r (the row's own failure ends only r), chosen from the target's logits (or log-probs)
        `scores` [V] where r asks for logprobs; returns whether r is finished."""
        if r.first_token_at is None:
            r.first_token_at, self.urgent = time.perf_counter(), True
            self.metrics.first_token(r.first_token_at - r.submitted)
        self.metrics.produced(1)
        try:
            if r.logprobs is not None:  # before the token's text: a stream sends both in one chunk
                context = (r.prompt_ids[-CONTEXT:] + r.tokens[-CONTEXT:])[-CONTEXT:]
                value = logprob_values(scores.view(1, -1), [token], r.logprobs)[0] if scores is not None else None
                r.push(("logprobs", [self.score(r, context, token, value)]))
            finished = add_token(r, token, self.tokenizer, self.eos, self.byte_ids)
        except Exception as e:
            log.exception("a request failed")
            self.fail(r, ApiError(500, f"request failed: {type(e).__name__}: {e}", kind="server_error"))
            return True
        if finished:
            self.release(r, r.finish_reason)
        return finished

    # --- logprobs (docs/serve.md, "Logprobs")

    @functools.cached_property
    def token_bytes(self) -> list:
        return self.tokenizer.token_bytes()

    def score(self, r: Request, context: list, token: int, value: Optional[tuple]) -> dict:
        """The logprobs record of r's `token` after the ids `context` (the last CONTEXT: its text's), from its
        logprob_values (None where nothing scored it: a prompt's first token), with its text_offset in r's answer
        (a special token, which the answer's text leaves out, takes no room there)."""
        text_of = token_texts(self.tokenizer, self.token_bytes, self.byte_ids, context)
        if value is None:
            entry = dict(zip(("token", "bytes"), text_of(token)), logprob=None, top_logprobs=None)
        else:
            entry = logprob_entry(value, token, text_of)
        special = token >= len(self.token_bytes) or self.token_bytes[token] is None
        entry["text_offset"] = r.offset
        r.offset += len(r.offset_decoder.decode(b"" if special else bytes(entry["bytes"])))
        return entry

    def score_prompt(self, r: Request, logits: torch.Tensor, start: int, n: int) -> list:
        """Records of the prompt tokens that logits [n, V] (positions start .. start + n - 1) predict, and of the
        prompt's first token (at start 0)."""
        ids = r.prompt_ids
        out = [self.score(r, [], ids[0], None)] if start == 0 else []
        scored = range(start + 1, min(start + n + 1, len(ids)))
        values = logprob_values(logits[:len(scored)], [ids[i] for i in scored], r.logprobs)
        return out + [self.score(r, ids[max(i - CONTEXT, 0):i], ids[i], value) for i, value in zip(scored, values)]

    # --- the prefix cache (docs/serve.md, "Prefix cache")

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def entry(self, row: int) -> list:
        """The ids whose keys and values cache row `row` holds in its first slots, at their own positions: its
        request's cached ids, or the entry the last request there left."""
        r = self.rows[row]
        return (r.prompt_ids + r.tokens)[:self.cached(r)] if r is not None else (self.kept[row] or [])

    def longest_prefix(self, ids: list, skip: Optional[int] = None) -> tuple:
        """(row, n): the row (other than `skip`) holding the longest prefix of ids, and n, its length, at most all
        of ids but the last (whose logits give the first answer token, so it is always computed); (None, 0) if no
        row holds one. A scan of the B rows, not a tree: each row holds one sequence of its own (module doc)."""
        best, n = None, 0
        if self.prefix_cache:
            for row in range(self.batch):
                if row != skip:
                    m = min(common_prefix(ids, self.entry(row)), len(ids) - 1)
                    if m > n:
                        best, n = row, m
        return best, n

    def place(self, r: Request):
        """A free row for r (called holding self.wake), holding the longest prefix of r's prompt any row has: the
        row of that entry itself when r's prompt extends the whole of it; else a free row with no entry (lowest
        first), else the least recently used (its entry evicted), the prefix copied in. r's prefill starts after
        it."""
        # a prompt to score is computed whole: a cached prefix would skip positions whose logits it needs
        source, n = self.longest_prefix(r.prompt_ids) if not r.scores_prompt else (None, 0)
        if source is not None and self.rows[source] is None and n == len(self.kept[source]):
            row = source
        else:
            row = min((i for i, q in enumerate(self.rows) if q is None),
                      key=lambda i: (self.kept[i] is not None, self.used[i], i))
        if n and row != source:
            self.copy_cache(source, row, n)
        elif row != source:
            self.draft_held[row] = 0
        if source is not None:
            self.used[source] = self.tick()
        self.kept[row] = None  # r's now (its first n slots are r's prefix)
        r.slot, r.prefilled, r.cached_tokens = row, n, n
        self.rows[row] = r

    def reuse_more(self, r: Request):
        """At r's first prefill chunk (r in row 0): a longer prefix of r's prompt than r got when it was placed, if
        another row holds one by now (the request ahead of it, which shares its system prompt, has prefilled since:
        requests that arrive together share it too). Counts r's reuse in the metrics."""
        source, n = self.longest_prefix(r.prompt_ids, skip=0) if not r.scores_prompt else (None, 0)
        if n > r.prefilled:
            self.copy_cache(source, 0, n)
            self.used[source] = self.tick()
            r.prefilled = r.cached_tokens = n
        if r.cached_tokens:
            self.metrics.prefix_hits += 1
            self.metrics.prefix_tokens += r.cached_tokens

    def forget(self):
        """Drop every prefix-cache entry (after warm-up; after a failed step)."""
        with self.wake:
            self.kept = [None] * self.batch
            self.draft_held = [0] * self.batch

    @torch.no_grad()
    def step(self):
        """One prefill forward of one prompt chunk (if a row is prefilling), then one decode step over the first n
        cache rows (if a row decodes): plain, [n, 1], or speculative, [n, N + 1] (self.arm decides)."""
        prefilling = [r for r in self.rows if r is not None and r.prefilled < len(r.prompt_ids)]
        if prefilling:
            self.prefill(min(prefilling, key=lambda r: (r.slot != 0, r.submitted)))
        if not any(self.decoding(r) for r in self.rows):
            return
        live, size = self.compact()
        arm = self.arm(live, size)
        if arm is None or self.warming:  # warm-up: both shapes at every batch size
            self.plain_step(live, size)
            live, size = self.compact()
        if arm is not None and live:
            self.speculative_step(live, size, arm)

    @staticmethod
    def decoding(r: Optional[Request]) -> bool:
        return r is not None and r.prefilled == len(r.prompt_ids)

    def cached(self, r: Request) -> int:
        """r's entries in the cache: its first cached(r) slots."""
        return r.position if self.decoding(r) else r.prefilled

    def held(self, row: int) -> int:
        """How many of cache row `row`'s first slots hold keys and values someone needs: its request's cached
        ones, or its prefix-cache entry."""
        r = self.rows[row]
        return self.cached(r) if r is not None else len(self.kept[row] or ())

    def swap(self, a: int, b: int):
        """Cache rows a and b trade what they hold: each one's request or prefix-cache entry moves to the other
        row with its cache entries (a copy of both rows' held slots)."""
        if a == b:
            return
        na, nb = self.held(a), self.held(b)
        swap_rows(self.engine.move_cache_slots, a, b, na, nb)
        if self.draft_model is not None:  # the draft's rows trade what they hold of the same ids
            da, db = min(self.draft_held[a], na), min(self.draft_held[b], nb)
            swap_rows(self.draft_move, a, b, da, db)
            self.draft_held[a], self.draft_held[b] = db, da
        with self.wake:
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            self.kept[a], self.kept[b] = self.kept[b], self.kept[a]
            self.used[a], self.used[b] = self.used[b], self.used[a]
            for row in (a, b):
                if self.rows[row] is not None:
                    self.rows[row].slot = row

    def to_row_0(self, r: Request):
        """r to cache row 0 (prefill's row), and what row 0 held (a request, an entry) with its cache entries to
        r's row. A row-0 request in the middle of its prompt is never moved: prefill picks it first."""
        self.swap(r.slot, 0)

    def compact(self) -> tuple:
        """(the decoding requests, the decode batch n): n is the smallest of decode_batches that holds them, beside
        a request in the middle of its prompt in row 0 (the next chunk is prefilled there, so it stays); a decoding
        request in row n or beyond moves into a lower row that holds no cache entries. Requests move only when the
        count of rows falls below a smaller batch (a copy of their cached slots, once), never to fill a gap. What the
        lower row held (a request waiting for its prefill, a prefix-cache entry) moves up in exchange; rows holding
        the fewest entries are taken first."""
        live = [r for r in self.rows if self.decoding(r)]
        pinned = int(self.rows[0] is not None and not self.decoding(self.rows[0]))
        size = next(b for b in self.decode_batches if b >= len(live) + pinned)
        free = sorted((i for i in range(pinned, size) if not self.decoding(self.rows[i])), key=self.held)
        for r in [r for r in live if r.slot >= size]:
            self.swap(r.slot, free.pop(0))
        return live, size

    def mask(self, pos: torch.Tensor, padding_sees: int) -> torch.Tensor:
        """[n, 1, T, S] bool for queries at pos [n, T]: a real query sees the slots up to its own; one at the scratch
        slot (idle row, padding) sees only slot `padding_sees`, so the attention kernel reads one key for it
        (kernels_a8.cpp reads a query's keys from the first its mask allows to the last), not the whole cache."""
        slots = torch.arange(self.model.max_seq_length, device=pos.device)
        query = pos.view(pos.shape[0], 1, pos.shape[1], 1)
        return torch.where(query == self.scratch, slots == padding_sees, slots <= query)

    def copy_cache(self, source: int, target: int, n: int):
        """Cache row `source`'s first n slots (keys and values of every layer) into row `target`; the draft model's
        row too, as far as it holds them."""
        copy_rows(self.engine.move_cache_slots, source, target, n)
        if self.draft_model is not None:
            held = min(n, self.draft_held[source])
            copy_rows(self.draft_move, source, target, held)
            self.draft_held[target] = held

    def prefill(self, r: Request):
        """The next chunk of r's prompt through a [1, chunk] forward on cache row 0: prefill computes only the row
        that needs it (a [B, chunk] forward would compute every row's padding); at its end, r's first token."""
        self.to_row_0(r)
        if r.prefilled == r.cached_tokens:  # r's first chunk
            self.reuse_more(r)
        piece = r.prompt_ids[r.prefilled:r.prefilled + self.chunk]
        # a stored graph takes any token count: no padding to compute (other modes compile one graph per width)
        exact = self.engine.mode.startswith("stored")
        width = len(piece) if exact else next((w for w in self.widths if w >= len(piece)), self.chunk)
        x = torch.zeros(1, width, dtype=torch.long)
        pos = torch.full((1, width), self.scratch, dtype=torch.long)  # padding writes only the scratch slot
        x[0, :len(piece)] = torch.tensor(piece)
        pos[0, :len(piece)] = torch.arange(r.prefilled, r.prefilled + len(piece))
        pos = pos.to(self.device)
        # padding sees the chunk's first slot only: the kernel's keys end at the chunk's last, not at the scratch slot
        mask = self.mask(pos, r.prefilled)
        with sdpa_context():
            logits = self.engine.forward(x.to(self.device), pos, pos, mask)  # [1, chunk, V]; slots = positions
        self.metrics.prefill_steps += 1
        if r.scores_prompt:
            r.prompt_scores += self.score_prompt(r, logits[0], r.prefilled, len(piece))
        r.prefilled += len(piece)
        if self.draft_model is not None:
            self.draft_reads(r)
        if r.prefilled == len(r.prompt_ids):
            self.prompt_done(r, logits[0, len(piece) - 1])

    def prompt_done(self, r: Request, last: torch.Tensor):
        """r's prompt is in the cache: its echo goes out (with the prompt's records where asked), then its first
        token, drawn from `last` (the last prompt position's logits); none for `max_tokens` 0 (scoring alone)."""
        if r.echo is not None:
            r.push(("prompt", r.prompt_scores if r.scores_prompt else None))
            r.offset = len(r.echo)  # the answer's tokens follow the prompt's text
            r.offset_decoder.reset()
        if r.max_tokens == 0:
            r.finish_reason = "length"
            self.release(r, "length")
        else:
            self.pick([r], last[None])

    def draft_reads(self, r: Request):
        """The draft model reads r's prompt as far as the target has (cache row 0), so that its row is in step when
        r drafts (from where its row holds r's ids: a prefix may have come with fewer of its draft keys)."""
        start = min(self.draft_held[0], r.prefilled)
        if start < r.prefilled:
            x = torch.tensor([r.prompt_ids[start:r.prefilled]], device=self.device)
            self.drafter.engine.write_cache(x, torch.arange(start, r.prefilled, device=self.device).view(1, -1))
        self.draft_held[0] = r.prefilled

    def decode(self, live: list, size: int):
        """One [n, 1] forward over cache rows 0 .. n-1 (n = size), where compact() put the decoding rows (`live`):
        each reads its current token at its position; a prefilling or idle row among them writes only the scratch
        slot and sees only it. Rows from n on are not computed at all. Then one token per decoding row, drawn with
        its own settings."""
        x = torch.zeros(size, 1, dtype=torch.long)
        pos = torch.full((size, 1), self.scratch, dtype=torch.long)
        for r in live:
            x[r.slot, 0], pos[r.slot, 0] = r.tokens[-1], r.position
        pos = pos.to(self.device)
        with sdpa_context():
            logits = self.engine.forward(x.to(self.device), pos, pos, self.mask(pos, self.scratch))  # [n, 1, V]
        self.metrics.steps += 1
        self.metrics.rows_stepped += len(live)
        for r in live:  # a request that may draft: its plain steps count in its tokens per target forward
            self.count_speculative(r, 1, 1)
        slots = [r.slot for r in live]
        self.pick(live, logits[:, 0] if slots == list(range(size)) else logits[slots, 0])  # rows 0.. n-1: a view

    def pick(self, requests: list, logits: torch.Tensor):
        """Each request's next token from its row of logits [n, V] (take() on its root alone): argmax, or drawn
        from its own generator; from the logits its grammar allows, if it has one. The argmax and the look for
        broken logits cover all rows at once, one transfer to the host: a greedy row without a grammar needs no more."""
        roots = [Tree.rooted_at(r.tokens[-1] if r.tokens else r.prompt_ids[-1]) for r in requests]
        trees, masks = constrain(roots, [r.constraint for r in requests], [True] * len(requests))
        for r, tree, bitmask, row, argmax in zip(requests, trees, masks, logits, checked_argmax(logits)):
            self.take(r, tree, bitmask, row[None], [argmax])

    def take(self, r: Request, tree: Tree, bitmask: Optional[torch.Tensor], logits: torch.Tensor, argmax: list):
        """r's verdict on its tree (verdict()) and its tokens handed on (hand_out())."""
        verdict = self.verdict(r, tree, bitmask, logits, argmax)
        if verdict is not None:
            self.hand_out(r, tree, *verdict, logits)

    def verdict(self, r: Request, tree: Tree, bitmask: Optional[torch.Tensor], logits: torch.Tensor, argmax: list):
        """(accepted path, next token) of r's tree from the target's logits there [nodes, V] and their checked_argmax
        (accept_row), or None where r ends instead: its grammar allows nothing at the root, or the
        logits are broken (r fails)."""
        if bitmask is not None and not bool(bitmask[0].any()):  # the grammar allows nothing here: r ends
            self.end_early(r, r.constraint.note or DEAD_END)
            return None
        path, token = accept_row(r, tree, logits, argmax, bitmask)
        if token is None:
            self.fail(r, broken_weights())
            return None
        return path, token

    def hand_out(self, r: Request, tree: Tree, path: list, token: int, logits: torch.Tensor, counted: bool = False):
        """The step's tokens to r in order, each first to its grammar (which ends the answer where it allows
        nothing), then to r with the raw logits of the node that chose it (logprobs); `counted`: each counts in r's
        speculative figures. Stops where r finishes."""
        for node, t in zip([0] + path, [tree.tokens[node] for node in path] + [token]):
            if r.constraint is not None and not r.constraint.accept(t):
                self.end_early(r, r.constraint.note or DEAD_END)
                return
            if counted:
                self.count_speculative(r, 0, 1)
            if self.accept(r, t, logits[node]):
                return

    def end_early(self, r: Request, note: str):
        """r ends with finish_reason "stop" before its next token (its grammar allows none), its text released."""
        r.note, r.finish_reason = note, "stop"
        try:
            emit(r, stable_text(answer_text(r, len(r.tokens), self.tokenizer)))
        except Exception as e:
            self.fail(r, ApiError(500, f"request failed: {type(e).__name__}: {e}", kind="server_error"))
            return
        self.release(r, "stop")

    def count_speculative(self, r: Request, forwards: int, tokens: int):
        """Figures of a request that may draft (fastgen.tokens_per_target_forward, the speculative metrics): the
        target forwards it took part in and the tokens they gave it, counted before the tokens go out."""
        if self.drafts(r):
            r.spec_forwards += forwards
            r.spec_tokens += tokens
            self.metrics.spec_forwards += forwards
            self.metrics.spec_tokens += tokens

    # --- speculation inside the batch (docs/serve.md, "Speculative decoding")

    def drafts(self, r: Request) -> bool:
        """Whether r's row drafts when the batch speculates: greedy (its output is the same either way) or sampled
        without a seed (a seeded one keeps the per-row draws that make it reproducible: it verifies its root alone)."""
        return self.drafter is not None and (r.sampling.temperature == 0 or r.seed is None)

    def auto(self, size: int) -> Optional[AutoChoice]:
        """`auto`'s choice at decode batch `size` (None without `auto`): one AutoChoice per batch size, since a
        verification's and a draft's seconds depend on it. Batch 1 starts from the timings an earlier run stored,
        and keeps its own."""
        library = getattr(self.generator.speculator, "auto", None)
        if library is None or self.drafter is None:
            return None
        if size not in self.autos:
            self.autos[size] = AutoChoice(library.arms)
            if size == 1:  # a lone request's timings, as generate.py's runs keep them (speculate.StoredCosts)
                self.autos[size].seed(library.costs())
                self.autos[size].store = library.store
        return self.autos[size]

    def arm(self, live: list, size: int) -> Optional[tuple]:
        """What the next decode step drafts, (depth, tree size), or None for a plain batched step: no batch drafter,
        no row that drafts, or `auto` (AutoChoice, from this server's timings of both kinds of step at this batch
        size and the acceptance seen) finds that drafting does not pay. The choice looks only at the past: lossless."""
        if self.drafter is None or not any(self.drafts(r) for r in live):
            return None
        auto = self.auto(size)
        if auto is None or self.warming:
            return self.drafter.depth, self.drafter.tree_nodes
        if (size, 1) not in auto.measured(auto.verify_seconds):
            return None  # plain steps first: the cost a draft must beat
        return auto.choose(size)

    def plain_step(self, live: list, size: int):
        started = time.perf_counter()
        self.decode(live, size)  # its tokens went to the host: the step is over on any device
        auto = self.auto(size)
        if auto is not None:
            auto.observe(None, [], [], 0.0, time.perf_counter() - started, size)

    def speculative_step(self, live: list, size: int, arm: tuple):
        """Every drafting row drafts a tree (draft_trees), one [size, N + 1] target forward verifies all rows' trees
        (verify_trees; a row that does not draft verifies its root alone: a plain step's token), each row accepts its
        own path (accept_row), the accepted paths' keys and values move next to their roots (in the draft model's
        cache too), and each row's tokens go to its request until it ends. Rejected nodes' slots lie past the row's
        cached ones: later steps write them again."""
        started = time.perf_counter()
        trees, view = self.draft_trees(live, size, arm)
        drafting = [r for r in live if self.drafts(r)]
        constraints = {r.slot: r.constraint for r in live}
        # drafts a grammar forbids cut; the target's logits at the kept nodes masked in accept_row
        trees, masks = constrain(trees, [constraints.get(b) for b in range(size)], [True] * size)
        if view is not None:  # the draft model is told of the trees verified
            for r in drafting:
                view[0][r.slot] = trees[r.slot]
        if not self.warming and all(len(trees[r.slot].tokens) == 1 for r in drafting):
            return self.plain_step(live, size)  # nothing drafted (no n-gram matched): a plain step costs less
        drafted = time.perf_counter()
        # a draft model reading the tokens of plain steps before pays for switching, not for this arm (as the
        # library's loop prices it: speculate.Speculator.speculative_step)
        started = max(started, getattr(self.drafter, "caught_up", 0.0))
        pos = [r.position if self.decoding(r) else 0 for r in self.rows[:size]]
        logits = self.verify_trees(trees, pos, arm[1] + 1)  # [size, N + 1, V]
        argmax = checked_argmax(logits)  # every row's, one transfer to the host
        results = {r.slot: self.verdict(r, trees[r.slot], masks[r.slot], logits[r.slot], argmax[r.slot])
                   for r in live}
        paths = [(results.get(b) or (None, None))[0] for b in range(size)]
        keep_paths(self.engine.move_cache_slots, paths, pos)
        if view is not None:  # the draft model keeps the accepted nodes it read, and will read the rest
            draft_trees, draft_pos = view
            kept = [path if self.rows[b] is not None and self.drafts(self.rows[b]) else None
                    for b, path in enumerate(paths)]
            self.drafter.accepted(kept, draft_trees, draft_pos)
            for b, path in enumerate(kept):
                if path is not None:
                    self.draft_held[b] = draft_pos[b] + 1 + len(path) - len(self.drafter.pending[b])
        self.metrics.steps += 1
        self.metrics.rows_stepped += len(live)
        for r in live:
            if results[r.slot] is not None:
                self.count_speculative(r, 1, 0)
                self.hand_out(r, trees[r.slot], *results[r.slot], logits[r.slot], counted=True)
        auto = self.auto(size)
        if auto is not None:
            auto.observe(arm, [trees[r.slot] for r in drafting], [paths[r.slot] for r in drafting],
                         drafted - started, time.perf_counter() - drafted, size)

    def draft_trees(self, live: list, size: int, arm: tuple) -> tuple:
        """Each decoding row's tree, rooted at its current token, per cache row 0 .. size-1 (None where no request
        decodes): drafted (arm: depth, nodes) for the rows that draft, the root alone for the others; and, with a
        draft model, (its trees, their root slots) for every row, which it is told about once verified. The draft
        samples with the drafting rows' settings where they all share them, else greedily: deterministic children,
        point masses to the verifier, lossless for every row's own settings."""
        trees = [None] * size
        for r in live:
            trees[r.slot] = Tree.rooted_at(r.tokens[-1])
        drafting = [r for r in live if self.drafts(r)]
        settings = {(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in drafting}
        sampling = drafting[0].sampling if len(settings) == 1 else Sampling(0.0)
        if self.draft_model is not None:
            made, view = self.model_drafts(size, arm, sampling)
            for r in drafting:
                trees[r.slot] = made[r.slot]
            return trees, view
        for r in drafting:  # n-gram lookups: host work, for the drafting rows alone, each with its own table
            r.lookup = r.lookup or self.drafter.lookup.fresh()
        self.drafter.lookups = [r.lookup for r in drafting]
        made, _ = self.drafter.draft([r.tokens[-1] for r in drafting], [r.position for r in drafting], arm[0],
                                     [r.prompt_ids + r.tokens for r in drafting], sampling, nodes=arm[1])
        for r, tree in zip(drafting, made):
            trees[r.slot] = tree
        return trees, None

    def model_drafts(self, size: int, arm: tuple, sampling: Sampling) -> tuple:
        """The draft model's trees for cache rows 0 .. size-1, its forwards over the same rows of its own cache as
        the target's. A drafting row first reads the tokens its draft row lacks (held up to draft_held). A row that
        does not draft is fed token 0 just past what its draft row holds (the slot before it is written again with
        the same token), so that what it holds stays. Returns the trees and (the trees, their root slots)."""
        drafter = self.drafter
        roots, pos, contexts, pending, lookups = [], [], [], [], []
        for b in range(size):
            r, held = self.rows[b], min(self.draft_held[b], self.held(b))
            if self.decoding(r) and self.drafts(r):
                context = r.prompt_ids + r.tokens
                if drafter.lookup is not None:
                    r.lookup = r.lookup or drafter.lookup.fresh()
                roots.append(r.tokens[-1])
                pending.append(context[held:r.position])
                lookups.append(r.lookup)
            else:
                context = self.entry(b)[:held] + [0] if held else [0, 0]
                roots.append(0)
                pending.append([])
                lookups.append(NoLookup)
            contexts.append(context)
            pos.append(len(context) - 1)
        drafter.pending, drafter.lookups = pending, lookups
        trees, _ = drafter.draft(roots, pos, arm[0], contexts, sampling, nodes=arm[1])
        return trees, (trees, pos)

    def verify_trees(self, trees: list, pos: list, width: int) -> torch.Tensor:
        """The target's logits [size, width, V] at every node of each row's tree (padded to `width`; row b's node i
        at slot pos[b] + i, seeing the row's cached slots and its ancestors: speculate.tree_inputs), in one forward.
        A row with no tree (idle, or prefilling) writes only the scratch slot and sees only it, as in decode()."""
        padded = [(tree if tree is not None else Tree.rooted_at(0)).pad_to(width) for tree in trees]
        tokens, input_pos, slots, mask = tree_inputs(padded, pos, self.model.max_seq_length, "cpu")
        for b, tree in enumerate(trees):
            if tree is None:
                input_pos[b], slots[b] = self.scratch, self.scratch
                mask[b] = torch.arange(self.model.max_seq_length) == self.scratch
        d = self.device
        with sdpa_context():
            return self.engine.forward(tokens.to(d), input_pos.to(d), slots.to(d), mask.to(d))  # [size, width, V]

    def can_speculate(self, r: Request) -> bool:
        """The library's speculative loop serves a lone decoding request where the drafter does not draft in batches
        (a draft head, a draft of another tokenizer): greedy (its output is the same either way) or sampled without
        a seed (a seeded one keeps the per-row draws that make it reproducible)."""
        speculator = self.generator.speculator
        return (speculator is not None and self.drafter is None and not r.cancelled
                and r.prefilled == len(r.prompt_ids) and (r.sampling.temperature == 0 or r.seed is None)
                and (r.logprobs is None or getattr(speculator, "gives_logprobs", False))
                and (r.constraint is None or isinstance(speculator, Speculator)))  # not a draft of another tokenizer

    @torch.no_grad()
    def speculate(self, r: Request):
        """Decode the lone request r with the library's speculator, which runs on cache row 0 (r moves there
        first) until r finishes or someone else waits; then batched decoding takes over from the cache it left."""
        self.swap(r.slot, 0)  # the context's keys/values, once (row 0 has no request: r is alone)
        forwards = [0]

        def counted(fn):
            def run(*args, **kwargs):
                forwards[0] += 1
                return fn(*args, **kwargs)
            return run

        # plain steps inside the loop run through plain decoding's (speculate.Speculator): each of their tokens is
        # looked at for NaN before it is handed on, as batched decoding's are
        watch = FiniteWatch(counted(self.engine.decode_one_token), self.engine.model)
        engine = dataclasses.replace(self.engine, forward=counted(self.engine.forward), decode_one_token=watch,
                                     forward_features=self.engine.forward_features and
                                     counted(self.engine.forward_features))
        first, tokens_before, forwards_before = [True], r.spec_tokens, r.spec_forwards

        def on_token(token, scores=None):
            watch.check()
            if first[0]:  # the speculator repeats its starting token (already r's): not a new one
                first[0] = False
                return
            r.spec_tokens += 1  # counted before the token is handed on: the answer's figures go out with it
            r.spec_forwards = forwards_before + forwards[0]
            someone_waits = self.waiting and None in self.rows
            finished = self.accept(r, int(token.view(-1)[0]), scores)
            self.flush()
            if finished or r.cancelled or someone_waits or self.stopping:
                raise Yield

        current = torch.tensor([r.tokens[-1]], device=self.device)
        context = r.prompt_ids + r.tokens[:-1]
        extra = {}
        if self.generator.speculator.features:  # a draft head reads the context's target features: one more pass
            ids = torch.tensor([context], device=self.device)
            with sdpa_context():
                extra["features"] = self.engine.forward_features(ids, torch.arange(len(context), device=self.device)
                                                                 .view(1, -1))[1].clone()
        if r.constraint is not None:  # it has taken r's tokens so far; the loop hands it each new one
            extra["constraints"] = [r.constraint]
        try:
            self.generator.speculator.generate(engine, [context], current, r.max_tokens - len(r.tokens) + 1,
                                               r.sampling, sorted(self.eos), True, on_token, **extra,
                                               **({"logprobs": True} if r.logprobs is not None else {}))
        except Yield:
            pass
        else:
            if r.constraint is not None and r.constraint.note is not None and self.rows[r.slot] is r:
                self.end_early(r, r.constraint.note)  # the loop ended its row at the grammar's dead end
        self.metrics.spec_tokens += r.spec_tokens - tokens_before
        self.metrics.spec_forwards += forwards[0]

    def warm_up(self):
        """Requests that run every shape the server uses (each prefill width, each decode batch, a speculative run),
        so that compilation happens before /health says ready. The prefix cache is off meanwhile (each prompt
        must fill its width) and empty after."""
        enabled, self.prefix_cache = self.prefix_cache, False
        self.warming = True
        try:
            self.run_warm_up()
        finally:
            self.prefix_cache, self.warming = enabled, False
            self.forget()
        self.metrics = Metrics(self.batch)  # the figures count real requests only

    def run_warm_up(self):
        prompt = self.tokenizer.encode_prompt("Hello, my name is")[: max(1, self.context // 4)]
        n = min(12, self.context - len(prompt))
        # B requests at once: one is prefilled per step, so the decoding rows grow 1, 2, ..., B (every decode batch)
        # while the first is still decoding (B + 1 tokens); then lone requests (speculative, if drafting) whose
        # prompts fill each prefill width
        short = prompt[:max(1, min(len(prompt), self.context - self.batch - 1))]
        # a step that drafts gives a row up to depth + 1 tokens: the first must still decode when the last joins
        steps = (self.batch + 1) * (1 + (self.drafter.depth if self.drafter is not None else 0))
        together = [(short, min(max(n, steps), self.context - len(short)))] * self.batch
        runs = [together] + [[((prompt * w)[:min(w, self.context - n)], n)] for w in self.widths]
        for prompts in runs:
            requests = [Request(list(p), tokens, Sampling(0.0)) for p, tokens in prompts]
            with self.wake:  # all admitted at the same step boundary (the queue's limit is the clients')
                if self.stopping:
                    raise RuntimeError("the server is shutting down")
                self.waiting.extend(requests)
                self.wake.notify()
            while any(r.finished_at is None and r.error is None for r in requests):  # released, not just done
                time.sleep(0.01)
            failed = next((r.error for r in requests if r.error is not None), None)
            if failed is not None:
                raise RuntimeError(f"warm-up failed: {failed.message}")


# ----------------------------------------------------------------------------- checking a request

def field_of(body: dict, name: str, kinds, default=None, check=None, explain: str = "", where: str = None):
    """body[name] if it has one of the JSON types `kinds` (and passes check), the default if absent or null. The
    400 names `where` (the field's path, for one inside an object of the body), else `name`."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) \
            or (isinstance(value, float) and not math.isfinite(value)) or (check is not None and not check(value)):
        where = where or name
        raise ApiError(400, f"`{where}` must be {explain}, got {json.dumps(value)[:80]}", where, "invalid_value")
    return value


def check_text(text: str, where: str) -> str:
    """`text` if it is Unicode text: JSON escapes can carry lone surrogates ("\\ud800"), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"`{where}` holds a lone surrogate at character {e.start}: not Unicode text", where,
                       "invalid_value") from None
    return text


def number_is(value, neutral) -> bool:
    return type(value) in (int, float) and value == neutral  # not a bool: True == 1


# Fields that would change what a client gets back, which this server does not do: a 400 naming the field, not an
# answer that silently ignores them (a JSON mode or a tool call the client then fails to parse). Their neutral
# values (absent, null, empty, off) pass.
UNSUPPORTED = {
    "functions": lambda v: v == [], "function_call": lambda v: v == "none",
    "logit_bias": lambda v: v == {}, "top_logprobs": lambda v: v == 0,
    "best_of": lambda v: number_is(v, 1), "suffix": lambda v: v == "",
    "modalities": lambda v: v == ["text"], "audio": lambda v: False, "prediction": lambda v: False,
    # other servers' sampling extensions (vLLM, llama-server): a client that sends them expects them applied
    "repetition_penalty": lambda v: number_is(v, 1), "min_p": lambda v: number_is(v, 0),
    "typical_p": lambda v: number_is(v, 1), "min_tokens": lambda v: number_is(v, 0),
    "mirostat": lambda v: number_is(v, 0), "ignore_eos": lambda v: v is False,
}
COMPLETIONS_ONLY = ("best_of", "suffix")
CHAT_READS = ("top_logprobs",)  # completions ask for alternatives with `logprobs` N (read_logprobs)
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")
# the most alternatives per token OpenAI gives: chat's `top_logprobs`, completions' `logprobs`
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5


def refuse_unsupported(body: dict, chat: bool):
    for name in CHAT_ONLY:
        if not chat and body.get(name) not in (None, [], "none", False):
            raise ApiError(400, f"`{name}` is for /v1/chat/completions", name, "unsupported_value")
    for name, neutral in UNSUPPORTED.items():
        if chat and name in COMPLETIONS_ONLY + CHAT_READS or body.get(name) is None or neutral(body[name]):
            continue
        raise ApiError(400, f"`{name}` is not supported by this server (got {json.dumps(body[name])[:80]})", name,
                       "unsupported_value")


def read_settings(body: dict, chat: bool) -> dict:
    """The generation settings of a request body, each checked (400 naming the field)."""
    number = (int, float)
    field_of(body, "n", (int,), 1, lambda v: v == 1, "1 (one choice per request)")
    field_of(body, "parallel_tool_calls", (bool,), None, None, "true or false")
    for name in ("presence_penalty", "frequency_penalty"):
        field_of(body, name, number, 0, lambda v: v == 0, "0 (penalties are not supported)")
    refuse_unsupported(body, chat)
    logprobs, echo = read_logprobs(body, chat)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
                                 and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"`stop` must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                       "stop", "invalid_value")
    for s in stop or []:
        check_text(s, "stop")
    # chat's newer name wins where it has a value (a client may send the one it does not use as null)
    bound = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field_of(body, bound, (int,), None, lambda v: v >= (0 if echo else 1),
                          "an integer >= 1 (0 only with `echo`: the prompt scored, nothing generated)")
    options = field_of(body, "stream_options", (dict,), {}, None, "an object")
    if options and body.get("stream") is not True:
        raise ApiError(400, "`stream_options` is only allowed with `stream`: true", "stream_options", "invalid_value")
    if options.get("include_usage") not in (None, True, False):
        raise ApiError(400, f"`stream_options.include_usage` must be true or false, got "
                       f"{json.dumps(options['include_usage'])[:80]}", "stream_options.include_usage", "invalid_value")
    return {
        "max_tokens": max_tokens if max_tokens is not None else (None if chat else 16),
        "temperature": field_of(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        "top_p": field_of(body, "top_p", number, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": field_of(body, "top_k", (int,), None, lambda v: v >= 1, "an integer >= 1"),
        "seed": field_of(body, "seed", (int,), None, lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)"),
        "stream": field_of(body, "stream", (bool,), False, None, "true or false"),
        "include_usage": bool(options.get("include_usage")),
        "stop": stop or [],
        "logprobs": logprobs, "echo": echo,
    }


def read_logprobs(body: dict, chat: bool) -> tuple:
    """(how many alternatives each token's logprobs record lists, None if logprobs are not asked; whether the
    prompt is echoed) in OpenAI's fields: chat's `logprobs` true and `top_logprobs` N; completions' `logprobs` N
    and `echo`. Checked before the request is queued."""
    if chat:
        wanted = field_of(body, "logprobs", (bool,), False, None, "true or false")
        top = field_of(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                       f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not wanted:
            raise ApiError(400, "`top_logprobs` needs `logprobs`: true", "top_logprobs", "invalid_value")
        return (top if wanted else None), False
    logprobs = field_of(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_COMPLETION_LOGPROBS,
                        f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] (alternatives per token)")
    return logprobs, field_of(body, "echo", (bool,), False, None, "true or false")


def read_messages(body: dict) -> list:
    """The conversation: each message's role and text; an assistant's `tool_calls` (then its content may be null)
    and a tool result's `tool_call_id` kept for the chat template (chat_messages)."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "`messages` is required: a list of {\"role\", \"content\"} objects", "messages",
                       "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of {\"role\", \"content\"} objects", "messages",
                       "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"`{where}` must be an object with a string `role`", where, "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"`{where}.content` parts must be {{\"type\": \"text\", \"text\": ...}}",
                               f"{where}.content", "invalid_value")
            content = "".join(p["text"] for p in content)
        calls = read_tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if m["role"] == "assistant" else None
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"`{where}.content` must be a string", f"{where}.content", "invalid_value")
        message = {"role": check_text(m["role"], f"{where}.role"), "content": check_text(content, f"{where}.content")}
        if calls:
            message["tool_calls"] = calls
        field_of(m, "name", (str,), None, None, "a string", f"{where}.name")
        call_id = field_of(m, "tool_call_id", (str,), None, None, "a string", f"{where}.tool_call_id")
        if m["role"] == "tool" and call_id is not None:
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def read_tool_calls(calls, where: str) -> Optional[list]:
    """An assistant message's earlier tool calls, each {"id", "type": "function", "function": {"name",
    "arguments"}}, the arguments (OpenAI's JSON text) read into an object, as chat templates expect them."""
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise ApiError(400, f"`{where}` must be a list of tool calls", where, "invalid_value")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"`{where}[{j}].function.name` must be a string", f"{where}[{j}].function.name",
                           "invalid_value")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, RecursionError):  # not JSON, an integer too long to convert, nested too deeply
            arguments = None
        if not isinstance(arguments, dict):  # templates iterate its items: a list or a number would fail there
            raise ApiError(400, f"`{where}[{j}].function.arguments` must be the JSON text of an object",
                           f"{where}[{j}].function.arguments", "invalid_value")
        field_of(call, "id", (str,), None, None, "a string", f"{where}[{j}].id")
        field_of(call, "type", (str,), None, lambda v: v == "function", '"function"', f"{where}[{j}].type")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ----------------------------------------------------------------------------- structured output and tool calls

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}
# for chat templates that do not read `tools`: the tools and the answer's shape, said in a system message
TOOLS_PROMPT = ("Functions you can call:\n{tools}\nTo call one, answer with only {{\"name\": NAME, \"arguments\": "
                "{{...}}}}.")


@dataclass
class Structure:
    """What a request's answer must be: `grammar` (how to build its grammar.Compiled: a callable, run off the event
    loop; None: free text), the tools to show the model, and whether the answer may be a tool call to parse back."""
    grammar: Optional[callable] = None
    tools: Optional[list] = None
    calls: bool = False


def read_structure(body: dict, chat: bool, grammars) -> Structure:
    """`response_format` and `tools` / `tool_choice`, checked (a 400 naming the field) before anything is compiled
    or decoded. `grammars` (a callable giving the generator's grammar.Grammars) is called only when needed."""
    form = body.get("response_format")
    if form is not None and not (isinstance(form, dict) and form.get("type") in ("text", "json_object",
                                                                                  "json_schema")):
        raise ApiError(400, "`response_format.type` must be text, json_object or json_schema",
                       "response_format.type", "invalid_value")
    schema, kind = None, (form or {}).get("type", "text")
    if kind == "json_schema":
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ApiError(400, "`response_format.json_schema.schema` must be a JSON Schema object",
                           "response_format.json_schema.schema", "invalid_value")
        for name, kinds, explain in (("name", str, "a string"), ("description", str, "a string"),
                                     ("strict", bool, "true or false")):
            field_of(spec, name, (kinds,), None, None, explain, f"response_format.json_schema.{name}")
        schema = spec["schema"]
        schema_error(check_schema, schema, "response_format.json_schema.schema")
    tools = read_tools(body) if chat else []
    choice = read_tool_choice(body, [name for name, _, _ in tools])
    if choice != "none" and kind != "text":
        raise ApiError(400, "`response_format` and a tool call cannot both shape one answer: set `tool_choice` to "
                       "\"none\" or drop `response_format`", "response_format", "invalid_value")
    shown = [tool for _, _, tool in tools] or None
    if choice != "none":
        chosen = [(name, parameters) for name, parameters, _ in tools if choice in ("auto", "required", name)]
        return Structure(lambda: grammars().tool_call(chosen, choice != "auto"), shown, True)
    if kind == "text":
        return Structure(None, shown)
    where = "response_format.json_schema.schema" if schema is not None else "response_format"
    return Structure(lambda: grammars().json_schema(schema, where), shown)


def schema_error(function, *args):
    try:
        return function(*args)
    except SchemaError as e:
        raise ApiError(400, str(e), e.field, "invalid_value") from None


def read_tools(body: dict) -> list:
    """[(name, parameters schema, the tool as given)] of `tools`: OpenAI's function tools, each named."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "`tools` must be a list of {\"type\": \"function\", \"function\": {...}}", "tools",
                       "invalid_value")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f"`{where}.type` must be \"function\"", f"{where}.type", "invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ApiError(400, f"`{where}.function` must be an object", f"{where}.function", "invalid_value")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ApiError(400, f"`{where}.function.name` must be 1 to 64 letters, digits, _ or - (got "
                           f"{json.dumps(name)[:80]})", f"{where}.function.name", "invalid_value")
        if name in [n for n, _, _ in out]:
            raise ApiError(400, f"`{where}.function.name` {name!r} names two tools", f"{where}.function.name",
                           "invalid_value")
        field_of(function, "description", (str,), None, None, "a string", f"{where}.function.description")
        field_of(function, "strict", (bool,), None, None, "true or false", f"{where}.function.strict")
        parameters = function.get("parameters")
        parameters = NO_PARAMETERS if parameters is None else parameters  # null, as elsewhere, is absent
        schema_error(check_schema, parameters, f"{where}.function.parameters")
        out.append((name, parameters, tool))
    return out


def read_tool_choice(body: dict, names: list) -> str:
    """"none", "auto", "required" or the name of the one tool to call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in names:
            raise ApiError(400, f"`tool_choice` names the function {json.dumps(choice)[:80]}, which is not among "
                           f"`tools`", "tool_choice", "invalid_value")
        return choice
    if choice not in ("none", "auto", "required"):
        raise ApiError(400, "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", "tool_choice", "invalid_value")
    if choice != "none" and not names:
        raise ApiError(400, f"`tool_choice` {choice} needs `tools`", "tool_choice", "invalid_value")
    return choice


def chat_messages(messages: list, tools: Optional[list], tokenizer) -> tuple:
    """(messages, tools) for the chat template: as they are where it reads `tools`; otherwise the tools described
    in a system message (TOOLS_PROMPT), earlier calls written as the JSON the model is asked for, and tool results
    as user messages. A `developer` message (OpenAI's newer name for the system message) is a system message where
    the template does not name that role: a template knows the roles its model was trained on, and Llama 2's refuses
    any other."""
    if any(m["role"] == "developer" for m in messages) and "developer" not in (tokenizer.chat_template or ""):
        messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]
    if tokenizer.uses_tools or not (tools or any("tool_calls" in m or m["role"] == "tool" for m in messages)):
        return messages, tools
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"]] * bool(m["content"]) + calls)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"The function returned: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def tool_calls_of(text: str) -> Optional[list]:
    """The answer as OpenAI's message.tool_calls, if it is a whole tool call ({"name", "arguments"}); else None."""
    if not text.startswith("{"):
        return None
    try:
        call = json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens
        return None
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


# ----------------------------------------------------------------------------- HTTP

class Service:
    """What the HTTP handlers share: the model's name, the scheduler once loaded, the key."""

    def __init__(self, model_name: str, api_key: Optional[str] = None):
        self.model_name, self.api_key = model_name, api_key
        self.scheduler: Optional[Scheduler] = None
        self.ready = False
        self.failed: Optional[str] = None

    def load(self, build) -> Optional[Scheduler]:
        """build() (the scheduler, its model loaded); None if that failed (self.failed says why)."""
        try:
            self.scheduler = build()
            return self.scheduler
        except UserError as e:
            self.failed = str(e)
            log.error("error: %s", e)
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.exception("loading failed")
        return None

    def warm_up(self):
        """Compile every graph (the scheduler's loop must be running), then answer /health with 200."""
        try:
            self.scheduler.warm_up()
            self.ready = True
            log.info("ready")
        except Exception as e:
            self.failed = str(e)
            if not self.scheduler.failure:  # that one is the server's last line (main)
                log.error("error: %s", e)
            self.scheduler.stop()

    def start(self, build):
        """Load, run the scheduler in a thread of its own and warm up, in the background (tests, eager engines)."""
        def run():
            if self.load(build) is not None:
                self.scheduler.thread.start()
                self.warm_up()
        threading.Thread(target=run, name="load", daemon=True).start()

    def check_key(self, request):
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer KEY`", None,
                           "invalid_api_key")

    def check_ready(self):
        if not self.ready:
            raise ApiError(503, f"the model failed to load: {self.failed}" if self.failed else
                           "the model is loading: retry when GET /health answers 200", kind="server_error",
                           code="model_not_ready")


class Mailbox:
    """Events from the scheduler thread to one event loop's queues, handed over once per step (flush): waking the
    loop is a system call (which also lets the loop take the GIL mid-step); one per token per request was a large
    share of the scheduler thread's time (BENCHMARKS.md, "Server under load")."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.pending, self.lock = loop, [], threading.Lock()

    def post(self, queue: asyncio.Queue, event):
        with self.lock:
            self.pending.append((queue, event))

    def flush(self) -> bool:
        """Wake the loop to deliver what is pending; whether anything was."""
        with self.lock:
            if not self.pending:
                return False
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass
        return True

    def deliver(self):
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, event in pending:
            queue.put_nowait(event)


def create_app(service: Service):
    """The routes: each a named handler; the completion endpoints share `complete`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import FileResponse, JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def health(request):
        if service.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "failed" if service.failed else "loading"}, status_code=503)

    async def models(request):
        service.check_key(request)
        return JSONResponse({"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                                          "owned_by": "fastgen"}]})

    async def metrics(request):
        service.check_key(request)
        text = service.scheduler.metrics.text() if service.scheduler else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def page(request):
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    async def chat_completions(request):
        return await complete(service, request, chat=True)

    async def completions(request):
        return await complete(service, request, chat=False)

    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(request, e: HTTPException):
        return await api_error(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                 code="not_found" if e.status_code == 404 else None))

    app = Starlette(routes=[
        Route("/", page), Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error})
    app.state.service = service
    return app


async def complete(service: Service, request, chat: bool):
    """POST /v1/chat/completions (chat) or /v1/completions: the request read and checked, queued, then answered
    whole or streamed."""
    service.check_key(request)
    service.check_ready()
    body = await read_json(request)
    check_model(body, service.model_name)
    settings = read_settings(body, chat)
    scheduler = service.scheduler
    structure = read_structure(body, chat, lambda: scheduler.grammars)
    prompt_ids, param, prompt_text = read_prompt(body, chat, scheduler.tokenizer, structure.tools)
    max_tokens = fit_context(prompt_ids, settings["max_tokens"], scheduler.context, param)
    constraint = None
    if structure.grammar is not None:  # compiled once per schema (cached), off the event loop
        compiled = await asyncio.to_thread(schema_error, structure.grammar)
        constraint = Constraint(compiled, scheduler.model.args.vocab_size)
    events = asyncio.Queue()
    r = Request(prompt_ids, max_tokens, Sampling(settings["temperature"], settings["top_k"], settings["top_p"]),
                settings["seed"], settings["stop"], functools.partial(mailbox_of(scheduler).post, events),
                logprobs=settings["logprobs"], echo=prompt_text if settings["echo"] else None,
                constraint=constraint, calls=structure.calls)
    scheduler.submit(r)
    watcher = asyncio.create_task(watch_disconnect(request, r, scheduler, events))
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "created": int(time.time()),
            "model": service.model_name}
    if settings["stream"]:
        from starlette.responses import StreamingResponse
        return StreamingResponse(stream(r, events, watcher, scheduler, meta, chat, settings["include_usage"]),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await answer_whole(r, events, watcher, scheduler, meta, chat)


async def read_json(request) -> dict:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(await read_body(request))
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply", None, "invalid_json") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ApiError(400, f"the body is not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def check_model(body: dict, model_name: str):
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(400, f"`model` {json.dumps(model)[:80]} is not served here: use {model_name!r} "
                       f"(GET /v1/models)", "model", "model_not_found")


def read_prompt(body: dict, chat: bool, tokenizer, tools: Optional[list] = None) -> tuple:
    """The prompt's token ids (a chat's through the chat template, with its tools: chat_messages), the name of the
    field they came from, and the prompt's text (what `echo` repeats). A completion's prompt is a string or its
    token ids (as lm-eval sends them), alone or as a list of one."""
    if chat:
        messages, tools = chat_messages(read_messages(body), tools, tokenizer)
        try:
            return tokenizer.chat_ids(messages, tools=tools), "messages", None
        except UserError as e:
            raise ApiError(400, f"`messages`: {e}", "messages", "invalid_value") from None
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "`prompt` is required: a string", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i < tokenizer.vocab_size for i in prompt):
            raise ApiError(400, f"`prompt` token ids must be in [0, {tokenizer.vocab_size})", "prompt",
                           "invalid_value")
        return list(prompt), "prompt", tokenizer.processor.decode(prompt, skip_special_tokens=True)
    if not isinstance(prompt, str):
        raise ApiError(400, "`prompt` must be a string or a list of token ids", "prompt", "invalid_value")
    return tokenizer.encode_prompt(check_text(prompt, "prompt")), "prompt", prompt


def fit_context(prompt_ids: list, max_tokens: Optional[int], context: int, param: str) -> int:
    """The request's `max_tokens` (by default, the rest of the context), refused when prompt + completion do not
    fit the context."""
    if not prompt_ids:  # "" where the tokenizer adds no BOS: nothing to continue
        raise ApiError(400, f"`{param}` is empty: give at least one token to continue", param, "invalid_value")
    if len(prompt_ids) >= context:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this server's context is {context} tokens "
                       f"(prompt + completion): shorten `{param}`", param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = context - len(prompt_ids)
    if len(prompt_ids) + max_tokens > context:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + `max_tokens` ({max_tokens}) exceeds this "
                       f"server's context of {context} tokens: lower `max_tokens` to at most "
                       f"{context - len(prompt_ids)}", "max_tokens", "context_length_exceeded")
    return max_tokens


def mailbox_of(scheduler: Scheduler) -> Mailbox:
    """The mailbox of the running event loop, made on its first request (one loop serves the app; tests run
    several)."""
    loop = asyncio.get_running_loop()
    mailbox = next((m for m in scheduler.mailboxes if m.loop is loop), None)
    if mailbox is None:
        mailbox = Mailbox(loop)
        scheduler.mailboxes = [m for m in scheduler.mailboxes if not m.loop.is_closed()] + [mailbox]
    return mailbox


async def answer_whole(r: Request, events: asyncio.Queue, watcher, scheduler: Scheduler, meta: dict, chat: bool):
    """The whole answer in one response once r is done (499 if the client went away first)."""
    from starlette.responses import JSONResponse
    try:
        text, finish, entries = "", None, []
        while finish is None:
            kind, value = await events.get()
            if kind == "text":
                text += value
            elif kind == "logprobs":
                entries += value
            elif kind == "prompt":  # the echo: the prompt's text (and records) before the answer's
                text, entries = r.echo + text, (value or []) + entries
            elif kind == "done":
                finish = value
            elif kind == "error":
                raise value
            else:  # the client went away
                return JSONResponse({}, status_code=499)
    finally:
        watcher.cancel()
        scheduler.cancel(r)
    choice = {"index": 0, "finish_reason": finish, "logprobs": logprobs_field(r, entries, chat, whole=True)}
    message = {"role": "assistant", "content": text}
    calls = tool_calls_of(text) if r.calls else None
    if calls:  # the answer is a tool call: OpenAI's shape for it
        message, choice["finish_reason"] = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    choice.update({"message": message} if chat else {"text": text})
    return JSONResponse(dict(meta, object="chat.completion" if chat else "text_completion", choices=[choice],
                             usage=usage(r), fastgen=r.stats()))


async def read_body(request) -> bytes:
    """The body, refused with 413 past MAX_BODY_BYTES (by its Content-Length, or as it streams in) and with 408 if it
    takes longer than BODY_SECONDS to arrive."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body has {int(length)} bytes; this server reads at most {MAX_BODY_BYTES}",
                       None, "request_too_large")
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes, the most this server reads",
                               None, "request_too_large")
            chunks.append(chunk)
    from starlette.requests import ClientDisconnect
    try:
        await asyncio.wait_for(read(), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {BODY_SECONDS:g} s", None, "request_timeout") from None
    except ClientDisconnect:  # no one to answer; an error response ends the handler without a traceback
        raise ApiError(400, "the client closed the connection before its body arrived", None,
                       "client_disconnected") from None
    return b"".join(chunks)


async def watch_disconnect(request, r: Request, scheduler: Scheduler, events: asyncio.Queue):
    """The client's connection, watched: if it closes before r is done, r is cancelled (its row is freed at the
    next step boundary) and the handler told."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scheduler.cancel(r)
            events.put_nowait(("gone", None))
            return


def logprobs_field(r: Request, entries: list, chat: bool, whole: bool = False) -> Optional[dict]:
    """A choice's `logprobs` in OpenAI's shape for the records `entries` (Scheduler.score): chat's {"content":
    [{"token", "logprob", "bytes", "top_logprobs"}]}; completions' {"tokens", "token_logprobs", "top_logprobs" (a
    dict per token: its alternatives' and its own), "text_offset"}. None where not asked (or a stream's chunk has
    no token)."""
    if r.logprobs is None or not (entries or whole):
        return None
    if chat:
        return {"content": [{key: e[key] for key in ("token", "logprob", "bytes", "top_logprobs")} for e in entries]}
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else
                             {t["token"]: t["logprob"] for t in e["top_logprobs"]} | {e["token"]: e["logprob"]}
                             for e in entries],
            "text_offset": [e["text_offset"] for e in entries]}


def usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt_ids) + len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


async def stream(r: Request, events: asyncio.Queue, watcher, scheduler: Scheduler, meta: dict, chat: bool,
                 include_usage: bool):
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`; the last chunk carries the finish reason
    and this answer's figures (an extension field, `fastgen`)."""
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: Optional[str], finish: Optional[str] = None, first: bool = False, entries=(), calls=None,
              **extra) -> str:
        logprobs = logprobs_field(r, list(entries), chat)  # the records of the tokens this chunk's text holds
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
            delta |= {"tool_calls": [dict(call, index=i) for i, call in enumerate(calls)]} if calls else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        extra = ({"usage": None} if include_usage else {}) | extra  # OpenAI's chunks say so until the last
        return f"data: {json.dumps(dict(meta, object=kind_name, choices=[choice], **extra))}\n\n"

    held = "" if r.calls else None  # an answer that may be a tool call: held while it may be
    try:
        if chat:
            yield chunk("", first=True)
        pending = []  # records of tokens whose text has not gone out yet (held back, or none of its own)
        while True:
            kind, value = await events.get()
            if kind == "logprobs":
                pending += value
            elif kind == "prompt":
                yield chunk(r.echo, entries=value or [])
            elif kind == "text" and held is not None:
                held += value
                if not held.startswith("{"):  # text, not a call: it streams from here on
                    yield chunk(held, entries=pending)
                    held, pending = None, []
            elif kind == "text":
                yield chunk(value, entries=pending)
                pending = []
            elif kind == "done":
                calls = tool_calls_of(held) if held else None
                if calls or held:  # the held answer: a tool call, or text after all
                    yield chunk(None, calls=calls, entries=pending) if calls else chunk(held, entries=pending)
                    value, pending = "tool_calls" if calls else value, []
                yield chunk(None if chat else "", value, entries=pending, fastgen=r.stats())
                if include_usage:
                    yield f"data: {json.dumps(dict(meta, object=kind_name, choices=[], usage=usage(r)))}\n\n"
                break
            elif kind == "error":
                yield f"data: {json.dumps(value.body())}\n\n"
                break
            else:
                return
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        scheduler.cancel(r)  # a client gone mid-stream frees its row at the next step boundary


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="OpenAI-compatible server: continuous batching, speculative decoding in "
                                            "the batch, a prefix cache, a chat page at /")
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"))
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--draft_head", type=Path, default=None, help="a draft head (scripts/train_draft_head.py)")
    p.add_argument("--speculate_k", default="5", help="draft depth K (>= 1), or 'auto'")
    p.add_argument("--tree_nodes", default=None, help="draft tokens verified per target forward, or 'auto'")
    p.add_argument("--draft_ngram", type=int, default=0, metavar="N", help="n-gram lookup drafting")
    p.add_argument("--compile", nargs="?", const="auto", default="none", choices=COMPILE_MODES, metavar="MODE")
    p.add_argument("--max_batch_size", type=int, default=8, help="rows decoded together (continuous batching)")
    p.add_argument("--max_queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="tokens per request, prompt + completion (default: the model's context, at most 4096); "
                        "every decode step attends over this many cache slots, so size it to your requests")
    p.add_argument("--no_prefix_cache", action="store_true",
                   help="compute every prompt whole: no reuse of the keys and values of an earlier request's prefix")
    p.add_argument("--stream_interval", type=float, default=0.02, metavar="SECONDS",
                   help="the least time between hand-overs of decoded tokens to the clients (faster decoding hands "
                        "several over at once); a first token, an end, an error go at once; 0: every step")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None)
    return p.parse_args(argv)


def build_scheduler(args: argparse.Namespace, shard=None) -> Scheduler:
    """The generator for these flags (as generate.py builds it; its target sharded by `shard` under tensor
    parallelism) under a scheduler."""
    depth = args.speculate_k if args.speculate_k == "auto" else int(args.speculate_k)
    precision = PRECISIONS[args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")]
    nodes = args.tree_nodes if args.tree_nodes in (None, "auto") else int(args.tree_nodes)
    generator = Generator.build(args.checkpoint_path, args.device, precision, args.draft_checkpoint_path,
                                Speculation(depth, nodes, args.draft_ngram), args.compile, shard=shard,
                                draft_head=args.draft_head)
    block = generator.model.args.block_size
    return Scheduler(generator, args.max_batch_size, args.max_queue, min(args.max_seq_length or 4096, block),
                     not args.no_prefix_cache, args.stream_interval)


def check_args(args: argparse.Namespace):
    if args.speculate_k != "auto" and not args.speculate_k.isdigit():
        raise UserError(f"--speculate_k must be an integer >= 1 or 'auto', got {args.speculate_k!r}")
    if args.tree_nodes not in (None, "auto") and not args.tree_nodes.isdigit():
        raise UserError(f"--tree_nodes must be an integer or 'auto', got {args.tree_nodes!r}")
    for name in ("max_batch_size", "max_queue", "max_seq_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    if not 0 <= args.stream_interval <= 1:  # also NaN
        raise UserError(f"--stream_interval must be in [0, 1] seconds, got {args.stream_interval}")
    if not args.checkpoint_path.is_file():
        raise UserError(f"checkpoint not found: {args.checkpoint_path}: pass a model.pth file")


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or a host that does not resolve is one line
    (uvicorn, binding it later in its thread, logged the error and left the process serving nothing)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses the port
        sock.bind(address)
    except OSError as e:  # in use, not an address of this machine, a host that does not resolve
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def join_ranks(args: argparse.Namespace) -> tuple:
    """Under torchrun with more than one process: join the other ranks (tp.py; every rank must get the same flags but
    --host, --port and --api_key, which only rank 0 uses). Returns (rank, shard function, tp.Lockstep), or
    (0, None, None) for one process."""
    rank, world_size, shard = setup_distributed(args.device)
    if world_size == 1:
        return 0, None, None
    import tp
    try:
        tp.check_same_settings({name: str(value) for name, value in vars(args).items()
                                if name not in ("host", "port", "api_key")})
    except UserError as e:
        raise UserError(flag_names(str(e), {name: f"--{name}" for name in vars(args)})) from None
    return rank, shard, tp.Lockstep()


def follow(args: argparse.Namespace, shard, lockstep):
    """A rank other than 0 (it never listens): its shard of the model, then rank 0's calls on it until rank 0 stops
    the server or goes away. Never returns."""
    import tp
    # Ctrl-C reaches every rank of a terminal, torchrun hands its SIGTERM to every rank: rank 0 stops the others (a
    # rank that left at once would be a lost rank to rank 0); a rank ends when rank 0 stops it or goes away
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        lockstep.follow(build_scheduler(args, shard).engine, sdpa_context)
    except (UserError, RanksFailed) as e:
        tp.end_process(f"error: {e}")
    tp.end_process()


def finish_ranks(lockstep, scheduler: Optional[Scheduler], status: int):
    """Rank 0's end under tensor parallelism: the other ranks stopped and all leave together, or the one line of why
    they could not go on (exit status 1 at least). Never returns."""
    import tp
    if scheduler is None:  # loading failed: its line is out; the others stop with a line of their own
        tp.end_process("", max(status, 1))
    failure = scheduler.failure
    if failure is None:
        try:
            lockstep.stop()
        except RanksFailed as e:
            failure = str(e)
    if failure:
        tp.end_process(f"error: {failure}", max(status, 1))
    tp.end_process(None, status)


def main(argv=None) -> int:
    """The model runs in the main thread (inductor's CPU GEMM templates compile only there), uvicorn in another.
    Under torchrun rank 0 serves; the other ranks follow its calls on their shards (follow, tp.Lockstep)."""
    import uvicorn
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    # a server lives long: its weights on 2 MB pages decode faster every token for a one-time cost at load
    os.environ.setdefault("FASTGEN_HUGE_PAGES", "1")
    lockstep = None
    try:
        check_args(args)
        rank, shard, lockstep = join_ranks(args)
        if rank > 0:
            follow(args, shard, lockstep)
        sock = listen(args.host, args.port)
    except UserError as e:
        if lockstep is not None:
            import tp
            tp.end_process(f"error: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 1
    service = Service(args.checkpoint_path.parent.name, args.api_key)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    terminated, stopping = [], []

    def stop():
        # stop taking requests and end the in-flight ones, so that their connections close and uvicorn exits
        stopping.append(True)
        if service.scheduler is not None:
            service.scheduler.stop()
        server.should_exit = True

    def terminate(signum, frame):
        terminated.append(signum)
        stop()

    def serve():
        try:
            server.run(sockets=[sock])
        finally:
            if not server.should_exit:  # uvicorn stopped on its own: nothing would ever reach the model
                service.failed = service.failed or "the HTTP server stopped"
                stop()

    serving = threading.Thread(target=serve, name="http", daemon=True)
    serving.start()

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    scheduler = service.load(lambda: build_scheduler(args, shard))
    if scheduler is not None and lockstep is not None:  # every call that changes the model reaches every rank
        scheduler.engine = scheduler.generator.target = lockstep.leader(scheduler.engine)
        scheduler.idle = lockstep.keep_alive
    if scheduler is not None and not stopping:
        threading.Thread(target=service.warm_up, name="warm-up", daemon=True).start()
        scheduler.loop()
    server.should_exit = True
    serving.join(10)
    status = 128 + terminated[0] if terminated else 1 if service.failed or (scheduler and scheduler.failure) else 0
    if lockstep is not None:
        finish_ranks(lockstep, scheduler, status)
    return status


if __name__ == "__main__":
    sys.exit(main())
