"""Time one training step's phases, GRPO against PODS, with and without prompt sharing.

A measuring tool beside train.py, not part of training: it builds the same model, sampler and update
as `train.py` (its flags, but not those of a whole run such as --m or --steps: UNUSED), runs one untimed
step at full size (warm_up), then draws --prompts-per-step prompts, generates their n rollouts, and runs
the update on the m kept for m = n, n/2 and n/4 (m >= 2), printing a table of seconds per phase, the
update's peak memory and each step's cost relative to GRPO's. It then sets GRPO's update against its arithmetic (the FLOPs of its matrix
products, and the rate this CPU reaches on those products alone at a micro-batch's shape; attention's
score products are left out) and, with the transformers backend, one decode step against its own
(`decode_step_ms`), and prints the gap between the sampler's and the trainer's log-probabilities.
Last, for PODS with m = n/2, the update on the kept groups against the update on the informative ones
alone (`--uniform-groups keep` against `skip`), on the same batches. `--resume --out-dir RUN` starts
from the adapter of RUN's last checkpoint: a trained policy, whose groups are more often uniform.

Usage:
    python benchmark.py --dataset arith --n 8 --prompts-per-step 4
    python benchmark.py --dataset arith:2 --n 8 --prompts-per-step 4 --resume --out-dir runs/pods   # a trained policy
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import config
import data
import distributed
import grpo
import model as models
import pods
import progress
import run_dir
import sampling
import train
import vllm_sampler
from decode import windowed_attention
from update import micro_batches, policy_update, prompt_groups


def peak_memory_mb(fn):
    """(fn's result, the peak memory it added in MiB): CUDA's allocator peak on a GPU; on a CPU the
    process's resident memory, sampled every 5 ms in a thread, above its level at the start (memory
    that earlier work freed is first handed back with glibc's malloc_trim, so it is not reused
    unseen). Without /proc (macOS) it is the growth of the process's peak resident memory, which
    reads 0 when earlier work peaked higher."""
    import ctypes
    import resource
    import threading

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, (torch.cuda.max_memory_allocated() - before) / 2**20

    def rss() -> int:
        if os.path.exists("/proc/self/statm"):  # Linux: the resident memory now
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # elsewhere (macOS: bytes): the peak so far
        return peak_rss if sys.platform == "darwin" else peak_rss * 1024

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): freed memory may be reused unseen
        pass
    before, peak, done = rss(), [0], threading.Event()

    def watch():
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = fn()
    finally:
        done.set()
        watcher.join()
    return result, max(0, max(peak[0], rss()) - before) / 2**20


def snapshot(model, optimizer):
    """A function that puts the trainable weights and the optimizer's state back as they are now: each timed update
    (and the warm-up's) is undone, so every one starts from the policy given, fresh or --resume's (an update per
    variant moved it 7 steps a repeat at n=8)."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights, state = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())

    def restore() -> None:
        with torch.no_grad():
            for p, saved in zip(params, weights):
                p.copy_(saved)
        optimizer.load_state_dict(copy.deepcopy(state))

    return restore


def warm_up(sampler, model, optimizer, scheduler, stream, args: train.Args, pad_id: int) -> None:
    """One untimed step at full size: a generation of --prompts-per-step x n and GRPO's update on it, with
    the prompt per row and shared. First calls pay one-off costs (on a GPU the allocator growing to the
    step's size, the first kernels), which otherwise fall on whichever column runs first (on an H100, per-row
    generation, timed first, read 2x shared's, though the two differ only in the prompt's prefill)."""
    sampler.share_prompt = False
    scored = sampling.generate_and_score(sampler, stream.next_batch(args.prompts_per_step), args.n)
    rollouts, scores = scored.rollouts, scored.rewards
    advantages = grpo.group_advantages(scores.view(-1, args.n)).flatten()
    for share in (False, True):
        policy_update(model, optimizer, scheduler, rollouts, advantages, train.update_settings(dataclasses.replace(args, share_prompt=share)), pad_id)
    sampler.update_weights(model)


def benchmark(args: train.Args, repeats: int = 2) -> list[dict]:
    """Time one step's phases for GRPO (m = n) and PODS (m = n/2, n/4), each with the prompt computed
    once per rollout and once per group (--no-share-prompt / --share-prompt), on the same rollouts.

    Each repeat draws --prompts-per-step prompts and generates their n rollouts twice from the same
    seed, without and with the shared prefill (in float32 the same tokens come out, so the work is the same; a
    bfloat16 copy rounds the two prefills apart, and a line then says how many tokens each drew),
    then runs the update on the m kept by --rule for each m, without and with prompt sharing,
    measuring its peak memory too. Prints the means and the ratios to GRPO's step. m below 2 is left
    out (advantages need two kept rollouts). With vLLM, generation runs once per repeat: vLLM always
    shares prompts (prefix caching) and its noise is not torch's, so the per-row column is for the
    transformers backend only.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.rule == "none":
        raise config.UsageError("--rule none: benchmark.py times GRPO (m = n) beside PODS itself; pass the rule PODS keeps m by")
    args = config.resolve(dataclasses.replace(args, m=args.n), device)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model_name = models.pick_model(args.model, device)
    found = run_dir.found_in(Path(args.out_dir)) if args.resume != "no" else []
    if args.resume == "yes" and not found:
        raise config.UsageError(f"--resume: no checkpoint-STEP directory in {args.out_dir}")
    if found:  # a trained policy: the adapter of --out-dir's last checkpoint, on the model and LoRA shape it trained
        saved = Path(args.out_dir) / "config.json"
        try:
            trained = json.loads(saved.read_text()) if saved.exists() else {}
            if not isinstance(trained, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as err:  # (json's JSONDecodeError is a ValueError)
            raise config.UsageError(f"{saved} cannot be read ({str(err).splitlines()[0][:120]}): copy the run again") from None
        if "model_resolved" in trained:
            run_dir.check_resumed_model(Path(args.out_dir), trained["model_resolved"], model_name)
        for name in ("lora_rank", "lora_alpha"):
            if trained.get(name, getattr(args, name)) != getattr(args, name):
                raise config.UsageError(f"--resume: {args.out_dir} trained with --{name.replace('_', '-')} {trained[name]}; pass it")
    model, tokenizer = models.load_trainable_policy(model_name, device, args.lora_rank, args.lora_alpha, args.bf16_weights,
                                                    args.gradient_checkpointing, args.bf16_autocast,
                                                    args.max_prompt_tokens + args.max_new_tokens)
    if found:
        checkpoint.load_adapter(found[-1], model)
    examples = data.load_examples(args.dataset, "train", seed=args.seed)
    stream = data.PromptStream(examples, lambda question: sampling.build_prompt(tokenizer, question), args.max_prompt_tokens, args.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = train.make_sampler(args, model, tokenizer, device)
    policy = snapshot(model, optimizer)  # every timed update starts from it: the timed policy is the one given
    warm_up(sampler, model, optimizer, scheduler, stream, args, tokenizer.pad_token_id)
    policy()
    sampler.update_weights(model)  # (warm_up handed the sampler its updated adapter: repeat 0 samples the policy given)
    ms = sorted({m for m in (args.n, args.n // 2, args.n // 4) if m >= 2}, reverse=True)
    shares = (False, True)
    windowed = windowed_attention(model)  # a sliding window: the "shared" update and prefill run per row (update.py, sampling.py)
    vllm = isinstance(sampler, vllm_sampler.VLLMSampler)
    generation_shares = (True,) if vllm else shares  # vLLM: generation once, always shared
    gaps = []  # the sampler/trainer log-prob gap of each repeat's first, on-policy update
    gen_s = {share: [] for share in shares}
    upd_s = {(m, share): [] for m in ms for share in shares}
    mem_mb = {(m, share): [] for m in ms for share in shares}
    tokens, update_tokens = {share: [] for share in shares}, {share: [] for share in shares}  # completion tokens; what each update reads
    handover_s = []  # the adapter handed to the sampler after the update, which train.py counts in update_s
    skip_m, uniform_share, skip_s = ms[min(1, len(ms) - 1)], [], []  # keep against skip: PODS m = n/2, the profile's prompt setting
    for repeat in range(repeats):
        batch = stream.next_batch(args.prompts_per_step)
        for share in generation_shares:
            sampler.share_prompt = share
            torch.manual_seed(args.seed + repeat)
            start = time.perf_counter()
            scored = sampling.generate_and_score(sampler, batch, args.n)
            rollouts, scores = scored.rollouts, scored.rewards
            gen_s[share].append(time.perf_counter() - start)
            tokens[share].append(sum(len(r.completion_ids) for r in rollouts))
        for share in shares:
            update_tokens[share].append(tokens_read(rollouts, share and not windowed, args.micro_batch))
        for m in ms:
            run = dataclasses.replace(args, m=m, rule="none" if m == args.n else args.rule)
            kept_idx = train.select(scores, run.rule, run.n, run.m, rng)
            advantages = grpo.group_advantages(scores[kept_idx].view(-1, m)).flatten()
            for share in shares:
                start = time.perf_counter()
                stats, peak = peak_memory_mb(lambda: policy_update(model, optimizer, scheduler, [rollouts[i] for i in kept_idx], advantages,
                                                         train.update_settings(dataclasses.replace(run, share_prompt=share)), tokenizer.pad_token_id))
                upd_s[m, share].append(time.perf_counter() - start)
                mem_mb[m, share].append(peak)
                policy()
                if m == args.n and not share and "sampler_gap_mean" in stats:
                    gaps.append((stats["sampler_gap_mean"], stats["sampler_gap_max"]))
            if m == skip_m:  # --uniform-groups skip: the same update on the informative groups alone
                informative = pods.informative_groups(scores[kept_idx].view(-1, m))
                uniform_share.append(1 - informative.mean())
                rows = [kept_idx[g * m + j] for g in np.flatnonzero(informative) for j in range(m)]
                start = time.perf_counter()  # timed as keep's was, peak_memory_mb's sampling thread included
                if rows:
                    peak_memory_mb(lambda: policy_update(model, optimizer, scheduler, [rollouts[i] for i in rows],
                                                         advantages.view(-1, m)[informative].flatten(), train.update_settings(run),
                                                         tokenizer.pad_token_id))
                skip_s.append(time.perf_counter() - start)
                policy()
        start = time.perf_counter()
        sampler.update_weights(model)  # (the same weights: timed as the hand-over each training step ends with)
        handover_s.append(time.perf_counter() - start)
    rows = []
    for m in ms:
        for share in shares:
            generation, update = float(np.mean(gen_s[share] or gen_s[True])), float(np.mean(upd_s[m, share]) + np.mean(handover_s))
            rows.append({"n": args.n, "m": m, "share_prompt": share, "generation_s": generation, "update_s": update,
                         "step_s": generation + update, "update_peak_mb": float(np.max(mem_mb[m, share]))})
    print(f"\n{model_name} ({f'the adapter of {found[-1]}' if found else 'a fresh adapter'}), {args.prompts_per_step} prompts x "
          f"n={args.n}, {args.max_new_tokens} new tokens, PODS keeping m by {args.rule}, micro-batch {args.micro_batch}, {device}, "
          f"mean of {repeats} (peak memory: the larger); update s includes handing the adapter to the sampler ({np.mean(handover_s):.2f} s), as train.py's"
          + ("; vLLM generates once (it always shares prompts): the prompt column is the update's" if vllm else "")
          + ("; the model has a sliding window, so a shared prompt is computed per row: 'shared' times that" if windowed else ""))
    if not vllm and tokens[False] != tokens[True]:  # (a bfloat16 copy: its rounding differs between the two prefills)
        print(f"generation per row and shared drew other tokens from the same seed: {np.mean(tokens[False]):.0f} and "
              f"{np.mean(tokens[True]):.0f} completion tokens a step")
    print(f"{'method':<18}{'prompt':>10}{'generation s':>14}{'update s':>10}{'step s':>8}{'update peak MiB':>17}{'step/GRPO':>11}")
    grpo_step = rows[0]["step_s"]  # GRPO with the prompt per rollout: the reference
    for row in rows:
        name = f"GRPO n={row['n']}" if row["m"] == args.n else f"PODS n={row['n']} m={row['m']}"
        print(f"{name:<18}{'shared' if row['share_prompt'] else 'per row':>10}{row['generation_s']:>14.1f}{row['update_s']:>10.1f}"
              f"{row['step_s']:>8.1f}{row['update_peak_mb']:>17.0f}{row['step_s'] / grpo_step:>11.2f}")
    print(f"completion tokens per step: {np.mean(tokens[True]):.0f}; GRPO step time per completion token: "
          f"{1000 * grpo_step / float(np.mean(tokens[False] or tokens[True])):.1f} ms with the prompt per rollout, "
          f"{1000 * rows[1]['step_s'] / float(np.mean(tokens[True])):.1f} ms shared")
    keep_s = np.mean(upd_s[skip_m, args.share_prompt])
    print(f"--uniform-groups, {'GRPO' if skip_m == args.n else 'PODS'} n={args.n} m={skip_m}, prompt {'shared' if args.share_prompt else 'per row'}: "
          f"{np.mean(uniform_share):.2f} of the kept groups uniform; update {keep_s:.2f} s keeping them (keep), {np.mean(skip_s):.2f} s "
          f"without them (skip), {np.mean(skip_s) / keep_s:.2f}x")
    if gaps:
        print(f"sampler/trainer |log p| gap per completion token: mean {np.mean([g[0] for g in gaps]):.4f}, "
              f"max {np.max([g[1] for g in gaps]):.4f} (each repeat's on-policy update)")
    layer_params, head_params = linear_params(model)
    steps = len(micro_batches(rollouts, args.micro_batch))  # forward/backward passes of GRPO's update
    computing = sampler.model if getattr(sampler, "merged", False) else model  # the dtype the update computes in
    arithmetic_s = {}  # GRPO's update at its matmul rate, per row and shared
    reference = int(args.beta > 0)  # --beta: the reference model's forward (the adapter off) in each micro-batch
    passes = (3 if args.gradient_checkpointing else 2) + reference  # forward, backward to the inputs, the layers' forward again
    for share, row in zip(shares, rows[:2]):  # GRPO's update (m = n), per row and shared
        read, head = (float(np.mean([counts[i] for counts in update_tokens[share]])) for i in (0, 1))
        gflop = 2 * (passes * layer_params * read + (2 + reference) * head_params * head) / 1e9
        rows_per_pass, update_alone = round(read / steps), float(np.mean(upd_s[args.n, share]))  # (without the hand-over)
        rate = 2 * (layer_params + head_params) * rows_per_pass / matmuls_ms(computing, rows_per_pass) / 1e6  # GFLOP/s
        print(f"GRPO update, prompt {'shared' if share else 'per row'}: {gflop:.3g} GFLOP in its matrix products ({read:.0f} "
              f"positions through the layers, {head:.0f} through the LM head, padding included; forward and backward"
              f"{', the layers recomputed' if args.gradient_checkpointing else ''}{', the reference forward' if reference else ''}; "
              f"LoRA's not counted); at the {rate:.0f} GFLOP/s "
              f"its layers reach alone at a micro-batch's shape that is {gflop / rate:.2g} s: measured {update_alone:.2g} s (without "
              f"the hand-over), "
              f"{update_alone / (gflop / rate):.1f}x its arithmetic")
        arithmetic_s[share] = gflop / rate, rate
    if not vllm:
        rows_per_step = 32
        tuned = decode_step_ms(sampler, batch[0][0], rows_per_step)
        plain = decode_step_ms(train.make_sampler(dataclasses.replace(args, merged_sampler=False), model, tokenizer, device),
                               batch[0][0], rows_per_step)
        params = sum(p.numel() for p in sampler.model.parameters())
        floor = matmuls_ms(sampler.model, rows_per_step)
        copy = f" (merged {str(sampler.merged_dtype).removeprefix('torch.')} copy)" if sampler.merged else ""
        print(f"decode step at {rows_per_step} rows ({len(batch[0][0])}-token prompt): {tuned:.0f} ms with the training sampler"
              f"{copy}, {plain:.0f} ms sampling the trained model itself; "
              f"its arithmetic ({2 * params * rows_per_step / 1e9:.1f} GFLOP): the same matrix products alone take "
              f"{floor:.0f} ms, so the step is {tuned / floor:.1f}x its arithmetic")
        # the whole step, prompt shared: generation = each prompt's prefill at the update's rate, then each generate call
        # (--gen-batch rows, whole groups) as many decode steps as its longest completion, at its rows' matmul rate
        update_arithmetic, rate = arithmetic_s[True]
        per_call = min(len(rollouts), max(1, args.gen_batch // args.n) * args.n)
        calls = [(max(len(r.completion_ids) for r in rollouts[i:i + per_call]), len(rollouts[i:i + per_call]))
                 for i in range(0, len(rollouts), per_call)]  # (decode steps, rows) of each generate call
        floors = {rows_per_step: floor} | {rows: matmuls_ms(sampler.model, rows) for rows in {rows for _, rows in calls} - {rows_per_step}}
        decode_steps = sum(steps for steps, _ in calls)
        generation_arithmetic = (2 * layer_params * sum(len(prompt) for prompt, _ in batch) / (rate * 1e9)
                                 + sum(steps * floors[rows] for steps, rows in calls) / 1000)
        measured = rows[1]
        print(f"GRPO step, prompt shared: {measured['step_s']:.1f} s (generation {measured['generation_s']:.1f}, update "
              f"{measured['update_s']:.1f}); its arithmetic {generation_arithmetic + update_arithmetic:.2g} s (generation "
              f"{generation_arithmetic:.2g}: {len(batch)} prefills, {decode_steps} decode steps of up to {per_call} rows; update "
              f"{update_arithmetic:.2g}): {measured['step_s'] / (generation_arithmetic + update_arithmetic):.1f}x")
    return rows


def tokens_read(rollouts: list, share_prompt: bool, micro_batch: int) -> tuple[int, int]:
    """(positions through the decoder layers, positions through the LM head) of the update, as update.py builds its
    micro-batches: each row padded to the longest prompt plus the longest completion, and C + 1 positions of the head
    per row; with the prompt shared, each group piece one row of its prompt and its completions packed behind it
    (update.micro_batches, update.shared_prompt_logprobs)."""
    layers = head = 0
    for piece in micro_batches(rollouts, micro_batch):
        batch = [rollouts[i] for i in piece]
        prompt = max(len(r.prompt_ids) for r in batch)
        if share_prompt:
            groups = prompt_groups(batch)
            packed = prompt + max(sum(len(batch[i].completion_ids) for i in group) for group in groups)
            layers, head = layers + len(groups) * packed, head + len(groups) * (packed - prompt + 1)
        else:
            completion = max(len(r.completion_ids) for r in batch)
            layers, head = layers + len(batch) * (prompt + completion), head + len(batch) * (completion + 1)
    return layers, head


def linear_params(model) -> tuple[int, int]:
    """Weights in the decoder layers' linear maps (the LoRA factors left out: 5-7% of the update's work at rank 16 on
    the embedded model), and in the LM head."""
    head = model.get_output_embeddings().weight
    layers = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and m.weight is not head and "lora_" not in name)
    return layers, head.numel()


def decode_step_ms(sampler, prompt: list[int], rows: int, steps: int = 32, repeats: int = 3) -> float:
    """Milliseconds per decode step of a transformers sampler at `rows` rows of one prompt: the time
    to generate steps + 1 tokens minus the time to generate 1 (prefill and first sample), over
    `steps`, with no stop token, so every row decodes every step. The best of `repeats`."""
    stops, limit = sampler.stops, sampler.max_new_tokens
    sampler.stops = set()
    try:
        best = float("inf")
        for _ in range(repeats):
            times = []
            for tokens in (1, steps + 1):
                sampler.max_new_tokens = tokens
                start = time.perf_counter()
                sampler.generate([prompt], rows)
                times.append(time.perf_counter() - start)
            best = min(best, (times[1] - times[0]) / steps * 1000)
        return best
    finally:
        sampler.stops, sampler.max_new_tokens = stops, limit


def matmuls_ms(model, rows: int, repeats: int = 3) -> float:
    """Milliseconds for the matrix products of one decode step alone: `rows` rows through every linear
    layer of `model` (the LM head included), in the layer's dtype, with nothing else. The floor a
    decode step would reach with no overhead at all. The best of `repeats`."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    sync = torch.cuda.synchronize if weights[0].is_cuda else lambda: None  # a GPU runs them after Python returns
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)
            sync()
            best = min(best, time.perf_counter() - start)
    return best * 1000


UNUSED = {  # train.py's flags that have no meaning for one timed step: refused, not silently ignored
    "m": "benchmark.py times m = n, n/2 and n/4 (m >= 2) itself",
    "vllm_sleep": "benchmark.py times generation and the update with vLLM awake",
    **dict.fromkeys(("steps", "time_budget", "save_every_steps", "save_every_minutes", "max_skipped_steps", "warmup_ratio"),
                    "benchmark.py times single steps at a constant learning rate and saves nothing"),
    **dict.fromkeys(("uniform_groups", "max_refill_rounds"), "benchmark.py times --uniform-groups keep against skip itself"),
}

HELPS = {"out_dir": "with --resume: the run whose last checkpoint's adapter is timed (benchmark.py writes nothing)",
         "resume": "time the adapter of --out-dir's last checkpoint (a trained policy): yes (bare --resume) | auto (if any) | no"}


def main(argv: list[str] | None = None) -> int:
    """train.py's flags (config.parse_args over train.Args) but those in UNUSED; a bad one exits 2 with one line, as train.py's do."""
    args = config.parse_args(train.Args, sys.argv[1:] if argv is None else argv, __doc__.split("\n")[0], UNUSED, HELPS)
    try:
        world = distributed.world_from_env()
    except distributed.LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if world.launched:  # each rank would time the whole batch on its own, all on one GPU
        progress.say_at_exit("error: benchmark.py times one process; run it with python, not torchrun", world)
        return 2
    if os.path.normpath(args.out_dir) != os.path.normpath(train.Args.out_dir) and args.resume == "no":  # it writes nothing
        print(f"error: --out-dir {args.out_dir} is read only with --resume (its last checkpoint's adapter is timed); "
              f"add --resume, or leave --out-dir out", file=sys.stderr)
        return 2
    try:
        benchmark(args)
    except (config.UsageError, data.DataError, models.SetupError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (the figures print at the end: none was finished)
        print("interrupted: benchmark.py prints its figures once every phase is timed, so none was; it writes nothing",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
