#!/usr/bin/env bash
# GPU correctness after the merges (one H200): graph world1, capturable optimizers, fp8 unit, TE world1, graph bench.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$SECONDS; say() { echo "=== [$((SECONDS - t0))s] $*"; }
source .te/install.sh >/dev/null 2>&1 || echo "TE install failed"
python3 -m pip install -q --no-deps --no-index .whl/py-1.11.0-py2.py3-none-any.whl .whl/pytest_forked-1.7.5-py3-none-any.whl .whl/junitparser-*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --target /tmp/mfsdp_site .whl/megatron_fsdp-*.whl
export PYTHONPATH=$PWD:/tmp/mfsdp_site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch, transformer_engine; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), "TE", transformer_engine.__version__)'
P="python3 -m pytest -q -rfEs -p no:cacheprovider"
say graph world1
timeout 170 $P tests/functional/test_cuda_graph.py -k "not world2" --junitxml=$OUT/graph1.xml 2>&1 | tail -25
say optim capture
timeout 60 $P tests/unit/optim -k "cuda_graph or capturable or cuda" 2>&1 | tail -6
say fp8 unit
timeout 120 $P tests/unit/fp8 --junitxml=$OUT/fp8unit.xml 2>&1 | tail -15
say te world1 + decoupled TE
timeout 150 $P tests/functional/test_fp8_te.py tests/functional/test_decoupled_grad_te.py tests/unit/fsdp/test_dropin_signature.py -k "not world2 and not ws2" --junitxml=$OUT/te1.xml 2>&1 | tail -15
exit 0
timeout 90 torchrun --standalone --nproc-per-node 1 bench/cuda_graph_bench.py --configs small,1.3b --md $OUT/graph.md 2>&1 | tail -25
say done
