"""``fp8jax verify MODULE:FUNCTION``: exit status, table and JSON output."""

import argparse
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from fp8jax import cli as fp8jax_cli
from fp8jax.verify import cli


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="fp8jax")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return cli.run(parser.parse_args(["verify", *argv]))


@pytest.mark.deviceless
def test_fp8_program_on_eight_gpus_passes_with_json(capsys):
    status = _run("verify_programs:fp8_entry", "--mesh", "fsdp=8", "--json")
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    assert result["ok"] and result["problems"] == []
    assert (result["devices"], result["mesh"]) == (8, "fsdp=8")
    report = result["report"]
    assert (report["fp8_gemms"], report["non_fp8_gemms"]) == (3, 0)
    gathered = {c["dtype"] for c in report["collectives"] if c["kind"] == "all-gather"}
    # The kernel is gathered in E4M3 and, for the dgrad, the gradient in E5M2.
    assert gathered == {"f8e4m3fn", "f8e5m2"}


@pytest.mark.deviceless
def test_bf16_program_fails_naming_the_line(capsys):
    flags = "--xla-flags=--xla_gpu_enable_triton_gemm=false"  # '=': the value starts with '-'
    status = _run("verify_programs:bf16_entry", "--target", "h200", flags)
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL:" in out and "cublaslt GEMM bf16" in out
    assert "verify_programs.py:" in out


@pytest.mark.deviceless
def test_allow_and_at_least_let_a_bf16_program_pass(capsys):
    status = _run("verify_programs:bf16_entry", "--allow", "bf16_matmul", "--at-least", "0")
    assert status == 0
    assert "OK: 0 FP8 GEMMs, 1 high-precision GEMMs allowed." in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "fsdp=4", "--devices", "8"], "--mesh fsdp=4 has 4 devices but --devices is 8"),
        (["--target", "a100"], "target must be one of"),
        (["--devices", "6", "--hosts", "4", "--mesh", "fsdp=6"], "not divisible by hosts=4"),
        (["--mesh", "fsdp"], "mesh string must look like"),
    ],
)
def test_argument_errors_exit_2(capsys, argv, message):
    assert _run("verify_programs:fp8_entry", *argv) == 2
    assert message in capsys.readouterr().err


def test_a_target_file_that_is_not_text_is_refused_naming_it(tmp_path, capsys):
    # The codec's error came out alone, naming neither --target nor the file.
    target = tmp_path / "gpu.txtpb"
    target.write_bytes(b"\xd6\x00\xff binary")
    assert _run("verify_programs:fp8_entry", "--target", str(target)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fp8jax verify: error: target config {target} cannot be read "), err
    assert "can't decode byte 0xd6" in err


def test_errors_are_json_too_with_json(capsys):
    assert _run("verify_programs:fp8_entry", "--target", "a100", "--json") == 2
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_wired_into_the_fp8jax_command(capsys):
    assert fp8jax_cli.main(["verify", "verify_programs:fp8_entry", "--target", "a100"]) == 2
    assert "target must be one of" in capsys.readouterr().err


@pytest.mark.deviceless
@pytest.mark.parametrize(("expect", "status", "verdict"), [
    ("3", 0, "OK: 3 FP8 GEMMs, no other GEMMs."),
    ("4", 1, "FAIL:\nexpected exactly 4 FP8 GEMMs, found 3."),
])  # fmt: skip
def test_expect_checks_the_exact_count_in_plain_text(capsys, expect, status, verdict):
    assert _run("verify_programs:fp8_entry", "--expect", expect) == status
    out = capsys.readouterr().out
    assert out.startswith("verify_programs:fp8_entry on 1 x H100\nGEMMs: 3 (3 FP8, 0 not FP8)\n")
    assert out.rstrip().endswith(verdict)


@pytest.mark.deviceless
@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("bad_factories:nowhere", r"bad_factories:nowhere: module 'bad_factories' \(.*"
         r"bad_factories\.py\) has no attribute 'nowhere'\."),
        ("bad_factories:NOT_CALLABLE", r"bad_factories:NOT_CALLABLE must be a function "
         r"mesh -> \(fn, args\), got a int \(3\)\."),
        ("bad_factories:no_mesh_argument", r"must take one argument, the Mesh \(None without "
         r"--mesh\); its signature is no_mesh_argument\(\)"),
        ("bad_factories:only_the_function", r"must return \(fn, args\).*got only a function"),
        ("bad_factories:three_things", r"got a tuple of 3: \(function, tuple, NoneType\)\."),
        ("bad_factories:raises", r"bad_factories:raises\(mesh\) raised RuntimeError: the model "
         r"config is missing \(.*bad_factories\.py:\d+\)"),
    ],
)  # fmt: skip
def test_a_bad_factory_is_refused_in_one_line_naming_it(capsys, entry, message):
    assert _run(entry) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fp8jax verify: error: {entry}") and re.search(message, err), err


@pytest.mark.deviceless
def test_a_function_that_does_not_trace_is_refused_in_one_line_naming_the_line(capsys):
    # The worker's traceback came back under "deviceless compile of  failed:".
    assert _run("bad_factories:shapes_that_do_not_fit") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        "fp8jax verify: error: bad_factories:shapes_that_do_not_fit: tracing fn(*args) raised "
        "TypeError: dot_general requires contracting dimensions to have the same shape"
    ), err
    assert re.search(r"\(.*bad_factories\.py:\d+\)\n$", err), err


def _processes_running(needle: str) -> list[int]:
    """The pids of live (not zombie) processes whose command line contains ``needle``."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (proc / "cmdline").read_bytes().decode(errors="replace"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(proc.name))
    return pids


@pytest.mark.deviceless
@pytest.mark.skipif(not pathlib.Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
def test_ctrl_c_stops_the_compiler_child_and_removes_its_folder(tmp_path):
    # Issue 56, item 10: the child went on compiling and /tmp/fp8jax-verify-* stayed.
    env = os.environ | {"TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), *sys.path])
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8jax_command", "verify", "bad_factories:sleeps"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # bounds a hung start; nothing depends on timing
        while not (children := _processes_running(str(tmp_path))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert (proc.returncode, output) == (130, "fp8jax verify: interrupted; nothing was checked.\n")
    assert list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 60
    while any(pid in _processes_running(str(tmp_path)) for pid in children):
        assert time.monotonic() < deadline, f"compiler child {children} still running"
        time.sleep(0.1)
