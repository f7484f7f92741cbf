"""Environment every rank process runs with, whoever started it.

NVLink multicast stays off (NVSHMEM, NCCL and PyTorch's symmetric memory): the layer never
uses it, and a multicast object left behind by a crashed process can take a shared host's
GPUs out of service.
"""

from __future__ import annotations

SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
