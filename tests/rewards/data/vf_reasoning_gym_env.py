"""A verifiers environment from the library's own classes: `verifiers.ReasoningGymEnv` (reasoning-gym questions,
`<answer>` tags parsed by its XMLParser, reasoning-gym's `score_answer` in its rubric)."""
import verifiers as vf


def load_environment(num_train_examples: int = 8, num_eval_examples: int = 4, seed: int = 0):
    return vf.ReasoningGymEnv(gym="basic_arithmetic", num_train_examples=num_train_examples,
                              num_eval_examples=num_eval_examples, seed=seed)
