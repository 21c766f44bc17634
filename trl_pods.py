"""PODS for TRL: a GRPOTrainer that generates n rollouts per prompt and trains on m of them.

Paper: Xu, Savani, Fang, Kolter, "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM
Reinforcement Learning" (arXiv 2504.13818). TRL's GRPOTrainer generates `num_generations` = n
rollouts per prompt and updates on all of them; `PODSGRPOTrainer` keeps m of each prompt's n with a
Definition 3.1 rule (`pods.downsample`: max_variance, max_reward or random), recomputes the
advantages from the kept rewards (`grpo.group_advantages`), and hands TRL's loss only the kept rows:

    config = GRPOConfig(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                        loss_type="grpo", ...)          # 4 prompts x 8 rollouts per optimizer step
    trainer = PODSGRPOTrainer(model=..., reward_funcs=..., args=config, train_dataset=..., m=4)
    trainer.train()                                     # each step trains on 4 prompts x 4 kept rollouts

Tested with trl 1.16.0 (requirements-trl.txt). The trainer needs `pods` and `grpo` of this project;
`task_dataset` and `task_reward`, train.py's task for it, also `data` and `rewards`. Importing it with a
TRL whose overridden methods have other signatures fails with one line saying so (check_trl; a TRL that
changed what they do, or what the batch holds, under the same signatures is not caught there: another version
is warned of at import, and a batch key it does not know stops the first step).

What it overrides in GRPOTrainer, and why:
- `_calculate_rewards`: calls TRL's and keeps its result, the reward of every reward function for
  every rollout of every process, so the selection uses exactly the rewards TRL scored.
- `_generate_and_score_completions`: after TRL's (generate, score, advantages over all n), keeps m
  rows per prompt group (their completions padded to the longest kept one only: `trim_completions`)
  and recomputes `advantages` and `num_items_in_batch` for them. It is the
  last point before `_prepare_inputs` shuffles the generation batch and splits it into
  `steps_per_generation` micro-batches, so every micro-batch, and TRL's unchanged `compute_loss`,
  sees only kept rows: the backward pass runs on m/n of the rollouts, the saving PODS is about.
In evaluation (`model.training` False) nothing changes: all n rollouts are scored.

Loss type: `loss_type="grpo"` is the paper's normalization, grpo.grpo_loss's: each completion's
token losses averaged over its own tokens (1/|o_i|), then averaged over completions. TRL's "grpo"
takes that mean per micro-batch and divides by the accumulation steps; the micro-batches are of
equal size, so the sum is the mean over all kept completions. TRL's default "dapo" (and "bnpo")
normalize by token counts instead, which weights long completions more, and "dr_grpo" by rows x
max_completion_length.

Batch sizes: `per_device_train_batch_size` counts generated rollouts, as in TRL; after down-sampling
each micro-batch holds per_device_train_batch_size x m / n of them. Checked at construction (one-line
ValueErrors, see `check_config`): a process holds whole groups, the kept rows split evenly into the
micro-batches (TRL's split_tensor_dict would silently drop a remainder), 2 <= m <= n, group scaling.
`num_items_in_batch` (the token count "dapo", "cispo" and "vespo" divide by) is recounted over the
kept rows, so those losses are not scaled down by about m/n. It is TRL's count, completion_mask x
tool_mask summed over every process, taken over the kept rows of the masks TRL returns: with
mask_truncated_completions=True TRL zeroes truncated rows in both masks before counting (trl 1.16.0
grpo_trainer.py 2487-2498), so a kept truncated row counts 0 tokens here as there.

Logging: TRL's `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<func>/mean|std`, the
`completions/*` lengths, `num_tokens`, with vLLM `sampling/sampling_logp_difference/*` and
`sampling/importance_sampling_ratio/*`, and the completions table (with TRL's advantages) describe all
n generated rollouts; `pods/reward` and `pods/reward_std` the m kept, each computed as its TRL namesake
(trl 1.16.0 grpo_trainer.py 2828-2830), and `pods/frac_reward_zero_std` the share of groups whose kept
rewards are all equal (where their advantages are 0; TRL's tests the std with torch.isclose, 1e-8 from 0).
So `reward_std` is the sample std of all the batch's rewards pooled; `pods/group_reward_std` is the mean within-group std of the kept rewards
(what max_variance maximizes), the quantity train.py logs as `kept_reward_std`.

Not saved: TRL computes old log-probs (with vLLM's importance sampling, or when
gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations, e.g.
num_iterations > 1) and reference log-probs (beta != 0) on all n rollouts, in no-grad forward
passes, before any reward exists; dropped rows still pay for those passes.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import warnings

import numpy as np
import torch
import trl
from trl import GRPOConfig, GRPOTrainer

import data
import grpo
import pods
import rewards

TESTED_TRL = "1.16.0"

# The per-rollout entries of the batch trl 1.16.0's _generate_and_score_completions returns for text
# prompts. A batch with any other entry (images, or a newer TRL's additions) is refused, not guessed at.
ROW_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
            "importance_sampling_ratio", "sampling_per_token_logps", "ref_per_token_logps", "tool_mask"}
BATCH_KEYS = {"num_items_in_batch"}  # one value for the whole batch, recomputed after down-sampling
# Those of ROW_KEYS that hold a value per completion token, [rows, completion tokens] (importance_sampling_ratio: or [rows, 1])
COMPLETION_KEYS = {"completion_ids", "completion_mask", "old_per_token_logps", "importance_sampling_ratio",
                   "sampling_per_token_logps", "ref_per_token_logps", "tool_mask"}

# The methods overridden or relied on, with the parameters they have in trl 1.16.0
TRL_METHODS = {
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_prepare_inputs": ["self", "generation_batch"],
}
# GRPOTrainer attributes read here, all set by trl 1.16.0's __init__
TRL_ATTRIBUTES = ("num_generations", "reward_weights", "scale_rewards", "multi_objective_aggregation", "_metrics", "_step",
                  "pad_to_multiple_of")


def version_error(what: str) -> str:
    return f"trl_pods was tested with trl {TESTED_TRL}; found trl {trl.__version__}, where {what}: pip install -r requirements-trl.txt"


def check_trl(trainer_class: type = GRPOTrainer) -> None:
    """Raise ImportError unless `trainer_class` has the methods this file overrides, as in trl 1.16.0."""
    for name, params in TRL_METHODS.items():
        method = getattr(trainer_class, name, None)
        if method is None or list(inspect.signature(method).parameters) != params:
            raise ImportError(version_error(f"GRPOTrainer.{name}({', '.join(params)}) is missing or has another signature"))


check_trl()
if trl.__version__ != TESTED_TRL:  # the signatures match, but what the methods do may have changed: said once, at import
    warnings.warn(f"trl_pods was tested with trl {TESTED_TRL}; this is trl {trl.__version__}, whose GRPOTrainer it has not "
                  f"been checked against: pip install -r requirements-trl.txt for the tested one", stacklevel=2)


def check_config(args: GRPOConfig | None, m: int, rule: str) -> None:
    """One-line ValueErrors for settings under which keeping m of n rollouts would go wrong (without `args`, TRL's
    default config not made yet: those of m and rule alone, checked before the model loads)."""
    if rule not in pods.RULES:
        raise ValueError(f"rule={rule!r} is not a down-sampling rule; choose one of {', '.join(sorted(pods.RULES))}")
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):  # m=3.0 passed the checks and failed at the first step
        raise ValueError(f"m={m!r} must be a whole number: the rollouts kept per prompt")
    if m < 2:
        raise ValueError(f"m={m} must be at least 2 (grpo.group_advantages needs two kept rewards per prompt)")
    if args is None:
        return
    n, B, S = args.num_generations, args.per_device_train_batch_size, args.steps_per_generation
    if m > n:
        raise ValueError(f"m={m} must be at most num_generations={n}: the rollouts kept of those sampled per prompt")
    if B * S % n:
        raise ValueError(f"per_device_train_batch_size={B} x steps_per_generation={S} = {B * S} rollouts per process is not a "
                         f"multiple of num_generations={n}: a prompt's rollouts would be split across processes; make it one")
    if B * m % n:
        raise ValueError(f"per_device_train_batch_size={B} x m={m} / num_generations={n} is not a whole number of kept rollouts "
                         f"per micro-batch (TRL would silently drop the remainder); make per_device_train_batch_size x m a "
                         f"multiple of num_generations")
    if args.scale_rewards != "group":
        raise ValueError(f"scale_rewards={args.scale_rewards!r}: PODS recomputes advantages with the group mean and std of "
                         f"the kept rewards (grpo.group_advantages); set scale_rewards='group'")
    if args.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(f"multi_objective_aggregation={args.multi_objective_aggregation!r}: PODS selects on the weighted "
                         f"sum of the rewards; set multi_objective_aggregation='sum_then_normalize'")


def local_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """This process's `rows` rewards from `start` among every process's [rows, reward functions], summed with the
    weights as TRL sums them. A rollout for which every reward function returned None stops every process alike
    (checked over all rows: one process alone raising left the others waiting in the next gather)."""
    if torch.isnan(rewards_per_func).all(dim=1).any():
        raise ValueError("every reward function returned None for a rollout, but PODS ranks all n rollouts by reward: "
                         "make at least one reward function return a number for every completion")
    mine = rewards_per_func[start : start + rows]
    return (mine * reward_weights.to(mine.device)).nansum(dim=1)


class PODSGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that trains on m of each prompt's n = num_generations rollouts (see the module docstring).

    m: rollouts kept per prompt, 2 <= m <= n. rule: "max_variance" (PODS), "max_reward" or "random".
    """

    def __init__(self, *args, m: int, rule: str = "max_variance", **kwargs):
        check_config(kwargs.get("args", args[2] if len(args) > 2 else None), m, rule)  # before the model loads
        super().__init__(*args, **kwargs)
        missing = [name for name in TRL_ATTRIBUTES if not hasattr(self, name)]
        if missing:
            raise RuntimeError(version_error(f"GRPOTrainer has no {', '.join(missing)}"))
        check_config(self.args, m, rule)  # again, with TRL's default config where none was given
        self.m, self.rule = m, rule
        self.rewards_per_func = None  # the last generation batch's rewards, every process's rows

    def selection_rng(self) -> np.random.Generator:
        """The random rule's generator for this generation batch: a function of the seed, the process
        and the place in training (optimizer step, micro-step within it), so a resumed run draws what
        the uninterrupted one would have (TRL checkpoints global_step, and restarts its micro-step
        counter _step at 0, which is a step boundary)."""
        micro_step = self._step % self.args.gradient_accumulation_steps
        return np.random.default_rng([self.args.seed, self.accelerator.process_index, self.state.global_step, micro_step])

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.rewards_per_func

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return batch
        start = self.accelerator.process_index * len(inputs)  # this process's rows among the gathered rewards
        return self.downsample_batch(batch, local_rewards(self.rewards_per_func, self.reward_weights, start, len(inputs)))

    def downsample_batch(self, batch: dict, rewards: torch.Tensor) -> dict:
        """Keep m rows of each group of n in TRL's generation batch, with advantages from the kept rewards.

        `rewards` are the local rows' rewards, group after group (TRL's RepeatSampler puts a prompt's
        n rollouts next to each other, and check_config keeps a group on one process).
        """
        unknown = set(batch) - ROW_KEYS - BATCH_KEYS
        if unknown:
            raise RuntimeError(f"the generation batch has entries {sorted(unknown)} that trl_pods cannot down-sample: multimodal "
                               f"prompts are not supported, and trl_pods was tested with trl {TESTED_TRL} (found {trl.__version__})")
        n, m = self.num_generations, self.m
        keep = torch.tensor(pods.downsample(rewards, m, self.rule, group_size=n, rng=self.selection_rng()), device=rewards.device)
        kept = trim_completions({key: value[keep] for key, value in batch.items() if key in ROW_KEYS}, self.pad_to_multiple_of)
        kept_rewards = rewards[keep].view(-1, m)
        kept["advantages"] = grpo.group_advantages(kept_rewards).view(-1)  # A_i = (r_i - mean) / (std + 1e-4), kept only
        # TRL's count (truncated rows already zeroed in both masks when mask_truncated_completions), over kept rows
        loss_mask = kept["completion_mask"] * kept["tool_mask"] if "tool_mask" in kept else kept["completion_mask"]
        kept["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()  # tokens the kept rows train on

        kept_rewards = self.accelerator.gather(kept_rewards)  # all processes' kept rewards, as TRL logs all rewards
        group_std = kept_rewards.std(dim=1)
        metrics = self._metrics["train"]
        metrics["pods/reward"].append(kept_rewards.mean().item())
        metrics["pods/reward_std"].append(kept_rewards.std().item())  # pooled, as TRL's reward_std (not per group)
        metrics["pods/group_reward_std"].append(group_std.mean().item())  # mean within-group std: train.py's kept_reward_std
        uniform = ~pods.informative_groups(kept_rewards)  # exactly where group_advantages gives 0 (a float32 std of equal rewards need not be 0)
        metrics["pods/frac_reward_zero_std"].append(float(uniform.mean()))
        return kept


def trim_completions(kept: dict, multiple: int | None = None) -> dict:
    """The kept rows' per-token entries cut after the last token any of them keeps in completion_mask: TRL pads every
    row to the longest of all n completions, which may be one dropped, and the update's forward and backward passes
    would run over its padding. What is cut is masked out of the attention and the loss alike (TRL's attention mask is
    the completion mask), so the loss is the same; at least one column stays (TRL reads logits_to_keep=0 as all). The
    width stays a multiple of GRPOConfig's pad_to_multiple_of (`multiple`; 128 on Neuron, which compiles per shape)."""
    mask = kept["completion_mask"]
    used = mask.any(dim=0).nonzero()
    width, tokens = int(used.max()) + 1 if len(used) else 1, mask.size(1)
    if multiple:
        width = min(tokens, -(-width // multiple) * multiple)
    return {key: value[:, :width] if key in COMPLETION_KEYS and value.dim() == 2 and value.size(1) == tokens else value
            for key, value in kept.items()}


# ----------------------------------------------------------------------------- this project's task, as TRL takes it

def task_dataset(dataset: str = "gsm8k", split: str = "train", count: int | None = None):
    """train.py's task as a TRL dataset: each row's `prompt` is train.py's chat (its system prompt asking for
    <think>/<answer>, then the question) and its `answer` the reference answer, which TRL hands to reward
    functions by column name (task_reward). `dataset` takes what train.py --dataset does (gsm8k, a .jsonl
    file, arith, arith:2); `split` is "train" or "test"; `count` keeps the first rows (None: all)."""
    from datasets import Dataset

    if split not in ("train", "test"):  # (the built-in task has no other, and returned its training problems)
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if count is not None and (isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1):
        raise ValueError(f"count={count!r} must be a whole number >= 1, or None for every row")  # (-1 dropped the last row)
    examples = data.load_examples(dataset, split)[:count]
    return Dataset.from_dict({
        "prompt": [rewards.chat_messages(e.question) for e in examples],
        "answer": [e.answer for e in examples],
    })


def completion_text(completion) -> str:
    """A completion as TRL hands it to reward functions, as text: a conversational message list or plain text."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def task_reward(completions, answer, **kwargs) -> list[float]:
    """train.py's reward (rewards.reward: correctness plus format) in TRL's reward-function signature."""
    return [rewards.reward(completion_text(c), a) for c, a in zip(completions, answer)]


def activation_checkpointing(on: bool) -> dict:
    """GRPOConfig's activation-checkpointing keyword as the installed transformers names it: `activation_checkpointing`
    from transformers 5.23, `gradient_checkpointing` before (the GPU set pins 5.19, which refuses the new name; 5.23 and
    later take the old one with a FutureWarning). As GRPOConfig(**activation_checkpointing(True), ...)."""
    from transformers import TrainingArguments

    renamed = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if renamed else "gradient_checkpointing": on}
