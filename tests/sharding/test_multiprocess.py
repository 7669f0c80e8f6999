"""Two processes x 4 CPU devices (jax.distributed, Gloo) run the sharded step like one process.

Each process is a fresh interpreter started here with its own 4 host
devices; they meet at a coordinator on 127.0.0.1. Both must finish within
TIMEOUT seconds; otherwise, or if one fails, both are killed and the test
fails with their output.
"""

import os
import pathlib
import pickle
import socket
import subprocess
import sys
import time

import sharded_layer as sl

import cpu_compile

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
PROCESSES = 2
TIMEOUT = 180  # seconds for both; a run takes ~15 s on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out: pathlib.Path) -> list[str]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        # The CPU compile flags of this process (tests/cpu_compile.py): each worker
        # compiles its sharded step faster, and the codegen is the reference's.
        XLA_FLAGS=cpu_compile.with_devices(4),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(PROCESSES), coordinator, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    outputs = []
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        outputs.append(f"timed out after {TIMEOUT} s")
    finally:
        for proc in procs:  # only the processes this test started
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    failed = [p.args[2] for p in procs if p.returncode != 0]
    assert not failed, f"processes {failed} failed:\n" + "\n---\n".join(o[-3000:] for o in outputs)
    return outputs


def test_two_processes_match_the_single_device_run(tmp_path, reference):
    _run_workers(tmp_path)
    for i in range(PROCESSES):
        with open(tmp_path / f"result-{i}.pkl", "rb") as f:
            result = pickle.load(f)
        sl.check_against_reference(result["state"], result["losses"], reference)
