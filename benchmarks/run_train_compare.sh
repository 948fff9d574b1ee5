#!/usr/bin/env bash
# GPT-2 small (recipes/gpt2-small-owt.yaml) trained on the same data and seed with each loss layer:
# CCE's (cce_kahan_full_c), megatron-core's ColumnParallelLinear + vocab_parallel_cross_entropy
# (megatron) and the same + its cross_entropy_loss_fusion (megatron_fused: native, or te where
# Transformer Engine is installed; FUSION_IMPL=native forces native), then one report against
# the first: loss curves, tokens/s, peak memory per rank.
#
#   benchmarks/run_train_compare.sh OUT_DIR
#
# Offline: the stdlib text with an 8,192-token BPE (prepared first, once). The model keeps
# GPT-2's 50,257-row vocabulary (padded to 50,432), so the loss layers compute at GPT-2's size.
# Layout: tensor 2 x data (NPROC / 2). Each run is one torchrun launch, killed after
# LAUNCH_TIMEOUT seconds. Runs, data and checkpoints go to WORK_DIR; OUT_DIR receives each run's
# metrics.jsonl, recipe.yaml and log, and train_compare_<gpu>_<date>.{json,md}.
#
# Environment (defaults): NPROC (4), STEPS (300), GBS (64), MBS (8), WARMUP (30), WORK_DIR
# (/tmp/cce_train_compare), PYTHON (python3), LAUNCH_TIMEOUT (240), IMPLS ("cce_kahan_full_c
# megatron megatron_fused"), FUSION_IMPL (loss.fusion_impl of the megatron_fused run: auto, native
# or te; default the recipe's), RECIPE (recipes/gpt2-small-owt.yaml), EXTRA (more --set overrides,
# space-separated, applied last to every run). Needs no pip install: run it with the packages
# importable (e.g. PYTHONPATH=/tmp/site:.). CPU smoke test: RECIPE=recipes/tiny.yaml NPROC=2 STEPS=20 GBS=8 MBS=4
# WARMUP=4 EXTRA="data.vocab_size=1024" benchmarks/run_train_compare.sh /tmp/out
# Exit status: 0 when every run and the report succeeded, else the last non-zero status.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/run_train_compare.sh OUT_DIR}
py=${PYTHON:-python3}
nproc=${NPROC:-4}
work=${WORK_DIR:-/tmp/cce_train_compare}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)

common=(
    run.out_dir="$work/runs" run.seed=1234
    data.source=stdlib data.tokenizer=bpe data.vocab_size=8192 data.dir="$work/data/stdlib-bpe-8192"
    train.steps="${STEPS:-300}" train.global_batch_size="${GBS:-64}" train.micro_batch_size="${MBS:-8}"
    optim.warmup_steps="${WARMUP:-30}" eval.interval=100 eval.iters=4
    checkpoint.interval=0 checkpoint.at_end=false checkpoint.resume=never
    logging.interval=10 logging.wandb=disabled
    ${EXTRA:-}
)
recipe=${RECIPE:-recipes/gpt2-small-owt.yaml}
stem=$(basename "$recipe" .yaml)

echo "=== preparing the data ($(date -u +%H:%M:%S)) ==="
$py -m cce_parallel.train --recipe "$recipe" --prepare-data --set "${common[@]}" || exit $?

rc=0
runs=()
for impl in ${IMPLS:-cce_kahan_full_c megatron megatron_fused}; do
    name="${stem}-${impl}"
    own=()  # overrides of this run alone (loss.fusion_impl is refused for the other impls)
    if [ "$impl" = megatron_fused ] && [ -n "${FUSION_IMPL:-}" ]; then
        own=(loss.fusion_impl="$FUSION_IMPL")
    fi
    rm -rf "$work/runs/$name"
    echo "=== loss.impl=$impl on $nproc GPUs ($(date -u +%H:%M:%S)) ==="
    timeout --signal=TERM --kill-after=15 "${LAUNCH_TIMEOUT:-240}" \
        $py -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        -m cce_parallel.train --recipe "$recipe" --set "${common[@]}" loss.impl="$impl" ${own[@]+"${own[@]}"} run.name="$name" \
        2>&1 | tee "$work/$name.log"
    s=${PIPESTATUS[0]}
    mkdir -p "$out/$name"
    cp "$work/$name.log" "$out/$name/train.log"
    for f in metrics.jsonl recipe.yaml; do
        [ -f "$work/runs/$name/$f" ] && cp "$work/runs/$name/$f" "$out/$name/$f"
    done
    if [ "$s" -ne 0 ]; then
        echo "=== loss.impl=$impl exited with status $s ===" >&2
        rc=$s
    fi
    runs+=("$out/$name")
done

$py -m benchmarks compare --runs "${runs[@]}" --out "$out" \
    --command "benchmarks/run_train_compare.sh $*  (RECIPE=$recipe NPROC=$nproc STEPS=${STEPS:-300} GBS=${GBS:-64} MBS=${MBS:-8} EXTRA=${EXTRA:-})" \
    || rc=$?
exit $rc
