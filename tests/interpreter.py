"""Triton's interpreter without its repeated set-up: a test-only speed-up, numerics unchanged.

Under TRITON_INTERPRET=1 a kernel launch swaps triton.language's builtins for numpy versions
(``_patch_lang``) and swaps them back when the launch ends. Triton 3.x also re-runs that swap on
every call of a nested ``@triton.jit`` helper, inside the launch, where the modules it patches are
already patched; it walks every member of triton.language with ``inspect.getmembers`` each time.
That made about a third of a CPU kernel test's time (tests/ops/test_one_pass.py, cProfile: 6.4 of
21 s of interpreted kernels, in 6,854 such calls).

``skip_nested_patching()`` makes a nested call skip the swap when every triton.language module its
function sees was swapped by the launch that is running. Anything else (a launch, a helper that
sees a module the launch did not, a triton without these internals) goes through triton's own code.
"""

import os


def skip_nested_patching() -> bool:
    """Install the skip once per process (under TRITON_INTERPRET=1 only); whether it is installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type, "restore"):
        return False
    if getattr(original, "skips_nested", False):
        return True
    import inspect

    import triton.language as tl

    patched: set = set()  # ids of the modules the running launch swapped; empty between launches
    seen_by: dict = {}  # function -> ids of the triton.language modules in its globals

    def langs(fn) -> set:
        if fn not in seen_by:
            seen_by[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        return seen_by[fn]

    class LaunchScope(scope_type):
        def restore(self):
            try:
                super().restore()
            finally:
                patched.clear()

    def patch_lang(fn):
        seen = langs(fn)
        if patched and seen <= patched:
            return scope_type()  # nothing swapped, nothing to restore
        scope = original(fn)
        if not patched:  # the launch's own swap: GridExecutor restores it when the launch ends
            scope.__class__ = LaunchScope
        patched.update(seen)
        return scope

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    return True
