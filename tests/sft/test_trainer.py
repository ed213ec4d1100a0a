"""The CPT/SFT trainer (ebpo.sft.trainer) end to end on tiny data: loss goes down, checkpoints + metrics, exact
resume, CPT and LoRA, DeepSpeed and data-parallel ranks."""
import json

import pytest
import torch
from safetensors.torch import load_file

from ebpo.sft.trainer import run

MODEL = "preset:tiny@0"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"prompt": f"Compute {a}+{b}.", "response": f"\\boxed{{{a + b}}}", "answer": str(a + b), "task": "math"}
            for a in range(10, 18) for b in range(20, 24)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": f"{r['prompt']} {r['response']}"}) + "\n" for r in rows))
    return d


def args(data, run_dir, *extra):
    return [f"model={MODEL}", f"data.train={data / 'train.jsonl'}", "data.max_len=48", "trainer.batch_size=8",
            "trainer.steps=10", "trainer.log_every=1", "trainer.tracking=none", "trainer.progress=false",
            "trainer.plots=false", "trainer.num_threads=1", "optim.lr=3e-3", "optim.warmup_steps=2",
            "eval.presets=[]", f"trainer.run_dir={run_dir}", *extra]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_loss_and_writes_checkpoint_and_metrics(data, tmp_path):
    run_dir = run(None, args(data, tmp_path / "run", "trainer.save_every=5", "trainer.plots=true"))
    m = read_metrics(run_dir)
    assert [r["step"] for r in m] == list(range(1, 11))
    first, last = sum(r["loss/total"] for r in m[:3]) / 3, sum(r["loss/total"] for r in m[-3:]) / 3
    assert last < first - 0.5
    ck = run_dir / "checkpoints"
    assert (ck / "latest").read_text() == "step_10"
    assert {p.name for p in ck.glob("step_*")} == {"step_5", "step_10"}
    assert (ck / "step_10" / "model" / "model.safetensors").exists()
    assert (ck / "step_10" / "model" / "tokenizer.json").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "plots" / "loss.png").exists()


def test_resume_continues_from_saved_step_exactly(data, tmp_path):
    full = run(None, args(data, tmp_path / "full"))
    part = run(None, args(data, tmp_path / "part", "trainer.stop_after=5"))
    assert (part / "checkpoints" / "latest").read_text() == "step_5"
    resumed = run(None, args(data, tmp_path / "ignored", f"trainer.resume={part}"))
    assert resumed == part
    steps = [r["step"] for r in read_metrics(part)]
    assert steps == list(range(1, 11))  # 1..5 then 6..10 appended, nothing repeated
    a = load_file(str(full / "checkpoints" / "step_10" / "model" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_10" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    la, lb = read_metrics(full)[-1]["loss/total"], read_metrics(part)[-1]["loss/total"]
    assert abs(la - lb) < 1e-5


def test_cpt_and_lora_runs(data, tmp_path):
    run_dir = run(None, args(data, tmp_path / "cpt", "kind=cpt", f"data.train={data / 'docs.jsonl'}",
                             "data.max_len=32", "trainer.steps=3"))
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_3"
    lora_dir = run(None, args(data, tmp_path / "lora", "lora.enabled=true", "lora.r=4", "trainer.steps=3",
                              "trainer.save_every=2", f"trainer.export_dir={tmp_path / 'export'}"))
    base = load_file(str(lora_dir / "checkpoints" / "step_3" / "model" / "model.safetensors"))
    assert not any("lora" in k for k in base)  # exported merged, plain LLaDA2 names
    from ebpo.model.loading import load_model

    exported = load_model(str(tmp_path / "export"))
    init = load_model(MODEL)
    changed = [k for k, v in exported.state_dict().items() if not torch.equal(v, init.state_dict()[k])]
    assert changed and all("attention" in k or "mlp" in k for k in changed)
    # resume a LoRA run for more steps (a longer schedule changes what it learns: named explicitly)
    run(None, args(data, tmp_path / "x", f"trainer.resume={lora_dir}", "lora.enabled=true", "lora.r=4",
                   "trainer.steps=4", "trainer.resume_changes=[trainer.steps]"))
    assert (lora_dir / "checkpoints" / "latest").read_text() == "step_4"


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_with_resume(data, tmp_path):
    part = run(None, args(data, tmp_path / "ds", "trainer.backend=deepspeed", "trainer.zero_stage=2",
                          "trainer.steps=4", "trainer.save_every=2", "trainer.stop_after=2"))
    run(None, args(data, tmp_path / "x", "trainer.backend=deepspeed", "trainer.zero_stage=2", "trainer.steps=4",
                   f"trainer.resume={part}"))
    m = read_metrics(part)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert (part / "checkpoints" / "step_4" / "deepspeed").is_dir()


def _torchrun(data, run_dir, *extra, nproc=2):
    import os
    import subprocess
    import sys

    from ebpo.infra.distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "-m", "ebpo.cli", "train", "recipes/sft_tiny.yaml",
           *args(data, run_dir, "trainer.backend=deepspeed", "trainer.steps=6", "trainer.save_every=3", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_two_rank_deepspeed_sft_checkpoints_and_resumes_exactly(data, tmp_path):
    """Two ranks checkpoint without racing on the temporary folder, and a resumed run repeats the
    uninterrupted one (both ranks restore their own noise generators)."""
    _torchrun(data, tmp_path / "full")
    _torchrun(data, tmp_path / "staged", "trainer.stop_after=3")
    ckpt = tmp_path / "staged" / "checkpoints" / "step_3"
    assert (ckpt / "rng_rank0.pt").exists() and (ckpt / "rng_rank1.pt").exists()
    assert not list((tmp_path / "staged" / "checkpoints").glob(".tmp_*"))
    _torchrun(data, tmp_path / "staged", f"trainer.resume={tmp_path / 'staged'}")
    full = {r["step"]: r for r in read_metrics(tmp_path / "full")}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "staged")}
    for step in (4, 5, 6):
        assert resumed[step]["loss/total"] == pytest.approx(full[step]["loss/total"], rel=1e-5), step


@pytest.mark.slow
def test_two_ranks_give_the_losses_of_one_rank_on_the_same_global_batch(data, tmp_path):
    """Two ranks of 4 examples compute the update of one rank on the same 8: every rank draws the noise of the
    whole global batch and normalises by its counts, so losses, accuracies and gradient norms agree."""
    _torchrun(data, tmp_path / "one", "trainer.batch_size=8", nproc=1)
    _torchrun(data, tmp_path / "two", "trainer.batch_size=4")
    one = {r["step"]: r for r in read_metrics(tmp_path / "one")}
    two = {r["step"]: r for r in read_metrics(tmp_path / "two")}
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        for key in ("loss/total", "loss/m2t", "acc/m2t", "tokens/masked", "train/grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)
