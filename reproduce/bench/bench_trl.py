"""Speed benchmark of TRL's GRPOTrainer on CPU: the reference point for `benchmark.py`.

TRL is not a dependency of this project; measure it in a venv of its own (docs/speed.md):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 "trl==1.16.*" peft transformers datasets
    .venv-trl/bin/python reproduce/bench/bench_trl.py                  # 6 optimizer steps (run `python sampling.py` once first)
    .venv-trl/bin/python reproduce/bench/bench_trl.py --max-steps 3    # quick smoke test

Configuration matched to our trainer's CPU preset: SmolLM2-135M-Instruct (fp32), LoRA r=16 / alpha=32 on all
attention + MLP projections, 4 prompts x 8 generations = 32 completions per optimizer step, max 32 new tokens,
temperature 0.9, lr 1e-4 (the CPU preset's value when this was measured; the rate does not change a step's time), beta=0 (no reference model), num_iterations=1, plain transformers .generate (no vLLM),
no gradient checkpointing, no bf16.

Batch bookkeeping in TRL 1.16 (see trl/trainer/grpo_config.py __post_init__):
  * per_device_train_batch_size counts COMPLETIONS per forward/backward micro-batch (not prompts);
  * generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation;
  * steps_per_generation defaults to gradient_accumulation_steps.
So with micro-batch B (default 8), gradient_accumulation_steps = steps_per_generation = 32 / B: each optimizer
step generates exactly one batch of 32 completions (4 prompts x 8) in a single .generate call and consumes it in
32/B micro-batches. Because gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0, TRL skips
the extra old-logprob forward pass (old = current, detached), as our trainer does.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: everything is loaded from local paths
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from model import CACHE_DIR  # noqa: E402  (where train.py caches the embedded model)
from rewards import SYSTEM_PROMPT  # noqa: E402  (the same prompt train.py uses)

MODEL_PATH = str(CACHE_DIR / "SmolLM2-135M-Instruct")  # the embedded model, as train.py caches it

PROMPTS_PER_STEP = 4
NUM_GENERATIONS = 8
COMPLETIONS_PER_STEP = PROMPTS_PER_STEP * NUM_GENERATIONS  # 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=6, help="optimizer steps (step 1 is excluded from the means)")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="completions per forward/backward pass (per_device_train_batch_size); must divide 32. "
                        "8 matches our trainer's CPU micro_batch; 32 = one pass per step")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave torch's default)")
    p.add_argument("--n-prompts", type=int, default=200, help="dataset size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=MODEL_PATH)
    p.add_argument("--out-dir", default="/tmp/trl-bench-out")
    return p.parse_args()


def build_dataset(n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows["prompt"].append([
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ])
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)


_NUMBER = re.compile(r"-?\d+")
# Exact completion-token counts seen by the reward function during the current step (cross-check for mean_length).
_tokens_seen: list[int] = []


def last_number_reward(prompts, completions, answer, completion_ids=None, **kwargs) -> list[float]:
    """1.0 if the last number in the completion text equals the answer, else 0.0."""
    if completion_ids is not None:
        _tokens_seen.append(sum(len(ids) for ids in completion_ids))
    rewards = []
    for completion, ans in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = _NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == ans else 0.0)
    return rewards


def main() -> int:
    args = parse_args()
    if COMPLETIONS_PER_STEP % args.micro_batch:
        sys.exit(f"--micro-batch must divide {COMPLETIONS_PER_STEP}")
    if args.threads:
        torch.set_num_threads(args.threads)

    import peft
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"peft {peft.__version__}")
    print(f"torch.get_num_threads() = {torch.get_num_threads()}, os.cpu_count() = {os.cpu_count()}")

    accum = COMPLETIONS_PER_STEP // args.micro_batch
    config = GRPOConfig(
        output_dir=args.out_dir,
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults bf16 to True (unless fp16): force fp32
        fp16=False,
        gradient_checkpointing=False,  # GRPOConfig defaults this to True; our trainer's CPU preset has it off
        learning_rate=1e-4,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.micro_batch,  # completions (not prompts) per micro-batch
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,  # => generation_batch_size = micro_batch * accum = 32
        num_generations=NUM_GENERATIONS,
        num_iterations=1,
        beta=0.0,
        max_completion_length=32,
        temperature=0.9,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    assert config.generation_batch_size == COMPLETIONS_PER_STEP, config.generation_batch_size
    assert config.steps_per_generation == config.gradient_accumulation_steps

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")

    class StepTimer(TrainerCallback):
        """Wall-clock per optimizer step: on_step_begin (before generation) .. on_step_end (after optimizer.step)."""

        def __init__(self):
            self.t0 = None
            self.rows: list[dict] = []

        def on_step_begin(self, args_, state, control, **kw):
            _tokens_seen.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            seconds = time.perf_counter() - self.t0
            self.rows.append({"step": state.global_step, "seconds": seconds, "tokens_exact": sum(_tokens_seen)})

        def on_log(self, args_, state, control, logs=None, **kw):
            if not logs or "completions/mean_length" not in logs or not self.rows:
                return
            row = self.rows[-1]
            if row["step"] != state.global_step or "mean_length" in row:
                return
            row["mean_length"] = logs["completions/mean_length"]
            row["tokens"] = row["mean_length"] * COMPLETIONS_PER_STEP
            row["reward"] = logs.get("reward")
            row["trl_step_time"] = logs.get("step_time")
            print(f"[bench] step {row['step']}: {row['seconds']:.2f} s/step | completions/mean_length "
                  f"{row['mean_length']:.2f} -> {row['tokens']:.0f} completion tokens (exact {row['tokens_exact']}) | "
                  f"{row['seconds'] / max(row['tokens'], 1e-9) * 1000:.1f} ms/token | reward {row['reward']} | "
                  f"TRL step_time {row['trl_step_time']}", flush=True)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=last_number_reward,
        args=config,
        train_dataset=build_dataset(args.n_prompts, args.seed),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[timer],
    )
    print(f"device {trainer.args.device}, model dtype {next(trainer.model.parameters()).dtype}, "
          f"per_device_train_batch_size {config.per_device_train_batch_size}, gradient_accumulation_steps "
          f"{config.gradient_accumulation_steps}, steps_per_generation {config.steps_per_generation}, "
          f"generation_batch_size {config.generation_batch_size}, num_generations {config.num_generations}, "
          f"gradient_checkpointing {config.gradient_checkpointing}, bf16 {config.bf16}")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"trainable (LoRA) parameters: {trainable:,}", flush=True)

    t_start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t_start

    rows = timer.rows
    measured = [r for r in rows if r["step"] >= 2]
    print("\n[bench] summary")
    print(f"[bench] torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"[bench] steps run: {len(rows)}, trainer.train() wall time {total:.1f} s")
    for r in rows:
        print(f"[bench]   step {r['step']}: {r['seconds']:.2f} s, mean_length {r.get('mean_length', float('nan')):.2f}, "
              f"tokens {r.get('tokens', float('nan')):.0f} (exact {r['tokens_exact']})")
    if measured:
        secs = [r["seconds"] for r in measured]
        toks = [r.get("tokens", r["tokens_exact"]) for r in measured]
        print(f"[bench] mean seconds/step over steps 2..{rows[-1]['step']}: {statistics.mean(secs):.3f} "
              f"(min {min(secs):.3f}, max {max(secs):.3f})")
        print(f"[bench] mean completion tokens/step over steps 2..{rows[-1]['step']}: {statistics.mean(toks):.1f}")
        print(f"[bench] mean seconds per completion token (sum s / sum tokens, steps 2..{rows[-1]['step']}): "
              f"{sum(secs) / sum(toks):.5f} ({sum(toks) / sum(secs):.1f} tokens/s)")
    else:
        print("[bench] only one step ran: nothing left after excluding warm-up step 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
