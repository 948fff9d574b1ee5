#!/bin/bash
# Tokens/s with and without apex (device tool; $OUT comes back): Gemma 2 2B and Llama 1B at TP 1,
# interleaved launches; .probe/apex.tgz is what apex.sh wrote.
exec > >(tee $OUT/p.txt) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl
tar -xzf .probe/apex.tgz -C /tmp
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
B=$PWD:/tmp/site; A=$B:/tmp/apexb:/tmp/apexb/wg; W=/tmp/w
S="run.out_dir=$W/runs run.seed=1234 checkpoint.interval=0 checkpoint.resume=never checkpoint.at_end=false data.source=stdlib data.tokenizer=bpe data.vocab_size=8192 data.dir=$W/data model.seq_length=2048 train.micro_batch_size=4 train.global_batch_size=4 optim.warmup_steps=1 eval.interval=0 eval.iters=1 logging.interval=1 logging.wandb=disabled loss.softcap=null parallel.tensor=1"
one() { echo "== $1 $(date +%T)"; PYTHONPATH=$2 timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m cce_parallel.train --recipe $3 --set $S train.steps=$4 run.name=$1 > $OUT/$1.log 2>&1; echo "exit $?"; grep -E "^step|terminate|Fatal|Error" $OUT/$1.log | tail -4; }
one gN1 $B recipes/gemma-2b-owt.yaml 16
one gA1 $A recipes/gemma-2b-owt.yaml 16
one lN1 $B recipes/llama-1b-owt.yaml 24
one lA1 $A recipes/llama-1b-owt.yaml 24
one gN2 $B recipes/gemma-2b-owt.yaml 16
one gA2 $A recipes/gemma-2b-owt.yaml 16
