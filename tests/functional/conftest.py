"""The L0 selection of the functional suites: a few cheap cells of every suite get the ``l0`` mark.

L0 runs on every change, so it must stay within minutes on 2 CPU cores yet touch every suite
(``launch_scripts/<gen>/active/L0_functional.sh`` selects ``-m "l0 or regression"``). The cells
below are chosen per suite for cost (2 ranks where the suite has them) and for the bug classes
they catch (``tests/mutants``: each mutant that L0 kills is killed by one of them). A new suite
adds at least one cell here; ``tests/unit/reports/test_functional_suites.py`` checks that every suite
has one, that every listed cell exists and that none is marked ``slow`` (L0 deselects those). A
GPU-only suite's cell skips on CPU with the missing requirement as the reason and runs in the GPU
generations' L0.

One autouse fixture also lives here because every suite's rank processes need it: TransformerEngine's
process-global FP8 state is reset before each test.
"""
from __future__ import annotations

import pytest

from fsdp_impl.fp8.te import reset_te_fp8_state

L0_MARKER = "l0"
L0_CELLS = (
    # activation recompute: inside a unit (non-reentrant, reentrant), bit-identical to no recompute;
    # no extra all-gather (wrapper, a region of two units in the 2-slot pool); FP8 params with a kept transpose
    "test_activation_recompute.py::test_recompute_is_bit_identical_world2[z3-resize-inside]",
    "test_activation_recompute.py::test_recompute_is_bit_identical_world2[z1-inside_reentrant]",
    "test_activation_recompute.py::test_recompute_gathers_nothing_extra[z3-resize-wrapper]",
    "test_activation_recompute.py::test_recompute_gathers_nothing_extra[z3-pool-region]",
    "test_activation_recompute.py::test_recompute_fp8_params[current-optim_grads_params-keep]",
    # NCCL user buffers: registered once, in one order on every rank, training unchanged (gloo, recorded)
    "test_nccl_ub.py::test_nccl_ub_registers_once_in_order_and_trains_identically[3]",
    # golden cells (the whole suite runs in L0 through -m golden; this cell names the suite here)
    "test_golden.py::test_golden_world2[zero3]",
    "test_checkpoint_compat.py::test_checkpoint_of_an_earlier_version_loads_and_continues_its_curve[zero3]",
    # GPU only: a captured step with recompute replays like eager; TE FP8 params recomputed
    "test_activation_recompute_gpu.py::test_recompute_cuda_graph_replay[pool-3]",
    "test_activation_recompute_gpu.py::test_recompute_te_fp8_params[current-3-keep]",
    # checkpoints: DTensor state dicts; exact resume on 2 ranks (ZeRO-1 Transformer: a load that
    # leaves stale compute weights, drops the optimizer state or advances Adam's step shows)
    "test_checkpoint_dist_errors.py::test_state_dicts_are_dtensors_with_global_shapes[optim_grads_params]",
    "test_checkpoint_resume.py::test_resume_is_bit_exact[ws2-transformer-optim-outer_none]",
    # checkpoints across engines: FSDP2 (world 4) into ours at world 2 and ours (world 4, torch_dcp)
    # into FSDP2 at world 2, bit for bit against the other engine's continuation; Hugging Face
    # export/import of a tied Qwen3 (skips without transformers, naming it)
    "test_checkpoint_interop.py::test_fsdp2_checkpoint_continues_in_ours_like_in_fsdp2[fsdp2_torch-zero3]",
    "test_checkpoint_interop.py::test_our_checkpoint_continues_in_fsdp2_like_in_ours[ours_zero3-to-zero3]",
    "test_checkpoint_hf.py::test_hf_export_matches_from_pretrained_and_imports_exactly[qwen3_tied]",
    # decoupled grads: present after sync (empty shards included), clipping, and the losses
    "test_decoupled_grad.py::TestDecoupledGrad::test_decoupled_grads_present_after_sync[3-ws2]",
    "test_decoupled_grad.py::TestDecoupledGrad::test_clip_norm_matches_reference[3-ws2]",
    "test_decoupled_grad.py::TestDecoupledGrad::test_losses_match_reference[3-ws2]",
    "test_decoupled_grad_outer.py::TestDecoupledGradOuter::test_losses_match_reference[optim_grads_params-outer_optim]",
    # engine: argument errors, accumulation, meta init, grads kept as views across zero_grad
    "test_engine_errors.py::test_unknown_strategy[zero3]",
    "test_engine_features.py::test_accumulation_grads_absent_until_sync_then_present_everywhere[optim_grads_params]",
    "test_engine_features.py::test_meta_init_equals_eager_init[optim_grads_params-cnn]",
    "test_engine_features.py::test_zero_grad_keep_views_trains_like_reference[optim_grads_params]",
    "test_engine_seed_compat.py::test_fully_shard_seed_style[cnn-optim_grads_params-plain]",
    "test_fully_shard_matrix.py::test_fully_shard[cnn-optim_grads_params-outer_optim-mesh2221-eager]",
    # meshes: errors, HSDP parity and traffic, CP, TP, the 2-rank shapes
    "test_mesh_errors.py::test_device_mesh_none_builds_1d_mesh_over_the_world",
    "test_mesh_hsdp.py::test_hsdp_parity_and_traffic[cnn-optim_grads_params]",
    "test_mesh_tp_cp.py::test_cp_sequence_chunks_match_full_sequence[optim_grads_params-fsdp]",
    "test_mesh_tp_dtensor.py::test_tp_dtensor_world2[3]",
    "test_mesh_world2.py::test_hsdp_world2[optim_grads_params]",
    "test_mesh_world2.py::test_plain_fsdp_world2[no_shard]",
    # across nodes (4 ranks under plain pytest, the job's world under a multi-node torchrun): DCP
    # save and resume through one shared directory, the HSDP outer dimension across the nodes
    "test_multinode.py::test_checkpoint_resume_across_nodes[optim_grads_params-outer_optim]",
    # parity with a single-process reference (SGD: catches a sum instead of an average)
    "test_parity.py::test_parity_world2[optim_grads_params-cnn-fp32-mb1-eager]",
    # drop-in arguments: grads against a reference (the default pre-division, then SUM)
    "test_dropin_args.py::test_grad_reduction_modes_match_a_reference[default-3]",
    # expert parallelism (4 ranks, the suite's smallest world): MoE grads and params vs one process
    "test_expert_parallel.py::test_moe_with_expert_parallelism_matches_one_process[zero3]",
    # wrap agreement: ranks wrapped differently fail together with the same message
    "test_wrap_agreement.py::test_ranks_with_different_strategies_fail_together",
    # FP8 (torch-native, CPU too): one amax all-reduce per step; the TE path through a stand-in
    "test_fp8.py::test_one_amax_all_reduce_per_step[delayed]",
    "test_fp8_te_standin.py::test_te_fp8_params_with_stand_in[regather]",
    "test_fp8_te_host_work.py::test_current_scaling_host_work_is_batched[keep_transpose]",
    # GPU only (they skip on CPU naming CUDA or TransformerEngine): CUDA-graph replay on 2 ranks
    # (bf16, and TE FP8 parameters), TE FP8 params, the TE seed's quantized model, decoupled grads with TE's FusedAdam
    "test_cuda_graph.py::test_replay_matches_eager_world2[zero3-plain-float32-adamw-full]",
    "test_cuda_graph_fp8.py::test_fp8_replay_matches_eager_world2[te-current-zero3-keep]",
    "test_fp8_te.py::test_te_fp8_params[current-fsdp2-eager]",
    "test_fp8_te_seed.py::test_fully_shard_te_quantized[False-current-mesh1211]",
    "test_fp8_te_cast.py::test_current_scaling_cast_equals_te[shape0-1.0]",
    "test_decoupled_grad_te.py::TestRegressionsWithFusedAdam::test_none_decoupled_grad_and_empty_shards[ws2]",
    # GPU only: ZeRO-3 memory against its closed-form sizes on one GPU
    "test_memory_gpu.py::test_zero3_memory_matches_closed_form_world1",
    # CPU offload: the streamed step (several chunks, params split across them) bit-identical to no
    # offload (kills offload_step_skips_a_d2h), and the host step (torch's fused CPU Adam) within its
    # tolerance, with the ZeRO-2 refresh after a fused step; GPU only: resting memory in closed form
    "test_offload.py::test_offload_matches_no_offload[gpu-zero3]",
    "test_offload.py::test_offload_matches_no_offload[cpu-zero2]",
    # overlap_step: the host step per unit as its grads land, bit for bit the step after the
    # backward (kills offload_overlap_steps_on_stale_grads); clip mode with the backward's norms
    # equal to no offload's clipping; the refusals (clip after an overlapped step, lr changed...)
    "test_offload_overlap.py::test_overlapped_step_equals_the_step_after_the_backward[cpu-zero3]",
    "test_offload_overlap.py::test_clip_mode_equals_clipping_without_overlap[gpu]",
    "test_offload_overlap.py::test_overlap_refuses_what_it_cannot_keep_exact",
    # the step running on into the next forward: bit for bit at ZeRO-3 (per-unit waits), lr moved at once
    "test_offload_overlap_forward.py::test_the_step_running_on_into_the_forward_equals_the_step_after_the_backward"
    "[zero3]",
    "test_offload_gpu.py::test_offload_resting_memory_matches_closed_form[gpu]",
    # GPU only: every unit stepped on the device inside the overlapped step equals no offload with the
    # same fused CUDA kernel bit for bit (device_step_units)
    "test_offload_device_step_gpu.py::test_all_units_stepped_on_the_gpu_equal_no_offload_with_the_fused_kernel",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{L0_MARKER}: a functional cell of the L0 tier (tests/functional/conftest.py)")


def l0_id(item: pytest.Item) -> str:
    """The item's node id relative to tests/functional, as ``L0_CELLS`` lists it."""
    return item.nodeid.split("tests/functional/", 1)[-1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the listed cells before ``-m`` deselects anything."""
    cells = set(L0_CELLS)
    for item in items:
        if l0_id(item) in cells:
            item.add_marker(L0_MARKER)


@pytest.fixture(autouse=True)
def _fresh_transformer_engine_fp8_state() -> None:
    """Start every test from TransformerEngine's initial FP8 state. A rank process runs many
    tests; without this, after a delayed-scaling test each later step of any recipe issued two
    extra all-reduces (the "3 all-reduces per step" the 2-GPU run of ``test_fp8_te.py`` saw for
    current scaling after the delayed cases). ``fsdp_impl.fp8.te.reset_te_fp8_state`` says why."""
    reset_te_fp8_state()
