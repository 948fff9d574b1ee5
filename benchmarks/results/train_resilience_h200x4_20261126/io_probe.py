"""Probe (kept as the source of io_probe.log): where can a checkpoint's seconds go on this host?
Run: torchrun --standalone --nproc-per-node 4 io_probe.py (4 GPUs; 52 GB of host memory, 64 GB of /tmp)."""
import hashlib, os, sys, time, threading
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank(); torch.cuda.set_device(rank)
GB = 1 << 30
n = 13  # GB per rank, like Gemma's model replica + optimizer shard
src = [torch.randn(128 << 20, device="cuda", dtype=torch.bfloat16) for _ in range(n * 4)]  # 256 MB each
torch.cuda.synchronize()
def timed(label, fn):
    dist.barrier(); t = time.perf_counter(); fn(); dist.barrier(); s = time.perf_counter() - t
    if rank == 0: print(f"{label}: {s:.2f} s ({n * 4 / s:.1f} GB/s over 4 ranks)", flush=True)
pinned = []; pageable = []
timed("pinned alloc + copy (first)", lambda: pinned.extend(t.to("cpu", non_blocking=False).pin_memory() if False else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in src))
timed("pinned copy (reuse)", lambda: [p.copy_(t) for p, t in zip(pinned, src)])
timed("pageable alloc + copy (first)", lambda: pageable.extend(t.to("cpu") for t in src))
timed("pageable copy (reuse)", lambda: [p.copy_(t) for p, t in zip(pageable, src)])
def host_register():
    for p in pageable:
        torch.cuda.cudart().cudaHostRegister(p.data_ptr(), p.numel() * p.element_size(), 0)
timed("cudaHostRegister of the pageable copies", host_register)
timed("registered copy (reuse)", lambda: [p.copy_(t) for p, t in zip(pageable, src)])
buf = pinned[0].view(torch.uint8).numpy()
t = time.perf_counter(); h = hashlib.sha256(); [h.update(buf) for _ in range(8)]; s = time.perf_counter() - t
if rank == 0: print(f"sha256 one thread: {8 * buf.nbytes / s / 1e9:.2f} GB/s", flush=True)
# disk: each rank writes 8 files of 1 GB from 8 threads, then fsyncs
def write_files(sync):
    def one(i):
        with open(f"/tmp/probe_{rank}_{i}", "wb") as f:
            for k in range(4): f.write(memoryview(pinned[k].view(torch.uint8).numpy()))
            if sync: f.flush(); os.fsync(f.fileno())
    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    [x.start() for x in ts]; [x.join() for x in ts]
dist.barrier(); t = time.perf_counter(); write_files(True); dist.barrier(); s = time.perf_counter() - t
if rank == 0: print(f"disk write 32 GB (4 ranks x 8 threads, fsync): {s:.1f} s = {32 / s:.2f} GB/s", flush=True)
dist.barrier(); t = time.perf_counter(); write_files(False); dist.barrier(); s = time.perf_counter() - t
if rank == 0: print(f"disk write 32 GB again, no fsync (page cache): {s:.1f} s = {32 / s:.2f} GB/s", flush=True)
t = time.perf_counter(); os.sync(); dist.barrier(); s = time.perf_counter() - t
if rank == 0: print(f"  then os.sync: {s:.1f} s", flush=True)
for i in range(8): os.remove(f"/tmp/probe_{rank}_{i}")
if rank == 0: os.system("df -h /tmp / | cat; mount | grep -E ' / | /tmp ' | cat; cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio")
