#!/bin/bash
# Issue 54 on one H200 (device tool: $OUT comes back): the Gemma 2 2B recipe at DP 1, deterministic,
# SIGTERM to launch/train.sh's process group after step 6, then the restart to step 12 (which ends
# with a full save). The reference (no signal) was the same command with run.name=ref, checkpoint.interval=0.
exec > >(tee $OUT/probe.log) 2>&1
W=/tmp/g
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl
export PYTHONPATH=$PWD:/tmp/site
R=recipes/gemma-2b-owt.yaml
S="run.out_dir=$W/runs run.seed=1234 data.source=stdlib data.tokenizer=bpe data.vocab_size=8192 data.dir=$W/data train.micro_batch_size=2 train.global_batch_size=4 train.steps=12 optim.warmup_steps=2 eval.interval=0 logging.interval=1 logging.wandb=disabled train.deterministic=true parallel.distributed_optimizer=false checkpoint.at_end=false checkpoint.keep=0"
[ -d $W/data ] || timeout 120 python3 -m cce_parallel.train --recipe $R --prepare-data --set $S > $OUT/prep.log 2>&1
t0=$(date +%s)
setsid launch/train.sh 1 $R --set $S run.name=sig checkpoint.interval=0 > $OUT/sig.log 2>&1 &
pid=$!
for i in $(seq 1 600); do
  sleep 0.2
  if grep -qE "step +6/" $OUT/sig.log; then kill -TERM -- -$pid; ts=$(date +%s.%N); echo "== SIGTERM after step 6 at $(( $(date +%s) - t0 )) s"; break; fi
done
( sleep 200; kill -9 -- -$pid 2>/dev/null ) & killer=$!
wait $pid; rc=$?; te=$(date +%s.%N); kill $killer 2>/dev/null
echo "== sig exit $rc, $(python3 -c "print(round($te-${ts:-0},1))") s after the signal"
grep -E "checkpoint|stopped|grace|agent|SIGKILL|rror" $OUT/sig.log | grep -v "^\[launch\]" | head -20
du -sb $W/runs/sig/checkpoints/* 2>/dev/null; cat $W/runs/sig/checkpoints/*/meta.json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print({k: d.get(k) for k in ('step','model_weights')})"
t0=$(date +%s)
setsid launch/train.sh 1 $R --set $S run.name=sig checkpoint.interval=0 checkpoint.at_end=true > $OUT/res.log 2>&1 &
pid=$!
( sleep 240; kill -9 -- -$pid 2>/dev/null ) & killer=$!
for i in $(seq 1 600); do
  sleep 0.2
  if grep -q "resumed from" $OUT/res.log; then rm -rf $W/runs/sig/checkpoints/step_0000007; echo "== lean checkpoint removed after loading"; break; fi
  kill -0 $pid 2>/dev/null || break
done
wait $pid; echo "== resume exit $? in $(( $(date +%s) - t0 )) s"; kill $killer 2>/dev/null
grep -E "resumed|step +(8|12)/|saved checkpoint|stopped|rror" $OUT/res.log | head
cp $W/runs/sig/metrics.jsonl $OUT/sig_metrics.jsonl
