"""Facts about the machine and software a benchmark ran on."""

from __future__ import annotations

import os
import platform

from speclm.files import cpu_name


def machine_facts() -> dict:
    import torch
    import transformers

    from speclm.quant.weights import int8_kernels

    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "int8_kernels": int8_kernels(),  # what int8 layers run here: it decides their speed
    }
