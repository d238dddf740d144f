"""The Triton interpreter (TRITON_INTERPRET=1, the CPU suite) without its repeated patching at every
device-function call.

A kernel launch patches `triton.language` (the builtins, `tl.tensor`'s operators, `tl.range`, ...)
for the interpreter and restores it when the launch ends. Each call of a `@triton.jit` helper inside
the kernel patches the same modules again with equivalent closures (triton 3.x,
`InterpretedFunction.__call__`): on the CPU suite's engine paths that repatching was a third of the
interpreter's time (one Gemma-family graph-path test: 49 s of 137 s). Here a helper's call skips it
when the launch that runs it has already patched every language module the helper's globals name;
anything else (a helper naming a module the kernel does not) is patched as before. What runs, and
what every kernel computes, is unchanged: only the redundant re-patching is left out.
"""

from __future__ import annotations

import inspect
import threading


def install() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_lorafleet_patch_once", False) or not hasattr(interpreter, "_patch_lang"):
        return
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    languages: dict[object, frozenset[int]] = {}  # jit function -> ids of the language modules it names
    local = threading.local()  # .launches: this thread's running launches, what each patched (None: not yet)

    def langs_of(fn) -> frozenset[int]:
        if fn not in languages:
            languages[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return languages[fn]

    def patch_lang(fn):
        launches = getattr(local, "launches", None)
        if launches and launches[-1] is None:  # the launch's own patch
            launches[-1] = langs_of(fn)
            return original_patch(fn)
        if launches and langs_of(fn) <= launches[-1]:
            return interpreter._LangPatchScope()  # already patched by the running launch
        return original_patch(fn)

    def launch(self, *args, **kwargs):
        launches = local.__dict__.setdefault("launches", [])
        launches.append(None)
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    interpreter._lorafleet_patch_once = True
