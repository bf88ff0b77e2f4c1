"""serve.py under tensor parallelism (tp.Lockstep): rank 0 serves and every call that changes the model reaches the
other ranks. In this process: replaying rank 0's recorded calls on a second copy of the model leaves it holding
rank 0's cache, bit for bit (nothing changes the model outside the mirrored calls). Under torchrun with 2 gloo
ranks: concurrent clients get the library's greedy answers; a rank killed mid-answer ends the server with a 503 and
one line."""
import http.client
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import serve
import tp
from bench_serve import free_port, wait_ready
from decode import sdpa_context
from helpers import ROOT, copy_checkpoint
from test_serve import Running, alone, library  # noqa: F401 (a fixture)

SYSTEM = "You are a terse assistant. Answer in one line, then stop. " * 3
PREAMBLE = "an optional argument " * 12


def requests(library):
    """Bodies for 4 concurrent clients (chat and completions, two pairs sharing a prefix: the prefix cache copies rows)
    and each one's answer from the library alone."""
    bodies = [("chat", {"messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "What is argparse?"}], "max_tokens": 30}),
              ("chat", {"messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "How do I add a flag?"}], "max_tokens": 24}),
              ("completions", {"prompt": PREAMBLE + "def main(", "max_tokens": 40}),
              ("completions", {"prompt": PREAMBLE + "usage", "max_tokens": 17})]
    tokenizer = library.tokenizer
    want = [alone(library, tokenizer.chat_ids(body["messages"]) if kind == "chat" else
                  tokenizer.encode_prompt(body["prompt"]), body["max_tokens"])[1] for kind, body in bodies]
    return [(kind, dict(body, temperature=0)) for kind, body in bodies], want


def post(port: int, kind: str, body: dict, timeout: float = 120) -> tuple:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("POST", f"/v1/{'chat/' if kind == 'chat' else ''}completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, data = response.status, json.loads(response.read())
    connection.close()
    return status, data


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    """A draft close to the target: the lone request's speculative loop accepts some drafts, rejects others."""
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("tp_near"), noise=0.05, sharpen=4.0)


@pytest.mark.slow
def test_replaying_rank_0s_calls_rebuilds_its_cache_bit_for_bit(random_target, near_draft, library, monkeypatch):
    """Rank 0's engine in this process, its calls recorded as they would be broadcast (pickled): 4 concurrent
    requests with shared prefixes and a bad one, then a lone one that speculates. A second copy of the model that
    runs only those calls ends with rank 0's keys and values in every slot: no forward, cache copy, swap or
    verification move escapes the mirror. Leaving out the cache moves breaks it."""
    sent = []
    lockstep = tp.Lockstep(group="in-process")
    monkeypatch.setattr(lockstep, "send", lambda message: sent.append(pickle.loads(pickle.dumps(message))))
    build = serve.build_scheduler

    def leading(args, shard=None):
        scheduler = build(args, shard)
        scheduler.engine = scheduler.generator.target = lockstep.leader(scheduler.engine)
        return scheduler
    monkeypatch.setattr(serve, "build_scheduler", leading)
    running = Running(random_target, "--max_batch_size", 4, "--draft_checkpoint_path", near_draft, "--speculate_k", 3,
                      "--tree_nodes", 6, api_key=None)
    try:
        bodies, want = requests(library)
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda kb: post(running.port, *kb), bodies + [
                ("completions", {"prompt": "x", "max_tokens": 0})]))
        assert [text_of(reply) for _, reply in replies[:4]] == want
        assert replies[4][0] == 400 and replies[4][1]["error"]["param"] == "max_tokens"
        lone = {"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 48, "temperature": 0}
        assert text_of(post(running.port, "chat", lone)[1]) == alone(
            library, library.tokenizer.chat_ids(lone["messages"]), 48)[1]
        assert running.metric("fastgen_prefix_cache_hits_total") >= 2
        assert running.metric("fastgen_speculative_target_forwards_total") > 0
    finally:
        running.stop()
        running.scheduler.thread.join(10)
    names = {name for name, _, _ in sent}
    assert {"forward", "move_cache_slots"} <= names
    moves = [args for name, args, _ in sent if name == "move_cache_slots"]
    assert any(len(args) == 4 and args[0] and args[2] != args[3] for args in moves)  # between rows: copies, swaps
    assert any(len(args) == 3 and args[0] != args[1] for args in moves)  # inside row 0: verification's accepted paths

    def replay(messages) -> bool:
        """Whether a fresh copy of the model, running these calls, holds rank 0's cache in every slot."""
        replica = build(running.args)
        follower = tp.Lockstep(group="in-process")
        follower.attach(replica.engine)
        for message in messages:
            assert follower.run(message, sdpa_context)
        return all(torch.equal(getattr(mine.attention.kv_cache, name), getattr(theirs.attention.kv_cache, name))
                   for mine, theirs in zip(running.scheduler.model.layers, replica.model.layers)
                   for name in ("k_cache", "v_cache"))
    assert replay(sent)
    assert not replay([message for message in sent if message[0] != "move_cache_slots"])


# ----------------------------------------------------------------------------- 2 ranks on the CPU (gloo)

def metric(port: int, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return float(text.split(f"\n{name} ")[1].split()[0])


def clean_env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID"):
        if name not in extra:
            env.pop(name, None)
    return env


@pytest.mark.slow
def test_two_ranks_answer_concurrent_clients_as_one_process(random_target, near_draft, library, tmp_path):
    """torchrun, 2 gloo ranks, a speculating drafter: 4 concurrent greedy clients (chat and completions, shared
    prefixes) and a bad request beside them get the library's answers alone, token for token; then a lone request
    that speculates. Ctrl-C (SIGINT to torchrun) stops every rank without an error."""
    port, log = free_port(), tmp_path / "torchrun.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "serve.py",
             "--checkpoint_path", str(random_target), "--device", "cpu", "--port", str(port), "--max_batch_size", "4",
             "--draft_checkpoint_path", str(near_draft), "--speculate_k", "3", "--tree_nodes", "6"],
            cwd=ROOT, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        with open(log, "rb") as said:
            wait_ready(port, [process], 300, said, "torchrun")
        bodies, want = requests(library)
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda kb: post(port, *kb), bodies + [("chat", {"messages": []})]))
        assert [text_of(reply) for _, reply in replies[:4]] == want
        assert replies[4][0] == 400 and replies[4][1]["error"]["param"] == "messages"
        lone = {"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 48, "temperature": 0}
        status, reply = post(port, "chat", lone)
        assert text_of(reply) == alone(library, library.tokenizer.chat_ids(lone["messages"]), 48)[1]
        assert reply["fastgen"]["tokens_per_target_forward"] > 1  # it speculated
        assert metric(port, "fastgen_prefix_cache_hits_total") >= 2
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        text = log.read_text()
        assert "error:" not in text and 'serve.py", line' not in text and 'tp.py", line' not in text, text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_killed_rank_ends_the_server_with_a_503_and_one_line(random_target, library, tmp_path):
    """Two ranks started by hand (no launcher to stop the others): rank 1 killed while two answers run. The streamed
    one ends with an error event, the other is a 503, both naming the lost rank; rank 0 prints that one line and
    exits with status 1, without a hang."""
    ids = library.tokenizer.encode_prompt("def main(")
    tokens, _ = alone(library, ids, 200)
    assert len(tokens) == 200 and not set(tokens) & set(library.eos_ids)  # no answer ends before the kill
    port, master = free_port(), free_port()
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    processes = []
    for rank in range(2):
        with open(logs[rank], "w") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "serve.py", "--checkpoint_path", str(random_target), "--device", "cpu", "--port",
                 str(port), "--max_batch_size", "2"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env=clean_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(master))))
    try:
        with open(logs[0], "rb") as said:
            wait_ready(port, processes, 300, said)
        whole = []
        thread = threading.Thread(target=lambda: whole.append(post(port, "completions", {
            "prompt": "def main(", "max_tokens": 200, "temperature": 0})))
        thread.start()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": "def main(", "max_tokens": 200, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        while metric(port, "fastgen_batch_rows_active") < 2:  # both answers running
            time.sleep(0.01)
        processes[1].kill()
        rest = response.read().decode()
        thread.join(60)
        cause = "rank 0 lost the other ranks of tensor parallelism"
        assert cause in rest and "tensor_parallel_failed" in rest
        status, reply = whole[0]
        assert status == 503 and reply["error"]["message"].startswith(cause)
        assert processes[0].wait(timeout=60) == 1
        errors = [line for line in logs[0].read_text().splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith(f"error: {cause} (") and "Traceback" not in \
            logs[0].read_text(), logs[0].read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
