"""Generate text with a Llama-family checkpoint: the command line over generation.py (flags, printing, exit codes).

    python generate.py --checkpoint_path checkpoints/tiny/target/model.pth --prompt "def main(" --compile
    python generate.py ... --draft_checkpoint_path checkpoints/tiny/draft/model.pth --speculate_k 5
"""
import argparse
import sys
from pathlib import Path

from errors import UserError, flag_names, interruptible_imports, run_cli

interruptible_imports(__name__)
import torch  # noqa: E402 (Ctrl-C while it loads: one line)

from compilation import COMPILE_MODES  # noqa: E402
from decode import PRECISIONS  # noqa: E402
from generation import Settings, Speculation, run  # noqa: E402

DEFAULTS = Settings()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Low-latency Llama generation (plain, speculative, tree, n-gram)")
    p.add_argument("--prompt", "--prompts_file", default=None, action=PromptAction,
                   help=f"text, an integer N for a synthetic prompt of N tokens, or @FILE (= --prompts_file FILE): "
                        f"one prompt per line (plain text, or JSON lines with a \"prompt\" field), run --batch_size "
                        f"at a time, each row's text and ids in --stats_json 'rows' (default: {DEFAULTS.prompt!r})")
    p.add_argument("--chat", "--interactive", action="store_true",
                   help="the checkpoint's chat template: around --prompt (one user turn), or without --prompt a "
                        "conversation read from standard input, answers streamed")
    p.add_argument("--num_samples", type=int, default=DEFAULTS.num_samples)
    p.add_argument("--max_new_tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--batch_size", type=int, default=DEFAULTS.batch_size,
                   help="rows decoded together: copies of --prompt, or the next B prompts of --prompts_file")
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help="0 means exact argmax (greedy)")
    p.add_argument("--top_k", type=int, default=DEFAULTS.top_k)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULTS.checkpoint_path)
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--draft_head", type=Path, default=None, metavar="DIR",
                   help="draft with a head trained from the target (scripts/train_draft_head.py) or an EAGLE-3 head")
    p.add_argument("--speculate_k", default="5", help="draft depth K (>= 1), or 'auto' for an adaptive depth")
    p.add_argument("--tree_nodes", default=None,
                   help="draft tokens verified per target forward (equal to speculate_k: a chain), or 'auto' to size "
                        "each step's tree (a draft head or n-gram drafts)")
    p.add_argument("--draft_ngram", type=int, default=0, metavar="N",
                   help="draft from an N-gram trie of the prompt and output (e.g. 3): alone, or with a draft model "
                        "and --tree_nodes, merged into the draft's tree")
    p.add_argument("--compile", "--compile_prefill", nargs="?", const="auto", default="none", choices=COMPILE_MODES,
                   metavar="MODE", action=CompileAction,
                   help="compile the graphs: auto (--compile alone: the whole model as one graph built once and "
                        "stored beside the checkpoint, loaded by later runs), autotune (the same, every matmul "
                        "timed), regional (one block shared by all layers: seconds to compile), whole (the model as "
                        "one graph compiled in this process; CUDA graphs on GPU); --compile_prefill [MODE] also "
                        "compiles a dynamic-shape prefill")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--json_schema", type=Path, default=None, metavar="FILE",
                   help="a JSON Schema file: every answer is JSON valid under it (grammar-constrained decoding)")
    p.set_defaults(compile_prefill=False)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU (bf16 mat-vec is slower than fp32 on many CPUs)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace of the last sample")
    p.add_argument("--stats_json", type=Path, default=None)
    return p.parse_args(argv)


class CompileAction(argparse.Action):
    """--compile [MODE]; --compile_prefill [MODE] is the same with the prefill compiled too."""

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string == "--compile_prefill":
            namespace.compile_prefill = True
            if value == self.const and namespace.compile != "none":  # no MODE given: keep the one --compile chose
                value = namespace.compile
        setattr(namespace, self.dest, value)


class PromptAction(argparse.Action):
    """--prompts_file FILE is --prompt @FILE."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, "@" + value if option_string == "--prompts_file" else value)


def settings_from(args: argparse.Namespace) -> Settings:
    depth = args.speculate_k
    if depth != "auto":
        try:
            depth = int(depth)
        except ValueError:
            raise UserError(f"--speculate_k must be an integer >= 1 or 'auto', got {depth!r}") from None
    nodes = args.tree_nodes
    if nodes is not None and nodes != "auto":
        try:
            nodes = int(nodes)
        except ValueError:
            raise UserError(f"--tree_nodes must be an integer or 'auto', got {nodes!r}") from None
    prompt, prompts_file = args.prompt if args.prompt is not None else DEFAULTS.prompt, None
    if prompt.startswith("@"):
        if prompt == "@":  # Path("") is the current directory: "is a directory" would not say what is missing
            raise UserError("--prompt @FILE: name the file of prompts after the @")
        prompts_file, prompt = Path(prompt[1:]), DEFAULTS.prompt
    return Settings(args.checkpoint_path, args.draft_checkpoint_path, prompt, args.chat, args.num_samples,
                    args.max_new_tokens, args.batch_size, prompts_file, args.temperature, args.top_k,
                    args.top_p, args.seed, Speculation(depth, nodes, args.draft_ngram), args.compile,
                    args.compile_prefill, args.device, args.precision, args.profile, args.stats_json,
                    stop_at_eos=not args.ignore_eos, draft_head=args.draft_head, json_schema=args.json_schema)


# the settings' names as the flags that set them, for error messages
FLAGS = dict({name: f"--{name}" for name in vars(parse_args([]))}, prompts_file="--prompts_file")


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        settings = settings_from(args)
        conversation = args.chat and args.prompt is None
        if conversation and settings.batch_size > 1:  # one conversation, streamed: a batch would count copies
            raise UserError("--chat without --prompt holds one conversation: --batch_size must be 1")
        return run(settings, print, questions(settings.device) if conversation else None)
    except UserError as e:
        raise UserError(flag_names(str(e), FLAGS)) from None


def questions(device: str):
    """The user's turns from standard input, until its end. Under tensor parallelism rank 0 reads and every rank gets
    the text."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import tp
        read = tp.read_prompt
    else:
        read = read_line
    while True:
        try:
            yield read("What is your prompt? ")
        except EOFError:
            return


def read_line(question: str) -> str:
    """input(), with a closed stdin (no file descriptor 0 at all) read as the end of the input."""
    if sys.stdin is None:
        raise EOFError
    try:
        line = input(question)
        line.encode("utf-8")  # undecodable bytes can arrive as lone surrogates (stdin's "surrogateescape" handler)
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise UserError("standard input is not UTF-8 text: pass the questions in UTF-8") from None
    return line


def lost_peer(e: Exception):
    """Under torchrun: a collective failed because another rank went away (gloo: "Connection closed by peer";
    NCCL): the line to print, or None for any other exception."""
    if not (isinstance(e, RuntimeError) and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    text = str(e)
    if not (isinstance(e, torch.distributed.DistError) or any(w in text for w in ("gloo", "NCCL", "closed by peer"))):
        return None
    reason = (text.strip().splitlines() or [type(e).__name__])[0]
    reason = reason.split("] ", 1)[-1].split(". ")[0][:160]  # "[.../pair.cc:537] Read error ...: reset by peer"
    return (f"error: rank {torch.distributed.get_rank()} lost the other ranks ({reason}): another rank failed; its "
            f"error is above")


def finish(error, status: int):
    """Under torchrun every rank leaves through tp.end_process (it never returns)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import tp
        tp.end_process(error, status)


def cli(argv=None) -> int:
    return run_cli(lambda: main(argv), explain=lost_peer, finish=finish)


if __name__ == "__main__":
    sys.exit(cli())
