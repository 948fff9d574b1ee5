"""The Llama 3.1 8B recipe (recipes/llama3-8b-owt.yaml) in and out of transformers, on one gloo
rank (fp32): the recipe with only its sizes shrunk (2 layers, hidden 128, 8 heads of 16 over 2
key/value heads, FFN 448, vocabulary 256, sequence 512) keeps its architecture (untied
embeddings, RoPE θ 500,000 with Llama 3.1's scaling, GQA 4:1, RMSNorm eps 1e-5, SwiGLU, no
biases, the CCE loss) and converts to a LlamaForCausalLM with Llama 3.1 8B's rope_scaling. A
transformers model of that config, saved as save_pretrained writes it, starts ours through
model.init_from's loader (config.json checked, safetensors read) with transformers' logits and
loss, and the export's merge gives its weights back exactly. Over 512 positions the scaling
matters: without it, or with Llama 3.2's factor 32, the logits are far from transformers'."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.hf import tiny
from tests.hf.test_layers import one_rank, our_logits_and_loss  # noqa: F401 - one_rank: a fixture

pytestmark = pytest.mark.distributed

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama3-8b-owt.yaml"
SEQ = 512  # at position 511 the scaling turns 4 of the 8 frequencies by up to 0.45 rad less
SIZES = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 8, "num_query_groups": 2,
         "ffn_hidden_size": 448, "vocab_size": tiny.VOCAB, "seq_length": SEQ}
# Llama 3.1 8B's config.json (rope_theta and rope_scaling, as transformers 5 names them).
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def shrunk():
    from cce_parallel.config import load_recipe

    return load_recipe(RECIPE, [f"model.{k}={v}" for k, v in SIZES.items()] + ["parallel.tensor=1"])


def build(recipe):
    from cce_parallel.train.gpt import build_gpt, transformer_config

    return build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True),
                     vocab_size=tiny.VOCAB, device="cpu").eval()


def test_shrunk_recipe_is_a_llama_3_1_of_other_sizes():
    from cce_parallel.config import load_recipe
    from cce_parallel.hf.convert import architecture, hf_config

    full, recipe = load_recipe(RECIPE), shrunk()
    assert recipe.model == dataclasses.replace(full.model, **SIZES)  # nothing else changed
    assert recipe.loss == full.loss and recipe.loss.impl == "cce_kahan_full_c"
    m = recipe.model
    assert (m.num_attention_heads // m.query_groups, m.head_dim) == (4, 16)
    config = hf_config(recipe, tiny.VOCAB)
    assert architecture(recipe) == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == ROPE
    assert (config["tie_word_embeddings"], config["rms_norm_eps"], config["hidden_act"],
            config["attention_bias"], config["mlp_bias"], config["num_key_value_heads"]) == (
        False, 1e-5, "silu", False, False, 2)


@pytest.mark.usefixtures("one_rank")
def test_init_from_gives_transformers_logits_and_loss_and_exports_back(tmp_path):
    from transformers import AutoConfig

    from cce_parallel.hf.convert import ConversionError, dict_reader, hf_state
    from cce_parallel.hf.load import load_hf, load_state

    recipe = shrunk()
    hf = tiny.hf_model_of(recipe)
    assert type(hf).__name__ == "LlamaForCausalLM"
    hf.save_pretrained(tmp_path)
    saved = AutoConfig.from_pretrained(tmp_path)  # what transformers reads back from config.json
    assert {k: saved.rope_parameters[k] for k in ROPE} == ROPE and not saved.tie_word_embeddings

    model = build(recipe)
    summary = load_hf(model, recipe, f"hf:{tmp_path}", tokenizer_vocab=tiny.VOCAB)
    assert summary["architecture"] == "llama"
    tokens, labels = tiny.batch(b=1, seq=SEQ)  # one sample: CCE runs under the Triton interpreter
    ref_logits, ref_loss = tiny.hf_logits_and_loss(hf, tokens, labels)
    logits, loss = our_logits_and_loss("llama", model, tokens, labels)
    assert tiny.rel(logits, ref_logits) < 1e-4
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * ref_loss.item()

    # The export's merge: transformers' tensors back, the untied output layer as lm_head.
    back = hf_state(recipe, {(0, 0): model.state_dict()}, vocab=tiny.VOCAB, hf_vocab=tiny.VOCAB)
    original = hf.state_dict()
    assert sorted(back) == sorted(original) and "lm_head.weight" in back
    for key, value in original.items():
        assert torch.equal(back[key], value), key

    # Not vacuous: init_from refuses another RoPE scaling, and loaded anyway its logits are off by
    # 11 % (none) and 1.2 % (factor 32). Logits only, for time.
    position_ids = torch.arange(SEQ).expand_as(tokens)
    for factor in (None, 32.0):
        other = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model,
                                                                      rope_scaling_factor=factor))
        model = build(other)
        with pytest.raises(ConversionError, match=r"^model.rotary_base / model.rope_scaling_factor"):
            load_hf(model, other, f"hf:{tmp_path}", tokenizer_vocab=tiny.VOCAB)
        load_state(model, other, dict_reader(original), hf_vocab=tiny.VOCAB)
        with torch.no_grad():
            assert tiny.rel(model(tokens, position_ids, None), ref_logits) > 1e-3, factor
