"""Structured output (grammar.py): JSON schemas and tool calls through the server's OpenAI API, the library and
generate.py, on a random model (whose answers would be garbage: the grammar alone makes them valid JSON), greedy and
sampled, with n-gram speculation and without; and constrained sampling checked by chi-square against the target's
distribution masked by the grammar and renormalised, which a broken way of cutting drafts fails."""
import contextlib
import json

import pytest
import torch

import draftmodel
import generation
import grammar
import speculate
from decode import Engine, Sampling, logits_to_probs
from errors import UserError
from helpers import FIRST, PREFIX, REJECT_BELOW, VOCAB, chi_square_pvalue, cli, tiny_tables, write_checkpoint
from test_serve import Running

pytestmark = pytest.mark.slow  # servers, compiled grammars and chi-square runs: the full suite runs them

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMAS = {  # nested objects, enums, arrays, numbers with ranges (strings bounded: a random model never ends one)
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                                   "y": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9}},
                  "required": ["x", "y"]},
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["point", "ok", "note"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 1, "maxItems": 4},
        "pairs": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 10, "maximum": 99},
                                                   {"const": "x"}], "items": False}},
        "required": ["tags", "pairs"]},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5},
                         {"type": "object", "properties": {"$defs_user": {"$ref": "#/$defs/id"}},
                          "required": ["$defs_user"]}],
               "$defs": {"id": {"type": "string", "pattern": "^[a-z]{2,4}$"}}},
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"]}}}]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_model):
    """A random target with a context that holds the tools' description in this tokenizer's few tokens."""
    return write_checkpoint(tmp_path_factory.mktemp("grammar_target"), tokenizer_model, seed=0, dim=64, n_layer=2,
                            n_head=4, n_local_heads=2, vocab_size=512, block_size=1024)


@pytest.fixture(scope="module")
def server(target):
    """Two rows, n-gram drafting: a request alone speculates; requests sent together, or with the speculator
    switched off (plain()), decode in the batch."""
    running = Running(target, "--max_batch_size", 2, "--draft_ngram", 3, "--speculate_k", 4)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def library(target):
    return generation.Generator.build(target)


class plain:
    """The server's speculator switched off while in the block: every request decodes in the batch."""

    def __init__(self, running):
        self.scheduler = running.scheduler

    def __enter__(self):
        s = self.scheduler
        self.saved = s.generator.speculator, s.drafter
        s.generator.speculator, s.drafter = None, None

    def __exit__(self, *exc):
        self.scheduler.generator.speculator, self.scheduler.drafter = self.saved


def ask(running, schema, **settings):
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return running.client.chat.completions.create(model=running.name, messages=MESSAGES, max_tokens=200,
                                                  response_format=form, **settings)


def library_answer(library, schema) -> list:
    ids = library.tokenizer.chat_ids(MESSAGES)
    return library.generate(ids, 200, Sampling(temperature=0), json_schema=schema)[0][0]


# ----------------------------------------------------------------------------- JSON schemas through the server

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_is_valid_json_ended_by_the_grammar(server, library, name):
    """Greedy and sampled, speculating alone and in the batch: each answer ends by the grammar (finish_reason stop)
    and validates; greedy answers are the library's constrained answer, token for token (through their text and
    count)."""
    schema = SCHEMAS[name]
    want = library_answer(library, schema)
    text = library.tokenizer.decode([t for t in want if t not in library.eos_ids])
    for speculating in (True, False):
        with (plain(server) if not speculating else contextlib.nullcontext()):
            # sampled: seeded requests never speculate (their draws stay reproducible); unseeded ones may
            replies = [ask(server, schema, temperature=0)] + [
                ask(server, schema, temperature=1.0, **({} if speculating else {"seed": seed})) for seed in range(3)]
        for reply in replies:
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)
        assert replies[0].choices[0].message.content == text
        assert replies[0].usage.completion_tokens == len(want)
        # which path: the lone request's loop (a two-token answer ends in the batch before it speculates), or the batch
        speculated = [("tokens_per_target_forward" in reply.model_extra["fastgen"]) for reply in replies]
        assert speculated[0] == speculating and (speculating or not any(speculated))


def test_json_object_and_concurrent_requests(server, library):
    """json_object: any JSON object; two constrained requests and a free one decode together, each as alone."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as pool:
        free = pool.submit(server.client.chat.completions.create, model=server.name, messages=MESSAGES,
                           max_tokens=20, temperature=0)
        person = pool.submit(ask, server, SCHEMAS["person"], temperature=0)
        anything = pool.submit(server.client.chat.completions.create, model=server.name, messages=MESSAGES,
                               max_tokens=200, temperature=0, response_format={"type": "json_object"})
    want = library_answer(library, SCHEMAS["person"])
    assert person.result().choices[0].message.content == library.tokenizer.decode(want[:-1])
    reply = anything.result().choices[0]
    assert reply.finish_reason == "length" or isinstance(json.loads(reply.message.content), dict)
    assert reply.message.content.startswith("{")
    ids = library.tokenizer.chat_ids(MESSAGES)
    plain_tokens = library.generate(ids, 20, Sampling(temperature=0))[0][0]
    assert free.result().usage.completion_tokens == len(plain_tokens)


def test_a_streamed_constrained_answer_is_the_whole_answer(server):
    schema = SCHEMAS["nested"]
    whole = ask(server, schema, temperature=0).choices[0].message.content
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    chunks = list(server.client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=200,
                                                        temperature=0, response_format=form, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- tool calls

def test_a_tool_call_round_trip(server):
    """tool_choice required: the answer is a call of one of the tools, its arguments valid for it, parsed into
    message.tool_calls (finish_reason tool_calls); the conversation goes on with the call and its result; a named
    tool is the one called; streamed, the call arrives as tool_calls."""
    client, parameters = server.client, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS,
                                               tool_choice="required", temperature=temperature, max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    reply = client.chat.completions.create(model=server.name, messages=follow, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    named = {"type": "function", "function": {"name": "add"}}
    reply = client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, max_tokens=200)
    assert reply.choices[0].message.tool_calls[0].function.name == "add"
    chunks = list(client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS,
                                                 tool_choice=named, temperature=0, max_tokens=200, stream=True))
    calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].choices[0].delta.tool_calls[0].function.name == "add"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for seed in range(3):  # auto: a call (valid), or text that does not start like one
        choice = client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS, seed=seed,
                                                temperature=1.0, max_tokens=200).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert not choice.message.content.startswith("{")


def test_a_tool_without_parameters_takes_no_arguments(server):
    """`parameters` absent or null (clients that serialize every field of a function): a call of it has no
    arguments, as OpenAI's functions without parameters."""
    for function in ({"name": "now"}, {"name": "now", "parameters": None}):
        status, reply = server.post("/v1/chat/completions", {
            "messages": MESSAGES, "tools": [{"type": "function", "function": function}], "tool_choice": "required",
            "temperature": 0, "max_tokens": 50})
        assert status == 200, reply
        call = reply["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "now" and json.loads(call["arguments"]) == {}


def test_tools_reach_the_chat_template_or_a_system_message(library):
    """A template that reads `tools` renders them itself; otherwise they are described in a system message, and
    earlier calls and results are written as text the template takes."""
    import serve
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    out, tools = serve.chat_messages(messages, TOOLS, library.tokenizer)  # the built-in Llama 2 template
    assert tools is None and out[0]["role"] == "system" and "weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert out[3] == {"role": "user", "content": "The function returned: 3"}
    library.tokenizer.chat_ids(out)  # the template takes it
    tokenizer = library.tokenizer.__class__.__new__(library.tokenizer.__class__)
    tokenizer.__dict__.update(library.tokenizer.__dict__, chat_template=(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}: "
        "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %};"
        "{% endfor %}"))
    tokenizer.__dict__.pop("uses_tools", None)
    assert tokenizer.uses_tools
    out, tools = serve.chat_messages(messages, TOOLS, tokenizer)
    assert out is messages and tools is TOOLS
    assert tokenizer.render_chat(out, tools=tools) == '[weather][add]user: hi;assistant: {"a": 1, "b": 2};tool: 3;'


# ----------------------------------------------------------------------------- bad input, dead ends

SCHEMA_FIELD = "response_format.json_schema.schema"


def nested(depth: int) -> dict:
    """A schema of `depth` levels of anyOf around a string."""
    schema = {"type": "string", "maxLength": 3}
    for _ in range(depth):
        schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


DEEPEST = ".anyOf[0]" * (grammar.MAX_DEPTH + 1)  # where a schema nested too deeply is refused
BAD = [  # (body fields, the field named)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, SCHEMA_FIELD + ".type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}},
     SCHEMA_FIELD + ".properties.n.multipleOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, SCHEMA_FIELD),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/none"}}}}, SCHEMA_FIELD),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, SCHEMA_FIELD),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"oneOf": [{}, {}]}}}]},
     "tools[0].function.parameters.oneOf"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    # an earlier call's arguments: JSON text of an object, which templates iterate (not a list, a number, bad JSON)
    *[({"tools": TOOLS, "messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]},
       f"messages[{len(MESSAGES)}].tool_calls[0].function.arguments") for arguments in ("[1, 2]", 7, "{'a': 1")],
    # nested past what the recursive passes over a schema can take (they were a 500)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": nested(300)}}}, SCHEMA_FIELD + DEEPEST),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]},
     "tools[0].function.parameters" + DEEPEST),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[param[:80] for _, param in BAD])
def test_bad_schemas_and_tools_are_a_400_naming_the_field(server, fields, param):
    before = server.scheduler.metrics.prompt_tokens
    status, reply = server.post("/v1/chat/completions", {"messages": MESSAGES, **fields})
    assert status == 400 and reply["error"]["param"] == param, reply
    assert param.split("[")[0].split(".")[0] in reply["error"]["message"]
    assert server.scheduler.metrics.prompt_tokens == before  # refused before it was queued


def test_schemas_nest_up_to_max_depth_and_annotations_are_values(server):
    """A schema nested MAX_DEPTH deep is enforced; an annotation's value is not a schema, however deep (it was walked
    as one, which ran out of stack), and a property named like a keyword is a schema (its length bound kept)."""
    grammar.check_schema(nested(grammar.MAX_DEPTH), "s")
    noted = {"type": "object", "x-note": json.loads("[" * 500 + "]" * 500),
             "properties": {"enum": {"type": "string", "maxLength": 3}}, "required": ["enum"]}
    assert grammar.length_patterns(noted)["properties"]["enum"]["pattern"].endswith("{0,3}$")
    for schema in (nested(grammar.MAX_DEPTH), noted):
        form = {"type": "json_schema", "json_schema": {"schema": schema}}
        status, reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40,
                                                             "response_format": form})
        assert status == 200, reply
        if reply["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)


DEAD_END = {"type": "string", "pattern": "^a[^\\s\\S]$"}  # after "a", no character can follow


def test_a_grammar_that_dead_ends_stops_with_a_note(server, library):
    for speculating in (True, False):
        with (plain(server) if not speculating else contextlib.nullcontext()):
            reply = ask(server, DEAD_END, temperature=0)
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == '"a'
        assert "dead end" in reply.model_extra["fastgen"]["note"]
    rows, stats = library.generate(library.tokenizer.chat_ids(MESSAGES), 20, Sampling(temperature=0),
                                   json_schema=DEAD_END)
    assert library.tokenizer.decode(rows[0]) == '"a' and "dead end" in stats["grammar_notes"][0]


# ----------------------------------------------------------------------------- generate.py and the library

def test_generate_json_schema_equals_the_servers_greedy_answer(server, target, tmp_path):
    schema = SCHEMAS["array"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "Hello, my name is"
    stats = cli.main(["--checkpoint_path", str(target), "--prompt", prompt, "--max_new_tokens", "200",
                      "--num_samples", "1", "--temperature", "0", "--json_schema", str(path)])
    reply = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=200, temperature=0,
                                             extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                                 "schema": schema}}})
    assert reply.choices[0].text == stats["samples"][0]["text"].removesuffix("</s>")
    assert reply.usage.completion_tokens == len(stats["samples"][0]["tokens"])
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "integer", "multipleOf": 2}))
    with pytest.raises(UserError, match=r"--json_schema .*bad.json: `\$.multipleOf`: .*not supported"):
        cli.main(["--checkpoint_path", str(target), "--json_schema", str(bad)])


def test_the_servers_draw_masks_before_top_k(server, monkeypatch):
    """A constrained row's token (Scheduler.pick) is drawn from its logits masked by the grammar, then warped: with
    top-k, the k most likely allowed tokens, not the allowed ones among the k most likely of all (a chi-square test
    against both; the tokens the grammar forbids hold the largest logits)."""
    import serve
    scheduler, vocab = server.scheduler, server.scheduler.model.args.vocab_size
    constraint = grammar.Constraint(scheduler.grammars.json_schema({"type": "integer", "minimum": 0}), vocab)
    allowed = grammar.unpack(constraint.allowed()[0], vocab)
    assert int(allowed.sum()) >= 10  # digits and runs of them
    logits = torch.rand(vocab, generator=torch.Generator().manual_seed(0)) + allowed  # allowed ones in [1, 2)
    logits[(~allowed).nonzero()[:3, 0]] = 3.0  # three forbidden tokens above every allowed one
    sampling = Sampling(1.0, top_k=6)
    drawn = []
    monkeypatch.setattr(scheduler, "accept", lambda r, token, scores=None: drawn.append(token))
    r = serve.Request([1], 8, sampling, seed=0, constraint=constraint)
    for _ in range(3000):
        scheduler.pick([r], logits[None])
        constraint.matcher.rollback(1)
    counts = torch.bincount(torch.tensor(drawn), minlength=vocab)
    right = logits_to_probs(logits.masked_fill(~allowed, -float("inf")), sampling).double()
    wrong = logits_to_probs(logits, sampling).double() * allowed
    assert chi_square_pvalue(counts, right) > REJECT_BELOW
    assert chi_square_pvalue(counts, wrong / wrong.sum()) < REJECT_BELOW


def test_the_library_constrains_batches_and_speculation_alike(target, library):
    """Prompts of different lengths in one batch, and with n-gram speculation (trees; the server's test speculates
    in chains): each greedy answer is the library's plain constrained answer for its prompt alone."""
    schema = SCHEMAS["nested"]
    prompts = [library.encode(p) for p in ("Hello, my name is", "def main(", "usage: prog [-h] " * 3)]
    alone = [library.generate(ids, 120, Sampling(temperature=0), json_schema=schema)[0][0] for ids in prompts]
    assert library.generate(prompts, 120, Sampling(temperature=0), json_schema=schema)[0] == alone
    speculating = generation.Generator.build(target, speculation=generation.Speculation(4, 8, 3))
    rows, stats = speculating.generate(prompts, 120, Sampling(temperature=0), json_schema=schema)
    assert rows == alone and stats["target_forwards"] <= max(map(len, alone)) + 1
    for row in rows:
        jsonschema.validate(json.loads(library.tokenizer.decode(row[:-1])), schema)


def test_a_grammar_never_allows_part_of_a_character(library):
    """Inside a JSON string any character may come, but never a token holding part of one (a byte-fallback <0xNN>
    of a byte >= 0x80): the grammar's text is always whole UTF-8 (grammar.whole_utf8)."""
    pieces = library.tokenizer.token_bytes()
    partial = [i for i, b in enumerate(pieces) if b and not grammar.whole_utf8(b)]
    assert partial  # the test tokenizer has byte-fallback tokens
    constraint = grammar.Constraint(library.grammars.json_schema({"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]}), library.model.args.vocab_size)
    for ch in '{"a": "':
        token = next(i for i, b in enumerate(pieces) if b == ch.encode())
        assert constraint.accept(token)
    allowed = grammar.unpack(constraint.allowed(), library.model.args.vocab_size)[0]
    assert allowed[[i for i, b in enumerate(pieces) if b in (b"x", b" ")]].all()  # a string takes text
    assert not allowed[partial].any()


def test_a_schema_file_that_cannot_be_read_is_one_line(target, tmp_path):
    for name, text, why in (("missing.json", None, "cannot read it"), ("bad.json", "{nope", "is not JSON"),
                            ("long.json", '{"maximum": ' + "9" * 5000 + "}", "is not JSON"),
                            ("deep.json", "[" * 10**5, "is not JSON")):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(UserError, match=f"--json_schema {path}.* {why}"):
            cli.main(["--checkpoint_path", str(target), "--json_schema", str(path)])


# ----------------------------------------------------------------------------- exactness: chi-square

class TinyVocabulary:
    """The token_bytes() of VOCAB tokens for the chi-square tables: digits, letters a-p, punctuation, an EOS."""
    PIECES = [str(d).encode() for d in range(10)] + [bytes([c]) for c in b"abcdefghijklmnop"] + \
        [b"{", b"}", b'"', b",", b" "]
    EOS = VOCAB - 1

    def token_bytes(self):
        return self.PIECES + [None]


# after FIRST ("7"): a letter a-f or a digit 0-4, then a letter a-h or a digit 5-9, then anything of a-p
EBNF = 'root ::= [0-9] ([a-f] | [0-4]) ([a-h] | [5-9]) [a-p]*'


def tiny_constraints(rows: int) -> list:
    grammars = grammar.Grammars(TinyVocabulary(), VOCAB, [TinyVocabulary.EOS])
    compiled = grammars.compiler.compile_grammar(grammars.xgr.Grammar.from_ebnf(EBNF))
    constraints = [grammar.Constraint(compiled, VOCAB) for _ in range(rows)]
    for c in constraints:
        assert c.accept(FIRST)
    return constraints


def masked_target(sampling: Sampling):
    """p(x1) and p(x1, x2) after PREFIX + [FIRST], each step's logits masked by the grammar, by enumeration."""
    target, _ = tiny_tables()
    context, c = tuple(PREFIX + [FIRST]), tiny_constraints(1)[0]

    def probs(logits):
        logits = logits.clone().float()
        c.mask(logits)
        return logits_to_probs(logits, sampling).double()
    p1 = probs(target.logits(context))
    p2 = torch.zeros(VOCAB, VOCAB, dtype=torch.double)
    for a in range(VOCAB):
        if p1[a] > 0:
            assert c.accept(a)
            p2[a] = probs(target.logits(context + (a,)))
            c.matcher.rollback(1)
    return p1, p1[:, None] * p2


def constrained_draws(speculator, sampling: Sampling, draws: int, rows: int = 250):
    """The two tokens after PREFIX + [FIRST] under the grammar (which has read FIRST), `draws` times, `rows` at a
    time, through the library's constrained generation (speculator None: one masked token per target forward)."""
    target, _ = tiny_tables()
    target.args = target.model.args  # generate() sizes its caches by the model's shape
    target.setup_caches(rows, len(PREFIX) + 4 + (speculator.lookahead if speculator else 0) + 2)
    prompts = [list(PREFIX) + [FIRST]] * rows
    torch.manual_seed(0)
    out = []
    for _ in range(draws // rows):
        got, _ = generation.generate(Engine(target), prompts, 2, sampling, [TinyVocabulary.EOS], True,
                                     speculator=speculator, constraints=tiny_constraints(rows))
        out += [row[:2] for row in got]
    return torch.tensor(out)


def pvalues_of(drawn, sampling):
    p1, joint = masked_target(sampling)
    first, second = drawn[:, 0], drawn[:, 1]
    return {"first": chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p1),
            "second": chi_square_pvalue(torch.bincount(second, minlength=VOCAB), joint.sum(0)),
            "pair": chi_square_pvalue(torch.bincount(first * VOCAB + second, minlength=VOCAB ** 2), joint.flatten())}


T1 = Sampling(temperature=1.0)


def test_constrained_sampling_is_the_masked_renormalised_distribution():
    """One masked token per target forward: each token drawn from the target's distribution over the tokens the
    grammar allows, renormalised (the grammar forbids most of the vocabulary at both places)."""
    pvalues = pvalues_of(constrained_draws(None, T1, 4000), T1)
    assert min(pvalues.values()) > REJECT_BELOW, pvalues


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_speculative_constrained_sampling_is_exact_and_cutting_drafts_alone_is_not(monkeypatch, broken):
    """A sampled draft model's trees (4 nodes, depth 2) with the drafts the grammar forbids cut: the output is the
    masked, renormalised target distribution. Cutting them but keeping each kept draft's proposal as the draft drew
    it (not renormalised over the allowed tokens) skews it, and the test sees it."""
    if broken:
        monkeypatch.setattr(grammar, "mask_proposal", lambda q, allowed: q)
    _, draft = tiny_tables()
    speculator = speculate.Speculator(draftmodel.ModelDrafter(Engine(draft), 2, 4))
    pvalues = pvalues_of(constrained_draws(speculator, T1, 8000), T1)
    assert (min(pvalues.values()) < REJECT_BELOW) == broken, pvalues
