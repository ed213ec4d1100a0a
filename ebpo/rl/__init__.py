"""The RL system, by role (docs/architecture.md has the map):

- entry and loops: `trainer` (picks one), `sync_loop`, `async_loop` (+ `async_pipeline`, its producer thread);
- one step: `step` (collect / learn / evaluate), over the records of `records`, with `batch` and `prompts`;
- the run: `setup` (start-up order, `RLRun`), `cluster` (actors and placement), `actors` (restartable
  handles), `launch` (run directory, Ray arguments), `checkpoints`;
- weights: `weights` (the one owner of weight versions and their transport), `weight_stream`;
- the learner: `learner`, `learner_steps`, `learner_config`, `learner_actor`, `learner_group`, `sharding`,
  `async_behaviour`;
- the recipe: `config`.
"""
