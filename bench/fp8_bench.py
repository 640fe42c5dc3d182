"""FP8 vs bf16 training of the bench GPT under our ZeRO-3, with FSDP2 bf16 in the same run.

    python -m bench.fp8_bench --nproc-per-node 2                 # ~3 min on 2 H200s
    python -m bench.fp8_bench --sizes 2.7b --reps 3                # world 1

The TE cells need TransformerEngine with its PyTorch extension, built for the installed torch and
CUDA (``pip install --no-build-isolation 'transformer_engine[pytorch]'``, see TE's installation
guide); without it they are skipped with the reason. Runs ``bench.suite`` (each cell in its own
process, implementations alternating inside each repetition, medians, peak memory, the same init
and data) with these implementations (listed in ``bench.impls``):

- ``ours-fp8-te-current`` / ``ours-fp8-te-delayed``: the bench GPT whose block linears (qkv,
  proj, fc1, fc2) are ``te.Linear`` built under ``te.quantized_model_init`` with
  Float8CurrentScaling / DelayedScaling, so their weights are FP8 parameters that our ZeRO-3
  all-gathers as FP8 bytes (sharded quantisation, one amax all-reduce per step), with
  ``keep_fp8_transpose_cache=True``; forward under ``te.autocast``. The weights start from the
  bf16 model's values (TE's ``init_method`` copies them), embeddings, LayerNorms and the head stay
  bf16 (``bench/gpt.py`` ties the head to the embedding, which is no FP8 candidate);
- ``ours-fp8-te-current-bf16params``: the same TE modules with bf16 parameters (our ZeRO-3
  gathers bf16, TE quantises in every forward), to separate FP8 compute from the FP8 gather;
- ``ours-fp8-te-current-regather``: FP8 parameters without ``keep_fp8_transpose_cache`` (the
  backward gathers the FP8 bytes again instead of holding the transposes: less memory);
- ``ours-fp8-te-block``: the same with Float8BlockScaling (``Float8BlockwiseQTensor`` weights;
  TE's ``quantize_master_weights`` does the sharded requantisation, the column-wise copies are
  built after each forward gather);
- ``ours-fp8-native-current``: the torch-native path (``fsdp_impl.fp8.convert_to_fp8`` with
  ``fp8_params=True``, ``torch._scaled_mm``), also the CPU smoke path (``--device cpu --sizes tiny``);
- ``-fused`` variants (``ours-z3-fused``, ``ours-fp8-te-current-fused``, ``-delayed-fused``,
  ``-block-fused``): the same with torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``)
  instead of the suite's default foreach AdamW, so a comparison with ``te-fp8-ref`` (TE's fused
  Adam) does not measure the optimizer kernel; compare fused with fused (``ours-z3-fused``);
- ``te-fp8-ref`` (``-delayed``, ``-block``): the reference a user compares with, TE's own best
  case: the same ``te.Linear`` FP8-parameter model (``te.quantized_model_init``) trained as a plain
  module without FSDP or any data parallelism, with TE's ``FusedAdam(master_weights=True)`` (fp32
  master weights and moments in the optimizer, FP8 weights requantised by TE after each step).
  At world > 1 every rank trains its own copy (no communication); its numbers are per GPU as
  everywhere.

Default: ``ours-z3`` (bf16), ``fsdp2`` (bf16), the two TE FP8 runs and ``te-fp8-ref``; 1.3B, 2
repetitions, 8 timed steps. The summary after the table states the targets: TE
Float8CurrentScaling >= 1.2x the throughput of ``ours-z3`` at no higher peak memory, and >= 0.95x
``te-fp8-ref``.
"""
from __future__ import annotations

import os
import sys

from bench import impls, report

# (implementation, reference, throughput ratio needed, peak memory no higher than the reference's):
# the targets for TE current scaling, then the same lines for the fused-optimizer variants
# and the delayed and block recipes (reported when both sides ran)
TARGETS = [("ours-fp8-te-current", "ours-z3", 1.2, True), ("ours-fp8-te-current", "te-fp8-ref", 0.95, False)]
TARGET = TARGETS[0][:3]
_REPORTED = [(f"ours-fp8-te-{kind}{fused}", ref, need, peak)
             for kind, suffix in (("current", ""), ("delayed", "-delayed"), ("block", "-block"))
             for fused in ("", "-fused")
             for ref, need, peak in ((f"ours-z3{fused}", 1.2, True), (f"te-fp8-ref{suffix}", 0.95, False))]
DEFAULT = ["ours-z3", "fsdp2", "ours-fp8-te-current", "ours-fp8-te-delayed", "te-fp8-ref"]
# The FP8 implementations (listed in ``bench.impls`` with the others).
FP8_IMPLS = impls.FP8_IMPLS


def target_line(rows: list[dict]) -> str:
    """The acceptance targets, per measured size: throughput ratio (and peak memory where it counts)."""
    cells = report.summarise(rows)
    lines = []
    for size in dict.fromkeys(c.size for c in cells):
        for impl, ref, need, peak in TARGETS + [t for t in _REPORTED if t not in TARGETS]:
            a = next((c for c in cells if c.size == size and c.impl == impl), None)
            b = next((c for c in cells if c.size == size and c.impl == ref), None)
            if a is None or b is None:
                if (impl, ref, need, peak) in TARGETS:
                    lines.append(f"- {size}: {impl} vs {ref}: n/a (not both measured)")
                continue
            r = a.tok_s / b.tok_s
            ok = r >= need and (not peak or a.peak_gib <= b.peak_gib)
            lines.append(f"- {size}: {impl} / {ref} throughput {r:.3f}x (target >= {need}x), peak "
                         f"{a.peak_gib:.2f} vs {b.peak_gib:.2f} GiB{'' if peak else ' (not part of this target)'}: "
                         f"{'met' if ok else 'NOT met'}")
    return "\n".join(["", "FP8 targets:", *lines])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=")[0] for a in argv}
    defaults = {"--impls": ",".join(DEFAULT), "--reps": "2", "--steps": "8", "--out": "fp8_bench.jsonl"}
    for flag, value in defaults.items():
        if flag not in given:
            argv += [flag, value]
    from bench import suite

    args = suite.parse_args(argv)
    code = suite.main(argv)
    if os.environ.get("RANK", "0") == "0" and args.out.exists():
        text = target_line(report.load(args.out))
        print(text, flush=True)
        if args.md is not None:
            with args.md.open("a") as f:
                f.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

