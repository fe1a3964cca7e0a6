"""Tiny mixture-of-experts causal LMs from configs (no download): Mixtral, Qwen2-MoE, Qwen3-MoE and
OLMoE, hidden 16, 2 layers, 4 experts, top-2, ``router_aux_loss_coef=0.2`` with ``output_router_logits``
on, every dropout 0, float64, the eager experts (transformers' grouped-mm kernel takes no float64).

transformers computes parts of the model's own loss in float32 even in a float64 model: the
load-balancing sums (``load_balancing_loss_func``) and the token loss (``ForCausalLMLoss`` upcasts the
logits with ``.float()``). :func:`float64_balance_loss` swaps in the same functions with those float32
islands in float64 (their source, ``float32`` -> ``float64`` and ``.float()`` -> ``.double()``), so that
a float64 comparison on the model's own loss sees the method, not the islands' rounding (about 1e-8
on these models); the tests run it on both sides.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, Dict, Iterator

import torch
from torch import nn

from hf_helpers import VOCAB

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
COEF = 0.2
_COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               use_cache=False, output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2,
               attention_dropout=0.0)
_FAMILY: Dict[str, tuple] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=16,
                                                                shared_expert_intermediate_size=16,
                                                                decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=16,
                                                                decoder_sparse_step=1, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}


def moe_config(family: str, **overrides: Any) -> Any:
    import transformers

    config_name, _, extra = _FAMILY[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    config._experts_implementation = "eager"
    return config


def moe_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, _FAMILY[family][1])(moe_config(family, **overrides)).double().train()
    model.loss_type = "ForCausalLM"
    return model


def _float64_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    source = inspect.getsource(fn).replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace = dict(fn.__globals__)
    exec(compile(source, f"<float64 {fn.__module__}.{fn.__name__}>", "exec"), namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def float64_balance_loss() -> Iterator[None]:
    """Every family's ``load_balancing_loss_func`` in float64 (restored on the way out)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    modules = [importlib.import_module(f"transformers.models.{f}.modeling_{f}") for f in FAMILIES]
    kept = [m.load_balancing_loss_func for m in modules]
    causal = LOSS_MAPPING["ForCausalLM"]
    try:
        for m, fn in zip(modules, kept):
            m.load_balancing_loss_func = _float64_source(fn)
        LOSS_MAPPING["ForCausalLM"] = _float64_source(causal)
        yield
    finally:
        for m, fn in zip(modules, kept):
            m.load_balancing_loss_func = fn
        LOSS_MAPPING["ForCausalLM"] = causal
