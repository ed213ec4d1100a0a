"""Multi-turn environments for agentic rollouts: the interface (`api`), environments built from tool
functions (`tools`), the loader (`loader`) and the tiny calculator task (`calculator`).

Lives in `rewards` because an environment is task-side user code like a reward: it scores, and its tools
may run untrusted input in `rewards.sandbox`. It imports nothing of ebpo (docs/rl.md, "Environments").
"""
from rewards.envs.api import Environment, StepResult, as_step_result
from rewards.envs.loader import BUILTIN_ENVS, EnvLoadError, load_environment, make_environment
from rewards.envs.tools import Tool, ToolEnv, parse_tool_calls, run_tool, spec_from_function, validate_arguments

__all__ = ["Environment", "StepResult", "as_step_result", "BUILTIN_ENVS", "EnvLoadError", "load_environment",
           "make_environment", "Tool", "ToolEnv", "parse_tool_calls", "run_tool", "spec_from_function",
           "validate_arguments"]
