"""`ebpo bench gpu`, the GPU acceptance run: its arithmetic (bandwidth table, bytes a decode forward reads)
against independent counts, its JSON with every section on CPU at tiny sizes, the GPU-test report, a
failing section, and the `--dtype` of `ebpo bench decode`."""
import json

import pytest
import torch

from ebpo.bench import gpu
from ebpo.infra.memory_plan import FP8_BYTES, count_parameters
from ebpo.model.presets import load_preset

GPU_TESTS = "tests/kernels/test_kernels_gpu.py"
TINY = ["--device", "cpu", "--model", "preset:tiny", "--batches", "1", "--new-tokens", "8", "--prompt-len", "4",
        "--preset", "m2t", "--learner-rows", "1x16", "--repeats", "1", "--bandwidth-gbs", "20"]


@pytest.mark.parametrize("name,gbs", [("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000),
                                      ("NVIDIA H100 NVL", 3900), ("NVIDIA H200", 4800), ("NVIDIA GH200 480GB", 4000),
                                      ("NVIDIA A100-SXM4-80GB", 2039), ("NVIDIA A100-SXM4-40GB", 1555),
                                      ("NVIDIA A100 80GB PCIe", 1935), ("NVIDIA A10", 600), ("NVIDIA L40S", 864),
                                      ("NVIDIA L4", 300)])
def test_bandwidth_by_device_name(name, gbs):
    assert gpu.hbm_bandwidth(name) == (gbs, pytest.approx(gpu.hbm_bandwidth(name)[1]))
    assert gpu.hbm_bandwidth(name)[0] == gbs
    assert gpu.hbm_bandwidth(name, 1234.0) == (1234.0, "--bandwidth-gbs")


def test_unknown_device_has_no_bandwidth_and_says_what_to_pass():
    gbs, why = gpu.hbm_bandwidth("CPU (x86_64)")
    assert gbs is None and "--bandwidth-gbs" in why


def test_weight_bytes_of_a_decode_forward():
    tiny = load_preset("tiny")  # block 8 x top-2 = 16 >= 8 experts: a forward can reach every expert
    embedding = tiny.vocab_size * tiny.hidden_size
    assert gpu.weight_bytes_per_forward(tiny, 1, 8, 4) == (count_parameters(tiny)["total"] - embedding) * 4
    lin = count_parameters(tiny)["linear"]
    assert gpu.weight_bytes_per_forward(tiny, 1, 8, 2, fp8=True) == pytest.approx(
        lin * FP8_BYTES + (count_parameters(tiny)["total"] - lin - embedding) * 2)
    # block routing: one block reaches C = 48 of 256 experts per layer, three blocks 144
    c = load_preset("llada22_mini")
    routed = (c.num_hidden_layers - c.first_k_dense_replace) * c.num_experts * 3 * c.hidden_size \
        * c.moe_intermediate_size
    rest = count_parameters(c)["total"] - routed - c.vocab_size * c.hidden_size
    for blocks, experts in ((1, 48), (3, 144), (9, 256)):
        assert gpu.weight_bytes_per_forward(c, blocks, 32, 2) == pytest.approx(
            (rest + routed * experts / c.num_experts) * 2)
    # the KV cache a forward reads: keys and values of every layer's KV heads, per cached token
    assert gpu.kv_bytes_per_forward(c, 4, 100, 2) == 4 * 100 * 2 * c.num_hidden_layers * c.num_key_value_heads \
        * c.head_dim * 2


def test_cpu_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main([*TINY, "--no-compiled", "--tests", GPU_TESTS, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(gpu.SECTIONS) <= set(r) and r["failed_sections"] == []
    assert r["model"] == {"preset": "tiny", "dtype": "float32", "parameters": count_parameters(load_preset("tiny"))
                          ["total"]}
    t = r["gpu_tests"]  # collected and skipped without a GPU (tests/conftest.py)
    assert t["status"] == "ok" and t["tests"] == t["skipped"] >= 1 and t["failed"] == 0
    eager = [x for x in r["decode"] if x["mode"] == "eager"]
    assert [x["batch"] for x in eager] == [1]
    for x in eager:
        assert x["tokens"] == 8 * x["batch"] and x["forwards"] >= 1
        assert x["ms_per_forward"] == pytest.approx(1e3 * x["wall_s"] / x["forwards"])
        assert x["hbm_floor_ms"] == pytest.approx(1e3 * (x["weight_bytes_per_forward"] + x["kv_bytes_per_forward"])
                                                  / 20e9)
    assert [(x["mode"], x["skipped"]) for x in r["decode"] if x not in eager] == [("compiled", "--no-compiled")]
    shapes = [s for s, _, _ in gpu.gemm_shapes(load_preset("tiny"))]
    assert [(g["M"], g["shape"]) for g in r["fp8"]["gemm"]] == [(8, s) for s in shapes]  # batch 1 x block 8
    for g in r["fp8"]["gemm"]:  # FP8 with 128 x 128 weight blocks: a few percent from the fp32 product
        assert g["rel_err_fp8"] < 0.1 and g["fp8_ms"] > 0
    assert [(d["mode"], d["batch"]) for d in r["fp8"]["decode"]] == [("eager fp8", 1)]
    for d in r["fp8"]["decode"]:
        assert d["speedup_over_base"] == pytest.approx(d["base_ms_per_forward"] / d["ms_per_forward"])
    (lk,) = r["likelihood"]
    assert lk["tokens"] == 32 and lk["forward_ms"] > 0 and lk["backward_ms"] > 0
    assert r["tensor_parallel"]["status"] == "skipped" and "needs 2 GPUs" in r["tensor_parallel"]["reason"]


@pytest.mark.slow
def test_cpu_run_with_the_compiled_step(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main([*TINY, "--skip", "gpu_tests,fp8,likelihood", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (comp,) = [x for x in r["decode"] if x["mode"] == "compiled"]
    assert comp["compile_s"] > 0 and comp["ms_per_forward"] > 0 and comp["compile_mode"] == "default"


def test_a_failing_section_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("likelihood broke")

    monkeypatch.setattr(gpu, "likelihood_section", broken)
    out = tmp_path / "gpu.json"
    assert gpu.main([*TINY, "--skip", "gpu_tests,decode,fp8", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["likelihood"] == {"error": "RuntimeError: likelihood broke"} and r["failed_sections"] == ["likelihood"]
    assert r["decode"] == {"skipped": "--skip"} and r["tensor_parallel"]["status"] == "skipped"
    assert "FAILED: likelihood" in capsys.readouterr().err
    # a model that cannot be built (out of memory, say): its sections say so, the rest of the run goes on
    monkeypatch.setattr(gpu, "build_model", lambda *args: broken())
    assert gpu.main([*TINY, "--skip", "gpu_tests", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["failed_sections"] == ["decode", "fp8", "likelihood"]
    assert r["fp8"] == {"error": "model not built: RuntimeError: likelihood broke"}
    assert r["tensor_parallel"]["status"] == "skipped"


def test_a_row_error_fails_its_section():
    assert gpu.failed({"likelihood": [{"rows": 1}, {"rows": 4, "error": "out of memory"}]}) == ["likelihood"]
    assert gpu.failed({"fp8": {"gemm": [], "decode": [{"mode": "eager fp8", "error": "x"}]}}) == ["fp8"]
    assert gpu.failed({"decode": [{"mode": "eager", "skipped": "time budget"}], "gpu_tests": {"status": "ok"}}) == []


def test_gpu_test_report_counts_and_names_failures(tmp_path):
    f = tmp_path / "test_marked.py"
    f.write_text("import pytest\n"
                 "@pytest.mark.gpu\ndef test_ok(): pass\n"
                 "@pytest.mark.gpu\ndef test_bad(): assert False\n"
                 "@pytest.mark.gpu\ndef test_skip(): pytest.skip('no')\n"
                 "def test_not_gpu(): assert False\n")
    t = gpu.run_gpu_tests([str(f)], 120)
    assert (t["status"], t["tests"], t["passed"], t["failed"], t["skipped"]) == ("failed", 3, 1, 1, 1)
    # JUnit's classname is the module's dotted path from pytest's rootdir, which depends on where the run starts
    assert [n.rsplit(".", 1)[-1] for n in t["failed_tests"]] == ["test_marked::test_bad"]
    assert gpu.failed({"gpu_tests": t}) == ["gpu_tests"]


def test_bench_decode_takes_a_dtype(tmp_path):
    from ebpo.bench.decode import main, resolve_dtype

    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16 and resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ValueError, match="--dtype: got 'int8'; allowed: auto, fp32, bf16, fp16"):
        resolve_dtype("int8", "cpu")
    out = tmp_path / "decode.json"
    assert main(["--model", "preset:tiny", "--dtype", "bf16", "--batch", "2", "--new-tokens", "8", "--presets", "m2t",
                 "--off-batch-preset", "", "--threads", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["dtype"] == "bfloat16"


def test_rows_past_the_budget_are_skipped_and_every_section_is_still_written(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main([*TINY, "--budget-s", "0", "--skip", "gpu_tests", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(gpu.SECTIONS) <= set(r)
    rows = r["decode"] + r["fp8"]["gemm"] + r["fp8"]["decode"] + r["likelihood"]
    assert [x["mode"] for x in r["decode"]] == ["eager", "compiled"]
    assert rows and all(x["skipped"].startswith("time budget") for x in rows)

