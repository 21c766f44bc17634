"""Imports what vllm.LLM with LoRA imports (vllm_sampler.py's path), as receive.sh's last step: prints vLLM's
version, and on a GPU the platform and the FlashAttention version vLLM picks. Exit status 1 if any import fails.

    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 python3 reproduce/gpu/carry-vllm/check_imports.py

On a CPU the CUDA extensions cannot load (they need the driver's libcuda.so.1), so only the modules that
import without them are checked there.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

# the LLM entry point, the V1 engine and its in-process core, the scheduler, both GPU model runners (vLLM 0.25
# uses Model Runner V2 for dense models), the worker, LoRA, the samplers, the attention backend, the models
MODULES = [
    "vllm", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.outputs", "vllm.lora.request",
    "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.core.sched.scheduler", "vllm.v1.structured_output",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.lora.worker_manager", "vllm.lora.layers", "vllm.lora.punica_wrapper.punica_gpu", "vllm.lora.ops.triton_ops",
    "vllm.v1.sample.sampler", "vllm.v1.worker.gpu.sample.sampler", "vllm.v1.attention.backends.flash_attn",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2", "vllm.compilation.backends",
    "vllm.model_executor.warmup.kernel_warmup",
]
# need the driver (libcuda.so.1) or vLLM's CUDA ops; kernel_warmup imports minimax_m3_msa_warmup at every start,
# and it imports torchvision (the image's 0.26.0)
CUDA_MODULES = ["vllm.platforms.cuda", "vllm.device_allocator.cumem", "vllm.vllm_flash_attn",
                "vllm._C_stable_libtorch", "vllm.model_executor.warmup.minimax_m3_msa_warmup"]


def main() -> int:
    import torch

    cuda = torch.cuda.is_available()
    start, failed = time.perf_counter(), []
    for name in MODULES + (CUDA_MODULES if cuda else []):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - each failure is reported, then the status says it
            failed.append(name)
            print(f"check_imports: FAILED {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    import vllm

    where = os.path.dirname(os.path.dirname(vllm.__file__))
    print(f"check_imports: vllm {vllm.__version__} from {where}, torch {torch.__version__}, "
          f"{len(MODULES) + (len(CUDA_MODULES) if cuda else 0) - len(failed)} modules imported in "
          f"{time.perf_counter() - start:.1f} s" + ("" if cuda else " (no GPU: the CUDA extensions were not loaded)"))
    if cuda and not failed:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_interface as fa

        print(f"check_imports: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"vLLM platform {type(current_platform).__name__}, FlashAttention {get_flash_attn_version()} "
              f"(FA2 {'present' if fa.FA2_AVAILABLE else 'left out'}, FA3 {'present' if fa.FA3_AVAILABLE else 'absent'}), "
              f"VLLM_USE_FLASHINFER_SAMPLER={os.environ.get('VLLM_USE_FLASHINFER_SAMPLER', 'unset')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
