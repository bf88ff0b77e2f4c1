"""Download a Hugging Face Llama-family checkpoint (config, tokenizer, safetensors weights only).

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf   # -> checkpoints/meta-llama/Llama-2-7b-chat-hf

Then convert it with scripts/convert_hf_checkpoint.py (scripts/prepare.sh does both).
"""
import argparse
import os
from pathlib import Path

ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "*.safetensors", "*.safetensors.index.json",
]
# Mistral's own-format copy of the weights, and Meta's original/ folder: duplicates under other names
IGNORE_PATTERNS = ["consolidated*", "original/*"]


def _is_network_error(e: Exception) -> bool:
    """No connection, DNS failure, timeout: huggingface_hub reports these as LocalEntryNotFoundError
    (nothing cached to fall back on) or lets the HTTP client's transport error through."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, (LocalEntryNotFoundError, ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "ConnectionError", "Timeout", "TimeoutException"})


def hf_download(repo_id: str, checkpoint_dir="checkpoints", hf_token=None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if repo_id.count("/") != 1:
        raise SystemExit(f"--repo_id must look like ORG/NAME (e.g. meta-llama/Llama-2-7b-chat-hf), got {repo_id!r}")
    out = Path(checkpoint_dir) / repo_id
    token = hf_token or os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's login cache
    access_hint = (f"accept the license on https://huggingface.co/{repo_id} and set HF_TOKEN "
                   f"(or run `huggingface-cli login`, or pass --hf_token)")
    try:
        snapshot_download(repo_id, local_dir=out, token=token,
                          allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass of it
        raise SystemExit(f"{repo_id} is gated: {access_hint}") from None
    except RepositoryNotFoundError:
        raise SystemExit(f"repository {repo_id} not found on the Hugging Face hub (or it is private: "
                         f"{access_hint}); check the spelling of --repo_id") from None
    except RevisionNotFoundError as e:
        raise SystemExit(f"{repo_id}: {e}") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise SystemExit(f"access to {repo_id} denied (HTTP {status}): {access_hint}") from None
        raise SystemExit(f"downloading {repo_id} failed: {e}") from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise SystemExit(
            f"the Hugging Face hub is unreachable ({type(e).__name__}); if you have the model as a local "
            f"Hugging Face dir (config.json + *.safetensors), convert it directly with "
            f"scripts/convert_hf_checkpoint.py --checkpoint_dir DIR") from None
    if not any(out.glob("*.safetensors")):
        raise SystemExit(f"{repo_id} has no *.safetensors weights; download its pytorch_model*.bin files into "
                         f"{out} yourself, then run scripts/convert_hf_checkpoint.py --checkpoint_dir {out}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo_id", required=True, help="Hugging Face repository, ORG/NAME")
    p.add_argument("--checkpoint_dir", default="checkpoints", help="the download goes to CHECKPOINT_DIR/ORG/NAME")
    p.add_argument("--hf_token", default=None, help="access token (default: HF_TOKEN, then the login cache)")
    args = p.parse_args(argv)
    out = hf_download(args.repo_id, args.checkpoint_dir, args.hf_token)
    print(f"downloaded {args.repo_id} to {out}")
    return out


if __name__ == "__main__":
    main()
