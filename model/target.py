"""The frozen target: any local HF causal LM folder, run only up to the last tapped layer, returning the
concatenated hidden states the drafter reads as context (packed: `target_features`); the embedding and lm_head
alone for the drafter ranks (`load_frozen_io`); the MASK token."""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

# The demo target, SmolLM2-135M-Instruct as an HF folder (python -m tools.smollm2 writes it): the trainer's default
DEFAULT_TARGET = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"


class Target:
    """Frozen HF causal LM. features() runs decoder layers 0..max(layer_ids) only and returns their outputs
    concatenated, [b, S, K*H], equal to HF's output_hidden_states[l + 1]: the last decoder layer's entry there is
    after the final norm, so a tap of the last layer is normed too (what eval_dflash and serving read)."""

    def __init__(self, path, device="cpu", dtype=torch.bfloat16, layer_ids=None):
        path = Path(path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target folder {path} has no config.json: pass a local HF model folder")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"target folder {path} is not a causal LM (model_type={config.model_type!r}, "
                             f"architectures={getattr(config, 'architectures', None)}): the target must load with "
                             f"transformers.AutoModelForCausalLM")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        self.model.to(device).eval().requires_grad_(False)
        self.hf_config = self.model.config.get_text_config()
        self.num_layers = self.hf_config.num_hidden_layers
        self.decoder = self.model.get_decoder()            # the base model holding .layers (Qwen3Model, LlamaModel)
        if not isinstance(getattr(self.decoder, "layers", None), nn.ModuleList):
            raise ValueError(f"{type(self.model).__name__} has no decoder layer stack (.get_decoder().layers) to tap; "
                             f"the target must be a decoder-only causal LM (Llama, Qwen, ...)")
        self.layer_ids = list(layer_ids) if layer_ids is not None else []
        assert all(0 <= l < self.num_layers for l in self.layer_ids), \
            f"layer_ids {self.layer_ids} outside 0..{self.num_layers - 1}"
        if self.num_layers - 1 in self.layer_ids and not isinstance(getattr(self.decoder, "norm", None), nn.Module):
            raise ValueError(f"{type(self.decoder).__name__} has no final norm (.norm) to apply to its last layer "
                             f"{self.num_layers - 1}, which is tapped: tap an earlier layer (TARGET_LAYER_IDS)")
        self.embed_tokens: nn.Embedding = self.model.get_input_embeddings()
        self.lm_head_weight: torch.Tensor = self.model.get_output_embeddings().weight   # [V, H], may be tied
        self.device, self.dtype = torch.device(device), self.embed_tokens.weight.dtype

    def compile_layers(self) -> None:
        """torch.compile each decoder layer (fuses the norms, RoPE, SiLU and residual adds between the matmuls).
        Per-layer wrappers, so features()' hooks sit outside the compiled code; a second sequence length makes
        the graphs dynamic (torch.compile's automatic dynamic shapes), so mixed lengths compile twice, not per batch."""
        for i in range(len(self.decoder.layers)):
            self.decoder.layers[i] = torch.compile(self.decoder.layers[i])

    def warm_up(self, max_tokens: int) -> None:
        """Make every graph the compiled layers need for real micro-batches now, on the calling thread, so that
        later calls from any thread only run them: synthetic batches (at most max_tokens tokens each) with padding,
        at two lengths (the first call compiles static shapes, the second makes them dynamic), one of a single
        sequence (a size-1 batch dimension is specialised) and one without padding (HF passes no attention mask)."""
        S = max(16, min(128, max_tokens // 4))
        gen = torch.Generator().manual_seed(0)
        for b, n, padded in ((2, S, True), (3, S - 3, True), (1, S - 5, False), (2, S - 7, False)):
            ids = torch.randint(0, self.hf_config.vocab_size, (b, n), generator=gen)
            attn = torch.ones(b, n, dtype=torch.long)
            if padded:
                attn[-1, n // 2:] = 0                                          # right padding, as Data.batch pads
            self.features(ids.to(self.device), attn.to(self.device))

    @torch.no_grad()   # not inference_mode: the drafter's autograd graph must be allowed to read the features
    def features(self, input_ids, attention_mask=None, layer_ids=None):
        """input_ids, attention_mask [b, S] (right padding) -> [b, S, K*H]."""
        layer_ids = list(layer_ids) if layer_ids is not None else self.layer_ids
        assert layer_ids, "no target layers to tap: pass layer_ids"
        full = self.decoder.layers
        taps, hooks = {}, []

        def keep(l):
            def hook(_module, _inputs, out):
                taps[l] = out[0] if isinstance(out, tuple) else out
            return hook
        try:
            # only the layers up to the last tap run; hooks keep just the K tapped outputs alive
            self.decoder.layers = nn.ModuleList(full[: max(layer_ids) + 1])
            hooks = [self.decoder.layers[l].register_forward_hook(keep(l)) for l in set(layer_ids)]
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
            self.decoder.layers = full
        last = self.num_layers - 1
        if last in taps:
            taps[last] = self.decoder.norm(taps[last])
        return torch.cat([taps[l] for l in layer_ids], dim=-1)                 # [b, S, K*H]


def target_features(target, ids, attn, device):
    """[b, S] padded -> features [T, K*H] of the real tokens, packed, on device."""
    feats = target.features(ids.to(device, non_blocking=True), attn.to(device, non_blocking=True))  # [b, S, K*H]
    keep = attn.flatten().nonzero().squeeze(1)       # found on the CPU: a boolean index on the GPU would sync
    return feats.flatten(0, 1).index_select(0, keep.to(device, non_blocking=True))  # [T, K*H]


def load_frozen_io(path, device, dtype):
    """The target's embedding and lm_head weights only (drafter ranks never load the whole target).
    -> (embedding module, lm_head weight [V, H], the text config)."""
    path = Path(path)
    top = AutoConfig.from_pretrained(path, local_files_only=True)
    cfg = top.get_text_config()
    tied = bool(getattr(top, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    found = {}
    for f in files:
        if not (path / f).exists():
            continue
        with safe_open(path / f, framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = sf.get_tensor(k)
                elif k == "lm_head.weight":
                    found["head"] = sf.get_tensor(k)
    if "embed" not in found or ("head" not in found and not tied):
        # not safetensors, or unusual names: let transformers find the two tensors
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        found = {"embed": m.get_input_embeddings().weight.detach(), "head": m.get_output_embeddings().weight.detach()}
    found.setdefault("head", found["embed"])                                             # tied embeddings
    embed = torch.nn.Embedding.from_pretrained(found["embed"].to(device, dtype), freeze=True)
    return embed, found["head"].to(device, dtype).requires_grad_(False), cfg


# ---------------------------------------------------------------------------
# The MASK token

def _template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(t.values()) if isinstance(t, dict) else str(t)


def _reserved_ids(tokenizer) -> set:
    return {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                        tokenizer.unk_token_id) if i is not None}


def default_mask_token_id(tokenizer, vocab_rows: int) -> int:
    """The first embedding row past the tokenizer (Qwen3: 151669) when there is one; otherwise (SmolLM2: 49152 ==
    vocab rows) the highest-id added special token that is not bos/eos/pad/unk and does not occur in the chat
    template (SmolLM2 -> 16 '<empty_output>'), so the MASK never collides with a token of the training data."""
    n = len(tokenizer)
    if n < vocab_rows:
        return n
    reserved, template = _reserved_ids(tokenizer), _template_text(tokenizer)
    cands = [i for i, tok in tokenizer.added_tokens_decoder.items()
             if tok.special and i not in reserved and tok.content not in template and i < vocab_rows]
    if not cands:
        raise ValueError(f"no free MASK token: the tokenizer fills all {vocab_rows} embedding rows and every added "
                         f"special token is reserved or used by the chat template; pass MASK_TOKEN_ID explicitly")
    return max(cands)


def check_mask_token_id(mask_id: int, tokenizer, vocab_rows: int) -> None:
    """Raise ValueError unless mask_id is an embedding row that no training token uses."""
    if not 0 <= mask_id < vocab_rows:
        raise ValueError(f"mask_token_id {mask_id} is outside the target's embedding (0..{vocab_rows - 1}); "
                         f"fix: use default_mask_token_id(tokenizer, {vocab_rows}) = "
                         f"{default_mask_token_id(tokenizer, vocab_rows)}")
    if mask_id >= len(tokenizer):
        return   # an unused row past the tokenizer: the intended case
    tok = tokenizer.added_tokens_decoder.get(mask_id)
    problem = None
    if tok is None or not tok.special:
        problem = "an ordinary vocabulary token (it occurs in the training text)"
    elif mask_id in _reserved_ids(tokenizer):
        problem = "the tokenizer's bos/eos/pad/unk token"
    elif tok.content in _template_text(tokenizer):
        problem = f"{tok.content!r}, which the chat template emits"
    if problem:
        raise ValueError(f"mask_token_id {mask_id} is {problem}; the drafter would confuse MASK with real input. "
                         f"fix: use default_mask_token_id(tokenizer, {vocab_rows}) = "
                         f"{default_mask_token_id(tokenizer, vocab_rows)}")
