"""The frozen target: any local HF causal LM folder, run only up to the last tapped layer, returning the
concatenated hidden states the drafter reads as context (packed: `target_features`); sharded over the ranks of a
target replica with FSDP2 (`load_sharded`, TARGET_SHARDS); the embedding and lm_head alone for the drafter ranks
(`load_frozen_io`); the MASK token; a Hub id resolved from the local cache (`resolve_model_path`)."""
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

# The demo target, SmolLM2-135M-Instruct as an HF folder (python -m tools.smollm2 writes it): the trainer's default
DEFAULT_TARGET = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"
class Target:
    """Frozen HF causal LM. features() runs decoder layers 0..max(layer_ids) only and returns their outputs
    concatenated, [b, S, K*H], equal to HF's output_hidden_states[l + 1]: the last decoder layer's entry there is
    after the final norm, so a tap of the last layer is normed too (what eval_dflash and serving read).
    shard_group: the process group of this rank's target replica (TARGET_SHARDS ranks): the model is then built by
    load_sharded, each rank holding 1/N of the weights of layers 0..max(layer_ids), and every rank of the group
    must call features() equally often (pipe.Replica sees to it); there is no lm_head then (the drafter ranks load
    theirs)."""

    def __init__(self, path, device="cpu", dtype=torch.bfloat16, layer_ids=None, shard_group=None):
        path = Path(path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target folder {path} has no config.json: pass a local HF model folder")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"target folder {path} is not a causal LM (model_type={config.model_type!r}, "
                             f"architectures={getattr(config, 'architectures', None)}): the target must load with "
                             f"transformers.AutoModelForCausalLM")
        self.sharded = shard_group is not None
        if self.sharded:
            assert layer_ids, "a sharded target needs its layer_ids (the layers past the last tap are not loaded)"
            self.model = load_sharded(path, config, dtype, device, shard_group, max(layer_ids))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
            self.model.to(device)
        self.model.eval().requires_grad_(False)
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
        # [V, H], may be tied; None when sharded (its rows are spread over the replica, and only the one process,
        # which never shards, trains its drafter on the target's own lm_head)
        self.lm_head_weight = None if self.sharded else self.model.get_output_embeddings().weight
        self.device, self.dtype = torch.device(device), dtype

    def compile_layers(self) -> None:
        """torch.compile each decoder layer (fuses the norms, RoPE, SiLU and residual adds between the matmuls).
        Per-layer wrappers, so features()' hooks sit outside the compiled code; a second sequence length makes
        the graphs dynamic (torch.compile's automatic dynamic shapes), so mixed lengths compile twice, not per batch."""
        for i in range(len(self.decoder.layers)):
            self.decoder.layers[i] = torch.compile(self.decoder.layers[i])

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
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
            self.decoder.layers = full
        if self.num_layers - 1 in taps:   # the whole stack ran: the decoder's output is the last layer's, normed
            taps[self.num_layers - 1] = out.last_hidden_state   # (a sharded norm is only whole inside the forward)
        return torch.cat([taps[l] for l in layer_ids], dim=-1)                 # [b, S, K*H]


# ---------------------------------------------------------------------------
# A target sharded over the ranks of one replica (TARGET_SHARDS)
#
# FSDP2, not tensor parallelism (why, with the arithmetic: docs/multi-gpu.md, Targets larger than one GPU): every
# rank of a replica forwards its own micro-batch, so the rest of the pipeline (one target rank -> its drafters, the
# plan g % TARGET_RANKS) is unchanged, and the cost is one all-gather of each layer's weights per micro-batch,
# prefetched under the previous layer's compute.

@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory) and their buffers for real: RoPE's
    inv_freq is computed at construction and is in no checkpoint (accelerate's init_empty_weights, buffers kept)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _checkpoint_rows(path):
    """name -> rows(a, b): rows a..b-1 (dim 0) of that tensor read from the folder's safetensors files, so a rank
    reads only its shard. {} when the weights are not safetensors."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    rows = {}
    for f in files:
        if not (path / f).exists():
            return {}
        with safe_open(path / f, framework="pt") as sf:
            for k in sf.keys():
                rows[k] = (path / f, k)

    def reader(file, key):
        def read(a, b):
            with safe_open(file, framework="pt") as sf:
                sl = sf.get_slice(key)
                return sl[a:b], tuple(sl.get_shape())
        return read
    return {k: reader(*v) for k, v in rows.items()}


def load_sharded(path, config, dtype, device, group, last_layer):
    """The causal LM with decoder layers 0..last_layer only (the rest and the lm_head never load), sharded over
    `group` with FSDP2 (torch.distributed.fsdp.fully_shard): the embedding, each decoder layer and the rest of the
    decoder (final norm) are one unit each, sharded on dim 0, all-gathered inside the forward and resharded after it
    (reshard_after_forward), each unit prefetching the next one's all-gather. No rank ever holds the whole model:
    the skeleton is built on the meta device, each rank allocates its 1/N on `device` and reads only those rows of
    the safetensors files. A checkpoint whose names differ from the modules' (a conversion transformers applies
    while loading) falls back to loading the model on the CPU (whole, per rank) and copying out each rank's rows."""
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    decoder = model.get_decoder()
    decoder.layers = nn.ModuleList(decoder.layers[: last_layer + 1])
    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    units = [decoder.embed_tokens, *decoder.layers]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True)          # the root: final norm (and nothing else)
    for unit, nxt in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([nxt])
    buffers = {n: b.clone() for n, b in decoder.named_buffers()}        # to_empty drops their values
    decoder.to_empty(device=device)
    with torch.no_grad():
        for n, b in decoder.named_buffers():
            b.copy_(buffers[n])
    params = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}   # the lm_head stays on meta
    source = _checkpoint_rows(path)
    if not all(n in source for n in params):
        full = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).state_dict()
        source = {n: (lambda a, b, t=full[n]: (t[a:b], tuple(t.shape))) for n in params}
    rank, n_shards = dist.get_rank(group), dist.get_world_size(group)
    with torch.no_grad():
        for n, p in params.items():
            local = p.to_local()                                           # [rows of this rank, ...]
            c = -(-p.shape[0] // n_shards)                                 # torch.chunk's split, as FSDP2's
            a, b = min(p.shape[0], rank * c), min(p.shape[0], (rank + 1) * c)
            rows, shape = source[n](a, b)
            if shape != tuple(p.shape) or local.shape[0] != b - a:
                raise ValueError(f"target weight {n}: the checkpoint holds {list(shape)}, the model built from "
                                 f"config.json {list(p.shape)}: {path} is inconsistent")
            local.copy_(rows)
    return model


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
