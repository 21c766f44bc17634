"""Several processes: torchrun/DDP training, resume and Ctrl-C on two CPU processes, and elastic restarts."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoint
import config
import data
import distributed
import model as models
import sampling
import train
import update
from testkit import checkpointed_lora_policy, length_reward_script, lora_policy, read_metrics, tiny_args, torchrun


def test_torchrun_two_processes_train_two_steps_then_resume_exactly_at_step_3(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    script, out, straight = length_reward_script(tmp_path), tmp_path / "run", tmp_path / "straight"
    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "2", "--prompts-per-step", "4"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # rank 0 alone writes, one row per step
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    saved = torch.load(out / "checkpoint-2" / "training_state.pt", weights_only=False)
    assert len(saved["random_states"]) == 2  # each rank's generators, for an exact resume
    assert not torch.equal(saved["random_states"][0]["torch"], saved["random_states"][1]["torch"])
    assert done.stderr.count("generation on 2 processes (DDP)") == 1  # one start line: rank 0 speaks for both

    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "3", "--prompts-per-step", "4", "--resume"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["elapsed_s"] > rows[1]["elapsed_s"]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == 12  # 4 prompts per step over both ranks

    # the same 3 steps without a stop: the same rollouts, updates and adapter
    done = torchrun(2, *tiny_args(tiny_model_dir, straight, "--steps", "3", "--prompts-per-step", "4"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    for resumed, uninterrupted in zip(rows, read_metrics(straight)):
        for key in ("reward_mean", "kept_reward_std", "completion_len", "loss", "grad_norm"):
            assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    assert rows[2]["grad_norm"] > 0
    a, b = load_file(out / "checkpoint-3" / "adapter_model.safetensors"), load_file(straight / "checkpoint-3" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6

    # one process cannot continue a two-process run: the second rank's random state has no owner
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", "--prompts-per-step", "4", "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert "was trained with 2" in err and "--nproc_per_node" in err and "\n" not in err


def test_torchrun_with_more_processes_than_gpus_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """torchrun --nproc_per_node 2 on a one-GPU machine: each rank takes GPU LOCAL_RANK, and rank 1 died
    in a traceback, CUDA's 'invalid device ordinal' (seen on an H100). Now refused in one line before the
    run directory is made. The GPU is faked here (rank 0's view); on a real one see the cuda test below."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--prompts-per-step", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: torchrun started 2 processes on this machine but it has 1 GPU(s): run one process per GPU (--nproc_per_node 1)"
    assert not out.exists()


def test_torchrun_on_several_nodes_with_restarts_in_the_shared_store_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Each node's torchrun agent counts restarts for itself, so in the one store the agents share the ranks of a
    restart cannot tell the attempts apart (the next test): refused before the run directory is made."""
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                            TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--prompts-per-step", "2")) == 2
    assert capsys.readouterr().err.strip() == (
        "error: torchrun on 2 nodes with --max-restarts 3: start it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every "
        "node, so that each restart meets in a fresh store (in the shared one a restarted rank may wait for the others forever)")
    assert not out.exists()
    world = distributed.world_from_env()
    for allowed in (dict(TORCHELASTIC_USE_AGENT_STORE="False"), dict(TORCHELASTIC_MAX_RESTARTS="0"), dict(GROUP_WORLD_SIZE="1")):
        with monkeypatch.context() as env:
            for name, value in allowed.items():
                env.setenv(name, value)
            config.check_torchrun("cpu", world)


TWO_NODES_WORKER = """
import os, sys, time
sys.path.insert(0, {project!r})
import torch, torch.distributed as dist
import config, distributed
world = distributed.world_from_env()
config.check_torchrun("cpu", world)
distributed.start(world)
total = torch.ones(1)
dist.all_reduce(total)
print(f"node {{os.environ['NODE']}} attempt {{os.environ['TORCHELASTIC_RESTART_COUNT']}}: {{total.item():g}} ranks", flush=True)
ran = {ran!r} + os.environ["NODE"]  # each node's own mark: B's rank, reading A's, finished before its agent restarted it
if not os.path.exists(ran):
    open(ran, "w").close()
    if os.environ["NODE"] == "A":
        os.kill(os.getpid(), 9)  # a fault on node A
    time.sleep(60)  # node B: healthy, busy; its agent restarts it when A's comes back
distributed.finish(world)
"""


def test_two_nodes_restart_after_a_fault_on_one_and_meet_again_in_a_fresh_store(tmp_path):
    """Two torchrun agents on this machine stand for two nodes (docs/multi-gpu.md's command, with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --max-restarts 1). Node A's rank is killed; its agent counts
    a restart and node B's, whose rank was healthy, does not, so the ranks start again as attempts 1 and 0.
    They meet all the same (a prefix naming the attempt kept them waiting for each other forever)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    worker = tmp_path / "worker.py"
    worker.write_text(TWO_NODES_WORKER.format(project=str(Path(__file__).parent), ran=str(tmp_path / "ran-")))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    nodes = {node: subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "1",
                                     "--log-dir", str(tmp_path / f"logs-{node}"), str(worker)],
                                    env=os.environ | {"NODE": node, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in "AB"}
    try:
        outputs = {node: process.communicate(timeout=120) for node, process in nodes.items()}
    finally:
        for process in nodes.values():  # SIGTERM: an agent then ends its ranks (they run in their own sessions,
            process.terminate()         # where a SIGKILL of the agent would leave them waiting)
            process.wait(timeout=60)
    assert [nodes[node].returncode for node in "AB"] == [0, 0], outputs
    assert outputs["A"][0].splitlines() == ["node A attempt 0: 2 ranks", "node A attempt 1: 2 ranks"]
    assert outputs["B"][0].splitlines() == ["node B attempt 0: 2 ranks", "node B attempt 0: 2 ranks"]


RANK_0_LATE = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import train
if os.environ["RANK"] == "0":
    time.sleep(2)  # rank 0 reaches its refusal last: rank 1 exits first, and torchrun then stops every rank
sys.exit(train.main())
"""


def test_a_refusal_under_torchrun_reaches_its_stderr_when_rank_0_is_the_last_to_get_there(tmp_path):
    """torchrun stops every rank once one has exited: rank 1, silent, used to exit first and rank 0 was stopped before
    it printed (on an H200 stderr ended in torchrun's summary alone). The other ranks now wait for rank 0 to say it."""
    driver = tmp_path / "rank_0_late.py"
    driver.write_text(RANK_0_LATE)
    done = torchrun(2, "--prompts-per-step", "3", "--dataset", "arith", "--out-dir", str(tmp_path / "run"), script=str(driver))
    assert done.returncode != 0 and not (tmp_path / "run").exists()
    assert done.stderr.count("error: --prompts-per-step 3 does not divide among 2 processes") == 1, done.stderr[-3000:]


def test_ctrl_c_on_torchrun_stops_both_ranks_after_the_step_with_one_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    launcher = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "100000", "--prompts-per-step", "4", "--time-budget", "3"), wait=False)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.time() < deadline and launcher.poll() is None, "no training steps"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C in torchrun's terminal sends it
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))
    assert [p.name for p in checkpoint.find(out)] == [f"checkpoint-{steps[-1]}"]  # the last finished step, saved once
    assert err.count(f"interrupted: the last checkpoint is {out / f'checkpoint-{steps[-1]}'} (--resume continues from it)") == 1


def test_a_second_ctrl_c_on_torchrun_stops_both_ranks_without_saving(tiny_model_dir, tmp_path):
    """torchrun passes the first Ctrl-C on to each rank and SIGTERMs them at the second; that is each rank's second signal,
    so they quit without saving, and rank 0's last line says how to start again. Updates take 3 s here, so both
    signals arrive within one step."""
    out, script = tmp_path / "run", tmp_path / "slow_updates.py"
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport train\n"
                      "update = train.policy_update\n"
                      "train.policy_update = lambda *args, **kwargs: time.sleep(3) or update(*args, **kwargs)\n"
                      "sys.exit(train.main())\n")
    launcher = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "100000", "--prompts-per-step", "4", "--time-budget", "3"), script=str(script), wait=False)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
            assert time.time() < deadline and launcher.poll() is None, "no training steps"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode != 0 and checkpoint.find(out) == []
    assert err.count(f"interrupted: no checkpoint was saved in {out}; the same command with --resume auto starts the run again") == 1, err[-3000:]


AT_RANKS_SECOND_UPDATE = """
import os, signal, sys, torch
sys.path.insert(0, os.getcwd())
import train
event, rank, update, calls = os.environ["EVENT"], os.environ["RANK"], train.policy_update, []

def children_of(parent):
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(parent)]

def policy_update(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2 and event in ("scheduler", "hangup") and rank == "0":  # Slurm's scancel: SIGTERM to torchrun and
        for pid in [os.getppid(), *children_of(os.getppid())]:  # every rank; a terminal closed: SIGHUP to them all
            os.kill(pid, signal.SIGTERM if event == "scheduler" else signal.SIGHUP)
    if len(calls) == 2 and event == "sigterm" and rank == "1":  # a kill of one worker
        os.kill(os.getpid(), signal.SIGTERM)
    if len(calls) == 2 and event == "oom" and rank == "1":  # its completions longer than rank 0's
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return update(*args, **kwargs)

train.policy_update = policy_update
sys.exit(train.main())
"""


@pytest.mark.parametrize("event", ["scheduler", "hangup", "sigterm", "oom"])
def test_a_stop_or_failure_at_one_rank_or_at_all_is_saved_and_said_under_torchrun(event, tiny_model_dir, tmp_path):
    """scheduler: a SIGTERM to every process of the job reached each rank twice (the scheduler's, torchrun's), and the
    second quit without saving. hangup: the same with SIGHUP (a terminal closed), which killed every rank unsaved. sigterm: a SIGTERM to rank 1 stopped both ranks, but rank 0 logged "done". oom: rank 1
    out of memory was silent; rank 0 said only that its connection closed. Each is found in step 2's update."""
    driver, out = tmp_path / "at_second_update.py", tmp_path / "run"
    driver.write_text(AT_RANKS_SECOND_UPDATE)
    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "5", "--prompts-per-step", "4"), script=str(driver),
                    env=os.environ | {"EVENT": event})
    assert done.returncode != 0
    if event == "oom":
        assert "[rank 1] error: out of memory; lower --micro-batch" in done.stderr, done.stderr[-3000:]
        return
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"], done.stderr[-3000:]  # step 2 finished and saved
    assert done.stderr.count(f"interrupted: the last checkpoint is {out / 'checkpoint-2'} (--resume continues from it)") == 1
    assert "done: metrics in" not in done.stderr


def test_prompts_per_step_that_do_not_divide_among_the_processes_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    """Checked before the ranks meet, so each exits at once (torchrun then reports the failed ranks)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert train.main(["--prompts-per-step", "3", "--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts-per-step 3 does not divide among 2 processes" in err and "\n" not in err
    assert not torch.distributed.is_initialized()


def equal_groups() -> list[sampling.Rollout]:
    """Four prompts with three completions each, of uneven lengths: two prompts for each of two ranks.
    Each carries made-up sampler log-probabilities, so that the update reports a sampler gap."""
    rng = random.Random(1)
    rollouts = []
    for prompt_len in (5, 9, 3, 7):
        prompt = [rng.randrange(3, 200) for _ in range(prompt_len)]
        for _ in range(3):
            completion = [rng.randrange(3, 200) for _ in range(rng.randint(1, 7))]
            rollouts.append(sampling.Rollout(prompt, completion, "", False, [rng.uniform(-9, 0) for _ in completion]))
    return rollouts


EQUAL_GROUP_ADVANTAGES = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.0, -1.0, 0.2, 0.8, 0.5, -1.1, 0.6])


def update_on(model, rollouts, advantages, pad_id, beta: float = 0.0, rows_in_mean: float | None = None):
    """One policy_update with plain SGD (its step is proportional to the gradient, unlike Adam's first
    step) and micro-batches of 2 (so DDP skips the sync on all but the last); the stats and the LoRA
    weights and gradients after it."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = update.UpdateSettings(micro_batch=2, bf16_autocast=False, max_grad_norm=1e9, beta=beta, share_prompt=True)  # the CPU profile's
    stats = update.policy_update(model, optimizer, scheduler, rollouts, advantages, args, pad_id, rows_in_mean=rows_in_mean)
    return stats, [p.detach().clone() for p in params], [p.grad.clone() for p in params]


def ddp_update_worker(rank: int, model_dir: str, port: int, out: str, beta: float, checkpointing: bool) -> None:
    """One of two ranks: its half of the prompts, the same update through DDP, counting DDP's gradient
    all-reduces (one per bucket of gradients; the tiny model's LoRA gradients fill one bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = distributed.world_from_env()
    distributed.start(world)
    torch.set_num_threads(1)
    model, tokenizer = checkpointed_lora_policy(Path(model_dir), checkpointing)
    model = distributed.wrap(model, world)
    all_reduces = []
    model.register_comm_hook(None, lambda state, bucket: all_reduces.append(1) or allreduce_hook(torch.distributed.group.WORLD, bucket))
    rollouts, advantages = distributed.shard(equal_groups(), world), distributed.shard(EQUAL_GROUP_ADVANTAGES, world)
    stats, weights, grads = update_on(model, rollouts, advantages, tokenizer.pad_token_id, beta)
    stats = distributed.reduce_row(stats, world, maxima=("sampler_gap_max",))
    torch.save({"stats": stats, "weights": weights, "grads": grads, "all_reduces": len(all_reduces),
                "micro_batches": len(update.micro_batches(rollouts, 2))}, Path(out) / f"rank{rank}.pt")
    distributed.finish(world)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("beta, checkpointing", [(0.0, False), (0.1, True)])
def test_two_processes_with_half_the_prompts_each_make_the_update_of_one_process_with_all(tiny_model_dir, tmp_path, beta, checkpointing):
    """The same LoRA gradients, weights and loss; with beta > 0 the KL reference (the adapter switched
    off inside the DDP wrapper) and gradient checkpointing under DDP too. DDP communicates once per
    step (no_sync on all but the last micro-batch), not once per micro-batch."""
    import torch.multiprocessing as mp

    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
    stats, weights, grads = update_on(model, equal_groups(), EQUAL_GROUP_ADVANTAGES, tokenizer.pad_token_id, beta)
    mp.spawn(ddp_update_worker, args=(str(tiny_model_dir), free_port(), str(tmp_path), beta, checkpointing), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["all_reduces"] for r in ranks] == [1, 1] and ranks[0]["micro_batches"] == 4
    assert (stats["kl"] > 0) == (beta > 0)
    total = torch.cat([g.flatten() for g in grads]).norm()
    assert total > 0 and any((w - w0).abs().max() > 0 for w, w0 in zip(weights, lora_policy_weights(tiny_model_dir)))
    for rank in ranks:
        assert torch.cat([(a - b).flatten() for a, b in zip(rank["grads"], grads)]).norm() / total <= 1e-5
        assert max((a - b).abs().max().item() for a, b in zip(rank["weights"], weights)) <= 1e-6
        assert rank["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-6)
        assert rank["stats"]["kl"] == pytest.approx(stats["kl"], abs=1e-6)
        assert rank["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
        assert rank["stats"]["sampler_gap_max"] == pytest.approx(stats["sampler_gap_max"], abs=1e-5)  # the max over ranks
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]))  # the ranks stay identical


def uneven_ddp_worker(rank: int, model_dir: str, port: int, out: str) -> None:
    """One of two ranks holding different numbers of the 12 rows, weighted as train.py weighs them (rows_in_mean = 12 / 2
    ranks): 9 and 3, then 12 and none (rank 1 runs one row at weight 0, rows_in_mean inf, so the all-reduce completes)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = distributed.world_from_env()
    distributed.start(world)
    torch.set_num_threads(1)
    rollouts, results = equal_groups(), []
    for on_rank_0 in (9, 12):
        model, tokenizer = lora_policy(Path(model_dir))
        mine = list(range(on_rank_0)) if rank == 0 else list(range(on_rank_0, 12))
        if mine:
            kept, advantages, rows_in_mean = [rollouts[i] for i in mine], EQUAL_GROUP_ADVANTAGES[mine], 12 / 2
        else:
            kept, advantages, rows_in_mean = rollouts[:1], torch.zeros(1), math.inf
        stats, weights, grads = update_on(distributed.wrap(model, world), kept, advantages, tokenizer.pad_token_id, rows_in_mean=rows_in_mean)
        results.append({"stats": distributed.reduce_row(stats, world, maxima=("sampler_gap_max",)), "weights": weights, "grads": grads})
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.finish(world)


def test_ranks_with_different_numbers_of_rows_make_the_update_of_one_process_with_all(tiny_model_dir, tmp_path):
    """--uniform-groups skip or refill under torchrun: ranks may update on different numbers of rows, or none. Weighted by
    policy_update's rows_in_mean, DDP's average is the mean over all rows: the gradient, weights, loss and statistics of one
    process holding them all, and a rank's row of weight 0 adds nothing to them."""
    import torch.multiprocessing as mp

    model, tokenizer = lora_policy(tiny_model_dir)
    stats, weights, grads = update_on(model, equal_groups(), EQUAL_GROUP_ADVANTAGES, tokenizer.pad_token_id)
    mp.spawn(uneven_ddp_worker, args=(str(tiny_model_dir), free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for split in (0, 1):
        for rank in ranks:
            result = rank[split]
            assert torch.cat([(a - b).flatten() for a, b in zip(result["grads"], grads)]).norm() / total <= 1e-5
            assert max((a - b).abs().max().item() for a, b in zip(result["weights"], weights)) <= 1e-6
            for key in ("loss", "clip_frac", "ratio_mean", "kl"):
                assert result["stats"][key] == pytest.approx(stats[key], abs=1e-6), key
            assert result["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][split]["weights"], ranks[1][split]["weights"]))


RANK_1_UNIFORM = """
import itertools, os, sys
sys.path.insert(0, os.getcwd())
import rewards, train
informative = itertools.cycle([0.0, 1.0, 0.0, 2.0])  # rank 0: every group informative; rank 1: every group uniform
rewards.reward = (lambda completion, answer: next(informative)) if os.environ["RANK"] == "0" else (lambda completion, answer: 1.0)
sys.exit(train.main())
"""


def test_torchrun_refill_with_a_rank_that_never_has_an_informative_group_agrees_on_the_rounds_and_finishes(tiny_model_dir, tmp_path):
    """Rank 1 never has an informative group, so the step has 2 of its 4 after round 1 and both ranks draw a second
    (2 rounds at most), their streams together; rank 0's 4 groups are the update's (8 rows: the informative groups of
    all ranks count, as in one process), rank 1 joins DDP's all-reduce at weight 0; the metrics are global."""
    driver = tmp_path / "rank_1_uniform.py"
    driver.write_text(RANK_1_UNIFORM)
    out = tmp_path / "run"
    argv = tiny_args(tiny_model_dir, out, "--steps", "2", "--prompts-per-step", "4", "--uniform-groups", "refill", "--max-refill-rounds", "2")
    done = torchrun(2, *argv, script=str(driver))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [(r["generation_rounds"], r["prompts_drawn"], r["uniform_share"], r["informative_rows"]) for r in rows] == [(2, 8, 0.5, 8)] * 2
    assert all(r["grad_norm"] > 0 and r["skipped"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["data_position"] == 16


SCRIPTED_GROUPS = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import rewards, sampling, train
informative = {tuple(ids) for ids in json.load(open(os.environ["INFORMATIVE_PROMPTS"]))}

def generate(self, prompts, n):  # the same completions for a prompt in any process: its group, whichever rank draws it
    return [[sampling.Rollout(p, [10 + j, 20 + len(p) % 7, 30 + j % 3][: 1 + j % 3], ("i" if tuple(p) in informative else "u") + str(j),
                              False) for j in range(n)] for p in prompts]

def reward(completion, answer):  # an informative prompt's rollouts earn 0 and 1 in turn, a uniform one's 1.0 each
    return float(int(completion[1:]) % 2) if completion[0] == "i" else 1.0

original = train.policy_update
def recorded(model, optimizer, scheduler, kept, advantages, settings, pad_id, rows_in_mean=None):
    with open(os.path.join(os.environ["UPDATES_DIR"], "rank" + os.environ.get("RANK", "0")), "a") as f:
        f.write(json.dumps({"rows": [[r.prompt_ids, r.completion_ids, a] for r, a in zip(kept, advantages.tolist())],
                            "rows_in_mean": rows_in_mean}) + "\\n")
    return original(model, optimizer, scheduler, kept, advantages, settings, pad_id, rows_in_mean=rows_in_mean)

sampling.HFSampler.generate, rewards.reward, train.policy_update = generate, reward, recorded
sys.exit(train.main())
"""


def test_torchrun_refill_trains_on_the_rows_of_one_process_and_ends_with_its_adapter(tiny_model_dir, tmp_path):
    """--uniform-groups refill is global: in each round of 4 prompts the first 2 are informative (prompts 0-1 on rank 0,
    2-3 on rank 1), so a step has 2 informative groups after round 1 and draws a second. One process trains on the 4
    informative groups, 8 rows; two ranks train on the same 8 rows, all on rank 0, while rank 1 runs one row at weight 0.
    With beta > 0 that row has a KL gradient, and the loss and gradient norm are those of a mean over 8 rows (a rank-local
    mean would halve them): rows, advantages, loss, gradient norm and adapter match one process. Completions and
    rewards are scripted per prompt, so both runs draw the same rollouts."""
    from safetensors.torch import load_file

    tokenizer = models.load_policy(str(tiny_model_dir), "cpu", torch.float32)[1]
    stream = data.PromptStream(data.load_examples("arith", "train"), lambda q: sampling.build_prompt(tokenizer, q), 512, seed=0)
    prompts = [ids for ids, _ in stream.next_batch(24)]
    (tmp_path / "informative.json").write_text(json.dumps([p for i, p in enumerate(prompts) if i % 4 < 2]))
    driver = tmp_path / "scripted_groups.py"
    driver.write_text(SCRIPTED_GROUPS)
    flags = ("--steps", "3", "--prompts-per-step", "4", "--uniform-groups", "refill", "--max-refill-rounds", "2",
             "--beta", "0.5", "--no-bf16-autocast", "--max-grad-norm", "1e9")
    runs = {}
    for processes in (1, 2):
        out, updates = tmp_path / f"run{processes}", tmp_path / f"updates{processes}"
        updates.mkdir()
        env = os.environ | {"INFORMATIVE_PROMPTS": str(tmp_path / "informative.json"), "UPDATES_DIR": str(updates)}
        argv = tiny_args(tiny_model_dir, out, *flags)
        done = (subprocess.run([sys.executable, str(driver), *argv], cwd=Path(__file__).parent, capture_output=True, text=True,
                               timeout=300, env=env) if processes == 1 else torchrun(2, *argv, script=str(driver), env=env))
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [[json.loads(line) for line in (updates / f"rank{r}").read_text().splitlines()] for r in range(processes)]
        runs[processes] = {"metrics": read_metrics(out), "updates": ranks,
                           "adapter": load_file(out / "checkpoint-3" / "adapter_model.safetensors")}
    one, two = runs[1], runs[2]
    assert [(r["generation_rounds"], r["prompts_drawn"], r["informative_rows"]) for r in one["metrics"]] == [(2, 8, 8)] * 3
    for step in range(3):
        (alone,) = [u[step] for u in one["updates"]]
        rank0, rank1 = (u[step] for u in two["updates"])
        assert alone["rows_in_mean"] == 8 and len(alone["rows"]) == 8
        assert rank0["rows"] == alone["rows"] and rank0["rows_in_mean"] == 8 / 2  # the same rows, in the same order
        assert rank1["rows_in_mean"] == math.inf and len(rank1["rows"]) == 1  # no informative group: one row at weight 0
    for a, b in zip(one["metrics"], two["metrics"]):
        assert (b["generation_rounds"], b["prompts_drawn"], b["informative_rows"]) == (a["generation_rounds"], a["prompts_drawn"], a["informative_rows"])
        for key in ("loss", "kl", "grad_norm", "reward_mean", "uniform_share", "all_rounds_reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert two["metrics"][-1]["kl"] > 0 and two["metrics"][-1]["grad_norm"] > 0
    assert max((one["adapter"][k] - two["adapter"][k]).abs().max().item() for k in one["adapter"]) <= 1e-6


def lora_policy_weights(model_dir: Path) -> list[torch.Tensor]:
    model, _ = lora_policy(model_dir)
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_one_process_world_leaves_everything_as_it_is():
    world = distributed.World()
    row = {"loss": 0.5, "generation_s": 2.0, "n": 4}
    assert not world.launched and world.is_main and distributed.world_from_env() == world
    assert distributed.reduce_row(row, world, maxima=("generation_s",)) is row
    assert distributed.shard([1, 2, 3], world) == [1, 2, 3] and distributed.any_rank(True, world) is True
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, world) is model and distributed.unwrap(model) is model
    assert distributed.gather("x", world) == ["x"]


ELASTIC_DRIVER = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
import rewards, train
rewards.reward = lambda completion, answer: float(len(completion) % 3)
original = train.policy_update
def dies_in_step_3(*args, **kwargs):
    marker = os.path.join(os.environ["FAULT_DIR"], "updates-rank" + os.environ["RANK"])
    count = int(open(marker).read()) + 1 if os.path.exists(marker) else 1
    open(marker, "w").write(str(count))
    if count == 3 and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)  # a hardware fault, an OOM kill: no handler runs
    return original(*args, **kwargs)
train.policy_update = dies_in_step_3
sys.exit(train.main())
"""


@pytest.mark.parametrize("elastic", ["standalone", "nnodes 1:2"])
def test_a_rank_killed_mid_step_under_torchrun_max_restarts_resumes_and_ends_as_an_uninterrupted_run(tiny_model_dir, tmp_path, elastic):
    """torchrun --max-restarts 1 with --resume auto: rank 1 is SIGKILLed in step 3's update, after
    checkpoint-2; torchrun restarts both ranks with the same command, which continues from
    checkpoint-2. The fault costs the steps since the last checkpoint (here 1, with --save-every-steps 1).
    Also under --nnodes 1:2 (an elastic job that may grow to two nodes) with one node, through a c10d rendezvous:
    one agent, so distributed.start's store prefix names the attempt, as under --standalone."""
    from safetensors.torch import load_file

    driver = tmp_path / "elastic.py"
    driver.write_text(ELASTIC_DRIVER)
    out, straight = tmp_path / "run", tmp_path / "straight"
    argv = tiny_args(tiny_model_dir, out, "--steps", "4", "--prompts-per-step", "4", "--save-every-steps", "1", "--resume", "auto")
    rendezvous = {"standalone": ("--standalone",),
                  "nnodes 1:2": ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}",
                                 "--rdzv-conf", "last_call_timeout=1")}[elastic]  # (1 s for a second node to join, not 30)
    done = torchrun(2, *argv, script=str(driver), launcher_flags=("--max-restarts", "1"), env=os.environ | {"FAULT_DIR": str(tmp_path)},
                    rendezvous=rendezvous)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "checkpoint-2" in done.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step exactly once
    assert int((tmp_path / "updates-rank1").read_text()) == 5  # 3 updates, the 3rd killed; then steps 3 and 4 again
    done = torchrun(2, *tiny_args(tiny_model_dir, straight, "--steps", "4", "--prompts-per-step", "4"), script=length_reward_script(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for resumed, uninterrupted in zip(rows, read_metrics(straight)):
        for key in ("reward_mean", "kept_reward_std", "completion_len", "loss", "grad_norm"):
            assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    a, b = load_file(out / "checkpoint-4" / "adapter_model.safetensors"), load_file(straight / "checkpoint-4" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def uneven_keys_worker(rank: int, port: int, out: str) -> None:
    """policy_update reports sampler_gap_* only where its rows had a completion token: a rank whose kept completions
    were all empty (EOS first) has no such keys, the other has."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = distributed.world_from_env()
    distributed.start(world)
    row = {"generation_s": 1.0 + rank, "loss": 0.25 * rank}
    if rank == 0:
        row |= {"sampler_gap_mean": 0.01, "sampler_gap_max": 0.5}
    row |= {"grad_norm": 0.3, "skipped": 0}
    torch.save(distributed.reduce_row(row, world, maxima=("generation_s", "sampler_gap_max")), Path(out) / f"rank{rank}.pt")
    distributed.finish(world)


def test_metrics_rows_whose_keys_differ_between_ranks_are_reduced_not_aborted(tmp_path):
    """gloo aborted rank 1 (gloo::EnforceNotMet, an all_reduce of 6 numbers against 4): the torchrun job died at the
    step's metrics row, with no checkpoint and no line saying why. A key some ranks lack is reduced over those that have it."""
    import torch.multiprocessing as mp

    mp.spawn(uneven_keys_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rows = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert rows[0] == rows[1]
    assert rows[0]["generation_s"] == 2.0 and rows[0]["loss"] == pytest.approx(0.125) and rows[0]["skipped"] == 0
    assert rows[0]["sampler_gap_mean"] == pytest.approx(0.01) and rows[0]["sampler_gap_max"] == 0.5
