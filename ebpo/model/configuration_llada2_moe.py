"""`LLaDA2MoeConfig`: the Hugging Face configuration of the LLaDA2.x MoE block-diffusion model.

Field names follow the released `configuration_llada2_moe.py` so a real checkpoint's `config.json`
loads as is. `validate()` runs on construction; each error names the offending field.
"""
from __future__ import annotations

from transformers import PretrainedConfig


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int = 5120,
        moe_intermediate_size: int = 512,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 4,
        head_dim: int | None = 128,
        num_experts: int = 256,
        num_experts_per_tok: int = 8,
        num_shared_experts: int = 1,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        norm_topk_prob: bool = True,
        score_function: str = "sigmoid",
        moe_router_enable_expert_bias: bool = True,
        first_k_dense_replace: int = 1,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_bias: bool = False,
        use_qk_norm: bool = True,
        partial_rotary_factor: float = 0.5,
        rope_theta: float = 600000.0,
        rope_scaling: dict | None = None,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        pad_token_id: int = 156892,
        eos_token_id: int = 156892,
        bos_token_id: int = 156891,
        mask_token_id: int = 156895,
        delete_token_id: int | None = None,
        insert_token_id: int | None = None,
        block_size: int = 32,
        moe_impl: str = "auto",
        block_routing_capacity: int = 0,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.score_function = score_function
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.first_k_dense_replace = first_k_dense_replace
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.use_qk_norm = use_qk_norm
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_theta = rope_theta
        if rope_scaling is not None:
            raise ValueError(f"LLaDA2MoeConfig.rope_scaling: only null is supported, got {rope_scaling!r}")
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        # Levenshtein edit-control tokens (LLaDA2.2; docs/decoding.md): predicting DELETE at position i removes
        # x_i, INSERT turns x_i into ([MASK], x_i). None (the released configs) = no Levenshtein editing.
        self.delete_token_id = delete_token_id
        self.insert_token_id = insert_token_id
        # Block length of the block-diffusion schedule (32 for LLaDA2.x). Not in the released config:
        # the released generation code takes it as an argument; ours keeps it next to the model.
        self.block_size = block_size
        # "auto" | "grouped" | "dense": how routed experts are computed (see LLaDA2MoeExperts).
        self.moe_impl = moe_impl
        # LLaDA2.2 block routing (ebpo.model.routing, docs/background.md section 9): every diffusion block
        # admits C routed experts and its tokens route inside them. 0 (default) or C >= num_experts: off,
        # per-token routing bit for bit. Not in the released LLaDA2.1 config.
        self.block_routing_capacity = block_routing_capacity
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field (docs/background.md section 1 constraints)."""

        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"LLaDA2MoeConfig.{field}: {msg}")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "intermediate_size", "block_size"):
            v = getattr(self, field)
            need(isinstance(v, int) and v > 0, field, f"must be a positive integer, got {v!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"{self.num_attention_heads} must be a multiple of num_key_value_heads={self.num_key_value_heads}")
        need(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor",
             f"must lie in (0, 1], got {self.partial_rotary_factor}")
        rot = int(self.head_dim * self.partial_rotary_factor)
        need(rot % 2 == 0 and rot > 0, "partial_rotary_factor",
             f"head_dim * partial_rotary_factor = {rot} must be a positive even number")
        need(self.score_function == "sigmoid", "score_function", f"only 'sigmoid' is supported, got {self.score_function!r}")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        need(self.moe_impl in ("auto", "grouped", "dense"), "moe_impl",
             f"must be one of 'auto', 'grouped', 'dense', got {self.moe_impl!r}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must lie in [0, num_hidden_layers={self.num_hidden_layers}], got {self.first_k_dense_replace}")
        if self.first_k_dense_replace < self.num_hidden_layers:  # there are MoE layers
            need(self.num_experts > 0, "num_experts", f"must be positive, got {self.num_experts}")
            need(self.n_group > 0 and self.num_experts % self.n_group == 0, "n_group",
                 f"num_experts={self.num_experts} must be divisible by n_group={self.n_group}")
            per_group = self.num_experts // self.n_group
            need(per_group >= 2, "n_group", f"each group needs at least 2 experts, got {per_group}")
            need(1 <= self.topk_group <= self.n_group, "topk_group",
                 f"must lie in [1, n_group={self.n_group}], got {self.topk_group}")
            need(1 <= self.num_experts_per_tok <= self.topk_group * per_group, "num_experts_per_tok",
                 f"must lie in [1, topk_group * experts_per_group = {self.topk_group * per_group}], "
                 f"got {self.num_experts_per_tok}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
            C = self.block_routing_capacity
            need(isinstance(C, int) and C >= 0, "block_routing_capacity", f"must be an integer >= 0, got {C!r}")
            if 0 < C < self.num_experts:  # on: the pool lies inside the block's topk_group groups (routing.py)
                need(self.num_experts_per_tok <= C <= self.topk_group * per_group, "block_routing_capacity",
                     f"must be 0 (off), >= num_experts={self.num_experts} (off), or lie in [num_experts_per_tok="
                     f"{self.num_experts_per_tok}, topk_group * experts_per_group = {self.topk_group * per_group}], "
                     f"got {C}")
        edit = (self.delete_token_id, self.insert_token_id)
        need((edit[0] is None) == (edit[1] is None), "insert_token_id",
             f"delete_token_id and insert_token_id are set together or not at all, got {edit}")
        if edit[0] is not None:
            need(len({int(edit[0]), int(edit[1]), int(self.mask_token_id)}) == 3, "delete_token_id",
                 f"delete/insert/mask token ids must differ, got {edit + (self.mask_token_id,)}")
        for field in ("mask_token_id", "eos_token_id", "pad_token_id", "delete_token_id", "insert_token_id"):
            v = getattr(self, field)
            if v is not None:
                ids = v if isinstance(v, (list, tuple)) else [v]
                need(all(0 <= int(i) < self.vocab_size for i in ids), field,
                     f"{v} must lie inside the vocabulary [0, {self.vocab_size})")
