"""Tiny random models of each family, built locally with transformers (nothing is downloaded),
and the recipes of the same models; helpers shared by the tests (and their spawned workers)."""

import torch

VOCAB, SEQ = 256, 16

# The recipe's model section of each family; each is a transformers model of the same shape.
MODELS = {
    "gpt2": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64},
    "llama": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 64, "position_embedding": "rope", "rotary_base": 10000, "rope_scaling_factor": 32.0,
              "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False, "tie_embeddings": False},
    "gemma2": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
               "ffn_hidden_size": 64, "position_embedding": "rope", "normalization": "RMSNorm",
               "layernorm_epsilon": 1e-6, "activation": "geglu", "add_bias_linear": False, "scale_embeddings": True,
               "post_norms": True, "zero_centered_norm": True, "attention_softcap": 2.0, "sliding_window": 5},
}
LOSS_SOFTCAP = {"gemma2": 3.0}


def recipe_dict(arch: str, *, tp: int = 1, pp: int = 1, impl: str = "torch", **model) -> dict:
    return {
        "model": {**MODELS[arch], "seq_length": SEQ, "vocab_size": VOCAB, "attention": "sdpa", **model},
        "loss": {"impl": impl, "softcap": LOSS_SOFTCAP.get(arch)},
        "parallel": {"tensor": tp, "pipeline": pp},
    }


def recipe(arch: str, **kwargs):
    from cce_parallel.config import recipe_from_dict

    return recipe_from_dict(recipe_dict(arch, **kwargs))


def hf_model(arch: str, *, seed: int = 0, **model):
    """A random transformers model of the family (fp32, eval mode, eager attention), its weights
    jittered so that every norm and bias differs from its initial value."""
    return hf_model_of(recipe(arch, **model), seed=seed)


def hf_model_of(recipe, *, seed: int = 0):
    """hf_model for any recipe whose model has VOCAB rows (e.g. a shipped recipe, shrunk)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cce_parallel.hf.convert import hf_config

    fields = hf_config(recipe, VOCAB)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def batch(seed: int = 1, b: int = 2, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def hf_logits_and_loss(model, tokens, labels):
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return logits, loss


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()
