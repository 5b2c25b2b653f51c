"""The shipped configs of the published models of each family other than Llama (configs/qwen2_5_7b.yaml,
qwen3_8b.yaml, mistral_7b.yaml, mixtral_8x7b.yaml, gemma2_9b.yaml) hold exactly the published model: the model of
its config.json on the Hugging Face Hub (what `model.init_from` checks) and its published parameter count, as the
planner (`jaxpar-plan`) counts it. That each fits the cluster it names is tests/unit/test_gpu_check.py's (the Llama 3
configs are test_hf.py's).
"""

import os

import pytest

from jaxpar.analysis.planner.plan import plan
from jaxpar.config import load_config, resolve_config
from jaxpar.config.mesh_axes import mesh_sizes
from jaxpar.model.flops import inactive_expert_params
from jaxpar.model.hf.config import ARCHITECTURES, hf_config_from_model, model_config_from_hf, model_differences

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# config.json of each published model as the Hub holds it (the keys jaxpar reads)
QWEN2_5_7B = {  # Qwen/Qwen2.5-7B
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
GEMMA2_9B = {  # google/gemma-2-9b
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}
# config, its config.json, the parameters of the published weights (the model cards round them: Qwen2.5-7B 7.61B,
# Qwen3-8B 8.2B, Mixtral-8x7B 46.7B, Gemma-2-9B 9.24B)
PUBLISHED = [
    ("qwen2_5_7b.yaml", QWEN2_5_7B, 7_615_616_512),
    ("qwen3_8b.yaml", QWEN3_8B, 8_190_735_360),
    ("mistral_7b.yaml", MISTRAL_7B, 7_241_732_096),
    ("mixtral_8x7b.yaml", MIXTRAL_8X7B, 46_702_792_704),
    ("gemma2_9b.yaml", GEMMA2_9B, 9_241_705_984),
]
IDS = [name for name, _, _ in PUBLISHED]


def _load(name: str):
    """The config resolved for its mesh's device count (each of these configs sets every mesh axis)."""
    path = os.path.join(ROOT, "configs", name)
    n = 1
    for size in mesh_sizes(load_config(path, validate=False).mesh).values():
        n *= size
    return resolve_config(load_config(path, num_devices=n), n)


@pytest.mark.parametrize("name, published, total", PUBLISHED, ids=IDS)
def test_config_is_the_published_model(name, published, total):
    """The config names its family and holds the model of the published config.json; the planner counts the
    published number of parameters."""
    cfg = _load(name)
    assert cfg.model.name == published["model_type"]
    assert model_differences(cfg.model, model_config_from_hf(published)) == []
    assert plan(cfg)["params"]["total"] == total


@pytest.mark.parametrize("name, published, total", PUBLISHED, ids=IDS)
def test_config_exports_as_its_family(name, published, total):
    """export-hf writes the family's transformers class, with the published model's config (read back equal)."""
    model = _load(name).model
    hf = hf_config_from_model(model, "bfloat16")
    assert hf["architectures"] == published["architectures"] == [ARCHITECTURES[model.name]]
    assert model_differences(model_config_from_hf(hf), model_config_from_hf(published)) == []


def test_mixtral_active_parameters_are_the_published_ones():
    """Mixtral 8x7B uses 12.9B of its 46.7B parameters per token (Jiang et al. 2024, abstract, round them to 13B
    of 47B): all but the 6 experts of 8 that top-2 routing leaves out in each of the 32 blocks."""
    cfg = _load("mixtral_8x7b.yaml")
    assert cfg.model.moe.num_experts == 8 and cfg.model.moe.top_k == 2
    assert plan(cfg)["params"]["total"] - inactive_expert_params(cfg.model) == 12_879_925_248
