"""``bench.upload_probe``: the splits cover a unit's buffer exactly once, every split steps the
same bits (the probe compares times of the same update), and without CUDA it says so."""
from __future__ import annotations

import pytest
import torch

from bench import upload_probe


@pytest.mark.parametrize("split", ["unit", "block", "1"])
def test_pieces_tile_the_buffer(split: str) -> None:
    hidden = 64
    n = 12 * hidden * hidden + 9 * hidden  # a bench GPT block's params, norms and biases
    pieces = upload_probe._pieces(n, split, hidden)
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(b > a for a, b in pieces)
    assert all(nxt[0] == prev[1] for prev, nxt in zip(pieces, pieces[1:], strict=False))
    if split == "block":
        assert [b - a for a, b in pieces[:3]] == [3 * hidden * hidden, 3 * hidden, hidden * hidden]


def test_chunks_of_n_mib() -> None:
    chunk = 2**20 // 4  # one MiB of fp32
    assert upload_probe._pieces(2 * chunk + 5, "1", 64) == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 2 * chunk + 5)]


def test_every_split_steps_the_same_bits() -> None:
    hidden, n = 16, 12 * 16 * 16 + 9 * 16
    torch.manual_seed(0)
    start = [torch.randn(n), torch.randn(n), torch.rand(n), torch.rand(n)]
    results = []
    for split in ("unit", "block"):
        p, g, m, v = (t.clone() for t in start)
        pieces = upload_probe._pieces(n, split, hidden)
        upload_probe._adam([p[a:b] for a, b in pieces], [g[a:b] for a, b in pieces],
                           [m[a:b] for a, b in pieces], [v[a:b] for a, b in pieces])
        results.append((p, m, v))
    assert not torch.equal(results[0][0], start[0])  # it stepped
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert upload_probe.main(["--units", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["adam", "copy:unit", "up:0", "up:-4", "up:half", ","])
def test_a_bad_mode_is_refused_naming_what_is_allowed(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        upload_probe.main(["--modes", bad])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--modes" in err and ("KIND:SPLIT" in err or "at least one" in err), err


def test_good_modes_are_kept_in_order() -> None:
    assert upload_probe.check_modes("up:block, adam:64,adam:unit") == ["up:block", "adam:64", "adam:unit"]
