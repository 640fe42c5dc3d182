"""The comparison helpers and the reference trainer the FSDP parity suites rely on: a helper that
passed a short loss list, or a reference whose piecewise grad were not the full-batch grad, would
let a broken engine pass every functional suite."""
from __future__ import annotations

import pytest
import torch

from tests.functional.common.decoupled import loss_check_problem
from tests.functional.common.mesh_checks import assert_parity
from tests.functional.common.models import build_model
from tests.functional.common.numerics import (
    assert_losses_close,
    max_loss_error,
    max_relative_error,
    model_relative_error,
    relative_error,
)
from tests.functional.common.reference import global_batch, piecewise_grads, train_reference

LOSSES = [1.0, 0.9, 0.8]
PARAMS = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1e-3])}


def test_short_loss_list_fails_every_parity_helper() -> None:
    short = LOSSES[:-1]  # a run that stopped one step early, equal on its prefix
    with pytest.raises(ValueError, match="is longer than"):
        max_loss_error(short, LOSSES)
    with pytest.raises(AssertionError, match="2 steps vs 3 in the reference"):
        assert_losses_close(short, LOSSES, rtol=1e-5)
    with pytest.raises(AssertionError, match="2 steps vs 3"):
        assert_parity(short, PARAMS, LOSSES, PARAMS)
    assert loss_check_problem([1.0, 0.5], [1.0, 0.5, 0.4]) == "2 losses for 3 reference losses"


def test_equal_runs_pass_and_one_bad_step_fails() -> None:
    assert_parity(LOSSES, PARAMS, list(LOSSES), {k: v.clone() for k, v in PARAMS.items()})
    with pytest.raises(AssertionError, match="max relative error 0.0125"):
        assert_losses_close([1.0, 0.9, 0.81], LOSSES, rtol=1e-5)


def test_relative_errors_closed_form() -> None:
    assert relative_error(torch.tensor([3.0, 4.0 + 5e-3]), PARAMS["w"]) == pytest.approx(1e-3, rel=1e-4)
    assert relative_error(torch.tensor([1.0]), torch.tensor([0.0]), scale=torch.tensor([2.0])) == 0.5
    off = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([2e-3])}
    assert max_relative_error(off, PARAMS) == (pytest.approx(1.0), "b")  # the tiny tensor, per tensor
    assert model_relative_error(off, PARAMS) == pytest.approx(1e-3 / 5.0, rel=1e-5)  # negligible overall
    with pytest.raises(AssertionError, match=r"tensor names differ: \['b'\]"):
        max_relative_error({"w": PARAMS["w"]}, PARAMS)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_piecewise_reference_is_the_full_batch_reference_in_fp32(opt: str) -> None:
    """Splitting the batch over 2 ranks x 3 microbatches changes only the order of fp32 sums."""
    full = train_reference(build_model("cnn"), "cnn", opt, 3, 6)
    pieces = train_reference(build_model("cnn"), "cnn", opt, 3, 6, split=(2, 3))
    assert max_loss_error(pieces[0], full[0]) <= 1e-6
    assert max_relative_error(pieces[1], full[1])[0] <= 1e-5


def test_piecewise_bf16_grad_differs_from_the_full_batch_one_only_by_rounding() -> None:
    """In bf16 the pieces are rounded each: the grads differ from the full-batch bf16 grad at
    the bf16 rounding level (measured 2.1e-3 whole-model), far below a wrong scale."""
    model = build_model("cnn", torch.bfloat16)
    inputs, target = global_batch("cnn", 0, 6, torch.bfloat16)
    named = list(model.named_parameters())
    _, full = piecewise_grads(model, named, "cnn", list(inputs), target, (1, 1), torch.float32)
    _, pieces = piecewise_grads(model, named, "cnn", list(inputs), target, (2, 3), torch.float32)
    err = model_relative_error(pieces, full)
    assert 0 < err < 1e-2, err
