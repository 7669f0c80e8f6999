"""Compile a JAX function for an H100/H200 and return the optimized HLO text.

Deviceless targets (``"h100"``, ``"h200"``) compile in a child process that
starts with ``JAX_PLATFORMS=cpu`` and the requested ``XLA_FLAGS``: XLA reads
its flags once per process, the caller keeps its own CPU or GPU backend, and a
compiler crash (XLA aborts on some internal errors) cannot take the caller
down with it.

The function reaches the child as a ``jax.export.Exported``: traced and lowered
here for the ``cuda`` platform, pickled, and compiled there for the topology.
That carries lambdas, closures, ``functools.partial`` and custom_vjp alike, and
keeps the caller's source lines in the HLO metadata. Shardings travel as
``PartitionSpec``s over an ``AbstractMesh``, so the caller needs no devices:
arguments sharded over 8 fake CPU devices compile for 8 H100s.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding

from fp8jax.verify import toolchain
from fp8jax.verify._arguments import abstract_args, donated_leaves, flatten_call, out_specs
from fp8jax.verify.meshes import MeshAxes, named_shardings, resolve_mesh

TARGETS = ("h100", "h200", "b200", "live")
# The folder holding this fp8jax package.
_FP8JAX_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CompileError(RuntimeError):
    """A compile failed; the message carries the compiler's own error."""


def compile_for(
    fn: Callable[..., Any] | str,
    *args: Any,
    target: str = "h100",
    devices: int = 1,
    hosts: int = 1,
    mesh: Any = None,
    xla_flags: str | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> str:
    """Compiles ``fn(*args)`` for a GPU target and returns the optimized HLO text.

    Args:
      fn: the function to compile (any callable: lambdas and closures work), or
        a ``"MODULE:FUNCTION"`` string naming a factory that takes the Mesh
        (None without one) and returns ``(fn, args)``; the factory then runs
        in the compiling process, against the target's own devices.
      *args: arrays or ``jax.ShapeDtypeStruct``s, in any pytree; shardings they
        carry (``NamedSharding`` on any mesh) are re-created on the target mesh
        by axis name. Leaves without ``shape`` and ``dtype`` are static.
      target: ``"h100"``, ``"h200"`` or ``"b200"`` (deviceless, in a child
        process; ``"b200"`` is structural only, see its ``.txtpb``), a
        path to a ``GpuTargetConfigProto`` ``.txtpb`` file, or ``"live"`` to
        compile in this process on its GPU.
      devices: number of GPUs in total.
      hosts: number of hosts the GPUs are spread over (deviceless only).
      mesh: axis sizes as a dict ``{"fsdp": 8}``, pairs ``(("dp", 2), ...)``,
        a flat ``("dp", 2, "fsdp", 4)``, a string ``"dp=2,fsdp=4"`` or a
        ``Mesh``/``AbstractMesh``. Defaults to the mesh of the arguments.
      xla_flags: ``XLA_FLAGS`` for the compile, e.g.
        ``"--xla_gpu_enable_triton_gemm=false"``; with ``"live"`` they are
        passed as per-compile XLA options.
      in_shardings: ``PartitionSpec``s or ``NamedSharding``s, a pytree prefix
        of ``args`` as for ``jax.jit``; they override the arguments' own.
      out_shardings: the same for the outputs.

    Returns:
      The text of the optimized HLO module.

    Raises:
      TypeError, ValueError: for arguments that cannot describe a compile.
      ImportError: if the deviceless toolchain (``fp8jax[verify]``) is missing
        or its CUDA plugin does not match jaxlib.
      CompileError: if tracing or compiling fails; it quotes the cause.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.verify import compile_for
      >>> x = jax.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn)
      >>> mm = lambda a, b: jax.lax.dot(a, b.T, preferred_element_type=jnp.bfloat16)
      >>> hlo = compile_for(mm, x, x, target="h100")
      >>> "f8e4m3fn" in hlo and "__triton" in hlo
      True
    """
    if isinstance(fn, str) and args:
        raise TypeError(
            f"fn={fn!r} names a factory that returns (fn, args), so pass no args with it; "
            f"got {len(args)}."
        )
    call = _Call(fn, args, in_shardings, out_shardings)
    return _compile([call], target, devices, hosts, mesh, xla_flags)[0][0]


def compile_many(
    calls: Sequence[tuple[Callable[..., Any] | str, Sequence[Any]]],
    *,
    target: str = "h100",
    devices: int = 1,
    hosts: int = 1,
    mesh: Any = None,
    xla_flags: str | None = None,
) -> list[str]:
    """Like ``compile_for`` for several ``(fn, args)`` pairs, in one child process.

    Starting the child costs a few seconds; compiling a small program costs
    about one. Batch the compiles that share a target, mesh and flags.

    Args:
      calls: ``(fn, args)`` pairs; ``args`` is a tuple of positional arguments.
      target, devices, hosts, mesh, xla_flags: as for ``compile_for``.

    Returns:
      One HLO text per call, in order.

    Raises:
      As ``compile_for``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.verify import compile_many
      >>> x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
      >>> texts = compile_many([(jnp.dot, (x, x)), (jnp.add, (x, x))], target="h200")
      >>> len(texts)
      2
    """
    jobs = []
    for i, call in enumerate(calls):
        if not (isinstance(call, tuple | list) and len(call) == 2):
            raise TypeError(f"calls[{i}] must be a (fn, args) pair, got {call!r}.")
        fn, args = call
        jobs.append(_Call(fn, tuple(args), None, None))
    return [hlo for hlo, _ in _compile(jobs, target, devices, hosts, mesh, xla_flags)]


class Memory(NamedTuple):
    """A compiled program's buffers per device, in bytes (``Compiled.memory_analysis()``).

    ``peak`` is what the program holds at once at most: its arguments, outputs
    and temporaries, less the outputs that reuse donated arguments' buffers.
    """

    argument: int
    output: int
    temp: int
    alias: int

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias


def memory_many(
    calls: Sequence[tuple[Callable[..., Any], Sequence[Any]]],
    *,
    target: str = "h200",
    devices: int = 1,
    mesh: Any = None,
    xla_flags: str | None = None,
    donate_argnums: tuple[int, ...] = (),
) -> list[Memory]:
    """Like ``compile_many``, but returns each compiled program's :class:`Memory`.

    A deviceless compile plans every buffer as a GPU's would, so its peak sizes a
    batch for that GPU without one. The compile has no autotuning and no cuDNN:
    a program that runs cuDNN attention on the GPU must be measured with a
    stand-in of the same footprint.

    Args:
      calls: ``(fn, args)`` pairs, as for ``compile_many``.
      target, devices, mesh, xla_flags: as for ``compile_for``.
      donate_argnums: the arguments every call donates, as for ``jax.jit``: a
        train step that donates its state reuses those buffers for the new one.

    Returns:
      One :class:`Memory` per call, in order.

    Raises:
      As ``compile_for``; CompileError if XLA reports no memory analysis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.verify import memory_many
      >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
      >>> [memory] = memory_many([(jnp.dot, (x, x))], target="h200")
      >>> memory.peak >= 3 * 1024 * 1024 * 2
      True
    """
    if not (isinstance(donate_argnums, tuple) and all(isinstance(i, int) for i in donate_argnums)):
        raise TypeError(f"donate_argnums must be a tuple of ints, got {donate_argnums!r}.")
    jobs = []
    for i, call in enumerate(calls):
        if not (isinstance(call, tuple | list) and len(call) == 2 and callable(call[0])):
            raise TypeError(f"calls[{i}] must be a (fn, args) pair, got {call!r}.")
        fn, args = call
        if any(not 0 <= n < len(args) for n in donate_argnums):
            raise ValueError(
                f"donate_argnums={donate_argnums} must index calls[{i}]'s {len(args)} arguments."
            )
        jobs.append(_Call(fn, tuple(args), None, None, donate_argnums))
    results = _compile(jobs, target, devices, 1, mesh, xla_flags)
    memories = []
    for i, (_, memory) in enumerate(results):
        if memory is None:
            raise CompileError(f"call {i}: XLA gave no memory analysis for target {target!r}.")
        memories.append(Memory(**memory))
    return memories


@dataclasses.dataclass(frozen=True)
class _Call:
    fn: Callable[..., Any] | str
    args: tuple[Any, ...]
    in_shardings: Any
    out_shardings: Any
    donate_argnums: tuple[int, ...] = ()


def _compile(calls, target, devices, hosts, mesh, xla_flags) -> list[tuple[str, dict | None]]:
    """One (HLO text, buffer sizes or None) per call."""
    config = _target_config(target)
    _check_counts(devices, hosts)
    if xla_flags is not None and not isinstance(xla_flags, str):
        raise TypeError(f"xla_flags must be a str like '--xla_foo=true', got {xla_flags!r}.")
    for call in calls:
        if not (callable(call.fn) or (isinstance(call.fn, str) and ":" in call.fn)):
            raise TypeError(f"fn must be a callable or 'MODULE:FUNCTION', got {call.fn!r}.")
    axes = resolve_mesh(mesh, [c for call in calls for c in (call.args, call.in_shardings)])
    if axes is not None and axes.size != devices:
        raise ValueError(
            f"mesh {axes} spans {axes.size} devices but devices={devices}; "
            f"pass devices={axes.size} or a mesh of {devices} devices."
        )
    if axes is None and devices > 1:
        raise ValueError(
            f"devices={devices} needs a mesh to shard over: pass mesh= (e.g. "
            f"mesh={{'fsdp': {devices}}}) or arguments with NamedShardings."
        )
    if target == "live":
        from fp8jax.verify import _worker

        return [_worker.compile_live(call, axes, devices, xla_flags) for call in calls]
    toolchain.check_deviceless()
    jobs = [_job(call, axes) for call in calls]
    payload = {
        "target_config": config,
        "topology": f"1x{hosts}x{devices // hosts}",
        "mesh": axes,
        "sys_path": sys.path,
        "jobs": jobs,
    }
    return _run_child(payload, xla_flags, [_name(call.fn) for call in calls])


def _name(fn) -> str:
    """How a report names the compiled function: its entry string, or its qualified name."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name or type(fn).__name__


def _target_config(target: str) -> str | None:
    if not isinstance(target, str):
        raise TypeError(f"target must be a str, one of {TARGETS} or a .txtpb path; got {target!r}.")
    if target == "live":
        return None
    if target in TARGETS:
        return toolchain.target_config(target)
    if target.endswith(".txtpb") and os.path.isfile(target):
        try:
            with open(target, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            # Both came out without the file's name: a traceback, or the codec's words alone.
            raise ValueError(
                f"target config {target} cannot be read as a text GpuTargetConfigProto: {e}"
            ) from None
        return toolchain.validate_target_config(text, target)
    raise ValueError(
        f"target must be one of {TARGETS} or the path of a GpuTargetConfigProto .txtpb file; "
        f"got {target!r}."
    )


def _check_counts(devices: int, hosts: int) -> None:
    for name, value in (("devices", devices), ("hosts", hosts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if devices % hosts:
        raise ValueError(
            f"devices={devices} is not divisible by hosts={hosts}; every host has "
            "the same number of GPUs (the topology is 1 x hosts x devices/hosts)."
        )


def _job(call: _Call, axes: MeshAxes | None) -> dict[str, Any]:
    """What the child needs for one call: an entry point, or a pickled Exported."""
    if isinstance(call.fn, str):
        return {"entry": call.fn}
    flat_fn, arrays, specs = flatten_call(call.fn, call.args, call.in_shardings, axes)
    donate = donated_leaves(call.args, call.donate_argnums)
    abstract_mesh = _traced_mesh(call, axes.build()) if axes else None
    sharding_for = (lambda s: NamedSharding(abstract_mesh, s)) if axes else (lambda s: None)
    sds = abstract_args(arrays, specs, sharding_for)
    outs = out_specs(flat_fn, sds, call.out_shardings) if axes else None
    jit_kw = {}
    if axes:
        jit_kw["in_shardings"] = tuple(sharding_for(s) for s in specs)
    if outs is not None:
        jit_kw["out_shardings"] = tuple(None if s is None else sharding_for(s) for s in outs)
    # Both sides run the same jax, so export's cross-version stability rules
    # for custom calls do not apply: "ALL" waives them.
    waive = [jax.export.DisabledSafetyCheck.custom_call("ALL")]
    try:
        with _context_mesh(call, abstract_mesh):
            exported = jax.export.export(
                jax.jit(flat_fn, **jit_kw), platforms=("cuda",), disabled_checks=waive
            )(*sds)
    except Exception as e:
        raise CompileError(
            f"tracing {flat_fn.__name__} for the cuda platform failed: {type(e).__name__}: {e}"
        ) from e
    # The VJP closure is the one part of an Exported that does not pickle, and
    # compiling never needs it.
    exported = dataclasses.replace(exported, _get_vjp=None)
    return {"exported": pickle.dumps(exported), "in_specs": specs, "out_specs": outs,
            "donate": donate}  # fmt: skip


def _traced_mesh(call: _Call, abstract_mesh):
    """The abstract mesh the arguments are typed with: ``abstract_mesh``, or the context's.

    Over Explicit axes the arguments' types carry their mesh, and JAX refuses
    a context mesh that differs from it (a CPU Mesh's abstract mesh names its
    device kind, ``axes.build()`` does not): there the arguments take the
    abstract mesh of the context :func:`_context_mesh` traces under.
    """
    if AxisType.Explicit not in tuple(abstract_mesh.axis_types):
        return abstract_mesh
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        concrete = _arguments_mesh(call)
        context = concrete.abstract_mesh if concrete is not None else abstract_mesh

    def axes(mesh):
        return mesh.axis_names, mesh.axis_sizes, tuple(mesh.axis_types)

    return context if axes(context) == axes(abstract_mesh) else abstract_mesh


def _context_mesh(call: _Call, abstract_mesh):
    """The mesh as context while tracing, as :func:`fp8jax.sharding.use_mesh` sets it.

    fp8jax's ops read it to keep whole-array kernels out of sharded programs,
    and bare ``PartitionSpec`` constraints in ``fn`` need it. Arguments
    sharded on a concrete Mesh make that Mesh the context (``fn`` may use it,
    as shard_map does, and JAX refuses a context mesh that differs from it);
    otherwise the abstract mesh. Left alone where the caller set one.
    """
    if abstract_mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    if (concrete := _arguments_mesh(call)) is not None:
        return jax.set_mesh(concrete)
    return jax.sharding.use_abstract_mesh(abstract_mesh)


def _arguments_mesh(call: _Call):
    """The first concrete Mesh the call's arguments are sharded on, or None."""
    for sharding in named_shardings(call.args):
        if isinstance(sharding.mesh, jax.sharding.Mesh):
            return sharding.mesh
    return None


# The compiler children running now, each with its temporary folder: what
# stop_children_before_exit ends and removes.
_children: dict[subprocess.Popen, str] = {}
_exiting = threading.Event()


def stop_children_before_exit() -> None:
    """Kills every compiler child with its process group (ptxas) and removes its folder.

    For the ``fp8jax`` command, whose Ctrl-C thread calls it just before it
    ends the process with ``os._exit`` (which runs no ``finally``). The thread
    waiting for the child then waits for that exit instead of reporting the
    killed child as a failed compile. A KeyboardInterrupt in Python reaches
    the same cleanup through :func:`_run_child`'s ``except``.
    """
    _exiting.set()
    _kept.clear()
    for proc, folder in list(_children.items()):
        _stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
        _children.pop(proc, None)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        # Its own session: the child and the ptxas processes XLA starts share one group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


class _Child(NamedTuple):
    """A compiler child serving requests (``_worker.serve``) until its stdin closes."""

    proc: subprocess.Popen
    folder: str  # its requests, responses and stderr
    replies: Any  # the read end of the pipe on which it answers each request


# Children kept for the next request with the same environment (XLA_FLAGS
# among it: XLA reads its flags once per process), so that a process making
# many deviceless compiles starts Python, JAX and the topology once
# (docs/design.md#deviceless-verification). One lock: one request at a time.
_kept: dict[tuple, _Child] = {}
_kept_lock = threading.Lock()
# Each idle child holds JAX and XLA in memory (0.4 GiB after an FP8 dense step); few
# environments recur.
_KEEP_AT_MOST = 2
# Variables that change while a process runs and mean nothing to a compile; the
# child's environment (its key) leaves them out, or each change would start a child.
# pytest names its current test in PYTEST_CURRENT_TEST: a suite kept no child from
# one test to the next.
_NOT_PASSED = ("PYTEST_CURRENT_TEST",)


def _start_child(env: dict[str, str]) -> _Child:
    folder = tempfile.mkdtemp(prefix="fp8jax-verify-")
    read_fd, write_fd = os.pipe()
    # The folder on its command line says whose child it is (ps, /proc).
    cmd = [sys.executable, "-m", "fp8jax.verify._worker", "--serve", str(write_fd), folder]
    with open(os.path.join(folder, "stderr"), "w") as stderr:
        # A session of its own, so that stopping it stops the compilers it started
        # too; a terminal's Ctrl-C then reaches only this process, which stops it.
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True, pass_fds=(write_fd,),
                                start_new_session=True)  # fmt: skip
    os.close(write_fd)
    _children[proc] = folder
    return _Child(proc, folder, os.fdopen(read_fd))


def _end_child(child: _Child) -> None:
    _stop(child.proc)
    with contextlib.suppress(OSError):  # a dead child's pipe may refuse the flush
        child.proc.stdin.close()
    child.replies.close()
    _children.pop(child.proc, None)
    shutil.rmtree(child.folder, ignore_errors=True)


@atexit.register
def _end_kept_children() -> None:
    for child in list(_kept.values()):
        _end_child(child)
    _kept.clear()


def _ask(child: _Child, payload: dict[str, Any]) -> list[dict]:
    """``payload``'s results from ``child``; CompileError where the child died on it."""
    request = os.path.join(child.folder, "request.pkl")
    response = os.path.join(child.folder, "response.pkl")
    with open(request, "wb") as f:
        pickle.dump(payload, f)
    try:
        child.proc.stdin.write(f"{request}\n{response}\n")
        child.proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # it died before reading: the reply line below is empty
    reply = child.replies.readline()
    if _exiting.is_set():
        threading.Event().wait()  # the Ctrl-C thread ends the process; say nothing
    if reply.strip() != "done" or not os.path.exists(response):
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=10)
        with open(os.path.join(child.folder, "stderr")) as f:
            stderr = f.read()
        raise CompileError(_child_failure(child.proc.returncode, stderr))
    with open(response, "rb") as f:
        results = pickle.load(f)
    os.remove(request)
    os.remove(response)
    return results


# A file in which XLA keeps the kernels it compiled, for the children to load instead
# of compiling them again (docs/verify.md#how-the-deviceless-compile-works).
KERNEL_CACHE_VARIABLE = "FP8JAX_VERIFY_KERNEL_CACHE"


def _kernel_cache(xla_flags: str) -> str | None:
    """The kernel cache file to compile with, or None.

    None where the variable is unset, where the flags name a cache of their own,
    and where the compile dumps its kernels (``--xla_dump_to``,
    ``MOSAIC_GPU_DUMP_TO``): a kernel loaded from the cache is not compiled, so
    its PTX would be missing from the dump.
    """
    cache = os.environ.get(KERNEL_CACHE_VARIABLE)
    if not cache or "xla_gpu_kernel_cache_file" in xla_flags:
        return None
    if "xla_dump_to" in xla_flags or os.environ.get("MOSAIC_GPU_DUMP_TO"):
        return None
    path = os.path.abspath(cache)
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(
            f"{KERNEL_CACHE_VARIABLE}={cache!r} names a file in {os.path.dirname(path)}, "
            "which is not a folder; create it or point the variable at a file in one."
        )
    return path


@contextlib.contextmanager
def _holding(cache: str | None):
    """Holds ``cache``'s lock file: XLA reads the whole file and writes it back, and
    two processes doing so at once lose entries or read half a file."""
    if cache is None:
        yield
        return
    import fcntl

    with open(f"{cache}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_child(payload: dict[str, Any], xla_flags: str | None, names: list[str]) -> list[tuple]:
    flags = xla_flags or ""
    cache = _kernel_cache(flags)
    if cache is not None:
        # XLA caches kernels only when it compiles each in an LLVM module of its own.
        flags = (
            f"{flags} --xla_gpu_kernel_cache_file={cache}"
            " --xla_gpu_enable_llvm_module_compilation_parallelism=true"
        ).strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    for volatile in _NOT_PASSED:
        env.pop(volatile, None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # JAX cannot load a deviceless executable from its persistent cache (docs/verify.md):
    # with the caller's cache passed on, the child wrote entries no one can read.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # The child's worker must be this fp8jax, wherever the environment's path points.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_FP8JAX_ROOT, env.get("PYTHONPATH")]))
    # A 'MODULE:FUNCTION' entry imports the user's module into the child, and a
    # later request must not see a stale copy of it: such children serve once.
    keep = not any("entry" in job for job in payload["jobs"])
    key = tuple(sorted(env.items()))
    with _kept_lock:
        child = _kept.pop(key, None) if keep else None
        if child is None or child.proc.poll() is not None:
            if child is not None:
                _end_child(child)
            child = _start_child(env)
        try:
            with _holding(cache):
                results = _ask(child, payload)
        except BaseException:
            _end_child(child)
            raise
        if keep:
            _kept[key] = child
            while len(_kept) > _KEEP_AT_MOST:  # the least recently served goes
                _end_child(_kept.pop(next(iter(_kept))))
        else:
            _end_child(child)
    texts = []
    for i, (result, name) in enumerate(zip(results, names, strict=True)):
        if result.get("entry"):  # the factory or its function: one line, no traceback
            raise CompileError(result["error"])
        if "error" in result:
            where = f"call {i} ({name})" if len(results) > 1 else name
            raise CompileError(f"deviceless compile of {where} failed:\n{result['error']}")
        texts.append((result["hlo"], result.get("memory")))
    return texts


def _child_failure(returncode: int, stderr: str) -> str:
    tail = "\n".join(stderr.strip().splitlines()[-30:])
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = ""
        if name == "SIGFPE":
            hint = (
                " XLA divides by gpu_device_info fields such as core_count; a target "
                "config that lacks them crashes it like this."
            )
        return f"the deviceless compiler process died with {name}.{hint}\n{tail}"
    return f"the deviceless compiler process exited with status {returncode}:\n{tail}"
