"""Precision-aware optimizers that can read FSDP's decoupled gradients (``param.decoupled_grad``).

One switch must be set on all three parties, or the wrap-time check raises::

    model = fully_shard_model(module, ..., use_decoupled_grad=True)
    optimizer = fully_shard_optimizer(fsdp_impl.optim.AdamW(
        model.parameters(), lr=1e-3, use_decoupled_grad=True,
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16))
    ...
    loss.backward()
    fsdp_impl.clip_grad_norm(model, 1.0)   # follows model.param_and_grad_buffer.use_decoupled_grad
    optimizer.step()
    optimizer.zero_grad()

With ``MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)`` the gradient shards arrive on
``decoupled_grad`` in bf16 (autograd would refuse a bf16 ``.grad`` on an fp32 parameter); the
update math always runs in fp32 (or the parameter's dtype when wider).
"""

from fsdp_impl.optim.adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
