"""The post-training objectives of `python -m benchmarks loss --objectives ...` (bench_loss.py): what an RL
or scoring step asks of the output layer, for ours and the peers, measured in the same rounds as the plain mean.

Objectives, over N tokens at temperature T, logp the target's log-probability and H the entropy of the
softmax of z / T (z = e @ c.T), adv advantages drawn once per case (standard normal, ADV_SEED):

- rl: -(logp · adv).mean() - ENTROPY_COEF · H.mean(), forward + backward (∇E and ∇C);
- logprobs: -(logp · adv).mean(), forward + backward;
- score: per-token logp and H under torch.no_grad() (rollout or reference-model scoring), forward only;
- fwd (a row, not an objective of --objectives): ours' plain mean, its forward alone with gradients enabled
  (the training forward, which on the one-pass path makes ∇E and ∇C), what score's time is compared with.

Methods (--post-methods): ours (cce_parallel.LinearCrossEntropy, ours:<impl>; the objective folded into the call:
weights=adv / N and entropy_weights=-ENTROPY_COEF / N, reduction "sum"), verl 0.9.1's fused linear
cross-entropy (loaded from its two kernel files without importing verl, load_verl), liger-kernel's
LigerFusedLinearScaledCrossEntropyTPFunction on a world-1 process group made for it, torch.compile and eager
PyTorch of the same math (the peers' objective written on their per-token outputs as an RL loss writes it).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import _common as C
import torch
import torch.nn.functional as F

OBJECTIVES = {
    "mean": "the plain mean cross-entropy of --methods: loss + ∇E + ∇C (the existing rows)",
    "rl": "-(logp · adv).mean() - 0.01 · entropy.mean() at temperature T: loss + ∇E + ∇C",
    "logprobs": "-(logp · adv).mean() at temperature T: loss + ∇E + ∇C",
    "score": "per-token logp and entropy at temperature T under torch.no_grad(): forward only",
}
POST = ("rl", "logprobs", "score")  # the post-training objectives, in this order in a result
FWD = "fwd"  # the row of ours' plain-mean forward alone (with gradients enabled), for score
BACKWARD = ("rl", "logprobs")  # timed forward + backward; score and fwd forward only
ENTROPY_COEF = 0.01
ADV_SEED = 2
POST_METHODS = "ours,verl,liger,compile"
SMOKE_POST_METHODS = "ours,verl,liger,eager"  # torch.compile on a CPU builds C++ for ~10 s per objective
DEFAULT_IMPL = "cce_kahan_full_c"
VERL_PACKAGE = "_bench_verl_kernel"  # the private package verl's kernel files are loaded as (load_verl)


class Unavailable(Exception):
    """A method that cannot compute an objective here (recorded as status "unavailable")."""


@dataclass
class Out:
    """What one call of an objective gives: the scalar to differentiate (rl, logprobs, fwd) and the per-token
    target log-probs (or their negation, nll) and entropies where the method returns them."""

    loss: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    nll: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def log_probs(self) -> torch.Tensor | None:
        return self.logp if self.logp is not None else None if self.nll is None else -self.nll


@dataclass
class PostMethod:
    key: str  # ours, verl, liger, compile, eager
    label: str
    make: Callable | None = None  # make(objective, temperature, a, b) -> call(e, c, t) -> Out; may raise Unavailable
    unavailable: str | None = None
    info: dict = field(default_factory=dict)
    close: Callable | None = None  # releases what building it made (liger's process group)


def row_key(objective: str, method: str) -> str:
    return f"{objective}:{method}"


def timing(objective: str) -> str:
    """The name of what a row of the objective times: "fwd_bwd", or "fwd" for score and fwd."""
    return "fwd_bwd" if objective in BACKWARD else "fwd"


def advantages(t: torch.Tensor) -> torch.Tensor:
    """adv: fp32 standard normal, shaped like t, drawn once per case (seed ADV_SEED)."""
    g = torch.Generator(t.device).manual_seed(ADV_SEED)
    return torch.randn(t.shape, device=t.device, generator=g)


def weights(objective: str, t: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """(a, b) such that the objective is Σ_i a_i · CE_i + b · Σ_i H_i, CE = -logp: a = adv / N, b =
    -ENTROPY_COEF / N for rl and None for logprobs."""
    n = t.numel()
    return advantages(t) / n, (-ENTROPY_COEF / n if objective == "rl" else None)


# ---- Methods -------------------------------------------------------------------------------------


def _ours(impl: str) -> PostMethod:
    label = f"cce_parallel {impl}"
    try:
        import cce_parallel as pkg
    except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
        return PostMethod("ours", label, unavailable=C.short_error(exc), info={"impl": impl})
    options = set(getattr(pkg.linear_cross_entropy, "__kwdefaults__", None) or ())
    missing = {"temperature", "return_entropy"} - options
    if missing or impl not in getattr(pkg, "IMPLS", ()):
        why = f"no {', '.join(sorted(missing))}= in linear_cross_entropy" if missing else f"{impl} not in IMPLS"
        return PostMethod("ours", label, unavailable=why, info={"impl": impl})
    entropy_weights = "entropy_weights" in inspect.signature(pkg.LinearCrossEntropy.forward).parameters

    def make(objective, temperature, a, b):
        if objective == "rl" and not entropy_weights:
            raise Unavailable("cce_parallel has no entropy_weights= in LinearCrossEntropy.forward")
        if objective == "score":
            module = pkg.LinearCrossEntropy(impl=impl, reduction="none", return_entropy=True, temperature=temperature)

            def call(e, c, t):
                with torch.no_grad():
                    nll, entropy = module(e, c, t)
                return Out(nll=nll, entropy=entropy)
        elif objective == "rl":
            module = pkg.LinearCrossEntropy(impl=impl, reduction="sum", return_entropy=True, temperature=temperature)

            def call(e, c, t):  # the returned loss is the objective: Σ a·CE + b·H
                loss, entropy = module(e, c, t, weights=a, entropy_weights=b)
                return Out(loss=loss, entropy=entropy)
        elif objective == "logprobs":
            module = pkg.LinearCrossEntropy(impl=impl, reduction="sum", temperature=temperature)

            def call(e, c, t):
                return Out(loss=module(e, c, t, weights=a))
        else:  # FWD: the plain mean, a module of its own (its forwards teach nothing to the mean row's)
            module = pkg.LinearCrossEntropy(impl=impl)

            def call(e, c, t):
                return Out(loss=module(e, c, t))
        call.state = module.state  # its paths go into the result, as the mean rows'
        return call

    return PostMethod("ours", label, make, info={"impl": impl, "entropy_weights": entropy_weights})


def load_verl():
    """verl's fused linear cross-entropy, `linear_cross_entropy(hidden, weight, labels, temperature, reduction)
    -> (logprobs, entropy)`, from verl/utils/kernel/{linear_cross_entropy,kernels}.py of the installed verl,
    without importing verl: its package __init__ imports ray, tensordict and transformers, which those two
    files do not need. They need torch, triton and verl.utils.device (verl's platform layer), which is
    stubbed with torch.cuda while they load. Loaded once, as the package VERL_PACKAGE."""
    if VERL_PACKAGE in sys.modules:
        return sys.modules[VERL_PACKAGE]
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'verl'")
    kdir = Path(next(iter(spec.submodule_search_locations))) / "utils" / "kernel"
    cuda = torch.cuda.is_available()
    device = types.ModuleType("verl.utils.device")  # what kernels.py imports of it
    device.is_cuda_available = cuda
    device.get_device_capability = lambda device_id=0: (
        torch.cuda.get_device_capability(device_id) if cuda else (None, None))
    device.get_device_name = lambda: "cuda" if cuda else "cpu"
    device.get_torch_device = lambda: torch.cuda
    package = types.ModuleType(VERL_PACKAGE)
    package.__path__ = [str(kdir)]  # linear_cross_entropy.py's `from . import kernels` resolves here
    saved = sys.modules.get("verl.utils.device")
    sys.modules["verl.utils.device"], sys.modules[VERL_PACKAGE] = device, package
    try:
        for name in ("kernels", "linear_cross_entropy"):
            spec = importlib.util.spec_from_file_location(f"{VERL_PACKAGE}.{name}", kdir / f"{name}.py")
            if spec is None:
                raise ModuleNotFoundError(f"verl has no utils/kernel/{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            setattr(package, name, module)
    except BaseException:
        for name in (VERL_PACKAGE, f"{VERL_PACKAGE}.kernels", f"{VERL_PACKAGE}.linear_cross_entropy"):
            sys.modules.pop(name, None)
        raise
    finally:
        if saved is None:
            del sys.modules["verl.utils.device"]
        else:
            sys.modules["verl.utils.device"] = saved
    return package


def _verl(device) -> PostMethod:
    label, ver = "verl fused linear cross-entropy (Triton)", C.pkg_version("verl")
    try:
        fn = load_verl().linear_cross_entropy.linear_cross_entropy
    except Exception as exc:  # noqa: BLE001
        return PostMethod("verl", label, unavailable=C.short_error(exc))
    label = label.replace(" ", f" {ver} ", 1)
    if not C.is_cuda(device):
        return PostMethod("verl", label, unavailable="needs CUDA (its kernels assert hidden.is_cuda)")

    def make(objective, temperature, a, b):
        temperature = float(temperature)  # it asserts a float
        if objective == "score":
            def call(e, c, t):
                with torch.no_grad():
                    logp, entropy = fn(e, c, t, temperature, "none")
                return Out(logp=logp, entropy=entropy)
            return call
        # Its backward asserts contiguous per-token gradients: weights as tensors, as a masked mean gives them.
        wl, we = -a, (torch.full_like(a, b) if b is not None else None)

        def call(e, c, t):
            logp, entropy = fn(e, c, t, temperature, "none")
            loss = (logp * wl).sum() if we is None else (logp * wl).sum() + (entropy * we).sum()
            return Out(loss=loss, logp=logp, entropy=entropy)
        return call

    return PostMethod("verl", label, make, info={"version": ver, "loaded": "verl/utils/kernel by file path"})


LIGER_NATIVE, LIGER_FALLBACK = "native CUTLASS + NVSHMEM", "chunked fallback (512-token chunks, PyTorch)"


def _liger(device, dtype) -> PostMethod:
    label = "liger-kernel LigerFusedLinearScaledCrossEntropyTPFunction, world-1 gloo group"
    try:
        mod = importlib.import_module("liger_kernel.ops.fused_linear_scaled_cross_entropy")
        fn = mod.LigerFusedLinearScaledCrossEntropyTPFunction.apply
    except Exception as exc:  # noqa: BLE001
        return PostMethod("liger", label, unavailable=C.short_error(exc))
    ver = C.pkg_version("liger-kernel")
    label = label.replace(" ", f" {ver} ", 1)
    if not C.is_cuda(device):
        return PostMethod("liger", label, unavailable="needs CUDA (its TP function checks input.is_cuda)")
    path = _liger_path(mod, device, dtype)
    try:
        group, close = _world_one_group()
    except Exception as exc:  # noqa: BLE001
        return PostMethod("liger", label, unavailable=f"world-1 process group: {C.short_error(exc)}")

    def make(objective, temperature, a, b):
        if objective == "score":
            def call(e, c, t):
                with torch.no_grad():
                    nll, entropy = fn(e, c, t, group, temperature, -100, 1, True)
                return Out(nll=nll, entropy=entropy)
            return call
        if objective == "logprobs":
            def call(e, c, t):
                nll = fn(e, c, t, group, temperature, -100, 1, False)
                return Out(loss=(nll * a).sum(), nll=nll)
            return call
        we = torch.full_like(a, b)

        def call(e, c, t):
            nll, entropy = fn(e, c, t, group, temperature, -100, 1, True)
            return Out(loss=(nll * a).sum() + (entropy * we).sum(), nll=nll, entropy=entropy)
        return call

    return PostMethod("liger", f"{label}, {path}", make, close=close,
                      info={"version": ver, "path": path, "process_group": "gloo, world size 1"})


def _liger_path(mod, device, dtype) -> str:
    """Which of its paths LigerFusedLinearScaledCrossEntropyTPFunction takes here, as it decides (bf16 on
    sm90 / sm100 with liger-cute-kernels and NVSHMEM: native, else its fallback)."""
    try:
        if dtype == torch.bfloat16 and mod._supports_native_tp_architecture(torch.device(device)):
            try:
                if mod._load_native_tp_function() is not None:
                    return LIGER_NATIVE
            except ImportError:
                pass
        return LIGER_FALLBACK
    except Exception as exc:  # noqa: BLE001 - its private helpers moved: say so, the run goes on
        return f"unknown ({C.short_error(exc, 100)})"


def _world_one_group():
    """(the default process group, a function that destroys it if made here): one of world size 1 (gloo, an
    in-memory store), for liger's TP function, which reads the group's rank and size and, at size 1, calls
    no collective."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is initialized")
        return dist.group.WORLD, None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD, dist.destroy_process_group


def _math(e, c, t, temperature: float, entropy: bool = True):
    """(logp, entropy or None) in PyTorch: the logits in the input dtype, then fp32 / T."""
    z = F.linear(e, c).float() / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, t[:, None]).squeeze(-1)
    if not entropy:
        return logp, None
    return logp, torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def rl_math(e, c, t, temperature: float, wl, we):
    logp, entropy = _math(e, c, t, temperature)
    return (logp * wl).sum() + (entropy * we).sum(), logp, entropy


def logprobs_math(e, c, t, temperature: float, wl):
    logp, _ = _math(e, c, t, temperature, entropy=False)
    return (logp * wl).sum(), logp


def score_math(e, c, t, temperature: float):
    return _math(e, c, t, temperature)


def _torch(key: str) -> PostMethod:
    compiled = key == "compile"
    label = "torch.compile of the same math" if compiled else "torch eager, the same math"

    def make(objective, temperature, a, b):
        # Three functions, three code objects: torch.compile caches one graph per function (dynamic=False).
        fns = {"rl": rl_math, "logprobs": logprobs_math, "score": score_math}
        fn = torch.compile(fns[objective], dynamic=False) if compiled else fns[objective]
        if objective == "score":
            def call(e, c, t):
                with torch.no_grad():
                    logp, entropy = fn(e, c, t, temperature)
                return Out(logp=logp, entropy=entropy)
        elif objective == "logprobs":
            wl = -a

            def call(e, c, t):
                loss, logp = fn(e, c, t, temperature, wl)
                return Out(loss=loss, logp=logp)
        else:
            wl, we = -a, torch.full_like(a, b)

            def call(e, c, t):
                loss, logp, entropy = fn(e, c, t, temperature, wl, we)
                return Out(loss=loss, logp=logp, entropy=entropy)
        return call

    return PostMethod(key, label, make,
                      info={"math": "logits = e @ c.T in the input dtype, .float() / T, log_softmax + gather, "
                                    "entropy = logsumexp - Σ softmax·z"})


def build(keys: list[str], device, dtype) -> list[PostMethod]:
    """The --post-methods: ours[:<impl>], verl, liger, compile, eager (at most one ours)."""
    out: list[PostMethod] = []
    for key in keys:
        if key.partition(":")[0] == "ours":
            if any(m.key == "ours" for m in out):
                raise SystemExit(f"--post-methods: one ours at most ({key!r})")
            out.append(_ours(key.partition(":")[2] or DEFAULT_IMPL))
        elif key == "verl":
            out.append(_verl(device))
        elif key == "liger":
            out.append(_liger(device, dtype))
        elif key in ("compile", "eager"):
            out.append(_torch(key))
        else:
            raise SystemExit(f"unknown post-training method {key!r}; known: ours[:<impl>], verl, liger, compile, eager")
    return out


def close(methods: list[PostMethod]) -> None:
    for m in methods:
        if m.close is not None:
            m.close()
            m.close = None


# ---- Reference -----------------------------------------------------------------------------------


@torch.no_grad()
def reference(e, c, t, *, temperature: float = 1.0, a: torch.Tensor | None = None, b: float | None = None,
              chunk_bytes: int = 1 << 29) -> dict:
    """Per-token logp and entropy ([N] fp64) at temperature T of the inputs upcast: fp32 logits (TF32 off),
    their softmax statistics in fp64, chunked over tokens. With a (shaped like t): also the objective Σ a_i·CE_i +
    b·Σ H_i (b None: 0) as "loss" and its fp32 ∇E [N, D], ∇C [V, D]; dz = a (p - onehot) - b p (z - Σ p z),
    divided by T."""
    N, V = e.shape[0], c.shape[0]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        c32 = c.float()
        out = {"logp": torch.empty(N, dtype=torch.float64, device=e.device),
               "entropy": torch.empty(N, dtype=torch.float64, device=e.device)}
        if a is not None:
            aa = a.reshape(-1).double()
            out["grad_e"] = torch.empty(e.shape, dtype=torch.float32, device=e.device)
            out["grad_c"] = torch.zeros(c.shape, dtype=torch.float32, device=e.device)
            loss = torch.zeros((), dtype=torch.float64, device=e.device)
        chunk = max(1, min(N, chunk_bytes // (8 * V)))
        for s in range(0, N, chunk):
            e32, tt = e[s : s + chunk].float(), t[s : s + chunk]
            z = (e32 @ c32.T).double() / temperature
            lse = torch.logsumexp(z, dim=-1)
            p = (z - lse[:, None]).exp_()
            ez = (p * z).sum(-1)
            logp = z.gather(1, tt[:, None]).squeeze(1) - lse
            out["logp"][s : s + chunk], out["entropy"][s : s + chunk] = logp, lse - ez
            if a is None:
                continue
            w = aa[s : s + chunk]
            loss += -(w * logp).sum() + (0.0 if b is None else b * (lse - ez).sum())
            g = p * w[:, None]
            g[torch.arange(tt.numel(), device=e.device), tt] -= w
            if b is not None:
                g -= b * p * (z - ez[:, None])
            g = (g / temperature).float()
            del z, p
            torch.mm(g, c32, out=out["grad_e"][s : s + chunk])
            out["grad_c"].addmm_(g.T, e32)
            del g
        if a is not None:
            out["loss"] = float(loss)
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# ---- Measuring (bench_loss.run_case times the rows with the plain mean's, in the same rounds) -------------


@dataclass
class PostRun:
    """What a run measures besides the mean: its objectives (of POST), methods and temperature, and the key
    of ours' plain-mean row among the mean's methods (ours:<impl>), which its ratios are over."""

    objectives: list[str]
    methods: list[PostMethod]
    temperature: float
    mean_key: str | None

    def rows(self) -> list[tuple[str, PostMethod]]:
        """(objective, method) of every row, in the order measured: each objective's methods, then fwd:ours."""
        rows = [(o, m) for o in self.objectives for m in self.methods]
        ours = next((m for m in self.methods if m.key == "ours"), None)
        return rows + ([(FWD, ours)] if "score" in self.objectives and ours is not None else [])


def measure(method: PostMethod, objective: str, e, c, t, *, temperature: float, ref: dict | None, device):
    """All of one row but its time: its call built, one call (with its backward for rl and logprobs) for its
    errors against ref (reference()'s), the peak memory of another. Returns (res, call or None); a fatal CUDA
    error raises C.FatalCudaError (.result: what was recorded)."""
    key, what = row_key(objective, method.key), timing(objective)
    res = {"key": key, "objective": objective, "method": method.key, "label": method.label, "status": "ok"}
    if method.unavailable:
        res.update(status="unavailable", error=method.unavailable)
        return res, None
    a, b = weights(objective, t) if objective in BACKWARD else (None, None)
    stage, call = "build", None
    try:
        call = method.make(objective, temperature, a, b)
        stage = "accuracy"
        C.clear_grad(e, c)
        out = run(call, objective, e, c, t)
        C.sync(device)
        res.update(errors(out, ref, e, c))
        grad_fn = next((x.grad_fn for x in (out.loss, out.nll, out.logp) if x is not None and x.grad_fn), None)
        if method.key == "liger" and grad_fn is not None:  # which of its paths ran: its autograd Function
            res["ran"] = type(grad_fn).__name__
        del out, grad_fn
        C.clear_grad(e, c)
        stage = f"{what} memory"
        res[f"{what}_mem_bytes"] = C.peak_bytes(lambda: run(call, objective, e, c, t), device=device)
    except Unavailable as exc:
        res.update(status="unavailable", error=str(exc))
        call = None
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the run goes on
        res.update(C.failure(exc, stage))
        call = None
        if C.is_fatal_cuda_error(exc):
            fatal = C.FatalCudaError(res["error"])
            fatal.result = res
            raise fatal from None
    finally:
        C.clear_grad(e, c)
        C.free_memory(device)
    return res, call


def run(call, objective: str, e, c, t) -> Out:
    """One timed unit of a row: the call, and for rl and logprobs the backward of its objective."""
    out = call(e, c, t)
    if objective in BACKWARD:
        out.loss.backward()
    return out


def errors(out: Out, ref: dict | None, e, c) -> dict:
    """The call's relative errors against ref: the objective (its value), logp and entropy (‖x - ref‖ / ‖ref‖
    over the tokens), ∇E and ∇C, each where both have it."""
    res = {}
    if out.loss is not None:
        res["loss"] = float(out.loss.detach().float())
    if not ref:
        return res
    if "loss" in res and ref.get("loss") is not None:
        res["loss_rel_err"] = abs(res["loss"] - ref["loss"]) / abs(ref["loss"])
    logp = out.log_probs()
    for name, x in (("logp", logp), ("entropy", out.entropy)):
        if x is not None and ref.get(name) is not None:
            res[f"{name}_rel_err"] = C.rel_err(x.detach().reshape(-1), ref[name])
    if ref.get("grad_e") is not None:
        res["grad_e_rel_err"] = None if e.grad is None else C.rel_err(e.grad.reshape(-1, e.shape[-1]), ref["grad_e"])
        res["grad_c_rel_err"] = None if c.grad is None else C.rel_err(c.grad, ref["grad_c"])
    return res


def ratios(rows: dict, mean: dict | None, sizes: list) -> None:
    """In place, from the rows' stored call times (C.paired_ratio, rounds of `sizes` calls): each row's time
    over ours' plain mean's fwd+bwd (vs_mean_paired; `mean` its result), a score row's over ours' training
    forward (vs_fwd_paired, fwd:ours), each over verl's of the same objective (vs_verl_paired); and peak
    memory over torch.compile's of the same objective (mem_vs_compile)."""
    def times(res):
        return (res.get(timing(res["objective"])) or {}).get("times_ms") if res else None

    mean_times = ((mean or {}).get("fwd_bwd") or {}).get("times_ms")
    for key, res in rows.items():
        mine, what = times(res), timing(res["objective"])
        if not mine:
            continue
        bases = {"vs_mean_paired": mean_times}
        if res["objective"] == "score":
            bases["vs_fwd_paired"] = times(rows.get(row_key(FWD, "ours")))
        if res["objective"] != FWD and res["method"] != "verl":
            bases["vs_verl_paired"] = times(rows.get(row_key(res["objective"], "verl")))
        for name, base in bases.items():
            ratio = C.paired_ratio(mine, base, sizes) if base else None
            if ratio is not None:
                res[what][name] = ratio
        ref = rows.get(row_key(res["objective"], "compile"), {}).get(f"{what}_mem_bytes")
        if res.get(f"{what}_mem_bytes") is not None and ref and res["method"] != "compile":
            res["mem_vs_compile"] = res[f"{what}_mem_bytes"] / ref
