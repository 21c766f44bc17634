"""reproduce/gpu/: the GPU check's parts that run without a GPU: the summary from constructed logs (summary.py),
decode_bench.py's loading of an older tree, peak.py's split of the peak at the update, check.sh's refusal of an unknown stage and its install of a wheel set (TRL's checkpointing keyword: test_trl_pods.py), and a dry run of the pods and trl stages' scripts on a CPU. The check itself needs a CUDA GPU: bash reproduce/gpu/check.sh (README.md beside this file)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import summary
import torch

HERE = Path(__file__).parent
ENV = {"card": "NVIDIA H200, 143771 MiB", "date": "2026-11-28 10:12 UTC", "commit": "75ef33d with uncommitted changes",
       "versions": "torch 2.11.0+cu130, transformers 5.19.0, peft 0.21.2, trl 1.16.0, vllm absent",
       "model": "random weights at Qwen/Qwen2.5-3B-Instruct's shape", "old": "5af2948"}


def write_stage(logs: Path, stage: str, steps: list[tuple[float, float]], peak: str | None, **extra) -> None:
    """STAGE.jsonl with a row per step (generation_s, update_s; elapsed_s adds each step's sum) and STAGE.log."""
    elapsed, rows = 0.0, []
    for step, (generation_s, update_s) in enumerate(steps, start=1):
        elapsed += generation_s + update_s
        rows.append({"step": step, "elapsed_s": elapsed, "generation_s": generation_s, "update_s": update_s, **extra})
    (logs / f"{stage}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (logs / f"{stage}.log").write_text(f"training...\n{peak}\n" if peak else "training...\n")


@pytest.fixture
def logs(tmp_path) -> Path:
    (tmp_path / "env.txt").write_text("".join(f"{key}: {value}\n" for key, value in ENV.items()))
    (tmp_path / "tests.log").write_text(
        "....F.s\nFAILED test_cuda.py::test_cuda_torchrun - AssertionError: no one-line refusal\n"
        "SKIPPED [1] test_cuda.py:122: could not import 'vllm'\n"
        "1 failed, 5 passed, 1 skipped, 420 deselected in 95.31s (0:01:35)\n")
    (tmp_path / "decode.log").write_text("Loading weights...\ndecode: graph             6.10 ms/step  (0.78 s)\n"
                                         "decode: graph / eager 0.21\neval batch: 64 questions x 1, 512 new tokens, graph: "
                                         "prompts prefilled whole 9.00 s, after their shared prefix 8.00 s (92 tokens): 1.12x\n")
    (tmp_path / "status.txt").write_text("tests\t1\t97\ndecode\t0\t41\npods\t0\t104\nold\t0\t150\ntrl\t124\t190\ngrpo\t0\t112\n"
                                         "vllm\tskipped\tvLLM does not import here\n")
    write_stage(tmp_path, "pods", [(48.0, 3.5), (15.0, 2.0), (16.0, 2.2)], "train.main exit 0 after 99 s; "
                "CUDA peak allocated 14.27 GiB, reserved 15.21 GiB; in the update 14.27 GiB allocated, outside it 13.10",
                completion_len=512.0, sampler_gap_mean=0.027)
    write_stage(tmp_path, "old", [(50.0, 3.5), (45.0, 2.0), (47.0, 2.0)], "CUDA peak allocated 15.10 GiB, reserved 16.00 GiB")
    write_stage(tmp_path, "grpo", [(50.0, 5.0), (15.0, 5.0), (16.0, 4.0)], "CUDA peak allocated 14.50 GiB, reserved 15.50 GiB")
    write_stage(tmp_path, "trl", [(55.0, 5.0), (50.0, 4.0)], None, completion_len=512.0)  # stopped in step 3: no peak
    return tmp_path


@pytest.mark.pure
def test_summary_times_steps_2_and_3_only_and_divides_step_times_by_trls(logs):
    text = summary.summary(logs)
    columns = [re.split(r"\s{2,}", line) for line in text.splitlines()]
    rows = {line[0]: line[1:] for line in columns if line[0] in summary.ROWS}  # what, steps, generation s, update s, ...
    assert rows["pods"] == ["PODS, train.py --backend hf", "2-3", "15.5", "30.3", "2.1", "17.6", "14.27 / 15.21", "512", "0.0270",
                            "ok, 104 s"]  # step 1's 51.5 s left out
    assert rows["old"][:2] == ["PODS, train.py at 5af2948", "2-3"]
    assert rows["trl"] == ["GRPO, TRL GRPOTrainer", "2", "50.0", "97.7", "4.0", "54.0", "-", "512", "-", "timed out at 190 s"]
    assert rows["vllm"][-1] == "skipped: vLLM does not import here"
    assert "step time ratios: pods / trl 0.33, grpo / trl 0.37, pods / grpo 0.88, pods / old 0.37" in text.splitlines()
    assert "peak GiB allocated by phase: pods 14.27 in the update, 13.10 outside it" in text.splitlines()  # old: no split


@pytest.mark.pure
def test_summary_sets_the_vllm_stage_beside_pods_and_trl_and_says_its_peak_holds_vllms_kv_cache(logs):
    """--backend vllm: its step time over train.py --backend hf's and TRL's, and its KV cache (allocated whole at
    vLLM's start, at the size --gpu-memory-utilization gives it) named under the table."""
    (logs / "status.txt").write_text("pods\t0\t104\ntrl\t0\t190\nvllm\t0\t260\n")
    write_stage(logs, "trl", [(55.0, 5.0), (50.0, 4.0), (50.0, 4.0)], None)
    write_stage(logs, "vllm", [(150.0, 3.0), (4.0, 2.5), (3.5, 2.5)], "train.main exit 0 after 200 s; "
                "CUDA peak allocated 52.10 GiB, reserved 53.00 GiB; in the update 52.10 GiB allocated, outside it 45.00")
    (logs / "vllm.log").write_text("INFO vLLM KV cache: 1,020,416 tokens\n" + (logs / "vllm.log").read_text())
    lines = summary.summary(logs).splitlines()
    assert "vllm: its peak holds vLLM's KV cache, 1,020,416 tokens, as --gpu-memory-utilization sized it" in lines
    assert "step time ratios: pods / trl 0.33, vllm / pods 0.36, vllm / trl 0.12" in lines


@pytest.mark.pure
def test_summary_of_two_calls_on_one_machine_is_one_table_under_the_first_calls_header(logs, tmp_path):
    """The plan for vLLM at 3B: check.sh pods vllm in one call (vLLM last, so it may take what is left), trl in
    the next; summary.py LOGS LATER_LOGS sets them side by side, a stage in both taken from the later call."""
    later = tmp_path / "later"
    later.mkdir()
    (later / "env.txt").write_text("card: another header, not shown\n")
    (later / "status.txt").write_text("trl\t0\t200\n")
    write_stage(later, "trl", [(55.0, 5.0), (50.0, 4.0), (52.0, 4.0)], "CUDA peak allocated 20.00 GiB, reserved 21.00 GiB")
    lines = summary.summary(logs, later).splitlines()
    assert "card: NVIDIA H200, 143771 MiB" in lines and "card: another header, not shown" not in lines
    rows = {line[0]: line[1:] for line in map(lambda line: re.split(r"\s{2,}", line), lines) if line[0] in summary.ROWS}
    assert rows["trl"] == ["GRPO, TRL GRPOTrainer", "2-3", "51.0", "-", "4.0", "55.0", "20.00 / 21.00", "-", "-", "ok, 200 s"]
    assert rows["pods"][-1] == "ok, 104 s" and "  1 failed, 5 passed, 1 skipped, 420 deselected in 95.31s (0:01:35)" in lines
    command = subprocess.run([sys.executable, str(HERE / "summary.py"), str(logs), str(later)], capture_output=True, text=True)
    assert command.returncode == 0 and command.stdout.splitlines() == lines


@pytest.mark.pure
def test_peak_py_splits_the_peak_at_the_update_and_keeps_the_whole_runs(monkeypatch):
    """peak.PhasePeaks on a stand-in for torch.cuda's one peak counter: over 5 GiB of weights, generation takes 4 GiB
    more, the update 12 and a checkpoint after it 5; the update's peak is its own, the whole run's the larger."""
    import peak

    memory = {"now": 0, "peak": 0}

    def allocate(gib: float) -> None:  # a tensor of `gib` made and freed
        memory["peak"] = max(memory["peak"], memory["now"] + gib * 2**30)

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: memory["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: memory["peak"] + 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: memory.update(peak=memory["now"]))
    peaks = peak.PhasePeaks()
    update = peaks.wrap(lambda rows: allocate(12) or rows)
    memory["now"] = 5 * 2**30  # the weights
    allocate(4)  # generation
    assert update("rows") == "rows"
    allocate(5)  # a checkpoint
    assert peaks.line() == ("CUDA peak allocated 17.00 GiB, reserved 18.00 GiB; "
                            "in the update 17.00 GiB allocated, outside it 10.00")


@pytest.mark.pure
def test_summary_header_names_card_date_commit_versions_model_and_the_tests_counts(logs):
    lines = summary.summary(logs).splitlines()
    for key, value in ENV.items():
        assert f"{key}: {value}" in lines
    assert "tests (pytest -m cuda): failed (exit 1) after 97 s" in lines
    assert "  1 failed, 5 passed, 1 skipped, 420 deselected in 95.31s (0:01:35)" in lines
    assert "  FAILED test_cuda.py::test_cuda_torchrun - AssertionError: no one-line refusal" in lines
    assert "decode step (decode_bench.py): ok, 41 s" in lines
    assert "  decode: graph             6.10 ms/step  (0.78 s)" in lines and "  decode: graph / eager 0.21" in lines
    assert "  eval batch: 64 questions x 1, 512 new tokens, graph: prompts prefilled whole 9.00 s, after their shared prefix 8.00 s (92 tokens): 1.12x" in lines


@pytest.mark.pure
def test_summary_of_tests_stopped_by_the_budget_names_each_outcome_and_the_test_that_was_running(tmp_path):
    (tmp_path / "status.txt").write_text("tests\t124\t324\n")
    (tmp_path / "tests.log").write_text(  # pytest -v -s: a test's prints come between its name and its outcome
        "collected 430 items / 422 deselected / 8 selected\n\ntest_cuda.py::test_a[False] PASSED\n"
        "test_cuda.py::test_b \ncuda sampler gap: mean 1.11e-03\nPASSED\ntest_cuda.py::test_c FAILED\n"
        "test_cuda.py::test_d SKIPPED (needs vLLM)\ntest_cuda.py::test_vllm \nWARNING vLLM is starting\n")
    lines = summary.summary(tmp_path).splitlines()
    assert lines[lines.index("tests (pytest -m cuda): timed out at 324 s") + 1:][:6] == [
        "  stopped before pytest's summary:", "  test_cuda.py::test_a[False] PASSED", "  test_cuda.py::test_b PASSED",
        "  test_cuda.py::test_c FAILED", "  test_cuda.py::test_d SKIPPED", "  test_cuda.py::test_vllm was running"]

@pytest.mark.pure
def test_summary_of_stages_without_rows_names_each_failure_and_gives_no_ratios(tmp_path):
    (tmp_path / "env.txt").write_text("card: X\n")
    (tmp_path / "status.txt").write_text("pods\t1\t30\ngrpo\t137\t110\ntrl\tskipped\tno time left of BUDGET=480 s\n")
    (tmp_path / "pods.log").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n\n")
    lines = summary.summary(tmp_path).splitlines()
    assert [line.split("  ")[-1] for line in lines if line.startswith(("pods  ", "grpo  ", "trl  "))] == [
        "failed (exit 1) after 30 s", "timed out at 110 s", "skipped: no time left of BUDGET=480 s"]
    assert "pods failed: torch.OutOfMemoryError: CUDA out of memory" in lines
    assert not any("ratios" in line or "grpo failed" in line for line in lines)


@pytest.mark.pure
def test_summary_leaves_out_a_row_cut_short_and_a_sampler_gap_that_is_not_finite_and_names_a_folder_without_logs(logs, tmp_path):
    """A stage killed as it wrote leaves half a line; train.py writes a sampler gap that is not finite as null. Both
    ended the summary in a traceback. A LOGS folder that is not one (a call that returned nothing) is named."""
    (logs / "status.txt").write_text("pods\t124\t104\n")
    write_stage(logs, "pods", [(48.0, 3.5), (15.0, 2.0), (16.0, 2.2)], None, sampler_gap_mean=None)
    with (logs / "pods.jsonl").open("a") as rows:
        rows.write('{"step": 4, "elapsed_')
    pods = next(line for line in summary.summary(logs).splitlines() if line.startswith("pods  "))
    assert re.split(r"\s{2,}", pods)[2:4] + re.split(r"\s{2,}", pods)[-2:] == ["2-3", "15.5", "-", "timed out at 104 s"]
    command = subprocess.run([sys.executable, str(HERE / "summary.py"), str(logs), str(tmp_path / "none")], capture_output=True, text=True)
    assert command.returncode == 1 and command.stderr == (
        f"summary.py: {tmp_path / 'none'} holds no status.txt: name the logs folder each check.sh call's logs.tar.gz "
        "unpacks to (unpack each into a folder of its own: all are named logs)\n")


@pytest.mark.pure
def test_check_sh_refuses_an_unknown_stage_in_one_line_before_doing_anything(tmp_path):
    result = subprocess.run(["bash", str(HERE / "check.sh"), "pods", "tset"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "check.sh: unknown stage 'tset'; choose from: tests decode pods old trl grpo vllm\n"
    assert not (tmp_path / "out").exists()


def fake_wheel(folder: Path, name: str, version: str) -> None:
    """A pure-Python wheel of an empty package, enough for pip to install."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.mark.pure
def test_check_sh_installs_another_wheel_set_afresh_so_the_header_names_what_runs(tmp_path):
    """WHEELS (the CUDA tests again with another transformers, in one call): the second set replaces the first whole.
    pip --target --upgrade had left the first version's dist-info beside the second's code, and the header named it."""
    work = tmp_path / "work"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""}
    for version in ("1.0", "2.0"):
        fake_wheel(tmp_path / version, "podsfakepkg", version)
        result = subprocess.run(["bash", str(HERE / "check.sh"), "tests"], capture_output=True, text=True,
                                env={**env, "WORK": str(work), "WHEELS": str(tmp_path / version)}, timeout=120)
        assert f"installing from {tmp_path / version} into {work}/site: podsfakepkg {version}" in result.stdout, result.stdout
        assert sorted(p.name for p in (work / "site").iterdir()) == ["podsfakepkg", f"podsfakepkg-{version}.dist-info"]
    assert result.returncode == 1 and "torch sees no CUDA GPU here" in result.stdout  # this machine's end of the check


def test_decode_bench_times_an_older_tree_with_its_own_decode_step(tmp_path):
    """decode_bench.py's `old` variant: the older tree's sampling.py, and its decode.py where it has one (the decode
    step moved there on 28 November), not the checkout's; the checkout's decode module stays in place."""
    import decode_bench

    root = HERE.parent.parent
    (tmp_path / "sampling.py").write_bytes((root / "sampling.py").read_bytes())
    (tmp_path / "decode.py").write_text((root / "decode.py").read_text() + "\nOLDER_TREE = True\n")
    checkout = sys.modules["decode"]
    old = decode_bench.old_sampling(tmp_path)
    assert sys.modules[old.CudaGraphDecode.__module__].OLDER_TREE and old.reserve_cache is not checkout.reserve_cache
    assert sys.modules["decode"] is checkout and not hasattr(checkout, "OLDER_TREE")


def test_decode_bench_times_each_graph_capture_and_puts_the_sampler_back(monkeypatch):
    import decode_bench
    import sampling

    built = []
    monkeypatch.setattr(sampling, "CudaGraphDecode", lambda *args, **kwargs: built.append(args) or "step")
    stand_in, record = sampling.CudaGraphDecode, []
    with decode_bench.capture_times(record):
        assert sampling.CudaGraphDecode("model", "cache") == "step"
    assert built == [("model", "cache")] and len(record) == 1 and record[0] >= 0
    assert sampling.CudaGraphDecode is stand_in


@pytest.mark.trl
def test_the_timed_stages_run_on_a_cpu_as_check_sh_calls_them_and_summary_reads_their_logs(tmp_path, tiny_model_dir):
    """check.sh's pods and trl stages, each script called as check.sh calls it, on the tiny model for 3 steps: a dry
    run of the check's wiring before GPU minutes are spent on it. trl_gpu.py once imported a function peak.py no longer
    had, so the TRL stage of the next GPU check would have ended in an ImportError."""
    pytest.importorskip("trl", reason="TRL is optional: pip install -r requirements-trl.txt")
    root, logs = HERE.parent.parent, tmp_path / "logs"
    logs.mkdir()
    common = ["--model", str(tiny_model_dir), "--dataset", "arith", "--n", "4", "--max-new-tokens", "4", "--steps", "3"]
    stages = {"pods": ["peak.py", *common, "--out-dir", str(tmp_path / "pods"), "--backend", "hf", "--m", "2"],
              "trl": ["trl_gpu.py", *common, "--out-dir", str(tmp_path / "trl")]}
    for stage, (script, *flags) in stages.items():
        done = subprocess.run([sys.executable, str(HERE / script), *flags], cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (logs / f"{stage}.log").write_text(done.stdout + done.stderr)
        (logs / f"{stage}.jsonl").write_bytes((tmp_path / stage / "metrics.jsonl").read_bytes())
    (logs / "status.txt").write_text("pods\t0\t20\ntrl\t0\t20\n")
    (logs / "env.txt").write_text("".join(f"{key}: {value}\n" for key, value in ENV.items()))
    lines = summary.summary(logs).splitlines()
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in lines if line.split() and line.split()[0] in ("pods", "trl")}
    assert rows["pods"][2] == rows["trl"][2] == "2-3" and rows["pods"][-1] == rows["trl"][-1] == "ok, 20 s"
    assert rows["pods"][7] == rows["trl"][7] == "0.00 / 0.00"  # a CPU: torch.cuda's peaks are 0
    assert any(line.startswith("step time ratios: pods / trl ") for line in lines)
