"""`LinearCrossEntropy`: the functional API as an nn.Module holding the options."""

import torch

from cce_parallel.ops.functional import linear_cross_entropy


class LinearCrossEntropy(torch.nn.Module):
    """Cut cross-entropy loss with fixed options; forward(e, c, targets, bias=None).

    Takes the same keyword options as `cce_parallel.linear_cross_entropy`.
    """

    def __init__(
        self,
        *,
        ignore_index=-100,
        softcap=None,
        label_smoothing=0.0,
        z_loss=0.0,
        reduction="mean",
        impl="cce",
        filter_eps="auto",
        return_lse=False,
    ):
        super().__init__()
        self.options = dict(
            ignore_index=ignore_index,
            softcap=softcap,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            reduction=reduction,
            impl=impl,
            filter_eps=filter_eps,
            return_lse=return_lse,
        )

    def forward(self, e, c, targets, bias=None):
        return linear_cross_entropy(e, c, targets, bias=bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
