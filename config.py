"""The run's configuration: the GPU and CPU profiles that fill train.py's unset flags, the command
line, and the checks that turn a bad combination into one line (UsageError) before anything loads.

`Args` itself (every flag, with its help) is at the top of train.py. Fields left at None there take
the profile of the device: on a GPU the authors' released single-GPU configuration, on a CPU one sized
for the embedded 135M model. docs/defaults.md gives the reasons and measurements behind each default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os

import torch

import data
import distributed
import model
import vllm_sampler

log = logging.getLogger("pods")

RULES = ("max_variance", "max_reward", "random", "none")
RESUME_MODES = ("no", "yes", "auto")
UNIFORM_GROUPS = ("keep", "skip", "refill")  # --uniform-groups: what a step does with groups whose kept rewards are all equal
MAX_SEED = 2**31  # --seed below it: ranks and eval's repeats add to it, and vLLM seeds numpy (32-bit) with it

PROFILES = {
    "gpu": dict(prompts_per_step=1, max_new_tokens=512, lr=5e-6, lora_rank=64, lora_alpha=64, micro_batch=4, steps=1000, time_budget=0.0,
                gradient_checkpointing=True, bf16_autocast=False, bf16_weights=True, merged_sampler=True, share_prompt=False),
    "cpu": dict(prompts_per_step=4, max_new_tokens=32, lr=3e-4, lora_rank=16, lora_alpha=32, micro_batch=8, steps=100, time_budget=0.0,
                gradient_checkpointing=False, bf16_autocast=True, bf16_weights=False, merged_sampler=True, share_prompt=True),
}
BFLOAT16_FLAGS = ("bf16_autocast",)  # off in the CPU profile where the CPU emulates bfloat16 (the merged copy is then float32)
VLLM_FLAGS = ("gpu_memory_utilization", "vllm_kv_cache_gb", "vllm_enforce_eager", "vllm_sleep")  # refused where vLLM is not used
PRECISION_FLAGS = (*BFLOAT16_FLAGS, "merged_sampler", "bf16_weights", "cuda_graph")  # --resume warns when they change (rounding)


def flag_text(name: str, on: bool) -> str:
    """A boolean setting as its command-line flag: flag_text("bf16_autocast", False) == "--no-bf16-autocast"."""
    return f"--{'' if on else 'no-'}{name.replace('_', '-')}"


def profile(device: str) -> dict:
    """The defaults for `device`: PROFILES, with bfloat16 off on a CPU that emulates it (no AVX-512 BF16
    or AMX: float32 is several times faster there; model.computes_bfloat16)."""
    if device == "cuda":
        return PROFILES["gpu"]
    if model.computes_bfloat16(device):
        return PROFILES["cpu"]
    return {**PROFILES["cpu"], **{k: False for k in BFLOAT16_FLAGS}}


# flags that may name a file or directory: a leading "~" is the home directory (the shell leaves "--out-dir=~/runs" as typed)
PATH_FLAGS = ("model", "dataset", "out_dir")
UNBOUNDED = ("max_grad_norm", "clip_eps", "clip_eps_high", "tis_cap")  # inf: no clipping, no cap on the importance weight


class UsageError(ValueError):
    """A bad command line; the message says what to change."""


class Parser(argparse.ArgumentParser):
    """argparse, its errors in one line (exit 2) instead of after the whole usage: `--lr abc` put 40 lines before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(args_class, argv: list[str] | None = None, description: str = "", unused: dict[str, str] | None = None,
               helps: dict[str, str] | None = None):
    """An `args_class` (a dataclass such as train.Args) from the command line: each field a --flag, its
    metadata["help"] (or `helps`' text for it) the help text, then its default in brackets; booleans take
    --flag/--no-flag, --resume alone means yes. `unused` maps fields a tool does not read to the reason: their flags
    are left out of --help and refused in one line (exit 2) instead of being ignored; the fields keep their defaults."""
    parser = Parser(description=description)
    unused, helps = unused or {}, helps or {}
    for f in dataclasses.fields(args_class):
        flag = "--" + f.name.replace("_", "-")
        if f.name in unused:  # any value, even a bad one, is refused for the flag itself
            parser.add_argument(flag, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        shown = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
        described = helps.get(f.name, f.metadata["help"])
        text = described + ("" if f.default is None else f" [{shown}]")  # None: the profile's, in its help
        if f.name == "resume":  # --resume alone means yes
            parser.add_argument(flag, nargs="?", const="yes", default=f.default, choices=RESUME_MODES, help=described)
        elif f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            kind = {"int": int, "float": float, "str": path_arg if f.name in PATH_FLAGS else str}[f.type.split(" ")[0]]
            parser.add_argument(flag, type=kind, default=f.default, help=text)
    parsed = vars(parser.parse_args(argv))
    for name in unused:
        if name in parsed:
            parser.exit(2, f"{parser.prog}: error: --{name.replace('_', '-')} is not used here: {unused[name]}\n")
    return args_class(**parsed)


def path_arg(text: str) -> str:
    """A path flag's value: a leading "~" expanded (the shell leaves "--out-dir=~/x" as typed); an empty one refused
    ("--out-dir $OUT" with $OUT unset wrote the run into the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a path")
    return os.path.expanduser(text)


def resolve(args, device: str, world_size: int = 1):
    """Fill the None fields from the device's profile and --backend auto with the backend it picks, and check the
    combination (and that the prompts of a step divide among `world_size` processes)."""
    filled = {k: v for k, v in profile(device).items() if getattr(args, k) is None}
    forced = [flag_text(k, True) for k in BFLOAT16_FLAGS if getattr(args, k) and not model.computes_bfloat16(device)]
    if args.dataset == "auto":  # the paper's task on a GPU; offline on a CPU, the task the embedded model can learn
        filled["dataset"] = data.GSM8K if device == "cuda" else data.ARITH
    args = dataclasses.replace(args, **filled)
    data.check_dataset_file(args.dataset)  # (before any line is logged: a command with an error gets the error alone)
    for name, value in vars(args).items():  # NaN would pass every check below; inf is a limit left off, no rate or size
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value) and name not in UNBOUNDED):
            raise UsageError(f"--{name.replace('_', '-')} {value} must be a {'number' if math.isnan(value) else 'finite number'}")
    for name, value in vars(args).items():  # 2^63 overflowed torch after the model had loaded (a traceback, a run left behind)
        if isinstance(value, int) and not isinstance(value, bool) and value >= MAX_SEED and name != "seed":
            raise UsageError(f"--{name.replace('_', '-')} {value} is too large (at most {MAX_SEED - 1})")
    if args.rule not in RULES:
        raise UsageError(f"unknown --rule {args.rule!r}; choose one of {', '.join(RULES)}")
    if args.n < 2:
        raise UsageError(f"--n {args.n} must be >= 2 (advantages need a group)")
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    if args.rule == "none":
        if args.m not in (args.n, defaults["m"]):  # a --m given (the default's 16 is not the user's)
            log.info("--rule none trains on all n=%d rollouts (vanilla GRPO); --m %d is not used", args.n, args.m)
        args = dataclasses.replace(args, m=args.n)
    if args.m > args.n:
        raise UsageError(f"--m {args.m} must be <= --n {args.n}: PODS keeps m of the n rollouts it generates")
    if args.m < 2:
        raise UsageError(f"--m {args.m} must be >= 2: the advantage divides by the std of the kept rewards")
    if args.m == args.n and args.rule != "none":  # e.g. --n 16 alone, with --m's default of 16
        log.info("--m %d equals --n: every rollout is kept, so each step is vanilla GRPO's; pass a smaller --m for PODS", args.m)
    if args.uniform_groups not in UNIFORM_GROUPS:
        raise UsageError(f"unknown --uniform-groups {args.uniform_groups!r}; choose one of {', '.join(UNIFORM_GROUPS)}")
    if args.backend not in ("auto", "vllm", "hf"):
        raise UsageError(f"unknown --backend {args.backend!r}; choose vllm, hf or auto")
    vllm = vllm_sampler.uses_vllm(args.backend, device)  # --backend vllm without vLLM: said now, not once the model has loaded
    if args.temperature <= 0:
        raise UsageError(f"--temperature {args.temperature} must be > 0: GRPO samples its rollouts")
    if vllm and args.temperature < 0.01:  # vLLM samples at 0.01 when asked for less, and the update would score at the flag's
        raise UsageError(f"--temperature {args.temperature} is below vLLM's lowest, 0.01; raise it or pass --backend hf")
    if args.beta < 0:
        raise UsageError(f"--beta {args.beta} must be >= 0")
    check_optimizer_flags(args)
    if args.tis_cap < 0 or (0 < args.tis_cap < 1):
        raise UsageError(f"--tis-cap {args.tis_cap} must be 0 (off) or >= 1 (a cap below 1 would shrink every token's weight)")
    for name in ("prompts_per_step", "max_new_tokens", "max_prompt_tokens", "micro_batch", "steps", "lora_rank", "lora_alpha",
                 "gen_batch", "max_skipped_steps", "max_refill_rounds"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("seed", "time_budget", "save_every_steps", "save_every_minutes"):  # 0: no limit, or off
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0")
    if args.max_refill_rounds != defaults["max_refill_rounds"] and args.uniform_groups != "refill":
        raise UsageError(f"--max-refill-rounds is used by --uniform-groups refill only (this run: {args.uniform_groups}); "
                         f"leave it out or pass --uniform-groups refill")
    if args.seed >= MAX_SEED:
        raise UsageError(f"--seed {args.seed} must be < 2^31 = {MAX_SEED}")
    if args.prompts_per_step % world_size:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} does not divide among {world_size} processes: "
                         f"it counts the prompts of a step over all of them; pass a multiple of {world_size}")
    vllm_sampler.check_vllm_memory_flags(args.gpu_memory_utilization, args.vllm_kv_cache_gb)
    if args.vllm_sleep and device != "cuda":
        raise UsageError("--vllm-sleep needs a GPU: vLLM has no sleep mode on a CPU (it frees GPU memory for the update)")
    vllm_sampler.check_vllm_flags_used(args.backend, device, [f"--{name.replace('_', '-')}" for name in VLLM_FLAGS
                                                               if getattr(args, name) != defaults[name]])
    if forced:  # warnings last: a command with an error gets the error alone
        log.warning("%s on a CPU that emulates bfloat16 (no AVX-512 BF16 or AMX): steps are several times slower "
                    "than in float32, this CPU's default", " and ".join(forced))
    if "max_new_tokens" in filled and device == "cpu" and data.arith_levels(args.dataset) is None:
        log.warning("--max-new-tokens %d, the CPU profile's (sized for arith), cuts most GSM8K-style solutions off before "
                    "their answer: pass --max-new-tokens 256 or more (the authors': 512)", args.max_new_tokens)
    return dataclasses.replace(args, backend="vllm" if vllm else "hf")  # auto as it resolved: config.json records the one used


def check_optimizer_flags(args) -> None:
    """The update's numbers, checked before anything loads. Some would not fail at all: clipping to a norm
    <= 0 scales the gradient by it (a negative norm turns the step into gradient ascent, 0 erases it),
    and a negative clip range clips every ratio to a constant (rollouts with a positive advantage never learn)."""
    if args.lr <= 0:
        raise UsageError(f"--lr {args.lr} must be > 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in [0, 1)")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay {args.weight_decay} must be >= 0")
    if args.max_grad_norm <= 0:
        raise UsageError(f"--max-grad-norm {args.max_grad_norm} must be > 0: the gradient is scaled down to this norm")
    if not 0 <= args.warmup_ratio <= 1:
        raise UsageError(f"--warmup-ratio {args.warmup_ratio} must be in [0, 1]: a share of --steps")
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name in ("clip_eps", "clip_eps_high"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0: the ratio is clipped to [1 - eps, 1 + eps_high]")
        if getattr(args, name) != defaults[name]:  # one update per batch: the old log-probs are the new, rho = 1
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} has no effect: each batch of rollouts gets one "
                             f"update, so the ratio is 1 and nothing is clipped (grpo.grpo_loss); leave it out")


def merged_dtype(args) -> torch.dtype:
    """The precision of the hf sampler's merged copy: bfloat16 where the run computes in bfloat16
    (--bf16-autocast, --bf16-weights), float32 where it does not (a CPU without bfloat16 arithmetic:
    there a float32 copy still saves peft's adapter matmuls, docs/speed.md)."""
    return torch.bfloat16 if args.bf16_autocast or args.bf16_weights else torch.float32


def check_torchrun(device: str, world: distributed.World) -> None:
    """What torchrun must give the ranks before they meet (every rank raises, rank 0 says it):
    - on GPUs, a GPU for each process on a machine (each rank takes the one numbered by its LOCAL_RANK),
      instead of CUDA's 'invalid device ordinal';
    - on several nodes with --max-restarts, a fresh store for each restart: in the one store torchrun's
      agents share by default, a restarted rank can read the dead attempt's addresses, and the attempt
      cannot be told apart there, since each node's agent counts restarts for itself (distributed.start)."""
    if not world.launched:
        return
    gpus, per_node = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device == "cuda" and per_node > gpus:
        raise UsageError(f"torchrun started {per_node} processes on this machine but it has {gpus} GPU(s): "
                         f"run one process per GPU (--nproc_per_node {gpus})")
    nodes, restarts = int(os.environ.get("GROUP_WORLD_SIZE", 1)), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if nodes > 1 and restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError(f"torchrun on {nodes} nodes with --max-restarts {restarts}: start it with "
                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node, so that each restart meets in a "
                         "fresh store (in the shared one a restarted rank may wait for the others forever)")
