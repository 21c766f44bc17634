"""prepare.sh's packing and receive.sh, as a borrowed GPU machine runs it, on a small stand-in payload: pieces
arriving one call at a time, in any order, twice, damaged, after the machine was released; then the install and
a repeated call. The real payload (vLLM 0.25.0, three device calls) is measured in README.md beside this file."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure
HERE = Path(__file__).resolve().parent


def pack(site: Path, out: Path, piece_bytes: int) -> list[str]:
    """prepare.sh's packing and splitting alone (VLLM_PACK_ONLY), into `out`; the pieces' names."""
    env = dict(os.environ, VLLM_PACK_ONLY=str(site), VLLM_OUT=str(out), PIECE_BYTES=str(piece_bytes))
    subprocess.run(["bash", str(HERE / "prepare.sh")], env=env, check=True, capture_output=True, text=True)
    return sorted(p.name for p in out.glob("part-*"))


def receive(tmp: Path, parts: Path, *carried: str, recv: str = "recv") -> subprocess.CompletedProcess:
    """One device call: receive.sh with only `carried` (and the manifest) in its parts folder."""
    call = tmp / "call"
    subprocess.run(["rm", "-rf", str(call)], check=True)
    call.mkdir()
    (call / "manifest").write_bytes((parts / "manifest").read_bytes())
    for name in carried:
        (call / name).write_bytes((parts / name).read_bytes())
    env = dict(os.environ, VLLM_PARTS=str(call), VLLM_RECV=str(tmp / recv), VLLM_SITE=str(tmp / "site"),
               VLLM_CHECK_CMD="python3 -c 'import vllm; print(\"imported vllm\", vllm.__version__)'")
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(HERE / "receive.sh")], env=env, capture_output=True, text=True)


@pytest.fixture
def payload(tmp_path):
    site = tmp_path / "built"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text('__version__ = "0.25.0"\n')
    (site / "vllm" / "kernels.bin").write_bytes(random.Random(0).randbytes(300_000))  # incompressible, like cubins
    parts = pack(site, tmp_path / "parts", piece_bytes=120_000)
    return site, tmp_path / "parts", parts


def test_pieces_in_any_order_twice_and_damaged_then_installed(tmp_path, payload):
    site, parts, names = payload
    assert names == ["part-00", "part-01", "part-02"]
    manifest = (parts / "manifest").read_text()
    assert "pieces 3" in manifest and "vllm 0.25.0" in manifest

    first = receive(tmp_path, parts, "part-01")
    assert first.returncode == 10, first.stdout + first.stderr
    assert "part-01: stored" in first.stdout and "still to carry: part-00 part-02" in first.stdout
    assert "released" in first.stdout  # part-00 should have come first: said, not guessed silently

    again = receive(tmp_path, parts, "part-01")
    assert again.returncode == 10 and "part-01: already here" in again.stdout

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest").write_bytes((parts / "manifest").read_bytes())
    bad = bytearray((parts / "part-00").read_bytes())
    bad[1000] ^= 0xFF
    (damaged / "part-00").write_bytes(bytes(bad))
    broken = receive(tmp_path, damaged, "part-00")
    assert broken.returncode == 3 and "sha256" in broken.stdout

    assert receive(tmp_path, parts, "part-00").returncode == 10
    last = receive(tmp_path, parts, "part-02")
    assert last.returncode == 0, last.stdout + last.stderr
    assert "imported vllm 0.25.0" in last.stdout
    installed = tmp_path / "site"
    assert (installed / "vllm" / "kernels.bin").read_bytes() == (site / "vllm" / "kernels.bin").read_bytes()
    assert not list((tmp_path / "recv").glob("part-*"))  # the pieces are dropped once unpacked

    repeat = receive(tmp_path, parts)  # a later call, nothing carried but the manifest
    assert repeat.returncode == 0 and "already installed" in repeat.stdout and "imported vllm 0.25.0" in repeat.stdout


def test_a_released_machine_and_another_build_start_again(tmp_path, payload):
    _, parts, _ = payload
    assert receive(tmp_path, parts, "part-00").returncode == 10
    # another build (other checksums): what was stored is dropped, not mixed
    other = tmp_path / "other-built"
    (other / "vllm").mkdir(parents=True)
    (other / "vllm" / "__init__.py").write_text('__version__ = "0.25.0"\n')
    (other / "vllm" / "kernels.bin").write_bytes(random.Random(1).randbytes(300_000))
    pack(other, tmp_path / "other-parts", piece_bytes=120_000)
    switched = receive(tmp_path, tmp_path / "other-parts", "part-00")
    assert switched.returncode == 10 and "another payload" in switched.stdout
    # a bare /tmp (released machine): the call says what is missing
    fresh = receive(tmp_path, parts, "part-02", recv="recv-fresh")
    assert fresh.returncode == 10 and "still to carry: part-00 part-01" in fresh.stdout
    assert "released" in fresh.stdout
