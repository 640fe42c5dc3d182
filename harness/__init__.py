"""A torchrun-aware pytest harness for distributed PyTorch tests.

Generic: it imports nothing from ``fsdp_impl`` and can be adopted by any project.
"""
