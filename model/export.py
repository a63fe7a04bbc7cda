"""Serving-format save/load: a folder with config.json (a Qwen3 config + DFlash fields), model.safetensors with bare
keys (bf16 by default), which SGLang, vLLM and z-lab's DFlashDraftModel load (docs/ALGORITHM.md, section 4), and the
modeling code for transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True, dtype="auto")`:
modeling_dflash.py with this project's drafter.py, attention.py and dflash2.py beside it (REMOTE_CODE); and a README.md
model card with what the drafter was trained for and the commands that serve it (model_card). export_dflash2 /
load_dflash2 do the same for a DFlash2 drafter (model/dflash2.py)."""
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.dflash2 import DFlash2Config, DFlash2Drafter
from model.drafter import Drafter, DrafterConfig
from model.hub import HUB_ID

MODEL_DIR = Path(__file__).resolve().parent
REMOTE_CODE = ("modeling_dflash.py", "drafter.py", "attention.py", "dflash2.py")   # copied into every export, as is
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def serving_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    L = cfg.num_hidden_layers
    n_sliding = cfg.layer_types.count("sliding_attention")
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},   # trust_remote_code: the files beside it
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": L,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": n_sliding > 0,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": L - n_sliding,          # Qwen3's rule: layers >= max_window_layers slide
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        # transformers 4.x loaders (z-lab pins 4.57.1) read only the top-level key and fall back to 10000 silently
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
    }


def serving_config_dflash2(cfg: DFlash2Config, dtype: torch.dtype) -> dict:
    """serving_config under DFlash2's architecture name, with its fields in dflash_config (the keys z-lab's
    DFlash2DraftModel, SGLang and vLLM read). No `is_causal`: z-lab's reference and vLLM then make sliding layers
    causal inside the block and full layers bidirectional, as this project trains them (z-lab's published DFlash2
    drafters say `is_causal: false`, all layers sliding)."""
    c = serving_config(cfg, dtype)
    c["architectures"] = ["DFlash2DraftModel"]
    c["auto_map"] = {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    c["dflash_config"].update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                              selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    return c


def export_dflash2(drafter: DFlash2Drafter, out_dir, dtype=torch.bfloat16, state=None, **card) -> Path:
    """export_drafter of a DFlash2 drafter: its config (serving_config_dflash2), its weights under the names the
    engines read (layers.{i}.attention_conv / mlp_conv.base_kernel [2, taps, H] and .kernel_projection.weight
    [2 * taps * H / group, H]; candidate_selector.predecessor_codebook and successor_codebook [V, rank],
    candidate_selector.hidden_projection.weight [rank, H]); modeling_dflash.DFlash2DraftModel runs it."""
    return export_drafter(drafter, out_dir, dtype, state, config=serving_config_dflash2(drafter.config, dtype), **card)


def export_drafter(drafter: Drafter, out_dir, dtype=torch.bfloat16, state=None, *, target=None,
                   target_fingerprint=None, step=None, data=None, evaluation=None, config=None) -> Path:
    """Write config.json, model.safetensors, the modeling code (REMOTE_CODE) and README.md to out_dir atomically (tmp
    folder, then os.replace). dtype: the weights' on the way out; bf16 by default, what serving runs next to a bf16
    target (the trainer's fp32 master weights stay in its state.pt). state: the whole state dict to write instead of
    drafter.state_dict() (a sharded drafter's, gathered: checkpoint.full_state). The rest only feeds the model card
    (model_card), each optional: target (its Hub id or folder), target_fingerprint (checkpoint.target_fingerprint),
    step (optimizer steps trained), data (a dict summarising the data, e.g. data.loader.Data.fingerprint()),
    evaluation (trainer.evaluate.evaluate's result at this step: tau, tau_by_category, lossless, prompts). config: another
    architecture's config.json (export_dflash2)."""
    out = Path(out_dir)
    state = drafter.state_dict() if state is None else state
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config_json = json.dumps(config or serving_config(drafter.config, dtype), indent=2)
    (tmp / "config.json").write_text(config_json)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in REMOTE_CODE:
        shutil.copyfile(MODEL_DIR / name, tmp / name)
    card = model_card(drafter.config, dtype, target, target_fingerprint, step, data, evaluation,
                      config_sha256=hashlib.sha256(config_json.encode()).hexdigest())
    (tmp / "README.md").write_text(card)
    # os.replace cannot overwrite a non-empty folder: move the old one aside first, drop it after the swap
    old = out.with_name(f"{out.name}.old{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------
# The model card

HUB_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")   # a Hugging Face cache folder


def target_name(target) -> str | None:
    """The name to serve the target by, valid from any folder: a Hugging Face cache snapshot folder as its Hub id
    (org/name), a Hub id that is no local folder as it is, a folder as its absolute path."""
    if target is None:
        return None
    m = HUB_SNAPSHOT.search(str(target))
    if m:
        return f"{m[1]}/{m[2]}"
    path = Path(target).expanduser()
    if not path.exists() and HUB_ID.fullmatch(str(target)):
        return str(target)
    return str(path.resolve())


def file_sha256(path) -> str | None:
    """sha256 of a file's bytes, as `sha256sum` prints it; None when there is no such file."""
    path = Path(path)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _fmt(x) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def model_card(cfg: DrafterConfig, dtype, target=None, target_fingerprint=None, step=None, data=None,
               evaluation=None, config_sha256=None) -> str:
    """README.md of an export: what the drafter reads and was trained on, tau if measured, how to serve it. Every
    hash it shows can be checked: config_sha256 is this export's config.json as `sha256sum` prints it, the target's
    config.json likewise, and data's content_hash is the one data.prepare wrote to DATA/stats.json."""
    name = target_name(target)
    tgt = name or "TARGET"                 # the serving commands' target: a Hub id or an absolute folder
    B, dflash2 = cfg.block_size, isinstance(cfg, DFlash2Config)
    rows = _card_rows(cfg, dtype, name, target, target_fingerprint, step, data, config_sha256)
    lines = []
    if name and HUB_ID.fullmatch(name):
        lines += ["---", f"base_model: {name}", "library_name: transformers",
                  "tags:", "- dflash"] + (["- dflash2"] if dflash2 else []) + ["- speculative-decoding", "---", ""]
    kind = "DFlash2" if dflash2 else "DFlash"
    lines += [f"# {kind} drafter for {name or 'its target'}", "",
              f"A {kind} block-diffusion drafter for speculative decoding: from the target's hidden states it drafts "
              f"{B - 1} tokens in one forward"
              + (" (block-local dynamic convolutions in every layer; a candidate selector picks each slot's token "
                 "given the one before)" if dflash2 else "")
              + "; the target verifies them, so the output is the target's own. It has no "
              "embedding or lm_head: it uses the target's, and it serves only the target it was trained on.", "",
              "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    lines += _card_measured(evaluation) + _card_serving(tgt, B, dflash2)
    return "\n".join(lines)


def _card_rows(cfg, dtype, name, target, target_fingerprint, step, data, config_sha256) -> list[tuple[str, str]]:
    """The model card's table: the target and its hashes, the drafter's shape, the training it had."""
    B = cfg.block_size
    n_sliding = cfg.layer_types.count("sliding_attention")
    rows = [("target", f"`{name}`" if name else "not recorded (pass target= to export_drafter)")]
    fp = target_fingerprint or {}
    folder = fp.get("path") or (target if target is not None and Path(target).expanduser().is_dir() else None)
    if folder and (sha := file_sha256(Path(folder).expanduser() / "config.json")):
        rows.append(("target config.json sha256", f"`{sha}` (`sha256sum config.json` in the target's folder)"))
    if fp.get("weights_sha256"):
        rows.append(("target weights fingerprint", f"`{fp['weights_sha256']}` (one sha256 over the weight files' "
                                                   f"names, headers and first tensor bytes, not a file's hash: "
                                                   f"checkpoint.target_fingerprint)"))
    if config_sha256:
        rows.append(("config.json sha256", f"`{config_sha256}` (`sha256sum config.json` in this folder)"))
    rows += [("block size", f"{B} (the anchor + {B - 1} drafted tokens per step)"),
             ("draft layers", f"{cfg.num_hidden_layers}" + (f" ({n_sliding} sliding, window {cfg.sliding_window})"
                                                             if n_sliding else "")),
             ("tapped target layers", f"{list(cfg.target_layer_ids)} of {cfg.num_target_layers} "
                                      f"(decoder layer l = HF hidden_states[l + 1])"),
             ("mask token id", str(cfg.mask_token_id)),
             ("weights", f"model.safetensors, {_DTYPE_NAMES[dtype]}")]
    dflash2 = isinstance(cfg, DFlash2Config)
    if dflash2:
        rows += [("architecture", "`DFlash2DraftModel` (config.json `architectures`)"),
                 ("convolutions", f"{cfg.conv_kernel_size} taps, groups of {cfg.conv_group_size} channels, around "
                                  f"the attention and the MLP of every layer, inside the block"),
                 ("candidate selector", f"rescores the unary top-{cfg.selector_top_k} of every slot, rank "
                                        f"{cfg.selector_rank}; the draft is its walk from the verified anchor")]
    if step is not None:
        rows.append(("training steps", str(step)))
    for k, v in (data or {}).items():
        if k == "content_hash":
            rows.append(("data content_hash", f"`{v}` (`content_hash` in DATA/stats.json, written by data.prepare)"
                         if v else "not recorded (DATA has no stats.json from data.prepare)"))
        elif v is not None:
            rows.append((f"data {k}", _fmt(v)))
    return rows


def _card_measured(evaluation) -> list[str]:
    """The card's "Measured at export" section: tau overall and per category, or how to measure it."""
    lines = ["## Measured at export", ""]
    if evaluation and evaluation.get("tau") is not None:
        e = evaluation
        lossless = {True: ", lossless", False: ", NOT lossless (see the evaluation log)"}.get(e.get("lossless"), "")
        prompts = f" on {e['prompts']} prompts" if e.get("prompts") else ""
        prompts += f" of `{e['prompts_file']}`" if e.get("prompts_file") else ""
        lines += [f"tau (tokens committed per verify step, greedy block verification) = **{_fmt(float(e['tau']))}**"
                  f"{prompts}{lossless} (eval_dflash.py).", ""]
        cats = e.get("tau_categories") or {}
        if cats:   # eval_dflash's per-category stats: {category: {prompts, mean, se}}, and the macro-average
            se = lambda x: "-" if x is None else _fmt(x)   # noqa: E731
            lines += ["| category | prompts | tau | SE |", "|---|---|---|---|"] + \
                     [f"| {c} | {v['prompts']} | {_fmt(v['mean'])} | {se(v['se'])} |" for c, v in cats.items()]
            if e.get("tau_macro") is not None:
                lines += [f"| **macro** (each category weighted equally) | | **{_fmt(e['tau_macro'])}** | "
                          f"{se(e.get('tau_macro_se'))} |"]
            lines += [""]
        elif e.get("tau_by_category"):
            lines += ["| category | tau |", "|---|---|"] + \
                     [f"| {c} | {_fmt(t)} |" for c, t in e["tau_by_category"].items()] + [""]
    else:
        lines += ["No evaluation ran for this export; measure tau with "
                  "`python eval_dflash.py --target TARGET --drafter THIS_FOLDER --prompts PROMPTS.jsonl`.", ""]
    return lines


def _card_serving(tgt: str, B: int, dflash2: bool) -> list[str]:
    """The card's "Serve it" and "What was checked" sections: SGLang, vLLM and Transformers commands."""
    return ["## Serve it", "",
              "`DRAFTER` is this folder (or its Hub id once uploaded)."
              + (" The engines load a DFlash2 drafter through the same DFLASH speculative flags, choosing the model "
                 "by config.json's `architectures` (`DFlash2DraftModel`): use a release whose DFlash support "
                 "includes DFlash2 (not checked here)." if dflash2 else ""), "",
              "SGLang (`--speculative-num-draft-tokens` is the block size):", "", "```bash",
              f"python -m sglang.launch_server --model-path {tgt} \\",
              "    --speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER \\",
              f"    --speculative-num-draft-tokens {B} --trust-remote-code", "```", "",
              "vLLM (`num_speculative_tokens` is the block size - 1, the drafted tokens):", "", "```bash",
              f"vllm serve {tgt} \\",
              f"    --speculative-config '{{\"method\": \"dflash\", \"model\": \"DRAFTER\", "
              f"\"num_speculative_tokens\": {B - 1}}}'", "```", "",
              "Transformers (this folder's own modeling_dflash.py; one prompt at a time):", "", "```python",
              "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
              "",
              'draft = AutoModel.from_pretrained("DRAFTER", trust_remote_code=True, dtype="auto", '
              'device_map="cuda:0").eval()',
              f'target = AutoModelForCausalLM.from_pretrained("{tgt}", dtype="auto", device_map="cuda:0").eval()',
              f'tokenizer = AutoTokenizer.from_pretrained("{tgt}")',
              'messages = [{"role": "user", "content": "How many positive whole-number divisors does 196 have?"}]',
              'input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
              '                                          return_dict=True)["input_ids"].to(draft.device)',
              "output = draft.spec_generate(input_ids=input_ids, max_new_tokens=2048, temperature=0.0, target=target,",
              "                             stop_token_ids=[tokenizer.eos_token_id])",
              "print(tokenizer.decode(output[0], skip_special_tokens=False))", "```", "",
              "## What was checked", "",
              "- Verified by this project's tests on a tiny target (CPU): the Transformers quick start above "
              "(spec_generate returns exactly the target's greedy `generate` output), and that config.json carries "
              "the keys SGLang's and vLLM's DFlash loaders read, with the types they check.",
              "- Not run here: SGLang and vLLM themselves. Their flags are as documented in z-lab/dflash's README "
              "(SGLang `--speculative-algorithm DFLASH --speculative-draft-model-path`, "
              "`--speculative-num-draft-tokens` = block size; vLLM `--speculative-config` with "
              "`\"method\": \"dflash\"` and `num_speculative_tokens` = block size - 1). "
              "Older SGLang builds read only `dflash_config.mask_token` (a string, default "
              "`<|MASK|>`), not `mask_token_id`; use one that reads `dflash_config.mask_token_id`.", ""]


def load_drafter(path, device="cpu", dtype=None) -> Drafter:
    """Inverse of export_drafter: built on the meta device, weights assigned straight from the file."""
    path = Path(path)
    with open(path / "config.json") as f:
        c = json.load(f)
    assert c.get("architectures") != ["DFlash2DraftModel"], f"{path} is a DFlash2 export: load it with load_dflash2"
    return _load(path, Drafter, DrafterConfig.from_serving(c), device, dtype)


def load_dflash2(path, device="cpu", dtype=None) -> DFlash2Drafter:
    """Inverse of export_dflash2."""
    path = Path(path)
    with open(path / "config.json") as f:
        c = json.load(f)
    assert c.get("architectures") == ["DFlash2DraftModel"], f"{path} is not a DFlash2 export: {c.get('architectures')}"
    return _load(path, DFlash2Drafter, DFlash2Config.from_serving(c), device, dtype)


def _load(path, cls, cfg, device, dtype):
    with torch.device("meta"):
        drafter = cls(cfg)
    state = load_file(str(path / "model.safetensors"), device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter
