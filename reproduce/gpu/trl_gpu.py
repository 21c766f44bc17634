"""TRL's GRPOTrainer configured as train.py's GPU profile, timed as train.py times its steps: the GPU check's trl
stage (check.sh). One GPU, transformers generation (no vLLM), bfloat16 base weights, activation checkpointing,
LoRA r64/alpha 64 on the seven projections, micro-batch 4, one prompt x n rollouts a step, beta 0, the paper's
loss normalization, learning rate 5e-6, clipping 0.1, temperature 0.9; train.py's prompt and reward
(trl_pods.task_dataset, trl_pods.task_reward). Run from the repository root:
    python3 reproduce/gpu/trl_gpu.py --model DIR --dataset gsm8k --n 32 --max-new-tokens 512 --steps 3 --out-dir /tmp/trl
It writes OUT_DIR/metrics.jsonl, a row per optimizer step with train.py's keys (step, elapsed_s, generation_s,
update_s, completion_len), and prints torch.cuda's peak memory as peak.py does. On a CPU it runs too, as a dry run
of the stage (test_gpu_check.py), with every memory figure 0.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts it (nothing to wait for on a CPU: a dry run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock(TrainerCallback):
    """Each optimizer step's seconds, from its start to its end, and the share of them TRL's generation took
    (`timed`), written as a train.py metrics row."""

    def __init__(self, metrics_file, n: int):
        self.metrics_file, self.n, self.elapsed_s = metrics_file, n, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self.start, self.generation_s, self.lengths = time.perf_counter(), 0.0, []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        step_s = time.perf_counter() - self.start
        self.elapsed_s += step_s
        row = {"step": state.global_step, "elapsed_s": round(self.elapsed_s, 3), "generation_s": round(self.generation_s, 3),
               "update_s": round(step_s - self.generation_s, 3), "completion_len": sum(self.lengths) / max(1, len(self.lengths)),
               "n": self.n}
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        print("STEP", json.dumps(row), flush=True)

    def timed(self, generate_and_score):
        """TRL's _generate_and_score_completions, adding its seconds and completion lengths to this step's."""
        def generate_and_score_timed(inputs):
            synchronize()
            start = time.perf_counter()
            batch = generate_and_score(inputs)
            synchronize()
            self.generation_s += time.perf_counter() - start
            self.lengths += batch["completion_mask"].sum(dim=1).tolist()
            return batch
        return generate_and_score_timed


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory or a hub name")
    parser.add_argument("--dataset", default="gsm8k", help="what train.py --dataset takes: gsm8k or a GSM8K-style .jsonl")
    parser.add_argument("--n", type=int, default=32, help="rollouts per prompt (num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (max_steps)")
    parser.add_argument("--out-dir", required=True, help="TRL's output_dir, where metrics.jsonl goes")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    import trl_pods
    from peak import PhasePeaks

    config = GRPOConfig(output_dir=args.out_dir, num_generations=args.n, per_device_train_batch_size=4,
                        gradient_accumulation_steps=args.n // 4, max_completion_length=args.max_new_tokens, temperature=0.9,
                        learning_rate=5e-6, max_grad_norm=0.1, beta=0.0, loss_type="grpo", bf16=True,
                        use_cpu=not torch.cuda.is_available(),  # a dry run on a CPU (test_gpu_check.py)
                        model_init_kwargs={"dtype": torch.bfloat16}, **trl_pods.activation_checkpointing(True),
                        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(Path(args.out_dir) / "metrics.jsonl", "w") as metrics_file:
        clock = Clock(metrics_file, args.n)
        trainer = GRPOTrainer(model=args.model, reward_funcs=trl_pods.task_reward, args=config,
                              train_dataset=trl_pods.task_dataset(args.dataset, count=200), callbacks=[clock],
                              peft_config=LoraConfig(r=64, lora_alpha=64, target_modules="all-linear", task_type="CAUSAL_LM"))
        trainer._generate_and_score_completions = clock.timed(trainer._generate_and_score_completions)
        print(f"TRL trainer built in {time.time() - start:.0f} s", flush=True)
        trainer.train()
    print(f"TRL done after {time.time() - start:.0f} s; {PhasePeaks(cuda=torch.cuda.is_available()).line()}")


if __name__ == "__main__":
    main(sys.argv[1:])
