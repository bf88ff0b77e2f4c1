"""serve.py under load: N closed-loop clients (each sends its next streaming request as soon as the last one ends)
against a server on a loopback port, at --max_batch_size B = 1, 4, 8: aggregate tokens/s, p50 / p95 time to first
token and inter-token latency.

    python scripts/bench_serve.py --checkpoint_path checkpoints/tiny/target/model.pth --seconds 20 --json out.json

Each B starts its own server (python serve.py, same flags), waits for GET /health, then runs --clients clients
(default 2 B) for --seconds. Tokens/s counts the completion tokens of the requests that finished inside the window
(their usage), over the window. Time to first token: request sent -> first text chunk; inter-token latency: the gaps
between text chunks (a chunk carries one token's text, or several where held-back text is released at once).

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

    python scripts/bench_serve.py --checkpoint_path M/model.pth --versus_plain --batch_sizes 4 --clients 4 \
        --workload copy -- --compile --draft_ngram 3 --speculate_k auto

--versus_plain: per B, the same closed-loop greedy load on a server with the drafter flags given after -- and on one
with them taken out (plain batching): both aggregate tokens/s and their ratio, the mean tokens per target forward of
the speculative answers, and whether every answer was the same both ways (each prompt's answer, whoever asked it).
Clients default to B there (one row each). --workload copy sends prompts whose answers repeat text already in them
(code with repeated structure, lists, records: what n-gram lookups draft well); `mixed` (default) is PROMPTS.
"""
import collections
import contextlib
import argparse
import http.client
import json
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
# copy-heavy prompts: their continuations repeat what the prompt already holds
COPY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\ndef multiply(a, b):\n",
    "Fruits: apple, banana, cherry, date, elderberry, fig, grape.\nThe same fruits again: apple, banana,",
    '{"name": "Alice", "age": 30, "city": "Paris"}\n{"name": "Bob", "age": 25, "city": "Paris"}\n{"name": "Carol",',
    "1. Open the file.\n2. Read the header.\n3. Check the header.\n4. Read the rows.\n5. Check the rows.\n6.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "SELECT id, name FROM users WHERE age > 30;\nSELECT id, name FROM users WHERE age > 40;\nSELECT id, name FROM",
]
WORKLOADS = {"mixed": PROMPTS, "copy": COPY_PROMPTS}
# serve.py's drafter flags (each with its value): --versus_plain takes them out for the plain server
DRAFTER_FLAGS = ("--draft_checkpoint_path", "--draft_head", "--speculate_k", "--tree_nodes", "--draft_ngram")
MAX_CLIENTS, MAX_SECONDS = 64, 600
# the chat workload's user messages are drawn from these words (a fixed text: both runs send the same messages)
FILLER = ("the parser reads each option and its value then checks the value against the type the option declares "
          "and stores it in a namespace that the program later reads to decide what to do next while the help text "
          "lists every option with a short line about what it changes").split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, process: subprocess.Popen, timeout: float, log=None):
    """Until /health answers 200; serve's own `error:` line (its stderr, in `log`) if it exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            said = []
            if log is not None:
                log.seek(0)
                said = [line for line in log.read().decode(errors="replace").splitlines() if line.startswith("error: ")]
            raise SystemExit(f"error: serve.py exited with status {process.returncode} before it was ready"
                             + (f" ({said[-1][len('error: '):]})" if said else ""))
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: serve.py was not ready after {timeout:.0f} s")


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


def one_request(port: int, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: its send time, the arrival times of its text chunks, its completion tokens."""
    connection, response, sent = stream(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, 120)
    arrivals, tokens, figures, text = [], 0, {}, ""
    for chunk in chunks(response):
        figures = chunk.get("fastgen") or figures
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk.get("choices") and chunk["choices"][0]["text"]:
            arrivals.append(time.perf_counter())
            text += chunk["choices"][0]["text"]
    connection.close()
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "ended": time.perf_counter(), "fastgen": figures,
            "prompt": prompt, "text": text}


def load(port: int, clients: int, seconds: float, max_tokens: int, prompts: list = PROMPTS) -> dict:
    """Closed-loop clients for `seconds`: aggregate tokens/s and latency percentiles (seconds); `answers`, each
    request's figures."""
    done, lock = [], threading.Lock()
    start = time.perf_counter()
    stop_at = start + seconds

    def client(i: int):
        n = 0
        while time.perf_counter() < stop_at:
            result = one_request(port, prompts[(i + n) % len(prompts)], max_tokens)
            n += 1
            with lock:
                done.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    inside = [r for r in done if r["ended"] <= stop_at]
    ttft = [r["arrivals"][0] - r["sent"] for r in done if r["arrivals"]]
    itl = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]

    def pct(values, q):
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else None)

    return {"clients": clients, "requests": len(done), "tokens_per_sec": sum(r["tokens"] for r in inside) / seconds,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95),
            "answers": inside, "all_answers": done}


@contextlib.contextmanager
def serving(checkpoint: Path, batch: int, flags: list):
    """serve.py at --max_batch_size `batch` with these flags on a free loopback port, once ready: yields the port."""
    port = free_port()
    log = tempfile.TemporaryFile()  # serve's stderr: its one line, if it stops before it is ready
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--checkpoint_path", str(checkpoint),
                                "--port", str(port), "--host", "127.0.0.1", "--max_batch_size", str(batch),
                                "--max_queue", str(MAX_CLIENTS), *flags], stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_ready(port, process, timeout=600, log=log)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def chat_request(port: int, messages: list, max_tokens: int) -> dict:
    """One greedy streaming chat completion: its answer text, time to its first text, usage and `fastgen`."""
    connection, response, sent = stream(port, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens},
                                        600)
    if response.status != 200:
        said = json.loads(response.read() or b"{}").get("error", {}).get("message", "")
        raise SystemExit(f"error: the server refused a chat turn with {response.status}: {said} (lower "
                         f"--chat_history or --max_tokens)")
    text, first, usage, figures = "", None, None, {}
    for chunk in chunks(response):
        if "error" in chunk:
            raise SystemExit(f"error: the server answered a chat turn with: {chunk['error']['message']}")
        figures = chunk.get("fastgen") or figures
        usage = chunk.get("usage") or usage
        content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
        if content:  # the first chunk (the role, no text) is sent before any token
            first = first or time.perf_counter()
            text += content
    connection.close()
    return {"text": text, "ttft": (first or time.perf_counter()) - sent, "usage": usage, "fastgen": figures}


def chat(port: int, turns: int, history: int, max_tokens: int) -> list:
    """A chat of `turns` turns, each one's request the conversation so far plus a new user message sized so that
    the last prompt holds about `history` tokens: each turn's chat_request result."""
    # a turn adds its user message, its answer and the template around them (about 20 tokens with the question);
    # English text is about 1.3 tokens a word: the last turn's usage tells the real count
    words = max(1, round((history / turns - max_tokens - 20) / 1.3))
    messages, results = [], []
    for turn in range(turns):
        text = " ".join(FILLER[(turn * 11 + i) % len(FILLER)] for i in range(words))
        messages.append({"role": "user", "content": f"Part {turn + 1}: {text}. What does this part say?"})
        result = chat_request(port, messages, max_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    return results


def chat_turns(args, extra: list) -> list:
    """Per B, the chat on a server with the prefix cache and on one without: the last turn's figures, both ways."""
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        runs = {}
        for name, flags in (("cached", extra), ("cold", extra + ["--no_prefix_cache"])):
            with serving(args.checkpoint_path, batch, flags) as port:
                runs[name] = chat(port, args.chat_turns, args.chat_history, args.max_tokens)
        cached, cold = runs["cached"][-1], runs["cold"][-1]
        rows.append({"batch_size": batch, "turns": args.chat_turns,
                     "last_prompt_tokens": cached["usage"]["prompt_tokens"],
                     "last_cached_tokens": cached["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "ttft_cached": cached["ttft"], "ttft_cold": cold["ttft"], "speedup": cold["ttft"] / cached["ttft"],
                     "server_ttft_cached": cached["fastgen"].get("time_to_first_token"),
                     "server_ttft_cold": cold["fastgen"].get("time_to_first_token"),
                     "identical": [r["text"] for r in runs["cached"]] == [r["text"] for r in runs["cold"]]})
    return rows


def report_chat(args, extra: list, rows: list):
    print(f"{'B':>3} {'turns':>5} {'last prompt':>11} {'cached':>7} {'TTFT cached':>11} {'TTFT cold':>10} "
          f"{'ratio':>6} answers   (last turn; TTFT in ms, request sent -> first text)")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['turns']:>5} {r['last_prompt_tokens']:>11} {r['last_cached_tokens']:>7} "
              f"{r['ttft_cached'] * 1000:>11.1f} {r['ttft_cold'] * 1000:>10.1f} {r['speedup']:>6.2f} "
              f"{'identical' if r['identical'] else 'DIFFERENT'}")
    if args.json:
        result = {"checkpoint": str(args.checkpoint_path), "chat_turns": args.chat_turns,
                  "chat_history": args.chat_history, "max_tokens": args.max_tokens, "server_flags": extra,
                  "rows": rows}
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


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


def versus_plain(args, extra: list, prompts: list) -> list:
    """Per B, the closed-loop greedy load on a server with the drafter and on one without: tokens/s both ways."""
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        clients = min(args.clients or batch, MAX_CLIENTS)
        runs = {}
        for name, flags in (("plain", without_drafter(extra)), ("speculative", extra)):
            with serving(args.checkpoint_path, batch, flags) as port:
                runs[name] = load(port, clients, args.seconds, args.max_tokens, prompts)
        answers = collections.defaultdict(set)  # each prompt's answers, both ways (greedy: one each)
        for run in runs.values():
            for answer in run["all_answers"]:
                answers[answer["prompt"]].add(answer["text"])
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
          f"workload {args.workload}")
    print(f"{'B':>3} {'clients':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'tok/fwd':>7} answers")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['clients']:>7} {r['plain_tokens_per_sec']:>11.1f} "
              f"{r['speculative_tokens_per_sec']:>10.1f} {value(r['ratio'], '.3f'):>6} "
              f"{value(r['tokens_per_target_forward'], '.2f'):>7} {'identical' if r['identical'] else 'DIFFERENT'}")
    if args.json:
        result = {"checkpoint": str(args.checkpoint_path), "seconds": args.seconds, "max_tokens": args.max_tokens,
                  "workload": args.workload, "server_flags": extra, "plain_flags": without_drafter(extra),
                  "rows": rows}
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"))
    p.add_argument("--batch_sizes", default="1,4,8")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default: 2 B)")
    p.add_argument("--seconds", type=float, default=30.0, help="load time per batch size")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--versus_generate", action="store_true",
                   help="one client at each B against generate.py's plain tokens/s on the same checkpoint and prompt")
    p.add_argument("--chat_turns", type=int, default=0, metavar="N",
                   help="one client's N-turn chat, with the prefix cache and without: the last turn's time to first "
                        "token both ways")
    p.add_argument("--chat_history", type=int, default=1500, metavar="TOKENS",
                   help="about how many tokens the chat's last prompt holds (--chat_turns)")
    p.add_argument("--versus_plain", action="store_true",
                   help="each B with the drafter flags given after -- and without them (plain batching)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed",
                   help="the clients' prompts: mixed, or copy (answers that repeat the prompt's text)")
    p.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: more serve.py flags (--compile ...)")
    args = p.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or (args.clients is not None and not 0 < args.clients <= MAX_CLIENTS):
        raise SystemExit(f"error: --seconds must be in (0, {MAX_SECONDS}] and --clients in [1, {MAX_CLIENTS}]")
    extra = [f for f in args.server_flags if f != "--"]
    if args.chat_turns:
        if args.versus_generate or args.clients is not None or args.chat_turns < 2 or args.chat_history < 1:
            raise SystemExit("error: --chat_turns (>= 2) runs one client, alone: leave out --versus_generate and "
                             "--clients, and give --chat_history >= 1")
        report_chat(args, extra, chat_turns(args, extra))
        return
    prompts = WORKLOADS[args.workload]
    if args.versus_plain:
        if args.versus_generate or without_drafter(extra) == extra:
            raise SystemExit("error: --versus_plain compares a drafter with plain batching: give the drafter's flags "
                             "after -- (--draft_ngram N, --draft_checkpoint_path ...), and leave out --versus_generate")
        report_versus_plain(args, extra, versus_plain(args, extra, prompts))
        return
    plain = None
    if args.versus_generate:
        if args.clients not in (None, 1):
            raise SystemExit("error: --versus_generate runs one client: leave out --clients")
        plain = generate_tokens_per_sec(args.checkpoint_path, PROMPTS[0], args.max_tokens, generate_flags(extra))
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        with serving(args.checkpoint_path, batch, extra) as port:
            if plain is not None:
                answers = load(port, 1, args.seconds, args.max_tokens, PROMPTS[:1])["answers"]
                rows.append(dict(lone_client(answers, plain), batch_size=batch))
                continue
            clients = min(args.clients or 2 * batch, MAX_CLIENTS)
            row = load(port, clients, args.seconds, args.max_tokens, prompts)
            del row["answers"], row["all_answers"]
            rows.append(dict(row, batch_size=batch))
    if plain is not None:
        report_versus_generate(args, extra, plain, rows)
        return
    ms = lambda v: f"{v * 1000:.1f}" if v is not None else "-"  # noqa: E731
    print(f"{'B':>3} {'clients':>7} {'requests':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'ITL p50':>8} {'ITL p95':>8}   (latencies in ms)")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['clients']:>7} {r['requests']:>8} {r['tokens_per_sec']:>9.1f} "
              f"{ms(r['ttft_p50']):>9} {ms(r['ttft_p95']):>9} {ms(r['itl_p50']):>8} {ms(r['itl_p95']):>8}")
    if args.json:
        result = {"checkpoint": str(args.checkpoint_path), "seconds": args.seconds, "max_tokens": args.max_tokens,
                  "server_flags": extra, "rows": rows}
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


def report_versus_generate(args, extra: list, plain: float, rows: list):
    rate = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    ratio = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
    print(f"generate.py plain: {plain:.1f} tokens/s ({PROMPTS[0]!r}, {args.max_tokens} new tokens, flags "
          f"{' '.join(generate_flags(extra)) or 'none'})")
    print(f"{'B':>3} {'answers':>7} {'answer tok/s':>12} {'ratio':>6} {'decode tok/s':>12} {'ratio':>6}   "
          f"(one client; ratio: to generate.py's)")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['answers']:>7} {rate(r['answer_tokens_per_sec']):>12} {ratio(r['ratio']):>6} "
              f"{rate(r['decode_tokens_per_sec']):>12} {ratio(r['decode_ratio']):>6}")
    if args.json:
        result = {"checkpoint": str(args.checkpoint_path), "seconds": args.seconds, "max_tokens": args.max_tokens,
                  "prompt": PROMPTS[0], "server_flags": extra, "generate_flags": generate_flags(extra),
                  "generate_tokens_per_sec": plain, "rows": rows}
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))


if __name__ == "__main__":
    sys.exit(run_cli(main))
