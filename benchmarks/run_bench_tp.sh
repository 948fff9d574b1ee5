#!/usr/bin/env bash
# One torchrun launch of bench_tp.py per TP size (a fresh process each, so Megatron's global
# parallel state, the allocator and a crash or hang at one size cannot touch the others), then one
# merged report: <out>/<gpu>_<yyyymmdd>_tp[_<TAG>].{json,md}.
#
#   benchmarks/run_bench_tp.sh OUT_DIR [bench_tp.py options...]     e.g. --commit SHA --regimes random
#
# Pass the report's suffix as TAG, not --tag (each launch gets its own --tag "part-tp<t>").
# Environment: TP_SIZES (default "1 2 4"), NPROC (default: every visible GPU), TAG (suffix of the
# merged report), PYTHON (default python3), LAUNCH_TIMEOUT (seconds per launch, default 180:
# three launches fit one 10-minute device call).
# Exit status: 0 when every launch and the merge succeeded, else the last non-zero status.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/run_bench_tp.sh OUT_DIR [bench_tp.py options...]}
shift
py=${PYTHON:-python3}
nproc=${NPROC:-$($py -c 'import torch; print(torch.cuda.device_count())')}
tag=${TAG:-}
part=${tag:+${tag}-}part
rc=0
mkdir -p "$out"
for t in ${TP_SIZES:-1 2 4}; do
    echo "=== TP=$t on $nproc ranks ($(date -u +%H:%M:%S)) ==="
    timeout --signal=TERM --kill-after=15 "${LAUNCH_TIMEOUT:-180}" \
        $py -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
        benchmarks/bench_tp.py --tp "$t" --out "$out" --tag "${part}-tp$t" "$@"
    s=$?
    if [ $s -ne 0 ]; then
        echo "=== TP=$t exited with status $s ===" >&2
        rc=$s
    fi
done
shopt -s nullglob
parts=("$out"/*_tp_"${part}"-tp*.json)
if [ ${#parts[@]} -eq 0 ]; then
    echo "no results to merge in $out" >&2
    exit 1
fi
if $py benchmarks/bench_tp.py --render "${parts[@]}" --out "$out" ${tag:+--tag "$tag"}; then
    # The merged .md replaces the per-launch ones; their .json stay as the merge's sources.
    for f in "${parts[@]}"; do rm -f "${f%.json}.md"; done
else
    rc=$?
fi
exit $rc
