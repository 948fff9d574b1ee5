"""The pretraining job: ``python -m cce_parallel.train --recipe recipes/<name>.yaml`` (see __main__.py).

    __main__.py           entry point: parse, build, train, tear down (console script ``cce-train``)
    launch.py             torchrun detection, device, environment (allocator, deterministic mode), process groups, seeds
    gpt.py                the recipe's megatron-core GPTModel, with the CCE loss layer (or megatron's own)
    engine.py             DDP + optimizer + schedule: megatron-core's on CUDA; cpu.py's stand-ins on CPU
    data.py               prepared dataset, megatron GPT datasets, deterministic batches
    trainer.py            the loop: step, log, evaluate, checkpoint
    checkpoint.py         atomic checkpoints with model, optimizer, scheduler, data position, RNG, written in the background
    checkpoint_files.py   its files: names, meta.json and checksums, verification, the run directory's lock, safe reading
    checkpoint_state.py   the engine's state (model, optimizer, RNG) as tensors for DCP + JSON
    checkpoint_writer.py  Checkpointer: host buffers, the background write, atomic publishing
    signals.py            SIGTERM / SIGUSR1 (and train.exit_duration): save at the next step boundary and exit 0
    grace.py              how long a save on a signal takes, the launcher's grace, the warning where it is short
    torchrun.py           torchrun for the job (python -m cce_parallel.train.torchrun): exit 0 after a clean stop
                          on a signal, and a grace that fits the save
    metrics.py            console, metrics.jsonl, wandb
    estimate.py           --dry-run: meta-device model, parameter count, memory estimate, layout

Importing this package imports neither megatron-core nor triton.
"""
