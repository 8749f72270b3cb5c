"""Host-side checks shared by the GEMM launchers (lora_gemm.py, lora_gemm_ws.py)."""
from __future__ import annotations

import torch


def tma_ok(*ts: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides, and a contiguous last dimension."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


def sm_count(device: torch.device) -> int:
    """Programs of a persistent kernel: the SM count (4 under the CPU interpreter)."""
    return 4 if device.type == "cpu" else torch.cuda.get_device_properties(device).multi_processor_count
