"""LocalRotaryEmbedding: megatron-core's RotaryEmbedding with its frequencies kept on their device.

megatron-core's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
at the first forward, whatever device the model lives on, so RoPE cannot run on a CPU. This
subclass computes the embedding [s, 1, 1, d] where ``inv_freq`` was built: on the CPU with
``use_cpu_initialization`` (the train job's CPU runs), on the GPU otherwise. The frequencies,
Llama 3 scaling and the non-interleaved layout (HF's rotate_half) are megatron-core's own.
"""

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


class LocalRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose ``get_emb`` does not move ``inv_freq`` to CUDA."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.rotary_interleaved:
            raise ValueError("LocalRotaryEmbedding supports rotary_interleaved=False only")
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, d]


def use_local_rotary(model) -> None:
    """Switch a GPTModel's RotaryEmbedding (if any) to LocalRotaryEmbedding, in place."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if type(rotary) is RotaryEmbedding:
        rotary.__class__ = LocalRotaryEmbedding
