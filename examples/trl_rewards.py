"""TRL reward functions, as TRL's documentation writes them, for rlfabric's `python_function` scorer.

Each function below is copied unchanged from TRL's docs (the README's quickstart and the GRPO trainer's
"Using a custom reward function" examples) or uses TRL's own reward helpers; rlfabric calls them exactly
as TRL's GRPOTrainer does: by keyword, with `prompts`, `completions`, `completion_ids`, every dataset
column under its own name, `trainer_state`, `log_extra` and `log_metric` (see
`rlfabric/reward/scorers/python_function.py`).

In a run file (the reward service must allow this file's folder, and `trl.rewards` for the functions
made by TRL's factories: `allowed_functions`; `rlfabric up` allows the run file's folder):

    [reward]
    scorer = "python_function"
    params = { function = ["examples/trl_rewards.py:format_reward_func",
                           "examples/trl_rewards.py:soft_overlong_punishment"],
               weights = [1.0, 0.5] }

Standalone:

    rlfabric reward score --input items.jsonl --output scored.jsonl --scorer python_function \\
        --params '{"function": "examples/trl_rewards.py:reward_len"}' --allow-function examples
"""

# ruff: noqa: B905 (the functions are TRL's examples, verbatim)

import asyncio
import re

from trl.rewards import get_soft_overlong_punishment


# TRL README, quickstart: rewards completions close to 20 characters.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


# TRL docs, GRPO "Example 2: Reward completions with a specific format" (conversational completions).
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# TRL docs, GRPO "Example 3: Reward completions based on a reference" (a `ground_truth` column).
def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# TRL docs, GRPO "Example 5: Asynchronous reward functions".
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# TRL's DAPO overlong penalty on `completion_ids` (trl.rewards.get_soft_overlong_punishment).
soft_overlong_punishment = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)


# A reward that logs a metric through TRL's `log_metric` and a per-completion column through `log_extra`,
# and reads the training progress from `trainer_state` (a curriculum: longer answers pay after step 10).
def length_curriculum_reward(completions, trainer_state, log_metric=None, log_extra=None, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    lengths = [len(text) for text in texts]
    if log_metric is not None:
        log_metric("mean_chars", sum(lengths) / len(lengths))
    if log_extra is not None:
        log_extra("chars", lengths)
    target = 40 if trainer_state.global_step >= 10 else 20
    return [-abs(target - n) / target for n in lengths]


# TRL docs, GRPO "Example 4: Multi-task reward functions", with the checker it leaves to the reader.
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


def check_math_solution(prompt, completion):
    """The toy checker behind `math_reward_func`: the completion states the sum asked for ("2+2")."""
    numbers = re.findall(r"\d+", prompt)
    return bool(numbers) and str(sum(int(n) for n in numbers)) in completion
