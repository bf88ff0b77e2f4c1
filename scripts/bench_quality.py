"""What quantization costs in quality: each of our files of a real model against its fp32 checkpoint, beside
llama.cpp's Q8_0 and Q4_1 of the same model, on the same text and the same chunks (eval.py's measures: perplexity,
KL(fp32 || file), same top token, RMS of the change in the next token's probability).

    python scripts/bench_quality.py                       # SmolLM2-135M-Instruct of scripts/demo.sh
    python scripts/bench_quality.py --chunks 64 --json bench_results/quality.json

llama.cpp (llama-cpp-python, when installed) reads our token ids and returns every position's logits, so both
sides score exactly the same tokens. The text defaults to the Python standard library's pydoc_data/topics.py
(ships with Python: offline). Note for SmolLM2 from its Q4_1 GGUF: that "fp32" checkpoint is the Q4_1 file
dequantized, so llama.cpp's Q4_1 is the base itself up to float rounding, and its Q8_0 is a requantization of it.
"""
import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402
import generation  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

# eval.py's measures (chunks, the scored span, the tally), loaded from its file as its tests load it: a command line
# is never imported, and these are exactly what eval.py reports
_spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
evaluation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evaluation)


def llama_cpp_quality(gguf: Path, chunks: torch.Tensor, base, threads: int) -> dict:
    """eval.py's measures for a GGUF file through llama.cpp, on chunks [n, ctx] of our ids, against `base`."""
    import numpy as np
    from llama_cpp import Llama
    ctx = chunks.shape[1]
    llm = Llama(model_path=str(gguf), n_ctx=ctx, n_batch=ctx, n_threads=threads, logits_all=True, verbose=False)
    logits_at, targets_at = evaluation.scored_span(ctx)
    base.setup_caches(1, ctx)
    positions = torch.arange(ctx).view(1, ctx)
    tally = evaluation.Tally()
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk.tolist())
        logits = torch.from_numpy(np.array(llm.scores[:ctx], dtype=np.float32))[logits_at]  # [ctx/2 - 1, V]
        with torch.no_grad():
            base_logits = evaluation.chunk_logits(base, chunk.view(1, ctx), positions, logits_at.start,
                                                  logits_at.stop)[0]
        tally.add(logits[:, : base_logits.shape[-1]], chunk[targets_at], base_logits)
    return tally.result()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, default=ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--gguf", type=Path, default=ROOT / "checkpoints/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--text", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data/topics.py")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/quality.json")
    args = p.parse_args(argv)
    benchlib.check_counts(args, "ctx", "chunks", "threads", zero_means_default=())
    torch.set_num_threads(args.threads)
    model_pth = args.checkpoint_dir / "model.pth"
    if not model_pth.is_file():
        sys.exit(f"error: {model_pth} not found: run bash scripts/demo.sh (or convert a checkpoint) first")
    tokenizer = get_tokenizer(args.checkpoint_dir)
    tokens = tokenizer.encode(args.text.read_text())
    bos_id = evaluation.bos_of(tokenizer)
    chunks = evaluation.make_chunks(tokens, args.ctx, bos_id)[: args.chunks]
    base = generation.load_model(model_pth)
    variants = {"ours fp32 (itself)": (model_pth, torch.float32), "ours bf16": (model_pth, torch.bfloat16),
                "ours int8": (benchlib.quantized_checkpoint(model_pth, "int8"), torch.float32)}
    for group in (32, 64, 128):  # the group sizes that divide every layer's input size
        if all(n % group == 0 for n in (base.args.dim, base.args.intermediate_size)):
            variants[f"ours int4 g{group}"] = (benchlib.quantized_checkpoint(model_pth, "int4", group), torch.float32)
    # 8-bit activations in integer dot products (kernels_a8.cpp), llama.cpp's Q8_0 / Q4_1 x Q8 pairing
    variants["ours int8-a8"] = (benchlib.quantized_checkpoint(model_pth, "int8-a8"), torch.float32)
    for group in (32, 64):  # g64: 4.5 bits a weight, as llama.cpp's Q4_0
        if all(n % group == 0 for n in (base.args.dim, base.args.intermediate_size)):
            variants[f"ours int4-a8 g{group}"] = (benchlib.quantized_checkpoint(model_pth, "int4-a8", group),
                                                  torch.float32)
    rows = []
    for name, (path, dtype) in variants.items():
        model = generation.load_model(path, precision=dtype)
        result = evaluation.perplexity(model, tokens, args.ctx, base=base, bos_id=bos_id, limit_chunks=args.chunks)
        rows.append(dict(config=name, **result))
        print(f"  {name}: perplexity {result['perplexity']:.4f}, KL {result['kl_mean']:.6f}", flush=True)
    try:
        peers = {"llama.cpp Q4_1": args.gguf, "llama.cpp Q8_0": benchlib.requantized_q8_0(args.gguf)}
        for name, gguf in peers.items():
            result = llama_cpp_quality(gguf, chunks, base, args.threads)
            rows.append(dict(config=name, **result))
            print(f"  {name}: perplexity {result['perplexity']:.4f}, KL {result['kl_mean']:.6f}", flush=True)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows", flush=True)
    print()
    benchlib.print_table(rows, ["config", "perplexity", "perplexity_stderr", "kl_mean", "kl_max", "same_top_token",
                                "rms_dp", "tokens_scored"])
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "rows": rows,
                                    "settings": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    sys.exit(run_cli(main))
