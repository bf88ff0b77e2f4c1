#!/usr/bin/env bash
# Download a Hugging Face checkpoint and convert it: checkpoints/ORG/NAME/model.pth
#   scripts/prepare.sh meta-llama/Llama-2-7b-chat-hf
# CHECKPOINTS=DIR puts it under DIR instead of ./checkpoints; HF_TOKEN is used for gated models.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 ORG/NAME   (a Hugging Face repo id, e.g. meta-llama/Llama-2-7b-chat-hf)" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
checkpoints="${CHECKPOINTS:-checkpoints}"
python "$here/download.py" --repo_id "$1" --checkpoint_dir "$checkpoints"
python "$here/convert_hf_checkpoint.py" --checkpoint_dir "$checkpoints/$1"
