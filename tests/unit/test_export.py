"""Serving format: exact round trip, exact key names and config fields, the folder read the way transformers'
AutoModel (trust_remote_code), SGLang, vLLM and vLLM's speculators converter read it."""
import json

import pytest
import torch
from safetensors.torch import load_file

from model.export import export_drafter, load_drafter


def test_round_trip_exact(build_drafter, tiny_llama_dir, tmp_path):
    d = build_drafter(tiny_llama_dir, num_layers=3, block_size=8, sliding_window_layers=1, sliding_window=32)
    out = export_drafter(d, tmp_path / "drafter", dtype=torch.float32)
    out = export_drafter(d, tmp_path / "drafter", dtype=torch.float32)   # overwriting an existing export works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"], "no tmp/old folders left behind"
    d2 = load_drafter(out, device="cpu")
    assert d2.config == d.config
    s1, s2 = d.state_dict(), d2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    d3 = load_drafter(out, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in d3.parameters())
    # the default export is bf16: the fp32 master weights rounded once
    served = load_file(export_drafter(d, tmp_path / "bf16") / "model.safetensors")
    assert all(served[k].dtype == torch.bfloat16 and torch.equal(served[k], v.bfloat16()) for k, v in s1.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_qwen3_export_keys_and_config(build_drafter, tiny_qwen3_dir, tmp_path):
    from transformers import AutoConfig, Qwen3Config
    L, B = 2, 16
    d = build_drafter(tiny_qwen3_dir, num_layers=L, block_size=B)
    H, K = d.config.hidden_size, d.config.num_taps
    out = export_drafter(d, tmp_path / "drafter")
    sd = load_file(out / "model.safetensors")
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    want = {f"layers.{i}.{k}" for i in range(L) for k in per_layer} | {"norm.weight", "fc.weight",
                                                                       "hidden_norm.weight"}
    assert set(sd) == want
    assert sd["fc.weight"].shape == (H, K * H)

    cfg = json.loads((out / "config.json").read_text())
    hf = AutoConfig.from_pretrained(tiny_qwen3_dir)
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    for k in ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "max_position_embeddings", "vocab_size"]:
        assert cfg[k] == getattr(hf, k), k
    assert cfg["num_hidden_layers"] == L and cfg["layer_types"] == ["full_attention"] * L
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["attention_bias"] is False and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]           # top level, for transformers-4 loaders
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": hf.rope_parameters["rope_theta"]}
    assert cfg["rope_scaling"] is None
    assert cfg["block_size"] == B and cfg["num_target_layers"] == hf.num_hidden_layers
    assert cfg["dflash_config"] == {"mask_token_id": hf.vocab_size - 1,
                                    "target_layer_ids": d.config.target_layer_ids}
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    # and transformers itself reads it back as the same Qwen3 config
    q = Qwen3Config.from_pretrained(out)
    assert q.rope_parameters["rope_theta"] == cfg["rope_theta"] and q.num_hidden_layers == L


def test_export_loads_with_automodel_trust_remote_code(build_drafter, tiny_qwen3_dir, tmp_path):
    """z-lab's documented path, AutoModel.from_pretrained(dir, trust_remote_code=True, dtype="auto"): the folder's own
    modeling code (this project's drafter.py, copied), bf16 as exported, the same weights and outputs as
    load_drafter's."""
    from transformers import AutoModel
    from model.objective import pack
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4, sliding_window_layers=1, sliding_window=16)
    out = export_drafter(d, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "attention.py", "config.json", "dflash2.py",
                                                     "drafter.py", "model.safetensors", "modeling_dflash.py"]
    m = AutoModel.from_pretrained(out, trust_remote_code=True, dtype="auto", local_files_only=True).eval()
    assert type(m).__name__ == "DFlashDraftModel" and {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ours = load_drafter(out)
    assert m.block_size == 4 and m.mask_token_id == d.config.mask_token_id
    assert m.drafter.config.__dict__ == d.config.__dict__     # a DrafterConfig of the copied module, same fields
    want, got = ours.state_dict(), m.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    g = torch.Generator().manual_seed(0)
    doc, pos = pack(torch.tensor([9, 7]))
    anchors = torch.tensor([2, 11])
    feats = torch.randn(16, d.config.num_taps * d.config.hidden_size, generator=g).bfloat16()
    emb = torch.randn(8, d.config.hidden_size, generator=g).bfloat16()
    bpos = torch.cat([pos[a] + torch.arange(4) for a in anchors])
    attn = ours.attn_spec(anchors, doc[anchors], doc)
    with torch.no_grad():
        assert torch.equal(m(feats, pos, emb, bpos, attn), ours(feats, pos, emb, bpos, attn))


def test_export_reads_as_the_sglang_and_vllm_loaders_read_it(build_drafter, tiny_qwen3_dir, tmp_path):
    """The config keys (with their types) and weights that the public DFlash loaders read, checked the way they read
    them (written from their code, not copied): SGLang python/sglang/srt/models/dflash.py with
    speculative/dflash_utils.py parse_dflash_draft_config; vLLM vllm/model_executor/models/qwen3_dflash.py with
    get_eagle3_aux_layers_from_config; vllm-project/speculators convert/dflash/converter.py."""
    from numbers import Integral
    from transformers import AutoConfig, Qwen3Config
    d = build_drafter(tiny_qwen3_dir, num_layers=3, block_size=8, sliding_window_layers=1, sliding_window=32)
    out = export_drafter(d, tmp_path / "drafter")
    raw = json.loads((out / "config.json").read_text())
    sd = load_file(out / "model.safetensors")
    n_target = AutoConfig.from_pretrained(tiny_qwen3_dir).num_hidden_layers
    H = raw["hidden_size"]

    # both serving stacks build the config with transformers from model_type, and pick the class by architectures
    cfg = AutoConfig.from_pretrained(out)
    assert isinstance(cfg, Qwen3Config) and "DFlashDraftModel" in cfg.architectures

    # SGLang: dflash_config first, then the top level; ints (not bools) in range
    dc = cfg.dflash_config
    L = raw["num_hidden_layers"]
    n_tgt = dc.get("num_target_layers", raw.get("num_target_layers"))
    block = dc.get("block_size", raw.get("block_size"))
    ids = dc.get("target_layer_ids", raw.get("target_layer_ids"))
    mask = dc.get("mask_token_id")
    assert isinstance(L, int) and L >= 1 and isinstance(n_tgt, int) and n_tgt == n_target and block == 8
    assert isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < n_tgt for i in ids)
    assert isinstance(mask, Integral) and not isinstance(mask, bool) and 0 <= mask < raw["vocab_size"]
    assert isinstance(dc.get("mask_token", "<|MASK|>"), str)
    assert raw["hidden_act"] == "silu" and raw["intermediate_size"] > 0
    assert len(cfg.layer_types) == L and set(cfg.layer_types) <= {"full_attention", "sliding_attention"}
    assert cfg.sliding_window == 32                                    # the window of its sliding layers
    assert sd["fc.weight"].shape == (H, len(ids) * H)                   # fc input: one hidden state per tap

    # vLLM: aux layers are DFlash's ids + 1 (HF hidden_states indices); sliding layers are causal, full ones not;
    # RoPE from rope_parameters; q/k/v and gate/up stacked from the separate tensors
    aux = [i + 1 for i in dc["target_layer_ids"]]
    assert getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) is None and all(1 <= a <= n_tgt for a in aux)
    assert sd["fc.weight"].shape[1] == (getattr(cfg, "target_hidden_size", None) or H) * len(aux)
    assert [lt == "sliding_attention" for lt in cfg.layer_types] == [False, False, True]
    assert dc.get("use_swa", False) is False and dc.get("causal") is None and getattr(cfg, "is_causal", None) is None
    assert cfg.rope_parameters["rope_theta"] == d.config.rope_theta
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(L):
        pre = f"layers.{i}."
        assert sd[pre + "self_attn.q_proj.weight"].shape == (nh * hd, H)
        assert sd[pre + "self_attn.k_proj.weight"].shape == sd[pre + "self_attn.v_proj.weight"].shape == (nkv * hd, H)
        assert sd[pre + "self_attn.q_norm.weight"].shape == sd[pre + "self_attn.k_norm.weight"].shape == (hd,)
        assert sd[pre + "mlp.gate_proj.weight"].shape == sd[pre + "mlp.up_proj.weight"].shape == \
            (cfg.intermediate_size, H)
    assert {"norm.weight", "hidden_norm.weight"} <= set(sd) and not any("embed" in k or "lm_head" in k for k in sd)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16} and cfg.dtype == torch.bfloat16

    # speculators' converter: block_size at the top or in dflash_config, target_layer_ids and vocab_size required;
    # its transformer config is the rest, a Qwen3 config
    assert raw.get("block_size") or dc.get("block_size")
    rest = {k: v for k, v in raw.items()
            if k not in {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}}
    assert Qwen3Config(**rest).num_hidden_layers == L and isinstance(rest["vocab_size"], int)


# ---------------------------------------------------------------------------
# z-lab's Transformers quick start on our export: draft.spec_generate(input_ids=..., target=target, ...)

def greedy_reference(target, input_ids, max_new_tokens, stop=None):
    """transformers' own greedy generate, cut after the first stop token (what spec_generate must return)."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen)


def overfit(drafter, target, ids, prompt_len, steps=200, lr=3e-3):
    """Train the drafter on one sequence (the target's greedy output after prompt_len), every completion position an
    anchor, as training does: the block [ids[p], MASK, ...] at positions p.. sees the target's features before p."""
    cfg, L = drafter.config, len(ids)
    B, V = cfg.block_size, target.config.vocab_size
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[l + 1][0] for l in cfg.target_layer_ids], -1)                     # [L, K*H]
        anchors = torch.arange(prompt_len, L - 1)                                               # [N]
        pos = anchors[:, None] + torch.arange(B)                                                # [N, B]
        block = torch.where(pos == anchors[:, None], ids[anchors][:, None], cfg.mask_token_id)
        emb = target.get_input_embeddings()(block.flatten())                                    # [N*B, H]
        labels, valid = ids[pos.clamp(max=L - 1)][:, 1:], (pos < L)[:, 1:]                     # [N, B-1]
    zeros = torch.zeros(L, dtype=torch.long)
    attn = drafter.attn_spec(anchors, zeros[: len(anchors)], zeros)
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        h = drafter(feats, torch.arange(L), emb, pos.flatten(), attn)                           # [N*B, H]
        logits = target.get_output_embeddings()(h).view(len(anchors), B, V)[:, 1:]             # [N, B-1, V]
        loss = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter


def test_spec_generate_equals_target_greedy(build_drafter, tiny_qwen3_dir, tmp_path):
    """The exported folder's own spec_generate (AutoModel, trust_remote_code) returns exactly the target's greedy
    output, prompt included, for an untrained (bf16) and a trained (fp32) drafter, with and without a stop token;
    the trained one commits several tokens per step, so the accept / crop / commit path runs, not only a=0."""
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    input_ids = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(0))
    N = 40
    want = greedy_reference(target, input_ids, N)
    assert want.shape == (1, 12 + N)
    gen = want[0, 12:].tolist()
    stop = next(t for i, t in enumerate(gen) if i >= 8 and t not in gen[:i])   # first seen at index i >= 8
    want_stop = greedy_reference(target, input_ids, N, stop=[stop])
    assert want_stop.shape[1] == 12 + gen.index(stop) + 1 and want_stop[0, -1] == stop

    untrained = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4)
    trained = overfit(build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4, seed=1), target, want[0], 12)
    for name, d, dtype in [("untrained", untrained, torch.bfloat16), ("trained", trained, torch.float32)]:
        draft = AutoModel.from_pretrained(export_drafter(d, tmp_path / name, dtype=dtype), trust_remote_code=True,
                                          dtype="auto", local_files_only=True).eval()
        got = draft.spec_generate(input_ids=input_ids, max_new_tokens=N, temperature=0.0, target=target,
                                  stop_token_ids=None, return_stats=True)
        assert torch.equal(got.output_ids, want), name
        assert sum(got.acceptance_lengths) == N - 1 and got.num_output_tokens == N   # the first token: the prefill
        tau = N / (len(got.acceptance_lengths) + 1)
        assert (tau > 2.0) if name == "trained" else (tau < 1.5), (name, got.acceptance_lengths)
        out = draft.spec_generate(input_ids=input_ids, max_new_tokens=N, temperature=0.0, target=target,
                                  stop_token_ids=[stop])
        assert torch.equal(out, want_stop), name
        short = draft.spec_generate(input_ids=input_ids, max_new_tokens=7, temperature=0.0, target=target,
                                    stop_token_ids=[stop])
        assert torch.equal(short, want[:, : 12 + 7]), name                   # max_new_tokens caps a step


def test_spec_generate_sampling_is_seeded_and_checks_its_input(build_drafter, tiny_qwen3_dir, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    draft = AutoModel.from_pretrained(export_drafter(build_drafter(tiny_qwen3_dir), tmp_path / "d"),
                                      trust_remote_code=True, dtype="auto", local_files_only=True).eval()
    ids = torch.tensor([[5, 9, 33, 2, 71]])
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(draft.spec_generate(input_ids=ids, max_new_tokens=30, temperature=1.0, target=target,
                                        stop_token_ids=None))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert runs[0].shape == (1, 35) and torch.equal(runs[0][:, :5], ids)
    with pytest.raises(ValueError, match=r"\[1, P\]"):
        draft.spec_generate(input_ids=ids.repeat(2, 1), max_new_tokens=4, temperature=0.0, target=target,
                            stop_token_ids=None)


def test_spec_generate_refuses_bad_arguments_and_a_target_without_the_mask_id(build_drafter, tiny_qwen3_dir,
                                                                              tmp_path):
    """max_new_tokens=0 gives back the prompt; a negative, NaN or infinite temperature and a target whose vocabulary
    lacks the drafter's mask id are ValueErrors that say so, not greedy decoding or an index error."""
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    draft = AutoModel.from_pretrained(export_drafter(build_drafter(tiny_qwen3_dir), tmp_path / "d"),
                                      trust_remote_code=True, dtype="auto", local_files_only=True).eval()
    ids = torch.tensor([[5, 9, 33, 2, 71]])
    assert torch.equal(draft.spec_generate(target=target, input_ids=ids, max_new_tokens=0), ids)
    stats = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=0, return_stats=True)
    assert torch.equal(stats.output_ids, ids) and stats.num_output_tokens == 0 and stats.acceptance_lengths == []
    for bad in (-1, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, temperature=bad)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=-1)
    target.resize_token_embeddings(draft.mask_token_id)   # a target with fewer rows: the mask id is past its end
    with pytest.raises(ValueError, match=f"mask token id {draft.mask_token_id} is outside the target's vocabulary"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4)


# ---------------------------------------------------------------------------
# The model card every export carries

def test_model_card_says_what_serves_it(build_drafter, tiny_qwen3_dir, tmp_path):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=8)
    bare = (export_drafter(d, tmp_path / "bare") / "README.md").read_text()
    assert "not recorded" in bare and "No evaluation ran" in bare and "base_model" not in bare
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / ("a" * 40)
    fp = {"path": str(snapshot), "config_sha256": "c" * 64, "weights_sha256": "w" * 64}
    ev = {"tau": 3.25, "lossless": True, "prompts": 80, "tau_by_category": {"math": 4.5, "chat": 2.0}}
    card = (export_drafter(d, tmp_path / "full", target=snapshot, target_fingerprint=fp, step=1200,
                           data={"rows": 5000, "content_hash": "cafe"}, evaluation=ev) / "README.md").read_text()
    assert card.startswith("---\nbase_model: Qwen/Qwen3-8B\n")          # the Hub's model-card metadata
    cfg = d.config
    for want in ["# DFlash drafter for Qwen/Qwen3-8B", "w" * 64, "| block size | 8 ",
                 f"| tapped target layers | {cfg.target_layer_ids} of 6", f"| mask token id | {cfg.mask_token_id} |",
                 "| draft layers | 2 |", "| training steps | 1200 |", "| data rows | 5000 |",
                 "**3.25** on 80 prompts, lossless",
                 "| math | 4.50 |", "| chat | 2.00 |",
                 "--model-path Qwen/Qwen3-8B", "--speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER",
                 "--speculative-num-draft-tokens 8",
                 """vllm serve Qwen/Qwen3-8B \\\n    --speculative-config '{"method": "dflash", "model": "DRAFTER", """
                 """"num_speculative_tokens": 7}'""",
                 "draft.spec_generate(input_ids=input_ids", "Not run here"]:
        assert want in card, want
    # a local target folder is named as given, with no Hub metadata
    local = (export_drafter(d, tmp_path / "local", target="/models/my-target") / "README.md").read_text()
    assert "base_model" not in local and "--model-path /models/my-target" in local


def test_model_card_hashes_and_target_can_be_checked(build_drafter, tiny_qwen3_dir, tmp_path, monkeypatch):
    """The card's hashes are what `sha256sum config.json` prints (the export's and the target's) and stats.json's
    content_hash; a target given as a relative folder is served by its absolute path, a Hub id as it is."""
    import hashlib
    import shutil
    shutil.copytree(tiny_qwen3_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4)
    fp = {"path": str(tmp_path / "models" / "tiny"), "config_sha256": "c" * 64, "weights_sha256": "w" * 64}
    out = export_drafter(d, tmp_path / "drafter", target="models/tiny", target_fingerprint=fp,
                         data={"rows": 8, "content_hash": "ab" * 32})
    card = (out / "README.md").read_text()
    sha = lambda f: hashlib.sha256(f.read_bytes()).hexdigest()   # noqa: E731  as sha256sum prints it
    assert f"| config.json sha256 | `{sha(out / 'config.json')}`" in card
    assert f"| target config.json sha256 | `{sha(tmp_path / 'models' / 'tiny' / 'config.json')}`" in card
    assert "c" * 64 not in card, "the normalised config hash matches no file: not on the card"
    assert f"| data content_hash | `{'ab' * 32}` (`content_hash` in DATA/stats.json" in card
    absolute = str(tmp_path / "models" / "tiny")
    assert f"--model-path {absolute} " in card and f"vllm serve {absolute} " in card
    assert f'AutoTokenizer.from_pretrained("{absolute}")' in card and '"models/tiny"' not in card
    hub = (export_drafter(d, tmp_path / "hub", target="Qwen/Qwen3-8B") / "README.md").read_text()
    assert "--model-path Qwen/Qwen3-8B " in hub and hub.startswith("---\nbase_model: Qwen/Qwen3-8B\n")


def test_model_card_quick_start_runs(build_drafter, tmp_path):
    """The card's Transformers snippet, run as written (the folders, CPU and a short answer swapped in), gives the
    target's greedy answer: a tiny Qwen3 with the real Qwen3 tokenizer and chat template as the target."""
    import re
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from server import tiny_chat_model
    target_dir = tiny_chat_model(tmp_path / "target")
    out = export_drafter(build_drafter(target_dir, num_layers=1, block_size=4), tmp_path / "drafter",
                         target=target_dir)
    card = (out / "README.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", card, re.S)
    code = code.replace('"DRAFTER"', repr(str(out))).replace('"cuda:0"', '"cpu"').replace("2048", "12")
    ns = {}
    exec(code, ns)
    target, tok = AutoModelForCausalLM.from_pretrained(target_dir).eval(), AutoTokenizer.from_pretrained(target_dir)
    want = target.generate(input_ids=ns["input_ids"], attention_mask=torch.ones_like(ns["input_ids"]),
                           max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=0)
    assert ns["input_ids"].shape[1] > 10 and torch.equal(ns["output"], want)
