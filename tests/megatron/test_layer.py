"""CCEOutputLayer on its own, in this process (no process group: tensor-parallel size 1), on CPU.

- the loss [b, s] and ∇hidden, ∇weight, ∇bias against the float64 oracle (tests/oracle.py) for
  every loss option, with hidden states [s, b, h] and labels [b, s], and with per-token
  ``loss_weights`` [b, s] (tests/megatron/test_loss_weights.py: at TP=2, against Megatron);
  ``entropy_weights`` (a number or [b, s]) against a float64 w · CE + h · entropy, and their misuse;
- the layer's own ``cce_state``: passed to every call, learned by this layer alone, shown in its
  repr, kept by a conversion with the same options, forgotten by ``reset_cce_state``;
- Megatron's gradient-accumulation fusion: ∇W added into ``main_grad`` (fp32 or bf16),
  ``grad_added_to_main_grad`` set, a dummy gradient returned (zeros with ``zero_out_wgrad``), and a
  plain gradient when fusion is off or there is no ``main_grad``;
- the loss returned under ``route_labels`` is recognized, also through a whole view of it
  (Megatron-FSDP's root hook);
- the loss runs inside the module's forward: a forward pre-hook that rewrites the weight (as
  Megatron DDP's parameter all-gather does) is seen by the loss;
- without labels the layer is ColumnParallelLinear (weight=, runtime_gather_output);
- converting keeps the parameters, their tensor-parallel attributes and the state dict, and is
  idempotent; misuse raises errors that name the problem;
- SDPAttention against a float64 reference, LocalNorm's attributes, and ``import cce_parallel``
  without megatron-core.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from cce_parallel.megatron import CCEOptions, CCEOutputLayer, padded_vocab_size
from tests.oracle import oracle, rel_err

S, B, H, V = 7, 3, 24, 61  # odd sizes: masked loads in the kernels
TOL = {"torch": 1e-5, "exact": 1e-5, "cce": 1e-4, "cce_kahan_full_c": 1e-4}


def _config(**kwargs) -> ModelParallelConfig:
    return ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32, **kwargs)


def _init(w):
    return torch.nn.init.normal_(w, std=0.3)


def _layer(vocab=V, bias=False, options=None, **kwargs) -> CCEOutputLayer:
    torch.manual_seed(3)
    return CCEOutputLayer(
        H, vocab, config=_config(), init_method=_init, bias=bias, cce_options=options, **kwargs
    )


def _inputs(vocab=V, ignore=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    if ignore:
        labels[0, :3] = -100
        labels[2, 5] = -100
    return hidden, labels


@pytest.mark.parametrize("impl", list(TOL))
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"softcap": 2.0},
        {"label_smoothing": 0.1, "z_loss": 1e-3},
        {"ignore": True},
        {"bias": True, "softcap": 4.0, "temperature": 0.7},
    ],
    ids=["plain", "softcap", "smoothing+zloss", "ignore_index", "bias+softcap+temperature"],
)
def test_loss_and_grads_vs_oracle(impl, opts):
    opts = dict(opts)
    ignore, bias = opts.pop("ignore", False), opts.pop("bias", False)
    layer = _layer(bias=bias, options=CCEOptions(impl=impl, **opts))
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    hidden, labels = _inputs(ignore=ignore)
    hidden.requires_grad_()
    loss, out_bias = layer(hidden, labels=labels)
    assert out_bias is None
    assert loss.shape == (B, S) and loss.dtype == torch.float32 and loss.is_contiguous()
    grad = torch.randn(B, S, generator=torch.Generator().manual_seed(1))
    loss.backward(grad)
    ref = oracle(
        hidden, layer.weight, labels.t(), bias=layer.bias, grad_loss=grad.t(), reduction="none", **opts
    )
    tol = TOL[impl]
    assert rel_err(loss.t(), ref.loss) <= tol
    assert rel_err(hidden.grad, ref.de) <= tol
    assert rel_err(layer.weight.grad, ref.dc) <= tol
    if bias:
        assert rel_err(layer.bias.grad, ref.dbias) <= tol


def test_loss_scale_and_state_reach_the_loss(monkeypatch):
    """CCEOptions.loss_scale is the loss's loss_scale argument (None: the layer's state's number),
    and the state passed is the layer's own."""
    from cce_parallel.megatron import layer as layer_module

    seen = []
    real = layer_module.linear_cross_entropy
    monkeypatch.setattr(layer_module, "linear_cross_entropy",
                        lambda *a, **k: seen.append((k["loss_scale"], k["state"])) or real(*a, **k))
    hidden, labels = _inputs()
    layers = [_layer(options=CCEOptions(impl="torch", loss_scale=scale)) for scale in (0.25, None)]
    for layer in layers:
        layer(hidden, labels=labels)
    assert seen == [(0.25, layers[0].cce_state), (None, layers[1].cce_state)]
    assert layers[0].cce_state is not layers[1].cce_state


@pytest.mark.parametrize("impl", ["torch", pytest.param("cce_kahan_full_c", marks=pytest.mark.interpreter)])
def test_loss_weights_vs_oracle(impl):
    """loss_weights [b, s]: the loss is w · CE per token (0 where ignored), its gradients those of
    the summed weighted loss; the one-pass path only scales them (no recompute)."""
    layer = _layer(options=CCEOptions(impl=impl))
    hidden, labels = _inputs(ignore=True)
    hidden.requires_grad_()
    w = torch.randn(B, S, generator=torch.Generator().manual_seed(2))
    loss, _ = layer(hidden, labels=labels, loss_weights=w)
    loss.sum().backward()
    ref = oracle(hidden, layer.weight, labels.t(), weights=w.t(), reduction="none")
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    tol = TOL[impl]
    assert rel_err(loss.t(), ref.loss) <= tol
    assert rel_err(hidden.grad, ref.de) <= tol
    assert rel_err(layer.weight.grad, ref.dc) <= tol
    if impl != "torch":
        assert layer.cce_state.paths == {"one_pass": 1, "scaled": 1}


@pytest.mark.interpreter
def test_layer_owns_its_state():
    """What a backward teaches the loss is this layer's (cce_state), shown in its repr; converting
    with the same options keeps it, other options start a fresh one; reset_cce_state forgets it."""
    options = CCEOptions(impl="cce_kahan_full_c")
    layer, other = _layer(options=options), _layer(options=options)
    hidden, labels = _inputs()
    loss, _ = layer(hidden, labels=labels)
    with pytest.warns(UserWarning, match="neither one number"):
        (loss * torch.randn(B, S)).sum().backward()  # per-token weights the forward did not know
    state = layer.cce_state
    assert state.per_token_weights_seen and state.paths["recomputed"] == 1
    assert "cce_state=UpstreamState(" in repr(layer) and "per_token_weights_seen=True" in repr(layer)
    assert not other.cce_state.per_token_weights_seen and not other.cce_state.paths
    loss, _ = layer(hidden, labels=labels)
    (loss * torch.randn(B, S)).sum().backward()
    assert state.paths["deferred"] == 1  # later per-token calls of this layer make ∇W in their backward
    other(hidden, labels=labels)
    assert other.cce_state.paths == {"one_pass": 1}
    assert CCEOutputLayer.convert(layer, CCEOptions(impl="cce_kahan_full_c")).cce_state is state
    layer.reset_cce_state()
    assert layer.cce_state is state and not state.per_token_weights_seen and not state.paths
    state.expect_loss_scale(0.5)
    CCEOutputLayer.convert(layer, CCEOptions(impl="cce_kahan_full_c", z_loss=1e-4))
    assert layer.cce_state is not state and layer.cce_state.loss_scale == 1.0


def test_loss_weights_misuse():
    layer = _layer(options=CCEOptions(impl="torch"))
    hidden, labels = _inputs()
    w = torch.rand(B, S)
    with pytest.raises(ValueError, match="without labels the layer returns logits"):
        layer(hidden, loss_weights=w)
    with layer.route_labels(labels, w):
        with pytest.raises(ValueError, match="given twice"):
            layer(hidden, loss_weights=w)
    with layer.route_labels(labels, w):
        loss, _ = layer(hidden)
    assert torch.equal(loss, layer(hidden, labels=labels, loss_weights=w)[0])
    assert layer._cce_pending_weights is None


def _entropy_reference(layer, hidden, labels, w, h, temperature):
    """float64 w · CE + h · entropy per token [b, s] (0 where ignored), and the gradients of its sum
    for hidden and the weight."""
    x = hidden.detach().double().requires_grad_()
    c = layer.weight.detach().double().requires_grad_()
    logp = torch.log_softmax((x @ c.t()) / temperature, dim=-1).transpose(0, 1)  # [b, s, V]
    keep = labels != -100
    ce = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = torch.where(keep, w.double() * ce + torch.as_tensor(h).double() * entropy, 0.0)
    loss.sum().backward()
    return loss.detach(), x.grad, c.grad


@pytest.mark.parametrize("impl", ["torch", pytest.param("cce_kahan_full_c", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("per_token", [False, True], ids=["number", "tensor"])
def test_entropy_weights_vs_float64(impl, per_token):
    """entropy_weights, a number or [b, s]: the loss is w · CE + h · entropy per token at the
    temperature (0 where ignored); on the one-pass path its gradients are made in the forward and
    only scaled (no recompute)."""
    layer = _layer(options=CCEOptions(impl=impl, temperature=0.7))
    hidden, labels = _inputs(ignore=True)
    hidden.requires_grad_()
    g = torch.Generator().manual_seed(2)
    w = torch.randn(B, S, generator=g)
    h = -0.3 * torch.rand(B, S, generator=g) if per_token else -0.3
    loss, _ = layer(hidden, labels=labels, loss_weights=w, entropy_weights=h)
    loss.sum().backward()
    ref, ref_dh, ref_dw = _entropy_reference(layer, hidden, labels, w, h, 0.7)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    tol = TOL[impl]
    assert rel_err(loss, ref) <= tol
    assert rel_err(hidden.grad, ref_dh) <= tol
    assert rel_err(layer.weight.grad, ref_dw) <= tol
    if impl != "torch":
        assert layer.cce_state.paths == {"one_pass": 1, "scaled": 1}


def test_entropy_weights_misuse():
    layer = _layer(options=CCEOptions(impl="torch"))
    hidden, labels = _inputs()
    h = torch.rand(B, S)
    with pytest.raises(ValueError, match="entropy_weights add each token's entropy.*without labels"):
        layer(hidden, entropy_weights=h)
    with layer.route_labels(labels, entropy_weights=h):
        with pytest.raises(ValueError, match="entropy_weights was given twice"):
            layer(hidden, entropy_weights=h)
    with pytest.raises(ValueError, match="return_log_probs and entropy_weights together"):
        layer(hidden, labels=labels, entropy_weights=h, return_log_probs=True)
    with pytest.raises(ValueError, match="return_log_probs and entropy_weights together"):
        with layer.route_labels(labels, entropy_weights=-0.01, return_log_probs=True):
            pass
    with layer.route_labels(labels, entropy_weights=h):
        loss, _ = layer(hidden)
    assert torch.equal(loss, layer(hidden, labels=labels, entropy_weights=h)[0])
    assert layer._cce_pending_entropy_weights is None
    bad = [
        (h.t(), ValueError, r"entropy_weights must be shaped like the labels.*look like \[s, b\]"),
        (torch.tensor(-0.01), ValueError, r"got \(\) \(one number: pass it as a Python float\)"),
        (h > 0.5, TypeError, "entropy_weights must be a floating-point tensor"),
        (h.to("meta"), ValueError, "entropy_weights are on meta"),
        (float("nan"), ValueError, "entropy_weights must be finite, got nan"),
        (True, TypeError, "entropy_weights must be a finite number, a torch.Tensor or None, got bool"),
    ]
    for value, kind, pattern in bad:
        with pytest.raises(kind, match=pattern):
            layer(hidden, labels=labels, entropy_weights=value)


def _reference_grad(layer, hidden, labels, weights=None):
    w = layer.weight.detach().clone().requires_grad_()
    logits = (hidden @ w.t()).float()  # [s, b, V]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.t().reshape(-1), reduction="none")
    (losses.sum() if weights is None else (losses * weights.t().reshape(-1)).sum()).backward()
    return w.grad


@pytest.mark.parametrize("impl, weighted", [("torch", False), ("cce_kahan_full_c", False), ("cce_kahan_full_c", True)])
@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16])
def test_main_grad_accumulation(main_grad_dtype, impl, weighted):
    """dW accumulates into main_grad over micro-batches; with per-token weights too (the one-pass
    path's recompute adds into main_grad on the first call, the lean backward on later ones)."""
    layer = _layer(options=CCEOptions(impl=impl))
    layer.gradient_accumulation_fusion = True
    w = layer.weight
    w.main_grad = torch.full(w.shape, 0.5, dtype=main_grad_dtype)
    w.grad_added_to_main_grad = False
    expected = torch.full(w.shape, 0.5)
    for seed in (0, 1):  # two micro-batches accumulate
        hidden, labels = _inputs(seed=seed)
        weights = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) if weighted else None
        expected = expected + _reference_grad(layer, hidden, labels, weights)
        loss, _ = layer(hidden, labels=labels)
        (loss.sum() if weights is None else (loss * weights).sum()).backward()
        assert w.grad_added_to_main_grad
        assert w.grad is not None and w.grad.shape == w.shape and w.grad.dtype == w.dtype  # the dummy
        w.grad = None
        w.grad_added_to_main_grad = False
    assert w.main_grad.dtype == main_grad_dtype
    tol = 1e-5 if main_grad_dtype == torch.float32 else 1e-2
    assert rel_err(w.main_grad.float(), expected) <= tol


def test_main_grad_dummy_is_zero_for_tied_embedding():
    layer = _layer(options=CCEOptions(impl="torch"))
    layer.gradient_accumulation_fusion = True
    w = layer.weight
    w.main_grad = torch.zeros(w.shape)
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = True  # GPTModel sets it on a weight shared with the embedding on one stage
    hidden, labels = _inputs()
    loss, _ = layer(hidden, labels=labels)
    loss.sum().backward()
    assert torch.count_nonzero(w.grad) == 0
    assert rel_err(w.main_grad, _reference_grad(layer, hidden, labels)) <= 1e-5


def test_plain_gradient_without_fusion_or_flag():
    hidden, labels = _inputs()
    # Fusion off: a plain gradient even with main_grad present (DDP's hook adds it).
    layer = _layer(options=CCEOptions(impl="torch"))
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer(hidden, labels=labels)[0].sum().backward()
    assert torch.count_nonzero(layer.weight.main_grad) == 0
    assert rel_err(layer.weight.grad, _reference_grad(layer, hidden, labels)) <= 1e-5
    # Fusion on but no grad_added_to_main_grad attribute (no DDP): main_grad only, no dummy.
    layer = _layer(options=CCEOptions(impl="torch"))
    layer.gradient_accumulation_fusion = True
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer(hidden, labels=labels)[0].sum().backward()
    assert layer.weight.grad is None
    assert rel_err(layer.weight.main_grad, _reference_grad(layer, hidden, labels)) <= 1e-5


def test_loss_runs_inside_forward_after_pre_hooks():
    """Megatron DDP's forward pre-hook finishes the weight's all-gather; the loss must see it."""
    layer = _layer(options=CCEOptions(impl="torch"))
    gathered = torch.randn(V, H)

    def all_gather_done(module, args):
        with torch.no_grad():
            module.weight.copy_(gathered)

    handle = layer.register_forward_pre_hook(all_gather_done)
    hidden, labels = _inputs()
    loss, _ = layer(hidden, labels=labels)
    handle.remove()
    want = torch.nn.functional.cross_entropy(
        (hidden @ gathered.t()).permute(1, 2, 0), labels, reduction="none"
    )
    assert rel_err(loss, want) <= 1e-5


@pytest.mark.parametrize("batch", [B, 1], ids=["b3", "b1"])
def test_routed_loss_is_recognized_through_a_whole_view(batch):
    """Megatron-FSDP's root forward hook hands the layer's output on as output.view_as(output):
    the loss must still be recognized (else GPTModel feeds it to Megatron's cross-entropy), and a
    view of other elements or another shape must not be. With b = 1 the loss is itself a view."""
    layer = _layer(options=CCEOptions(impl="torch"))
    hidden, labels = _inputs()
    hidden, labels = hidden[:, :batch], labels[:batch]
    with layer.route_labels(labels):
        loss, _ = layer(hidden)
        assert layer.is_routed_loss(loss) and layer.is_routed_loss(loss.view_as(loss))
        assert not layer.is_routed_loss(loss.clone())
        assert not layer.is_routed_loss(loss[:, 1:])
        assert not layer.is_routed_loss(loss.reshape(-1))
        assert not layer.is_routed_loss(None)
    assert not layer.is_routed_loss(loss)


def test_logits_path_is_column_parallel_linear():
    plain = ColumnParallelLinear(
        H, V, config=_config(), init_method=lambda w: torch.nn.init.normal_(w), bias=False
    )
    layer = CCEOutputLayer.convert(plain)
    hidden, _ = _inputs()
    logits, bias = layer(hidden)
    assert bias is None and logits.shape == (S, B, V)
    assert torch.equal(logits, hidden @ layer.weight.t())
    other = torch.randn(V, H)
    logits, _ = layer(
        hidden, weight=other, runtime_gather_output=False
    )  # True: tests/megatron/test_gpt_cpu.py
    assert torch.equal(logits, hidden @ other.t())
    with pytest.raises(RuntimeError, match="supplied weight's shape"):
        layer(hidden, weight=torch.randn(V + 1, H))


def test_convert_keeps_parameters_and_is_idempotent():
    plain = ColumnParallelLinear(H, V, config=_config(), init_method=torch.nn.init.normal_, bias=True)
    weight, bias = plain.weight, plain.bias
    attrs = {k: dict(vars(p)) for k, p in (("weight", weight), ("bias", bias))}
    keys = set(plain.state_dict())
    hooks = []
    plain.register_forward_pre_hook(lambda m, a: hooks.append(1))
    layer = CCEOutputLayer.convert(plain, CCEOptions(impl="cce"))
    assert layer is plain and type(layer) is CCEOutputLayer
    assert layer.weight is weight and layer.bias is bias
    assert {"weight": dict(vars(weight)), "bias": dict(vars(bias))} == attrs
    assert attrs["weight"] == {
        "tensor_model_parallel": True,
        "partition_dim": 0,
        "partition_stride": 1,
        "allreduce": True,
    }
    assert set(layer.state_dict()) == keys
    again = CCEOutputLayer.convert(layer, CCEOptions(impl="exact", softcap=5.0))
    assert again is layer and type(layer) is CCEOutputLayer and layer.cce_options.impl == "exact"
    assert "impl=exact" in repr(layer)
    layer(torch.randn(S, B, H), labels=torch.randint(0, V, (B, S)))
    assert hooks == [1], "the forward pre-hook registered before converting must fire"


def test_convert_subclass_keeps_its_behaviour():
    class Tagged(ColumnParallelLinear):
        tag = "kept"

    layer = CCEOutputLayer.convert(
        Tagged(H, V, config=_config(), init_method=torch.nn.init.normal_, bias=False)
    )
    assert isinstance(layer, CCEOutputLayer) and isinstance(layer, Tagged) and layer.tag == "kept"
    assert type(
        CCEOutputLayer.convert(Tagged(H, V, config=_config(), init_method=torch.nn.init.normal_))
    ) is type(layer)


def test_errors_name_the_problem():
    layer = _layer(options=CCEOptions(impl="torch"))
    hidden, labels = _inputs()
    with pytest.raises(ValueError, match=r"labels must be \[b, s\] = \(3, 7\).*look like \[s, b\]"):
        layer(hidden, labels=labels.t())
    with pytest.raises(ValueError, match=r"labels must be \[b, s\]"):
        layer(hidden, labels=labels[:, :-1])
    with pytest.raises(ValueError, match=r"hidden states must be \[s, b, h\]"):
        layer(hidden[0], labels=labels)
    with pytest.raises(ValueError, match=r"shard of the \[61, 24\] output weight is \(61, 24\)"):
        layer(hidden, weight=torch.randn(V - 1, H), labels=labels)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        layer(hidden, labels=[[1, 2]])
    with pytest.raises(ValueError, match=r"found 61"):
        layer(hidden, labels=torch.full((B, S), V))
    with pytest.raises(TypeError, match="integer"):
        layer(hidden, labels=labels.float())
    w = torch.rand(B, S)
    with pytest.raises(ValueError, match=r"loss_weights must be shaped like the labels.*look like \[s, b\]"):
        layer(hidden, labels=labels, loss_weights=w.t())
    with pytest.raises(TypeError, match="loss_weights must be a floating-point tensor"):
        layer(hidden, labels=labels, loss_weights=w > 0.5)
    with pytest.raises(ValueError, match="loss_weights are on meta"):
        layer(hidden, labels=labels, loss_weights=w.to("meta"))


def test_option_and_config_errors():
    with pytest.raises(ValueError, match="unknown impl 'fast'"):
        CCEOptions(impl="fast")
    with pytest.raises(ValueError, match="label_smoothing"):
        CCEOptions(label_smoothing=1.0)
    with pytest.raises(ValueError, match="softcap"):
        CCEOptions(softcap=0.0)
    for bad in (0.0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="temperature"):
            CCEOptions(temperature=bad)
    with pytest.raises(ValueError, match="z_loss"):
        CCEOptions(z_loss=-1.0)
    with pytest.raises(ValueError, match="logits_budget"):
        CCEOptions(logits_budget="sometimes")
    with pytest.raises(TypeError, match="ignore_index"):
        CCEOptions(ignore_index=1.5)
    for bad in (0.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="loss_scale"):
            CCEOptions(loss_scale=bad)
    with pytest.raises(
        ValueError, match=r"not divisible by 8 \(make_vocab_size_divisible_by=8.*pad it to 64"
    ):
        _layer(options=CCEOptions(make_vocab_size_divisible_by=8))
    with pytest.raises(TypeError, match="ColumnParallelLinear"):
        CCEOutputLayer.convert(torch.nn.Linear(2, 2))
    deferred = ColumnParallelLinear(H, V, config=_config(), init_method=torch.nn.init.normal_)
    deferred.config.defer_embedding_wgrad_compute = True  # (the config check wants pipeline parallelism)
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        CCEOutputLayer.convert(deferred)
    layer = _layer(bias=True, skip_bias_add=True, options=CCEOptions(impl="torch"))
    hidden, labels = _inputs()
    with pytest.raises(ValueError, match="skip_bias_add"):
        layer(hidden, labels=labels)
    tied = _layer(skip_weight_param_allocation=True)
    with pytest.raises(ValueError, match="pass weight="):
        tied(hidden, labels=labels)


def test_use_cce_rejects_other_models():
    from cce_parallel.megatron import use_cce

    with pytest.raises(TypeError, match="GPTModel"):
        use_cce(torch.nn.Linear(2, 2))


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(256000, 128, 2) == 256000


# ---------------------------------------------------------------------------------------------
# SDPAttention and LocalNorm


def _attention(config_kwargs, sq, heads, groups, mask=None, mask_type="causal"):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cce_parallel.megatron import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * 8,
        num_attention_heads=heads,
        num_query_groups=groups,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        **config_kwargs,
    )
    attn = SDPAttention(
        config, layer_number=1, attn_mask_type=getattr(AttnMaskType, mask_type), attention_type="self"
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, 2, heads, 8, generator=g)
    k = torch.randn(sq, 2, groups, 8, generator=g)
    v = torch.randn(sq, 2, groups, 8, generator=g)
    out = attn(q, k, v, mask)
    # float64 reference: [b, heads, sq, sk] scores with Megatron's mask convention (True = masked).
    rep = heads // groups
    q64, k64, v64 = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    k64, v64 = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    scores = q64 @ k64.transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    elif mask_type == "causal":
        scores = scores.masked_fill(torch.ones(sq, sq, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ v64).permute(2, 0, 1, 3).reshape(sq, 2, heads * 8)
    return out, want


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sdpa_attention_causal(heads, groups):
    out, want = _attention({}, 9, heads, groups)
    assert out.shape == (9, 2, heads * 8)
    assert rel_err(out, want) <= 1e-6


def test_sdpa_attention_explicit_mask_and_no_mask():
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[..., 0] = False  # every query sees at least one key
    out, want = _attention({}, 6, 4, 4, mask=mask)
    assert rel_err(out, want) <= 1e-6
    out, want = _attention({}, 6, 4, 4, mask_type="no_mask")
    assert rel_err(out, want) <= 1e-6


def test_local_norm_tags_sequence_parallel():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cce_parallel.megatron import LocalNorm

    for normalization, cls in (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            normalization=normalization,
        )
        norm = LocalNorm(config=config, hidden_size=8, eps=1e-6)
        assert type(norm) is cls and norm.eps == 1e-6
        assert all(p.sequence_parallel for p in norm.parameters())


def test_local_spec_swaps_attention_and_norms():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from cce_parallel.megatron import LocalNorm, SDPAttention, local_gpt_layer_spec

    spec = local_gpt_layer_spec(qk_layernorm=True)
    sub = spec.submodules
    assert sub.input_layernorm is LocalNorm and sub.pre_mlp_layernorm is LocalNorm
    attn = sub.self_attention.submodules
    assert (
        attn.core_attention.module is SDPAttention
        and attn.core_attention.params == {"softcap": None, "sliding_window": None}
        and attn.q_layernorm is LocalNorm
        and attn.k_layernorm is LocalNorm
    )
    text = repr(spec)
    assert DotProductAttention.__name__ not in text and WrappedTorchNorm.__name__ not in text


def test_gemma2_spec_options():
    """Gemma 2's options: post-norm attention and MLP, the softcap and window for SDPAttention,
    and (1 + w) norms (ZeroCenteredNorm) with layernorm_zero_centered_gamma."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cce_parallel.megatron import LocalNorm, local_gpt_layer_spec
    from cce_parallel.megatron.spec import PostNormMLP, PostNormSelfAttention, ZeroCenteredNorm

    sub = local_gpt_layer_spec(attention_softcap=50.0, sliding_window=4096, post_norms=True).submodules
    # megatron-core up to 0.18 gives the MLP as a ModuleSpec, 0.19 as a partial of MLP's builder.
    mlp = sub.mlp.module if isinstance(sub.mlp, ModuleSpec) else sub.mlp.func.__self__
    assert sub.self_attention.module is PostNormSelfAttention and mlp is PostNormMLP
    assert sub.self_attention.submodules.core_attention.params == {"softcap": 50.0, "sliding_window": 4096}
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               layernorm_zero_centered_gamma=True)
    norm = LocalNorm(config=config, hidden_size=8, eps=1e-6)
    assert isinstance(norm, ZeroCenteredNorm) and torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), eps=1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_zero_centered_norm_compiled_on_cuda(cuda, kind):
    """On CUDA the (1 + w) norm runs compiled: output and gradients equal the eager function's
    within bf16's rounding (output, dx) and fp32's (dw, db)."""
    from cce_parallel.megatron.spec import ZeroCenteredNorm, _zero_centered

    norm = ZeroCenteredNorm(256, kind=kind).to(cuda)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(64, 2, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    results = []
    for fn in (norm, lambda t: _zero_centered(t, norm.weight, norm.bias, norm.shape, norm.eps, kind == "RMSNorm")):
        x.grad = None
        norm.zero_grad(set_to_none=True)
        out = fn(x)
        out.backward(gy)
        results.append([out.detach(), x.grad] + [p.grad for p in norm.parameters()])
    compiled, eager = results
    for a, b in zip(compiled[:2], eager[:2]):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-6)
    for a, b in zip(compiled[2:], eager[2:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_import_without_megatron():
    """`import cce_parallel` works without megatron-core; cce_parallel.megatron says what is missing."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "megatron" or name.startswith("megatron."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import cce_parallel
        assert "megatron" not in sys.modules
        try:
            import cce_parallel.megatron
        except ImportError as err:
            assert "needs megatron-core" in str(err), err
        else:
            raise AssertionError("cce_parallel.megatron imported without megatron-core")
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
