"""serve.py under load: N closed-loop clients (each sends its next streaming request as soon as the last one ends)
against a server on a loopback port, at --max_batch_size B = 1, 4, 8: aggregate tokens/s, p50 / p95 time to first
token and time per output token; beside the same figures of another OpenAI-compatible server (llama.cpp's
llama-server) on the same weights, where one is given.

    python scripts/bench_serve.py --checkpoint_path checkpoints/tiny/target/model.pth --seconds 20 --json out.json

Each B starts its own server (python serve.py, same flags), waits for GET /health, then runs --clients clients
(default 2 B; B with a peer) for --seconds per workload. Tokens/s counts the completion tokens of the requests that
finished inside the window (their usage), over the window; answer tokens/s: each such answer's tokens over its time
from request sent to its last chunk (mean). Time to first token: request sent -> first text chunk; time per output
token (TPOT): per request, first text chunk -> last over the chunks after the first (a chunk carries one token's
text, or several where held-back text is released at once). Workloads (--workloads): plain (short prompts to
/v1/completions), shared (chat requests of one long common system prompt, --system_tokens, and a short distinct
question) and chat (each client holds chats of --turns turns, each request the conversation so far; its last turns'
TTFT is reported apart).

    python scripts/bench_serve.py --checkpoint_path M/model.pth --llama_cpp DIR --gguf M.F32.gguf \\
        --workloads plain,shared,chat --json out.json -- --compile

A peer: --llama_cpp DIR (a llama.cpp source tree with build/bin/llama-server) on --gguf (the same weights at the same
bits), or any OpenAI-compatible server's command line, --peer_command, whose {port}, {batch}, {context},
{total_context} and {threads} are filled in. Per B, ours (--max_seq_length --context, OMP_NUM_THREADS=--threads)
and the peer (llama-server -np B -c B x --context -t/-tb --threads --cont-batching) are started side by side and
take turns workload by workload (who goes first alternates); rows for ours, the peer and their ratio. With
--draft_checkpoint_path, every B runs twice, plain and speculative (the peer with --peer_draft_flags; with
--llama_cpp and --draft_gguf: -md DRAFT --spec-draft-n-max --speculate_k).

    python scripts/bench_serve.py --checkpoint_path M/model.pth --versus_generate --batch_sizes 8 -- --compile

--versus_generate: a lone client against generate.py on the same checkpoint, prompt, max_tokens and --compile /
--device / --precision (pass no drafter flags: plain decoding on both sides). generate.py's tokens/s (its
--stats_json, the mean over its samples after the first) beside, per B, one client's answers one after another for --seconds: tokens per
second of each answer from request sent to its last chunk (mean; the first answer left out as a warm-up), the
server's own decode rate after the first token (its `fastgen.tokens_per_second`), and the ratios to generate.py's.

    python scripts/bench_serve.py --checkpoint_path M/model.pth --chat_turns 10 --batch_sizes 8 -- --compile

--chat_turns N: one client holds a chat of N turns (greedy, streaming), each turn's messages the whole conversation
so far and a new user message, sized so that the last turn's prompt holds about --chat_history tokens; once on a
server with the prefix cache and once on one started with --no_prefix_cache. Reported per B: the last turn's
prompt and cached tokens, its time to first token (request sent -> first text) both ways and their ratio, and
whether every answer was the same both ways.
"""
import contextlib
import argparse
import http.client
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from errors import run_cli, write_atomically  # noqa: E402

PROMPTS = ["Write a short story about a robot learning to paint.", "def fibonacci(n):",
           "Explain how a key-value cache speeds up decoding.", "The three most important ideas in physics are",
           "Translate to French: the weather is nice today.", "List five uses of a paperclip:"]
# copy-heavy prompts: their continuations repeat what the prompt already holds (what n-gram lookups draft well)
COPY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\ndef multiply(a, b):\n",
    "Fruits: apple, banana, cherry, date, elderberry, fig, grape.\nThe same fruits again: apple, banana,",
    '{"name": "Alice", "age": 30, "city": "Paris"}\n{"name": "Bob", "age": 25, "city": "Paris"}\n{"name": "Carol",',
    "1. Open the file.\n2. Read the header.\n3. Check the header.\n4. Read the rows.\n5. Check the rows.\n6.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "SELECT id, name FROM users WHERE age > 30;\nSELECT id, name FROM users WHERE age > 40;\nSELECT id, name FROM",
]
# --versus_generate's one prompt: a story's opening, which models continue at length (an instruction as a raw
# completion may end at its first token, and an answer with no text has nothing to time)
LONE_PROMPT = "Once upon a time, in a small village by the sea,"
MAX_CLIENTS, MAX_SECONDS = 64, 600
WORKLOADS = ("plain", "shared", "chat", "copy")
# serve.py's drafter flags (each with its value): --versus_plain takes them out for the plain server
DRAFTER_FLAGS = ("--draft_checkpoint_path", "--draft_head", "--speculate_k", "--tree_nodes", "--draft_ngram")
# the chat and shared workloads' texts are drawn from these words (a fixed text: every run sends the same messages)
FILLER = ("the parser reads each option and its value then checks the value against the type the option declares "
          "and stores it in a namespace that the program later reads to decide what to do next while the help text "
          "lists every option with a short line about what it changes").split()
TOKENS_PER_WORD = 1.3  # English text, about: the usage of a request tells the real count


def free_port() -> int:
    """A loopback port free now and outside the kernel's ephemeral range: a port the kernel handed out (bind to 0)
    could be handed again, to a connection or to gloo's sockets, before the server that is given it binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.Random().sample(range(20000, low), min(64, low - 20000)) if low > 21000 else []
    for port in candidates + [0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError("no free loopback port")


def wait_ready(port: int, processes: list, timeout: float, log=None, name: str = "serve.py"):
    """Until /health answers 200 (the server on `port`, started as `processes`: one, or one per rank); if any of
    them exits first, the server's own `error:` line (else its last line; its output, a binary file, in `log`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for i, process in enumerate(processes):
            if process.poll() is None:
                continue
            said = []
            if log is not None:
                log.seek(0)
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
                said = [line[len("error: "):] for line in lines if line.startswith("error: ")] or lines[-1:]
            which = f" (process {i + 1} of {len(processes)})" if len(processes) > 1 else ""
            raise SystemExit(f"error: {name}{which} exited with status {process.returncode} before it was ready"
                             + (f" ({said[-1]})" if said else ""))
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: {name} was not ready after {timeout:.0f} s")


def stream(port: int, path: str, body: dict, timeout: float):
    """POST a greedy streaming request with usage: (connection, response, send time)."""
    body = dict(body, temperature=0, stream=True, stream_options={"include_usage": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.perf_counter()
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection, connection.getresponse(), sent


def chunks(response):
    """The JSON chunks of a server-sent event stream, up to [DONE]."""
    for line in response:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def request(port: int, path: str, body: dict) -> dict:
    """One greedy streaming completion or chat completion: its send time, the arrival times of its text chunks, its
    text, usage (and completion tokens: the usage's, else one a chunk), end time and `fastgen` figures."""
    connection, response, sent = stream(port, path, body, 600)
    if response.status != 200:
        said = json.loads(response.read() or b"{}").get("error", {})
        raise SystemExit(f"error: the server refused a request with {response.status}: "
                         f"{said.get('message', said) if isinstance(said, dict) else said} (a prompt too long for "
                         f"its context? lower --chat_history, --system_tokens or --max_tokens)")
    arrivals, text, usage, figures = [], "", None, {}
    for chunk in chunks(response):
        if "error" in chunk:
            raise SystemExit(f"error: the server answered a request with: {chunk['error'].get('message')}")
        figures = chunk.get("fastgen") or figures
        usage = chunk.get("usage") or usage
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
        if piece:  # a chat's first chunk (the role, no text) is sent before any token
            arrivals.append(time.perf_counter())
            text += piece
    connection.close()
    return {"sent": sent, "arrivals": arrivals, "text": text, "usage": usage, "ended": time.perf_counter(),
            "tokens": usage["completion_tokens"] if usage else len(arrivals), "fastgen": figures}


def filler(words: int, start: int) -> str:
    return " ".join(FILLER[(start + i) % len(FILLER)] for i in range(words))


def plain_workload(max_tokens: int, prompts: list = PROMPTS):
    """Client i's n-th request: the next of `prompts` to /v1/completions (the copy workload: COPY_PROMPTS)."""
    def run(port: int, i: int, n: int, state: dict) -> dict:
        prompt = prompts[(i + n) % len(prompts)]
        return dict(request(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}), prompt=prompt)
    return run


def shared_workload(system_tokens: int, max_tokens: int):
    """Every request one long system prompt (about `system_tokens` tokens), common to all, and a distinct question."""
    system = "You answer questions about a program. Its manual: " + filler(round(system_tokens / TOKENS_PER_WORD), 0)

    def run(port: int, i: int, n: int, state: dict) -> dict:
        question = f"Question {n + 1} of client {i + 1}: {PROMPTS[(i + n) % len(PROMPTS)]}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return request(port, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})
    return run


def chat_workload(turns: int, history: int, max_tokens: int):
    """Each client holds chats of `turns` turns, one after another, each turn's request the conversation so far and
    a new user message sized so that the last prompt holds about `history` tokens. Each result has its `turn`."""
    # a turn adds its user message, its answer and the template around them (about 20 tokens with the question)
    words = max(1, round((history / turns - max_tokens - 20) / TOKENS_PER_WORD))

    def run(port: int, i: int, n: int, state: dict) -> dict:
        turn = n % turns
        if turn == 0:
            state["messages"] = []
        chat = f"Chat {n // turns + 1} of client {i + 1}. " if i or n >= turns else ""
        text = filler(words, turn * 11)
        state["messages"].append({"role": "user", "content": f"{chat}Part {turn + 1}: {text}. What does it say?"})
        result = request(port, "/v1/chat/completions", {"messages": state["messages"], "max_tokens": max_tokens})
        state["messages"].append({"role": "assistant", "content": result["text"]})
        return dict(result, turn=turn + 1)
    return run


def percentile(values: list, q: int):
    """The q-th percentile (linear between the nearest ranks, as numpy's default); None of nothing."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latencies(results: list) -> tuple:
    """Times to first token and times per output token (seconds) of these requests' chunk arrivals: a request's
    TPOT is its first chunk -> last chunk over the chunks after the first (a server that hands several chunks over
    at once has near-zero gaps between chunks and longer ones between hand-overs: their mean is its pace)."""
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (len(r["arrivals"]) - 1) for r in results
            if len(r["arrivals"]) > 1]
    return ttft, tpot


def summarize(done: list, seconds: float, stop_at: float) -> dict:
    """Aggregate tokens/s of the requests that ended by `stop_at` over `seconds`, their mean answer tokens/s (sent
    -> last chunk) and completion tokens (an answer may end at the model's end of text), and latency percentiles
    of every request; for a chat, its last turns' TTFT apart."""
    inside = [r for r in done if r["ended"] <= stop_at]
    ttft, tpot = latencies(done)
    rates = [r["tokens"] / (r["ended"] - r["sent"]) for r in inside if r["tokens"]]
    last = max((r.get("turn", 0) for r in done), default=0)
    row = {"requests": len(done), "tokens_per_sec": sum(r["tokens"] for r in inside) / seconds,
           "answer_tokens_per_sec": statistics.mean(rates) if rates else None,
           "tokens_per_answer": statistics.mean(r["tokens"] for r in inside) if inside else None,
           "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
           "tpot_p50": percentile(tpot, 50), "tpot_p95": percentile(tpot, 95)}
    if last:
        row["last_turn"] = last
        row["last_turn_ttft_p50"] = percentile(latencies([r for r in done if r.get("turn") == last])[0], 50)
    return row


def load(port: int, clients: int, seconds: float, workload) -> dict:
    """Closed-loop clients running `workload` for `seconds`: summarize()'s figures; `answers`, the figures of each
    request that ended inside the window."""
    done, lock, failed = [], threading.Lock(), []
    start = time.perf_counter()
    stop_at = start + seconds

    def client(i: int):
        n, state = 0, {}
        try:
            while time.perf_counter() < stop_at and not failed:
                result = workload(port, i, n, state)
                n += 1
                with lock:
                    done.append(result)
        except BaseException as e:  # re-raised by the main thread: one line, not a thread's traceback
            failed.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return dict(summarize(done, seconds, stop_at), clients=clients, answers=[r for r in done if r["ended"] <= stop_at])


@contextlib.contextmanager
def launched(argv: list, port: int, name: str, env: dict = None):
    """A server started by this command line (to listen on `port`); yields a function that waits until GET /health
    says ready and returns the port (several servers start at once, then are waited for); stopped after."""
    log = tempfile.TemporaryFile()  # its output: its own line, if it stops before it is ready
    try:
        process = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, env=env)
    except OSError as e:
        log.close()
        raise SystemExit(f"error: could not start {name}: {e}")
    try:
        yield lambda: wait_ready(port, [process], 600, log, name) or port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def our_server(checkpoint: Path, batch: int, flags: list, threads: int = None):
    """launched(): serve.py at --max_batch_size `batch` with these flags on a free loopback port."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    return launched([sys.executable, ROOT / "serve.py", "--checkpoint_path", checkpoint, "--port", port, "--host",
                     "127.0.0.1", "--max_batch_size", batch, "--max_queue", MAX_CLIENTS, *flags], port, "serve.py",
                    env)


@contextlib.contextmanager
def serving(checkpoint: Path, batch: int, flags: list, threads: int = None):
    """serve.py (our_server()) once ready: yields the port."""
    with our_server(checkpoint, batch, flags, threads) as ready:
        yield ready()


def literal(text) -> str:
    """A path inside a command template, its braces kept as they are."""
    return str(text).replace("{", "{{").replace("}", "}}")


def llama_server(llama_cpp: Path, gguf, draft_gguf, speculate_k: str) -> tuple:
    """llama-server's command template on `gguf` and its drafter flags: (template, draft flags)."""
    server = llama_cpp.expanduser() / "build/bin/llama-server"
    if not server.is_file():
        raise SystemExit(f"error: --llama_cpp {llama_cpp} has no build/bin/llama-server: give a llama.cpp source "
                         f"tree built with `cmake -B build && cmake --build build --target llama-server`")
    if gguf is None:
        raise SystemExit("error: --llama_cpp needs --gguf: the same weights at the same bits as --checkpoint_path")
    for flag, path in (("--gguf", gguf), ("--draft_gguf", draft_gguf)):
        if path is not None and not path.is_file():
            raise SystemExit(f"error: {flag} {path}: no such file")
    template = [literal(server), "-m", literal(gguf), "--host", "127.0.0.1", "--port", "{port}", "-np", "{batch}",
                "-c", "{total_context}", "-t", "{threads}", "-tb", "{threads}", "--cont-batching"]
    draft = ["-md", literal(draft_gguf), "--spec-draft-n-max", speculate_k] if draft_gguf is not None else []
    return template, draft


def peer_argv(template: list, batch: int, context: int, threads: int, port: int) -> list:
    """The peer's command line: the template's {port}, {batch}, {context}, {total_context}, {threads} filled in."""
    values = dict(port=port, batch=batch, context=context, total_context=batch * context, threads=threads)
    try:
        return [arg.format(**values) for arg in template]
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"error: --peer_command / --peer_draft_flags: cannot fill in {e} (the fields are "
                         f"{', '.join('{' + k + '}' for k in values)}; a literal brace is written twice)")


def versus(args, extra: list, peer) -> list:
    """Per B and mode (plain; speculative with a drafter), per workload: ours' figures beside the peer's, the two
    servers up side by side and taking turns, workload by workload (who goes first alternates)."""
    workloads = {"plain": plain_workload(args.max_tokens), "copy": plain_workload(args.max_tokens, COPY_PROMPTS),
                 "shared": shared_workload(args.system_tokens, args.max_tokens),
                 "chat": chat_workload(args.turns, args.chat_history, args.max_tokens)}
    modes = ["plain"] + (["speculative"] if args.draft_checkpoint_path else [])
    rows, turn = [], 0
    for batch in args.batch_sizes:
        clients = args.clients or (batch if peer else 2 * batch)
        for mode in modes:
            flags = ["--max_seq_length", str(args.context), *extra]
            template = peer["command"] if peer else None
            if mode == "speculative":
                flags += ["--draft_checkpoint_path", str(args.draft_checkpoint_path), "--speculate_k", args.speculate_k]
                template = template and template + peer["draft"]
            with contextlib.ExitStack() as stack:
                ready = {"ours": stack.enter_context(our_server(args.checkpoint_path, batch, flags, args.threads))}
                if peer:
                    port = free_port()
                    ready["peer"] = stack.enter_context(launched(
                        peer_argv(template, batch, args.context, args.threads, port), port, peer["name"]))
                ports = {side: wait() for side, wait in ready.items()}
                for name in args.workloads:
                    order = list(ports) if turn % 2 == 0 else list(ports)[::-1]
                    turn += 1
                    figures = {}
                    for side in order:
                        workloads[name](ports[side], clients, 0, {})  # warm-up: one request, apart from the clients
                        figures[side] = load(ports[side], clients, args.seconds, workloads[name])
                        del figures[side]["answers"]
                    rows.append(side_by_side(batch, mode, name, clients, figures))
    return rows


def side_by_side(batch: int, mode: str, workload: str, clients: int, figures: dict) -> dict:
    """One row: ours' figures, the peer's, and `x`: ours / peer for tokens/s, peer / ours for latencies (> 1: ours
    is ahead either way)."""
    row = {"batch_size": batch, "mode": mode, "workload": workload, "clients": clients, **figures}
    if "peer" in figures:
        ours, peer = figures["ours"], figures["peer"]
        ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
        row["x"] = {key: ratio(ours.get(key), peer.get(key)) if "tokens" in key else ratio(peer.get(key), ours.get(key))
                    for key in ("tokens_per_sec", "answer_tokens_per_sec", "ttft_p50", "ttft_p95", "tpot_p50",
                                "tpot_p95", "last_turn_ttft_p50")}
    return row


def show(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def table(header: list, lines: list, note: str = ""):
    """Rows of cells, right-aligned under their header (the first column left-aligned)."""
    cells = [header] + lines
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              + (f"   ({note})" if j == 0 and note else ""))


def write_result(path, result: dict):
    if path:
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


def report_versus(args, extra: list, peer, rows: list):
    lines = []
    for r in rows:
        for side in [s for s in ("ours", "peer", "x") if s in r]:
            f, x = r[side], side == "x"
            speed = (lambda v: show(v, ".2f")) if x else (lambda v: show(v, ".1f"))  # noqa: E731
            latency = (lambda v: show(v, ".2f")) if x else (lambda v: show(v, ".1f", 1000))  # noqa: E731
            lines.append([str(r["batch_size"]), r["mode"], r["workload"], peer["name"] if side == "peer" else side,
                          "" if x else str(r["clients"]), "" if x else str(f["requests"]),
                          "" if x else show(f["tokens_per_answer"], ".1f"), speed(f["tokens_per_sec"]),
                          speed(f["answer_tokens_per_sec"]), *[latency(f[k]) for k in ("ttft_p50", "ttft_p95",
                                                                                       "tpot_p50", "tpot_p95")],
                          latency(f.get("last_turn_ttft_p50"))])
    table(["B", "mode", "workload", "server", "clients", "requests", "tok/answer", "tokens/s", "answer tok/s", "TTFT p50",
           "TTFT p95", "TPOT p50", "TPOT p95", "last turn TTFT"], lines,
          "latencies in ms" + ("; x: ours / peer for tokens/s, peer / ours for latencies: > 1, ours ahead"
                               if peer else ""))
    write_result(args.json, {
        "checkpoint": str(args.checkpoint_path), "seconds": args.seconds, "max_tokens": args.max_tokens,
        "context": args.context, "threads": args.threads, "workloads": args.workloads, "turns": args.turns,
        "chat_history": args.chat_history, "system_tokens": args.system_tokens, "server_flags": extra,
        "draft_checkpoint_path": str(args.draft_checkpoint_path) if args.draft_checkpoint_path else None,
        "peer": peer, "rows": rows})


def first_token(result: dict) -> float:
    return (result["arrivals"][0] if result["arrivals"] else result["ended"]) - result["sent"]


def chat_turns(args, extra: list) -> list:
    """Per B, one client's chat on a server with the prefix cache and on one without: the last turn's figures, both
    ways."""
    rows = []
    for batch in args.batch_sizes:
        runs = {}
        for name, flags in (("cached", extra), ("cold", extra + ["--no_prefix_cache"])):
            with serving(args.checkpoint_path, batch, flags, args.threads) as port:
                turn, state = chat_workload(args.chat_turns, args.chat_history, args.max_tokens), {}
                runs[name] = [turn(port, 0, n, state) for n in range(args.chat_turns)]
        cached, cold = runs["cached"][-1], runs["cold"][-1]
        rows.append({"batch_size": batch, "turns": args.chat_turns,
                     "last_prompt_tokens": cached["usage"]["prompt_tokens"],
                     "last_cached_tokens": cached["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "ttft_cached": first_token(cached), "ttft_cold": first_token(cold),
                     "speedup": first_token(cold) / first_token(cached),
                     "server_ttft_cached": cached["fastgen"].get("time_to_first_token"),
                     "server_ttft_cold": cold["fastgen"].get("time_to_first_token"),
                     "identical": [r["text"] for r in runs["cached"]] == [r["text"] for r in runs["cold"]]})
    return rows


def report_chat(args, extra: list, rows: list):
    table(["B", "turns", "last prompt", "cached", "TTFT cached", "TTFT cold", "ratio", "answers"],
          [[str(r["batch_size"]), str(r["turns"]), str(r["last_prompt_tokens"]), str(r["last_cached_tokens"]),
            show(r["ttft_cached"], ".1f", 1000), show(r["ttft_cold"], ".1f", 1000), show(r["speedup"], ".2f"),
            "identical" if r["identical"] else "DIFFERENT"] for r in rows],
          "last turn; TTFT in ms, request sent -> first text")
    write_result(args.json, {"checkpoint": str(args.checkpoint_path), "chat_turns": args.chat_turns,
                             "chat_history": args.chat_history, "max_tokens": args.max_tokens,
                             "server_flags": extra, "rows": rows})


def generate_flags(server_flags: list) -> list:
    """The serve.py flags generate.py shares (--compile [MODE], --device, --precision), as generate.py takes them."""
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--compile", nargs="?", const="auto", default=None)
    shared.add_argument("--device", default=None)
    shared.add_argument("--precision", default=None)
    known, _ = shared.parse_known_args(server_flags)
    return [f for name in ("compile", "device", "precision") if getattr(known, name) is not None
            for f in (f"--{name}", getattr(known, name))]


def generate_tokens_per_sec(checkpoint: Path, prompt: str, max_tokens: int, flags: list, samples: int = 6) -> float:
    """generate.py's plain greedy tokens/s for `prompt`: the mean over the samples of its --stats_json after the
    first (an eager run's first pays one-time costs; a compiling run's warm-up sample is not among them)."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        done = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(checkpoint),
                               "--prompt", prompt, "--max_new_tokens", str(max_tokens), "--num_samples", str(samples),
                               "--temperature", "0", "--stats_json", str(stats), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0 or not stats.is_file():
            said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
            raise SystemExit(f"error: generate.py exited with status {done.returncode}"
                             + (f" ({said[-1][len('error: '):]})" if said else ""))
        return statistics.mean(sample["tokens_per_sec"] for sample in json.loads(stats.read_text())["samples"][1:])


def lone_client(answers: list, plain: float) -> dict:
    """One client's answers (the first left out as a warm-up where there are more) against generate.py's tokens/s."""
    counted = [a for a in (answers[1:] if len(answers) > 1 else answers) if a["tokens"] and a["arrivals"]]
    if not counted:
        raise SystemExit("error: no answer finished inside --seconds: raise it")
    answer = statistics.mean(a["tokens"] / (a["ended"] - a["sent"]) for a in counted)
    rates = [a["fastgen"]["tokens_per_second"] for a in counted if a["fastgen"].get("tokens_per_second")]
    decode = statistics.mean(rates) if rates else None
    return {"answers": len(counted), "answer_tokens_per_sec": answer, "decode_tokens_per_sec": decode,
            "generate_tokens_per_sec": plain, "ratio": answer / plain,
            "decode_ratio": decode / plain if decode is not None else None}


def report_versus_generate(args, extra: list, plain: float, rows: list):
    print(f"generate.py plain: {plain:.1f} tokens/s ({LONE_PROMPT!r}, {args.max_tokens} new tokens, flags "
          f"{' '.join(generate_flags(extra)) or 'none'})")
    table(["B", "answers", "answer tok/s", "ratio", "decode tok/s", "ratio"],
          [[str(r["batch_size"]), str(r["answers"]), show(r["answer_tokens_per_sec"], ".1f"), show(r["ratio"], ".3f"),
            show(r["decode_tokens_per_sec"], ".1f"), show(r["decode_ratio"], ".3f")] for r in rows],
          "one client; ratio: to generate.py's")
    write_result(args.json, {"checkpoint": str(args.checkpoint_path), "seconds": args.seconds,
                             "max_tokens": args.max_tokens, "prompt": LONE_PROMPT, "server_flags": extra,
                             "generate_flags": generate_flags(extra), "generate_tokens_per_sec": plain, "rows": rows})


def versus_generate(args, extra: list):
    plain = generate_tokens_per_sec(args.checkpoint_path, LONE_PROMPT, args.max_tokens, generate_flags(extra))
    rows = []
    for batch in args.batch_sizes:
        with serving(args.checkpoint_path, batch, extra, args.threads) as port:
            answers = load(port, 1, args.seconds, plain_workload(args.max_tokens, [LONE_PROMPT]))["answers"]
            rows.append(dict(lone_client(answers, plain), batch_size=batch))
    report_versus_generate(args, extra, plain, rows)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"))
    p.add_argument("--batch_sizes", default=None, help="default 1,4,8; 1,2,4,8 with a peer")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default: 2 B; B with a peer)")
    p.add_argument("--seconds", type=float, default=30.0, help="load time per batch size and workload")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--workloads", default="plain", help=f"some of {','.join(WORKLOADS)}")
    p.add_argument("--system_tokens", type=int, default=1000, help="the shared workload's system prompt, about")
    p.add_argument("--turns", type=int, default=10, help="turns of each chat of the chat workload")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens per request: ours --max_seq_length (held to the model's), the peer {context}")
    p.add_argument("--threads", type=int, default=None, help="ours (OMP_NUM_THREADS) and the peer's {threads} "
                   "(default: torch's own for ours alone; every core with a peer)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None, help="speculative rows beside the plain ones")
    p.add_argument("--speculate_k", default="5", help="ours' --speculate_k; llama-server's --spec-draft-n-max")
    p.add_argument("--llama_cpp", type=Path, default=None, metavar="DIR",
                   help="a llama.cpp source tree with build/bin/llama-server: the peer, on --gguf")
    p.add_argument("--gguf", type=Path, default=None, help="the same weights at the same bits, for llama-server")
    p.add_argument("--draft_gguf", type=Path, default=None, help="llama-server's drafter (the speculative rows)")
    p.add_argument("--peer_command", default=None, help="any OpenAI-compatible server's command line: the peer")
    p.add_argument("--peer_draft_flags", default=None, help="added to --peer_command for the speculative rows")
    p.add_argument("--versus_generate", action="store_true",
                   help="one client at each B against generate.py's plain tokens/s on the same checkpoint and prompt")
    p.add_argument("--chat_turns", type=int, default=0, metavar="N",
                   help="one client's N-turn chat, with the prefix cache and without: the last turn's time to first "
                        "token both ways")
    p.add_argument("--chat_history", type=int, default=1500, metavar="TOKENS",
                   help="about how many tokens a chat's last prompt holds (--chat_turns, the chat workload)")
    p.add_argument("--versus_plain", action="store_true",
                   help="each B with the drafter flags given after -- and without them (plain batching); the plain "
                        "or copy workload")
    p.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: more serve.py flags (--compile ...)")
    args = p.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or (args.clients is not None and not 0 < args.clients <= MAX_CLIENTS):
        raise SystemExit(f"error: --seconds must be in (0, {MAX_SECONDS}] and --clients in [1, {MAX_CLIENTS}]")
    peer = args.llama_cpp is not None or args.peer_command is not None
    try:
        args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2,4,8" if peer else "1,4,8")).split(",")]
    except ValueError:
        args.batch_sizes = []
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise SystemExit("error: --batch_sizes must be a comma-separated list of integers >= 1")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        raise SystemExit(f"error: --workloads must name some of {', '.join(WORKLOADS)}, got {args.workloads}")
    for name in ("system_tokens", "turns", "context", "chat_history", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
    if args.speculate_k != "auto" and not args.speculate_k.isdigit():
        raise SystemExit(f"error: --speculate_k must be an integer >= 1 or 'auto', got {args.speculate_k!r}")
    return args


def without_drafter(flags: list) -> list:
    """serve.py flags with the drafter's taken out (each with its value, or as --flag=value)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in DRAFTER_FLAGS:
            skip = True
        elif not flag.startswith(tuple(f + "=" for f in DRAFTER_FLAGS)):
            out.append(flag)
    return out


def versus_plain(args, extra: list) -> list:
    """Per B, the same closed-loop greedy load on a server with the drafter and on one without (clients default to
    B): both aggregate tokens/s, the speculative answers' tokens per target forward, and whether each prompt got
    the same answer every time, both ways."""
    prompts = COPY_PROMPTS if args.workloads == ["copy"] else PROMPTS
    rows = []
    for batch in args.batch_sizes:
        clients = min(args.clients or batch, MAX_CLIENTS)
        runs = {}
        for name, flags in (("plain", without_drafter(extra)), ("speculative", extra)):
            with serving(args.checkpoint_path, batch, flags, args.threads) as port:
                runs[name] = load(port, clients, args.seconds, plain_workload(args.max_tokens, prompts))
        answers = {}
        for run in runs.values():
            for answer in run["answers"]:
                answers.setdefault(answer["prompt"], set()).add(answer["text"])
        per_forward = [a["fastgen"]["tokens_per_target_forward"] for a in runs["speculative"]["answers"]
                       if a["fastgen"].get("tokens_per_target_forward")]
        plain, fast = runs["plain"]["tokens_per_sec"], runs["speculative"]["tokens_per_sec"]
        rows.append({"batch_size": batch, "clients": clients, "plain_tokens_per_sec": plain,
                     "speculative_tokens_per_sec": fast, "ratio": fast / plain if plain else None,
                     "tokens_per_target_forward": statistics.mean(per_forward) if per_forward else None,
                     "requests": {name: run["requests"] for name, run in runs.items()},
                     "identical": all(len(texts) == 1 for texts in answers.values())})
    return rows


def report_versus_plain(args, extra: list, rows: list):
    value = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    print(f"speculative: {' '.join(extra)}; plain: {' '.join(without_drafter(extra)) or 'no flags'}; "
          f"workload {args.workloads[0]}")
    print(f"{'B':>3} {'clients':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'tok/fwd':>7} answers")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['clients']:>7} {r['plain_tokens_per_sec']:>11.1f} "
              f"{r['speculative_tokens_per_sec']:>10.1f} {value(r['ratio'], '.3f'):>6} "
              f"{value(r['tokens_per_target_forward'], '.2f'):>7} {'identical' if r['identical'] else 'DIFFERENT'}")
    if args.json:
        result = {"checkpoint": str(args.checkpoint_path), "seconds": args.seconds, "max_tokens": args.max_tokens,
                  "workload": args.workloads[0], "server_flags": extra, "plain_flags": without_drafter(extra),
                  "rows": rows}
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


def peer_of(args):
    """The peer, {"name", "command", "draft"} (templates), or None; bad flags are one line before any server."""
    if args.llama_cpp is not None and args.peer_command is not None:
        raise SystemExit("error: give --llama_cpp or --peer_command, not both")
    if args.llama_cpp is None and (args.gguf or args.draft_gguf):
        raise SystemExit("error: --gguf and --draft_gguf are llama-server's: give --llama_cpp DIR too")
    if args.llama_cpp is not None:
        command, draft = llama_server(args.llama_cpp, args.gguf, args.draft_gguf, args.speculate_k)
        if draft and args.speculate_k == "auto":
            raise SystemExit("error: --speculate_k auto has no llama-server peer: give a depth")
        peer = {"name": "llama-server", "command": command, "draft": draft}
    elif args.peer_command is not None:
        peer = {"name": "peer", "command": shlex.split(args.peer_command),
                "draft": shlex.split(args.peer_draft_flags or "")}
    else:
        if args.peer_draft_flags:
            raise SystemExit("error: --peer_draft_flags goes with --peer_command")
        print("no --llama_cpp or --peer_command: the peer columns are skipped", flush=True)
        return None
    if bool(peer["draft"]) != (args.draft_checkpoint_path is not None):
        raise SystemExit("error: the speculative rows need a drafter on both sides: --draft_checkpoint_path with "
                         "--draft_gguf (llama-server) or --peer_draft_flags")
    if not peer["command"]:
        raise SystemExit("error: --peer_command is empty")
    peer_argv(peer["command"] + peer["draft"], 1, 1, 1, 1)  # a template it cannot fill: one line, now
    args.threads = args.threads or os.cpu_count()
    return peer


def main(argv=None):
    args = parse(argv)
    extra = [f for f in args.server_flags if f != "--"]
    if args.chat_turns or args.versus_generate:
        if args.llama_cpp or args.peer_command or args.draft_checkpoint_path or args.workloads != ["plain"]:
            raise SystemExit("error: --chat_turns and --versus_generate run ours alone: leave out the peer, "
                             "--draft_checkpoint_path and --workloads")
        if args.clients not in (None, 1):
            raise SystemExit("error: --chat_turns and --versus_generate run one client: leave out --clients")
    if args.chat_turns:
        if args.versus_generate or args.chat_turns < 2:
            raise SystemExit("error: --chat_turns (>= 2) runs one client, alone: leave out --versus_generate")
        report_chat(args, extra, chat_turns(args, extra))
    elif args.versus_generate:
        versus_generate(args, extra)
    elif args.versus_plain:
        if args.llama_cpp or args.peer_command or without_drafter(extra) == extra \
                or len(args.workloads) != 1 or args.workloads[0] not in ("plain", "copy"):
            raise SystemExit("error: --versus_plain compares a drafter with plain batching on ours alone: give the "
                             "drafter's flags after -- (--draft_ngram N, --draft_checkpoint_path ...), one of the "
                             "plain or copy workloads, and no peer")
        report_versus_plain(args, extra, versus_plain(args, extra))
    else:
        peer = peer_of(args)
        if peer and any(f.split("=")[0] in ("--max_seq_length", "--max_batch_size") for f in extra):
            raise SystemExit("error: with a peer, give --context and --batch_sizes, not serve.py's --max_seq_length "
                             "and --max_batch_size: both servers get them")
        report_versus(args, extra, peer, versus(args, extra, peer))


if __name__ == "__main__":
    sys.exit(run_cli(main))
