"""bench/fp8_bench.py: the FP8 implementations are in the suite's table but not its defaults, and the
target line reads the medians and peaks right."""
from __future__ import annotations

from bench import fp8_bench, impls


def _row(impl: str, tok: float, peak: float, rep: int = 1) -> dict:
    return {"kind": "cell", "size": "1.3b", "impl": impl, "rep": rep, "tok_s_per_gpu": tok, "step_s": 1.0,
            "peak_gib": peak, "rest_gib": 1.0, "build_gib": 1.0}


def test_fp8_impls_are_listed_without_touching_the_defaults() -> None:
    """``bench.impls`` lists the FP8 implementations (no ``register()`` adding them at run time,
    which closed an import cycle), and none of them is a default of the suite."""
    before = list(impls.DEFAULT_IMPLS)
    assert all(i.name in impls.IMPLS for i in fp8_bench.FP8_IMPLS)
    assert list(impls.DEFAULT_IMPLS) == before
    assert not any(i.name in impls.DEFAULT_IMPLS for i in fp8_bench.FP8_IMPLS)
    assert impls.unavailable_reason("ours-fp8-native-current", 2) is None


def test_target_line_met_and_not_met() -> None:
    met = fp8_bench.target_line([_row("ours-z3", 1000, 20.0), _row("ours-fp8-te-current", 1300, 19.0)])
    assert "throughput 1.300x" in met and ": met" in met
    slow = fp8_bench.target_line([_row("ours-z3", 1000, 20.0), _row("ours-fp8-te-current", 1100, 19.0)])
    assert "NOT met" in slow
    heavy = fp8_bench.target_line([_row("ours-z3", 1000, 20.0), _row("ours-fp8-te-current", 1300, 21.0)])
    assert "NOT met" in heavy
    assert "n/a" in fp8_bench.target_line([_row("ours-z3", 1000, 20.0)])


def test_target_line_reports_fused_and_other_recipes_only_when_both_ran() -> None:
    rows = [_row("ours-z3-fused", 1000, 20.0), _row("ours-fp8-te-current-fused", 1250, 19.0),
            _row("ours-fp8-te-delayed", 900, 19.0), _row("te-fp8-ref-delayed", 1000, 19.0)]
    text = fp8_bench.target_line(rows)
    assert "ours-fp8-te-current-fused / ours-z3-fused throughput 1.250x (target >= 1.2x)" in text
    assert "ours-fp8-te-delayed / te-fp8-ref-delayed throughput 0.900x (target >= 0.95x)" in text
    assert "NOT met" in text.split("te-fp8-ref-delayed throughput")[1]
    assert "block" not in text  # neither side of the block lines ran: no line, not even n/a
    assert text.count("n/a") == 2  # the two targets (ours-fp8-te-current) are always listed
