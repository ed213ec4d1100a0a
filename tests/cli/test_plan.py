"""`ebpo plan RECIPE` (ebpo.cli.plan): the memory plan of shipped recipes on real node shapes, exit status 1 when
a plan does not fit, and exit status 2 naming the field when the model cannot take a layout."""
import pytest


def test_plan_command_for_the_mini_recipe(capsys):
    from ebpo.cli import main

    assert main(["plan", "recipes/rl_math_llada21_mini.yaml", "model=preset:mini"]) == 0
    out = capsys.readouterr().out
    assert "16.26 B parameters" in out and "DOES NOT FIT" not in out
    # flash on one node of 80 GB GPUs does not fit: exit status 1
    assert main(["plan", "recipes/rl_math_llada21_mini.yaml", "model=preset:flash"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


FLASH_80GB = "recipes/rl_math_llada21_flash_80gb.yaml"


def test_flash_80gb_recipe_fits_four_nodes_of_80gb(capsys):
    from ebpo.cli import main

    assert main(["plan", FLASH_80GB, "model=preset:flash", "--nodes", "4", "--gpu-mem-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "4 ranks (tensor_parallel 4, expert_parallel 4), 1 KV head(s)" in out
    assert "all-to-all buffers" in out
    # the single-GPU flash recipe does not fit the same cluster: its rollout worker holds the whole policy
    assert main(["plan", "recipes/rl_math_llada21_flash.yaml", "model=preset:flash", "--nodes", "4"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_flash_80gb_plan_breaks_with_too_few_ranks_or_gpus(capsys):
    from ebpo.cli import main

    base = [FLASH_80GB, "model=preset:flash", "--nodes", "4"]
    # one rank per worker: the whole FP8 policy on one 80 GB GPU
    assert main(["plan", *base, "rollout.tensor_parallel=1", "rollout.expert_parallel=1"]) == 1
    rollout = capsys.readouterr().out.split("rollout worker")[1]
    assert "DOES NOT FIT" in rollout
    # 4 workers x 8 ranks + 16 learner ranks: more GPUs than 4 x 8
    assert main(["plan", *base, "rollout.tensor_parallel=8", "rollout.expert_parallel=8"]) == 1
    assert "the recipe asks for 48 GPUs; the cluster has 32" in capsys.readouterr().out
    # the recipe on two nodes
    assert main(["plan", FLASH_80GB, "model=preset:flash", "--nodes", "2"]) == 1
    assert "the cluster has 16" in capsys.readouterr().out


@pytest.mark.parametrize("overrides,message", [
    (["rollout.tensor_parallel=3", "rollout.expert_parallel=1"],
     "rollout.tensor_parallel = 3: the model's 32 attention heads must be divisible by it and its 4 KV heads "
     "divisible by it or dividing it; allowed: [1, 2, 4, 8, 16, 32]"),
    (["rollout.tensor_parallel=64"], "rollout.tensor_parallel = 64: the model's 32 attention heads"),
    (["rollout.expert_parallel=12"], "rollout.expert_parallel = 12: the model's 256 routed experts must be divisible "
                                     "by it; allowed: [1, 2, 4, 8, 16, 32, 64, 128, 256]"),
    (["rollout.expert_parallel=6"], "rollout.expert_parallel = 6 and rollout.tensor_parallel = 4: one must divide "
                                    "the other"),
    (["rollout.expert_parallel=0"], "rollout.expert_parallel: must be an integer >= 1"),
])
def test_plan_refuses_a_layout_the_model_cannot_take(overrides, message, capsys):
    from ebpo.cli import main

    assert main(["plan", FLASH_80GB, "model=preset:flash", "--nodes", "4", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_plan_refuses_fp8_slices_off_the_128_wide_blocks(capsys):
    """The parallel model's own checks run too: mini's shared expert (512 units) over 8 tensor-parallel ranks
    is 64 units per rank, not a whole FP8 block; in bf16 the same layout is fine."""
    from ebpo.cli import main

    base = ["plan", FLASH_80GB, "model=preset:mini", "rollout.tensor_parallel=8", "rollout.expert_parallel=8"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "rollout.tensor_parallel = 8, rollout.expert_parallel = 8, rollout.fp8 = true" in err
    assert "moe_intermediate_size" in err and "128" in err
    assert main([*base, "rollout.fp8=false"]) in (0, 1)
    assert "rollout worker" in capsys.readouterr().out
