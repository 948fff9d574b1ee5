"""Checkpoints under faults: what they hold (tensors and small JSON, nothing to unpickle), corrupt
or incomplete files (found by their checksums, skipped for the previous checkpoint or refused
when named), the run directory's lock, and workers that die with a SIGKILLed torchrun."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import ROOT, _alive, _descendants, base_overrides, run_train, train_command, train_env

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]


NEWEST, OLDER = "step_0000050", "step_0000040"  # the reference run's two kept checkpoints (checkpoint.keep: 2)


@pytest.fixture(scope="module")
def two_checkpoints(tiny_reference):
    """The reference run (the tiny recipe at TP=2, 50 steps), shared by every test of the run, with
    its checkpoints NEWEST and OLDER: (run dir, metrics). Tests change copies only."""
    run_dir, metrics, _ = tiny_reference
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [OLDER, NEWEST]
    return run_dir, metrics


def _copy_run(run_dir: Path, runs_dir: Path, name: str) -> Path:
    copy = runs_dir / name
    shutil.copytree(run_dir, copy)
    return copy


def _flip_bit(file: Path, offset: int):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def test_checkpoint_holds_tensors_and_small_json(two_checkpoints):
    from cce_parallel.train import checkpoint, checkpoint_files

    run_dir, _ = two_checkpoints
    path = run_dir / "checkpoints" / NEWEST
    meta = checkpoint.verify(path)
    names = {p.name for p in path.iterdir()}
    assert set(meta["files"]) == names - {"meta.json"}
    assert {"rank0.rng.json", "rank1.rng.json", "tp0_pp0.optim.json", "tp1_pp0.optim.json"} <= names
    for name in names:
        assert name.endswith((".json", ".distcp")) or name == ".metadata", name
        if name.endswith(".json") and name != "meta.json":
            assert (path / name).stat().st_size < 64 << 10, name  # structure and plain values, no tensor data
    metadata = checkpoint_files.SafeReader(path).read_metadata()
    kinds = {type(md).__name__ for md in metadata.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}  # nothing DCP would unpickle on load
    assert any(key.startswith("tp1_pp0/optim/0/state_dict/") for key in metadata.state_dict_metadata)


def test_encoded_state_keeps_tensor_data_out_of_json():
    """A state as large as a 2.5B-parameter model's Adam moments (meta tensors: no memory)
    encodes to a few hundred bytes of JSON; anything not plain data is refused."""
    from cce_parallel.train import checkpoint_state

    n = 2_500_000_000
    state = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.empty(n, device="meta"),
                           "exp_avg_sq": torch.empty(n, device="meta")}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "exp_avg_dtype": torch.bfloat16}]}
    tensors = {}
    doc = checkpoint_state._encode([{"state_dict": state, "main_params": [torch.empty(n, device="meta")]}], "x", tensors)
    assert len(json.dumps(doc)) < 1000
    assert sorted(tensors) == ["x/0/main_params/0", "x/0/state_dict/state/0/exp_avg",
                               "x/0/state_dict/state/0/exp_avg_sq", "x/0/state_dict/state/0/step"]
    back = checkpoint_state._decode(json.loads(json.dumps(doc)), tensors)
    assert back[0]["state_dict"]["param_groups"] == state["param_groups"]
    assert back[0]["state_dict"]["state"][0]["exp_avg"] is tensors["x/0/state_dict/state/0/exp_avg"]
    with pytest.raises(TypeError, match="x/k: a object cannot go into a checkpoint"):
        checkpoint_state._encode({"k": object()}, "x", {})


def test_megatron_fsdp_checkpoints_resume_under_megatron_fsdp_only(two_checkpoints):
    """Megatron-FSDP's checkpoints hold each rank's own shards: a DDP checkpoint must not load
    into a Megatron-FSDP run (nor the reverse, by the same check), with an error naming both."""
    from types import SimpleNamespace

    from cce_parallel.train import checkpoint

    run_dir, _ = two_checkpoints
    path = run_dir / "checkpoints" / NEWEST
    layout = checkpoint.read_meta(path)["layout"]
    engine = SimpleNamespace(model=[SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=True))])
    with pytest.raises(ValueError, match="parallel.fsdp=none; this run has parallel.fsdp=megatron"):
        checkpoint.load(path, engine=engine, layout=layout)


def test_empty_shards_and_dtensors_encode():
    """Megatron-FSDP leaves some ranks empty shards: they are written into the JSON (dtype and
    shape), not handed to DCP; _local turns DTensors into this rank's shard (a view)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from cce_parallel.train import checkpoint_state

    tensors = {}
    doc = checkpoint_state._encode({"w": torch.empty(0, 8, dtype=torch.bfloat16), "m": torch.ones(3)}, "x", tensors)
    assert sorted(tensors) == ["x/m"]
    back = checkpoint_state._decode(json.loads(json.dumps(doc)), tensors)
    assert back["w"].shape == (0, 8) and back["w"].dtype == torch.bfloat16
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        full = torch.arange(12.0).reshape(4, 3)
        d = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
        local = checkpoint_state._local({"s": [d, 5]})
        assert type(local["s"][0]) is torch.Tensor and local["s"][1] == 5
        assert local["s"][0].data_ptr() == d.to_local().data_ptr()
    finally:
        dist.destroy_process_group()


def _truncate(path):
    shard = path / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return "__1_0.distcp has"


def _bit_flip(path):
    shard = path / "__0_0.distcp"
    _flip_bit(shard, shard.stat().st_size // 2)
    return "__0_0.distcp is corrupt (sha256 mismatch)"


def _delete_metadata(path):
    (path / ".metadata").unlink()
    return ".metadata is missing"


def _garbage_meta(path):
    (path / "meta.json").write_bytes((path / "meta.json").read_bytes()[:100])
    return "meta.json is unreadable"


def _edited_meta(path):
    meta = json.loads((path / "meta.json").read_text())
    meta["step"] += 1
    (path / "meta.json").write_text(json.dumps(meta))
    return "meta.json is corrupt (its content does not match its sha256)"


def _rng_json(path):
    _flip_bit(path / "rank1.rng.json", 50)
    return "rank1.rng.json is corrupt (sha256 mismatch)"


@pytest.mark.parametrize("damage", [_truncate, _bit_flip, _delete_metadata, _garbage_meta, _edited_meta, _rng_json])
def test_verify_names_the_damaged_file(two_checkpoints, tmp_path, damage):
    from cce_parallel.train import checkpoint

    run_dir, _ = two_checkpoints
    path = tmp_path / NEWEST
    shutil.copytree(run_dir / "checkpoints" / NEWEST, path)
    checkpoint.verify(path)
    expected = damage(path)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify(path)
    assert f"{path}/{expected}" in str(err.value)


def test_metadata_unpickler_refuses_code(two_checkpoints, tmp_path):
    from cce_parallel.train import checkpoint, checkpoint_files

    run_dir, _ = two_checkpoints
    path = tmp_path / NEWEST
    shutil.copytree(run_dir / "checkpoints" / NEWEST, path)

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(checkpoint.CheckpointError, match="posix.system is not allowed"):
        checkpoint_files.SafeReader(path).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_corrupt_newest_checkpoint_falls_back(two_checkpoints, tiny_data, runs_dir):
    """The newest checkpoint's shard is damaged: the restart warns, naming it, resumes from the one
    before, and the steps after it repeat the first run's losses bitwise."""
    from cce_parallel.train.metrics import read_metrics

    run_dir, first = two_checkpoints
    run_dir = _copy_run(run_dir, runs_dir, "faults-fallback")
    shard = run_dir / "checkpoints" / NEWEST / "__0_0.distcp"
    _flip_bit(shard, shard.stat().st_size // 3)
    overrides = base_overrides(runs_dir, tiny_data, run_dir.name)
    done = run_train(overrides + ["train.stop_at=42"])
    warning = f"warning: skipping checkpoint {NEWEST}: {shard} is corrupt (sha256 mismatch)"
    assert warning in done.stderr.splitlines()
    assert f"resumed from {run_dir / 'checkpoints' / OLDER} at step 40" in done.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert list(metrics["resume"]) == [40]
    assert [metrics["train"][s]["loss"] for s in (41, 42)] == [first["train"][s]["loss"] for s in (41, 42)]
    assert metrics["train"][41]["time"] != first["train"][41]["time"]  # the restart's records, not the copied ones


def test_named_bad_checkpoint_is_an_error(two_checkpoints, runs_dir, tiny_data):
    run_dir, _ = two_checkpoints
    run_dir = _copy_run(run_dir, runs_dir, "faults-named")
    path = run_dir / "checkpoints" / NEWEST
    (path / ".metadata").unlink()
    done = run_train(base_overrides(runs_dir, tiny_data, "faults-named-2") + [f"checkpoint.resume={path}"], check=False,
                     torchrun=True)
    assert done.returncode != 0
    line = f"cce-train: invalid recipe: checkpoint.resume: {path}: {path}/.metadata is missing"
    assert line in done.stderr.splitlines()
    # Rank 0 speaks for both: torchrun's SIGTERM, once rank 0 has exited, ends rank 1's wait for it
    # (QUIET_RANK_WAIT_S) at once and in silence, not 20 s later with the same line again.
    assert done.stderr.count(line) == 1, done.stderr[-3000:]
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr  # torchrun adds its own


def test_lock_and_killed_launcher(tiny_data, runs_dir):
    """A second run on a live run's directory is refused, naming the holder; SIGKILL to torchrun
    alone takes its workers down within seconds (paused ones too: PR_SET_PDEATHSIG's SIGKILL); the
    stale lock does not block the restart."""
    # Far more steps than the test needs: the first run must still hold the lock when the second
    # starts, however slow the machine (50 steps ended before the second run's start on 2 cores).
    overrides = base_overrides(runs_dir, tiny_data, "locked") + ["checkpoint.interval=2", "train.steps=100000"]
    run_dir = runs_dir / "locked"
    proc = subprocess.Popen(train_command(overrides), cwd=ROOT, env=train_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the first run did not reach a checkpoint"
            time.sleep(0.1)
        holder = (run_dir / ".lock").read_text().strip()
        assert holder.startswith("pid ") and " on host " in holder
        # Its workers are paused (they still hold the lock) while the second run starts, rather
        # than training on and taking the CPU from it.
        workers = _descendants(proc.pid)
        assert len(workers) >= 2
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)

        second = run_train(overrides, check=False)
        assert second.returncode != 0
        assert f"cce-train: invalid recipe: run.name: {run_dir} is in use by another run ({holder}" in second.stderr

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "workers outlived their killed launcher"
    finally:
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    step = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    done = run_train(overrides + [f"train.stop_at={step + 1}"])
    assert "resumed from" in done.stdout
