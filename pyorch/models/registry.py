"""Model classes by Hugging Face architecture name (config.json's "architectures")."""

import importlib

from torch import nn

# architecture -> (module under pyorch.models, class name); imported only when resolved.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def get_supported_archs() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class of the first supported architecture; ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"pyorch.models.{module_name}")
            return getattr(module, class_name)
    if any(_is_encoder_only(arch) for arch in architectures or []):
        raise ValueError(
            f"Model architectures {architectures} are encoder-only (BERT-style) models, which "
            "pyorch does not support; pooling (runner='pooling') runs on the decoder models: "
            f"{', '.join(get_supported_archs())}")
    raise ValueError(
        f"Model architectures {architectures} are not supported. "
        f"Supported architectures: {', '.join(get_supported_archs())}"
    )


# Encoder-only families (BERT and its descendants), named so that their refusal says why.
_ENCODER_ONLY_PREFIXES = ("Bert", "Roberta", "XLMRoberta", "DistilBert", "Electra", "Deberta",
                          "ModernBert", "NomicBert", "GteModel", "GteNew", "JinaBert", "MPNet")


def _is_encoder_only(arch: str) -> bool:
    return arch.startswith(_ENCODER_ONLY_PREFIXES)
