"""The rollout package stays readable: no function a reader must hold in their head runs over 80 lines."""
import ast
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "rollout"


def test_no_function_in_rollout_is_over_80_lines():
    long = []
    for path in sorted(ROLLOUT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.name}:{node.name} ({n} lines)")
    assert not long, long
