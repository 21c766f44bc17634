"""Update time of TRL's GRPOTrainer against trl_pods.PODSGRPOTrainer on CPU: what keeping m of n saves.

TRL is optional; run it in the venv of requirements-trl.txt, on an idle machine:

    .venv-trl/bin/python reproduce/bench/bench_trl_pods.py                    # embedded SmolLM2-135M, 6 steps per configuration
    .venv-trl/bin/python reproduce/bench/bench_trl_pods.py --max-steps 1 --warmup-steps 0 --model DIR   # smoke test

Three configurations run back to back in one process, each from the same fresh model and seed: TRL GRPO
(all n = 8 rollouts of each prompt trained on), then PODS (max_variance) keeping m = 4 and m = 2. Each step
generates 4 prompts x 8 rollouts of at most 32 new tokens (the CPU preset of reproduce/bench/bench_trl.py: LoRA r=16 on
all projections, fp32, lr 1e-4, beta 0, one update per generation, so no old/reference log-prob passes) and
trains on them in gradient_accumulation_steps = 32 / --micro-batch micro-batches; PODS's micro-batches hold
m/n as many rollouts. loss_type="grpo" (grpo.grpo_loss's normalization).

"update s" is a step's wall time (TrainerCallback.on_step_begin to on_step_end, the optimizer step
included) minus the time inside TRL's _generate_and_score_completions (generation, rewards, advantages);
PODS's selection counts as update. Step 1 (warm-up) is left out of the means. Generation is random, so
completion lengths differ between configurations; "update ms/token" divides the update time by the
completion tokens the loss saw (kept rows only), to tell length differences from the m/n saving. (On a
CPU, trl 1.16's fused LM head scores every prompt position too, so the time is not all per completion token.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: everything is loaded from local paths
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# peft 0.21 and trl 1.16 read transformers 5.23's deprecated is_gradient_checkpointing (at wrapping and every generation)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import model as models

PROMPTS_PER_STEP, N = 4, 8
CONFIGS = [("TRL GRPO", N), ("PODS", 4), ("PODS", 2)]  # (trainer, m); m = n is TRL's own GRPOTrainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=6, help="optimizer steps per configuration")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the means")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="generated rollouts per micro-batch (per_device_train_batch_size): 4, 8, 16 or 32 (it divides "
                        "32, and m=2 keeps a quarter of it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=models.EMBEDDED, help="a model directory, or 'embedded' (SmolLM2-135M-Instruct)")
    p.add_argument("--out-dir", default="/tmp/trl-pods-bench-out")
    return p.parse_args()


def timed_trainers():
    """GRPOTrainer and PODSGRPOTrainer that add up the seconds spent in TRL's _generate_and_score_completions
    and the completion tokens their loss sees."""
    from trl import GRPOTrainer

    from trl_pods import PODSGRPOTrainer

    class Timed(GRPOTrainer):
        generation_s, trained_tokens = 0.0, 0

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generation_s += time.perf_counter() - start

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.trained_tokens += int(inputs["completion_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    class TimedPODS(PODSGRPOTrainer, Timed):  # PODS's selection runs outside Timed's clock: it counts as update
        pass

    return Timed, TimedPODS


def run(name: str, m: int, args, model_path: str) -> list[dict]:
    from peft import LoraConfig
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )
    from trl import GRPOConfig

    import trl_pods

    accumulation = PROMPTS_PER_STEP * N // args.micro_batch
    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, bf16=False, fp16=False,
        **trl_pods.activation_checkpointing(False),  # off, by the name this transformers takes (TRL defaults it on)
        learning_rate=1e-4, max_steps=args.max_steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation, num_generations=N, num_iterations=1, beta=0.0, loss_type="grpo",
        max_completion_length=args.max_new_tokens, temperature=0.9, top_p=1.0, top_k=0, use_vllm=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
    )
    Timed, TimedPODS = timed_trainers()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    common = {"model": model, "reward_funcs": trl_pods.task_reward, "args": config, "train_dataset": trl_pods.task_dataset("arith", count=200),
              "processing_class": AutoTokenizer.from_pretrained(model_path), "peft_config": lora}
    trainer = Timed(**common) if m == N else TimedPODS(**common, m=m)
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            self.start, self.generation_s, self.tokens = time.perf_counter(), trainer.generation_s, trainer.trained_tokens

        def on_step_end(self, args_, state, control, **kwargs):
            total = time.perf_counter() - self.start
            generation = trainer.generation_s - self.generation_s
            steps.append({"step": state.global_step, "update_s": total - generation, "generation_s": generation,
                          "tokens": trainer.trained_tokens - self.tokens})
            print(f"[bench] {name} m={m} step {state.global_step}: update {total - generation:.2f} s, "
                  f"generation {generation:.2f} s, {steps[-1]['tokens']} trained completion tokens", flush=True)

    trainer.remove_callback(PrinterCallback)  # TRL's per-step log dicts: this script prints its own lines
    trainer.add_callback(StepTimer())
    trainer.train()
    return steps


def main() -> int:
    args = parse_args()
    if args.micro_batch not in (4, 8, 16, 32):
        sys.exit(f"--micro-batch {args.micro_batch} must be 4, 8, 16 or 32")
    if not 0 <= args.warmup_steps < args.max_steps:
        sys.exit(f"--warmup-steps {args.warmup_steps} must be below --max-steps {args.max_steps}")
    if args.max_new_tokens < 1:
        sys.exit(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.threads < 0:
        sys.exit(f"--threads {args.threads} must be >= 0 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import trl

    transformers.logging.set_verbosity_error()
    try:
        model_path = models.local_model_path(args.model)
    except models.SetupError as err:  # a directory that is not there, a hub name offline
        sys.exit(f"error: {err}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{torch.get_num_threads()} threads, model {model_path}")
    results = [(name, m, run(name, m, args, model_path)[args.warmup_steps:]) for name, m in CONFIGS]

    print(f"\n{PROMPTS_PER_STEP} prompts x n={N} rollouts, {args.max_new_tokens} new tokens, micro-batch {args.micro_batch} "
          f"generated rollouts; means over steps {args.warmup_steps + 1}..{args.max_steps}")
    print(f"{'trainer':<10} {'m':>3} {'update s/step':>14} {'generation s/step':>18} {'trained tokens/step':>20} "
          f"{'update ms/token':>16} {'update speed-up':>16}")
    baseline = statistics.mean(s["update_s"] for s in results[0][2])
    for name, m, steps in results:
        update = statistics.mean(s["update_s"] for s in steps)
        tokens = statistics.mean(s["tokens"] for s in steps)
        print(f"{name:<10} {m:>3} {update:>14.2f} {statistics.mean(s['generation_s'] for s in steps):>18.2f} "
              f"{tokens:>20.0f} {1000 * update / max(tokens, 1):>16.1f} {baseline / update:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
