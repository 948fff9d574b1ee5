"""Launch parameters for the CCE kernels: fixed, sane defaults per device (no autotuning by default)."""

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch settings for the forward and backward kernels.

    fwd_programs is the number of programs the forward aims for; it sets how many vocabulary
    splits each token block gets. bwd_v_chunks is how many launches the buffered backward modes
    (fp32 / fixed point) split the vocabulary into, so that their dC buffer is 1/bwd_v_chunks of dC.
    """

    fwd_block_n: int = 128
    fwd_block_v: int = 128
    fwd_block_d: int = 64
    fwd_num_warps: int = 8
    fwd_num_stages: int = 3
    fwd_programs: int = 528
    bwd_block_n: int = 64
    bwd_block_v: int = 128
    bwd_block_d: int = 64
    bwd_group_n: int = 8
    bwd_num_warps: int = 8
    bwd_num_stages: int = 3
    bwd_v_chunks: int = 8

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        for name in ("fwd_block_n", "fwd_block_v", "fwd_block_d", "bwd_block_n", "bwd_block_v", "bwd_block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")


# Under TRITON_INTERPRET every program runs as numpy code: small blocks keep the odd test shapes
# spread over several tiles (so masking is exercised) without making the interpreter crawl.
INTERPRETER_CONFIG = KernelConfig(
    fwd_block_n=16, fwd_block_v=64, fwd_block_d=32, fwd_programs=8, fwd_num_warps=4, fwd_num_stages=1,
    bwd_block_n=16, bwd_block_v=64, bwd_block_d=32, bwd_group_n=2, bwd_num_warps=4, bwd_num_stages=1,
    bwd_v_chunks=3,
)


def default_config(device: torch.device) -> KernelConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return replace(KernelConfig(), fwd_programs=4 * sms)
