"""Build and store every compiled graph a configuration needs, so that later runs start at full speed.

    python scripts/compile_model.py --checkpoint_path checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth \
        --draft_checkpoint_path checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth --speculate_k 5
    python scripts/compile_model.py --checkpoint_path .../model.pth --draft_head .../head   # the head's graphs too

On CUDA (and for `--compile whole` / `regional`) the graphs compile in the process and what is stored is their
kernels (compilation.CompileCache), so later processes skip code generation, builds and autotuning.
A stored graph serves one batch size and one cache length (prompt + new tokens, rounded up to a power of two from
256); it is dynamic in the tokens per call, so decode, verification and prefill share it. --max_tokens lists the
cache lengths to build (default 256 and 512: what generate.py's default 200 new tokens after a prompt of up to 300
tokens need). Graphs already stored and valid are loaded, not rebuilt. Prints what was built, its time and size.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
from generation import Generator, Sampling, Speculation, check_engine_settings  # noqa: E402


def compile_model(checkpoint_path, draft_checkpoint_path=None, speculation=None, batch_size=1, max_tokens=(256, 512),
                  mode="auto", device="cpu", precision=None, draft_head=None):
    """Build (or load) the graphs of each cache length in max_tokens; returns one row per stored package built or
    found: path, bytes, and the seconds this run spent on it."""
    from decode import PRECISIONS
    dtype = PRECISIONS[precision or ("bf16" if device.startswith("cuda") else "fp32")]
    generator = Generator.build(checkpoint_path, device, dtype, draft_checkpoint_path, speculation, mode,
                                batch_size=batch_size, draft_head=draft_head)
    if not generator.target.mode.startswith("stored") and generator.target.cache is None:
        raise UserError(f"`compile` {mode} stores nothing here ({generator.target.mode}): use auto or autotune")
    drafter = getattr(generator.speculator, "drafter", None)
    models = [(generator.model, Path(generator.model.checkpoint_path).stem),
              (getattr(drafter, "draft_model", None), None), (getattr(drafter, "head", None), "head")]
    rows = []
    for tokens in sorted(set(max_tokens)):  # ascending: each length grows the caches (they never shrink)
        if tokens < 16 or tokens > generator.model.args.block_size:
            raise UserError(f"`max_tokens` {tokens} must be between 16 and the model's context "
                            f"({generator.model.args.block_size})")
        start = time.perf_counter()
        generator.reserve(batch_size, tokens - 1 - generator.lookahead)
        # a few tokens: every graph the configuration runs is called (speculative runs verify a few trees)
        generator.generate([1] * 4, max(2, min(24, tokens // 4)), Sampling(0.0), stop_at_eos=False,
                           batch_size=batch_size)
        rows += [{"model": str(model.checkpoint_path), "stem": stem or Path(model.checkpoint_path).stem,
                  "batch": batch_size, "positions": model.max_seq_length,
                  "seconds": round(time.perf_counter() - start, 1)} for model, stem in models if model is not None]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--speculate_k", type=int, default=5)
    p.add_argument("--tree_nodes", type=int, default=None)
    p.add_argument("--draft_ngram", type=int, default=0, metavar="N")
    p.add_argument("--draft_head", type=Path, default=None, help="a draft head's directory: its graphs too")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--max_tokens", type=int, nargs="+", default=[256, 512],
                   help="cache lengths (prompt + new tokens) to build graphs for")
    p.add_argument("--compile", default="auto", choices=["auto", "autotune", "whole", "regional"],
                   help="auto / autotune: stored graphs on CPU; CUDA and the in-process modes store their kernels")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    args = p.parse_args()
    check_engine_settings(args.compile, args.precision, args.device)
    if args.batch_size < 1:
        raise UserError("`batch_size` must be >= 1")
    speculation = Speculation(args.speculate_k, args.tree_nodes, args.draft_ngram)
    start = time.perf_counter()
    rows = compile_model(args.checkpoint_path, args.draft_checkpoint_path, speculation, args.batch_size,
                         args.max_tokens, args.compile, args.device, args.precision, args.draft_head)
    print(f"{'model':60s} {'batch':>5s} {'positions':>9s} {'s':>7s} {'MB':>8s}")
    for row in rows:
        import artifacts
        directory = artifacts.directory_for(row["model"])
        stem = f"{row['stem']}-b{row['batch']}of{row['batch']}-s{row['positions']}-"
        size = sum(p.stat().st_size for p in directory.glob(stem + "*.so"))
        size += sum(p.stat().st_size for p in directory.glob(f"{row['stem']}-kernels-*.bin"))
        print(f"{row['model']:60s} {row['batch']:5d} {row['positions']:9d} {row['seconds']:7.1f} {size / 1e6:8.1f}")
    print(f"stored in {artifacts.directory_for(args.checkpoint_path)} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    sys.exit(run_cli(main))
