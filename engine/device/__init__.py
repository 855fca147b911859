"""Device streams: device work as asyncio awaitables (see stream.py for the contract)."""

from __future__ import annotations

import torch

from engine.device.cpu_stream import CpuDeviceStream
from engine.device.stream import DeviceHandle, DeviceStream

__all__ = ["CpuDeviceStream", "DeviceHandle", "DeviceStream", "make_device_stream"]


def make_device_stream(device: torch.device | str, torch_threads: int | None = None) -> DeviceStream:
    """The stream for `device`: CUDA streams for cuda devices, the CPU worker for anything else.

    Raises RuntimeError for a cuda device when CUDA is not usable, rather than silently running
    on the CPU.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        from engine.device.cuda_stream import CudaDeviceStream  # imported only where CUDA is used

        return CudaDeviceStream(dev, torch_threads)
    return CpuDeviceStream(torch_threads)
