"""The compiling side: the deviceless child process, and live compiles in-process.

Run as ``python -m fp8jax.verify._worker REQUEST RESPONSE`` with
``JAX_PLATFORMS=cpu``; ``compilation._run_child`` does that. It reads a pickled
request, builds the GPU topology, compiles each job, and pickles back one
``{"hlo": text}`` or ``{"error": message}`` per job.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import sys
import traceback
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

from fp8jax.verify import _arguments


def load_entry(spec: str):
    """Imports ``"MODULE:FUNCTION"`` and returns the function."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'MODULE:FUNCTION', got {spec!r}.")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}.") from None


def call_entry(spec: str, mesh) -> tuple[Any, tuple[Any, ...]]:
    """Calls the factory named by ``spec`` with ``mesh``; checks it returns (fn, args)."""
    result = load_entry(spec)(mesh)
    if not (isinstance(result, tuple | list) and len(result) == 2 and callable(result[0])):
        raise TypeError(
            f"{spec} must return (fn, args) with fn callable and args a tuple; "
            f"got {type(result).__name__}."
        )
    fn, args = result
    return fn, tuple(args) if isinstance(args, list | tuple) else (args,)


def compile_here(fn, args, in_shardings, out_shardings, axes, mesh, device, options=None) -> str:
    """Traces, lowers and compiles ``fn(*args)`` for ``mesh`` (or ``device``)."""
    flat_fn, arrays, specs = _arguments.flatten_call(fn, args, in_shardings, axes)
    sds = _abstract(arrays, specs, mesh, device)
    outs = _arguments.out_specs(flat_fn, sds, out_shardings) if mesh is not None else None
    return _compile_flat(flat_fn, sds, specs, outs, mesh, device, options)


def _abstract(arrays, specs, mesh, device) -> list[jax.ShapeDtypeStruct]:
    return _arguments.abstract_args(arrays, specs, lambda spec: _sharding(spec, mesh, device))


def _sharding(spec, mesh, device):
    """``spec`` on the target mesh; without a mesh, the target's first device."""
    return NamedSharding(mesh, spec) if mesh is not None else SingleDeviceSharding(device)


def _compile_flat(fn, sds, specs, out_specs, mesh, device, options) -> str:
    """Compiles a function of flat array leaves, whose shardings ``sds`` carry."""
    jit_kw: dict[str, Any] = {"in_shardings": tuple(_sharding(s, mesh, device) for s in specs)}
    if mesh is not None and out_specs is not None:
        jit_kw["out_shardings"] = tuple(
            None if s is None else NamedSharding(mesh, s) for s in out_specs
        )
    # Traced under the mesh, as fp8jax.sharding.use_mesh traces a train step:
    # fp8jax's ops read it to keep whole-array kernels out of sharded programs.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        lowered = jax.jit(fn, **jit_kw).trace(*sds).lower()
    return lowered.compile(options or None).as_text()


def compile_live(call, axes, devices: int, xla_flags: str | None) -> str:
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


def _run_job(job: dict[str, Any], topology, axes, mesh) -> str:
    device = topology.devices[0]
    if "entry" in job:
        fn, args = call_entry(job["entry"], mesh)
        return compile_here(fn, args, None, None, axes, mesh, device)
    exported = pickle.loads(job["exported"])
    sds = _abstract(exported.in_avals, job["in_specs"], mesh, device)
    return _compile_flat(exported.call, sds, job["in_specs"], job["out_specs"], mesh, device, None)


def main(request_path: str, response_path: str) -> int:
    with open(request_path, "rb") as f:
        request = pickle.load(f)
    # The caller's import path, so 'MODULE:FUNCTION' resolves here as it did there.
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology=request["topology"], target_config=request["target_config"]
    )
    axes = request["mesh"]
    mesh = axes.build(topology.devices) if axes else None
    results = []
    for job in request["jobs"]:
        try:
            results.append({"hlo": _run_job(job, topology, axes, mesh)})
        except Exception as e:
            lines = traceback.format_exception(e)
            results.append({"error": "".join(lines[-12:]).rstrip()})
    with open(response_path, "wb") as f:
        pickle.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
