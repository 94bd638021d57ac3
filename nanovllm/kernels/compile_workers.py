"""Forked processes that compile Triton kernels into Triton's file cache, for compile-ahead.

Compile-ahead's threads (kernels.compile_ahead) overlap the MLIR and LLVM passes and ptxas, but
Triton's code generator is Python: its AST walk holds the GIL, so 29 variants on 16 threads
took ~6 s where each alone takes ~0.2 s of it. A pool thread that hands its compile to a worker
first only reads the result back from the file cache: the worker compiles the same source,
target and options, so Triton derives the same cache key there.

The workers are forked when the runner starts, before it initialises CUDA or starts a thread,
so they hold every kernel module it imported and never touch the GPU. A task names its kernel
by module and qualified name (a forked child finds the same object); a kernel defined inside a
function, or arguments that do not pickle, compile on the thread as before, as does a task
whose worker failed: the thread's own compile then raises what Triton raises.
"""
import io
import logging
import os
import pickle
import queue
import sys
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe

logger = logging.getLogger(__name__)

# The free variables of Triton's compile closure (JITFunction._do_compile's async_compile,
# Triton 3.6 to 3.9) a task is made of; another shape compiles on the thread.
_CLOSURE = ("src", "target", "options", "env_vars")


class _TaskPickler(pickle.Pickler):
    """Pickles a JITFunction (a kernel, or a constexpr argument naming one) by its name and
    this process's cache key for it."""

    def reducer_override(self, obj: object) -> object:
        from triton.runtime.jit import JITFunction
        if isinstance(obj, JITFunction):
            if "<locals>" in obj.fn.__qualname__:
                raise pickle.PicklingError(f"{obj} is not a module attribute")
            return _find_kernel, (obj.fn.__module__, obj.fn.__qualname__, obj.cache_key)
        return NotImplemented


def _find_kernel(module: str, qualname: str, cache_key: str) -> object:
    """The JITFunction defined as module.qualname (unwrapping autotuners and heuristics),
    keyed as the caller keyed it."""
    from triton.runtime.jit import JITFunction
    obj = sys.modules[module] if module in sys.modules else __import__(module, fromlist=["_"])
    for name in qualname.split("."):
        obj = getattr(obj, name)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    # Triton 3.6 hashes the globals of a kernel's callees only where their keys were computed
    # first (DependenciesFinder merges them before asking): the same source gets another key
    # in a process that compiled other kernels in another order. The code is the same.
    obj.hash = cache_key
    return obj


def task_of(compile_fn: Callable[[], object]) -> bytes | None:
    """The pickled (source's parts, target, options, env) of Triton's compile closure, or None
    where it is not that closure or does not pickle."""
    names = getattr(getattr(compile_fn, "__code__", None), "co_freevars", ())
    if not set(_CLOSURE) <= set(names):
        return None
    cells = dict(zip(names, (cell.cell_contents for cell in compile_fn.__closure__)))
    src = cells["src"]
    options = cells["options"]
    parts = (type(src), src.fn, src.signature, src.constants, src.attrs, cells["target"],
             getattr(options, "__dict__", options), cells["env_vars"])
    buffer = io.BytesIO()
    try:
        _TaskPickler(buffer).dump(parts)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return buffer.getvalue()


def _compile(task: bytes) -> tuple[str, str, str]:
    """Compile a task into the file cache; (its kernel's hash, its source's, its function's
    cache key): the parent compares them with its own (CompileWorkers.check)."""
    from triton.compiler import compile as triton_compile
    source_type, fn, signature, constants, attrs, target, options, env_vars = pickle.loads(task)
    src = source_type(fn, signature, constants, attrs)
    kernel = triton_compile(src, target=target, options=options, _env_vars=env_vars)
    return kernel.hash, src.hash(), fn.cache_key


def _serve(conn: Connection) -> None:
    """A worker's loop: compile each task received, send its hashes (None if it failed)."""
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            result = _compile(task)
        except Exception:  # the parent's own compile reports it
            result = None
        conn.send(result)


def _fork_tree(conns: list[Connection]) -> None:
    """In a worker: fork one for each other pipe, halving the list at each fork (a process
    of the caller's size takes ~60 ms to fork: 16 in a chain would take ~1 s), serve the first
    pipe, then reap the forked ones."""
    # Triton's own key (a hash of its sources), once for all the workers: 16 processes each
    # hashing beside the caller's weight load had slowed that load by ~0.2 s
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # older Triton: each worker's first compile computes it
        pass
    children = []
    while len(conns) > 1:
        mine, theirs = conns[:len(conns) // 2], conns[len(conns) // 2:]
        pid = os.fork()
        for conn in theirs if pid else mine:  # each pipe end stays in one process
            conn.close()
        conns, children = (mine, children + [pid]) if pid else (theirs, [])
    _serve(conns[0])
    for pid in children:
        os.waitpid(pid, 0)


class CompileWorkers:
    """`count` forked processes; compile() sends a task to a free one and waits (GIL free)."""

    def __init__(self, count: int) -> None:
        self.idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.compiled_twice: list[str] = []  # kernels compiled here again: keys differed
        ours, theirs = zip(*(Pipe() for _ in range(count)))
        with warnings.catch_warnings():
            # 3.12+ warns when threads exist (a caller's): a worker only compiles, never
            # taking a lock another thread may have held at the fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()  # the caller forks once; that worker forks the others
        if pid == 0:  # a worker: never returns into the caller's code
            code = 0
            try:
                for conn in ours:
                    conn.close()
                _fork_tree(list(theirs))
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        for conn in theirs:
            conn.close()
        self.pid: int | None = pid
        for conn in ours:
            self.idle.put(conn)

    def compile(self, task: bytes) -> tuple[str, str, str] | None:
        """Compile a task_of's task in a free worker; _compile's hashes, or None if it failed."""
        conn = self.idle.get()
        try:
            conn.send_bytes(task)
            return conn.recv()
        except (EOFError, OSError):  # a dead worker: the thread compiles
            return None
        finally:
            self.idle.put(conn)

    def check(self, kernel: object, hashes: tuple[str, str, str] | None) -> None:
        """Note a kernel this process compiled again, its key unlike the worker's, and why."""
        if hashes is None or getattr(kernel, "hash", hashes[0]) == hashes[0]:
            return
        src = kernel.src
        why = ("the function's cache key" if src.fn.cache_key != hashes[2] else
               "the source's hash (signature, constants, attrs)" if src.hash() != hashes[1]
               else "the options, backend or environment")
        self.compiled_twice.append(f"{src.name}: {why}")

    def close(self) -> None:
        """End the workers (each exits when its pipe closes) and reap them."""
        while not self.idle.empty():
            self.idle.get().close()
        if self.pid is not None:
            os.waitpid(self.pid, 0)  # it reaps the workers it forked, they theirs
            self.pid = None
        if self.compiled_twice:  # a key the worker derived unlike this process: time lost
            logger.info("compiled again after a worker (keys differed): %s",
                        "; ".join(self.compiled_twice))
