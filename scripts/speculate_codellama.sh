#!/usr/bin/env bash
# CodeLlama-34B target with a CodeLlama-7B draft, greedy code completion, adaptive depth.
set -euo pipefail
bash scripts/prepare.sh codellama/CodeLlama-34b-Python-hf
bash scripts/prepare.sh codellama/CodeLlama-7b-Python-hf
python generate.py --compile \
  --checkpoint_path checkpoints/codellama/CodeLlama-34b-Python-hf/model.pth \
  --draft_checkpoint_path checkpoints/codellama/CodeLlama-7b-Python-hf/model.pth \
  --speculate_k auto --temperature 0 --prompt "def quicksort(items):" "$@"
