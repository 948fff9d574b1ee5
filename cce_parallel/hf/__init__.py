"""Hugging Face transformers in and out: export a train-job checkpoint, start from HF weights.

    python -m cce_parallel.export CHECKPOINT OUT_DIR [--dtype bf16] [--keep-padding]
    model.init_from: hf:<dir>        (recipe key) load a transformers checkpoint, shard by shard

convert.py maps parameters and checks configs (torch only); load.py (megatron-core) loads into
this rank's shard; export.py reads the DCP checkpoint and writes the transformers directory
(megatron_fsdp.py puts a Megatron-FSDP checkpoint's parameters together from the ranks' shards).
Needs the ``hf`` extra (transformers, safetensors) for export, safetensors for the import.
"""
