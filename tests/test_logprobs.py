"""Logprobs: the target's own log-probabilities of the tokens it chose (serve.py's `logprobs` / `top_logprobs` /
`echo`, speculate.Speculator's `logprobs`), equal to log_softmax of one plain full forward of the prompt and answer,
whether a token came from batched decoding, the prefill, a plain step of the speculative loop or an accepted draft."""
import collections

import pytest
import torch

import generation
import serve
import speculate
from decode import Sampling
from generation import load_model
from helpers import copy_checkpoint
from test_serve import PROMPTS, Running, alone, drive, library, tokenizers  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow  # servers and speculative runs per test: the full suite runs them

openai = pytest.importorskip("openai")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(random_target):
    """log_softmax of one plain forward over ids [T] (no cache reuse, no batching): [T, V]."""
    model = load_model(random_target)
    model.setup_caches(1, model.args.block_size)

    def log_probs(ids: list) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1))[0]
        return torch.log_softmax(logits.double(), -1)
    return log_probs


def check_answer(reference, prompt_ids: list, tokens: list, chosen: list, tops: list = None):
    """chosen[i] is the reference's log-probability of tokens[i] after prompt_ids + tokens[:i]; tops[i] (if given)
    are the reference's largest ones, in order."""
    assert len(chosen) == len(tokens) > 0
    expected = reference(prompt_ids + tokens)[len(prompt_ids) - 1:-1]  # row i predicts tokens[i]
    assert torch.allclose(torch.tensor(chosen, dtype=torch.double), expected[range(len(tokens)), tokens],
                          atol=TOLERANCE, rtol=0)
    for values, row in zip(tops or [], expected):
        assert torch.allclose(torch.tensor(values, dtype=torch.double), row.topk(len(values)).values,
                              atol=TOLERANCE, rtol=0)


class Finished:
    """The requests a server finished (prompt ids and tokens), in order: the ids behind a reply's token texts."""

    def __init__(self, running):
        self.requests, release = [], running.scheduler.release

        def spy(r, outcome):
            self.requests.append(r)
            return release(r, outcome)
        running.scheduler.release = spy

    def last(self):
        return self.requests[-1]


@pytest.fixture(scope="module")
def server(random_target):
    running = Running(random_target, "--max_batch_size", 4, chunk=16)
    running.finished = Finished(running)
    yield running
    running.stop()


# ----------------------------------------------------------------------------- chat and completions, batched decoding

@pytest.mark.parametrize("temperature", [0, 0.7])
def test_chat_logprobs_are_the_targets_log_softmax(server, library, reference, temperature):
    messages = [{"role": "user", "content": "What is argparse?"}]
    reply = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=20,
                                                  temperature=temperature, top_p=0.9, seed=3, logprobs=True,
                                                  top_logprobs=5)
    r = server.finished.last()
    content = reply.choices[0].logprobs.content
    # raw target log-probabilities: not those of the warped (temperature, top-p) distribution sampled from
    check_answer(reference, r.prompt_ids, r.tokens, [c.logprob for c in content],
                 [[t.logprob for t in c.top_logprobs] for c in content])
    assert all(len(c.top_logprobs) == 5 and bytes(c.bytes).decode("utf-8", "replace") for c in content)
    if temperature == 0:
        ids = server.scheduler.tokenizer.chat_ids(messages)
        assert r.tokens == alone(library, ids, 20)[0]
        assert all(c.token == c.top_logprobs[0].token for c in content)  # greedy: the likeliest token


def test_a_constrained_answer_is_scored_with_the_raw_logits(server, reference):
    """A request with a grammar (response_format) draws from its logits masked by it, in batched decoding; its
    records are the target's own log-probabilities all the same."""
    for temperature in (0, 0.8):
        reply = server.client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": "JSON, please."}], max_tokens=24,
            temperature=temperature, seed=5, logprobs=True, top_logprobs=3, response_format={"type": "json_object"})
        r = server.finished.last()
        content = reply.choices[0].logprobs.content
        assert r.constraint is not None and reply.choices[0].message.content.startswith("{")
        check_answer(reference, r.prompt_ids, r.tokens, [c.logprob for c in content],
                     [[t.logprob for t in c.top_logprobs] for c in content])


def test_chat_stream_chunks_carry_their_tokens_logprobs(server, reference):
    body = dict(model=server.name, messages=[{"role": "user", "content": "Tell me more."}], max_tokens=24,
                temperature=0, logprobs=True, top_logprobs=2)
    whole = server.client.chat.completions.create(**body).choices[0]
    chunks = list(server.client.chat.completions.create(**body, stream=True))
    r = server.finished.last()
    streamed = [c for chunk in chunks if chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in whole.logprobs.content]
    check_answer(reference, r.prompt_ids, r.tokens, [c.logprob for c in streamed])
    for chunk in chunks:  # a chunk with text carries the records of the tokens that made it
        if chunk.choices[0].delta.content:
            assert chunk.choices[0].logprobs.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    if "\ufffd" not in text:
        eos = server.scheduler.eos
        assert b"".join(bytes(c.bytes) for c, t in zip(streamed, r.tokens) if t not in eos) == text.encode()


def test_rows_decoded_together_each_get_their_own_logprobs(random_target, reference):
    """Requests joining a batch step by step (a prompt scored over several chunks while other rows decode, [n, 1]
    forwards of several rows, greedy and sampled): each one's records are its own tokens' log-probabilities."""
    generator = generation.Generator.build(random_target)
    scheduler = serve.Scheduler(generator, 4, 64, 200)
    scheduler.chunk, scheduler.widths = 16, [16]
    events = collections.defaultdict(list)

    def request(prompt, n, temperature, echo=False):
        ids = generator.tokenizer.encode_prompt(prompt)
        r = serve.Request(ids, n, Sampling(temperature), logprobs=2, echo=prompt if echo else None)
        r.push = lambda event: events[id(r)].append(event)
        return r
    arrivals = {0: [request(PROMPTS[0], 30, 0)], 1: [request(PROMPTS[4], 6, 0.8, echo=True)],
                3: [request(PROMPTS[1], 20, 0.8), request(PROMPTS[2], 12, 0)]}
    drive(scheduler, arrivals)
    for r in [r for rs in arrivals.values() for r in rs]:
        records = [e for kind, value in events[id(r)] if kind in ("prompt", "logprobs") for e in value]
        ids = r.prompt_ids + r.tokens if r.echo is not None else r.tokens
        assert len(records) == len(ids) and (r.echo is None or records[0]["logprob"] is None)
        skip = 1 if r.echo is not None else 0
        check_answer(reference, r.prompt_ids[:1] if skip else r.prompt_ids, ids[skip:],
                     [e["logprob"] for e in records[skip:]], [[t["logprob"] for t in e["top_logprobs"]]
                                                             for e in records[skip:]])


def test_completion_logprobs_and_echo_scoring(server, reference):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0 or 1): the prompt's tokens with the target's
    log-probabilities (the first one null), then the answer's; the same whether the prompt's prefix is cached or
    not (a scored prompt is computed whole), over several prefill chunks."""
    tokenizer = server.scheduler.tokenizer
    for prompt in (PROMPTS[1], PROMPTS[4]):
        ids = tokenizer.encode_prompt(prompt)
        replies = []
        for n in (0, 1, 0):
            reply = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=n, temperature=0,
                                                     echo=True, logprobs=3)
            replies.append(reply)
            choice, tokens = reply.choices[0], ids + server.finished.last().tokens
            got = choice.logprobs
            assert len(got.tokens) == len(tokens) == len(ids) + n and choice.text.startswith(prompt)
            assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
            check_answer(reference, ids[:1], tokens[1:], got.token_logprobs[1:])
            for chosen, top in zip(got.token_logprobs[1:], got.top_logprobs[1:]):
                assert 3 <= len(top) <= 4 and chosen in top.values()
            assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0
        assert replies[0].choices[0].logprobs == replies[2].choices[0].logprobs
        # the prompt as token ids (as lm-eval sends it) scores the same
        status, body = server.post("/v1/completions", {"prompt": [ids], "max_tokens": 0, "echo": True,
                                                       "logprobs": 3})
        assert status == 200 and body["choices"][0]["logprobs"]["token_logprobs"] == \
            replies[0].choices[0].logprobs.token_logprobs


def test_lm_evals_local_completions_reads_the_loglikelihood(server, library, reference):
    """lm-eval's `local-completions` request for a loglikelihood (its payload: the context and continuation as one
    list of ids, echo, logprobs 1, max_tokens 1), read by its own parser: the continuation's summed log-probability
    and whether it is the greedy one."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    context = server.scheduler.tokenizer.encode_prompt(PROMPTS[1])
    greedy = alone(library, context, 3)[0]
    for continuation in (greedy, [greedy[0], (greedy[1] + 1) % 500, greedy[2]]):
        payload = {"model": server.name, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1,
                   "logprobs": 1, "seed": 1234, "echo": True}
        status, reply = server.post("/v1/completions", payload)
        assert status == 200
        [(total, is_greedy)] = completions.LocalCompletionsAPI.parse_logprobs(reply, [context + continuation],
                                                                              [len(context)])
        expected = reference(context + continuation)[range(len(context) - 1, len(context) + 2), continuation]
        assert abs(total - float(expected.sum())) < 3 * TOLERANCE and is_greedy == (continuation == greedy)


def test_completion_logprobs_without_echo_and_streamed(server, reference):
    body = dict(model=server.name, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, logprobs=5)
    reply = server.client.completions.create(**body)
    r = server.finished.last()
    got = reply.choices[0].logprobs
    check_answer(reference, r.prompt_ids, r.tokens, got.token_logprobs)
    assert got.text_offset[0] == 0 and all(5 <= len(top) <= 6 for top in got.top_logprobs)
    chunks = list(server.client.completions.create(**dict(body, temperature=0, echo=True), stream=True))
    r = server.finished.last()
    scored = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert chunks[0].choices[0].text == PROMPTS[0] and scored[0].token_logprobs[0] is None
    values = [v for s in scored for v in s.token_logprobs]
    assert len(values) == len(r.prompt_ids) + len(r.tokens)
    check_answer(reference, r.prompt_ids[:1], r.prompt_ids[1:] + r.tokens, values[1:])


BAD = [  # (path, body, param): refused before any decoding
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # OpenAI's rule: only with logprobs true
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"max_tokens": 0, "logprobs": 2}, "max_tokens"),  # nothing to generate, nothing echoed
    ("/v1/completions", {"prompt": [1, 2, 100000], "echo": True}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{b}"[:40] for _, b, _ in BAD])
def test_bad_logprobs_are_a_400_naming_the_field(server, path, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    before = server.scheduler.metrics.prompt_tokens
    status, reply = server.post(path, base | body)
    assert status == 400 and reply["error"]["param"] == param and f"`{param}`" in reply["error"]["message"]
    assert server.scheduler.metrics.prompt_tokens == before  # never queued


def test_each_tokens_bytes_join_to_the_text(tokenizers):
    """A record's `bytes` are its token's share of the text, for every kind of tokenizer: prose, accents, CJK and
    emoji (byte-fallback runs and byte-level pieces holding part of a character); joined, they are the text's
    UTF-8, and a token holding part of a character shows as its escaped bytes."""
    from helpers import TEXT
    for tok in tokenizers:
        byte_ids, token_bytes, partial = serve.byte_tokens(tok), tok.token_bytes(), 0
        for line in TEXT[:10] + TEXT[-5:] + ["rare: ☃ 𝄞 ᚠᛇᚻ, Ωμέγα"]:
            ids = tok.encode(line)
            records = [serve.token_texts(tok, token_bytes, byte_ids, ids[max(i - serve.CONTEXT, 0):i])(t)
                       for i, t in enumerate(ids)]
            assert b"".join(bytes(raw) for _, raw in records) == tok.decode(ids).encode(), (type(tok).__name__, line)
            for text, raw in records:
                assert text == bytes(raw).decode("utf-8", "backslashreplace")
                partial += "\\x" in text
        assert partial  # (the texts hold characters split over tokens)


# ----------------------------------------------------------------------------- speculation

@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("logprobs_near"), noise=0.05, sharpen=4.0)


class Scored:
    """The library's speculator asked for logprobs: generation.generate as the server's lone request runs it."""

    def __init__(self, speculator):
        self.speculator, self.lookahead, self.features = speculator, speculator.lookahead, speculator.features

    def generate(self, *args, **kwargs):
        return self.speculator.generate(*args, **kwargs, logprobs=True)


@pytest.fixture(scope="module")
def head(library, tmp_path_factory):
    from drafthead import save_head
    from test_drafthead import random_head
    path = tmp_path_factory.mktemp("logprobs_head") / "head"
    save_head(random_head(library.model, 200, seed=4), path)
    return path


@pytest.mark.parametrize("drafter", ["draft chain", "draft tree", "ngram", "auto plain", "head auto"])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_speculator_scores_each_token_with_the_targets_log_softmax(random_target, near_draft, head, reference,
                                                                   monkeypatch, drafter, temperature):
    """Speculator.generate(logprobs=True): every token after the first comes with the target's log-probabilities
    where it was chosen, from an accepted draft, the token after it, or a plain step of `auto` (a draft head's
    plain steps keep the target's features too)."""
    if drafter == "auto plain":
        monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: None)
    how = {"draft chain": generation.Speculation(3), "draft tree": generation.Speculation(3, 6),
           "ngram": generation.Speculation(3, None, 2), "auto plain": generation.Speculation("auto"),
           "head auto": generation.Speculation("auto", "auto")}[drafter]
    draft = {"ngram": None, "head auto": None}.get(drafter, near_draft)
    built = generation.Generator.build(random_target, draft_checkpoint_path=draft, speculation=how,
                                       draft_head=head if drafter == "head auto" else None)
    prompt = built.tokenizer.encode_prompt(PROMPTS[1])
    torch.manual_seed(0)
    for _ in range(2 if drafter == "ngram" else 1):  # the n-gram lookup drafts from the run's earlier answer
        got = []
        tokens, stats = generation.generate(built.target, torch.tensor(prompt), 40, Sampling(temperature),
                                            built.eos_ids, False, 1, Scored(built.speculator),
                                            lambda token, scores: got.append((int(token[0]), scores)))
    assert [t for t, _ in got] == tokens[0] and got[0][1] is None
    check_answer(reference, prompt + tokens[0][:1], tokens[0][1:], [float(s[t]) for t, s in got[1:]])
    # (the random target's flat distribution rejects most sampled n-grams)
    if drafter.startswith("draft") or drafter == "ngram" and temperature == 0:
        assert stats["tokens_per_target_forward"] > 1  # drafts were accepted


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_a_lone_speculating_request_gets_the_targets_logprobs(random_target, near_draft, reference, drafter):
    """The server's lone request decodes through the speculative loop, with logprobs: each token's record is the
    target's log_softmax where it was chosen (accepted drafts included), greedy or sampled, streamed or not."""
    flags = ["--draft_checkpoint_path", near_draft] if drafter == "draft" else ["--draft_ngram", 3]
    running = Running(random_target, "--max_batch_size", 2, "--speculate_k", 3, *flags)
    finished = Finished(running)
    try:
        body = {"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 40,
                "temperature": 0, "logprobs": True, "top_logprobs": 3}
        # the last: a grammar's answer (response_format), drawn from masked logits, scored with the raw ones
        for stream, temperature, form in ((False, 0, None), (True, 0, None), (False, 0.8, None),
                                          (False, 0.8, {"type": "json_object"})):
            body = body | ({"response_format": form} if form else {})
            if stream:
                chunks = list(running.client.chat.completions.create(model=running.name, stream=True, **body))
                content = [c for chunk in chunks if chunk.choices[0].logprobs for c in chunk.choices[0].logprobs
                           .content]
                spec = chunks[-1].model_extra["fastgen"]
            else:
                reply = running.post("/v1/chat/completions", body | {"temperature": temperature})[1]
                content, spec = reply["choices"][0]["logprobs"]["content"], reply["fastgen"]
                content = [openai.types.chat.ChatCompletionTokenLogprob(**c) for c in content]
            r = finished.last()
            check_answer(reference, r.prompt_ids, r.tokens, [c.logprob for c in content],
                         [[t.logprob for t in c.top_logprobs] for c in content])
            assert (r.constraint is not None) == (form is not None)
            if temperature == 0 and (stream or drafter == "draft"):
                assert spec["tokens_per_target_forward"] > 1  # drafts were accepted
            if drafter == "ngram":  # the lookup drafts the next answers from this one (a library run's samples)
                running.scheduler.generator.speculator.drafter.lookup.finish(r.tokens)
    finally:
        running.stop()
