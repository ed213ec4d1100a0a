"""`ebpo bench gpu`: the GPU acceptance run, the first thing to run when a GPU is lent.

    ebpo bench gpu --json gpu.json                  # CUDA: preset:mini in bf16, budgeted to 7 minutes
    ebpo bench gpu --device cpu --json cpu.json     # CPU: preset:tiny, tiny sizes (CI keeps it runnable)

One command, one table per section, one JSON file. Sections (JSON keys):
  gpu_tests        `pytest -m gpu` in a subprocess: passed / failed / skipped, the failing tests' names;
  decode           `rollout.generate` on a random-weight preset, eager and compiled (`compiled_step=True`;
                   on CUDA the step runs as a CUDA graph), at batch 1, 32 and 128: tokens/s, forwards/s, ms
                   per forward, and the HBM floor: the bytes one forward must read (the weights it touches -
                   every dense weight, the LM head, the routed experts the batch's blocks can reach - plus
                   the KV cache of the mean prefix) over the card's memory bandwidth;
  fp8              FP8 (`kernels.fp8`) against bf16 on the model's GEMMs at the decode forwards' token
                   counts, and on a whole decode step (the model converted in place, eager, same batches);
  likelihood       the learner's forward and backward (`ebpo.core.likelihood.composite_logprobs`, packed,
                   one draw, activation checkpointing) at learner row sizes: ms, tokens/s, peak memory;
  tensor_parallel  a 2-rank tensor-parallel decode (`ParallelRolloutWorker`, one rank per GPU) against one
                   rank: tokens/s, speedup, identical tokens; needs 2 GPUs (`--tp-cpu`: 2 gloo ranks on
                   the CPU, which checks the row, not its speed).
A section that fails records its error and the run goes on; exit status 1 when a section failed or a GPU
test failed. `--budget-s` bounds the whole run: rows that would start past it are recorded as skipped.
Only the public rollout API (`generate`, `DecodeConfig`) is used.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import torch

from ebpo.bench.gpu_parallel import tensor_parallel_section

COMPILE_GUESS_S = 90.0  # seconds a compiled-step row is assumed to need before one has run (compile + capture)
SECTIONS = ("machine", "gpu_tests", "decode", "fp8", "likelihood", "tensor_parallel")

# HBM bandwidth (GB/s, vendor figures) by a substring of `torch.cuda.get_device_name`, first match wins
# (so "GH200" before "H200", "A100" before "A10", "L40S" before "L4").
BANDWIDTH_GBS = (
    ("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
    ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555), ("A10", 600),
    ("L40S", 864), ("L40", 864), ("L4", 300), ("MI300X", 5300),
)


def hbm_bandwidth(device_name: str, override_gbs: float | None = None) -> tuple[float | None, str]:
    """(GB/s, where it came from) for a device name: the override, else `BANDWIDTH_GBS`, else (None, why)."""
    if override_gbs:
        return float(override_gbs), "--bandwidth-gbs"
    for key, gbs in BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return float(gbs), f"table ({key})"
    return None, f"{device_name!r} is not in the table; pass --bandwidth-gbs"


def weight_bytes_per_forward(config, batch: int, block_size: int, bytes_per_weight: float,
                             fp8: bool = False) -> float:
    """Bytes of weights one decode forward over `batch` blocks of `block_size` tokens must read: every dense
    weight (attention, dense MLP, shared experts, norms, routers), the LM head, and the routed experts the
    blocks can reach (`expert_working_set`); not the embedding table (a forward gathers a few rows of it).
    fp8: the linear layers and experts at one byte plus a scale per 128 x 128 block."""
    from ebpo.infra.memory_plan import FP8_BYTES, expert_working_set, parameter_groups

    g = parameter_groups(config)
    lin = FP8_BYTES if fp8 else bytes_per_weight
    head = config.vocab_size * config.hidden_size
    experts = expert_working_set(config, batch, block_size, lin)["bytes"]
    return (g["q"] + g["kv"] + g["mlp"]) * lin + (head + g["replicated"]) * bytes_per_weight + experts


def kv_bytes_per_forward(config, batch: int, prefix: float, bytes_per_value: float) -> float:
    """Bytes of cached keys and values `batch` rows with a `prefix`-token cached prefix read in one forward."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value
    return batch * prefix * per_token


@dataclass
class Budget:
    """Wall-clock budget of the run: `over()` once `seconds` have passed since `start`."""

    seconds: float
    start: float

    def over(self, need: float = 0.0) -> bool:
        """True when fewer than `need` seconds are left (or none)."""
        return self.seconds - (time.perf_counter() - self.start) < max(need, 0.0) or self.used() > self.seconds

    def used(self) -> float:
        return time.perf_counter() - self.start


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model(preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight `preset` model built directly on `device` (a 16B preset never passes through host
    memory), then cast to `dtype`; the caller's RNG state is left as it was."""
    from ebpo.model import LLaDA2MoeModelLM
    from ebpo.model.presets import load_preset

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = LLaDA2MoeModelLM(load_preset(preset))
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------------------- sections
def run_gpu_tests(paths: list[str], timeout_s: float) -> dict:
    """`pytest -m gpu PATHS` in a subprocess; counts from its JUnit XML, the failing tests by name."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "gpu.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--junitxml", xml,
               *paths]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(cmd[2:]), "status": f"timed out after {timeout_s:g} s"}
        out = {"command": " ".join(cmd[2:]), "rc": proc.returncode, "seconds": time.perf_counter() - t0,
               "tail": (proc.stdout + proc.stderr)[-2000:]}
        if not os.path.exists(xml):
            return {**out, "status": "pytest wrote no report"}
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
    # rc 5: nothing collected (no GPU-marked test under PATHS), not a failure
    status = "failed" if failed or proc.returncode not in (0, 5) else "ok"
    return {**out, "status": status, "tests": total, "passed": total - skipped - len(failed), "failed": len(failed),
            "skipped": skipped, "failed_tests": failed}


def _decode_once(model, prompts, cfg) -> tuple[float, list]:
    from rollout import generate

    t0 = time.perf_counter()
    outs = generate(model, prompts, cfg, seeds=list(range(len(prompts))))
    return time.perf_counter() - t0, outs


def decode_row(model, prompts, cfg, mode: str, floor) -> dict:
    """One timed decode of `prompts` (all at once) after an untimed warm-up: for the compiled step the
    warm-up is the same decode (it compiles every shape the timed run meets), eager a one-block decode."""
    K = cfg.block_size or model.config.block_size
    warm = cfg if mode != "eager" else cfg.replace(max_new_tokens=K)
    compile_s, _ = _decode_once(model, prompts, warm)
    wall, outs = _decode_once(model, prompts, cfg)
    # every sequence starts in the first forward, so the engine's forwards are the most any sequence took part in
    forwards = max(o.num_forwards for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"mode": mode, "batch": len(prompts), "tokens": tokens, "forwards": forwards, "wall_s": wall,
           "tokens_per_s": tokens / wall, "forwards_per_s": forwards / wall, "ms_per_forward": 1e3 * wall / forwards}
    if mode != "eager":
        row["compile_s"] = compile_s
    return {**row, **floor(len(prompts), row["ms_per_forward"])}


def _floor(model, cfg, prompt_len: int, bytes_per_weight: float, gbs: float | None, fp8: bool = False):
    """`floor(batch, ms)`: the HBM-floor columns of a decode row (`weight_bytes_per_forward` + the KV cache
    of the mean cached prefix, prompt + half the answer, over `gbs` GB/s)."""
    c = model.config
    K = cfg.block_size or c.block_size

    def floor(batch: int, ms: float) -> dict:
        wb = weight_bytes_per_forward(c, batch, K, bytes_per_weight, fp8)
        kv = kv_bytes_per_forward(c, batch, prompt_len + max(cfg.max_new_tokens - K, 0) / 2, bytes_per_weight)
        out = {"weight_bytes_per_forward": wb, "kv_bytes_per_forward": kv}
        if gbs:
            out["hbm_floor_ms"] = 1e3 * (wb + kv) / (gbs * 1e9)
            out["floor_over_measured"] = out["hbm_floor_ms"] / ms
        return out
    return floor


@contextlib.contextmanager
def cuda_graphs(enabled: bool):
    """Run the compiled decode step as a CUDA graph (`rollout.compiled.MODE = "reduce-overhead"`,
    docs/decoding.md) while the block runs; yields the compile mode in force."""
    import rollout.compiled as compiled

    old = getattr(compiled, "MODE", None)
    if enabled and hasattr(compiled, "MODE"):
        compiled.MODE = "reduce-overhead"
    try:
        yield getattr(compiled, "MODE", None) or "default"
    finally:
        if hasattr(compiled, "MODE"):
            compiled.MODE = old


def decode_section(model, a, budget: Budget, gbs, mode: str, fp8_dtype: torch.dtype | None = None) -> list[dict]:
    """Decode rows of `mode` ("eager" or "compiled") for every batch of `a.batches` (`decode_row`); rows past
    the budget are skipped. fp8_dtype: the model's linear layers are FP8 and the rest of it this dtype (the
    floor counts their bytes so)."""
    from rollout import DecodeConfig

    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    dev = next(model.parameters()).device
    fp8 = fp8_dtype is not None
    bpw = torch.empty((), dtype=fp8_dtype if fp8 else next(model.parameters()).dtype).element_size()
    label = mode + (" fp8" if fp8 else "")
    rows = []
    # a row may start only if the time it likely takes is left: 1.5 x the previous row's (batches grow), and for
    # the first compiled row a guess at a compile
    need = COMPILE_GUESS_S if mode == "compiled" else 0.0
    with cuda_graphs(dev.type == "cuda" and mode == "compiled") as compile_mode:
        for batch in a.batches:
            if budget.over(need):
                rows.append({"mode": label, "batch": batch, "skipped": f"time budget ({need:.0f} s needed)"})
                continue
            t0 = time.perf_counter()
            cfg = DecodeConfig.preset(a.preset, max_new_tokens=a.new_tokens, stop_at_eos=False,
                                      temperature=a.temperature, max_batch=batch, compiled_step=mode == "compiled")
            prompts = [torch.randint(8, V, (a.prompt_len,), generator=g).tolist() for _ in range(batch)]
            row = decode_row(model, prompts, cfg, mode, _floor(model, cfg, a.prompt_len, bpw, gbs, fp8))
            row["mode"] = label
            if mode == "compiled":
                row["compile_mode"] = compile_mode
            rows.append(row)
            _line("decode", row)
            need = 1.5 * (time.perf_counter() - t0)
    return rows


def gemm_shapes(config) -> list[tuple[str, int, int]]:
    """(name, N out, K in) of the model's linear layers: fused QKV, attention output, dense MLP, one expert."""
    H, d = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    F, Fe = config.intermediate_size, config.moe_intermediate_size
    return [(f"qkv {H}->{qkv}", qkv, H), (f"attn out {config.num_attention_heads * d}->{H}", H,
                                                config.num_attention_heads * d),
            (f"ffn up {H}->{F}", F, H), (f"ffn down {F}->{H}", H, F), (f"expert up {H}->{Fe}", Fe, H),
            (f"expert down {Fe}->{H}", H, Fe)]


def _median_time(fn, dev: torch.device, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def gemm_rows(config, dtype: torch.dtype, dev: torch.device, tokens: int, repeats: int) -> list[dict]:
    """FP8 (`kernels.fp8.fp8_block_matmul`, per-block weights, per-token-group activations) against a `dtype`
    matmul on `tokens` rows for every shape of `gemm_shapes`, with both errors against an fp32 product."""
    from kernels.fp8 import fp8_block_matmul, quantize_weight_blockwise

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, N, K in gemm_shapes(config):
        x = torch.randn(tokens, K, generator=g).to(dev, dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dtype)
        wq, ws = quantize_weight_blockwise(w)
        t_base = _median_time(lambda: x @ w.t(), dev, repeats)
        t_fp8 = _median_time(lambda: fp8_block_matmul(x, wq, ws, out_dtype=dtype), dev, repeats)
        exact = x.float() @ w.float().t()
        rel = [float((y.float() - exact).norm() / exact.norm()) for y in (x @ w.t(), fp8_block_matmul(x, wq, ws))]
        rows.append({"M": tokens, "shape": name, "N": N, "K": K, "base_ms": 1e3 * t_base, "fp8_ms": 1e3 * t_fp8,
                     "speedup": t_base / t_fp8, "fp8_tflops": 2 * tokens * N * K / t_fp8 / 1e12,
                     "rel_err_base": rel[0], "rel_err_fp8": rel[1]})
    return rows


def fp8_section(model, a, budget: Budget, gbs, base_rows: list[dict]) -> dict:
    """FP8 against the model's dtype (bf16 on CUDA): the model's GEMMs at the decode forwards' token counts
    (batch x block), then whole eager decode steps of an FP8 copy of the model (converted in place, then
    freed), compared with the `base_rows` of the same batch."""
    import copy

    from kernels.fp8 import convert_model_to_fp8

    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    K = model.config.block_size
    gemm = []
    for batch in a.batches:
        if budget.over():
            gemm.append({"M": batch * K, "skipped": "time budget"})
            continue
        for r in gemm_rows(model.config, dtype, dev, batch * K, a.repeats):
            gemm.append(r)
            _line("fp8 gemm", r)
    fp8_model = convert_model_to_fp8(copy.deepcopy(model))
    try:
        rows = decode_section(fp8_model, a, budget, gbs, "eager", fp8_dtype=dtype)
    finally:
        del fp8_model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        ref = next((b for b in base_rows if b["mode"] == "eager" and b["batch"] == r["batch"] and "skipped" not in b),
                   None)
        if ref and "skipped" not in r:
            r["base_ms_per_forward"] = ref["ms_per_forward"]
            r["speedup_over_base"] = ref["ms_per_forward"] / r["ms_per_forward"]
    return {"base_dtype": str(dtype).removeprefix("torch."), "gemm": gemm, "decode": rows}


def likelihood_section(model, a, budget: Budget) -> list[dict]:
    """The learner's packed forward (one noise draw with its clean copy) and backward on rows of `row_len`
    tokens, half prompt, half response; activation checkpointing as the learner recipes set it."""
    from ebpo.core.likelihood import draw_noise
    from ebpo.model.modeling_llada2_moe import enable_activation_checkpointing

    c = model.config
    dev = next(model.parameters()).device
    if a.checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    for i, (n, length) in enumerate(a.learner_rows):
        if budget.over():
            rows.append({"rows": n, "row_len": length, "skipped": "time budget"})
            continue
        ids = torch.randint(8, c.vocab_size, (n, length), generator=g, device=dev)
        resp = torch.zeros(n, length, dtype=torch.bool, device=dev)
        resp[:, length // 2:] = True
        noise = draw_noise(resp, c.block_size, 1, 0.1, 1.0, g)
        try:
            row = _likelihood_row(model, ids, noise, c.mask_token_id, dev, warm=i == 0)
        except torch.cuda.OutOfMemoryError as e:
            row = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"rows": n, "row_len": length, "tokens": 2 * n * length, **row})
        _line("likelihood", rows[-1])
    model.eval()
    return rows


def _likelihood_row(model, ids, noise, mask_id: int, dev, warm: bool) -> dict:
    from ebpo.core.likelihood import composite_logprobs

    def step():
        _sync(dev)
        t0 = time.perf_counter()
        comp = composite_logprobs(model, ids, noise, [0], mask_id, packed=True)
        _sync(dev)
        t1 = time.perf_counter()
        comp.float().sum().backward()
        _sync(dev)
        return t1 - t0, time.perf_counter() - t1

    if warm:
        step()
        model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    fwd, bwd = step()
    tokens = 2 * ids.numel()
    out = {"forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd, "tokens_per_s": tokens / (fwd + bwd)}
    if dev.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    return out


# ------------------------------------------------------------------------------------------- the run
def _line(section: str, row: dict) -> None:
    """One progress line per finished row (a long run shows where it is)."""
    keys = [k for k in ("mode", "batch", "shape", "M", "rows", "row_len") if k in row]
    vals = [k for k in ("tokens_per_s", "ms_per_forward", "hbm_floor_ms", "speedup", "forward_ms", "backward_ms",
                        "error", "skipped") if k in row]
    print(f"  {section}: " + " ".join(f"{k}={row[k]}" for k in keys) + "  "
          + " ".join(f"{k}={_fmt(row[k])}" for k in vals), flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def machine(dev: torch.device, dtype: torch.dtype, override_gbs: float | None) -> dict:
    """The device, software versions and the bandwidth the HBM floor uses."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({platform.processor() or 'unknown'})"
    gbs, source = hbm_bandwidth(name, override_gbs)
    return {"device": str(dev), "name": name, "gpus": torch.cuda.device_count() if dev.type == "cuda" else 0,
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "dtype": str(dtype).removeprefix("torch."), "bandwidth_gbs": gbs, "bandwidth_source": source}


def _section(result: dict, name: str, skip: set, fn, path: str | None = None):
    """result[name] = fn(), or the reason it did not run, or the error it raised (the run goes on); then the
    result so far goes to `path` (a run stopped from outside keeps its finished sections)."""
    if name in skip:
        result[name] = {"skipped": "--skip"}
        return
    try:
        result[name] = fn()
    except Exception as e:  # an acceptance run reports what failed and goes on to the next section
        result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"  {name}: ERROR {type(e).__name__}: {e}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump({**result, "partial": True}, f, indent=1)


def run(a) -> dict:
    """Every section of the acceptance run (module docstring) with the parsed arguments `a`."""
    from ebpo.bench.decode import resolve_dtype

    dev = torch.device(a.device)
    dtype = resolve_dtype(a.dtype, a.device)
    budget = Budget(a.budget_s, time.perf_counter())
    result = {"machine": machine(dev, dtype, a.bandwidth_gbs),
              "settings": {k: v for k, v in vars(a).items() if k != "json"}}
    skip = set(filter(None, a.skip.split(",")))
    _section(result, "gpu_tests", skip, lambda: run_gpu_tests(a.tests, a.tests_timeout_s), a.json)
    try:
        model = build_model(a.model, dtype, dev)
    except Exception as e:  # e.g. out of memory: the model's sections say so
        result["model"] = {"preset": a.model, "error": f"{type(e).__name__}: {e}"}
        for name in ("decode", "fp8", "likelihood"):
            result[name] = {"error": f"model not built: {type(e).__name__}: {e}"}
    else:
        result["model"] = {"preset": a.model, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                           "parameters": sum(p.numel() for p in model.parameters())}
        _model_sections(model, a, budget, result, skip)
    _section(result, "tensor_parallel", skip, lambda: tensor_parallel_section(dev, a), a.json)
    result["seconds"] = budget.used()
    return result


def _model_sections(model, a, budget: Budget, result: dict, skip: set) -> None:
    """decode (eager), fp8, likelihood, then the compiled decode rows: cheap and certain first, compile time
    last, so that the budget skips the compiled rows first."""
    gbs = result["machine"]["bandwidth_gbs"]
    _section(result, "decode", skip, lambda: decode_section(model, a, budget, gbs, "eager"), a.json)
    eager = result["decode"] if isinstance(result["decode"], list) else []
    _section(result, "fp8", skip, lambda: fp8_section(model, a, budget, gbs, eager), a.json)
    _section(result, "likelihood", skip, lambda: likelihood_section(model, a, budget), a.json)
    if not isinstance(result["decode"], list):
        return
    if a.no_compiled:
        result["decode"] += [{"mode": "compiled", "batch": b, "skipped": "--no-compiled"} for b in a.batches]
        return
    _section(result, "decode_compiled", skip, lambda: decode_section(model, a, budget, gbs, "compiled"), a.json)
    compiled = result.pop("decode_compiled")
    result["decode"] += compiled if isinstance(compiled, list) else [{"mode": "compiled", **compiled}]


def _rows(section) -> list[dict]:
    if isinstance(section, list):
        return section
    if isinstance(section, dict) and "gemm" in section:
        return section["gemm"] + section["decode"]
    return []


def failed(result: dict) -> list[str]:
    """The sections that raised or have a row that did (out of memory included), and the GPU tests if any
    failed or timed out."""
    bad = [n for n in SECTIONS if isinstance(result.get(n), dict) and "error" in result[n]
           or any("error" in r for r in _rows(result.get(n)))]
    if result.get("gpu_tests", {}).get("status", "ok") != "ok":  # failed, timed out, no report
        bad.append("gpu_tests")
    return bad


def print_tables(result: dict) -> None:
    """One table per section."""
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 160))
    m = result["machine"]
    mod = result["model"]
    about = mod.get("error") or f"{mod['parameters'] / 1e9:.3g} B parameters, random weights, {mod['dtype']}"
    con.print(f"ebpo bench gpu: preset:{mod['preset']} ({about}) on {m['name']} ({m['device']}), torch {m['torch']}, "
              f"HBM {m['bandwidth_gbs'] or 'unknown'} GB/s [{m['bandwidth_source']}], {result['seconds']:.0f} s")

    def table(title: str, rows, cols):
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows if isinstance(rows, list) else [rows]:
            note = r.get("skipped") or r.get("error")
            cells = [_fmt(r.get(c, "")) for c in cols]
            if note:  # a row that did not run says why in its first empty cell
                cells[next((i for i, c in enumerate(cols) if c not in r), -1)] = str(note)
            t.add_row(*cells)
        con.print(t)

    t = result["gpu_tests"]
    table("GPU-marked tests (pytest -m gpu)", t, ["status", "tests", "passed", "failed", "skipped", "seconds"])
    for name in t.get("failed_tests", []):
        con.print(f"  FAILED {name}")
    cols = ["mode", "batch", "tokens_per_s", "forwards_per_s", "ms_per_forward", "hbm_floor_ms",
            "floor_over_measured", "compile_s"]
    table("decode (random weights)", result["decode"], cols)
    fp8 = result["fp8"]
    if "gemm" in fp8:
        base = fp8["base_dtype"]
        table(f"FP8 vs {base}: GEMMs (speedup = {base} ms / fp8 ms)", fp8["gemm"],
              ["M", "shape", "base_ms", "fp8_ms", "speedup", "rel_err_base", "rel_err_fp8"])
        table(f"FP8 vs {base}: decode step (eager)", fp8["decode"],
              ["mode", "batch", "ms_per_forward", "base_ms_per_forward", "speedup_over_base", "hbm_floor_ms"])
    else:
        table("FP8 vs bf16", fp8, ["status"])
    table("likelihood forward + backward (learner)", result["likelihood"],
          ["rows", "row_len", "tokens", "forward_ms", "backward_ms", "tokens_per_s", "peak_gb"])
    table("tensor-parallel decode, 2 ranks", result["tensor_parallel"],
          ["status", "gpus", "batch", "one_rank_tokens_per_s", "two_rank_tokens_per_s", "speedup", "identical_tokens",
           "reason"])


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ebpo bench gpu", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda[:N] or cpu (default: cuda when there is one)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights and activations: auto = bf16 on CUDA, fp32 on CPU (default: %(default)s)")
    p.add_argument("--model", default=None, help="random-weight preset (default: mini on CUDA, tiny on CPU)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,32,128 on CUDA; 1,4 on CPU)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per sequence (default 64; CPU 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 32; CPU 8)")
    p.add_argument("--preset", default="speed", help="decode preset (default: %(default)s, the rollout preset)")
    p.add_argument("--temperature", type=float, default=0.0, help="decode temperature (default: greedy)")
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled-step rows (compile time)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="HBM bandwidth in GB/s for the floor, instead of the table by device name")
    p.add_argument("--learner-rows", default=None,
                   help="likelihood rows x tokens, e.g. 1x2048,4x2048 (default; CPU 1x64,2x64)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="likelihood without activation checkpointing")
    p.add_argument("--square", type=int, default=None, help="square FP8 GEMM size (default 4096; CPU 256)")
    p.add_argument("--repeats", type=int, default=None, help="GEMM timing repeats (default 20; CPU 3)")
    p.add_argument("--tests", nargs="*", default=["tests"], help="paths for pytest -m gpu (default: tests)")
    p.add_argument("--tests-timeout-s", type=float, default=180.0, help="limit for the GPU tests (default 180)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="rows that would start later are skipped (default 420 s on CUDA, 300 s on CPU)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip, of {', '.join(SECTIONS[1:])}")
    p.add_argument("--tp-cpu", action="store_true",
                   help="run the tensor-parallel row on 2 CPU ranks (gloo) when there are no 2 GPUs")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def parse_args(argv: list[str]):
    """Arguments with the device's defaults filled in (GPU: learner-scale mini; CPU: tiny sizes)."""
    a = build_parser().parse_args(argv)
    gpu = a.device.startswith("cuda")
    defaults = dict(model="mini" if gpu else "tiny", batches="1,32,128" if gpu else "1,4",
                    new_tokens=64 if gpu else 16, prompt_len=32 if gpu else 8,
                    learner_rows="1x2048,4x2048" if gpu else "1x64,2x64", square=4096 if gpu else 256,
                    repeats=20 if gpu else 3, budget_s=420.0 if gpu else 300.0)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.model = a.model.removeprefix("preset:")
    a.batches = [int(b) for b in str(a.batches).split(",")]
    a.learner_rows = _pairs(a.learner_rows)
    unknown = set(filter(None, a.skip.split(","))) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"ebpo bench gpu: --skip {sorted(unknown)}: allowed: {', '.join(SECTIONS[1:])}")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    result = run(a)
    print_tables(result)
    bad = failed(result)
    result["failed_sections"] = bad
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if bad:
        print(f"ebpo bench gpu: FAILED: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
