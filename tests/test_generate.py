"""generate.py: the CLI contract (stats JSON, stopping rules, errors) and compiled == eager."""
import json
import subprocess
import sys

import pytest
import torch

import decode
import errors
import generation
from errors import UserError
from helpers import REJECT_BELOW, ROOT, chi_square_pvalue, cli, write_checkpoint

DESIGN_FIELDS = {"device", "precision", "compile", "speculative", "prompt_tokens", "samples", "tokens_per_sec",
                 "bandwidth_gbs", "model_bytes", "compile_seconds"}


def run(checkpoint, *extra, prompt="def main(", n=24):
    return cli.main(["--checkpoint_path", str(checkpoint), "--prompt", prompt, "--max_new_tokens", str(n),
                          "--num_samples", "1", "--temperature", "0", *extra])


def greedy_reference(checkpoint, prompt_ids, n):
    """Greedy decoding by full forwards over the growing sequence: no KV cache involved."""
    model = generation.load_model(checkpoint)
    ids = list(prompt_ids)
    model.setup_caches(1, len(ids) + n + 1)
    for _ in range(n):
        x = torch.tensor([ids])
        ids.append(int(model(x, torch.arange(len(ids)).view(1, -1))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_greedy_matches_full_forward_reference(random_target):
    stats = run(random_target, "--ignore_eos")
    assert stats["samples"][0]["tokens"] == greedy_reference(random_target, stats["prompt_tokens"], 24)


def test_stats_json_has_design_fields(random_target, tmp_path):
    path = tmp_path / "stats.json"
    run(random_target, "--ignore_eos", "--stats_json", str(path), n=8)
    stats = json.loads(path.read_text())
    assert DESIGN_FIELDS <= stats.keys()
    assert stats["speculative"] == "none" and stats["device"] == "cpu" and stats["precision"] == "fp32"
    sample = stats["samples"][0]
    assert len(sample["tokens"]) == 8 and sample["tokens_per_sec"] > 0 and isinstance(sample["text"], str)
    assert stats["prompt_tokens"][0] == 1  # BOS
    assert stats["model_bytes"] == sum(p.numel() * 4 for p in generation.load_model(random_target).parameters())


def test_synthetic_integer_prompt(random_target):
    stats = run(random_target, "--ignore_eos", prompt="17", n=4)
    assert len(stats["prompt_tokens"]) == 18  # BOS + 17


def test_never_more_than_max_new_tokens_and_stops_at_eos(random_target, tmp_path, tokenizer_model):
    tokens = run(random_target, "--ignore_eos", n=30)["samples"][0]["tokens"]
    for n in (1, 2, 7):
        assert run(random_target, "--ignore_eos", n=n)["samples"][0]["tokens"] == tokens[:n]
    # make the 6th greedy token the EOS id: generation must stop right after it
    eos = tokens[5]
    assert eos not in tokens[:5]
    directory = tmp_path / "eos"
    config = json.loads((random_target.parent / "config.json").read_text())
    write_checkpoint(directory, tokenizer_model, seed=0, dim=64, n_layer=2, n_head=4, n_local_heads=2,
                     vocab_size=512, block_size=256, eos_token_ids=[eos])
    assert json.loads((directory / "config.json").read_text())["hidden_size"] == config["hidden_size"]
    assert run(directory / "model.pth", n=30)["samples"][0]["tokens"] == tokens[:6]


def test_batch_rows_equal_single_row(random_target):
    single = run(random_target, "--ignore_eos", n=10)["samples"][0]["tokens"]
    batched = run(random_target, "--ignore_eos", "--batch_size", "3", n=10)["samples"][0]["batch_tokens"]
    assert batched == [single] * 3


def test_sampling_is_seeded_and_respects_top_k(random_target):
    def sampled(seed):
        return cli.main(["--checkpoint_path", str(random_target), "--prompt", "x = ", "--max_new_tokens", "12",
                              "--num_samples", "1", "--temperature", "1.0", "--top_k", "1", "--ignore_eos",
                              "--seed", str(seed)])["samples"][0]["tokens"]
    # top_k 1 at any temperature is greedy
    assert sampled(1) == sampled(2) == run(random_target, "--ignore_eos", prompt="x = ", n=12)["samples"][0]["tokens"]


@pytest.mark.parametrize("compiled", [False, True])
def test_sample_from_draws_each_row_from_its_distribution(compiled):
    """decode.sample_from (inverse CDF): every row of a batch drawn from its own row, tokens of mass 0 (at the ends,
    in the middle) never; a deliberately broken variant (the CDF's search off by one token) is rejected."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9],
                          [1e-3, 0.3, 0.3, 0.099, 0.3, 0.0]])
    draws = 60_000
    sample_from = torch.compile(decode.sample_from, dynamic=False) if compiled else decode.sample_from
    drawn = sample_from(probs.unsqueeze(0).expand(draws, -1, -1))  # [draws, 3]
    assert drawn.shape == (draws, 3)
    for row in range(3):
        counts = torch.bincount(drawn[:, row], minlength=6).double()
        assert chi_square_pvalue(counts, probs[row].double()) > REJECT_BELOW, (row, counts)
    shifted = (drawn + 1).clamp_max(5)  # broken: the token after the one drawn
    assert min(chi_square_pvalue(torch.bincount(shifted[:, row], minlength=6).double(), probs[row].double())
               for row in range(3)) < REJECT_BELOW


def test_logits_to_probs_warping():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    greedy = decode.logits_to_probs(logits, decode.Sampling(0.0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    top2 = decode.logits_to_probs(logits, decode.Sampling(1.0, top_k=2))
    assert torch.allclose(top2[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), -1)) and top2[0, 2:].sum() == 0
    p = torch.softmax(logits[0], -1)
    nucleus = decode.logits_to_probs(logits, decode.Sampling(1.0, top_p=0.6))  # p[0] = 0.5..., needs two
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(nucleus[0, :2], p[:2] / p[:2].sum())
    sharp = decode.logits_to_probs(logits, decode.Sampling(0.5))
    assert torch.allclose(sharp, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("top_k,top_p", [(None, 0.9), (5, 0.5), (3, 0.95), (40, 0.8), (None, 0.3), (2, 0.999)])
def test_top_k_then_top_p_is_the_sorted_nucleus(top_k, top_p):
    """Top-p after top-k looks only at the top-k values: the kept set is still the smallest set of the largest
    logits whose mass (after top-k) reaches top_p, as a float64 sort of the whole vocabulary finds it; ties with
    the k-th logit stay. Rows whose mass lands within 1e-5 of top_p at the boundary are float rounding's call."""
    torch.manual_seed(top_k or 0)
    logits = torch.randn(64, 300) * torch.linspace(0.3, 4.0, 64).view(-1, 1)
    logits[0, :4] = logits[0].max() + 1.0  # four tied largest logits
    got = decode.logits_to_probs(logits, decode.Sampling(0.8, top_k=top_k, top_p=top_p))
    x = logits.double() / 0.8
    if top_k is not None:
        x = x.masked_fill(x < torch.topk(x, top_k).values[:, -1:], -float("inf"))
    ranked, order = torch.sort(x, descending=True)
    mass = ranked.softmax(-1)
    before = mass.cumsum(-1) - mass
    want = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, before < top_p)
    want |= x >= torch.where(want, x, torch.inf).min(-1, keepdim=True).values  # ties with the last kept
    clear = ((before - top_p).abs() > 1e-5).all(-1)
    assert clear.sum() > 48
    assert torch.equal((got > 0)[clear], want[clear])
    assert torch.allclose(got.double()[clear], x.masked_fill(~want, -float("inf")).softmax(-1)[clear], atol=1e-6)


@pytest.mark.slow
@pytest.mark.gemm_templates
def test_compiled_equals_eager_without_recompiling(random_target):
    from torch._dynamo.utils import counters
    prompts = [torch.tensor(p) for p in ([1, 5, 9], [1, 7, 3, 3, 8, 20, 11, 4], [1, 30, 31, 32, 33, 34])]
    lengths = [12, 20, 7]
    model = generation.load_model(random_target)
    eager = [generation.generate(decode.Engine(model), p, n, decode.Sampling(), [], stop_at_eos=False)[0]
             for p, n in zip(prompts, lengths)]
    torch._dynamo.reset()
    counters.clear()
    engine = decode.compile_engine(model, "cpu", "whole", compile_prefill=True)
    warm = generation.generate(engine, prompts[0], 4, decode.Sampling(), [], stop_at_eos=False)[0]
    graphs = counters["stats"]["unique_graphs"]
    compiled = [generation.generate(engine, p, n, decode.Sampling(), [], stop_at_eos=False)[0]
                for p, n in zip(prompts, lengths)]
    assert compiled == eager and warm[0] == eager[0][0][:4]
    # other prompt lengths and decode lengths reuse the graphs compiled during warm-up
    assert counters["stats"]["unique_graphs"] == graphs
    assert graphs >= 2  # decode and prefill really were compiled


@pytest.mark.slow
def test_cli_compile_flag_reports_compile_time(random_target):
    stats = run(random_target, "--ignore_eos", "--compile", "whole", n=6)
    assert stats["compile"] is True and stats["compile_seconds"] > 0 and stats["compile_mode"] == "whole"
    plain = run(random_target, "--ignore_eos", n=6)
    assert stats["samples"][0]["tokens"] == plain["samples"][0]["tokens"] and plain["compile_mode"] == "none"


def error_of(*argv):
    with pytest.raises(UserError) as info:
        cli.main(list(argv))
    return str(info.value)


def test_clear_errors(random_target, tmp_path):
    ck = str(random_target)
    assert "checkpoint not found" in error_of("--checkpoint_path", str(tmp_path / "nope.pth"))
    assert "temperature" in error_of("--checkpoint_path", ck, "--temperature", "-1")
    assert "exceeds the model's context" in error_of("--checkpoint_path", ck, "--prompt", "200",
                                                     "--max_new_tokens", "100")
    assert "max_new_tokens" in error_of("--checkpoint_path", ck, "--max_new_tokens", "0")
    assert "top_p" in error_of("--checkpoint_path", ck, "--top_p", "1.5")
    no_tokenizer = tmp_path / "stories15M-copy"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((random_target.parent / "config.json").read_text())
    (no_tokenizer / "model.pth").write_bytes(random_target.read_bytes())
    assert "no tokenizer.model or tokenizer.json" in error_of("--checkpoint_path", str(no_tokenizer / "model.pth"))
    unknown = tmp_path / "my-mystery-model"
    unknown.mkdir()
    (unknown / "model.pth").write_bytes(random_target.read_bytes())
    assert "unknown model" in error_of("--checkpoint_path", str(unknown / "model.pth"))


@pytest.mark.slow
def test_cli_error_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(tmp_path / "missing.pth")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: checkpoint not found")


@pytest.mark.slow
def test_interactive_streams_answers(random_target):
    result = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(random_target), "--interactive",
                             "--max_new_tokens", "6", "--temperature", "0", "--ignore_eos"],
                            cwd=ROOT, input="hello\nhow are you\n", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("What is your prompt?") == 3  # two answers, then end of input
    assert result.stdout.count("tokens/s") >= 2


def test_profile_writes_a_trace(random_target, tmp_path):
    trace = tmp_path / "trace.json"
    run(random_target, "--ignore_eos", "--profile", str(trace), n=3)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)


# ----------------------------------------------------------------------------- a batch of different prompts

BATCH = ([1, 5, 9], [1, 7, 3, 3, 8, 20, 11, 4, 60, 61, 62], [1, 30, 31, 32, 33, 34], [1, 250])


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_rows_of_different_prompts_equal_each_prompt_alone(random_target, compiled):
    """Four prompts of different lengths decoded together (right-padded prefill, per-row positions): each row
    is the prompt's own greedy continuation, including a row that stops at EOS early; a second batch of other
    lengths reuses the compiled graphs."""
    from torch._dynamo.utils import counters
    model = generation.load_model(random_target)
    eager = decode.Engine(model)
    alone = [generation.generate(eager, torch.tensor(p), 16, decode.Sampling(), [], stop_at_eos=False)[0][0]
             for p in BATCH]
    eos = alone[2][5]  # row 2 meets this token early; the others may too, then they stop there as well
    want = [generation.truncate_at_eos(row, {eos}) for row in alone]
    torch._dynamo.reset()
    counters.clear()
    engine = decode.compile_engine(model, "cpu", "whole", compile_prefill=True) if compiled else eager
    got, _ = generation.generate(engine, [list(p) for p in BATCH], 16, decode.Sampling(), [eos])
    assert got == want and len(got[2]) <= 6
    graphs = counters["stats"]["unique_graphs"]
    shifted = [p[:-1] or p for p in BATCH[1:]] + [list(BATCH[0]) + [7, 7]]  # other lengths, same batch size
    got, _ = generation.generate(engine, shifted, 16, decode.Sampling(), [], stop_at_eos=False)
    assert got == [generation.generate(eager, torch.tensor(p), 16, decode.Sampling(), [], stop_at_eos=False)[0][0]
                   for p in shifted]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for other prompt lengths


def test_prompts_file_rows_in_stats_json(random_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def main("}\nHello, my name is\n\n{"prompt": "x = [1, 2"}\n')
    stats = cli.main(["--checkpoint_path", str(random_target), "--prompts_file", str(prompts),
                           "--batch_size", "2", "--max_new_tokens", "8", "--temperature", "0", "--ignore_eos",
                           "--stats_json", str(tmp_path / "stats.json")])
    rows = json.loads((tmp_path / "stats.json").read_text())["rows"]
    assert [row["prompt"] for row in rows] == ["def main(", "Hello, my name is", "x = [1, 2"]
    for row in rows:  # every row equals its prompt run alone
        alone = run(random_target, "--ignore_eos", prompt=row["prompt"], n=8)
        assert row["tokens"] == alone["samples"][0]["tokens"] and row["prompt_tokens"] == alone["prompt_tokens"]
    assert len(stats["samples"]) == 2 and stats["samples"][0]["rows"] == 2


def test_a_prompts_file_prompt_too_long_is_named(random_target, tmp_path):
    """The context check ran on the longest prompt without saying which one it was."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\n\n" + "y " * 600 + "\nHello\n")
    with pytest.raises(UserError, match=r"--prompts_file .*prompts.txt, its prompt 2 \(the longest"):
        cli.main(["--checkpoint_path", str(random_target), "--prompts_file", str(prompts), "--max_new_tokens", "8"])


# ----------------------------------------------------------------------------- failures of the machine, odd inputs

def test_a_tiny_temperature_decodes_greedily(random_target):
    """Below decode.MIN_TEMPERATURE the division would overflow to inf / NaN: such a temperature is greedy."""
    assert decode.Sampling(1e-300).temperature == 0 and decode.Sampling(0.5).temperature == 0.5
    greedy = run(random_target, "--ignore_eos", n=8)["samples"][0]["tokens"]
    for extra in ([], ["--draft_ngram", "2", "--speculate_k", "3"]):
        tiny = run(random_target, "--ignore_eos", "--temperature", "1e-300", *extra, n=8)
        assert tiny["samples"][0]["tokens"] == greedy


def test_only_ascii_digits_make_a_synthetic_prompt(random_target):
    assert generation.is_synthetic(" 12 ") and not generation.is_synthetic("²") and not generation.is_synthetic("1a")
    stats = run(random_target, "--ignore_eos", prompt="²", n=2)
    assert len(stats["prompt_tokens"]) < 5  # the text "²", not two synthetic tokens or a crash


def test_failures_of_the_machine_are_one_line():
    """OSError by errno, memory and nesting depth: one line each; anything else is a bug and keeps its traceback."""
    line = errors.expected_failure(PermissionError(13, "Permission denied", "/somewhere/stats.json"))
    assert line.startswith("error: Permission denied: /somewhere/stats.json")
    assert errors.expected_failure(OSError(28, "No space left on device")).startswith("error: No space left")
    assert "out of memory" in errors.expected_failure(MemoryError())
    assert "out of memory" in errors.expected_failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you "
                                                                    "tried to allocate 10 bytes"))
    assert "nests too deeply" in errors.expected_failure(RecursionError())
    assert errors.expected_failure(ValueError("a bug")) is None

    def fails():
        raise PermissionError(13, "Permission denied", "/x")
    assert errors.run_cli(fails) == 1


def test_a_full_disk_behind_a_librarys_own_exception_is_one_line():
    """torch.compile's inductor reports a full disk (its cache) as its own exception with the OSError as the cause:
    one line naming the file. Any other OSError behind a failure (one the code handled, then failed otherwise) is
    not the reason: that failure keeps its traceback."""
    try:
        try:
            raise OSError(28, "No space left on device", "/cache/inductor/kernel.cpp")
        except OSError as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as e:
        wrapped = e
    assert errors.expected_failure(wrapped) == ("error: No space left on device: /cache/inductor/kernel.cpp: free "
                                                "some space or write elsewhere")
    try:
        try:
            raise FileNotFoundError(2, "No such file or directory", "/x/stored.json")
        except FileNotFoundError:
            raise ValueError("a bug while going on without it")
    except ValueError as e:
        assert errors.expected_failure(e) is None


@pytest.mark.slow
def test_a_closed_stdout_ends_quietly(random_target):
    """`generate.py ... | head -1`: the reader goes away; no BrokenPipeError traceback."""
    command = (f"{sys.executable} generate.py --checkpoint_path {random_target} --num_samples 3 --max_new_tokens 40 "
               f"--ignore_eos | head -c 1")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.returncode in (0, 141)


def test_stats_json_replaces_only_files_this_program_wrote(random_target, tmp_path):
    """A JSON file of someone else's (config.json, tokenizer.json) is refused before the run and left as it was; an
    earlier stats file is replaced."""
    config = random_target.parent / "config.json"
    before = config.read_bytes()
    with pytest.raises(UserError, match="--stats_json .*not a stats or trace file"):
        cli.main(["--checkpoint_path", str(random_target), "--stats_json", str(config), "--num_samples", "1"])
    assert config.read_bytes() == before
    out = tmp_path / "stats.json"
    for _ in range(2):
        run(random_target, "--stats_json", str(out), n=2)
    assert json.loads(out.read_text())["tokens_per_sec"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_holds_only_the_converted_weights_while_loading(tmp_path, tokenizer_model):
    """An fp32 file loaded as bf16: each tensor is converted before it moves, so the GPU's peak is the bf16 weights
    (what check_memory counted), not the fp32 file's size on top of them."""
    path = write_checkpoint(tmp_path / "m", tokenizer_model, seed=0, dim=256, n_layer=4, n_head=4, vocab_size=512,
                            block_size=64)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = generation.load_model(path, "cuda", torch.bfloat16)
    held = torch.cuda.memory_allocated() - base
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - base <= held + (1 << 20)
    assert held <= generation.weight_bytes(model, "cuda", torch.bfloat16) + (1 << 20)
