#!/usr/bin/env bash
# The GPU benchmark table (docs/benchmarks.md, "On a GPU") on one CUDA GPU, in one go: under 8 minutes on an H200.
#
#   bash benchmarks/gpu.sh               # every part
#   bash benchmarks/gpu.sh layer hunyuan  # only these parts (step, layer, hunyuan), e.g. to rerun one that failed
#
# Every benchmark runs with --repeats 2: each table keeps the least time and shows the first call apart
# ("first call (s)"), since the first carries the one-time costs (Triton's compilation, warm-up).
# It writes benchmarks/results/{step,layer,stats,sparse,hunyuan15}_cuda.md. These replace the tables there, and with
# them any notes written under an earlier table: `git diff benchmarks/results` shows what moved.
# A part that fails is reported and the next one runs; the script then exits 1.
#
# Time on an H200, from the earlier results (each process also pays about 20 s to import torch and diffusers twice,
# peak_memory.py re-executing it, and to build its model):
#   step     one CogVideoX-5b step, 42 layers, bf16: 7 cases × 2 steps of 1.8-7.3 s, ~65 s, plus building the
#            5B-parameter model with random weights: ~2.5 min
#   layer    one CogVideoX-2b layer, all 30 heads, float32, against the stock layer (0.08 s): the served kinds
#            frame and video_to_text (--cases maps), entropy, query_frame, received and block (--cases stats), and
#            tile by sdpa, frame_max, offset, top_p, pattern_recall, pattern_error, each row kind by torch's tiles
#            and by the kernels' (--cases sparse; its Triton tile row took 15 s): ~3 min over three processes
#   hunyuan  one HunyuanVideo 1.5 block at 720p × 121 frames (S = 113,585), all 16 heads, frame + video_to_text:
#            2 × (3.1 s stock + 3.1 s + 15.5 s captured): ~1.5 min
# About 6.5 minutes in all (an estimate: the script itself has not yet been timed on a GPU), so every part runs
# at full size: no fewer layers or heads than the earlier tables.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # this checkout's cogattn; logs as they come
python=${PYTHON:-python}

if ! "$python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "benchmarks/gpu.sh: no CUDA GPU visible to torch ($python -c 'import torch; assert torch.cuda.is_available()' failed)" >&2
  exit 1
fi

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(step layer hunyuan)
for part in "${parts[@]}"; do
  case $part in
    step | layer | hunyuan) ;;
    *) echo "benchmarks/gpu.sh: unknown part '$part' (step, layer, hunyuan)" >&2 && exit 2 ;;
  esac
done
results=benchmarks/results
written=() failed=()
start=$SECONDS

run() {  # run NAME OUT COMMAND...: one part, timed; OUT is the table it writes; a failure is kept for the end
  local name=$1 out=$2 t0=$SECONDS
  shift 2
  echo "=== $name: $*"
  if "$@"; then
    echo "=== $name: $((SECONDS - t0)) s"
    written+=("$out")
  else
    echo "=== $name: FAILED (exit $?) after $((SECONDS - t0)) s"
    failed+=("$name")
  fi
}

for part in "${parts[@]}"; do
  case $part in
    step)
      run "step: one CogVideoX-5b step (bf16, 42 layers)" $results/step_cuda.md "$python" benchmarks/bench_step.py \
        --device cuda --dtype bfloat16 --layers all --models CogVideoX-5b --repeats 2 --out $results/step_cuda.md
      ;;
    layer)
      for cases in maps stats sparse; do
        out=$results/$([ $cases = maps ] && echo layer || echo $cases)_cuda.md
        run "layer: one CogVideoX-2b layer, --cases $cases" "$out" "$python" benchmarks/bench_layer.py \
          --device cuda --cases $cases --repeats 2 --out "$out"
      done
      ;;
    hunyuan)
      run "hunyuan: one HunyuanVideo 1.5 block, S = 113,585" $results/hunyuan15_cuda.md "$python" \
        benchmarks/bench_hunyuan.py --model 1.5 --device cuda --heads 16 --frames-b 0 --repeats 2 \
        --out $results/hunyuan15_cuda.md
      ;;
  esac
done

echo "=== all: $((SECONDS - start)) s; written:"
printf '%s\n' "${written[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
