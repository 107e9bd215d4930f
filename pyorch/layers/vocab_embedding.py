"""Token embedding and LM head, sharded over the vocabulary (vLLM's VocabParallelEmbedding).

Rank r holds rows [r * n, (r + 1) * n) of the (padded) vocabulary, n = ceil(vocab / tp_size).
With tp_size > 1 each rank looks up the ids in its range (zeros elsewhere) and the ranks'
rows are summed (all-reduce); the LM head computes its vocabulary slice of the logits and
gathers them once, so every rank holds the full logits and samples the same tokens.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyorch.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pyorch.layers.linear import get_tensor_model_parallel_rank_and_size, linear, set_weight_attrs
from pyorch.layers.quantization import QuantizationConfig, QuantizeMethodBase


class VocabParallelEmbedding(nn.Module):
    """Embedding table [num_embeddings_per_partition, embedding_dim] for this rank."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        """quant_config may give the table a method (GGUF keeps the file's blocks: see
        pyorch/layers/quantization/gguf.py); None keeps a float table."""
        super().__init__()
        default_rank, default_size = get_tensor_model_parallel_rank_and_size()
        self.tp_rank = default_rank if tp_rank is None else tp_rank
        self.tp_size = default_size if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method: QuantizeMethodBase | None = (
            quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        )
        if self.quant_method is not None:
            self.quant_method.create_weights(
                self, self.num_embeddings_per_partition, embedding_dim, self.params_dtype
            )
            return
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=self.params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies this rank's vocabulary rows of a full [vocab, dim] (or [vocab]) tensor; rows
        past the real vocabulary (padding of the last shard) are zeroed."""
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"Vocab size mismatch: checkpoint has {loaded_weight.shape[0]} rows, the model "
                f"expects {self.num_embeddings}"
            )
        if loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"Shape mismatch: parameter {tuple(param.shape)}, checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        num_rows = self.vocab_end_index - self.vocab_start_index
        param.data[:num_rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[num_rows:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)  # type: ignore[attr-defined]
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, dim]
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        rows = self._lookup(local_ids)
        rows.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(rows)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocabulary logits, sharded like the embedding so it can
    share (tie) the embedding's weight."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, bias: bool = False, **kwargs: Any
    ):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0})

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Shares the embedding's weight (tie_word_embeddings), and its quantization method."""
        self.weight = embed_tokens.weight
        self.quant_method = embed_tokens.quant_method
        return self

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, num_embeddings] in float32."""
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden_states, self.bias)
        else:
            logits = linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:  # [N, V / tp] per rank -> [N, padded V] everywhere
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits(hidden)")
