"""Pretraining entry point: parse, build, train, tear down.

    torchrun --nproc-per-node 4 -m cce_parallel.train --recipe recipes/gpt2-small-owt.yaml
    python -m cce_parallel.train                       # the tiny recipe (re-launches under torchrun)
    python -m cce_parallel.train --recipe recipes/llama-1b-owt.yaml --dry-run --world-size 8
    python -m cce_parallel.train --recipe R.yaml --set train.steps=100 loss.impl=megatron

Also installed as the console script ``cce-train``.
"""

import argparse
import os
import shlex
import signal
import sys
import time

# Under torchrun every rank meets the same bad recipe, and the first rank to exit makes torchrun
# stop the others, rank 0 included, perhaps before it has printed. So the other ranks wait up to
# this long before they report an error themselves: rank 0 speaks first, and an error that only
# another rank meets is still reported. A SIGTERM ends the wait at once, without a word: torchrun
# stopping the others once rank 0 has exited, or a scheduler stopping the job (rank 0 speaks).
QUIET_RANK_WAIT_S = 20.0


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="cce-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", help="YAML recipe (default: the tiny recipe, i.e. the schema defaults)")
    ap.add_argument("--set", nargs="+", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override recipe keys (values are YAML: 3e-4, null, true); repeatable")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the recipe, build the model on the meta device, print sizes, memory and layout")
    ap.add_argument("--world-size", type=int, help="world size for --dry-run (default: tensor x pipeline x data)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    help="device to check and estimate for with --dry-run (default: cuda unless run.device is cpu)")
    ap.add_argument("--prepare-data", action="store_true",
                    help="prepare the recipe's dataset (tokenize, write data.dir) and exit; no torchrun needed")
    ap.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    started = time.monotonic()  # train.exit_duration counts from here
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from cce_parallel.config import RecipeError, dump_recipe, load_recipe
    from cce_parallel.data import DataError
    from cce_parallel.train import grace, launch

    launch.quiet_warnings()
    quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    try:
        recipe = load_recipe(args.recipe, [item for group in args.set for item in group])
        if args.print_recipe:
            print(dump_recipe(recipe), end="")
            return 0
        if args.prepare_data:
            if quiet:
                return 0
            from cce_parallel.train.data import prepare

            info = prepare(recipe.data)
            print(f"dataset ready in {info.out_dir}: {info.n_train_tokens:,} train / {info.n_valid_tokens:,} "
                  f"validation tokens, tokenizer {info.tokenizer} ({info.vocab_size} tokens)")
            return 0
        if args.dry_run:
            if quiet:
                return 0
            from cce_parallel.train.estimate import dry_run

            dry_run(recipe, world_size=args.world_size, device=args.device)
            return 0

        device = launch.resolve_device(recipe)
        world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else launch.needed_world_size(recipe)
        recipe.check_world(world, device)  # fail before starting any process
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launch.under_torchrun() else world
        launch.check_gpus(device, per_node)
        if not launch.under_torchrun() and world > 1:
            from cce_parallel.train.data import prepare

            prepare(recipe.data)  # before torchrun starts: bad data is then one line, not a report per rank
            launch.relaunch(world, argv)
        launch.prepare_environment(recipe, device)  # before megatron-core (and triton) is imported
        from cce_parallel.train.trainer import Trainer

        trainer = Trainer(recipe, device, command=shlex.join([sys.executable, "-m", "cce_parallel.train", *argv]),
                          started=started)
        try:
            trainer.train()
        except BaseException:
            trainer.close(failed=True)
            raise
        trainer.close()
        if trainer.stopped is not None:  # for the launcher's agent, after a signal (torchrun.py)
            stopped = trainer.stopped
            grace.mark_stopped(stopped["step"], stopped["checkpoint"], stopped["reason"])
    except RecipeError as err:
        _report("recipe", err, quiet)
        return 2
    except DataError as err:
        _report("data", err, quiet)
        return 2
    return 0


class _Stopped(Exception):
    pass


def _stopped(_number, _frame):
    raise _Stopped


def _report(what: str, err: Exception, quiet: bool) -> None:
    if quiet and not _waited_for_rank0():
        return
    print(f"cce-train: invalid {what}: {err}", file=sys.stderr, flush=True)


def _waited_for_rank0() -> bool:
    """A rank other than 0 waits QUIET_RANK_WAIT_S before it reports an error: True after the
    wait; False where a SIGTERM ended it, or had come already (noted by the trainer's handler)."""
    from cce_parallel.train.signals import StopOnSignal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _stopped)
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, StopOnSignal) and owner.first is not None:
            return False
        time.sleep(QUIET_RANK_WAIT_S)
    except _Stopped:
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
    return True


def _exit(code: int):
    """A rank ends here once its process group is destroyed and its files are closed: under
    torchrun, and in a plain one-process start (which sets torchrun's variables when it joins its
    process group). An exception (a crash) leaves as usual, with its traceback.

    On an H200 (torch 2.11, NCCL) 3 of 4 workers that had finished cleanly then died in the
    interpreter's C++ teardown ("terminate called without an active exception", SIGABRT), and
    torchrun reported the finished run as failed (benchmarks/results/h200_20261129_apex). Skipping
    that teardown keeps the exit code the job's.
    """
    from cce_parallel.train.launch import under_torchrun

    if not under_torchrun():
        raise SystemExit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
