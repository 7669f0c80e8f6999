"""Ctrl-C at every phase of ``fp8jax train``: exit 130, one line, no traceback.

Each test starts the command in a subprocess and sends SIGINT once the
process is known to be in the phase: blocked reading ``--data`` (a FIFO that
has a reader), or past a line of output that only that phase prints. The
timeouts only bound a hung process; no assertion depends on timing.
"""

import contextlib
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

FAST = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]
FAST += ["--precision", "bf16", "--log-every", "1", "--eval-every", "1000", "--steps", "100000"]
PATIENCE_S = 300


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap_processes():
    """Kills and reaps what a test started, also when it fails midway.

    A process left running, and its unclosed pipe, would surface as warnings
    in whichever later test the garbage collector happens to run in.
    """
    yield
    while _STARTED:
        proc = _STARTED.pop()
        proc.kill()
        proc.wait()
        proc.stdout.close()


def start(*argv: str) -> subprocess.Popen:
    """``fp8jax train ARGV`` through the console script's module."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8jax_command", "train", *FAST, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _STARTED.append(proc)
    return proc


def read_until(proc: subprocess.Popen, marker: str) -> list[str]:
    """The lines the process prints, up to and including the first that contains ``marker``."""
    lines = []
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"exited ({proc.wait()}) before {marker!r}:\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return lines
    pytest.fail(f"no {marker!r} in {PATIENCE_S} s:\n" + "".join(lines))


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        rest = proc.communicate(timeout=PATIENCE_S)[0]
    finally:
        proc.kill()
    return proc.returncode, rest


def open_writer_once_read(fifo, proc: subprocess.Popen) -> int:
    """Opens the FIFO for writing once the process has opened it for reading."""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: no reader yet
            if e.errno != errno.ENXIO:
                raise
        time.sleep(0.05)
    pytest.fail("the process never opened --data")


def pipes(pid: int) -> int:
    """How many pipes the process has open besides its stdin, stdout and stderr.

    The process opens and closes files as it runs: a descriptor listed may be
    gone when it is read (and the process itself, which the caller checks).
    """
    count = 0
    with contextlib.suppress(FileNotFoundError):
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(FileNotFoundError):
                count += int(fd.name) > 2 and os.readlink(fd).startswith("pipe:")
    return count


@pytest.mark.skipif(not pathlib.Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
def test_ctrl_c_while_jax_is_imported_exits_130_in_one_line(tmp_path):
    """The console script takes Ctrl-C before it imports fp8jax (and so JAX).

    Its Ctrl-C pipe (signal.set_wakeup_fd) marks that moment. Before, a Ctrl-C
    during JAX's import printed a traceback, aborted, or was swallowed by a
    garbage-collection callback and the run went on.
    """
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "text.txt")  # never written: the run cannot get past loading data
    proc = start("--data", str(data), "--out", str(tmp_path / "run"))
    deadline = time.monotonic() + PATIENCE_S
    while not pipes(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    status, output = finish(proc)
    assert status == 130, output
    assert output in (
        "fp8jax: interrupted.\n",  # before the arguments were parsed
        "fp8jax train: interrupted before the first step; no checkpoint was saved.\n",
    ), output


# A Ctrl-C sent the moment the Ctrl-C pipe exists, before the handler is set:
# the race the test above lost on CI once (a KeyboardInterrupt traceback, -2).
_CTRL_C_DURING_INSTALL = """
import os, signal, time
import fp8jax_command
interrupts = fp8jax_command._load_interrupts()
set_blocking = os.set_blocking
def ctrl_c_then_set_blocking(fd, flag):
    os.kill(os.getpid(), signal.SIGINT)
    set_blocking(fd, flag)
os.set_blocking = ctrl_c_then_set_blocking
interrupts.install("", "interrupted.")
time.sleep(60)  # the watcher thread ends the process before this returns
"""


def test_ctrl_c_while_the_handler_is_installed_exits_130_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_DURING_INSTALL], capture_output=True, text=True,
        timeout=PATIENCE_S,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout + proc.stderr) == (130, "fp8jax: interrupted.\n")


def test_ctrl_c_while_reading_data_exits_at_once_and_writes_nothing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    fifo = data / "text.txt"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    proc = start("--data", str(data), "--out", str(out))
    writer = open_writer_once_read(fifo, proc)
    try:
        # The process now blocks in read(), inside C, where Python runs no signal handler.
        proc.send_signal(signal.SIGINT)
        status, output = finish(proc)
    finally:
        os.close(writer)
    assert status == 130, output
    assert output.splitlines() == [
        "fp8jax train: interrupted before the first step; no checkpoint was saved."
    ]
    assert not out.exists()


def test_ctrl_c_while_the_first_step_compiles_stops_after_it_and_saves(tmp_path):
    out = tmp_path / "run"
    proc = start("--out", str(out))
    # The header is printed once the model exists, just before the first step compiles.
    read_until(proc, "train step:")
    proc.send_signal(signal.SIGINT)
    status, output = finish(proc)
    assert status == 130, output
    assert "Ctrl-C: stopping after this step" in output and "Traceback" not in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] >= 1
    assert (out / "checkpoints" / str(summary["step"])).is_dir()


def test_a_second_ctrl_c_aborts_at_once_and_keeps_complete_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc = start("--out", str(out), "--checkpoint-every", "1")
    read_until(proc, "train step:")
    proc.send_signal(signal.SIGINT)
    read_until(proc, "Ctrl-C: stopping after this step")
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    status, output = finish(proc)
    assert status == 130, output
    assert "Traceback" not in output and "Segmentation" not in output
    # Either the second Ctrl-C came while the step still ran (usually: the first step
    # compiles for seconds), or the loop had already stopped and saved.
    aborted = "fp8jax train: aborted by a second Ctrl-C" in output
    assert aborted or json.loads((out / "summary.json").read_text())["status"] == "interrupted"
    if aborted:
        last = output.rstrip().splitlines()[-1]
        checkpoints = sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*"))
        if checkpoints:
            kept = f"checkpoint {checkpoints[-1]} in {out / 'checkpoints'} is kept."
        else:
            kept = "no checkpoint was saved."
        assert last.endswith(kept), output
        assert not (out / "summary.json").exists()
