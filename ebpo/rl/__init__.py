"""The RL system: the Ray driver (`trainer`), the EBPO learner (`learner`) and its actor
(`learner_actor`), weight sync orchestration (`sync_driver`), batch building (`batch`), the RL
recipe (`config`) and restartable actor handles (`actors`)."""
