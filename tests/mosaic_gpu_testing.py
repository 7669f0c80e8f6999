"""What the Mosaic GPU kernels' tests share: one interpreter compile per kernel body, and
deviceless H200 compiles that keep the compiler's dumps of each program's kernels."""

import contextlib
import inspect
import threading

import jax
import pytest


@contextlib.contextmanager
def one_compile_per_thread_body():
    """Mosaic GPU's interpreter compiles each warpgroup's body once, not once per thread and CTA.

    It runs a CTA's warpgroups as threads, each of which traces, lowers and
    compiles the same body (one jaxpr; the thread id and the CTA's grid
    coordinates are arguments) before running it: the attention kernel's
    4-CTA grid made 12 identical CPU compiles of about 3 s each, most of its
    tests' time. Here the first thread compiles it and every thread of every
    CTA runs that executable, with the same arguments as before, so what is
    interpreted is unchanged. Where JAX's private ``_run_jaxpr`` is not the
    one this replaces (another JAX), the interpreter is left as it is.
    """
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic.interpret import thread_map

    run = getattr(thread_map, "_run_jaxpr", None)
    if run is None or list(inspect.signature(run).parameters) != ["jaxpr", "consts", "args"]:
        yield
        return
    executables, lock = {}, threading.Lock()

    def body(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_compiled_once(jaxpr, consts, *args):
        key = (id(jaxpr), tuple(jax.typeof(x) for x in (*consts, *args)))
        with lock:  # the CTA's other threads wait for the one compile
            if key not in executables:  # the jaxpr is kept, so its id stays its own
                traced = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args)
                executables[key] = (jaxpr, traced.lower().compile())
        executables[key][1](consts, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thread_map, "_run_jaxpr", run_compiled_once)
        yield


def h200_compiles_with_dumps(tmp_path_factory, dumps: dict[str, str]):
    """``compile(fn, *args, child=name)``: its H200 HLO and a folder of its kernels' dumps.

    ``dumps``: the Mosaic GPU variables that ask for them, e.g.
    ``{"MOSAIC_GPU_DUMP_PTX": "1"}``. The compiling child inherits the
    environment, in which Mosaic GPU's compiler writes each kernel's files to
    ``MOSAIC_GPU_DUMP_TO``. The environment is the kept child's key
    (fp8jax.verify.compilation): a dump folder per ``child`` lets one child
    serve the compiles that name it (a folder per test started a child each,
    about 4 s). The files are moved to the program's own folder after each
    compile, so a test reads only its program's kernels. A child compiles a
    kernel once and dumps it then only, so the programs that name one child
    must not share a kernel.
    """
    from fp8jax import verify

    dumped = {}

    def compile_with_dumps(fn, *args, child):
        if child not in dumped:
            dumped[child] = tmp_path_factory.mktemp(f"mosaic-gpu-dump-{child}")
        folder = tmp_path_factory.mktemp("program")
        try:
            with pytest.MonkeyPatch.context() as patch:
                for name, value in dumps.items():
                    patch.setenv(name, value)
                patch.setenv("MOSAIC_GPU_DUMP_TO", str(dumped[child]))
                hlo = verify.compile_for(fn, *args, target="h200")
        finally:  # also a failed compile's, which are no later program's
            for path in dumped[child].iterdir():
                path.rename(folder / path.name)
        return hlo, folder

    return compile_with_dumps
