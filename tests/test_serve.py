"""serve.py: the OpenAI API over continuous batching. Servers run in this process (uvicorn in a thread, a free
loopback port); each answer is checked against the library's own output for that prompt alone."""
import asyncio
import collections
import dataclasses
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import generation
import kernels
import serve
import speculate
from bench_serve import free_port
from decode import Sampling, logits_to_probs
from helpers import REJECT_BELOW, ROOT, chi_square_pvalue, copy_checkpoint, write_checkpoint
from test_crossdraft import noisy_draft  # noqa: F401 (a fixture)
from test_speculative import residual_ignores_draft

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
KEY = "test-key"


class Running:
    """A server on a free loopback port, started in this process."""

    def __init__(self, checkpoint, *flags, api_key=KEY, slow: float = 0.0, chunk=None, mode=None):
        self.args = serve.parse_args(["--checkpoint_path", str(checkpoint), "--port", "0", *map(str, flags)]
                                     + (["--api_key", api_key] if api_key else []))
        self.service = serve.Service(checkpoint.parent.name, api_key)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(serve.create_app(self.service), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

        self.shapes = collections.Counter()  # the [rows, columns] of every batched forward

        def build():
            scheduler = serve.build_scheduler(self.args)
            if chunk:  # short chunks of one width: short prompts span several
                scheduler.chunk, scheduler.widths = chunk, [chunk]
            forward = scheduler.engine.forward

            def forward_seen(x, *a, **k):
                self.shapes[tuple(x.shape)] += 1
                time.sleep(slow)  # a slower model: every forward takes at least `slow` seconds
                return forward(x, *a, **k)
            scheduler.engine = dataclasses.replace(scheduler.engine, forward=forward_seen,
                                                   mode=mode or scheduler.engine.mode)
            return scheduler
        self.service.start(build)
        deadline = time.time() + 300
        while not self.service.ready:
            assert self.service.failed is None and time.time() < deadline, self.service.failed
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)
        self.name = self.service.model_name
        self.scheduler = self.service.scheduler

    def post(self, path, body, headers=None, raw=None):
        """(status, parsed JSON) of a POST, the key sent unless headers say otherwise."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} if headers is None \
            else headers
        connection.request("POST", path, raw if raw is not None else json.dumps(body), headers)
        response = connection.getresponse()
        status, data = response.status, response.read()
        connection.close()
        return status, json.loads(data)

    def get(self, path, key=KEY):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        status, data = response.status, response.read().decode()
        connection.close()
        return status, data

    def metric(self, name):
        return float(next(line.split()[-1] for line in self.get("/metrics")[1].splitlines()
                          if line.startswith(name + " ") or line.startswith(name + "{")
                          and line.split()[0] == name))

    def stop(self):
        self.scheduler.stop()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(random_target):
    running = Running(random_target, "--max_batch_size", 4, chunk=16)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slow_server(random_target):
    """One row, one waiting request at most, 20 ms a forward: time to disconnect, fill the queue, press Stop."""
    running = Running(random_target, "--max_batch_size", 1, "--max_queue", 1, api_key=None, slow=0.02)
    # No token ends an answer: a sampled end token let the row holder finish before the queue filled, a flaky 429.
    running.scheduler.eos = set()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def library(random_target):
    return generation.Generator.build(random_target)


def alone(library, prompt_ids, n):
    """The library's greedy tokens for prompt_ids alone (generate.py's), and their text as the server sends it."""
    tokens = library.generate(list(prompt_ids), n, Sampling(temperature=0))[0][0]
    text = library.tokenizer.decode([t for t in tokens if t not in library.eos_ids])
    return tokens, serve.stable_text(text)


def finish_reason(tokens, library):
    return "stop" if tokens[-1] in library.eos_ids else "length"


PROMPTS = ["def main(", "Hello, my name is", "The parser adds", "usage: prog [-h]",
           "an optional argument " * 12]  # the last one spans several prefill chunks


# ----------------------------------------------------------------------------- the API, checked against the library

def test_chat_completion_equals_library(server, library):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is argparse?"}]
    reply = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=24, temperature=0)
    ids = library.tokenizer.chat_ids(messages)
    tokens, text = alone(library, ids, 24)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish_reason(tokens, library)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(tokens))
    assert reply.usage.total_tokens == len(ids) + len(tokens)
    assert reply.id.startswith("chatcmpl-") and reply.model == server.name and reply.created > 0


def test_a_developer_message_is_the_system_message(server, library):
    """OpenAI's clients send instructions as role "developer" (its newer name for "system"): a template that knows
    only system, user and assistant (Llama 2's refuses any other role) gets them as the system message."""
    question = {"role": "user", "content": "What is argparse?"}
    system = [{"role": "system", "content": "Answer briefly."}, question]
    reply = server.client.chat.completions.create(model=server.name, max_tokens=8, temperature=0,
                                                  messages=[{"role": "developer", "content": "Answer briefly."},
                                                            question])
    tokens, text = alone(library, library.tokenizer.chat_ids(system), 8)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(library.tokenizer.chat_ids(system))


def test_max_completion_tokens_or_max_tokens_bounds_a_chat_answer(server):
    """Chat takes either field; one sent as null (clients that serialize every field) leaves the other in force."""
    messages = [{"role": "user", "content": "Count on and on."}]
    for bound in ({"max_completion_tokens": 3}, {"max_tokens": 3}, {"max_completion_tokens": None, "max_tokens": 3},
                  {"max_completion_tokens": 3, "max_tokens": None}):
        status, reply = server.post("/v1/chat/completions", {"messages": messages, "temperature": 0, **bound})
        assert status == 200 and reply["usage"]["completion_tokens"] <= 3, bound
        assert reply["usage"]["completion_tokens"] == 3 or reply["choices"][0]["finish_reason"] == "stop"


def test_completion_and_its_stream_equal_library(server, library):
    for prompt in PROMPTS[:2]:
        tokens, text = alone(library, library.tokenizer.encode_prompt(prompt), 30)
        reply = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=30, temperature=0)
        assert reply.choices[0].text == text and reply.usage.completion_tokens == len(tokens)
        chunks = list(server.client.completions.create(model=server.name, prompt=prompt, max_tokens=30,
                                                       temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == finish_reason(tokens, library)
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) > 3


def test_chat_stream_arrives_in_pieces_with_usage(server, library):
    messages = [{"role": "user", "content": "Stream this, please."}]
    tokens, text = alone(library, library.tokenizer.chat_ids(messages), 40)
    chunks = list(server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=40,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= len(text) // 8
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # the raw events: as OpenAI's,
    connection.request("POST", "/v1/chat/completions", json.dumps(  # every chunk but the last says "usage": null
        {"messages": messages, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    events = [json.loads(line[6:]) for line in connection.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    connection.close()
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"]


def test_stop_strings_end_the_text_before_them(server, library):
    prompt = PROMPTS[1]
    _, text = alone(library, library.tokenizer.encode_prompt(prompt), 60)
    stop = next(text[k:k + 3] for k in range(len(text) // 2, len(text)) if "\ufffd" not in text[k:k + 3])
    want = text[:text.find(stop)]
    reply = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=60, temperature=0,
                                             stop=[stop, "\x00never"])
    assert reply.choices[0].text == want and reply.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=60, temperature=0,
                                                stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_stop_text_is_never_cut_inside_a_character():
    """A token that ends mid-character holds the text back until the character is whole."""
    class Bytes:  # ids are bytes of UTF-8
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")
    sent = []
    r = serve.Request([1], 10, Sampling(), push=sent.append)
    for b in "é!".encode():
        serve.add_token(r, b, Bytes(), eos=set())
    assert [text for _, text in sent] == ["é", "!"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A tokenizer of each kind a checkpoint may bring (tests/test_tokenizer.py builds the same)."""
    import tokenizer
    from helpers import write_chatml_tokenizer, write_llama2_json_tokenizer, write_llama3_tokenizer, \
        write_sentencepiece_model
    root = tmp_path_factory.mktemp("tokenizers")
    sp = write_sentencepiece_model(root / "sentencepiece")
    dirs = [write_chatml_tokenizer(root / "chatml"), write_llama3_tokenizer(root / "llama3"), sp,
            write_llama2_json_tokenizer(root / "llama2_json", sp / "tokenizer.model")]
    return [tokenizer.get_tokenizer(d) for d in dirs]


def test_the_answer_text_grows_as_the_whole_answer_decodes(tokenizers):
    """The server decodes only the ids after its cut, yet at every token its text is the decode of the whole
    answer, for every kind of tokenizer: prose, code, accents, CJK and emoji, byte-fallback pieces, spaces at piece
    starts, and random ids (pieces of characters, byte runs, special tokens) that no text encodes to."""
    from helpers import TEXT
    generator = torch.Generator().manual_seed(0)
    for tok in tokenizers:
        text = "\n".join(TEXT[:40] + TEXT[-5:])
        randoms = [torch.randint(0, tok.vocab_size, (300,), generator=generator).tolist() for _ in range(3)]
        for ids in [tok.encode(text), tok.encode(" ".join(TEXT[-5:]) * 8)] + randoms:
            r = serve.Request([1], len(ids), Sampling())
            for n in range(1, len(ids) + 1):
                r.tokens = ids[:n]
                assert serve.answer_text(r, n, tok) == tok.decode(ids[:n]), (type(tok).__name__, n)
            assert r.cut >= len(ids) - 3 * serve.MARGIN  # and the text it decodes again stays short


def test_nan_or_infinite_logits_fail_only_their_request(monkeypatch):
    """A row whose logits hold a NaN or +inf fails its own request (one 500 line); the rows beside it, and a -inf
    logit (a token ruled out), go on: greedy rows with their argmax. The step looks for broken logits and at the
    argmax once for all its rows (one transfer to the host), not row by row."""
    from types import SimpleNamespace
    failed, accepted, looks = [], [], []
    stub = SimpleNamespace(fail=lambda r, error: failed.append((r, error.message)),
                           accept=lambda r, token, scores=None: accepted.append((r, token)))
    for name in ("take", "verdict", "hand_out"):  # the scheduler's own, on the stub
        setattr(stub, name, getattr(serve.Scheduler, name).__get__(stub))
    finite = serve.chosen_is_finite
    monkeypatch.setattr(serve, "chosen_is_finite", lambda *args: looks.append(args) or finite(*args))
    requests = [serve.Request([1], 5, Sampling(temperature=t)) for t in (0, 0, 0.8, 0.8, 0, 0.8)]
    logits = torch.randn(6, 50)
    logits[1, 7], logits[3, 2], logits[4, 3], logits[5, 0] = float("nan"), float("inf"), -float("inf"), float("nan")
    serve.Scheduler.pick(stub, requests, logits)
    assert [r for r, _ in failed] == [requests[1], requests[3], requests[5]]
    assert all("NaN or infinite" in message for _, message in failed)
    assert [r for r, _ in accepted] == [requests[0], requests[2], requests[4]]
    assert [token for r, token in accepted if r.sampling.temperature == 0] == logits[[0, 4]].argmax(-1).tolist()
    assert len(looks) == 1


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(server):
    def sampled(seed, prompt=PROMPTS[0]):
        return server.client.completions.create(model=server.name, prompt=prompt, max_tokens=24, temperature=1.0,
                                                seed=seed, extra_body={"top_k": 50}).choices[0].text

    first = sampled(7)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(sampled, seed, prompt) for seed, prompt in zip((1, 2, 3), PROMPTS[1:])]
        beside = pool.submit(sampled, 7)
        assert beside.result() == first
        [o.result() for o in others]
    assert sampled(7) == first and sampled(8) != first


def test_sixteen_concurrent_clients_each_equal_the_library_alone(server, library):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    lengths = [8 + 3 * i for i in range(16)]

    def ask(i):
        reply = server.client.completions.create(model=server.name, prompt=prompts[i], max_tokens=lengths[i],
                                                 temperature=0)
        return reply.choices[0].text, reply.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    for prompt, n, (text, count) in zip(prompts, lengths, got):
        tokens, want = alone(library, library.tokenizer.encode_prompt(prompt), n)
        assert (text, count) == (want, len(tokens)), prompt
    assert server.metric("fastgen_batch_occupancy") > 0.25  # rows were shared
    # a prompt chunk is computed for its own row only ([1, C]); decoding runs the rows in use ([n, 1], n in 1, 2, 4)
    assert set(server.shapes) == {(1, 16), (1, 1), (2, 1), (4, 1)}
    assert server.metric("fastgen_prefill_steps_total") >= 16


def test_stored_graphs_prefill_the_exact_chunk_and_stay_exact(random_target, library):
    # the eager engine labelled as stored graphs (which take any token count): no padding to a prefill width; every
    # prompt prefilled whole (a reused prefix would start its chunks elsewhere)
    running = Running(random_target, "--max_batch_size", 3, "--no_prefix_cache", chunk=16, mode="stored")
    try:
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(6)]

        def ask(i):
            reply = running.client.completions.create(model=running.name, prompt=prompts[i], max_tokens=9 + i,
                                                      temperature=0)
            return reply.choices[0].text
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, range(6)))
        assert got == [alone(library, library.tokenizer.encode_prompt(p), 9 + i)[1] for i, p in enumerate(prompts)]
        widths = {shape[1] for shape in running.shapes if shape[0] == 1}
        lengths = [len(library.tokenizer.encode_prompt(p)) for p in prompts]
        assert {n % 16 for n in lengths if n % 16} <= widths and max(widths) == 16  # each chunk's rest, unpadded
        assert running.metric("fastgen_prefix_cache_hits_total") == 0  # prompts share prefixes; the cache is off
    finally:
        running.stop()


# ----------------------------------------------------------------------------- decode steps over the rows in use

@pytest.fixture(scope="module")
def wide_server(random_target):
    running = Running(random_target, "--max_batch_size", 8, chunk=16)
    yield running
    running.stop()


@pytest.mark.parametrize("clients", [1, 2, 3, 5])
def test_concurrent_clients_on_a_wide_batch_equal_the_library_token_for_token(wide_server, library, clients):
    """1, 2, 3 or 5 greedy clients on a server of 8 rows, joining at different times and leaving after different
    lengths (decoding rows move down as others leave): every answer's ids are the library's for its prompt alone,
    and a decode step computes only a batch of 1, 2, 4 or 8 rows (a lone client: 1)."""
    scheduler = wide_server.scheduler
    submitted, submit = [], scheduler.submit
    scheduler.submit = lambda r: (submitted.append(r), submit(r))[1]
    before = collections.Counter(wide_server.shapes)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(clients)]
    lengths = [40 - 7 * i for i in range(clients)]

    def ask(i):
        time.sleep(0.03 * i)
        return wide_server.client.completions.create(model=wide_server.name, prompt=prompts[i],
                                                     max_tokens=lengths[i], temperature=0).choices[0].text
    try:
        with ThreadPoolExecutor(clients) as pool:
            texts = list(pool.map(ask, range(clients)))
    finally:
        del scheduler.submit
    ids = [library.tokenizer.encode_prompt(p) for p in prompts]
    assert sorted(ids.index(r.prompt_ids) for r in submitted) == list(range(clients))
    for r in submitted:
        i = ids.index(r.prompt_ids)
        tokens, text = alone(library, ids[i], lengths[i])
        assert r.tokens == tokens and texts[i] == text, prompts[i]
    decodes = {shape[0] for shape in wide_server.shapes - before if shape[1] == 1}
    assert decodes <= {1, 2, 4, 8} and (clients > 1 or decodes == {1})


def drive(scheduler, arrivals: dict):
    """The scheduler's loop by hand, without its thread: the requests of arrivals[k] are submitted before step k;
    steps until all have finished (no drafter: every step is a batched one)."""
    everyone = [r for rs in arrivals.values() for r in rs]
    k = 0
    while any(r.finish_reason is None and r.error is None for r in everyone):
        for r in arrivals.get(k, []):
            scheduler.submit(r)
        with scheduler.wake:
            scheduler.admit()
        scheduler.step()
        k += 1
        assert k < 2000
    assert all(r.error is None for r in everyone)


def test_decode_steps_compute_the_rows_in_use_and_idle_rows_see_one_slot(random_target, library):
    """Requests join (one with a prompt of several chunks) and leave mid-way on 8 rows: each decode forward is a
    batch of the smallest of 1, 2, 4, 8 holding the decoding rows (and a request in the middle of its prompt, which
    stays in row 0); a row without a token to decode reads the scratch slot and its mask allows only that slot, a
    decoding row's every slot up to its position; prefill padding sees one slot of its chunk. Requests moved down
    to rows below the batch, and every greedy answer is the library's alone, token for token; a seeded sampled one
    is the same as alone."""
    scheduler = serve.Scheduler(generation.Generator.build(random_target), 8, 64, 200)
    scheduler.chunk, scheduler.widths = 16, [16]
    S, scratch = scheduler.model.max_seq_length, scheduler.scratch
    slots = torch.arange(S)
    calls, forward = [], scheduler.engine.forward

    def spy(x, pos, cache_slots, mask):
        rows = [(r, r.prefilled == len(r.prompt_ids), r.position) if r is not None else None
                for r in scheduler.rows]
        calls.append((x.shape, pos.clone(), mask.clone(), rows))
        return forward(x, pos, cache_slots, mask)
    scheduler.engine = dataclasses.replace(scheduler.engine, forward=spy)
    moves, compact = [], scheduler.compact

    def compacted():
        where = {id(r): r.slot for r in scheduler.rows if scheduler.decoding(r)}
        out = compact()
        moves.extend(r for r in out[0] if where[id(r)] != r.slot)
        return out
    scheduler.compact = compacted

    def greedy(prompt, n):
        return serve.Request(library.tokenizer.encode_prompt(prompt), n, Sampling())

    def seeded():
        return serve.Request(library.tokenizer.encode_prompt(PROMPTS[3]), 25, Sampling(0.9, top_k=50), seed=5)
    drive(scheduler, {0: [seeded_alone := seeded()]})
    long = greedy(PROMPTS[4], 20)  # several chunks of 16
    arrivals = {0: [greedy(PROMPTS[0], 40)], 2: [long],
                4: [greedy(PROMPTS[1], 6), greedy(PROMPTS[2], 30), greedy("a", 10)],
                6: [seeded(), greedy(PROMPTS[3] + " 7", 8)]}
    calls.clear()
    drive(scheduler, arrivals)
    for r in [r for rs in arrivals.values() for r in rs if r.sampling.temperature == 0]:
        assert r.tokens == alone(library, r.prompt_ids, r.max_tokens)[0]
    assert arrivals[6][0].tokens == seeded_alone.tokens
    assert moves, "no decoding request moved to a lower row"
    batches = []
    for shape, pos, mask, rows in calls:
        if shape[1] > 1:  # a prefill chunk: padding sees only the chunk's first slot
            for t in range(shape[1]):
                want = slots <= pos[0, t] if pos[0, t] != scratch else slots == pos[0, 0]
                assert torch.equal(mask[0, 0, t], want)
            continue
        decoding = [i for i, row in enumerate(rows) if row is not None and row[1]]
        pinned = rows[0] is not None and not rows[0][1]
        batch = shape[0]
        batches.append(batch)
        assert batch == min(b for b in (1, 2, 4, 8) if b >= len(decoding) + pinned)
        assert max(decoding) < batch
        for i in range(batch):
            position = rows[i][2] if i in decoding else scratch
            assert pos[i, 0] == position
            assert torch.equal(mask[i, 0, 0], slots <= position if i in decoding else slots == scratch)
    assert set(batches) == {1, 2, 4, 8} and batches[0] == 1 and batches[-1] == 1


# ----------------------------------------------------------------------------- the prefix cache

def reusable(prompt_ids, entries) -> int:
    """The prompt tokens a request may reuse: the longest prefix it shares with one of the cached entries (each an
    earlier request's prompt + answer but its last token, the ids in the cache), all but its own last token at most."""
    return min(max((serve.common_prefix(prompt_ids, e) for e in entries), default=0), len(prompt_ids) - 1)


def prefix_metrics(running) -> tuple:
    return (running.metric("fastgen_prefix_cache_hits_total"),
            running.metric("fastgen_prefix_cache_reused_tokens_total"))


def cached_of(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_chat_reuses_its_earlier_turns_and_answers_as_a_cold_server(server, library):
    """Three turns of a chat, each turn's prompt the last turn's prompt, its answer and a new question: every answer
    is the library's for the whole prompt alone, token for token; each turn reports as cached_tokens exactly the
    prefix its prompt shares with the cached ids of the turns before, and /metrics counts those hits and tokens. The
    last turn streams: its usage chunk (include_usage) reports the same."""
    server.scheduler.forget()
    before = prefix_metrics(server)
    messages = [{"role": "system", "content": "You answer in one line."}]
    entries, cached = [], []
    for turn, question in enumerate(["What is a parser?", "And what is a lexer?", "Which of them runs first?"]):
        messages.append({"role": "user", "content": question})
        ids = library.tokenizer.chat_ids(messages)
        tokens, text = alone(library, ids, 20)
        if turn < 2:
            reply = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 20, "temperature": 0})[1]
            got, usage = reply["choices"][0]["message"]["content"], reply["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        else:
            chunks = list(server.client.chat.completions.create(
                model=server.name, messages=messages, max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
        assert got == text, turn
        assert cached[-1] == reusable(ids, entries), turn
        entries.append(ids + tokens[:-1])
        messages.append({"role": "assistant", "content": text})
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    assert prefix_metrics(server) == (before[0] + 2, before[1] + cached[1] + cached[2])


def test_shared_prefixes_and_prompts_inside_a_cached_one(server, library):
    """Completions sharing a preamble, a prompt whose ids lie inside an earlier one's (a strict prefix of its
    cached ids) and the same prompt again: each answer is the library's alone, each reports the shared prefix, and
    a prompt held whole in the cache still computes its last token (its logits give the first answer token: reusing
    all of it, or one token fewer, is caught by cached_tokens or by the answer)."""
    server.scheduler.forget()
    before = prefix_metrics(server)
    preamble = "You are a careful assistant. Read the question and answer it in one short sentence. "
    prompts = [preamble + "Question: what does a parser do?", preamble + "Question: why split text into tokens?",
               preamble + "Question: what", preamble + "Question: what does a parser do?", preamble]
    entries, cached = [], []
    for prompt in prompts:
        ids = library.tokenizer.encode_prompt(prompt)
        tokens, text = alone(library, ids, 12)
        reply = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})[1]
        assert reply["choices"][0]["text"] == text, prompt
        cached.append(cached_of(reply))
        assert cached[-1] == reusable(ids, entries), prompt
        entries.append(ids + tokens[:-1])
    assert cached[0] == 0 and cached[1] > len(library.tokenizer.encode_prompt(preamble)) // 2
    assert cached[3] == len(library.tokenizer.encode_prompt(prompts[3])) - 1  # all of it cached: all but the last
    assert prefix_metrics(server) == (before[0] + 4, before[1] + sum(cached))


def test_the_least_recently_used_entry_is_evicted_when_rows_run_out(random_target, library):
    """Two rows, both holding cached entries (chats X and Y); X's next turn reuses X's entry; then a new request Z
    needs a row: Y's entry, the least recently used, is evicted. X's third turn still reuses X's history; Y's second
    turn reuses only what X's and Z's entries share with it. Every answer is the library's alone."""
    running = Running(random_target, "--max_batch_size", 2, chunk=16)
    try:
        entries = {}

        def ask(name, prompt, cached_entries):
            """The answer's text and cached_tokens, which must be the prefix shared with these entries."""
            ids = library.tokenizer.encode_prompt(prompt)
            tokens, text = alone(library, ids, 10)
            reply = running.post("/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})[1]
            assert reply["choices"][0]["text"] == text, name
            assert cached_of(reply) == reusable(ids, [entries[n] for n in cached_entries]), name
            entries[name] = ids + tokens[:-1]
            return text, cached_of(reply)

        x, y = "Alpha beta gamma delta.", "Zeta eta theta iota."
        x1, _ = ask("x", x, [])
        y1, _ = ask("y", y, ["x"])
        x2, _ = ask("x", x + x1 + " More alpha, please.", ["x", "y"])
        ask("z", "Omicron pi rho sigma.", ["x", "y"])  # no row without an entry: Y's, the older, goes
        _, x3 = ask("x", x + x1 + " More alpha, please." + x2 + " And more.", ["x", "z"])
        _, y2 = ask("y", y + y1 + " More zeta.", ["x", "z"])
        assert x3 > len(library.tokenizer.encode_prompt(x + x1)) and y2 < len(library.tokenizer.encode_prompt(y)) - 1
    finally:
        running.stop()


def test_concurrent_requests_share_a_system_prompt(server, library):
    """Four chat requests with one system prompt at once: the first prefilled computes it, each other one reuses
    it (taken at its first prefill chunk, after the first's prompt is in), and every answer is the library's
    alone."""
    server.scheduler.forget()
    before = prefix_metrics(server)
    system = {"role": "system", "content": "You are a terse assistant who answers every question in five words."}
    questions = ["Name a prime.", "Define a lexer.", "Pick a color.", "Say goodbye."]
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    ids = [library.tokenizer.chat_ids(m) for m in conversations]
    shared = {serve.common_prefix(a, b) for a in ids for b in ids if a is not b}
    assert len(shared) == 1  # every pair shares the same prefix: the system prompt and the template around it
    [shared] = shared

    def ask(messages):
        return server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0})[1]

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, conversations))
    for prompt_ids, reply in zip(ids, replies):
        assert reply["choices"][0]["message"]["content"] == alone(library, prompt_ids, 16)[1]
    assert sorted(cached_of(r) for r in replies) == [0, shared, shared, shared]
    assert prefix_metrics(server) == (before[0] + 3, before[1] + 3 * shared)


def test_reused_keys_and_values_are_those_a_cold_prefill_computes(random_target, library):
    """After a request that reused a prefix (of another prompt; its own prompt whole but the last token; of a
    request that arrived with it, taken at its first prefill chunk after another's prompt went through row 0), its
    row's keys and values in every slot of its prompt and answer are those of the same request on a cold server:
    the prefix is reused at its own positions and the prefill starts right after it (a slot early or late, or a
    slot not copied, changes that slot's keys and every later one's)."""
    def scheduler(prefix_cache):
        s = serve.Scheduler(generation.Generator.build(random_target), 4, 64, 200, prefix_cache)
        s.chunk, s.widths = 16, [16]
        return s

    def request(prompt):
        return serve.Request(library.tokenizer.encode_prompt(prompt), 12, Sampling())

    first = "The parser adds the arguments it was given to a namespace"
    warm = scheduler(True)
    drive(warm, {0: [request(first)]})
    together = [request("The parser reads each option, then every value"), request("Zebras eat grass"),
                request("The parser reads each option, and")]
    cases = [[request("The parser adds options and flags")], [request(first)], together]
    for arrivals in cases:
        drive(warm, {0: arrivals})
        reused = arrivals[-1]
        cold = scheduler(False)
        drive(cold, {0: [fresh := serve.Request(list(reused.prompt_ids), 12, Sampling())]})
        assert reused.cached_tokens >= 8 and fresh.cached_tokens == 0 and reused.tokens == fresh.tokens
        n = len(reused.prompt_ids) + len(reused.tokens) - 1
        a, b = reused.slot, fresh.slot  # where each ended (nothing moved since)
        assert warm.kept[a] == reused.prompt_ids + reused.tokens[:-1] and cold.kept[b] is None
        for warm_layer, cold_layer in zip(warm.model.layers, cold.model.layers):
            for name in ("k_cache", "v_cache"):
                got = getattr(warm_layer.attention.kv_cache, name)[a, :, :n]
                want = getattr(cold_layer.attention.kv_cache, name)[b, :, :n]
                assert torch.allclose(got, want, atol=1e-5), (reused.prompt_ids, name)
    assert together[-1].cached_tokens == serve.common_prefix(together[0].prompt_ids, together[-1].prompt_ids)


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list()] == [server.name]
    assert server.get("/health", key=None)[0] == 200
    before = server.metric("fastgen_generated_tokens_total")
    server.client.completions.create(model=server.name, prompt="metrics", max_tokens=5, temperature=0)
    status, text = server.get("/metrics")
    assert status == 200 and server.metric("fastgen_generated_tokens_total") >= before + 1
    for name in ("fastgen_requests_total{outcome=\"length\"}", "fastgen_tokens_per_second",
                 "fastgen_time_to_first_token_seconds_count", "fastgen_speculative_tokens_per_forward",
                 "fastgen_batch_occupancy", "fastgen_queue_depth"):
        assert name in text


# ----------------------------------------------------------------------------- bad input and faults

def earlier_call(arguments) -> dict:
    """An assistant message that called a tool with these arguments (OpenAI's JSON text)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


BAD = [  # (path, body, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 400, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 3]}, 400, "stop"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested past the JSON parser's recursion
    # an integer of more digits than Python converts: the parser's ValueError (it was a 500 with a traceback)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage"),
    # features that change the reply, which this server does not have: refused, not silently ignored (structured
    # output's own bad input: tests/test_grammar.py)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": -100}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    # other servers' sampling extensions: refused unless neutral (a bool is not the number 1)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.3}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": True}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.05}, 400, "min_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}, 400,
     "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 8}, 400, "min_tokens"),
    # JSON escapes of lone surrogates: strings no tokenizer encodes (they were a 500 with a traceback)
    ("/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}', 400, "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "caf\\udce9"}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "\\ud83d", "content": ""}],'
     b' "stream": true}', 400, "messages[1].role"),
    # an earlier tool call's arguments that the JSON parser refuses other than as bad JSON (they were a 500)
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, earlier_call(arguments)]}, 400,
       "messages[1].tool_calls[0].function.arguments") for arguments in ('{"a": ' + "1" * 5000 + "}", "[" * 10**5)],
    # wrong types inside messages, tools and response_format (they were accepted, and dropped or rendered as given)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, dict(earlier_call("{}"), tool_calls=[
        {"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}])]}, 400,
     "messages[1].tool_calls[0].id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, earlier_call("{}"), {
        "role": "tool", "content": "3", "tool_call_id": ["c"]}]}, 400, "messages[2].tool_call_id"),
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                "tools": [{"type": "function", "function": {"name": "f", field: value}}]}, 400,
       f"tools[0].function.{field}") for field, value in (("description", 5), ("strict", "yes"))],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, 400,
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": ["x"], "schema": {"type": "object"}}}}, 400,
     "response_format.json_schema.name"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{b}"[:40] for _, b, _, _ in BAD])
def test_bad_input_is_a_400_naming_the_field(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, reply = server.post(path, body, raw=raw)
    assert got == status
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and (param is None or param.split("[")[0] in error["message"])


def test_an_empty_prompt_is_a_400_that_says_so():
    """A tokenizer without BOS encodes "" as no ids at all: nothing to continue, which is not a context overflow."""
    with pytest.raises(serve.ApiError) as e:
        serve.fit_context([], 16, 256, "prompt")
    assert e.value.status == 400 and e.value.param == "prompt" and e.value.code == "invalid_value"
    assert "empty" in e.value.message and "shorten" not in e.value.message


def test_neutral_values_of_unsupported_fields_pass(server):
    """Clients that send the unsupported fields' off values (a text response format, no tools, no bias) get their
    answer."""
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {},
               "top_logprobs": None, "max_tokens": 2}
    status, reply = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **neutral})
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    status, reply = server.post("/v1/completions", {"prompt": "hi", "echo": False, "best_of": 1, "suffix": "",
                                                    "repetition_penalty": 1.0, "min_p": 0, "typical_p": 1,
                                                    "min_tokens": 0, "mirostat": 0, "ignore_eos": False,
                                                    "max_tokens": 2})
    assert status == 200 and (reply["usage"]["completion_tokens"] == 2
                              or reply["choices"][0]["finish_reason"] == "stop")  # a sampled end token


def test_huge_and_slow_bodies_are_refused_before_they_are_read_whole(server, monkeypatch):
    """413 for a body over the limit (by its Content-Length, or as a chunked body streams in), 408 for a body that
    does not arrive in time; the server answers the next request as before."""
    monkeypatch.setattr(serve, "MAX_BODY_BYTES", 1000)
    monkeypatch.setattr(serve, "BODY_SECONDS", 0.5)
    body = json.dumps({"prompt": "x" * 2000, "max_tokens": 2}).encode()
    status, reply = server.post("/v1/completions", None, raw=body)
    assert status == 413 and reply["error"]["code"] == "request_too_large" and "1000" in reply["error"]["message"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # chunked: no Content-Length
    connection.request("POST", "/v1/completions", iter([body[:600], body[600:]]),
                       {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # promises 100 bytes, sends 10
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\":".encode())
        reply = b""
        while b"request_timeout" not in reply:  # the status line and the JSON body may come in separate segments
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
    monkeypatch.undo()
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_api_key_is_required(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, reply = server.post("/v1/completions", body, headers=headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert server.get("/v1/models", key="wrong")[0] == 401 and server.get("/v1/models")[0] == 200
    assert server.post("/v1/completions", body)[0] == 200


def test_unknown_path_is_an_openai_style_404(server):
    status, text = server.get("/v1/engines")
    assert status == 404 and json.loads(text)["error"]["code"] == "not_found"


def test_binds_loopback_unless_told():
    assert serve.parse_args([]).host == "127.0.0.1"


def test_a_port_it_cannot_listen_on_is_one_line_before_loading(random_target, capsys, monkeypatch):
    """uvicorn bound the port in its own thread after the model loaded: on a port in use it logged an error and the
    process went on serving nothing, forever; a port out of range was a traceback and the same hang."""
    loaded = []
    monkeypatch.setattr(serve, "build_scheduler", lambda args: loaded.append(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for flags, expect in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                              (["--port", "99999"], "--port must be in [0, 65535]"),
                              (["--port", "8000", "--host", "no.such.host.invalid"], "no.such.host.invalid")):
            capsys.readouterr()
            assert serve.main(["--checkpoint_path", str(random_target), *flags]) == 1
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], lines
    assert not loaded


def test_a_client_gone_before_its_body_arrives_ends_the_handler_quietly():
    """A body cut short by the client (ClientDisconnect) was an ASGI traceback in the log."""
    from starlette.requests import ClientDisconnect

    class Gone:
        headers = {"content-length": "100"}

        async def stream(self):
            yield b'{"prompt"'
            raise ClientDisconnect()
    with pytest.raises(serve.ApiError) as e:
        asyncio.run(serve.read_body(Gone()))
    assert e.value.status == 400 and e.value.code == "client_disconnected"


def test_health_is_503_while_loading(random_target):
    from starlette.testclient import TestClient
    release = threading.Event()
    service = serve.Service("target")

    def build():
        release.wait(30)
        return serve.build_scheduler(serve.parse_args(["--checkpoint_path", str(random_target)]))
    service.start(build)
    with TestClient(serve.create_app(service)) as client:
        assert client.get("/health").status_code == 503
        reply = client.post("/v1/completions", json={"prompt": "hi"})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_not_ready"
        release.set()
        deadline = time.time() + 60
        while client.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    service.scheduler.stop()


def test_a_failing_request_fails_alone(server, library, monkeypatch):
    """An exception while one request's token is handled ends that request (500), not its neighbours or the
    server."""
    doomed = library.tokenizer.encode_prompt("this one fails")
    add_token = serve.add_token

    def failing(r, *args):
        if r.prompt_ids == doomed and len(r.tokens) >= 3:
            raise RuntimeError("broken detokenizer")
        return add_token(r, *args)
    monkeypatch.setattr(serve, "add_token", failing)
    with ThreadPoolExecutor(3) as pool:
        bad = pool.submit(server.post, "/v1/completions", {"prompt": "this one fails", "max_tokens": 30,
                                                           "temperature": 0})
        good = [pool.submit(server.client.completions.create, model=server.name, prompt=p, max_tokens=30,
                            temperature=0) for p in PROMPTS[:2]]
        status, reply = bad.result()
        assert status == 500 and "broken detokenizer" in reply["error"]["message"]
        for p, g in zip(PROMPTS, good):
            assert g.result().choices[0].text == alone(library, library.tokenizer.encode_prompt(p), 30)[1]
    assert server.get("/health")[0] == 200


def stream_request(running, body):
    """A streaming request whose response is read by hand: (connection, response)."""
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                       {"Content-Type": "application/json"})
    return connection, connection.getresponse()


def test_a_client_that_disconnects_frees_its_row(slow_server, library):
    scheduler = slow_server.scheduler
    connection, response = stream_request(slow_server, {"prompt": "a long answer", "max_tokens": 200})
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert scheduler.rows[0] is not None
    cancelled = scheduler.metrics.outcomes["cancelled"]
    response.close()
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    steps = scheduler.metrics.steps
    deadline = time.time() + 10
    while scheduler.rows[0] is not None:
        assert time.time() < deadline
        time.sleep(0.005)
    assert scheduler.metrics.steps - steps <= 2  # the step in flight, at most one more
    assert scheduler.metrics.outcomes["cancelled"] == cancelled + 1
    # its row keeps what it had cached: the same prompt again reuses all of it but the last token, exactly
    ids = library.tokenizer.encode_prompt("a long answer")
    status, reply = slow_server.post("/v1/completions", {"prompt": "a long answer", "max_tokens": 3, "temperature": 0},
                                     headers={"Content-Type": "application/json"})
    assert status == 200 and cached_of(reply) == len(ids) - 1
    assert reply["choices"][0]["text"] == alone(library, ids, 3)[1]


def test_a_full_queue_answers_429(slow_server):
    first, running = stream_request(slow_server, {"prompt": "takes the row", "max_tokens": 200})
    running.readline()
    second, waiting = None, None
    try:
        second = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=60)
        second.request("POST", "/v1/completions", json.dumps({"prompt": "waits", "max_tokens": 2}),
                       {"Content-Type": "application/json"})
        deadline = time.time() + 10
        while not slow_server.scheduler.waiting:
            assert time.time() < deadline
            time.sleep(0.01)
        status, reply = slow_server.post("/v1/completions", {"prompt": "one too many", "max_tokens": 2},
                                         headers={"Content-Type": "application/json"})
        assert status == 429 and reply["error"]["code"] == "queue_full"
    finally:
        first.close()
    waiting = second.getresponse()
    assert waiting.status == 200 and json.loads(waiting.read())["usage"]["completion_tokens"] >= 1


# ----------------------------------------------------------------------------- speculation and compilation

@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("serve_near"), noise=0.05, sharpen=4.0)


def long_chat_answer(running, library, n):
    """A greedy chat answer of n tokens from the server, checked against the library's alone; the reply."""
    messages = [{"role": "user", "content": "Say something long."}]
    _, text = alone(library, library.tokenizer.chat_ids(messages), n)
    reply = running.post("/v1/chat/completions", {"messages": messages, "max_tokens": n, "temperature": 0})[1]
    assert reply["choices"][0]["message"]["content"] == text
    return reply


def test_a_lone_request_speculates_and_stays_exact(random_target, near_draft, library):
    running = Running(random_target, "--max_batch_size", 3, "--draft_checkpoint_path", near_draft,
                      "--speculate_k", 3)
    try:
        messages = [{"role": "user", "content": "Say something long."}]
        tokens, text = alone(library, library.tokenizer.chat_ids(messages), 60)
        reply = running.post("/v1/chat/completions", {"messages": messages, "max_tokens": 60, "temperature": 0})[1]
        assert reply["choices"][0]["message"]["content"] == text
        assert reply["fastgen"]["tokens_per_target_forward"] > 1.2  # drafts were accepted
        # the next turn reuses the keys and values the speculative loop left in row 0, and stays exact
        entry = library.tokenizer.chat_ids(messages) + tokens[:-1]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        ids = library.tokenizer.chat_ids(messages)
        reply = running.post("/v1/chat/completions", {"messages": messages, "max_tokens": 40, "temperature": 0})[1]
        assert reply["choices"][0]["message"]["content"] == alone(library, ids, 40)[1]
        assert cached_of(reply) == reusable(ids, [entry]) > 0
        with ThreadPoolExecutor(4) as pool:  # several at once: batched rows, then whoever is left alone
            got = list(pool.map(lambda p: running.client.completions.create(
                model=running.name, prompt=p, max_tokens=40, temperature=0).choices[0].text, PROMPTS[:4]))
        assert got == [alone(library, library.tokenizer.encode_prompt(p), 40)[1] for p in PROMPTS[:4]]
    finally:
        running.stop()


def test_plain_steps_chosen_by_auto_are_batched_steps_and_stop_on_nan(random_target, near_draft, library,
                                                                     monkeypatch):
    """Where `auto` steps plainly, a request that may draft takes the batch's plain [n, 1] steps: the answer is the
    library's alone, one token per target forward; logits gone NaN in such a step fail the request with the one
    NaN line, before a broken token goes out."""
    import speculate
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: None)
    running = Running(random_target, "--max_batch_size", 2, "--draft_checkpoint_path", near_draft,
                      "--speculate_k", "auto")
    try:
        reply = long_chat_answer(running, library, 40)
        assert reply["fastgen"]["tokens_per_target_forward"] == 1.0
        forward = running.scheduler.engine.forward

        def poisoned(x, *args, **kwargs):  # NaN in decode steps only (the prefill stays finite)
            logits = forward(x, *args, **kwargs)
            return logits * float("nan") if x.shape[1] == 1 else logits
        running.scheduler.engine = dataclasses.replace(running.scheduler.engine, forward=poisoned)
        status, reply = running.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0})
        assert status == 500 and "logits are NaN or infinite" in reply["error"]["message"]
    finally:
        running.stop()


def test_a_lone_request_speculates_with_a_draft_head(random_target, library, tmp_path):
    """--draft_head in the server: the lone request's context features come from one more target pass, and the
    answer is the library's alone, token for token, with `auto` choosing depths, tree sizes and plain steps."""
    from drafthead import save_head
    from test_drafthead import random_head
    save_head(random_head(library.model, 200, seed=4), tmp_path / "head")
    running = Running(random_target, "--max_batch_size", 2, "--draft_head", tmp_path / "head", "--speculate_k", "auto",
                      "--tree_nodes", "auto")
    try:
        long_chat_answer(running, library, 48)
        assert running.scheduler.generator.speculator.kind.startswith("head")
    finally:
        running.stop()


def test_a_lone_request_speculates_with_a_draft_of_another_tokenizer(random_target, noisy_draft, library):
    """A draft of another tokenizer in the server (crossdraft), its depth chosen by `auto`: the lone request's
    answer is the library's alone, token for token, greedy; a sampled request completes."""
    running = Running(random_target, "--max_batch_size", 2, "--draft_checkpoint_path", noisy_draft,
                      "--speculate_k", "auto")
    try:
        assert running.scheduler.generator.speculator.kind == "draft-cross-tokenizer"
        long_chat_answer(running, library, 48)
        sampled = running.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0.8})[1]
        assert sampled["usage"]["completion_tokens"] == 20 or sampled["choices"][0]["finish_reason"] == "stop"
        # its loop gives no logprobs: a request that asks for them decodes in the batch, and gets them
        scored = running.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                  "logprobs": 2})[1]
        assert len(scored["choices"][0]["logprobs"]["tokens"]) == scored["usage"]["completion_tokens"]
    finally:
        running.stop()


def launch(checkpoint, *flags):
    """python serve.py as a user runs it (the model in the main thread), on a free loopback port, once ready:
    (process, a stand-in for Running with .port and .get)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "serve.py", "--checkpoint_path", str(checkpoint), "--port",
                                str(port), *map(str, flags)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    running = Running.__new__(Running)
    running.port = port
    deadline = time.time() + 600
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.time() < deadline
        try:
            if running.get("/health", key=None)[0] == 200:
                return process, running
        except OSError:
            pass
        time.sleep(0.2)


@pytest.mark.slow
def test_compiled_graphs_are_never_rebuilt_after_warm_up(random_target, library):
    """After the warm-up, requests of any length, batched or alone, greedy or sampled, compile nothing new. Regional
    graphs: the same static-shape property as whole graphs (one per batch and width), built far sooner."""
    process, running = launch(random_target, "--max_batch_size", 2, "--compile", "regional", "--draft_ngram", 3,
                              "--speculate_k", 2)
    try:
        graphs = running.metric("fastgen_compiled_graphs")
        assert graphs > 0
        if kernels.huge_pages_available() and "FASTGEN_HUGE_PAGES" not in os.environ:  # the server's default
            with open(f"/proc/{process.pid}/smaps") as f:
                assert re.search(r"^THPeligible:\s+1$", f.read(), re.M)

        def ask(prompt, **extra):
            body = dict({"prompt": prompt, "max_tokens": 25, "temperature": 0}, **extra)
            return running.post("/v1/completions", body, headers={"Content-Type": "application/json"})[1]

        with ThreadPoolExecutor(3) as pool:  # prompts of several lengths, together and alone
            got = [r["choices"][0]["text"] for r in pool.map(ask, PROMPTS)]
        ask(PROMPTS[1], temperature=0.7, seed=3)
        assert got == [alone(library, library.tokenizer.encode_prompt(p), 25)[1] for p in PROMPTS]
        assert running.metric("fastgen_compiled_graphs") == graphs
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_sigterm_ends_in_flight_requests_and_exits(tokenizer_model, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "long", tokenizer_model, dim=64, n_layer=2, n_head=4, vocab_size=512,
                                  block_size=4096)
    process, running = launch(checkpoint, "--max_batch_size", 2)
    try:
        # greedy: this model's answer holds no end token in its first thousand (a sampled one could end it
        # before the signal, a flaky failure)
        connection, response = stream_request(running, {"prompt": "go on", "max_tokens": 4000, "temperature": 0})
        assert response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert "shutting_down" in rest  # the stream ends with an error event, not silently
        assert process.wait(timeout=20) == 128 + signal.SIGTERM
        assert "Traceback" not in process.stdout.read()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", running.port), timeout=2)
    finally:
        if process.poll() is None:
            process.kill()


# ----------------------------------------------------------------------------- the chat page in a real browser

@pytest.mark.slow
def test_chat_page_streams_answers_and_stops(slow_server, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(slow_server.url + "/")
        page.fill("#max_tokens", "12")
        page.fill("#prompt", "What does argparse do?")
        page.press("#prompt", "Enter")
        first = page.locator(".answer").first
        page.wait_for_function("document.querySelector('#send').disabled === false", timeout=30000)
        assert first.inner_text().strip() and "tokens/s" in page.locator(".assistant .stats").first.inner_text()
        page.fill("#max_tokens", "")  # the rest of the context: long enough to stop by hand
        page.fill("#prompt", "Now tell me everything.")
        page.click("#send")
        second = page.locator(".answer").nth(1)
        page.wait_for_function("document.querySelectorAll('.answer')[1].textContent.length > 5", timeout=30000)
        page.click("#stop")
        page.wait_for_function("document.querySelectorAll('.stats')[3].textContent.includes('stopped')",
                               timeout=10000)
        stopped = second.inner_text()
        time.sleep(0.3)
        assert second.inner_text() == stopped  # nothing arrives after Stop
        deadline = time.time() + 5
        while slow_server.scheduler.rows[0] is not None:  # and the server freed the row
            assert time.time() < deadline
            time.sleep(0.01)
        shot = tmp_path / "chat_page.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
        assert page.locator(".user").count() == 2 and shot.stat().st_size > 0
        # a refused turn (max_tokens past the context) says why and leaves the conversation: the next question's
        # request carries the two earlier turns, not the refused one, and gets its answer
        bodies = []
        page.on("request", lambda request: bodies.append(request.post_data_json) if request.method == "POST" else 0)
        page.fill("#max_tokens", "1000000")
        page.fill("#prompt", "A question refused.")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll('.stats')[5].textContent.includes('error')", timeout=10000)
        assert "max_tokens" in page.locator(".stats").nth(5).inner_text()
        assert page.input_value("#prompt") == "A question refused."  # back in the box, to edit or send again
        page.fill("#max_tokens", "3")
        page.fill("#prompt", "Then answer briefly.")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll('.stats')[7].textContent.includes('tokens')", timeout=30000)
        sent = [m["content"] for m in bodies[-1]["messages"]]
        assert sent[0::2] == ["What does argparse do?", "Now tell me everything.", "Then answer briefly."]
        assert sent[1] == first.text_content() and sent[3] == second.text_content() and len(sent) == 5
        browser.close()


@pytest.mark.slow
def test_bench_serve_compares_a_lone_client_with_generate(random_target, tmp_path):
    """scripts/bench_serve.py --versus_generate: generate.py's plain tokens/s on the same checkpoint and prompt, and
    one client's on a server of each B, with their ratio, printed and in the JSON."""
    out = tmp_path / "versus.json"
    done = subprocess.run([sys.executable, "scripts/bench_serve.py", "--checkpoint_path", str(random_target),
                           "--versus_generate", "--batch_sizes", "4", "--seconds", "2", "--max_tokens", "8",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generate.py plain:" in done.stdout and "answer tok/s" in done.stdout
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["batch_size"] == 4 and row["answers"] >= 1 and result["generate_tokens_per_sec"] > 0
    assert row["ratio"] == pytest.approx(row["answer_tokens_per_sec"] / result["generate_tokens_per_sec"])
    assert row["decode_ratio"] == pytest.approx(row["decode_tokens_per_sec"] / result["generate_tokens_per_sec"])


@pytest.mark.slow
def test_bench_serve_times_a_chats_last_turn_with_and_without_the_prefix_cache(random_target, tmp_path):
    """scripts/bench_serve.py --chat_turns: the chat on a server with the prefix cache and on one without; the last
    turn's prompt reuses the earlier turns, and every answer is the same both ways."""
    out = tmp_path / "chat.json"
    done = subprocess.run([sys.executable, "scripts/bench_serve.py", "--checkpoint_path", str(random_target),
                           "--chat_turns", "3", "--chat_history", "120", "--max_tokens", "8", "--batch_sizes", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TTFT cached" in done.stdout and "identical" in done.stdout
    [row] = json.loads(out.read_text())["rows"]
    assert row["identical"] and row["turns"] == 3 and row["batch_size"] == 2
    assert 0 < row["last_cached_tokens"] < row["last_prompt_tokens"]
    assert row["speedup"] == pytest.approx(row["ttft_cold"] / row["ttft_cached"])


@pytest.mark.slow
def test_bench_serve_compares_speculative_with_plain_batching(random_target, tmp_path):
    """scripts/bench_serve.py --versus_plain: the same greedy load on a server with n-gram drafting and on one
    without; both tokens/s and their ratio, and every answer the same both ways (greedy)."""
    out = tmp_path / "plain.json"
    done = subprocess.run([sys.executable, "scripts/bench_serve.py", "--checkpoint_path", str(random_target),
                           "--versus_plain", "--batch_sizes", "2", "--seconds", "3", "--max_tokens", "12",
                           "--workload", "copy", "--json", str(out), "--", "--draft_ngram", "3", "--speculate_k", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "spec tok/s" in done.stdout and "identical" in done.stdout
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert result["plain_flags"] == [] and result["server_flags"] == ["--draft_ngram", "3", "--speculate_k", "4"]
    assert row["identical"] and row["clients"] == 2 and min(row["requests"].values()) >= 2
    assert row["ratio"] == pytest.approx(row["speculative_tokens_per_sec"] / row["plain_tokens_per_sec"])
    assert row["tokens_per_target_forward"] >= 1.0


# ----------------------------------------------------------------------------- speculation inside the batch

def spec_scheduler(target, rows=4, **build):
    """A Scheduler over `target` with a drafter (Generator.build's arguments), prefill chunks of 16."""
    s = serve.Scheduler(generation.Generator.build(target, **build), rows, 64, 200)
    s.chunk, s.widths = 16, [16]
    return s


def verified(scheduler, monkeypatch) -> list:
    """Spies on the scheduler's verification: a list that collects (request, drafted nodes, accepted nodes, batch)."""
    seen, accept_row = [], serve.accept_row
    forward, batch = scheduler.engine.forward, [0]

    def forward_seen(x, *args, **kwargs):
        batch[0] = x.shape[0]
        return forward(x, *args, **kwargs)

    def spy(r, tree, logits, argmax, bitmask=None):
        path, token = accept_row(r, tree, logits, argmax, bitmask)
        drafted = sum(parent != speculate.NO_PARENT for parent in tree.parents) - 1
        seen.append((r, drafted, len(path or ()), batch[0]))
        return path, token
    scheduler.engine = dataclasses.replace(scheduler.engine, forward=forward_seen)
    monkeypatch.setattr(serve, "accept_row", spy)
    return seen


def joining_and_leaving(library) -> dict:
    """Greedy requests that arrive while others speculate and leave at different lengths; later ones reuse earlier
    prompts (the prefix cache); one prompt spans several chunks; a seeded sampled one rides along."""
    ids = [library.tokenizer.encode_prompt(p) for p in PROMPTS]
    greedy = Sampling()
    return {0: [serve.Request(ids[0], 40, greedy)], 2: [serve.Request(ids[4], 30, greedy)],
            3: [serve.Request(ids[1], 10, greedy), serve.Request(ids[2], 50, greedy)],
            7: [serve.Request(ids[3], 25, greedy), serve.Request(ids[0] + ids[1][1:], 20, greedy),
                serve.Request(ids[3], 20, Sampling(0.9, top_k=50), seed=7)],
            12: [serve.Request(ids[4] + ids[2][1:], 24, greedy), serve.Request(ids[0], 33, greedy)]}


@pytest.mark.parametrize("drafter", ["ngram", "draft", "draft tree", "draft auto"])
def test_rows_speculate_together_and_every_greedy_answer_is_the_librarys(random_target, near_draft, library, drafter,
                                                                        monkeypatch):
    """Requests join and leave while the batch speculates (n-gram lookups, a draft model's chains or trees, `auto`),
    reuse cached prefixes and move between rows: every greedy answer is the library's alone, token for token;
    drafts were verified for several rows in one forward and accepted; a seeded sampled request, which verifies its
    root alone, draws what it draws alone."""
    build = {"ngram": dict(speculation=generation.Speculation(4, None, 3)),
             "draft": dict(draft_checkpoint_path=near_draft, speculation=generation.Speculation(3)),
             "draft tree": dict(draft_checkpoint_path=near_draft, speculation=generation.Speculation(3, 8)),
             "draft auto": dict(draft_checkpoint_path=near_draft, speculation=generation.Speculation("auto"))}[drafter]
    scheduler = spec_scheduler(random_target, **build)
    seeded = joining_and_leaving(library)[7][2]
    drive(scheduler, {0: [seeded]})  # alone
    seen = verified(scheduler, monkeypatch)
    arrivals = joining_and_leaving(library)
    drive(scheduler, arrivals)
    everyone = [r for rs in arrivals.values() for r in rs]
    for r in everyone:
        if r.seed is None:
            assert r.tokens == alone(library, r.prompt_ids, r.max_tokens)[0], r.prompt_ids
    assert arrivals[7][2].tokens == seeded.tokens
    assert sum(r.cached_tokens > 0 for r in everyone) >= 2
    together = [(drafted, accepted) for r, drafted, accepted, batch in seen if drafted and batch > 1]
    assert together and sum(accepted for _, accepted in together) > 0
    assert not any(drafted for r, drafted, _, _ in seen if r.seed is not None)
    assert scheduler.metrics.spec_tokens > scheduler.metrics.spec_forwards


def test_a_draft_of_the_target_itself_accepts_every_draft_wherever_its_row_moved(random_target, library,
                                                                                 monkeypatch):
    """With the target as its own draft, every drafted token is accepted only if the draft's cache rows hold the
    keys of the same ids as the target's: through prefill, prefix-cache copies, the moves to row 0 and down, and
    rows that idle beside drafting ones. A scheduler that leaves the draft's rows behind when rows swap is caught."""
    for broken in (False, True):
        if broken:
            swap = serve.swap_rows
            monkeypatch.setattr(serve, "swap_rows", lambda move, *args: None  # the draft's swaps go missing
                                if getattr(move, "args", (None,))[0] is scheduler.draft_model else swap(move, *args))
        scheduler = spec_scheduler(random_target, draft_checkpoint_path=random_target,
                                   speculation=generation.Speculation(3))
        seen = verified(scheduler, monkeypatch)
        for _ in range(2):  # the second time, prompts are cached
            arrivals = joining_and_leaving(library)
            drive(scheduler, arrivals)
            for r in [r for rs in arrivals.values() for r in rs if r.seed is None]:
                assert r.tokens == alone(library, r.prompt_ids, r.max_tokens)[0]
        rejected = [(drafted, accepted) for _, drafted, accepted, _ in seen if accepted < drafted]
        assert len(seen) > 50 and bool(rejected) == broken, rejected


def test_nan_in_a_verification_fails_only_its_row(random_target, near_draft, library):
    """Logits gone NaN in one row of a verification forward end that row's request with an error; the rows beside
    it speculate on and answer as the library does alone."""
    scheduler = spec_scheduler(random_target, draft_checkpoint_path=near_draft, speculation=generation.Speculation(3))
    forward, victim = scheduler.engine.forward, []

    def poisoned(x, *args, **kwargs):
        logits = forward(x, *args, **kwargs)
        if x.shape[1] > 1 and x.shape[0] > 1 and not victim and scheduler.rows[1] is not None:
            victim.append(scheduler.rows[1])
            logits[1] = float("nan")
        return logits
    scheduler.engine = dataclasses.replace(scheduler.engine, forward=poisoned)
    ids = [library.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    requests = [serve.Request(p, 30, Sampling()) for p in ids]
    for r in requests:
        scheduler.submit(r)
    while any(r.finish_reason is None and r.error is None for r in requests):
        with scheduler.wake:
            scheduler.admit()
        scheduler.step()
    assert len(victim) == 1 and victim[0].error is not None and "NaN" in victim[0].error.message
    for r in requests:
        if r is not victim[0]:
            assert r.error is None and r.tokens == alone(library, r.prompt_ids, 30)[0]


def batch_draws(target, draft, rows: list, rounds: int) -> list:
    """Draws of the two tokens after prompt + [FIRST_TOKEN] for each of `rows` (prompt ids, Sampling, seeded), all
    in one batch of speculating rows (a draft model's depth-2 chains), `rounds` times: [(t2, t3)] per row. The
    prompts are prefilled once; each round puts fresh requests, their first token given, on the rows they hold.
    Also returns the speculative (tokens, target forwards) of the rows that drafted."""
    scheduler = spec_scheduler(target, len(rows), draft_checkpoint_path=draft, speculation=generation.Speculation(2))
    scheduler.eos = set()  # every answer is 3 tokens long
    first = [serve.Request(list(p), 1, Sampling()) for p, _, _ in rows]
    drive(scheduler, {0: first})
    drawn = [[] for _ in rows]
    torch.manual_seed(0)
    for k in range(rounds):
        requests, free = [], set(range(len(rows)))
        for prompt, sampling, seeded in rows:  # a row whose entry starts with the prompt (rows move as they end)
            slot = next(i for i in sorted(free) if scheduler.kept[i][:len(prompt)] == list(prompt))
            free.remove(slot)
            r = serve.Request(list(prompt), 3, sampling, seed=k if seeded else None)
            r.prefilled, r.tokens, r.slot = len(prompt), [FIRST_TOKEN], slot
            scheduler.rows[slot], scheduler.kept[slot] = r, None
            requests.append(r)
        while any(r.finish_reason is None and r.error is None for r in requests):
            scheduler.step()
        assert all(r.error is None for r in requests)
        for out, r in zip(drawn, requests):
            out.append(r.tokens[1:])
    return drawn, (scheduler.metrics.spec_tokens, scheduler.metrics.spec_forwards)


FIRST_TOKEN = 100
ROUNDS = 200
T1_K4, T07_K3 = Sampling(1.0, top_k=4), Sampling(0.7, top_k=3)


def exact_pairs(model, prompt: list, sampling: Sampling) -> torch.Tensor:
    """The target's p(t2, t3) after prompt + [FIRST_TOKEN], [V * V], by enumeration over t2's support."""
    def probs(context):
        model.setup_caches(1, 64)
        with torch.no_grad():
            logits = model(torch.tensor([context]), torch.arange(len(context)).view(1, -1))[0, -1]
        return logits_to_probs(logits, sampling).double()
    context = list(prompt) + [FIRST_TOKEN]
    p2 = probs(context)
    joint = torch.zeros(len(p2), len(p2), dtype=torch.double)
    for t2 in p2.nonzero().flatten().tolist():
        joint[t2] = p2[t2] * probs(context + [t2])
    return joint.flatten()


def same_settings_everywhere(r, tree, logits, argmax, bitmask=None, accept_row=serve.accept_row):
    """Broken: every sampled row verified with the first row's settings, not its own."""
    return accept_row(dataclasses.replace(r, sampling=T1_K4) if r.sampling.temperature else r, tree, logits, argmax)


SLOW_CASES = ("broken: rows verified with one row's settings",)  # a chi-square run each: one broken case stays in the quick loop
BATCH_LOSSLESS = {  # name: (the rows' settings are all the same, what to break or None)
    "one setting: the draft samples": (True, None),
    "mixed settings: greedy drafts": (False, None),
    "broken: residual ignores the draft": (False, ("speculate", "residual", residual_ignores_draft)),
    "broken: rows verified with one row's settings": (False, ("serve", "accept_row", same_settings_everywhere)),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in BATCH_LOSSLESS])
def test_sampled_rows_speculating_in_a_batch_are_target_distributed(random_target, near_draft, library, case,
                                                                   monkeypatch):
    """Sampled rows in one batch, at two positions (two prompts), with their own settings (two samplings, a greedy
    row and a seeded one beside them), speculate together; each group's (t2, t3) draws pass a chi-square test
    against the target's distribution computed by enumeration, and deliberately broken verifications fail it
    (REJECT_BELOW as in test_speculative.py). With one setting the draft samples with it (its proposals reach the
    verifier); with several it drafts greedily (point masses)."""
    same, breakage = BATCH_LOSSLESS[case]
    if breakage is not None:
        module, name, broken = breakage
        monkeypatch.setattr(speculate if module == "speculate" else serve, name, broken)
    a, b = (library.tokenizer.encode_prompt(p) for p in ("def main(", "Hello, my name is"))
    if same:
        rows = [(a, T1_K4, False)] * 3 + [(b, T1_K4, False)] * 3
    else:
        rows = [(a, T1_K4, False)] * 2 + [(a, T1_K4, True), (b, T07_K3, False), (b, T07_K3, False),
                                          (a, Sampling(), False), (b, T07_K3, True), (b, Sampling(), False)]
    drawn, (tokens, forwards) = batch_draws(random_target, near_draft, rows, ROUNDS)
    model = generation.load_model(random_target)
    pvalues = {}
    for prompt, sampling in {(tuple(p), (s.temperature, s.top_k)): (p, s) for p, s, _ in rows
                             if s.temperature > 0}.values():
        pairs = torch.tensor([d for (p, s, _), got in zip(rows, drawn) if p == prompt and s == sampling for d in got])
        vocab = model.args.vocab_size
        counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)
        pvalues[(len(prompt), sampling.temperature)] = chi_square_pvalue(counts, exact_pairs(model, prompt, sampling))
    greedy = [got for (p, s, _), got in zip(rows, drawn) if s.temperature == 0]
    assert all(len(set(map(tuple, got))) == 1 for got in greedy)  # a greedy row beside them: always the same
    assert (min(pvalues.values()) < REJECT_BELOW) == (breakage is not None), pvalues
    assert 1.2 < tokens / forwards < 2.8  # drafts accepted and rejected (depth 2: at most 3 tokens a forward)


class Recorder:
    """A Mailbox stand-in: the events posted since the last flush, and each hand-over with the step it came at."""

    def __init__(self, step):
        self.pending, self.handed, self.step = [], [], step

    def post(self, event):
        self.pending.append(event)

    def flush(self) -> bool:
        if not self.pending:
            return False
        self.handed.append((self.step[0], self.pending))
        self.pending = []
        return True


@pytest.mark.parametrize("interval", [0.0, 0.02])
def test_tokens_reach_the_http_side_at_most_every_stream_interval_and_first_tokens_and_ends_at_once(
        random_target, library, monkeypatch, interval):
    """The scheduler's loop by hand on a clock of 7 ms a step: with --stream_interval 0 every step's events go out
    after it; with 20 ms a first token and an end go out after the step that made them, other tokens wait at most
    one step past the interval (a hand-over wakes the event loop, which takes a core mid-step where none is spare).
    Every event goes out once, in order, whatever the interval."""
    clock, step = [0.0], [0]
    monkeypatch.setattr(serve.time, "perf_counter", lambda: clock[0])
    scheduler = serve.Scheduler(generation.Generator.build(random_target), 2, 64, 200, stream_interval=interval)
    recorder = Recorder(step)
    scheduler.mailboxes = [recorder]
    ids = library.tokenizer.encode_prompt("def main(")
    r = serve.Request(ids, 40, Sampling(temperature=0), push=recorder.post)
    scheduler.submit(r)
    made = {}  # step -> the events it made
    while r.finish_reason is None:
        with scheduler.wake:
            scheduler.admit()
        before = len(recorder.pending) + sum(len(events) for _, events in recorder.handed)
        scheduler.step()
        made[step[0]] = len(recorder.pending) + sum(len(events) for _, events in recorder.handed) - before
        clock[0] += 0.007
        scheduler.flush()
        step[0] += 1
        assert step[0] < 200 and r.error is None
    events = [event for _, handed in recorder.handed for event in handed]
    assert not recorder.pending and events[-1] == ("done", r.finish_reason)
    assert "".join(value for kind, value in events if kind == "text") == r.text and len(r.tokens) > 10
    steps = [k for k, _ in recorder.handed]
    first = min(k for k, n in made.items() if n)
    assert steps[0] == first and steps[-1] == max(made)  # the first token and the end: after their own step
    if interval == 0:
        assert steps == [k for k, n in sorted(made.items()) if n]
    else:  # none sooner than 20 ms after the last (but the end); none of a token made over 2 steps (14 ms) before
        assert all(b - a >= 3 for a, b in zip(steps, steps[1:-1])), steps
        oldest = [min(j for j, n in made.items() if n and j > a) for a in steps[:-1]]
        assert all(k - j <= 2 for j, k in zip(oldest, steps[1:])), (steps, made)
        assert len(steps) < len([n for n in made.values() if n]) / 2


@pytest.mark.parametrize("value", ["-0.01", "nan", "2"])
def test_a_stream_interval_out_of_range_is_one_line_before_loading(random_target, capsys, monkeypatch, value):
    loaded = []
    monkeypatch.setattr(serve, "build_scheduler", lambda args: loaded.append(1))
    assert serve.main(["--checkpoint_path", str(random_target), "--stream_interval", value]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: --stream_interval must be in [0, 1] seconds, got {float(value)}"] and not loaded


def test_an_answer_of_one_token_has_no_tokens_per_second(server):
    """No token follows the first to time: the figure is null (it read 0.0, a pace the server never had)."""
    _, one = server.post("/v1/completions", {"prompt": "def main(", "max_tokens": 1, "temperature": 0})
    _, more = server.post("/v1/completions", {"prompt": "def main(", "max_tokens": 4, "temperature": 0})
    assert one["usage"]["completion_tokens"] == 1 and one["fastgen"]["tokens_per_second"] is None
    assert more["usage"]["completion_tokens"] == 4 and more["fastgen"]["tokens_per_second"] > 0
