"""The compiling side: the deviceless child process, and live compiles in-process.

Run as ``python -m fp8jax.verify._worker --serve FD FOLDER`` with
``JAX_PLATFORMS=cpu`` (``compilation._run_child`` does that; FOLDER, where
its requests lie, only names it). For each request it reads a pickled
payload, builds the GPU topology, compiles each job, and pickles back one
``{"hlo": text, "memory": sizes}`` or ``{"error": message}`` per job.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import pickle
import sys
import traceback
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

from fp8jax.verify import _arguments

# fp8jax's own folder, two up from this file.
_FP8JAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class EntryError(ValueError):
    """The ``MODULE:FUNCTION`` factory could not give ``(fn, args)``; the message is one line."""


class TraceError(ValueError):
    """Tracing the factory's ``fn(*args)`` failed: an error in the user's function."""


def load_entry(spec: str):
    """Imports ``"MODULE:FUNCTION"`` and returns the function."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EntryError(f"expected 'MODULE:FUNCTION', got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise EntryError(
            f"{spec}: importing module {module_name!r} raised {_one_line(e)}"
        ) from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise EntryError(
            f"{spec}: module {module_name!r} ({_where(module)}) has no attribute {attr!r}."
        ) from None
    if not callable(factory):
        raise EntryError(
            f"{spec} must be a function mesh -> (fn, args), got a {type(factory).__name__} "
            f"({_short(factory)})."
        )
    return factory


def call_entry(spec: str, mesh) -> tuple[Any, tuple[Any, ...]]:
    """Calls the factory named by ``spec`` with ``mesh``; checks it returns (fn, args)."""
    factory = load_entry(spec)
    try:
        inspect.signature(factory).bind(mesh)
    except TypeError as e:
        raise EntryError(
            f"{spec} must take one argument, the Mesh (None without --mesh); its signature "
            f"is {spec.partition(':')[2]}{_signature(factory)}: {e}."
        ) from None
    except ValueError:  # a builtin without a signature: let the call say
        pass
    try:
        result = factory(mesh)
    except Exception as e:
        raise EntryError(f"{spec}(mesh) raised {_one_line(e)}") from None
    if not (isinstance(result, tuple | list) and len(result) == 2 and callable(result[0])):
        what = f"a {type(result).__name__}"
        if callable(result):
            what = "only a function; return it with its arguments, (fn, args)"
        elif isinstance(result, tuple | list):
            what = f"a {type(result).__name__} of {len(result)}: ({_types(result)})"
        raise EntryError(
            f"{spec} must return (fn, args) with fn callable and args a tuple; got {what}."
        )
    fn, args = result
    return fn, tuple(args) if isinstance(args, list | tuple) else (args,)


def _one_line(e: BaseException) -> str:
    """``Type: message (file:line)``: the exception and the innermost frame of the user's code.

    That is the innermost frame outside JAX and fp8jax, or the innermost where
    every frame is theirs.
    """
    frames = traceback.extract_tb(e.__traceback__)
    library = (os.path.dirname(jax.__file__) + os.sep, _FP8JAX_DIR)
    users = [f for f in frames if not f.filename.startswith(library)] or frames
    where = f" ({users[-1].filename}:{users[-1].lineno})" if users else ""
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"


def _where(module) -> str:
    return getattr(module, "__file__", None) or "no file"


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _types(values) -> str:
    return ", ".join(type(v).__name__ for v in values)


def compile_here(fn, args, in_shardings, out_shardings, axes, mesh, device, options=None):
    """Traces, lowers and compiles ``fn(*args)`` for ``mesh`` (or ``device``): (HLO text,
    :func:`memory_bytes`)."""
    flat_fn, arrays, specs = _arguments.flatten_call(fn, args, in_shardings, axes)
    sds = _abstract(arrays, specs, mesh, device)
    outs = _arguments.out_specs(flat_fn, sds, out_shardings) if mesh is not None else None
    return _compile_flat(flat_fn, sds, specs, outs, mesh, device, options)


def _abstract(arrays, specs, mesh, device) -> list[jax.ShapeDtypeStruct]:
    return _arguments.abstract_args(arrays, specs, lambda spec: _sharding(spec, mesh, device))


def _sharding(spec, mesh, device):
    """``spec`` on the target mesh; without a mesh, the target's first device."""
    return NamedSharding(mesh, spec) if mesh is not None else SingleDeviceSharding(device)


def _compile_flat(fn, sds, specs, out_specs, mesh, device, options, donate=()):
    """Compiles a function of flat array leaves, whose shardings ``sds`` carry; the leaves
    ``donate`` are donated."""
    jit_kw: dict[str, Any] = {"in_shardings": tuple(_sharding(s, mesh, device) for s in specs)}
    if donate:
        jit_kw["donate_argnums"] = tuple(donate)
    if mesh is not None and out_specs is not None:
        jit_kw["out_shardings"] = tuple(
            None if s is None else NamedSharding(mesh, s) for s in out_specs
        )
    # Traced under the mesh, as fp8jax.sharding.use_mesh traces a train step:
    # fp8jax's ops read it to keep whole-array kernels out of sharded programs.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        try:
            lowered = jax.jit(fn, **jit_kw).trace(*sds).lower()
        except Exception as e:  # the user's function, not the compiler: one line says it
            raise TraceError(f"tracing fn(*args) raised {_one_line(e)}") from None
    compiled = lowered.compile(options or None)
    return compiled.as_text(), memory_bytes(compiled)


def memory_bytes(compiled) -> dict[str, int] | None:
    """The compiled program's buffer sizes per device (``memory_analysis()``), or None."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    names = ("argument", "output", "temp", "alias")
    return {name: int(getattr(memory, f"{name}_size_in_bytes", 0)) for name in names}


def compile_live(call, axes, devices: int, xla_flags: str | None):
    """Compiles one call on this process's GPUs."""
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda"):
        raise RuntimeError(
            f"target='live' compiles on this process's GPU, but jax.default_backend() is "
            f"{backend!r}. Use target='h100' or 'h200' for a deviceless compile."
        )
    available = jax.devices()
    if len(available) < devices:
        raise ValueError(f"devices={devices}, but this process sees {len(available)} GPUs.")
    mesh = axes.build(available) if axes else None
    fn, args = call.fn, call.args
    if isinstance(fn, str):
        fn, args = call_entry(fn, mesh)
    options = _compiler_options(xla_flags)
    return compile_here(
        fn, args, call.in_shardings, call.out_shardings, axes, mesh, available[0], options
    )


def _compiler_options(xla_flags: str | None) -> dict[str, object]:
    """``"--a=false --b=3 --c"`` as ``{"a": False, "b": 3, "c": True}``.

    Per-compile options must be typed: XLA rejects the string ``"false"`` for a
    boolean option (seen on the H200 with jax 0.11.2).
    """
    options: dict[str, object] = {}
    for flag in (xla_flags or "").split():
        name, _, value = flag.lstrip("-").partition("=")
        lowered = value.lower()
        if value == "" or lowered == "true":
            options[name] = True
        elif lowered == "false":
            options[name] = False
        elif value.lstrip("-").isdigit():
            options[name] = int(value)
        else:
            options[name] = value
    return options


def _run_job(job: dict[str, Any], topology, axes, mesh):
    device = topology.devices[0]
    if "entry" in job:
        fn, args = call_entry(job["entry"], mesh)
        return compile_here(fn, args, None, None, axes, mesh, device)
    exported = pickle.loads(job["exported"])
    sds = _abstract(exported.in_avals, job["in_specs"], mesh, device)
    return _compile_flat(exported.call, sds, job["in_specs"], job["out_specs"], mesh, device,
                         None, job.get("donate", ()))  # fmt: skip


@functools.cache
def _topology(topology: str, target_config: str | None):
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", topology=topology, target_config=target_config
    )


def main(request_path: str, response_path: str) -> int:
    with open(request_path, "rb") as f:
        request = pickle.load(f)
    # The caller's import path, so 'MODULE:FUNCTION' resolves here as it did there.
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    topology = _topology(request["topology"], request["target_config"])
    axes = request["mesh"]
    mesh = axes.build(topology.devices) if axes else None
    results = []
    for job in request["jobs"]:
        try:
            hlo, memory = _run_job(job, topology, axes, mesh)
            results.append({"hlo": hlo, "memory": memory})
        except EntryError as e:  # the user's factory: one line says it all
            results.append({"error": str(e), "entry": True})
        except TraceError as e:
            name = job.get("entry", "the function")
            results.append({"error": f"{name}: {e}", "entry": True})
        except Exception as e:
            lines = traceback.format_exception(e)
            results.append({"error": "".join(lines[-12:]).rstrip()})
    with open(response_path, "wb") as f:
        pickle.dump(results, f)
    return 0


def serve(reply_fd: int) -> int:
    """Answers requests until stdin closes: two lines (request, response paths) each,
    then ``done`` on ``reply_fd`` (stdout is left to whatever the compiled code prints)."""
    with os.fdopen(reply_fd, "w") as replies:
        while True:
            request, response = sys.stdin.readline().strip(), sys.stdin.readline().strip()
            if not request:
                return 0
            main(request, response)
            jax.clear_caches()  # each request's programs are compiled once
            replies.write("done\n")
            replies.flush()


if __name__ == "__main__":
    if sys.argv[1] != "--serve":
        sys.exit(f"usage: python -m fp8jax.verify._worker --serve FD FOLDER, got {sys.argv[1:]}")
    sys.exit(serve(int(sys.argv[2])))
