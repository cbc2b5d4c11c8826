"""Reference models (Hugging Face transformers, test-only) and a test-only paged block allocator."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.scheduler.model.batch import ForwardBatch

FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "head_dim": 16,
    },
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0, "head_dim": 32},
    # The families added for issue 42: windows of 12 (tests run prompts of 40+ tokens in 16-token
    # blocks), scaled RoPE with an original context of 32 (tests run past it).
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": 12, "head_dim": 16},
    "qwen2-window": {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 12,
                     "max_window_layers": 1},  # layers 1 and 2 slide
    "qwen3-yarn": {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 10000.0, "head_dim": 16,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "llama-dynamic": {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 16, "sliding_window": 12, "query_pre_attn_scalar": 24,
               # caps small enough to bend these random scores and logits
               "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "config_class": "Gemma3TextConfig", "head_dim": 16,
               "sliding_window": 12, "sliding_window_pattern": 2, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "query_pre_attn_scalar": 16},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "pad_token_id": 0, "original_max_position_embeddings": 32,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                              "long_factor": [1.5 + 0.5 * i for i in range(8)]}},
    # Mixtures of experts (test_moe.py): 8 experts, top 2; a decode step of 3 sequences routes 6
    # pairs, so some expert gets no token. Qwen3-MoE unnormalized with a dense layer 1, Mixtral renormalized.
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1000000.0, "head_dim": 16, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False, "mlp_only_layers": [1]},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                "sliding_window": 12},
}
SHAPE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_hf_model(family: str, tie: bool, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model with every weight random (biases and norms too), fp32, eval."""
    import transformers

    options = {**SHAPE, **FAMILY_CONFIGS[family], "tie_word_embeddings": tie}
    architecture = options.pop("architectures")[0]
    config_class = getattr(transformers, options.pop("config_class", architecture.replace("ForCausalLM", "Config")))
    config = config_class(**options, architectures=[architecture])
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    _randomize(model)
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    # Large enough weights that logits are peaked: greedy ties would make comparisons flaky.
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        else:
            param.normal_(0.0, 0.15)


def save_hf_model(model: torch.nn.Module, out: Path, sharded: bool = False) -> Path:
    model.save_pretrained(out, max_shard_size="40KB" if sharded else "2GB")
    return out


class LinearPager:
    """Test-only block manager: each sequence owns a fixed run of blocks, drawn from a shuffled pool.
    Its tables pad with block `num_blocks`: the trash block of a KV cache sized `num_blocks`."""

    def __init__(self, num_seqs: int, max_blocks_per_seq: int, block_size: int, seed: int = 0) -> None:
        pool = torch.randperm(num_seqs * max_blocks_per_seq, generator=torch.Generator().manual_seed(seed))
        self.tables = pool.view(num_seqs, max_blocks_per_seq)  # [S, M]
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.tables.numel()

    def batch(self, chunks: list[tuple[int, list[int], int]], capture_layers: tuple[int, ...] = ()) -> ForwardBatch:
        """chunks: (sequence id, new token ids, position of the first new token), in batch order."""
        ids = [tok for _, toks, _ in chunks for tok in toks]
        positions = [start + i for _, toks, start in chunks for i in range(len(toks))]
        seq_of_token = [seq for seq, toks, _ in chunks for _ in toks]
        slots = [self._slot(seq, pos) for seq, pos in zip(seq_of_token, positions)]
        lens = [start + len(toks) for _, toks, start in chunks]
        starts = [0]
        for _, toks, _ in chunks:
            starts.append(starts[-1] + len(toks))
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=self._tables([seq for seq, _, _ in chunks], lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            capture_layers=capture_layers,
        )

    def _slot(self, seq: int, pos: int) -> int:
        return int(self.tables[seq, pos // self.block_size]) * self.block_size + pos % self.block_size

    def _tables(self, seqs: list[int], lens: list[int]) -> torch.Tensor:
        rows = self.tables[seqs].clone()  # [B, M]
        used = -(-torch.tensor(lens) // self.block_size)  # [B]
        rows[torch.arange(rows.shape[1])[None, :] >= used[:, None]] = self.num_blocks
        return rows.to(torch.int32)


@pytest.fixture
def hf_model_dir(tmp_path: Path) -> Callable[..., tuple[torch.nn.Module, Path]]:
    """Factory: (family, tie, sharded) -> (reference model, directory it was saved to)."""

    def make(family: str, tie: bool, sharded: bool = False) -> tuple[torch.nn.Module, Path]:
        model = build_hf_model(family, tie)
        out = tmp_path / f"{family}-tie{int(tie)}-shard{int(sharded)}"
        return model, save_hf_model(model, out, sharded)

    return make


@pytest.fixture(scope="session")
def saved_family(tmp_path_factory) -> Callable[[str], tuple[torch.nn.Module, Path]]:
    """Factory: family -> (reference model, directory it was saved to), each built once a session
    (untied, but Gemma's, which ties as its checkpoints do)."""
    built: dict[str, tuple[torch.nn.Module, Path]] = {}

    def get(family: str) -> tuple[torch.nn.Module, Path]:
        if family not in built:
            model = build_hf_model(family, tie=family.startswith("gemma"))
            built[family] = model, save_hf_model(model, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture
def make_pager() -> type[LinearPager]:
    return LinearPager
