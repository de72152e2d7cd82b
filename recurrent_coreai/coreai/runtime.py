"""The one place that talks to the Core AI runtime (coreai-core) on this host.

* :func:`lower_universal` writes the Linux ahead-of-time form (``.aimodelx``: one
  ``*-universal.odix`` holding every function of the bundle) — the Linux counterpart of
  ``xcrun coreai-build compile``; how it lowers on the installed coreai-core is :mod:`.lowering`.
* :class:`DecodeSession` loads a lowered bundle and runs its decode function token by token
  with the two states kept between calls (they mutate in place).
* :class:`PromptSession` also runs the chunked prefill function on the same states: a prompt's
  full chunks through prefill, its tail through decode. Function names, roles, chunk length,
  state shapes and dtype come from the bundle's ``export.json`` (:func:`.entrypoints.bundle_functions`).

Before a function runs, its inputs, outputs and states as the loaded bundle declares them are
compared with export.json's (:func:`check_function`): a lowered bundle of another model or recipe
is one line, never a call the runtime aborts on. A Ctrl-C during a runtime call is held until the
call returns (:func:`interrupt_after`), so the interrupt reaches Python between calls and the
session closes cleanly (an interrupted call leaves the runtime's task behind: SIGABRT/SIGILL at exit).

A call is over only when the runtime's thread has left Python (:class:`RuntimeLoop`): the runtime
hands each result back from its own thread, which can still be waiting for the GIL after the main
thread has the result; had the interpreter exited then, the process aborted at exit. The
runtime's threads also drop their references to the loop after a call has returned: at exit, the
process waits until they are done (:meth:`RuntimeLoop.quiesce`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import re
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, by_role, bundle_functions, split_prompt
from recurrent_coreai.util.allocator import keep_freed_memory
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import require_space


LOWERED_RATIO, LOWERED_SLACK = 1.15, 8 << 20  # room a lowering needs: its .aimodel's bytes times this, plus this


def lower_universal(aimodel: Path, out_dir: Path) -> None:
    """Lower an ``.aimodel`` into ``out_dir`` (an existing, empty ``*.aimodelx`` directory)."""
    from coreai.authoring.asset import AIModelAsset

    if not AIModelAsset.is_valid(aimodel):
        raise PipelineError(aimodel, "is not a valid .aimodel asset", "re-run the export stage")
    # the lowering writes through a memory map: a full disk is SIGBUS, not an error, so the space
    # is checked first (the lowered form measured 1.02-1.10x its .aimodel)
    bundle = sum(f.stat().st_size for f in Path(aimodel).rglob("*") if f.is_file())
    require_space(out_dir, int(bundle * LOWERED_RATIO) + LOWERED_SLACK, f"the lowering of {Path(aimodel).name}")
    from recurrent_coreai.coreai import lowering, reproducible

    with reproducible.lowering_scope():  # canonical register order: byte-identical .odix
        lowering.lower(aimodel, out_dir)


_NDARRAY = re.compile(r"^NDArray \((\w+), ([0-9 ×]+)\)$")


def _tensor(name: str, desc: str) -> dict:
    m = _NDARRAY.match(desc)
    if not m:
        raise PipelineError("coreai-core", f"reports tensor {name!r} of a bundle function as {desc!r}, not as "
                            "'NDArray (<dtype>, <d0> × <d1> …)'", "use the pinned coreai-core (make setup)")
    return {"name": name, "shape": [int(d) for d in m[2].split("×")], "dtype": m[1].lower()}


def bundle_signature(aimodel: Path) -> dict[str, dict[str, list[dict]]]:
    """Every function an ``.aimodel`` holds, as the asset itself describes it (no lowering):
    ``{name: {"inputs"|"outputs"|"states": [{"name", "shape", "dtype"}, …]}}``."""
    from coreai.authoring.asset import AIModelAsset

    summary = AIModelAsset.load(Path(aimodel)).summary(include_statistics=False)
    if summary is None:
        raise PipelineError(aimodel, "holds no program", "re-run the export stage")
    return {fn: {kind: [_tensor(n, d) for n, d in getattr(summary, f"function_{kind}")(fn)]
                 for kind in ("inputs", "outputs", "states")} for fn in summary.function_names}


def state_spec(export_record: dict) -> tuple[dict[str, tuple[int, ...]], np.dtype]:
    """(state shapes, state dtype) of the bundle's decode function, as export.json records them."""
    states = bundle_functions(export_record)[DECODE]["states"]
    dtypes = {t["dtype"] for t in states}
    if len(dtypes) != 1:
        raise PipelineError(f"export.json of {export_record.get('bundle', 'the bundle')}",
                            f"records states of several dtypes {sorted(dtypes)}", "rerun the export stage")
    return {t["name"]: tuple(t["shape"]) for t in states}, np.dtype(dtypes.pop())


SETTLE_POLL_S, SETTLE_LIMIT_S = 0.0005, 10.0  # RuntimeLoop.settle: how often it looks, how long at most
# RuntimeLoop.quiesce at exit: how long the loop's reference count must stay unchanged, how long at most
QUIET_S, QUIET_LIMIT_S = 0.05, 2.0
_LOOPS: weakref.WeakSet = weakref.WeakSet()  # every RuntimeLoop still alive: quiesced at exit


def _quiesce_at_exit() -> None:
    """atexit (before the interpreter starts finalising, so a runtime thread may still take the GIL):
    let every live loop's runtime threads drop what they still hold (:meth:`RuntimeLoop.quiesce`)."""
    for loop in list(_LOOPS):
        loop.quiesce()


atexit.register(_quiesce_at_exit)


class RuntimeLoop(asyncio.SelectorEventLoop):
    """The event loop every runtime call runs on; it knows when a runtime thread is inside it.

    The runtime (Swift) hands a call's result back from one of its own threads (a libdispatch
    worker) through :meth:`call_soon_threadsafe`, whose wake-up write to the loop's socket releases
    the GIL. The main thread can then take the result and go on while that thread still waits to
    take the GIL back: measured on mamba2-tiny, in 110-169 of 210 calls of one ``generate``. If the
    interpreter is finalising by then, Python ends the waiting thread with ``pthread_exit``, whose
    forced unwinding reaches the Swift frames below it, and the Swift runtime aborts the process
    ("C++ exception handling detected but the Swift runtime was compiled with exceptions disabled",
    SIGABRT, exit 134; backtrace: ``_swift_exceptionPersonality`` <- ``_Unwind_ForcedUnwind`` <-
    ``pthread_exit`` <- ``take_gil`` <- ``sock_send`` on a DispatchWorker thread while the main
    thread is in ``Py_FinalizeEx``). :meth:`run` therefore returns only after :meth:`settle`.

    The same thread can also come back later: when the runtime's task ends, the Swift objects that
    held this loop are released, each taking the GIL (``PyGILState_Ensure``) to drop its
    reference (backtrace: ``take_gil`` <- ``PyGILState_Ensure`` <- ``_swift_release_dealloc``, main
    thread in ``Py_FinalizeEx``; 1 exit in 60-400 right after an interrupted load, under load). A
    load's releases come after its result (the loop's reference count: 5 before, 13 when the
    result is there, 7 a moment later). Nothing tells when they are over, so at exit, while a
    runtime thread may still take the GIL, :meth:`quiesce` waits until the reference count of every
    live loop has not changed for :data:`QUIET_S` since its last call returned (none of 700 such
    exits aborted then, under the same load)."""

    def __init__(self):
        super().__init__()
        self._inside = 0  # runtime threads inside call_soon_threadsafe (changed under the GIL)
        self._returned: float | None = None  # when run last returned (time.monotonic)
        _LOOPS.add(self)

    def call_soon_threadsafe(self, callback, *args, context=None):
        self._inside += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            self._inside -= 1  # the last bytecode such a thread runs here: no switch of the GIL after it

    @property
    def inside(self) -> int:
        return self._inside

    def settle(self, limit: float = SETTLE_LIMIT_S) -> bool:
        """Wait, the GIL released, until no runtime thread is inside this loop (at most ``limit``
        seconds); whether none is."""
        deadline = time.monotonic() + limit
        while self._inside and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
        return not self._inside

    def quiesce(self, quiet: float = QUIET_S, limit: float = QUIET_LIMIT_S) -> bool:
        """Wait, the GIL released, until this loop's reference count has not changed for ``quiet``
        seconds (at most ``limit``): the runtime's threads have dropped what they still held of it.
        Whether it went quiet. The quiet time counts from the last call's return: a loop whose last
        call returned ``quiet`` seconds ago, the interpreter running all along, returns at once."""
        if self._returned is None:
            return True  # no runtime task ever ran on it
        deadline = time.monotonic() + limit
        last, since = sys.getrefcount(self), self._returned
        while time.monotonic() < deadline:
            if time.monotonic() - since >= quiet and not self._inside:
                return True
            time.sleep(SETTLE_POLL_S * 2)
            now = sys.getrefcount(self)
            if now != last:
                last, since = now, time.monotonic()
        return False

    def run(self, awaitable):
        """``run_until_complete``, then :meth:`settle`: the runtime's thread is out of Python."""
        try:
            return self.run_until_complete(awaitable)
        finally:
            self.settle()
            self._returned = time.monotonic()


@contextlib.contextmanager
def interrupt_after():
    """SIGINT during the block is held and raised as KeyboardInterrupt when the block ends (main
    thread only; elsewhere, and when SIGINT is not Python's default handler, nothing changes)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:  # the call has returned and settled (RuntimeLoop.run): exiting now is safe
        raise KeyboardInterrupt


def _declared(fn) -> dict[str, list[dict]]:
    """A loaded function's inputs, outputs and states as the runtime describes them."""
    desc = fn.desc
    out = {}
    for kind in ("inputs", "outputs", "states"):
        names = getattr(desc, f"{kind[:-1]}_names")
        describe = getattr(desc, f"{kind[:-1]}_descriptor")
        out[kind] = [{"name": n, "shape": [int(d) for d in describe(n).shape], "dtype": str(describe(n).dtype).lower()}
                     for n in names]
    return out


def _tensors(items: list[dict]) -> str:
    return ", ".join(f"{t['name']} {list(t['shape'])} {t['dtype']}" for t in items) or "none"


def check_function(aimodelx: Path, fn, name: str, expected: dict) -> None:
    """The loaded function ``name`` declares the inputs, outputs and states ``expected`` (its
    export.json record, or just ``{"states": [...]}``) records, in name, shape and dtype."""
    try:
        got = _declared(fn)
    except Exception:  # noqa: BLE001 - a runtime without descriptors: the call itself is the check
        return
    for kind in ("states", "inputs", "outputs"):
        if kind not in expected:
            continue
        want = sorted((t["name"], list(t["shape"]), str(t["dtype"]).lower()) for t in expected[kind])
        have = sorted((t["name"], t["shape"], t["dtype"]) for t in got[kind])
        if want != have:
            raise PipelineError(aimodelx, f"function {name!r} has {kind} {_tensors(got[kind])}, but export.json "
                                f"records {_tensors(expected[kind])}: this lowered bundle was not built from this "
                                "export (another model's or recipe's bundle?)",
                                "rebuild it from this export: snakemake --cores 1 --forcerun aot")


class DecodeSession:
    """Synchronous wrapper around an async Core AI model with persistent states; ``function``
    is the decode function's name (by default the one of the entry-point table)."""

    def __init__(self, aimodelx: Path, state_shapes: dict[str, tuple[int, ...]], state_dtype: np.dtype,
                 function: str | None = None, expected: dict | None = None):
        import coreai.runtime as rt

        keep_freed_memory()  # the runtime's per-call scratch reused, not faulted in again (util/allocator.py)
        self._rt = rt
        self.aimodelx = aimodelx
        self.function = function or by_role(DECODE).name
        self._loop = RuntimeLoop()
        try:
            with interrupt_after():  # an interrupted load would leave the runtime's thread loading: SIGABRT at exit
                self._model = self._loop.run(rt.AIModel.load(str(aimodelx)))
            self._fn = self._model.load_function(self.function)
        except Exception as exc:  # noqa: BLE001 - runtime errors have many types
            self._loop.close()
            raise PipelineError(aimodelx, f"Core AI runtime cannot load it or its function {self.function!r} "
                                f"({type(exc).__name__}: {exc})",
                                "re-run the aot stage; check the toolchain versions") from None
        self.state_shapes, self.state_dtype = state_shapes, np.dtype(state_dtype)
        states = [{"name": n, "shape": list(shape), "dtype": self.state_dtype.name} for n, shape in state_shapes.items()]
        try:
            check_function(aimodelx, self._fn, self.function, {"states": states, **(expected or {})})
        except PipelineError:
            self.close()
            raise
        self.reset()

    def reset(self) -> None:
        self.states = {n: self._rt.NDArray(np.zeros(self.state_shapes[n], self.state_dtype)) for n in self.state_shapes}

    def _call(self, fn, tokens) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        inputs = {"input_ids": self._rt.NDArray(ids), "position_ids": self._rt.NDArray(np.zeros_like(ids))}
        with interrupt_after():  # an interrupted call would leave the runtime's task running
            res = self._loop.run(fn(inputs=inputs, state=self.states))
        return np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64)

    def step(self, token: int) -> np.ndarray:
        return self._call(self._fn, [token])

    @property
    def runtime_threads_inside(self) -> int:
        """Runtime threads still inside Python for this session's calls: 0 whenever a call has
        returned (:class:`RuntimeLoop`)."""
        return self._loop.inside

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(a.numpy()).copy() for n, a in self.states.items()}

    def set_states(self, arrays: dict[str, np.ndarray]) -> None:
        """Every state replaced by a copy of ``arrays[name]`` (a saved state: coreai/state_file.py,
        which checks a file first); the names, shapes and dtype must be the bundle's."""
        if set(arrays) != set(self.state_shapes):
            raise ValueError(f"states {sorted(arrays)} are not the bundle's {sorted(self.state_shapes)}")
        for n, shape in self.state_shapes.items():
            if tuple(arrays[n].shape) != tuple(shape) or arrays[n].dtype != self.state_dtype:
                raise ValueError(f"state {n} is {arrays[n].dtype} {list(arrays[n].shape)}, the bundle's "
                                 f"{self.state_dtype} {list(shape)}")
        self.states = {n: self._rt.NDArray(np.array(arrays[n], dtype=self.state_dtype, copy=True, order="C"))
                       for n in self.state_shapes}

    def close(self) -> None:
        self._fn = self._model = self._prefill = None
        self._loop.close()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptSession(DecodeSession):
    """A :class:`DecodeSession` over a bundle's decode AND prefill functions, as its export.json
    names them, on the same states: :meth:`feed` sends a prompt's full chunks through prefill
    (``chunk`` tokens per call) and its tail through decode, token by token — no padding."""

    def __init__(self, aimodelx: Path, export_record: dict):
        functions = bundle_functions(export_record)
        if PREFILL not in functions:
            raise PipelineError(f"export.json of {export_record.get('bundle', aimodelx)}", "has no prefill function",
                                "rerun the export stage (snakemake --forcerun export)")
        super().__init__(aimodelx, *state_spec(export_record), function=functions[DECODE]["name"],
                         expected=functions[DECODE])
        self.prefill_function = functions[PREFILL]["name"]
        self.chunk = int(functions[PREFILL]["tokens_per_call"])
        try:
            self._prefill = self._model.load_function(self.prefill_function)
        except Exception as exc:  # noqa: BLE001 - runtime errors have many types
            self.close()
            raise PipelineError(aimodelx, f"has no loadable function {self.prefill_function!r} ({type(exc).__name__}: "
                                f"{exc})", "rerun the export and aot stages (snakemake --forcerun export)") from None
        try:
            check_function(aimodelx, self._prefill, self.prefill_function, functions[PREFILL])
        except PipelineError:
            self.close()
            raise

    def prefill_chunk(self, tokens) -> np.ndarray:
        """Exactly ``chunk`` tokens through prefill; logits of the last one [V]."""
        if len(tokens) != self.chunk:
            raise ValueError(f"prefill takes exactly {self.chunk} tokens, got {len(tokens)}")
        return self._call(self._prefill, tokens)

    def feed(self, tokens) -> np.ndarray:
        """A whole prompt (at least one token); logits after its last token [V]."""
        tokens = list(tokens)
        full = split_prompt(len(tokens), self.chunk)[0] * self.chunk
        logits = None
        for start in range(0, full, self.chunk):
            logits = self.prefill_chunk(tokens[start:start + self.chunk])
        for t in tokens[full:]:
            logits = self.step(t)
        return logits
