"""Run the Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1) against the torch paths.

This checks kernel logic (indexing, masking, online reductions, rounding) without a GPU; performance and
hardware code generation are only covered by the GPU tests."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("_triton_checks.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "TRITON_INTERPRET_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
