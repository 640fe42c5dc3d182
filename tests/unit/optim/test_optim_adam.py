"""fsdp_impl.optim.Adam/AdamW against torch.optim.Adam/AdamW as the independent reference."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_impl.optim import Adam, AdamW

PAIRS = [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)]
CONFIGS: list[dict[str, Any]] = [
    {},
    {"weight_decay": 0.1},
    {"amsgrad": True},
    {"maximize": True, "weight_decay": 0.05},
    {"foreach": True, "weight_decay": 0.1, "amsgrad": True},
    {"foreach": True, "maximize": True},
    {"foreach": False, "betas": (0.8, 0.99), "eps": 1e-6},
]
STEPS = 6
LR = 1e-2


def _make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (0,), (4, 2, 2)]  # (0,) = an empty tensor, as an empty shard is
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor | None]:
    """Deterministic grads; param 1 only gets one every other step (exercises skipping)."""
    gen = torch.Generator().manual_seed(1000 + step)
    grads: list[torch.Tensor | None] = [torch.randn(p.shape, generator=gen) for p in params]
    if step % 2 == 1:
        grads[1] = None
    return grads


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, attr: str = "grad") -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(params, step), strict=True):
            if attr == "grad":
                p.grad = g
            else:
                p.decoupled_grad = g
        opt.step()


def _assert_params_close(ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float, atol: float) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        a = a.full_tensor() if isinstance(a, DTensor) else a
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol, msg=f"param {i}")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS, ids=["Adam", "AdamW"])
def test_matches_torch_fp32(ours_cls: type, torch_cls: type, config: dict[str, Any]) -> None:
    """fp32 moments: same operation sequence as torch, so agreement to fp32 rounding (<=1e-6 rel)."""
    ours_p, ref_p = _make_params(), _make_params()
    ours = ours_cls(ours_p, lr=LR, **config)
    ref = torch_cls(ref_p, lr=LR, **config)
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)
    moved = max((p - q).abs().max().item() for p, q in zip(ours_p, _make_params(), strict=True) if p.numel())
    assert moved > STEPS * LR * 0.1, "the optimizer did not move the parameters"
    for p, q in zip(ours_p, ref_p, strict=True):
        if p in ours.state:
            assert ours.state[p]["step"].item() == ref.state[q]["step"].item()
    assert ours.state[ours_p[1]]["step"].item() == STEPS // 2  # skipped without a grad, like torch


def test_param_groups_and_tensor_lr() -> None:
    ours_p, ref_p = _make_params(), _make_params()
    groups = lambda ps: [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "weight_decay": 0.2}]  # noqa: E731
    ours = AdamW(groups(ours_p), lr=torch.tensor(LR))
    ref = torch.optim.AdamW(groups(ref_p), lr=torch.tensor(LR))
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS, ids=["Adam", "AdamW"])
def test_capturable_matches_torch(ours_cls: type, torch_cls: type) -> None:
    """capturable keeps the step on the param's device and uses tensor-only bias correction.

    Its formula (torch's capturable one) reorders the divisions, so it agrees with the
    non-capturable reference to a few fp32 ulps rather than bit for bit.
    """
    ours_p, ref_p = _make_params(), _make_params()
    ours = ours_cls(ours_p, lr=LR, capturable=True, weight_decay=0.1, amsgrad=True)
    ref = torch_cls(ref_p, lr=LR, weight_decay=0.1, amsgrad=True)
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-6)
    step = ours.state[ours_p[0]]["step"]
    assert step.device == ours_p[0].device and step.dtype == torch.float32


FUSED_CONFIGS: list[dict[str, Any]] = [
    {},
    {"weight_decay": 0.1, "amsgrad": True},
    {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": torch.tensor(3e-3)},
]


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS, ids=["Adam", "AdamW"])
def test_fused_matches_torch_fused_bitwise(ours_cls: type, torch_cls: type, config: dict[str, Any]) -> None:
    """fused=True calls the same fused kernel as torch's fused=True, so the results are equal bit
    for bit (CPU has that kernel too); the step counter lives on the param's device."""
    ours_p, ref_p = _make_params(), _make_params()
    ours = ours_cls(ours_p, **{"lr": LR, **config}, fused=True)
    ref = torch_cls(ref_p, **{"lr": LR, **config}, fused=True)
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    for i, (a, b, start) in enumerate(zip(ours_p, ref_p, _make_params(), strict=True)):
        assert torch.equal(a.detach(), b.detach()), f"param {i} differs from torch's fused step"
        if a.numel():
            assert not torch.equal(a.detach(), start.detach()), f"param {i} did not move"
    step = ours.state[ours_p[0]]["step"]
    assert step.device == ours_p[0].device and step.item() == STEPS


def test_fused_refuses_grads_in_another_dtype() -> None:
    """The fused kernel updates in one dtype: a bf16 decoupled grad on an fp32 param is named."""
    params = _make_params()
    opt = AdamW(params, lr=LR, fused=True, use_decoupled_grad=True)
    for p in params:
        p.decoupled_grad = torch.ones(p.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused=True cannot update this parameter: grad is torch.bfloat16"):
        opt.step()


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS, ids=["Adam", "AdamW"])
def test_capturable_foreach_matches_torch(ours_cls: type, torch_cls: type) -> None:
    """capturable=True with foreach=True: the multi-tensor capturable formula (torch's, which
    reorders the divisions), fp32-rounding-close to torch's non-capturable reference. On CUDA the
    bit-for-bit comparison with torch's own capturable foreach step is in test_optim_capturable."""
    ours_p, ref_p = _make_params(), _make_params()
    ours = ours_cls(ours_p, lr=torch.tensor(LR), capturable=True, foreach=True, weight_decay=0.1, amsgrad=True)
    ref = torch_cls(ref_p, lr=LR, foreach=True, weight_decay=0.1, amsgrad=True)
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-6)
    assert ours.state[ours_p[0]]["step"].item() == STEPS


@pytest.mark.parametrize("foreach", [False, True])
def test_bf16_moments_close_to_fp32(foreach: bool) -> None:
    """bf16 moments with fp32 math stay within a bounded distance of the fp32 reference.

    bf16 keeps 8 significant bits, so each stored moment is off by <= 2^-9 relative; through the
    EMAs over a few steps that is a few percent of one Adam update, whose size is about lr.
    Hence the bound ``STEPS * lr * 0.05`` per element: loose enough for rounding, far tighter
    than the parameters' total movement (~STEPS * lr), so a wrong update would fail it.
    """
    ours_p, ref_p = _make_params(), _make_params()
    ours = AdamW(ours_p, lr=LR, foreach=foreach, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    ref = torch.optim.AdamW(ref_p, lr=LR)
    _run(ours, ours_p, STEPS)
    _run(ref, ref_p, STEPS)
    state = ours.state[ours_p[0]]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    assert ours_p[0].dtype == torch.float32
    _assert_params_close(ours_p, ref_p, rtol=0, atol=STEPS * LR * 0.05)
    diff = max((p - q).abs().max().item() for p, q in zip(ours_p, ref_p, strict=True) if p.numel())
    assert diff > 0, "bf16 moments gave bit-identical results: moments were not stored in bf16"


def test_bf16_grads_and_params_use_fp32_math() -> None:
    """bf16 decoupled grads (autograd forbids a bf16 ``.grad`` on an fp32 param, hence the
    decoupled attribute) are upcast: the update equals the fp32 reference fed the same values."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(64, generator=gen)
    grads = [torch.randn(64, generator=gen).bfloat16() for _ in range(4)]
    ours_p = torch.nn.Parameter(start.clone())
    ref_p = torch.nn.Parameter(start.clone())
    ours = Adam([ours_p], lr=LR, use_decoupled_grad=True)
    ref = torch.optim.Adam([ref_p], lr=LR)
    for g in grads:
        ours_p.decoupled_grad = g  # stays bf16: no cast on our side
        ref_p.grad = g.float()
        ours.step()
        ref.step()
    torch.testing.assert_close(ours_p.detach(), ref_p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the multi-tensor CUDA kernels)")
@pytest.mark.parametrize("foreach", [None, False])
def test_bf16_decoupled_grads_and_moments_on_cuda_close_to_fp32(foreach: bool | None) -> None:
    """The precision-aware step as a large offloaded run takes it on a GPU: fp32 CUDA params,
    bf16 decoupled grads, bf16 moments, torch's default path there (None: the multi-tensor
    kernels) and the single-tensor loop, against torch's fp32 AdamW fed the same grads. The
    bound is ``test_bf16_moments_close_to_fp32``'s (bf16 moments); a wrong update fails it."""
    ours_p = [torch.nn.Parameter(p.detach().cuda()) for p in _make_params()]
    ref_p = _make_params()
    ours = AdamW(ours_p, lr=LR, foreach=foreach, use_decoupled_grad=True, exp_avg_dtype=torch.bfloat16,
                 exp_avg_sq_dtype=torch.bfloat16)
    ref = torch.optim.AdamW(ref_p, lr=LR)
    for step in range(STEPS):
        for p, q, g in zip(ours_p, ref_p, _grads(ref_p, step), strict=True):
            p.decoupled_grad = None if g is None else g.bfloat16().cuda()
            q.grad = None if g is None else g.bfloat16().float()
        ours.step()
        ref.step()
    _assert_params_close([p.cpu() for p in ours_p], ref_p, rtol=0, atol=STEPS * LR * 0.05)


def test_reads_decoupled_grad_when_flag_set() -> None:
    ours_p, ref_p = _make_params(), _make_params()
    ours = AdamW(ours_p, lr=LR, use_decoupled_grad=True)
    assert ours.use_decoupled_grad is True
    ref = torch.optim.AdamW(ref_p, lr=LR)
    _run(ours, ours_p, STEPS, attr="decoupled_grad")
    _run(ref, ref_p, STEPS)
    assert all(p.grad is None for p in ours_p)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flag,attr", [(False, "decoupled_grad"), (True, "grad")])
def test_grad_on_other_attribute_is_a_warned_no_op(flag: bool, attr: str) -> None:
    """The seed-2 situation seen from the optimizer: nothing to step on must not pass silently."""
    params = _make_params()
    before = [p.detach().clone() for p in params]
    opt = Adam(params, lr=LR, use_decoupled_grad=flag)
    with pytest.warns(RuntimeWarning, match="use_decoupled_grad"):
        _run(opt, params, 1, attr=attr)
    _assert_params_close(params, before, rtol=0, atol=0)
    assert len(opt.state) == 0


def test_zero_grad_clears_decoupled_grad() -> None:
    params = _make_params()
    opt = Adam(params, use_decoupled_grad=True)
    for p in params:
        p.decoupled_grad = torch.ones_like(p)
    kept = params[0].decoupled_grad
    opt.zero_grad(set_to_none=False)
    assert params[0].decoupled_grad is kept and kept.abs().sum().item() == 0
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in params)


def test_flag_is_a_read_only_property() -> None:
    opt = Adam(_make_params())
    assert opt.use_decoupled_grad is False
    with pytest.raises(AttributeError):
        opt.use_decoupled_grad = True  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1.0}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"betas": (0.9,)}, "betas"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"fused": "yes"}, "fused"),
        ({"fused": True, "foreach": True}, "fused=True and foreach=True"),
        ({"fused": True, "exp_avg_dtype": torch.bfloat16}, "fused=True needs the moments"),
        ({"differentiable": True}, "differentiable"),
        ({"use_decoupled_grad": "yes"}, "use_decoupled_grad"),
        ({"exp_avg_dtype": torch.int32}, "exp_avg_dtype"),
        ({"exp_avg_sq_dtype": "bf16"}, "exp_avg_sq_dtype"),
        ({"foreach": "auto"}, "foreach"),
    ],
)
def test_bad_arguments_fail_early(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamW(_make_params(), **kwargs)


def test_state_dict_layout_matches_torch() -> None:
    ours_p, ref_p = _make_params(), _make_params()
    ours, ref = AdamW(ours_p, lr=LR), torch.optim.AdamW(ref_p, lr=LR)
    _run(ours, ours_p, 2)
    _run(ref, ref_p, 2)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd["param_groups"] == ref_sd["param_groups"]
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for key, ref_state in ref_sd["state"].items():
        assert ours_sd["state"][key].keys() == ref_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name, value in ref_state.items():
            torch.testing.assert_close(ours_sd["state"][key][name], value, rtol=0, atol=0)


def test_load_torch_state_dict_then_continue() -> None:
    """A checkpoint written by torch.optim.AdamW resumes in ours (and the run stays identical)."""
    ours_p, ref_p = _make_params(), _make_params()
    ref = torch.optim.AdamW(ref_p, lr=LR)
    _run(ref, ref_p, 3)
    with torch.no_grad():
        for p, q in zip(ours_p, ref_p, strict=True):
            p.copy_(q)
    ours = AdamW(ours_p, lr=LR)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for step in range(3, STEPS):
        for p, q, g in zip(ours_p, ref_p, _grads(ref_p, step), strict=True):
            p.grad, q.grad = g, g
        ours.step()
        ref.step()
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)


def test_load_keeps_low_precision_moments() -> None:
    """torch's loader casts moments to the param dtype; ours restores the configured dtype."""
    params = _make_params()
    opt = AdamW(params, lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)
    _run(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    fresh = AdamW(params, lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)
    fresh.load_state_dict(saved)
    state = fresh.state[params[0]]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.float16
    torch.testing.assert_close(state["exp_avg"], opt.state[params[0]]["exp_avg"], rtol=0, atol=0)


def _dtensor_params(mesh: Any, placements: list[Any]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements)) for p in _make_params()]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard0", "replicate"])
def test_dtensor_params_match_plain(one_rank_mesh: Any, placement: Any, foreach: bool) -> None:
    """DTensor params (incl. an empty one) update through local shards; state stays DTensor."""
    ours_p = _dtensor_params(one_rank_mesh, [placement])
    ref_p = _make_params()
    ours = AdamW(ours_p, lr=LR, foreach=foreach, use_decoupled_grad=True, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        for p, g in zip(ours_p, _grads(ours_p, step), strict=True):
            p.decoupled_grad = None if g is None else distribute_tensor(g, one_rank_mesh, [placement])
        for p, g in zip(ref_p, _grads(ref_p, step), strict=True):
            p.grad = g
        ours.step()
        ref.step()
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)
    state = ours.state[ours_p[0]]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == (placement,)
    assert isinstance(ours_p[0], DTensor)


def test_dtensor_grad_with_other_placement_is_rejected(one_rank_mesh: Any) -> None:
    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 2), one_rank_mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.randn(4, 2), one_rank_mesh, [Replicate()])
    with pytest.raises(ValueError, match="placements"):
        Adam([param]).step()


def test_no_warning_in_a_normal_step() -> None:
    params = _make_params()
    opt = Adam(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(opt, params, 2)


def test_dcp_save_load_resumes_exactly(one_rank_mesh: Any, tmp_path: Any) -> None:
    """torch.distributed.checkpoint saves our state (DTensor bf16 moments, step) and a fresh
    optimizer resumed from it continues exactly like the uninterrupted one."""
    import torch.distributed.checkpoint as dcp

    def make(params: list[torch.nn.Parameter]) -> AdamW:
        return AdamW(params, lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)

    def run(pairs: list[tuple[AdamW, list[torch.nn.Parameter]]], steps: range) -> None:
        for step in steps:
            for opt_, params_ in pairs:
                for p, g in zip(params_, _grads(params_, step), strict=True):
                    p.grad = None if g is None else distribute_tensor(g, one_rank_mesh, [Shard(0)])
                opt_.step()

    params = _dtensor_params(one_rank_mesh, [Shard(0)])
    opt = make(params)
    run([(opt, params)], range(2))
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    template = copy.deepcopy(opt.state_dict())
    for entry in template["state"].values():
        for value in entry.values():
            value.zero_()
    dcp.load({"optim": template}, checkpoint_id=str(tmp_path / "ckpt"))
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(resumed_params)
    resumed.load_state_dict(template)
    run([(opt, params), (resumed, resumed_params)], range(2, STEPS))
    state = resumed.state[resumed_params[0]]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].dtype == torch.bfloat16
    _assert_params_close(resumed_params, [p.full_tensor() for p in params], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for CUDA-graph capture")
def test_capturable_step_replays_in_cuda_graph() -> None:
    """capturable=True: one captured step, replayed with new decoupled grads copied into the
    same tensor, trains exactly like eager torch.optim.AdamW (the step counter lives on the GPU)."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(32, generator=gen)
    grads = [torch.randn(32, generator=gen).to(device) for _ in range(4)]
    param = torch.nn.Parameter(start.clone().to(device))
    param.decoupled_grad = torch.zeros(32, device=device)
    opt = AdamW([param], lr=LR, capturable=True, use_decoupled_grad=True)
    ref_param = torch.nn.Parameter(start.clone().to(device))
    ref = torch.optim.AdamW([ref_param], lr=LR)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up step creates the state outside the capture
        param.decoupled_grad.copy_(grads[0])
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    ref_param.grad = grads[0].clone()
    ref.step()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for grad in grads[1:]:
        param.decoupled_grad.copy_(grad)
        graph.replay()
        ref_param.grad = grad.clone()
        ref.step()
    torch.cuda.synchronize()
    assert opt.state[param]["step"].item() == len(grads)
    torch.testing.assert_close(param.detach(), ref_param.detach(), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(min_value=1e-4, max_value=0.5),
    beta1=st.floats(min_value=0.0, max_value=0.99),
    beta2=st.floats(min_value=0.5, max_value=0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    foreach=st.sampled_from([None, False, True]),
    decoupled_wd=st.booleans(),
)
def test_property_matches_torch(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    amsgrad: bool, maximize: bool, foreach: bool | None, decoupled_wd: bool,
) -> None:
    """Any valid hyper-parameter combination reproduces torch to fp32 rounding."""
    kwargs = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                  maximize=maximize, foreach=foreach)
    ours_cls, torch_cls = PAIRS[1] if decoupled_wd else PAIRS[0]
    ours_p, ref_p = _make_params(), _make_params()
    ours, ref = ours_cls(ours_p, **kwargs), torch_cls(ref_p, **kwargs)
    _run(ours, ours_p, 3)
    _run(ref, ref_p, 3)
    _assert_params_close(ours_p, ref_p, rtol=1e-6, atol=1e-7)
