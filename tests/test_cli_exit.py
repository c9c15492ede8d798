"""How the `ptq` command ends (`ptq.cli.entry` / `leave`): everything `sys.exit` does first still happens (threads
joined, exit handlers run, buffered output flushed, the command's status), but not the interpreter's teardown of
every module and object, which cost a one-image `ptq report` a quarter of its CPU (`bench/startup.py`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a command, with a late non-daemon thread, an exit handler and an object that reports its destruction at the
# interpreter's teardown; END is how the script ends (the `ptq` script's way, or sys.exit)
SCRIPT = """
import atexit, os, sys, threading, time

class Teardown:
    def __del__(self, write=os.write):  # sys.stdout is gone by then: straight to the file descriptor
        write(1, b"teardown ran\\n")

kept = Teardown()  # a module global: destroyed only by the interpreter's teardown
atexit.register(print, "exit handler ran")
sys.argv = ["ptq"] + sys.argv[1:]
from ptq import cli

returned, command = threading.Event(), cli.main

def main():
    try:
        return command()
    finally:
        returned.set()

cli.main = main  # a thread still running when the command returns
threading.Thread(target=lambda: (returned.wait(), time.sleep(0.3), print("thread finished"))).start()
from concurrent.futures import ThreadPoolExecutor
idle = ThreadPoolExecutor(1)  # never shut down: its worker waits until the exit hooks wake it
idle.submit(print, "pool task ran").result()
{end}
"""


def run(end: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(end=end), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_entry_skips_teardown_but_keeps_what_exit_does():
    done = run("cli.entry()", "ops", "--domain", "ai.onnx")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # the command's whole output, flushed from the pipe's buffer, then the thread's line and the exit handler's
    assert "Conv" in done.stdout and "MatMul" in done.stdout
    assert lines[-2:] == ["thread finished", "exit handler ran"]
    assert "teardown ran" not in done.stdout
    # the same command ended by sys.exit prints the same, and the teardown's line after it
    usual = run("sys.exit(cli.main())", "ops", "--domain", "ai.onnx")
    assert usual.returncode == 0 and usual.stdout.splitlines()[:-1] == lines
    assert usual.stdout.splitlines()[-1] == "teardown ran"


def test_entry_keeps_the_error_status_and_message(tmp_path):
    done = run("cli.entry()", "report", str(tmp_path / "missing.onnx"), "--quant", str(tmp_path / "q.json"),
               "--images", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.startswith("ptq report: error: ") and done.stderr.count("\n") == 1
