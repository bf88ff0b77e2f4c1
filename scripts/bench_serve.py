"""serve.py under load: N closed-loop clients (each sends its next streaming request as soon as the last one ends)
against a server on a loopback port, at --max_batch_size B = 1, 4, 8: aggregate tokens/s, p50 / p95 time to first
token and inter-token latency.

    python scripts/bench_serve.py --checkpoint_path checkpoints/tiny/target/model.pth --seconds 20 --json out.json

Each B starts its own server (python serve.py, same flags), waits for GET /health, then runs --clients clients
(default 2 B) for --seconds. Tokens/s counts the completion tokens of the requests that finished inside the window
(their usage), over the window. Time to first token: request sent -> first text chunk; inter-token latency: the gaps
between text chunks (a chunk carries one token's text, or several where held-back text is released at once).
"""
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
MAX_CLIENTS, MAX_SECONDS = 64, 600


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


def one_request(port: int, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: its send time, the arrival times of its text chunks, its completion tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    arrivals, tokens = [], 0
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk.get("choices") and chunk["choices"][0]["text"]:
            arrivals.append(time.perf_counter())
    connection.close()
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "ended": time.perf_counter()}


def load(port: int, clients: int, seconds: float, max_tokens: int) -> dict:
    """Closed-loop clients for `seconds`: aggregate tokens/s and latency percentiles (seconds)."""
    done, lock = [], threading.Lock()
    start = time.perf_counter()
    stop_at = start + seconds

    def client(i: int):
        n = 0
        while time.perf_counter() < stop_at:
            result = one_request(port, PROMPTS[(i + n) % len(PROMPTS)], max_tokens)
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
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"))
    p.add_argument("--batch_sizes", default="1,4,8")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default: 2 B)")
    p.add_argument("--seconds", type=float, default=30.0, help="load time per batch size")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: more serve.py flags (--compile ...)")
    args = p.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or (args.clients is not None and not 0 < args.clients <= MAX_CLIENTS):
        raise SystemExit(f"error: --seconds must be in (0, {MAX_SECONDS}] and --clients in [1, {MAX_CLIENTS}]")
    extra = [f for f in args.server_flags if f != "--"]
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        port = free_port()
        log = tempfile.TemporaryFile()  # serve's stderr: its one line, if it stops before it is ready
        process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--checkpoint_path",
                                    str(args.checkpoint_path), "--port", str(port), "--host", "127.0.0.1",
                                    "--max_batch_size", str(batch), "--max_queue", str(MAX_CLIENTS), *extra],
                                   stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_ready(port, process, timeout=600, log=log)
            clients = min(args.clients or 2 * batch, MAX_CLIENTS)
            rows.append(dict(load(port, clients, args.seconds, args.max_tokens), batch_size=batch))
        finally:
            process.terminate()
            process.wait(timeout=30)
            log.close()
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


if __name__ == "__main__":
    sys.exit(run_cli(main))
