"""Our GPTModel against transformers on one gloo rank (TP 1, fp32): HF weights loaded into the
train job's model give HF's logits and loss (GPT-2, Llama with Llama 3 RoPE scaling, Gemma 2 with
softcaps, sliding window, sandwich and (1 + w) norms), and the weights go back to HF unchanged."""


import pytest
import torch

from tests.dist import one_megatron_rank
from tests.hf import tiny

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def one_rank():
    with one_megatron_rank():
        yield


def ours_from_hf(arch: str, hf):
    from cce_parallel.hf.convert import dict_reader
    from cce_parallel.hf.load import load_state
    from cce_parallel.train.gpt import build_gpt, transformer_config

    recipe = tiny.recipe(arch)
    model = build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True),
                      vocab_size=tiny.VOCAB, device="cpu").eval()
    load_state(model, recipe, dict_reader(hf.state_dict()), hf_vocab=tiny.VOCAB)
    return recipe, model


def our_logits_and_loss(arch, model, tokens, labels):
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, position_ids, None)  # [b, s, V]
        loss = model(tokens, position_ids, None, labels=labels).mean()
    cap = tiny.LOSS_SOFTCAP.get(arch)
    if cap is not None:  # the loss layer's softcap; the raw logits are uncapped
        logits = cap * torch.tanh(logits / cap)
    return logits, loss


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2"])
def test_hf_weights_give_hf_logits_and_loss(one_rank, arch):
    hf = tiny.hf_model(arch)
    _, model = ours_from_hf(arch, hf)
    tokens, labels = tiny.batch()
    ref_logits, ref_loss = tiny.hf_logits_and_loss(hf, tokens, labels)
    logits, loss = our_logits_and_loss(arch, model, tokens, labels)
    assert tiny.rel(logits, ref_logits) < 1e-4
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * ref_loss.item()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2"])
def test_round_trip_hf_ours_hf_is_exact(one_rank, arch):
    from cce_parallel.hf.convert import hf_state

    hf = tiny.hf_model(arch)
    recipe, model = ours_from_hf(arch, hf)
    back = hf_state(recipe, {(0, 0): model.state_dict()}, vocab=tiny.VOCAB, hf_vocab=tiny.VOCAB)
    original = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and recipe.model.tie_embeddings)}
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key


def test_gemma2_window_and_softcap_matter(one_rank):
    """The Gemma 2 comparison is not vacuous: without the attention softcap or the window the
    logits differ from transformers' by far more than the tolerance."""
    hf = tiny.hf_model("gemma2")
    tokens, labels = tiny.batch()
    ref_logits, _ = tiny.hf_logits_and_loss(hf, tokens, labels)
    for change in ({"attention_softcap": None}, {"sliding_window": None}):
        import dataclasses

        from cce_parallel.hf.convert import dict_reader
        from cce_parallel.hf.load import load_state
        from cce_parallel.train.gpt import build_gpt, transformer_config

        recipe = tiny.recipe("gemma2")
        recipe.model = dataclasses.replace(recipe.model, **change)
        model = build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True),
                          vocab_size=tiny.VOCAB, device="cpu").eval()
        load_state(model, recipe, dict_reader(hf.state_dict()), hf_vocab=tiny.VOCAB)
        logits, _ = our_logits_and_loss("gemma2", model, tokens, labels)
        assert tiny.rel(logits, ref_logits) > 1e-3, change


def test_flex_attention_matches_the_math_path():
    """The CUDA path's score_mod and block mask (flex_attention, eager forward on CPU) compute what
    the CPU path computes."""
    from torch.nn.attention.flex_attention import flex_attention

    from cce_parallel.megatron.attention import _block_mask, _softcap_mod, math_capped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 19, 8, generator=g)
    k, v = torch.randn(2, 2, 19, 8, generator=g), torch.randn(2, 2, 19, 8, generator=g)
    for softcap, window in ((2.0, 5), (2.0, None), (None, 7)):
        ref = math_capped_attention(q, k, v, scale=0.3, softcap=softcap, window=window)
        out = flex_attention(q, k, v, score_mod=_softcap_mod(softcap), block_mask=_block_mask(19, window, q.device),
                             scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_clear_errors():
    """An architecture the export cannot write names the option; a config.json that differs from
    the recipe names the first difference; init_from and the export check their paths."""
    from cce_parallel.config import RecipeError, recipe_from_dict
    from cce_parallel.hf.convert import ConversionError, architecture, check_config, hf_config
    from cce_parallel.hf.export import resolve_checkpoint
    from cce_parallel.hf.load import init_from_path

    with pytest.raises(ConversionError, match=r"^model.normalization: 'LayerNorm'; a LlamaForCausalLM needs RMSNorm"):
        architecture(recipe_from_dict({"model": {"activation": "swiglu", "position_embedding": "rope"}}))
    with pytest.raises(ConversionError, match=r"^model.post_norms: False; a Gemma2ForCausalLM needs true"):
        architecture(tiny.recipe("gemma2", post_norms=False))
    with pytest.raises(ConversionError, match=r"^loss.softcap"):
        architecture(recipe_from_dict({"loss": {"softcap": 30.0}}))
    recipe = tiny.recipe("llama")
    config = hf_config(recipe, tiny.VOCAB)
    check_config(recipe, config, where="x", vocab=(tiny.VOCAB, tiny.VOCAB))
    for change, message in (({"num_key_value_heads": 4}, r"^model.num_query_groups: the recipe gives num_key_value_heads=2, x has num_key_value_heads=4"),
                            ({"intermediate_size": 96, "hidden_size": 48}, r"^model.hidden_size"),
                            ({"model_type": "gpt2"}, r"^model.init_from: x holds a 'gpt2' model"),
                            ({"vocab_size": 300}, r"^model.vocab_size: x has vocab_size=300"),
                            ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, r"^model.rotary_base")):
        with pytest.raises(ConversionError, match=message):
            check_config(recipe, dict(config, **change), where="x", vocab=(tiny.VOCAB, tiny.VOCAB))
    with pytest.raises(RecipeError, match=r"^model.init_from: must be hf:"):
        recipe_from_dict({"model": {"init_from": "/some/dir"}})
    with pytest.raises(ConversionError, match="is not a transformers model directory"):
        init_from_path("hf:/nonexistent")
    with pytest.raises(ConversionError, match="not a checkpoint"):
        resolve_checkpoint("/nonexistent")
