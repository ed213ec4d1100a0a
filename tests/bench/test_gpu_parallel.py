"""The tensor-parallel row of `ebpo bench gpu` (ebpo/bench/gpu_parallel.py), run on 2 CPU ranks with gloo."""
import json

import pytest

from ebpo.bench import gpu
from tests.bench.test_gpu import TINY


def test_tensor_parallel_row_on_two_cpu_ranks(tmp_path):
    """--tp-cpu runs the row's code on 2 gloo ranks: both workers decode the same prompts and seeds, the tokens
    agree exactly (fp32 on CPU) and the rates are the tokens the samples hold over positive seconds."""
    out = tmp_path / "gpu.json"
    assert gpu.main([*TINY, "--batches", "2", "--tp-cpu", "--skip", "gpu_tests,decode,fp8,likelihood",
                     "--json", str(out)]) == 0
    tp = json.loads(out.read_text())["tensor_parallel"]
    assert tp["status"] == "ran" and tp["ranks"] == 2 and tp["batch"] == 2 and tp["device"] == "cpu"
    assert tp["identical_tokens"] is True
    assert tp["one_rank_tokens_per_s"] > 0 and tp["two_rank_tokens_per_s"] > 0
    assert tp["speedup"] == pytest.approx(tp["two_rank_tokens_per_s"] / tp["one_rank_tokens_per_s"])
    # skipped on request, like the other sections
    assert gpu.main([*TINY, "--skip", "gpu_tests,decode,fp8,likelihood,tensor_parallel", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tensor_parallel"] == {"skipped": "--skip"}
