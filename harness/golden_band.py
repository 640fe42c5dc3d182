"""Measure each golden cell's cross-platform spread and write its band.

A golden file's *band* is how far a run may differ from it when the run's fingerprint differs
from the file's (another torch, BLAS, CPU capability, GPU stack: ``harness.golden``). It is
measured, not guessed: make the same cells under each variant you can reach into a copy of the
golden directory (``pytest -m golden --golden-update --golden-dir VARIANT_DIR`` with that variant's
torch or environment; ``HARNESS_NUMERICS=unpinned`` runs the cells without pinned numerics), then::

    python -m harness.golden_band tests/golden/cpu --variant unpinned=/tmp/unpinned/cpu \\
        --variant torch-2.14.1=/tmp/t214/cpu [--factor 10] [--floor fp32=1e-6] [--write]

Per cell and series the spread is the largest relative difference ``|variant - file| / |file|``
over the steps and variants; the band is ``factor`` x spread, but at least the dtype's floor
(a cell may happen not to move under the variants measured; another platform's rounding still
would). ``--write`` stores the band and how it was measured in the reference files (review the
diff like any golden change). Without ``--write`` it prints the table only.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
from dataclasses import dataclass

from harness import golden_file
from harness.golden_file import GoldenFile, GoldenFileError

TINY = 1e-30
DEFAULT_FACTOR = 10.0  # measured variants are few: another machine may spread several times more
# Relative floors per cell dtype (the series themselves are fp32/fp64 reductions: a few ulps of
# fp32 for fp32 cells; for bf16 and FP8 models, about what one rounding flip in the model moves a loss).
DEFAULT_FLOORS = {"fp32": 1e-6, "fp64": 1e-12, "bf16": 1e-3, "fp16": 1e-4, "fp8": 1e-3, "": 1e-6}


@dataclass
class CellSpread:
    """One cell's measured spread per series and variant."""

    path: pathlib.Path
    content: GoldenFile
    spread: dict[str, dict[str, float]]  # series -> variant -> max relative difference

    def band(self, factor: float, floors: dict[str, float]) -> dict[str, float]:
        floor = floors.get(self.content.dtype, floors[""])
        return {name: max(factor * max(by_variant.values(), default=0.0), floor)
                for name, by_variant in self.spread.items()}


def relative_spread(run: list[float], ref: list[float]) -> float:
    """The largest ``|run - ref| / |ref|`` over the steps (inf when lengths or NaNs differ)."""
    if len(run) != len(ref):
        return math.inf
    worst = 0.0
    for got, want in zip(run, ref, strict=True):
        if math.isnan(got) or math.isnan(want):
            if math.isnan(got) != math.isnan(want):
                return math.inf
            continue
        worst = max(worst, 0.0 if got == want else abs(got - want) / max(abs(want), TINY))
    return worst


def measure(reference: pathlib.Path, variants: dict[str, pathlib.Path]) -> list[CellSpread]:
    """The spread of every format-2 file in ``reference`` against the variants' files of the same cell."""
    out = []
    for path in sorted(reference.glob("*.json")):
        content = golden_file.read(path)
        if content is None or content.fingerprint is None:
            continue
        spread: dict[str, dict[str, float]] = {name: {} for name in content.series}
        for label, directory in variants.items():
            other = golden_file.read(directory / path.name)
            if other is None:
                continue
            for name, values in content.series.items():
                spread[name][label] = relative_spread(other.series.get(name, []), values)
        out.append(CellSpread(path, content, spread))
    return out


def _floors(items: list[str]) -> dict[str, float]:
    floors = dict(DEFAULT_FLOORS)
    for item in items:
        dtype, _, value = item.partition("=")
        try:
            floors[dtype] = float(value)
        except ValueError:
            raise SystemExit(f"--floor {item!r}: expected DTYPE=NUMBER, e.g. fp32=1e-6") from None
    return floors


def _variants(items: list[str]) -> dict[str, pathlib.Path]:
    out = {}
    for item in items:
        label, _, path = item.partition("=")
        if not label or not path or not pathlib.Path(path).is_dir():
            raise SystemExit(f"--variant {item!r}: expected LABEL=DIRECTORY of golden files made under that variant")
        out[label] = pathlib.Path(path)
    return out


def _note(cell: CellSpread, factor: float, floors: dict[str, float]) -> str:
    worst = {label: max((s.get(label, 0.0) for s in cell.spread.values()), default=0.0)
             for label in sorted({v for s in cell.spread.values() for v in s})}
    measured = ", ".join(f"{label} {value:.3g}" for label, value in worst.items()) or "no variant"
    floor = floors.get(cell.content.dtype, floors[""])
    return (f"band = max({factor:g} x the largest relative spread measured, {floor:g} ({cell.content.dtype or 'any'} "
            f"floor)); spread per variant (worst series): {measured}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.golden_band", description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=pathlib.Path, help="the directory of golden files to give bands")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR", required=True)
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR)
    parser.add_argument("--floor", action="append", default=[], metavar="DTYPE=REL")
    parser.add_argument("--write", action="store_true", help="store the bands in the reference files")
    args = parser.parse_args(argv)
    if args.factor < 1:
        parser.error(f"--factor {args.factor:g}: must be >= 1 (a band below the measured spread fails at once)")
    floors, variants = _floors(args.floor), _variants(args.variant)
    try:
        cells = measure(args.reference, variants)
    except GoldenFileError as exc:
        print(f"golden_band: {exc}", file=sys.stderr)
        return 2
    for cell in cells:
        band = cell.band(args.factor, floors)
        for name, by_variant in cell.spread.items():
            spreads = " ".join(f"{label}={value:.3g}" for label, value in sorted(by_variant.items()))
            print(f"{cell.path.stem:28s} {name:16s} band {band[name]:.3g}  spread {spreads}")
        if args.write:
            cell.content.band, cell.content.band_note = band, _note(cell, args.factor, floors)
            golden_file.write(cell.path, cell.content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
