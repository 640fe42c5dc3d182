"""Probe: time the per-weight pieces of TE's ``quantize_master_weights`` (amax, cast) against torch
ops on one GPU: ``source .te/install.sh && python3 bench/te_cast_probe.py``.

On the H200 (TE 2.20.2, 2026-12-01) it showed TE's ``update_quantized`` cast at 1.68 ms (fp32
input) / 1.17 ms (bf16) for a 16.8M-element weight against 0.11 ms for torch's mul+clamp+cast;
a second run found the cause: the quantizer's column-wise usage (on by default) transposes too.
Row-wise only, TE's cast of the bf16 weight takes 15 us (torch's ``mul`` into an FP8 view 80 us,
same bytes), which is what ``fsdp_impl.fp8_te`` now uses for current-scaling weights."""
import torch
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer


def timed(name, fn, n=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    print(f"{name}: {a.elapsed_time(b) / n:.3f} ms", flush=True)


with te.quantized_model_init(recipe=Float8CurrentScaling()):
    lin = te.Linear(2048, 8192, params_dtype=torch.bfloat16, device="cuda")
w = lin.weight
print(type(w).__name__, w.shape, flush=True)
master = torch.randn(8192 * 2048, device="cuda", dtype=torch.float32)
amax = torch.zeros(1, device="cuda")
timed("tex.compute_amax fp32 16.8M", lambda: tex.compute_amax(master, amax))
timed("torch amax (abs().max())", lambda: master.abs().max())
timed("torch _foreach_norm inf", lambda: torch._foreach_norm([master], float("inf")))
scale = torch.ones(1, device="cuda")
q = Float8Quantizer(scale=scale, amax=torch.Tensor(), fp8_dtype=w._fp8_dtype)
frag = q.create_tensor_from_data(w._data.view(-1), w.dtype)
timed("Float8Quantizer.update_quantized fp32->fp8", lambda: q.update_quantized(master, frag))
out = torch.empty(master.numel(), dtype=torch.uint8, device="cuda")
timed("torch mul+clamp+to(fp8)", lambda: out.view(torch.float8_e4m3fn).copy_((master * scale).clamp_(-448, 448)))
bf = master.to(torch.bfloat16)
timed("update_quantized bf16->fp8", lambda: q.update_quantized(bf, frag))
rowwise = Float8Quantizer(scale=scale, amax=torch.zeros(1, device="cuda"), fp8_dtype=w._fp8_dtype,
                          rowwise=True, columnwise=False)
rows = rowwise.create_tensor_from_data(out.view(1, -1), w.dtype)
timed("update_quantized bf16->fp8, row-wise only", lambda: rowwise.update_quantized(bf.view(1, -1), rows))
timed("torch mul(bf16, scale, out=fp8 view)", lambda: torch.mul(bf, scale, out=out.view(torch.float8_e4m3fn)))
