"""Bad input that shows only at run time (issue #38): sizes that would not fit in memory, a chat template that would
run for hours, logits that turn NaN mid-run, torchrun ranks launched with different arguments, Ctrl-C while the
imports run. Each ends in one line `error: ...` naming the flag or file and what to do (exit 1; 130 for Ctrl-C),
never a traceback or a hang.

Most rows run generate.py's command line in this process (cli.cli(argv): run_cli's one line and exit status,
without the ~3 CPU seconds of a new interpreter); the torchrun and Ctrl-C rows need processes of their own.
"""
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import errors
import generation
import tokenizer
from bench_serve import free_port
from helpers import ROOT, cli


def argv_for(checkpoint, *extra, n=20):
    return ["--checkpoint_path", checkpoint, "--prompt", "def main(", "--max_new_tokens", n, "--num_samples", 1,
            "--temperature", 0, "--device", "cpu", *extra]


def run_cli(capsys, *argv):
    """generate.py's command line in this process: (exit status, stderr lines, seconds)."""
    capsys.readouterr()
    t0 = time.monotonic()
    status = cli.cli([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines(), time.monotonic() - t0


def assert_one_line(result, *expect, bound=10):
    status, lines, seconds = result
    assert status == 1 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(e in lines[0] for e in map(str, expect)), lines[0]
    assert "Traceback" not in lines[0] and seconds < bound, (lines[0], seconds)


def checkpoint_copy(source: Path, directory: Path, **config) -> Path:
    """A copy of the checkpoint directory of `source` (model.pth) with config.json entries replaced."""
    directory.mkdir()
    for name in ("tokenizer.model", "model.pth"):
        shutil.copy(source.parent / name, directory)
    hf = json.loads((source.parent / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(hf, **config)))
    return directory / "model.pth"


# ----------------------------------------------------------------------------- memory, estimated before allocating

def test_kv_cache_beyond_memory_names_the_flags(random_target, capsys):
    result = run_cli(capsys, *argv_for(random_target, "--batch_size", 10**11))
    assert_one_line(result, "KV cache", "--batch_size", "--max_new_tokens", "available")


def test_weights_beyond_memory_name_the_checkpoint(random_target, capsys, monkeypatch):
    # bf16 on the CPU copies every fp32 weight (fp32 ones would stay memory-mapped from the file)
    monkeypatch.setattr(generation, "available_memory", lambda device: 4096)
    result = run_cli(capsys, *argv_for(random_target, "--precision", "bf16"))
    assert_one_line(result, f"loading {random_target}", "--precision")


def test_rope_table_beyond_memory_names_the_config(random_target, tmp_path, capsys, monkeypatch):
    checkpoint = checkpoint_copy(random_target, tmp_path / "long", max_position_embeddings=2**24)
    monkeypatch.setattr(generation, "available_memory", lambda device: 256 << 20)
    result = run_cli(capsys, *argv_for(checkpoint))
    assert_one_line(result, checkpoint.parent / "config.json", "max_position_embeddings")


def cgroup(root: Path, **files) -> Path:
    """A fake cgroup file system: files given as keyword arguments, `/` written `__` (memory__max)."""
    for name, text in files.items():
        path = root / name.replace("__", "/").replace("_dot_", ".")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


GIB = 1 << 30
CGROUPS = {  # id: (files, /proc/self/cgroup, bytes free)
    "v2": ({"memory_dot_max": f"{GIB}\n", "memory_dot_current": f"{GIB // 2}\n",
            "memory_dot_stat": "anon 1\nactive_file 1024\ninactive_file 3072\n"}, "0::/\n", GIB // 2 + 4096),
    "v2-unlimited": ({"memory_dot_max": "max\n", "memory_dot_current": "5\n"}, "0::/\n", None),
    "v2-parent-tighter": ({"a__memory_dot_max": "max\n", "a__memory_dot_current": "10\n",
                           "memory_dot_max": "1000\n", "memory_dot_current": "300\n"}, "0::/a\n", 700),
    "v2-over-limit": ({"memory_dot_max": "100\n", "memory_dot_current": "200\n"}, "0::/\n", 0),
    "v1": ({"memory__memory_dot_limit_in_bytes": f"{GIB}\n", "memory__memory_dot_usage_in_bytes": f"{GIB - 100}\n",
            "memory__memory_dot_stat": "cache 7\ntotal_inactive_file 50\ninactive_file 1\n"},
           "4:memory:/docker/x\n0::/\n", 150),
    "v1-unlimited": ({"memory__memory_dot_limit_in_bytes": "9223372036854771712\n",
                      "memory__memory_dot_usage_in_bytes": "5\n"}, "4:memory:/\n", None),
    "none": ({}, "0::/\n", None),
}


@pytest.mark.parametrize("files, self_cgroup, free", CGROUPS.values(), ids=CGROUPS.keys())
def test_cgroup_memory_limit_is_read(tmp_path, files, self_cgroup, free):
    (tmp_path / "self").write_text(self_cgroup)
    root = cgroup(tmp_path / "cgroup", **files)
    assert generation.cgroup_available_memory(root, tmp_path / "self") == free


def test_cpu_memory_is_the_smaller_of_host_and_cgroup(tmp_path, monkeypatch):
    """A container's limit, far below what the host has free, is the figure sizes are checked against. The host's
    figure is fixed here: the real one moves between two reads while other tests run beside this one."""
    root = cgroup(tmp_path, memory_dot_max=f"{1 << 20}", memory_dot_current="0")
    monkeypatch.setattr(generation, "host_available_memory", lambda: 8 * GIB)
    assert generation.available_memory("cpu", cgroup_root=root) == 1 << 20
    assert generation.available_memory("cpu", cgroup_root=tmp_path / "none") == 8 * GIB
    monkeypatch.setattr(generation, "host_available_memory", lambda: 1000)
    assert generation.available_memory("cpu", cgroup_root=root) == 1000
    monkeypatch.setattr(generation, "host_available_memory", lambda: None)
    assert generation.available_memory("cpu", cgroup_root=root) == 1 << 20
    assert generation.available_memory("cpu", cgroup_root=tmp_path / "none") is None


# ----------------------------------------------------------------------------- chat templates: loops, output, time

@pytest.mark.parametrize("template, limit", [
    ("{% for i in range(100000) %}{% for j in range(1000000) %}{{ j }}{% endfor %}{% endfor %}", "loops"),
    ("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", "writes"),
    ("{{ 'x' * 10 ** 9 }}", "sequence"),
    ("{{ 10 ** 100000000 }}", "power"),
], ids=["nested_ranges", "output", "string_times_n", "power"])
def test_costly_chat_template_fails_fast(template, limit, random_target, tmp_path, capsys):
    checkpoint = checkpoint_copy(random_target, tmp_path / "chat")
    (checkpoint.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    result = run_cli(capsys, *argv_for(checkpoint, "--chat"))
    assert_one_line(result, f"chat template in {checkpoint.parent / 'tokenizer_config.json'}", limit, bound=8)


@pytest.mark.parametrize("template", [
    "{% set s = 'a' * 16000000 %}{% for x in s %}{% for y in s %}{% endfor %}{% endfor %}hi",
    "{% set s = [0] * 16000000 %}{% for x in s %}{% for y in s %}{% endfor %}{% endfor %}hi",
], ids=["string", "list"])
def test_a_template_loop_that_calls_nothing_still_runs_out_of_time(template, monkeypatch):
    """No call, filter, operator or output inside the loops: only the traced lines see the clock (this hung
    generate.py, and a server's event loop, for hours)."""
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.5)
    before, t0 = sys.gettrace(), time.monotonic()
    with pytest.raises(errors.UserError, match="runs longer than 0.5 s"):
        TemplateOnly(template).render_chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5
    assert sys.gettrace() is before  # the tracer is taken off


class TemplateOnly(tokenizer.Tokenizer):
    """A tokenizer with nothing but a chat template: render_chat alone, in this process."""
    def __init__(self, template):
        self.special_tokens, self.directory = {"bos_token": "<s>"}, Path("checkpoint")
        self.chat_template, self.chat_template_source = template, "checkpoint/tokenizer_config.json"


HUGE_TEMPLATES = {  # id: (template, what the line names); each would take a gigabyte or hours if let run
    "center-filter": ("{{ 'x' | center(10**9) }}", "center"),
    "center-literal": ("{{ 'x' | center(1000000000) }}", "center"),  # folded while compiling, were it allowed
    "center-method": ("{{ 'x'.center(10**9) }}", "center"),
    "method-by-item": ("{{ 'x'['ljust'](10**9) }}", "ljust"),
    "zfill": ("{{ '1'.zfill(10**9) }}", "zfill"),
    "indent": ("{{ 'x' | indent(10**9) }}", "indent"),
    "printf-star": ("{{ '%*d' | format(10**9, 1) }}", "format"),
    "printf-width": ("{{ '%01000000000d' % 1 }}", "%"),
    "str-format-width": ("{{ '{:1000000000}'.format(1) }}", "format"),
    "str-format-nested": ("{{ '{:{}}'.format(1, 10**9) }}", "format"),
    "join-separator": ("{{ ('x' * 1000) | join('y' * 16000000) }}", "join"),
    "join-method": ("{{ ('y' * 16000000).join('x' * 1000) }}", "join"),
    "replace-empty": ("{{ ('x' * 10000) | replace('', 'y' * 10000) }}", "replace"),
    "translate": ("{{ 'aaaa'.translate({97: 'x' * 10000000}) }}", "translate"),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(10**7) }}", "expandtabs"),
    "to-bytes": ("{{ (1).to_bytes(10**9, 'big') }}", "to_bytes"),
    "batch-fill": ("{{ 'x' | batch(10**9, 'y') | list }}", "batch"),
    "slice": ("{{ 'x' | slice(10**9) | list }}", "slice"),
    "sum-lists": ("{{ ([[0] * 16] * 1000000) | sum(start=[]) }}", "sum"),
    "tojson-indent": ("{{ messages | tojson(indent=10**9) }}", "indent"),
    "doubling-tilde": ("{% set ns = namespace(s='x' * 10**6) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s }}", "~"),
    "doubling-plus": ("{% set ns = namespace(s='x' * 10**6) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s }}", "+"),
    "range-list": ("{{ range(10**9) | list }}", "loops"),
    "power-of-power": ("{{ (10**1024)**1024 }}", "power"),
    "lipsum": ("{{ lipsum(10**9) }}", "lipsum"),
}


@pytest.mark.parametrize("template, names", HUGE_TEMPLATES.values(), ids=HUGE_TEMPLATES.keys())
def test_template_building_a_huge_value_is_refused_before_it(template, names):
    t0 = time.monotonic()
    with pytest.raises(generation.UserError) as refused:
        TemplateOnly(template).render_chat([{"role": "user", "content": "hi"}])
    line = str(refused.value)
    assert line.startswith("chat template in checkpoint/tokenizer_config.json") and names in line, line
    assert "\n" not in line and time.monotonic() - t0 < 2


def test_template_filters_and_methods_of_ordinary_size_still_work():
    template = ("{% for m in messages %}{{ m['role'] | center(8) }}|{{ m.content | indent(2) }}|"
                "{{ '%s-%d' | format('a', 3) }}|{{ '{}:{:>3}'.format(m.role, 1) }}|{{ ['a', 'b'] | join(', ') }}|"
                "{{ m.content.replace('h', 'H') }}|{{ 'x' ~ 'y' }}|{{ [1] + [2] }}|{{ '%s' % 'z' }}|{{ 2 ** 10 }}|"
                "{{ messages | map(attribute='content') | join('/') }}|{{ m | tojson }}{% endfor %}")
    assert TemplateOnly(template).render_chat([{"role": "user", "content": "hi"}]) == \
        '  user  |hi|a-3|user:  1|a, b|Hi|xy|[1, 2]|z|1024|hi|{"role": "user", "content": "hi"}'


# ----------------------------------------------------------------------------- NaN logits after the prefill

@pytest.fixture
def nan_after(monkeypatch):
    """nan_after(checkpoint, calls): the target's first block outputs NaN from its call number calls + 1 on (the
    prefill is call 1), as weights that overflow a few tokens into the run would."""
    def poison(checkpoint, calls):
        load = generation.load_model

        def load_poisoned(path, *args, **kwargs):
            model = load(path, *args, **kwargs)
            if Path(path) == Path(checkpoint):
                count = [0]

                def hook(_module, _inputs, out):
                    count[0] += 1
                    return out * float("nan") if count[0] > calls else out
                model.layers[0].register_forward_hook(hook)
            return model
        monkeypatch.setattr(generation, "load_model", load_poisoned)
    return poison


@pytest.mark.parametrize("mode", ["greedy", "sampled", "batched", "chain", "tree", "ngram"])
def test_logits_turning_nan_mid_run_stop_with_one_line(mode, nan_after, random_target, random_draft, capsys):
    draft = ["--draft_checkpoint_path", random_draft, "--speculate_k", 3]
    extra = {"greedy": [], "sampled": ["--temperature", 0.8], "batched": ["--batch_size", 3], "chain": draft,
             "tree": draft + ["--tree_nodes", 6], "ngram": ["--draft_ngram", 2, "--speculate_k", 3]}[mode]
    nan_after(random_target, 3)
    result = run_cli(capsys, *argv_for(random_target, "--ignore_eos", *extra, n=30))
    assert_one_line(result, "NaN", random_target, "--precision")
    assert "for the prompt" not in result[1][0]  # the prefill was fine: caught while decoding


# ----------------------------------------------------------------------------- torchrun ranks that disagree

def test_ranks_launched_with_different_arguments_fail_every_rank(random_target, tmp_path):
    """Two ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), rank 1 with another
    --max_new_tokens: each exits 1 with the same one line, long before any join timeout."""
    worker = tmp_path / "worker.py"
    worker.write_text(f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport generate\n"
                      "extra = ['--max_new_tokens', '3'] if os.environ['RANK'] == '1' else []\n"
                      "sys.exit(generate.cli(sys.argv[1:] + extra))\n")
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", FASTGEN_DIST_TIMEOUT="30")
        ranks.append(subprocess.Popen([sys.executable, str(worker), *map(str, argv_for(random_target, n=4))],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    results = [(p, *p.communicate(timeout=60)) for p in ranks]
    want = "error: rank 1 was launched with another --max_new_tokens than rank 0 ('3' instead of '4'): give every " \
           "rank the same arguments"
    for p, stdout, stderr in results:
        errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
        assert p.returncode == 1 and errors == [want], stderr
        assert "Loaded" not in stdout  # refused before loading
    assert time.monotonic() - t0 < 25


def rank_alone(checkpoint, port: int, timeout: int) -> tuple:
    """generate.py started as torchrun starts rank 1 of 2, with no rank 0: (exit status, stderr, seconds)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                                                     "TORCH_CPP_LOG_LEVEL", "FASTGEN_TRACEBACK")}
    environment.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", FASTGEN_DIST_TIMEOUT=str(timeout))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "generate.py", *map(str, argv_for(checkpoint, n=4))], cwd=ROOT,
                          env=environment, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout + 120)
    return done.returncode, done.stderr, time.monotonic() - t0


@contextlib.contextmanager
def silent_listener():
    """A port where a process accepts every connection and never answers (a rendezvous port another program holds):
    yields the port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:  # closed
                return
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()
        for connection in held:
            connection.close()


JOIN_WAIT = 3  # FASTGEN_DIST_TIMEOUT of the tests below


def cannot_join(port: int) -> str:
    return (f"error: rank 1 of 2 could not join the others at 127.0.0.1:{port} within {JOIN_WAIT} s: start every "
            f"rank (torchrun --nproc_per_node=N) with the same MASTER_ADDR and MASTER_PORT, or raise "
            f"FASTGEN_DIST_TIMEOUT")


@pytest.mark.slow  # a rank process waits out its timeout
@pytest.mark.parametrize("peer", ["nothing listens", "a listener that never answers"])
def test_a_rank_that_cannot_join_prints_one_line_within_the_timeout(random_target, peer):
    """Rank 1 without a rank 0: nothing at the port (torch's connect timeout), or a process that accepts the
    connection and never answers (only the join's own deadline ends that wait). Either way exit 1 with the same one
    line on stderr, torch's C++ log (socket timeouts, retries, frame lists) kept out, soon after the timeout
    (the rest is the start-up: importing torch, loading nothing)."""
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(silent_listener()) if peer != "nothing listens" else free_port()
        status, stderr, seconds = rank_alone(random_target, port, JOIN_WAIT)
    assert status == 1 and stderr.splitlines() == [cannot_join(port)], stderr
    assert seconds < JOIN_WAIT + 30


# ----------------------------------------------------------------------------- Ctrl-C while the imports run

def importing_torch(pid: int, seconds: float = 10) -> bool:
    """Wait until the process has started loading torch's libraries (generate.py's imports run)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if "torch" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when torch starts loading")
def test_ctrl_c_while_importing_is_one_line(random_target):
    for _ in range(3):  # the signal must land inside the imports (torch's take a second or more)
        process = subprocess.Popen([sys.executable, "generate.py", *map(str, argv_for(random_target))], cwd=ROOT,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        hit = importing_torch(process.pid)
        if hit:
            process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
        if hit and stdout == "":  # no "Loaded ...": it stopped before the run began
            break
    else:
        pytest.skip("could not send SIGINT while generate.py was importing")
    assert process.returncode == 130 and stderr.strip() == "error: interrupted", stderr


COMMANDS = ["generate.py", "quantize.py", "eval.py", "serve.py", "scripts/convert_hf_checkpoint.py",
            "scripts/convert_gguf_checkpoint.py", "scripts/compile_model.py", "scripts/train_tiny.py",
            *(f"scripts/{p.name}" for p in sorted((ROOT / "scripts").glob("bench*.py"))
              if p.name not in ("benchlib.py", "bench_serve.py"))]  # bench_serve.py loads no torch
INTERRUPTING_TORCH = "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_ctrl_c_while_any_command_imports_is_one_line(command, tmp_path):
    """Every command that loads torch: Ctrl-C as it loads, made certain by a stand-in torch that interrupts its own
    import (a new interpreter without the real torch: a tenth of a second)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(INTERRUPTING_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, command], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 130 and result.stderr.strip() == "error: interrupted", result.stderr


def test_the_prompts_forward_beyond_memory_is_refused_before_it_runs(random_target, monkeypatch):
    """The first forward holds [B, T, vocab] logits: a batch whose caches fit but whose prompt forward does not was
    killed by the kernel's out-of-memory killer with no word; it is refused with the flags to lower."""
    model = generation.load_model(random_target)
    caches = sum(generation.cache_bytes(model, 64, 96))
    work = generation.forward_bytes(model, 64, 80)
    assert work > model.args.vocab_size * 64 * 80 * 4
    monkeypatch.setattr(generation, "available_memory", lambda device: caches + work // 2)
    with pytest.raises(errors.UserError, match="first forward over 64 x 80 tokens.*`batch_size`"):
        generation.reserve_caches(model, 64, 96, tokens=80)
    assert model.max_batch_size < 64  # nothing allocated
    monkeypatch.setattr(generation, "available_memory", lambda device: caches + work + 1)
    generation.reserve_caches(model, 64, 96, tokens=80)
    assert model.max_batch_size == 64


@pytest.mark.slow  # lm-eval imports: seconds
def test_eval_refuses_an_unknown_task_and_a_batch_beyond_memory_before_scoring(random_target, tmp_path, monkeypatch):
    """An unknown lm-eval task was named only after the whole perplexity run; eval's caches were allocated unchecked
    (a huge --batch_size was killed by the kernel), and a batch larger than the text's chunks only held memory."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks
    from types import SimpleNamespace
    import eval as evaluation
    # lm-eval's own index of its tasks (seconds) knows no such task either: test_eval's lm-eval run checks the name
    # against it, this checks that the name is checked before scoring
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None: SimpleNamespace(all_tasks=["a_task"]))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and looked at the dog. " * 200)
    scored = []
    monkeypatch.setattr(evaluation, "perplexity", lambda *a, **k: scored.append(1))
    settings = evaluation.Settings(checkpoint_path=str(random_target), text=str(text), ctx=64, tasks=["nosuchtask"])
    with pytest.raises(errors.UserError, match="nosuchtask"):
        evaluation.run(settings, say=lambda *a: None)
    assert not scored
    monkeypatch.undo()
    model = generation.load_model(random_target)
    tokens = list(range(5, 5 + 64 * 6))
    capped = evaluation.perplexity(model, tokens, 64, batch_size=10**9)
    assert capped["perplexity"] == pytest.approx(evaluation.perplexity(model, tokens, 64, batch_size=6)["perplexity"])
    monkeypatch.setattr(generation, "available_memory", lambda device: 1024)
    with pytest.raises(errors.UserError, match="`batch_size` or `ctx`"):
        evaluation.perplexity(generation.load_model(random_target), tokens, 64, batch_size=6)


def test_chat_input_that_is_not_utf8_is_one_line(monkeypatch):
    """stdin hands undecodable bytes over as lone surrogates (surrogateescape), which the tokenizer cannot encode."""
    monkeypatch.setattr("builtins.input", lambda question: "caf\udce9")
    with pytest.raises(errors.UserError, match="not UTF-8"):
        cli.read_line("? ")


def test_a_chat_turn_beyond_the_context_does_not_blame_max_new_tokens(random_target, monkeypatch, capsys):
    """A conversation's turn too long for the model was reported as "`--max_new_tokens` (1) ...: lower
    --max_new_tokens", a value the user never gave and whose lowering cannot help."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("x " * 400 + "\n"))
    result = run_cli(capsys, "--checkpoint_path", random_target, "--max_new_tokens", 3, "--device", "cpu", "--chat")
    assert_one_line(result, "conversation", "context 256")
    assert "max_new_tokens" not in result[1][0]


def test_too_many_draft_tokens_before_the_model_is_known_says_the_limit():
    with pytest.raises(errors.UserError) as e:
        generation.Speculation(1000).check(True)
    assert "at most 256" in str(e.value) and "None" not in str(e.value)


def test_train_draft_head_refuses_a_learning_rate_before_distilling(random_target, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_draft_head
    for lr in ("nan", "-1", "0", "inf"):
        with pytest.raises(errors.UserError, match="`lr`"):
            train_draft_head.main(["--checkpoint_path", str(random_target), "--out", str(tmp_path / "head"),
                                   "--lr", lr])
    assert not (tmp_path / "head").exists()


def test_train_draft_head_refuses_an_out_it_would_clobber_before_distilling(random_target, tmp_path, monkeypatch):
    """--out the checkpoint's own directory had its config.json replaced by the head's after the whole training (the
    checkpoint no longer loaded); a --top_k past the vocabulary was a traceback at the first distilled batch."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_draft_head
    ckpt = checkpoint_copy(random_target, tmp_path / "ckpt")
    other = tmp_path / "other"  # another model's directory
    other.mkdir()
    shutil.copy(ckpt.parent / "config.json", other)
    (tmp_path / "notes.txt").write_text("notes\n")
    before = {p: p.read_bytes() for p in (*ckpt.parent.iterdir(), other / "config.json", tmp_path / "notes.txt")}
    distilled = []
    monkeypatch.setattr(train_draft_head, "distilled_answers", lambda *a: distilled.append(1))
    for out, expect in ((ckpt.parent, "holds a model's config.json"), (other, "holds a model's config.json"),
                        (tmp_path / "notes.txt", "is a file"), (tmp_path / "head", "`top_k` 100000")):
        with pytest.raises(errors.UserError, match=expect):
            train_draft_head.main(["--checkpoint_path", str(ckpt), "--out", str(out), "--top_k", "100000"])
    assert not distilled and not (tmp_path / "head").exists()
    assert {p: p.read_bytes() for p in before} == before
    assert set(ckpt.parent.iterdir()) | set(other.iterdir()) <= set(before)


def test_compile_model_refuses_a_batch_beyond_memory_before_building(random_target, monkeypatch):
    """scripts/compile_model.py --batch_size 1000000000 built its graphs and was then killed by the kernel's
    out-of-memory killer, with no word; its caches are checked first."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import compile_model
    monkeypatch.setattr(generation, "available_memory", lambda device: 1 << 20)
    monkeypatch.setattr(generation.Generator, "generate", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(errors.UserError, match="KV cache of 1000000000 rows.*lower `batch_size`"):
        compile_model.compile_model(random_target, batch_sizes=[10**9])


def test_a_benchmark_only_that_names_nothing_is_refused_before_timing():
    """`--only` with a name that matches no configuration ran the baselines for minutes, then an empty table."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib
    configs = {"chain K=5": 1, "chain K=auto": 2}
    assert benchlib.pick(configs, "") == configs and benchlib.pick(configs, "chain K=auto") == {"chain K=auto": 2}
    assert benchlib.pick(["eager", "regional"], "regional", ";") == ["regional"]
    with pytest.raises(errors.UserError, match="'nomatch' names no configuration here; choose from: chain K=5"):
        benchlib.pick(configs, "chain K=5,nomatch")


BENCH_COUNTS = {"bench": "--repeats", "bench_a8": "--turns", "bench_batched": "--k", "bench_compile": "--new_tokens",
                "bench_crossdraft": "--prompts", "bench_gpu": "--repeats", "bench_quality": "--chunks",
                "bench_real": "--repeats", "bench_sampling": "--calls", "bench_speculative": "--prompt_tokens"}


@pytest.mark.parametrize("script, flag", BENCH_COUNTS.items(), ids=BENCH_COUNTS.keys())
def test_a_benchmark_count_of_zero_is_refused_before_timing(script, flag, monkeypatch):
    """`--repeats 0` ran every build and warm-up, then failed in min() of no times (a traceback); `--threads -1` in
    torch.set_num_threads."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import importlib
    bench = importlib.import_module(script)
    monkeypatch.setattr(bench.benchlib, "measure_bandwidth", lambda *a, **k: pytest.fail("timed before the check"))
    with pytest.raises(errors.UserError, match=f"{flag} must be >= 1, got 0"):
        bench.main([flag, "0"])
    if script not in ("bench_gpu",):  # its threads are the GPU's
        with pytest.raises(errors.UserError, match="--threads must be >= [01], got -1"):
            bench.main(["--threads", "-1"])


def test_a_template_that_renders_nothing_says_so():
    """It was reported later as "the prompt is empty", though the user gave one."""
    with pytest.raises(errors.UserError, match="renders the conversation as nothing"):
        TemplateOnly("{% if false %}x{% endif %}").render_chat([{"role": "user", "content": "hi"}])


def test_bench_serve_passes_on_the_servers_own_line_when_it_stops_before_ready(tmp_path):
    """It said only "serve.py exited with status 1", hiding why."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tempfile
    import bench_serve
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('error: no such port')"], stderr=log)
        process.wait()
        with pytest.raises(SystemExit, match=r"serve.py exited with status 1 before it was ready \(no such port\)"):
            bench_serve.wait_ready(1, [process], timeout=30, log=log)
        # a server of several processes (ranks): any one that exits first is the failure
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(SystemExit, match=r"serve.py \(process 2 of 2\) exited with status 1 .*no such port"):
                bench_serve.wait_ready(1, [alive, process], timeout=30, log=log)
        finally:
            alive.kill()
            alive.wait()
