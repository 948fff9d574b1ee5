# Gemma 2 2B recipe on one GPU, seq 2048, micro-batch 2, 4 micro-batches per step: today's layers
# (plain: no softcap, no window, no sandwich norms, plain RMSNorm weights) against Gemma 2's layers.
# Usage: bash ab.sh OUT_DIR   (metrics.jsonl and the log of each run land in OUT_DIR/<name>/)
set -u
out=$1
common="data.source=stdlib data.tokenizer=bpe data.vocab_size=1024 data.max_documents=4000 data.dir=/tmp/abdata train.steps=24 train.micro_batch_size=2 train.global_batch_size=8 optim.warmup_steps=4 eval.interval=0 eval.iters=1 checkpoint.interval=0 checkpoint.at_end=false logging.interval=1 run.out_dir=/tmp/abruns logging.wandb=disabled run.seed=1234"
python3 -m cce_parallel.train --recipe recipes/gemma-2b-owt.yaml --prepare-data --set $common 2>&1 | tail -1
for name in plain gemma2; do
  extra=""; [ $name = plain ] && extra="model.attention_softcap=null model.sliding_window=null model.post_norms=false model.zero_centered_norm=false"
  mkdir -p $out/$name
  timeout 240 torchrun --standalone --nproc-per-node 1 -m cce_parallel.train --recipe recipes/gemma-2b-owt.yaml --set $common run.name=$name $extra > $out/$name/train.log 2>&1
  echo "== $name rc=$?"; grep -E "^step|Error|parameters" $out/$name/train.log | cut -c1-200 | tail -6
  cp /tmp/abruns/$name/metrics.jsonl /tmp/abruns/$name/recipe.yaml $out/$name/ 2>/dev/null
done
