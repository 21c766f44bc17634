# source reproduce/gpu/carry-vllm/env.sh: use the vLLM 0.25.0 that receive.sh unpacked into /tmp/vllm-site (VLLM_SITE).
# Returns non-zero, changing nothing, where it is not there.
_vllm_site=${VLLM_SITE:-/tmp/vllm-site}
if [[ -f $_vllm_site/.vllm-payload ]]; then
  case ":${PYTHONPATH:-}:" in *":$_vllm_site:"*) ;; *) export PYTHONPATH=$_vllm_site${PYTHONPATH:+:$PYTHONPATH} ;; esac
  # FlashInfer is not carried, and on CUDA vLLM's samplers import it unless this is 0 (top-k/top-p then run in
  # PyTorch/Triton; the project samples with top_k=0, top_p=1, where FlashInfer's sampler is not used anyway)
  export VLLM_USE_FLASHINFER_SAMPLER=0
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # no network there
  unset _vllm_site
else
  echo "env.sh: no vLLM in $_vllm_site: run reproduce/gpu/carry-vllm/receive.sh first" >&2
  unset _vllm_site
  false
fi
