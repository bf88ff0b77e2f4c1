"""eval.py: perplexity as llama-perplexity computes it, checked against transformers on the same chunks; KL from a base
model; the lm-eval adapter against direct log-probabilities; the command line's errors, one line each.

The reference model is a tiny LlamaForCausalLM built with transformers and converted as tests/test_convert.py does;
the text is the standard library's documentation prose (pydoc_data/topics.py), which the tiny tokenizer never saw.
"""
import json
import math
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import convert_hf_checkpoint as convert
import eval as evaluation
import quantize
from decode import Sampling
from errors import UserError
from generation import Generator, load_model
from helpers import ROOT
from tokenizer import get_tokenizer

transformers = pytest.importorskip("transformers")

CTX = 64
TEXT = Path(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py").read_text(encoding="utf-8")[:6000]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, tokenizer_model):
    """(transformers model, our converted model.pth with the tiny sentencepiece tokenizer beside it)."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("hf_eval")
    hf.save_pretrained(directory)
    path = convert.main(["--checkpoint_dir", str(directory)])
    shutil.copy(tokenizer_model, directory / "tokenizer.model")
    return hf, path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def ours(path, **kwargs) -> dict:
    tokenizer = get_tokenizer(Path(path).parent)
    tokens = tokenizer.encode(TEXT)
    return evaluation.perplexity(load_model(path), tokens, CTX, bos_id=evaluation.bos_of(tokenizer), **kwargs)


def transformers_reference(hf, path) -> dict:
    """llama-perplexity's recipe written out independently: the tokenizer's own ids (BOS included), ctx-token chunks,
    BOS first in each, the tokens at ctx/2 + 1 .. ctx - 1 scored from transformers' logits."""
    stream = get_tokenizer(Path(path).parent).encode_prompt(TEXT)
    assert stream[0] == 1  # this tokenizer adds BOS
    n = len(stream) // CTX
    chunks = torch.tensor(stream[: n * CTX]).view(n, CTX)
    chunks[:, 0] = 1
    with torch.no_grad():
        logp = torch.log_softmax(hf(chunks).logits.double(), -1)  # [n, ctx, V]
    first = CTX // 2
    nll = -logp[:, first:-1].gather(-1, chunks[:, first + 1:].unsqueeze(-1)).flatten()
    mean = nll.mean().item()
    stderr = math.sqrt(((nll * nll).mean().item() - mean * mean) / (len(nll) - 1))
    return {"perplexity": math.exp(mean), "perplexity_stderr": math.exp(mean) * stderr, "tokens_scored": len(nll),
            "chunks": n}


# ----------------------------------------------------------------------------- perplexity

def test_make_chunks_as_llama_perplexity():
    tokens = list(range(10, 30))  # 20 text tokens
    with_bos = evaluation.make_chunks(tokens, 8, bos_id=1)  # stream [1, 10..29]: 21 tokens, 2 chunks of 8
    assert with_bos.tolist() == [[1, 10, 11, 12, 13, 14, 15, 16], [1, 18, 19, 20, 21, 22, 23, 24]]
    assert evaluation.make_chunks(tokens, 8).tolist() == [list(range(10, 18)), list(range(18, 26))]
    assert evaluation.scored_span(8) == (slice(4, 7), slice(5, 8))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_perplexity_matches_transformers(hf_checkpoint, batch_size):
    hf, path = hf_checkpoint
    ref = transformers_reference(hf, path)
    got = ours(path, batch_size=batch_size)
    assert ref["chunks"] >= 4 and got["chunks"] == ref["chunks"] and got["ctx"] == CTX
    assert got["tokens_scored"] == ref["tokens_scored"] == ref["chunks"] * (CTX // 2 - 1)
    assert got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-3)
    assert got["perplexity_stderr"] == pytest.approx(ref["perplexity_stderr"], rel=1e-3)


BROKEN = {  # scoring rules a bug could produce; each must disagree with transformers
    "first half scored": lambda ctx: (slice(0, ctx // 2 - 1), slice(1, ctx // 2)),
    "labels shifted by one (each position scored on its own input)": lambda ctx: (slice(ctx // 2, ctx - 1),
                                                                                  slice(ctx // 2, ctx - 1)),
    "labels shifted by one (two ahead)": lambda ctx: (slice(ctx // 2, ctx - 2), slice(ctx // 2 + 2, ctx)),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_comparison_catches_broken_scoring(hf_checkpoint, monkeypatch, name):
    """The comparison above has teeth: each of these bugs moves the perplexity well past its 0.1% tolerance."""
    hf, path = hf_checkpoint
    ref = transformers_reference(hf, path)
    monkeypatch.setattr(evaluation, "scored_span", BROKEN[name])
    got = ours(path, batch_size=2)
    assert got["perplexity"] != pytest.approx(ref["perplexity"], rel=1e-2), name


def test_kl_of_a_model_against_itself_is_zero(hf_checkpoint):
    _, path = hf_checkpoint
    got = ours(path, batch_size=2, base=load_model(path))
    assert got["kl_mean"] == pytest.approx(0, abs=1e-7) and got["kl_max"] == pytest.approx(0, abs=1e-6)
    assert got["same_top_token"] == 1.0 and got["rms_dp"] == pytest.approx(0, abs=1e-7)
    assert got["base_perplexity"] == pytest.approx(got["perplexity"], rel=1e-6)


def test_int8_against_its_fp32_base(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    directory = tmp_path / "ckpt"
    shutil.copytree(path.parent, directory)
    int8 = quantize.quantize_checkpoint(directory / "model.pth", "int8")
    got = ours(int8, batch_size=2, base=load_model(directory / "model.pth"))
    assert 0 < got["kl_mean"] < 0.02 and got["kl_mean"] <= got["kl_max"]
    assert got["same_top_token"] >= 0.9 and 0 < got["rms_dp"] < 0.05
    assert got["perplexity"] == pytest.approx(got["base_perplexity"], rel=0.05)


# ----------------------------------------------------------------------------- the lm-eval adapter, without lm-eval

@pytest.fixture(scope="module")
def adapter(hf_checkpoint):
    return evaluation.HarnessAdapter(Generator.build(hf_checkpoint[1]), max_length=128, batch_size=3)


def direct_logprob(model, ids: list, n: int) -> float:
    """The summed log-probability of the last n of ids, from one forward over all of them."""
    model.setup_caches(1, len(ids))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1)).double(), -1)[0]
    return sum(logp[k - 1, ids[k]].item() for k in range(len(ids) - n, len(ids)))


def test_loglikelihood_is_the_models_log_probability(adapter, hf_checkpoint):
    model, tokenizer = load_model(hf_checkpoint[1]), adapter.tokenizer
    requests = [("The quick brown", " fox jumps"), ("def main(", "):"), ("x = ", "1"), ("", "Hello world"),
                ("In the beginning ", "was the word")]
    got = adapter.loglikelihood(requests)
    one_by_one = evaluation.HarnessAdapter(adapter.generator, max_length=128, batch_size=1).loglikelihood(requests)
    for (context, continuation), (logprob, greedy), (alone, _) in zip(requests, got, one_by_one):
        if context.endswith(" "):  # lm-eval moves the context's trailing space into the continuation
            context, continuation = context[:-1], " " + continuation
        whole = tokenizer.encode_prompt(context + continuation)
        n = len(whole) - len(tokenizer.encode_prompt(context)) if context else len(whole) - 1
        assert logprob == pytest.approx(direct_logprob(model, whole, n), abs=1e-4)
        assert alone == pytest.approx(logprob, abs=1e-4)  # right-padding in a batch changes nothing
        assert logprob < 0 and isinstance(greedy, bool)


def test_loglikelihood_rolling_predicts_every_token_once(adapter, hf_checkpoint, monkeypatch):
    model, text = load_model(hf_checkpoint[1]), TEXT[:120]
    ids = adapter.tokenizer.encode_prompt(text)
    assert len(ids) <= 128  # one window: the whole text in one forward
    assert adapter.loglikelihood_rolling([text])[0] == pytest.approx(direct_logprob(model, ids, len(ids) - 1),
                                                                     abs=1e-3)
    short = evaluation.HarnessAdapter(adapter.generator, max_length=16)
    seen = []
    monkeypatch.setattr(short, "score", lambda pairs: seen.extend(pairs) or [(0.0, True)] * len(pairs))
    short.loglikelihood_rolling([text])
    assert [t for _, continuation in seen for t in continuation] == ids[1:]
    assert all(len(c) + len(n) <= 17 and len(n) <= 16 for c, n in seen) and len(seen) > 2


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(adapter):
    context = "The quick brown"
    rows, _ = adapter.generator.generate(adapter.tokenizer.encode_prompt(context), 12,
                                         Sampling(temperature=0))
    full = adapter.tokenizer.decode([t for t in rows[0] if t not in adapter.generator.eos_ids])
    stop = full[len(full) // 2:][:2]
    got = adapter.generate_until([(context, {"until": [stop], "max_gen_toks": 12}), (context, {"max_gen_toks": 12})])
    assert got == [full[: full.find(stop)], full]


# ----------------------------------------------------------------------------- the command line

def test_stats_json_has_every_key(hf_checkpoint, text_file, tmp_path):
    _, path = hf_checkpoint
    out = tmp_path / "quality.json"
    result = evaluation.main(["--checkpoint_path", str(path), "--text", str(text_file), "--ctx", str(CTX),
                              "--batch_size", "2", "--base", str(path), "--limit_chunks", "3",
                              "--stats_json", str(out)])
    stats = json.loads(out.read_text())
    assert stats == pytest.approx(result)
    assert set(stats) == {"perplexity", "perplexity_stderr", "tokens_scored", "chunks", "ctx", "kl_mean", "kl_max",
                          "same_top_token", "rms_dp", "tokens_per_sec"}
    assert stats["chunks"] == 3 and stats["tokens_scored"] == 3 * (CTX // 2 - 1) and stats["same_top_token"] == 1.0


def user_error(argv) -> str:
    with pytest.raises(UserError) as e:
        evaluation.main(argv)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_user_errors_name_the_flag(hf_checkpoint, text_file, tmp_path, monkeypatch):
    _, path = hf_checkpoint
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:100])
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")

    def no_model_work(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(evaluation.Generator, "build", no_model_work)
    monkeypatch.setattr(evaluation, "load_model", no_model_work)
    run = ["--checkpoint_path", str(path), "--text", str(text_file)]
    message = user_error(["--checkpoint_path", str(path), "--text", str(short), "--ctx", "64"])
    assert message.startswith("--text") and "fewer than two chunks of --ctx 64" in message
    assert "--ctx must be an even number" in user_error(run + ["--ctx", "63"])
    assert "--ctx 512 exceeds the model's context of 256" in user_error(run)
    assert "checkpoint not found" in user_error(["--checkpoint_path", str(tmp_path / "nope.pth"), "--text",
                                                 str(text_file)])
    assert "--text" in user_error(run[:2] + ["--text", str(tmp_path / "missing.txt"), "--ctx", "64"])
    assert "--stats_json" in user_error(run + ["--ctx", "64", "--stats_json", str(notes)])
    assert notes.read_text() == "my notes\n"
    assert "--base" in user_error(["--checkpoint_path", str(path), "--base", str(path)])
    other = tmp_path / "other"
    shutil.copytree(path.parent, other)
    (other / "tokenizer.model").unlink()
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(511)} | {"[UNK]": 511}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(other / "tokenizer.json"))
    assert "does not share the tokenizer" in user_error(run + ["--ctx", "64", "--base", str(other / "model.pth")])
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    assert "pip install lm-eval" in user_error(["--checkpoint_path", str(path), "--tasks", "tiny"])


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [(["--ctx", "64", "--text", "SHORT"], "error: --text"),
                                            (["--ctx", "7"], "error: --ctx must be an even number")])
def test_command_line_errors_are_one_line(hf_checkpoint, text_file, tmp_path, flags, message):
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:100])
    flags = [str(short) if f == "SHORT" else f for f in flags]
    result = subprocess.run([sys.executable, "eval.py", "--checkpoint_path", str(hf_checkpoint[1]), "--text",
                             str(text_file), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


# ----------------------------------------------------------------------------- lm-eval itself, offline

TASKS = {
    "tiny_choice": """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "tiny_rolling": """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}"
metric_list:
  - metric: word_perplexity
""",
    "tiny_generate": """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: [" "]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""",
}
DOCS = [{"question": "The keyword to define a function is", "choices": ["def", "class", "import"], "answer": 0},
        {"question": "A loop over a list uses", "choices": ["for", "with"], "answer": 0},
        {"question": "To leave a function early, use", "choices": ["pass", "return", "yield"], "answer": 1},
        {"question": "An exception is raised with", "choices": ["raise", "try"], "answer": 0}]


@pytest.mark.slow
def test_lm_eval_runs_a_local_task_offline(hf_checkpoint, adapter, tmp_path, monkeypatch):
    """A multiple-choice, a rolling log-likelihood and a generation task from YAML files, run by
    lm_eval.simple_evaluate with no network: each metric is the one our adapter's answers give."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks
    managers, index = {}, lm_eval.tasks.TaskManager
    # each run indexes lm-eval's thousands of task files (seconds): the second run here reuses the first's index
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None: managers.get(include_path) or
                        managers.setdefault(include_path, index(include_path=include_path)))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, yaml in TASKS.items():
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    generated = []
    generate_until = evaluation.HarnessAdapter.generate_until
    monkeypatch.setattr(evaluation.HarnessAdapter, "generate_until",
                        lambda self, requests: generated.extend(generate_until(self, requests)) or generated[-len(requests):])
    out = tmp_path / "stats.json"
    evaluation.main(["--checkpoint_path", str(hf_checkpoint[1]), "--tasks", "tiny_choice,tiny_rolling,tiny_generate",
                     "--include_path", str(tasks), "--ctx", "128", "--stats_json", str(out)])
    results = json.loads(out.read_text())["tasks"]
    assert "unknown --tasks: tiny_nothing" in user_error(["--checkpoint_path", str(hf_checkpoint[1]), "--tasks",
                                                          "tiny_nothing", "--include_path", str(tasks), "--ctx", "128"])
    picks = [max(range(len(d["choices"])), key=lambda i: adapter.loglikelihood([(d["question"], " " + d["choices"][i])])
                 [0][0]) for d in DOCS]
    expected = sum(p == d["answer"] for p, d in zip(picks, DOCS)) / len(DOCS)
    assert results["tiny_choice"]["acc,none"] == pytest.approx(expected)
    logprobs = adapter.loglikelihood_rolling([d["question"] for d in DOCS])
    words = sum(len(d["question"].split()) for d in DOCS)
    assert results["tiny_rolling"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(logprobs) / words),
                                                                            rel=1e-4)
    outputs = generate_until(adapter, [(d["question"], {"until": [" "], "max_gen_toks": 8}) for d in DOCS])
    assert sorted(generated) == sorted(outputs) and all(" " not in o for o in outputs)
    assert results["tiny_generate"]["exact_match,none"] == pytest.approx(
        sum(o == d["choices"][d["answer"]] for o, d in zip(outputs, DOCS)) / len(DOCS))
