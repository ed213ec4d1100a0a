"""RL on a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`, both nodes on this machine): with
`ray.spread_nodes=2` each node runs one rollout worker and one rank of a 2-rank DeepSpeed ZeRO-3 learner
group whose weights reach the rollout workers by the streamed broadcast; the run resumes exactly after
step 2 and survives a killed learner rank."""
from pathlib import Path

import pytest

from tests.support.ray_runs import (assert_same_learner_step, data, learner_steps, make_cfg, ray,  # noqa: F401
                                    rank_1_killed_at_update, train)


@pytest.fixture
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    # The head records itself as this machine's current cluster, which any other ray.init() without an
    # address (another test run, a user's job) would then join: this test connects by address instead.
    from ray._common.utils import get_ray_address_file

    current = Path(get_ray_address_file(None))
    if current.exists() and cluster.address in current.read_text():
        current.unlink()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _nodes_of(class_name: str) -> list[str]:
    from ray._private import state

    return sorted(a["Address"]["NodeID"] for a in state.actors().values()
                  if a["ActorClassName"].endswith(class_name) and a["State"] == "ALIVE")


@pytest.mark.slow
@pytest.mark.timeout(2400)  # four 3-step runs with ZeRO-3 ranks: about 10 minutes on 2 busy cores
def test_rl_on_two_nodes_spreads_trains_resumes_and_survives_a_killed_rank(two_nodes, tmp_path, data):
    common = ("trainer.steps=3", "trainer.tracking=none", "data.eval=null", "rollout.num_workers=2",
              "ray.spread_nodes=2", f"ray.address={two_nodes.address}", "ray.num_cpus=null",
              "ray.weight_sync=broadcast",
              "learner={n_draws: 2, mu: 1, minibatch_size: 3, lr: 0.001, num_workers: 2, backend: deepspeed, "
              "zero_stage: 3}")
    from ebpo.rl.sync_loop import SyncLoop

    placed = {}
    fit = SyncLoop.fit

    def fit_and_look(self):  # where the actors run, while they run
        placed["rollout"], placed["learner"] = _nodes_of("RolloutWorker"), _nodes_of("LearnerActor")
        return fit(self)

    SyncLoop.fit = fit_and_look
    try:
        train(make_cfg(tmp_path, data, tmp_path / "full", *common))
    finally:
        SyncLoop.fit = fit
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    assert placed["rollout"] == nodes and placed["learner"] == nodes  # one of each on each node

    full = learner_steps(tmp_path / "full")
    assert sorted(full) == [1, 2, 3]
    staged = tmp_path / "staged"
    train(make_cfg(tmp_path, data, staged, *common, "trainer.stop_after=2", "trainer.save_every=1"))
    train(make_cfg(tmp_path, data, staged, *common, f"trainer.resume={staged}"))
    assert_same_learner_step(full[3], learner_steps(staged)[3])

    with rank_1_killed_at_update(3):
        trainer, history = train(make_cfg(tmp_path, data, tmp_path / "killed", *common, "trainer.save_every=1"))
    assert [h["step"] for h in history] == [1, 2, 3] and history[-1]["faults/restarts"] == 1.0
    assert_same_learner_step(full[3], learner_steps(tmp_path / "killed")[3])
