"""data.py: the built-in arithmetic task, the GSM8K-style .jsonl reader and their errors."""

from __future__ import annotations

import json
import logging

import pytest

import data

pytestmark = pytest.mark.pure  # no torch, transformers, peft or vLLM code: CI runs it once


def test_arith_levels_compute_their_answers():
    rng = __import__("random").Random(3)
    for level in (1, 2, 3, 4):
        for _ in range(50):
            e = data.arith_problem(rng, level)
            numbers = [int(x) for x in __import__("re").findall(r"\d+", e.question)]
            if level == 1 or "gets" in e.question:
                assert int(e.answer) == numbers[0] + numbers[1]
            elif level == 4:
                assert int(e.answer) == numbers[0] + numbers[1] - numbers[2]
            else:
                assert int(e.answer) == numbers[0] - numbers[1] >= 0


def test_arith_splits_are_reproducible_and_distinct():
    assert data.load_examples("arith", "train", seed=1)[:5] == data.load_examples("arith", "train", seed=1)[:5]
    assert data.load_examples("arith", "test") == data.load_examples("arith", "test")
    test, train = data.load_examples("arith", "test"), data.load_examples("arith", "train", seed=0)
    assert data.load_examples("arith", "test", seed=5) == test  # the test split has its own seed, not the run's
    assert sum(a != b for a, b in zip(test, train)) > 0.95 * len(test)  # not the train stream's start (short sums recur in both)
    with pytest.raises(data.DataError, match=f"^--seed {data.ARITH_TEST_SEED} draws the arithmetic task's test problems"):
        data.load_examples("arith", "train", seed=data.ARITH_TEST_SEED)  # its stream would start with the test split


def test_a_dataset_file_that_is_not_utf8_stops_in_one_line_and_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"question": "Wie viel kostet ein Brötchen?", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(data.DataError, match=f"^{path} is not UTF-8 text \\(invalid start byte at byte 36\\); save it as UTF-8 JSON lines$"):
        data.load_examples(str(path), "train")
    path.write_bytes(b"\xef\xbb\xbf" + '{"question": "q", "answer": "1"}\n'.encode())  # UTF-8 with a byte-order mark
    assert data.load_examples(str(path), "train") == [data.Example("q", "1")]


def test_jsonl_reader_accepts_gsm8k_solutions_and_bare_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q1", "answer": "x\\n#### 1,200"}\n{"question": "q2", "answer": 7}\nnot json\n{"question": "q3"}\n')
    assert data.load_examples(str(path), "train") == [data.Example("q1", "1200"), data.Example("q2", "7")]
    path.write_text('{"question": "q1", "answer": "- 5"}\n{"question": "q2", "answer": "x\\n#### - 3"}\n')
    assert data.load_examples(str(path), "train") == [data.Example("q1", "-5"), data.Example("q2", "-3")]  # no bullets in a reference
    # JSON numbers as Python writes them: 1e-05 was read as 5 (the last number of "1e-05"); a boolean is no answer
    path.write_text(json.dumps({"question": "q1", "answer": 0.00001}) + "\n" + json.dumps({"question": "q2", "answer": 1e21}) + "\n"
                    + json.dumps({"question": "q3", "answer": 2.5}) + "\n" + json.dumps({"question": "q4", "answer": True}) + "\n")
    assert data.load_examples(str(path), "train") == [data.Example("q1", "0.00001"), data.Example("q2", "1000000000000000000000"),
                                                      data.Example("q3", "2.5")]
    # the same written as strings: "2.5e3" was read as 3 and "1e-5" as 5, the last number of each
    rows = [("q1", "2.5e3"), ("q2", "1e-5"), ("q3", " -4E2 "), ("q4", "1e999999999"), ("q5", "NaN"), ("q6", "72 apples"),
            ("q7", "The answer is 7 (from 3 apples)"), ("q8", "3 h.\n#### 7 from 3")]  # not one number: read as 3, without a word
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    assert data.load_examples(str(path), "train") == [data.Example("q1", "2500"), data.Example("q2", "0.00001"),
                                                      data.Example("q3", "-400"), data.Example("q6", "72")]


def test_jsonl_reader_errors_name_the_problem(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_examples(str(tmp_path / "missing.jsonl"), "train")
    (tmp_path / "bad.jsonl").write_text('{"text": "no question"}\n')
    with pytest.raises(data.DataError, match="no usable rows"):
        data.load_examples(str(tmp_path / "bad.jsonl"), "train")
    too_long = tmp_path / ("a" * 300 + ".jsonl")  # an OSError of the file system (also: no permission) was a traceback
    with pytest.raises(data.DataError, match=f"^cannot read dataset file {too_long} \\(File name too long\\); pass a .jsonl "):
        data.load_examples(str(too_long), "train")
    rows = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(3)]  # trained on its last row alone
    (tmp_path / "array.jsonl").write_text("[\n" + ",\n".join(map(json.dumps, rows)) + "\n]\n")
    with pytest.raises(data.DataError, match="is a JSON array; write one JSON object per line"):
        data.load_examples(str(tmp_path / "array.jsonl"), "train")


def test_arith_level_names():
    assert data.arith_levels("arith") == (1, 2, 3)
    assert data.arith_levels("arith:21") == (1, 2)
    assert data.arith_levels("gsm8k") is None and data.arith_levels("x.jsonl") is None
    assert all(e.question.startswith("What is") for e in data.load_examples("arith:1", "test"))
    with pytest.raises(data.DataError, match="levels are digits 1 to 4"):
        data.arith_levels("arith:5")


def test_a_malformed_line_in_a_jsonl_dataset_is_skipped_and_reported(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answ\n\n{"question": "3+3?", "answer": 6}\n'
                    + '{"question": "big", "answer": ' + "9" * 5000 + '}\n' + "[" * 100_000 + "\n")  # these two: tracebacks
    with caplog.at_level(logging.INFO, logger="pods"):
        examples = data.load_examples(str(path), "train")
    assert [e.answer for e in examples] == ["2", "6"]
    assert "skipped 3 unusable line(s)" in caplog.text and "first at line 2" in caplog.text


def test_hub_unreachable_answers_within_its_limit_though_the_dns_lookup_hangs(monkeypatch):
    """create_connection's timeout covers the connection, not the lookup before it: a resolver that hangs
    (here for 30 s) would hold hub_unreachable for its own timeout, and every offline start with it. The
    lookup and the connection together get 2 x timeout_s."""
    import socket
    import threading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    for variable in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(variable, raising=False)  # (the machine's own)
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: release.wait(30) and [])
    try:
        assert data.hub_unreachable(timeout_s=0.1) == "huggingface.co unreachable: no answer in 0.2 s"
    finally:
        release.set()

    def refused(address, timeout):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    assert data.hub_unreachable(timeout_s=10) == "huggingface.co unreachable: [Errno 111] Connection refused"
    asked = []
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: asked.append(address) or socket.socket())  # answered
    assert data.hub_unreachable(timeout_s=10) is None
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a mirror: its host and port are asked, not huggingface.co:443
    assert data.hub_unreachable(timeout_s=10) is None
    assert asked == [("huggingface.co", 443), ("127.0.0.1", 9)]
    monkeypatch.delenv("HF_ENDPOINT")
    monkeypatch.setenv("HTTPS_PROXY", "proxy.example:3128")  # behind a proxy the hub is reached through it: a direct
    assert data.hub_unreachable(timeout_s=10) is None  # connection to huggingface.co:443 failed and the run was refused
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert data.hub_unreachable(timeout_s=10) is None and asked[2:] == [("proxy.example", 3128), ("huggingface.co", 443)]
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.delenv("NO_PROXY")
    assert data.hub_unreachable(timeout_s=10) == "proxy.example (the proxy) unreachable: [Errno 111] Connection refused"
    monkeypatch.setenv("HTTPS_PROXY", "http://[::1")  # a traceback at start
    assert data.hub_unreachable(timeout_s=10) == "the proxy 'http://[::1' (HTTPS_PROXY or the like) is not a URL: Invalid IPv6 URL"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:99999")  # a port urlparse refuses
    assert data.hub_unreachable(timeout_s=10).startswith("the proxy 'http://proxy.example:99999' (HTTPS_PROXY or the like) is not a URL")
    monkeypatch.setenv("HTTPS_PROXY", "socks5h://proxy.example")  # SOCKS' port, not HTTP's
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: asked.append(address) or socket.socket())
    assert data.hub_unreachable(timeout_s=10) is None and asked.pop() == ("proxy.example", 1080)
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # `datasets` only: a model is still looked up on the hub
    assert data.hub_unreachable(timeout_s=10) is None and len(asked) == 5
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline by choice: the hub is not asked
    assert data.hub_unreachable(timeout_s=10) == "HF_HUB_OFFLINE is set" and len(asked) == 5


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_gsm8k_offline_by_choice_is_left_to_datasets_cache(variable, monkeypatch):
    """With an offline variable set, GSM8K is left to `datasets`, which reads its cache, without asking the hub."""
    import datasets

    monkeypatch.setattr(data, "hub_unreachable", lambda: pytest.fail("the hub was asked"))
    monkeypatch.setenv(variable, "1")
    read = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, split: read.append(split) or [{"question": "1+1?", "answer": "#### 2"}])
    assert [e.answer for e in data.load_examples("gsm8k", "test")] == ["2"] and read == ["test"]
