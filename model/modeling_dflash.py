"""The drafter as a transformers model, for z-lab's documented loading path:

    AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto")

model/export.py copies this file, drafter.py and attention.py into every export (config.json's auto_map names this
class), so the code that trained the weights is the code that runs them. Training never imports it.
"""
from transformers import PreTrainedModel, Qwen3Config

from .drafter import Drafter, DrafterCache, DrafterConfig


class DFlashDraftModel(PreTrainedModel):
    """The Drafter's modules under the checkpoint's names (layers.*, fc, hidden_norm, norm), run by the Drafter's own
    forward, context_kv and step. No embedding and no lm_head: DFlash uses the target's."""
    config_class = Qwen3Config
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        drafter = Drafter(DrafterConfig.from_serving(config.to_dict()))
        self.layers, self.fc, self.hidden_norm, self.norm = drafter.layers, drafter.fc, drafter.hidden_norm, drafter.norm
        object.__setattr__(self, "drafter", drafter)   # not a submodule: its modules are registered above
        self.block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.target_layer_ids = drafter.config.target_layer_ids
        self.post_init()

    def _init_weights(self, module):
        Drafter._init_weights(module)   # what a fresh Drafter has; loaded weights replace it

    def forward(self, features, ctx_positions, block_emb, block_positions, attn):
        """Drafter.forward: features [T, K*H] of the target's tapped layers (HF hidden_states[l + 1]), block_emb
        [N*B, H] embedded with the target's embedding -> [N*B, H] for the target's lm_head."""
        return self.drafter(features, ctx_positions, block_emb, block_positions, attn)

    def new_cache(self) -> DrafterCache:
        """Context keys/values for inference with step() (see eval_dflash.py for the decode loop)."""
        return DrafterCache(self.drafter)

    def step(self, cache: DrafterCache, block_emb, block_positions):
        return self.drafter.step(cache, block_emb, block_positions)
