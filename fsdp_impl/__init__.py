"""fsdp_impl: a fully sharded data parallel engine for PyTorch."""
