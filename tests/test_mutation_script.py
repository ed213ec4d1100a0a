"""scripts/mutation.py's pure parts: which equivalent.txt entries a run makes stale (a mutant now killed, or a
name the run no longer has after its function changed), against a plain reading of the rule."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stale_equivalents_are_entries_of_the_run_s_modules_that_name_no_survivor():
    m = _script()
    modules = ["rollout/engine.py", "rollout/static_slots.py"]
    status = {"rollout.engine.x_f__mutmut_1": "survived", "rollout.engine.x_f__mutmut_2": "killed",
              "rollout.engine.x_f__mutmut_3": "timeout", "rollout.static_slots.x_g__mutmut_1": "survived"}
    equiv = {"rollout.engine.x_f__mutmut_1": "fine", "rollout.engine.x_f__mutmut_2": "was equivalent",
             "rollout.engine.x_f__mutmut_3": "slow", "rollout.engine.x_f__mutmut_9": "renumbered away",
             "rollout.static_slots.x_g__mutmut_1": "fine",
             "rollout.decoder.x_h__mutmut_4": "another module: not this run's business",
             "rollout.engine_extra.x_k__mutmut_1": "a module whose name starts like one of the run's"}
    assert m.stale_equivalents(status, equiv, modules) == {"rollout/engine.py": [
        "`rollout.engine.x_f__mutmut_2`: killed in this run",
        "`rollout.engine.x_f__mutmut_3`: timeout in this run",
        "`rollout.engine.x_f__mutmut_9`: no such mutant in this run"]}
    assert m.stale_equivalents(status, {"rollout.engine.x_f__mutmut_1": "fine"}, modules) == {}



def test_only_patterns_select_mutants_by_fnmatch_on_their_names():
    m = _script()
    names = {"ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_3": "killed",
             "ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_25": "survived",
             "ebpo.core.likelihood.x_composite_logprobs__mutmut_1": "survived",
             "ebpo.core.likelihood.xǁNoiseDrawsǁtake__mutmut_2": "killed"}
    assert m.selected(names, None) == names and m.selected(names, []) == names
    assert m.selected(names, ["ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_*"]) == {
        "ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_3": "killed",
        "ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_25": "survived"}
    assert m.selected(names, ["*take*", "*_mutmut_1"]) == {
        "ebpo.core.likelihood.x_composite_logprobs__mutmut_1": "survived",
        "ebpo.core.likelihood.xǁNoiseDrawsǁtake__mutmut_2": "killed"}
