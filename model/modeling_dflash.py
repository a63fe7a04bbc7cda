"""The drafter as a transformers model, for z-lab's documented loading path:

    AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto")

model/export.py copies this file, drafter.py, attention.py and dflash2.py into every export (config.json's auto_map
names the class: DFlashDraftModel, or DFlash2DraftModel), so the code that trained the weights is the code that runs
them. Training never imports it. `spec_generate` is z-lab's documented Transformers quick start, written here again (an
export cannot import this project's package):

    draft.spec_generate(input_ids=ids, target=target, max_new_tokens=256, stop_token_ids=[eos], temperature=0.0)
"""
import inspect
import math
import numbers
from types import SimpleNamespace

import torch
from transformers import DynamicCache, PreTrainedModel, Qwen3Config

from .dflash2 import CandidateSelector, DFlash2Config, DFlash2Drafter, GroupedDynamicCausalConv, selector_walk
from .drafter import Drafter, DrafterCache, DrafterConfig


class DFlashDraftModel(PreTrainedModel):
    """The Drafter's modules under the checkpoint's names (layers.*, fc, hidden_norm, norm), run by the Drafter's own
    forward, context_kv and step. No embedding and no lm_head: DFlash uses the target's."""
    config_class = Qwen3Config
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        drafter = self.build_drafter(config.to_dict())
        for name, module in drafter.named_children():      # layers, fc, hidden_norm, norm (+ DFlash2's selector)
            setattr(self, name, module)
        object.__setattr__(self, "drafter", drafter)   # not a submodule: its modules are registered above
        self.block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.target_layer_ids = drafter.config.target_layer_ids
        self.post_init()

    @staticmethod
    def build_drafter(c: dict) -> Drafter:
        return Drafter(DrafterConfig.from_serving(c))

    def _init_weights(self, module):
        Drafter._init_weights(module)   # what a fresh Drafter has; loaded weights replace it

    def propose(self, h, anchor, lm_head):
        """The draft of one block at T=0: h [B-1, H] the drafter's output at the drafted slots, anchor [1] the verified
        token -> [B-1] token ids. DFlash: each slot's argmax."""
        return lm_head(h.to(lm_head.weight.dtype)).argmax(-1)

    def forward(self, features, ctx_positions, block_emb, block_positions, attn):
        """Drafter.forward: features [T, K*H] of the target's tapped layers (HF hidden_states[l + 1]), block_emb
        [N*B, H] embedded with the target's embedding -> [N*B, H] for the target's lm_head."""
        return self.drafter(features, ctx_positions, block_emb, block_positions, attn)

    def new_cache(self) -> DrafterCache:
        """Context keys/values for inference with step() (see eval_dflash.py for the decode loop)."""
        return DrafterCache(self.drafter)

    def step(self, cache: DrafterCache, block_emb, block_positions):
        return self.drafter.step(cache, block_emb, block_positions)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0,
                      return_stats=False):
        """z-lab's DFlashDraftModel.spec_generate: speculative decoding of one prompt with `target` (the HF causal LM
        this drafter was trained on). input_ids [1, P] on the target's device -> [1, P + n] the prompt and n <=
        max_new_tokens new tokens, cut after the first of stop_token_ids. temperature 0: greedy, exactly the target's
        own greedy output; > 0: each committed token is sampled from the target (a draft token is kept when it equals
        the target's sample at its slot). return_stats: a SimpleNamespace(output_ids, num_input_tokens,
        num_output_tokens, acceptance_lengths) as z-lab's dflash_generate returns, acceptance_lengths the tokens
        committed per verify step (tau = their mean). max_new_tokens=0 returns the prompt as it is."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt: input_ids must be [1, P], got {list(input_ids.shape)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or \
                not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        tc = target.config.get_text_config()
        cfg = self.drafter.config
        if (tc.hidden_size, tc.num_hidden_layers) != (cfg.hidden_size, cfg.num_target_layers):
            raise ValueError(f"this drafter reads a {cfg.num_target_layers}-layer target of hidden size "
                             f"{cfg.hidden_size}; the target given has {tc.num_hidden_layers} layers of "
                             f"{tc.hidden_size}")
        dev, P, B = input_ids.device, input_ids.shape[1], self.block_size
        stops = set(stop_token_ids or [])
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if not 0 <= self.mask_token_id < embed.num_embeddings:   # the draft block starts as mask embeddings
            raise ValueError(f"this drafter's mask token id {self.mask_token_id} is outside the target's vocabulary "
                             f"({embed.num_embeddings} embedding rows; the drafter was trained for "
                             f"{cfg.vocab_size}): pass the target it was trained on")
        if max_new_tokens == 0:
            return SimpleNamespace(output_ids=input_ids, num_input_tokens=P, num_output_tokens=0,
                                   acceptance_lengths=[]) if return_stats else input_ids
        dtype = next(self.parameters()).dtype
        cache, ctx = DynamicCache(), DrafterCache(self.drafter)
        cache_kw = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"

        def verify(ids, start, **kw):
            """ids [n] at positions start.. -> the target's pick per position [n], features [n, K*H] (KV appended)."""
            out = target(input_ids=ids[None], position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                         use_cache=True, output_hidden_states=True, **{cache_kw: cache}, **kw)
            logits = out.logits[0].float()                                                     # [n or 1, V]
            if temperature > 0:
                pick = torch.multinomial(torch.softmax(logits / temperature, -1), 1)[:, 0]
            else:
                pick = logits.argmax(-1)
            # HF hidden_states[l + 1] is decoder layer l's output, what training tapped (the last one after the norm)
            return pick, torch.cat([out.hidden_states[l + 1][0] for l in self.target_layer_ids], -1).to(dtype)

        pick, feats = verify(input_ids[0], 0, logits_to_keep=1)
        new, steps = [int(pick[-1])], []
        ctx.append(feats, torch.arange(P, device=dev))
        while len(new) < max_new_tokens and new[-1] not in stops:
            start = P + len(new) - 1                                  # position of the last committed token
            block = torch.tensor([new[-1]] + [self.mask_token_id] * (B - 1), device=dev)                  # [B]
            h = self.drafter.step(ctx, embed(block).to(dtype), torch.arange(start, start + B, device=dev))  # [B, H]
            block[1:] = self.propose(h[1:], block[:1], lm_head)
            pick, feats = verify(block, start)                                                         # [B]
            a = int((block[1:] == pick[:-1]).int().cumprod(0).sum())     # draft tokens the target agrees with
            extra = cache.get_seq_length() - (start + a + 1)             # drop the KV of the rejected slots
            if extra > 0:
                cache.crop(-extra)
            ctx.append(feats[: a + 1], torch.arange(start, start + a + 1, device=dev))
            committed = block[1: a + 1].tolist() + [int(pick[a])]
            cut = next((i + 1 for i, t in enumerate(committed) if t in stops), len(committed))
            committed = committed[: min(cut, max_new_tokens - len(new))]
            new += committed
            steps.append(len(committed))
        out = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=dev)], dim=1)
        if not return_stats:
            return out
        return SimpleNamespace(output_ids=out, num_input_tokens=P, num_output_tokens=len(new), acceptance_lengths=steps)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 (dflash2.py): the DFlash modules, with the convolutions inside layers.*, plus candidate_selector;
    spec_generate drafts with the selector's walk from the verified anchor instead of each slot's argmax."""
    _no_split_modules = ["DFlash2Layer"]

    @staticmethod
    def build_drafter(c: dict) -> DFlash2Drafter:
        return DFlash2Drafter(DFlash2Config.from_serving(c))

    def _init_weights(self, module):
        Drafter._init_weights(module)
        if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
            module.reset_parameters()   # identity convolutions, zero transition: a fresh DFlash2 is its backbone

    def propose(self, h, anchor, lm_head):
        return selector_walk(self.drafter.candidate_selector, h[None], lm_head.weight, anchor)[0]
